"""Sparse MQA decode helpers: a sync-free ``attention.sparse`` implementation and the glue ops of the sparse MQA
piece (``pieces/attention/sparse_mqa.py``) - cache writes by slot and softmax-gated pooling - all without a host
sync, so a step that uses them stays CUDA-graph capturable.

``attention.sparse`` (contract: ``ops/attention/sparse.py``, ``sparse_decode_reference``): ``q [B, H, D]`` attends
to the rows ``kv[b, topk_idx[b, i]]`` (``-1``: unused) of one shared K = V head, with an optional per-head sink
logit in the softmax denominator. ``sparse_decode_masked`` is that contract with masks instead of the reference's
per-sequence host-side selection: rows with nothing selected give zeros (the reference's answer too, with or
without sinks).
"""

from __future__ import annotations

import torch

from latency_specialized.kernels.mla_common import write_new_latents
from latency_specialized.ops.registry import Implementation, OpContext

__all__ = ["IMPLEMENTATIONS", "gather_slots", "pool_softmax", "slot_of", "sparse_decode_masked", "write_slots"]


def sparse_decode_masked(q: torch.Tensor, kv: torch.Tensor, topk_idx: torch.Tensor, *, scale: float,
                         v_dim: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``attention.sparse`` without a host sync: ``q [B, H, D]``, ``kv [B, T, D]``, ``topk_idx [B, k]`` (-1: unused),
    ``sinks [H]`` (fp32 logits, optional). Returns ``[B, H, v_dim]`` in q.dtype (fp32 math, one rounding)."""
    v_dim = v_dim or kv.shape[-1]
    idx = topk_idx.long()
    valid = idx >= 0
    rows = kv.float().gather(1, idx.clamp(min=0).unsqueeze(-1).expand(-1, -1, kv.shape[-1]))     # [B, k, D]
    s = torch.einsum("bhd,bkd->bhk", q.float(), rows) * scale
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float().view(1, -1, 1).expand(s.shape[0], -1, 1)], dim=-1)
    else:   # a zero-valued stand-in column that never wins: rows with nothing selected stay finite
        s = torch.cat([s, torch.full_like(s[..., :1], -1e30)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1]
    out = torch.einsum("bhk,bkd->bhd", p, rows[..., :v_dim])
    return torch.where(valid.any(-1).view(-1, 1, 1), out, 0.0).to(q.dtype)


def slot_of(block_table: torch.Tensor, index: torch.Tensor, block_size: int, live: torch.Tensor) -> torch.Tensor:
    """Flat paged-cache slot of entry ``index [B]`` of each sequence's block table (``-1`` where not ``live``)."""
    idx = index.long().clamp(min=0)
    col = (idx // block_size).clamp(max=block_table.shape[1] - 1)
    blk = block_table.long().gather(1, col.unsqueeze(1)).squeeze(1)
    return torch.where(live, blk * block_size + idx % block_size, -1)


def write_slots(cache: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """``cache`` (paged ``[blocks, block_size, D]``) at flat ``slots [B]`` <- ``values [B, D]``; slot < 0 writes
    nothing. No host sync (``kernels.mla_common.write_new_latents``)."""
    write_new_latents(cache.view(-1, cache.shape[-1]), values.to(cache.dtype), slots)


def gather_slots(cache: torch.Tensor, block_table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Entries ``index [B, k]`` (per-sequence positions, -1: none - read as entry 0) of the paged ``cache``
    ``[blocks, block_size, D]`` through ``block_table``: ``[B, k, D]``."""
    bs, idx = cache.shape[1], index.long().clamp(min=0)
    blk = block_table.long().gather(1, (idx // bs).clamp(max=block_table.shape[1] - 1))
    return cache.view(-1, cache.shape[-1])[blk * bs + idx % bs]


def pool_softmax(values: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Softmax-gated pooling of ``values [B, r, D]`` over the ``r`` rows, per channel, weights ``softmax_r(gates)``
    (fp32 math, values' dtype out)."""
    return (torch.softmax(gates.float(), dim=1) * values.float()).sum(1).to(values.dtype)


def _masked_supports(ctx: OpContext) -> bool | str:
    if not ctx.arch.startswith("sm_"):
        return "for CUDA-graph capture on GPUs; on the CPU the reference serves sparse attention"
    return True


IMPLEMENTATIONS = [
    Implementation("attention.sparse", "attention.sparse.torch_masked", sparse_decode_masked, _masked_supports,
                   priority=-50, description="gathered top-k rows, masked softmax with sinks: no host sync; GPUs only"),
]
