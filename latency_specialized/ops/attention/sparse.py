"""attention.sparse: top-k index attention (DSA-style): each query attends to selected tokens only."""

from __future__ import annotations

import torch

from latency_specialized.ops.registry import Implementation, always


def sparse_decode_reference(q: torch.Tensor, kv: torch.Tensor, topk_idx: torch.Tensor, *, scale: float,
                            v_dim: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over gathered tokens with one shared KV head (MQA / absorbed MLA form).

    Parameters
    ----------
    q : [B, H, D]; kv : [B, T, D] per-sequence keys (values are the first ``v_dim`` columns).
    topk_idx : [B, k] token indices into T, -1 for unused slots.

    Returns
    -------
    [B, H, v_dim] in q.dtype.
    """
    v_dim = v_dim or kv.shape[-1]
    B, H, _ = q.shape
    out = torch.zeros(B, H, v_dim, dtype=q.dtype, device=q.device)
    for b in range(B):
        idx = topk_idx[b][topk_idx[b] >= 0].long()
        k = kv[b, idx].float()
        s = q[b].float() @ k.t() * scale
        if sinks is not None:
            s = torch.cat([s, sinks.float().unsqueeze(-1)], dim=-1)
            p = torch.softmax(s, -1)[:, :-1]
        else:
            p = torch.softmax(s, -1)
        out[b] = (p @ k[:, :v_dim]).to(q.dtype)
    return out


IMPLEMENTATIONS = [
    Implementation("attention.sparse", "attention.sparse.reference", sparse_decode_reference, always,
                   priority=-100, is_reference=True, description="gather + torch softmax"),
]
