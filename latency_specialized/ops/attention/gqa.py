"""attention.gqa: grouped-query decode attention over a paged KV cache (optional sliding window).

Calling convention (one decode token per sequence)::

    o = gqa_decode(q, k_cache, v_cache, block_table, seq_lens, scale=, window=, sinks=,
                   k=k, v=v, slot_mapping=slots)

With ``k``, ``v`` and ``slot_mapping`` (the KV-write convention, used by ``pieces.attention.gqa``),
the new token's key and value are first written into the caches at ``slot_mapping[b]``
(``block * block_size + offset``; a negative slot writes nothing: batch padding), then attended
together with the cached history - as ``attention.mla`` writes its latent. Without them the caches
must already hold the current token (the original convention, still accepted).
Rows with ``seq_lens == 0`` are padding: they return zeros.
"""

from __future__ import annotations

import math

import torch

from latency_specialized.ops.registry import Implementation, always


def _check_write(k_cache: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                 slot_mapping: torch.Tensor | None) -> bool:
    given = [x is not None for x in (k, v, slot_mapping)]
    if any(given) and not all(given):
        raise ValueError("attention.gqa: k, v and slot_mapping come together (the new token's KV write)")
    if all(given) and tuple(k.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(f"attention.gqa: k of shape {tuple(k.shape)} does not fit the cache "
                         f"[blocks, block_size, {', '.join(map(str, k_cache.shape[2:]))}]")
    return all(given)


def write_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """``cache[slot] = new`` for slots >= 0 (boolean-mask indexing: reads the mask on the host)."""
    slots = slot_mapping.long()
    live = slots >= 0
    for cache, new in ((k_cache, k), (v_cache, v)):
        flat = cache.view(-1, *cache.shape[2:])  # raises on a cache that is not one flat slot array
        flat[slots[live]] = new[live].to(cache.dtype)


def write_kv_paged(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """``write_kv_reference`` without a host sync (CUDA-graph capturable).

    Every padding row (slot < 0) is pointed at the first live row's slot *with that row's value*:
    duplicate indices of one ``index_put_`` then carry identical values, so the result is
    deterministic. With no live row at all, every row rewrites slot 0 with its current value."""
    slots = slot_mapping.long()
    live = slots >= 0
    first = torch.argmax(live.to(torch.int32)).view(1)   # index_select, not t[first]: no host read
    any_live = live.any()
    target = torch.where(live, slots, slots.index_select(0, first).clamp(min=0))
    for cache, new in ((k_cache, k), (v_cache, v)):
        flat = cache.view(-1, *cache.shape[2:])
        new = new.to(cache.dtype)
        filler = torch.where(any_live, new.index_select(0, first)[0], flat[0])
        mask = live.view(-1, *([1] * (new.dim() - 1)))
        flat.index_put_((target,), torch.where(mask, new, filler))


def gqa_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, *, scale: float | None = None, window: int | None = None,
                         sinks: torch.Tensor | None = None, k: torch.Tensor | None = None,
                         v: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                         out: torch.Tensor | None = None, cross_row_reads: bool = False) -> torch.Tensor:
    """One decode token per sequence.

    Parameters
    ----------
    q : [B, H, D] queries (already position-encoded / normed).
    k_cache, v_cache : [num_blocks, block_size, KV, D] paged caches (written in place with ``k``/``v``).
    block_table : [B, max_blocks] int; seq_lens : [B] int, tokens in the cache per sequence, the new
        one included (0: padding row).
    window : attend to the last ``window`` tokens only (the new one included). sinks : [H] per-head
        sink logits (added to the softmax denominator, attended by nothing) or None.
    k, v : optional [B, KV, D] the new token's key and value (may be strided views), written at
    slot_mapping : [B] int flat slots (< 0: no write) before attending.
    out : optional [B, H, D] destination.
    cross_row_reads : True where a row may read a slot another row of the same call writes (a
        verification step: the 1 + k rows of a request share its blocks). Every row is written before any
        row reads here anyway; an implementation that fuses the write into the reads must not then.

    Returns
    -------
    [B, H, D] in q.dtype; fp32 math, one rounding. The reference loops over sequences and reads
    ``seq_lens`` on the host (a sync): GPU steps are served by ``attention.gqa.torch_paged``.
    """
    if _check_write(k_cache, k, v, slot_mapping):
        write_kv_reference(k_cache, v_cache, k, v, slot_mapping)
    B, H, D = q.shape
    kv_heads = k_cache.shape[2]
    block = k_cache.shape[1]
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    o = torch.zeros(B, H, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(seq_lens[b])
        if n <= 0:
            continue
        start = max(0, n - window) if window else 0
        pos = torch.arange(start, n, device=q.device)
        blocks = block_table[b, pos // block].long()
        kk = k_cache[blocks, pos % block].float()  # [n, KV, D]
        vv = v_cache[blocks, pos % block].float()
        kk = kk.repeat_interleave(H // kv_heads, dim=1)
        vv = vv.repeat_interleave(H // kv_heads, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), kk) * scale
        if sinks is not None:
            s = torch.cat([s, sinks.float().unsqueeze(-1)], dim=-1)
            p = torch.softmax(s, dim=-1)[:, :-1]
        else:
            p = torch.softmax(s, dim=-1)
        o[b] = torch.einsum("hn,nhd->hd", p, vv)
    y = o.to(q.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


def gqa_decode_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, *, scale: float | None = None, window: int | None = None,
                     sinks: torch.Tensor | None = None, k: torch.Tensor | None = None,
                     v: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, cross_row_reads: bool = False) -> torch.Tensor:
    """The reference's contract (same arguments and result) with no host sync: CUDA-graph capturable.

    Every sequence attends over all ``block_table.shape[1] * block_size`` positions of its block
    table with positions outside ``[seq_lens - window, seq_lens)`` masked out, so the work is
    O(max context) per step whatever the live lengths: a composition for capturing a whole decode
    step into one graph, not a fast kernel. fp32 math, one rounding, like the reference.
    """
    if _check_write(k_cache, k, v, slot_mapping):
        write_kv_paged(k_cache, v_cache, k, v, slot_mapping)
    B, H, D = q.shape
    kv_heads, block = k_cache.shape[2], k_cache.shape[1]
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    n_max = block_table.shape[1] * block
    pos = torch.arange(n_max, device=q.device)
    rows = block_table[:, pos // block].long().clamp(min=0) * block + pos % block          # [B, n_max]
    n = seq_lens.long().unsqueeze(1)
    valid = pos.unsqueeze(0) < n
    if window:
        valid &= pos.unsqueeze(0) >= n - window
    kf = k_cache.view(-1, kv_heads, D)[rows].float()                                       # [B, n_max, KV, D]
    vf = v_cache.view(-1, kv_heads, D)[rows].float()
    kf = torch.where(valid[..., None, None], kf, 0.0)   # positions past the end may hold NaN: no leak
    vf = torch.where(valid[..., None, None], vf, 0.0)
    g = H // kv_heads
    s = torch.einsum("bkgd,btkd->bkgt", q.float().view(B, kv_heads, g, D), kf) * scale    # [B, KV, g, n_max]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, kv_heads, g, 1).expand(B, kv_heads, g, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    p = torch.where(valid.any(-1).view(B, 1, 1, 1), p, 0.0)   # padding rows: no valid position, output 0
    y = torch.einsum("bkgt,btkd->bkgd", p, vf).reshape(B, H, D).to(q.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


def _paged_supports(ctx) -> bool | str:
    if not ctx.arch.startswith("sm_"):
        return ("for CUDA-graph capture on GPUs; on the CPU the reference serves GQA (it reads only the live "
                "context, this one the whole block table)")
    return True


IMPLEMENTATIONS = [
    Implementation("attention.gqa", "attention.gqa.reference", gqa_decode_reference, always, priority=-100,
                   is_reference=True, description="per-sequence torch softmax attention (+ KV write)"),
    Implementation("attention.gqa", "attention.gqa.torch_paged", gqa_decode_paged, _paged_supports, priority=-50,
                   description="torch attention masked over the whole block table: no host sync (graph-"
                               "capturable), O(max context) per step; GPUs only"),
]
