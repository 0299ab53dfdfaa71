"""attention.gqa: grouped-query decode attention over a paged KV cache (optional sliding window)."""

from __future__ import annotations

import math

import torch

from latency_specialized.ops.registry import Implementation, always


def gqa_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, *, scale: float | None = None, window: int | None = None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One decode token per sequence.

    Parameters
    ----------
    q : [B, H, D] queries (already position-encoded / normed).
    k_cache, v_cache : [num_blocks, block_size, KV, D] paged caches holding the current token too.
    block_table : [B, max_blocks] int; seq_lens : [B] int, tokens in the cache per sequence.
    window : attend to the last ``window`` tokens only. sinks : [H] per-head sink logits or None.

    Returns
    -------
    [B, H, D] in q.dtype.
    """
    B, H, D = q.shape
    kv_heads = k_cache.shape[2]
    block = k_cache.shape[1]
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    out = torch.empty_like(q)
    for b in range(B):
        n = int(seq_lens[b])
        start = max(0, n - window) if window else 0
        pos = torch.arange(start, n, device=q.device)
        blocks = block_table[b, pos // block].long()
        k = k_cache[blocks, pos % block].float()  # [n, KV, D]
        v = v_cache[blocks, pos % block].float()
        k = k.repeat_interleave(H // kv_heads, dim=1)
        v = v.repeat_interleave(H // kv_heads, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        if sinks is not None:
            s = torch.cat([s, sinks.float().unsqueeze(-1)], dim=-1)
            p = torch.softmax(s, dim=-1)[:, :-1]
        else:
            p = torch.softmax(s, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", p, v).to(q.dtype)
    return out


IMPLEMENTATIONS = [
    Implementation("attention.gqa", "attention.gqa.reference", gqa_decode_reference, always, priority=-100,
                   is_reference=True, description="per-sequence torch softmax attention"),
]
