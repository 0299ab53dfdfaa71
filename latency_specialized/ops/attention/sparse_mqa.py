"""Sparse MQA decode: the ``attention.sparse_mqa`` family (the whole attention of a DeepSeek-V4.1-style layer
between its projections) and the sync-free glue ops of the sparse MQA piece (``pieces/attention/sparse_mqa.py``):
cache writes by slot, paged gathers, softmax-gated pooling, tail RoPE. Nothing here syncs with the host, so a step
that uses them stays CUDA-graph capturable.

``attention.sparse_mqa`` (``sparse_mqa_decode_reference``; one token per sequence, ``M`` rows, ``H`` local query
heads, one shared K = V head of width ``D`` whose last ``R = 2 len(rope_inv_freq)`` channels are rotated in
interleaved pairs)::

    q  = rms(q) per head (weightless, only with q_norm_eps);  q = rope(q, pos)
    kv = RMSNorm(kv) * kv_norm_weight                                  (only with kv_norm_weight)
    window[rows[m], pos % W] = rope(kv, pos)                           (the ring write, before any read)
    keys = window[rows[m], i] for ring slots i holding one of the last min(S, seq_lens[m]) positions
         + cache[block_table[m, j // bs] * bs + j % bs] for the selection's j with 0 <= j < seq_lens[m] // ratio
    o  = softmax([scale q . keys | sinks[h]]) @ keys                  (the sink logit in the denominator only)
    o  = rope^-1(o, pos)                                               -> [M, H, D] in q.dtype

``W`` is the ring's length, ``S`` the window a row attends to (``sliding_window``, default ``W``): ring slot
``i`` holds position ``seq - 1 - ((seq - 1 - i) mod W)`` for a row of length ``seq``, visible while
``(seq - 1 - i) mod W < min(S, seq)``. A ring longer than the window (``W = S + MAX_SPEC_TOKENS`` in the sparse
MQA piece) lets a verification step's 1 + k rows of one request write positions ``p .. p + k`` without
overwriting what row ``p`` still reads, and keeps rows ``p + 1 ..`` out of row ``p``'s view; rejected rows'
entries are overwritten when their positions come again, before anyone reads them. ``cross_row_reads`` (a
verification step: rows read slots other rows of the call write) asks an implementation to write every row
before any row reads (the reference always does).

``q`` is the raw per-head query (``q_b`` output viewed ``[M, H, D]``) when ``q_norm_eps`` is given (the
piece's weightless per-head RMSNorm fused here), else already normed; ``kv`` the new token's pre-RoPE row:
raw when ``kv_norm_weight`` is given (the piece's kv_norm fused here, ``kv_norm_eps``), else already normed.
``kv`` may have strided rows (a column slice of the fused input projection).
``selection [M, topk]`` int32 positions of compressed rows (``-1``: none; entries ``>= seq_lens // ratio`` are not
complete rows yet and are skipped), None on window-only layers. Rows with nothing visible (padding: seq_lens 0)
give zeros. Roundings of the reference: the normed q, the normed kv (``rmsnorm_reference``), the roped q and
the ring row each rounded to their dtype (as the unfused ops round them), fp32 attention, the attention output
rounded to q.dtype, its inverse RoPE rounded again - exactly what the piece computed before this family existed.

``attention.sparse_mqa_compress`` (``sparse_mqa_compress_reference``): a KV source's compressor after its
projection ``c [M, 2D]`` (ratio r > 1: ``[kv | gate]``) or ``[M, D]`` (r = 1; strided rows ok)::

    pending[rows[m], pos % P] = c                                      (r > 1; P >= r rows, a ring)
    x = sum_t softmax_t(gate_t) * kv_t over positions pos-r+1 .. pos, per channel, oldest first
                                                                       (r > 1; r = 1: x = kv)
    lat = RMSNorm(x) * norm_weight                                     -> returned [M, D], the indexer key's input
    cache[slots[m]] = rope(lat, pos)                                   (slots < 0: the token completes no row)

Every row's pending write comes before any row's pool (a verification step's rows pool what earlier rows of
the same call wrote: ``cross_row_reads``); ``P = r + MAX_SPEC_TOKENS`` in the piece, for the reason the window
ring is longer. Only a token that completes its group (``slots >= 0``) uses the pool: other rows' ``lat`` pool
whatever the ring holds. Roundings as the unfused ops: the pending rows in their dtype, the pool rounded to it and to c's dtype, the norm
rounded, the roped row rounded.

``attention.sparse_mqa_compress_index`` (``sparse_mqa_compress_index_reference``): the compressor of a layer that
also owns the indexer's keys, with the key's own ops behind it - the program calls it instead of the compressor,
the key projection and the indexer's key step (a site that ``fuses`` them, where a kernel serves it)::

    lat = attention.sparse_mqa_compress(...)                           (as above, returned)
    k   = lat @ index_weight^T                                         [M, Dk] rounded to lat's dtype (the gemm's)
    index_cache[slots[m]] = rope_leading(RMSNorm(k) * index_norm_weight, pos)   (interleaved pairs; slots < 0:
                                                                       nothing; the indexer's step 0 for that k)

``attention.sparse`` (contract: ``ops/attention/sparse.py``, ``sparse_decode_reference``): ``q [B, H, D]`` attends
to the rows ``kv[b, topk_idx[b, i]]`` (``-1``: unused) of one shared K = V head, with an optional per-head sink
logit in the softmax denominator. ``sparse_decode_masked`` is that contract with masks instead of the reference's
per-sequence host-side selection: rows with nothing selected give zeros (the reference's answer too, with or
without sinks).
"""

from __future__ import annotations

import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels.mla_common import write_new_latents
from latency_specialized.kernels.ring_window import check_sliding_window
from latency_specialized.kernels.norm_reference import rmsnorm_reference
from latency_specialized.kernels.step_slots_triton import slot_of
from latency_specialized.ops.attention.sparse_mla import index_key_rows
from latency_specialized.ops.registry import Implementation, OpContext, always
from latency_specialized.ops.rope import apply_rope

__all__ = ["IMPLEMENTATIONS", "gather_slots", "group_slots", "pool_softmax", "ring_visible",
           "rope_tail", "slot_of", "sparse_decode_masked", "sparse_mqa_compress_index_reference",
           "sparse_mqa_compress_reference",
           "sparse_mqa_decode_reference", "write_slots"]


def rope_tail(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """``x [M, heads, D]`` with its last ``2 len(inv)`` channels rotated (interleaved pairs) at ``sign * pos``."""
    r = 2 * inv.shape[0]
    return torch.cat([x[..., :-r], apply_rope(x[..., -r:], pos * sign, inv, "interleaved")], dim=-1)


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


def group_slots(positions: torch.Tensor, ratio: int, ring: int) -> torch.Tensor:
    """``[M, ratio]`` pending-ring slots of positions ``pos - ratio + 1 .. pos`` (oldest first; ring of ``ring``
    rows, position p at p % ring)."""
    back = torch.arange(ratio - 1, -1, -1, device=positions.device)
    return torch.remainder(positions.long().unsqueeze(1) - back.unsqueeze(0), ring)


def pool_softmax(values: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Softmax-gated pooling of ``values [B, r, D]`` over the ``r`` rows, per channel, weights ``softmax_r(gates)``
    (fp32 math, values' dtype out)."""
    return (torch.softmax(gates.float(), dim=1) * values.float()).sum(1).to(values.dtype)


def ring_visible(seq_lens: torch.Tensor, ring: int, window: int) -> torch.Tensor:
    """``[M, ring]`` bool: ring slot ``i`` holds one of the last ``min(window, seq)`` positions of a row of length
    ``seq`` (position p at slot p % ring). With ``window == ring`` that is ``i < seq``."""
    seq = seq_lens.long().unsqueeze(1)
    back = torch.remainder(seq - 1 - torch.arange(ring, device=seq.device).unsqueeze(0), ring)
    return back < torch.clamp(seq, max=window)


def check_sparse_mqa_args(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                          seq_lens: torch.Tensor, window: torch.Tensor, cache: torch.Tensor | None,
                          block_table: torch.Tensor | None, selection: torch.Tensor | None,
                          sinks: torch.Tensor | None, rope_inv_freq: torch.Tensor, name: str) -> None:
    """UserError naming the fix where the arguments of an ``attention.sparse_mqa`` call do not fit together."""
    if q.dim() != 3:
        raise UserError(f"{name}: q has shape {tuple(q.shape)}; pass [M, H, D] (the q_b output viewed per head)")
    M, H, D = q.shape
    R = 2 * rope_inv_freq.shape[0]
    if tuple(kv.shape) != (M, D):
        raise UserError(f"{name}: kv has shape {tuple(kv.shape)}, needs [M={M}, D={D}] (the new token's row)")
    if any(t.shape != (M,) for t in (positions, rows, seq_lens)):
        raise UserError(f"{name}: positions / rows / seq_lens need shape [M={M}], got "
                        f"{tuple(positions.shape)} / {tuple(rows.shape)} / {tuple(seq_lens.shape)}")
    if window.dim() != 3 or window.shape[2] != D:
        raise UserError(f"{name}: window has shape {tuple(window.shape)}, needs [rows, W, D={D}]")
    if R <= 0 or R > D:
        raise UserError(f"{name}: {R} rope channels (2 len(rope_inv_freq)) must be in [2, D={D}]")
    if sinks is not None and tuple(sinks.shape) != (H,):
        raise UserError(f"{name}: sinks has shape {tuple(sinks.shape)}, needs [H={H}] (one logit per local head)")
    if (selection is None) != (cache is None) or (selection is not None and block_table is None):
        raise UserError(f"{name}: pass cache, block_table and selection together (compressed layers) or no "
                        "cache and no selection (window-only layers)")
    if selection is not None:
        if selection.dim() != 2 or selection.shape[0] != M or selection.shape[1] < 1:
            raise UserError(f"{name}: selection has shape {tuple(selection.shape)}, needs [M={M}, topk >= 1]")
        if cache.dim() != 3 or cache.shape[2] != D:
            raise UserError(f"{name}: cache has shape {tuple(cache.shape)}, needs paged [blocks, block_size, D={D}]")


def sparse_mqa_decode_reference(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                                seq_lens: torch.Tensor, window: torch.Tensor, cache: torch.Tensor | None,
                                block_table: torch.Tensor | None, selection: torch.Tensor | None,
                                sinks: torch.Tensor | None, rope_inv_freq: torch.Tensor, *, scale: float,
                                compress_ratio: int = 1, q_norm_eps: float | None = None,
                                kv_norm_weight: torch.Tensor | None = None, kv_norm_eps: float = 1e-6,
                                out: torch.Tensor | None = None, sliding_window: int | None = None,
                                cross_row_reads: bool = False, after_selection: bool = False) -> torch.Tensor:
    """Sparse MQA decode over the window ring and the selected compressed rows (module docstring).

    Parameters
    ----------
    q : [M, H, D] raw (``q_norm_eps`` given: normed here, weightless per head) or normed query, pre-RoPE.
    kv : [M, D] the new token's row, pre-RoPE: raw (``kv_norm_weight`` given) or normed; strided rows ok.
    positions, rows, seq_lens : [M] ints (rows: ring rows).
    window : [rows_max, W, D] the ring (position p at p % W), written in place (the new row, roped).
    cache : [blocks, block_size, D] paged compressed rows (roped) or None; block_table : [M, max_blocks] ints;
    selection : [M, topk] ints (-1 none; entries >= seq_lens // compress_ratio skipped) or None.
    sinks : [H] fp32 logits or None. rope_inv_freq : [R/2] fp32. scale : softmax scale.
    kv_norm_weight : optional [D] RMSNorm gain of kv (eps ``kv_norm_eps``). out : optional [M, H, D] destination.
    sliding_window : positions a row sees in the ring (default: the ring's length W; at most W).
    cross_row_reads : rows read ring slots other rows of this call write (verification steps); the reference
        writes every row first anyway.
    after_selection : the launch right before this call on the stream wrote ``selection`` and nothing else the call
        reads (the indexer's last kernel); an implementation may start behind it early. Ignored here.

    Returns
    -------
    [M, H, D] in q.dtype, the inverse RoPE applied. No host sync.
    """
    check_sparse_mqa_args(q, kv, positions, rows, seq_lens, window, cache, block_table, selection, sinks,
                          rope_inv_freq, "attention.sparse_mqa")
    if kv_norm_weight is not None and tuple(kv_norm_weight.shape) != (kv.shape[1],):
        raise UserError(f"attention.sparse_mqa: kv_norm_weight has shape {tuple(kv_norm_weight.shape)}, needs "
                        f"[D={kv.shape[1]}]")
    del cross_row_reads, after_selection  # every row is written before any row reads (index_put_ below)
    M, H, D = q.shape
    W, pos, inv = window.shape[1], positions, rope_inv_freq
    S = check_sliding_window(sliding_window, W, "attention.sparse_mqa")
    seq, rws = seq_lens.long(), rows.long()
    if q_norm_eps is not None:
        q = rmsnorm_reference(q.reshape(M * H, D), None, q_norm_eps).view(M, H, D)
    if kv_norm_weight is not None:
        kv = rmsnorm_reference(kv, kv_norm_weight, kv_norm_eps)
    q = rope_tail(q, pos, inv)
    window.index_put_((rws, pos % W), rope_tail(kv.unsqueeze(1), pos, inv).squeeze(1).to(window.dtype))
    keys = window.index_select(0, rws)                                                 # [M, W, D]
    valid = ring_visible(seq, W, S)                                                   # [M, W]
    if selection is not None:
        comp = gather_slots(cache, block_table, selection)                              # [M, topk, D]
        keys = torch.cat([keys, comp.to(keys.dtype)], dim=1)
        seq_c = seq // compress_ratio                                                   # complete compressed rows
        valid = torch.cat([valid, (selection >= 0) & (selection.long() < seq_c.unsqueeze(1))], dim=1)
    idx = torch.where(valid, torch.arange(keys.shape[1], device=q.device).unsqueeze(0), -1)
    o = sparse_decode_masked(q, keys, idx, scale=scale, v_dim=D, sinks=sinks)
    o = rope_tail(o, pos, inv, sign=-1.0)
    if out is not None:
        out.copy_(o)
        return out
    return o


def sparse_mqa_compress_reference(c: torch.Tensor, pending: torch.Tensor | None, rows: torch.Tensor,
                                  positions: torch.Tensor, norm_weight: torch.Tensor, rope_inv_freq: torch.Tensor,
                                  cache: torch.Tensor, slots: torch.Tensor, *, eps: float, ratio: int,
                                  out: torch.Tensor | None = None, cross_row_reads: bool = False) -> torch.Tensor:
    """A KV source's compressor (module docstring, ``attention.sparse_mqa_compress``).

    Parameters
    ----------
    c : [M, 2D] ``[kv | gate]`` (ratio > 1) or [M, D] (ratio 1), the compressor projection of the token.
    pending : [rows_max, P, 2D] (P >= ratio) the ring of the groups' rows so far (position p at p % P), written
        in place (None where ratio is 1).
    rows, positions : [M] ints (state rows, token positions). norm_weight : [D]; rope_inv_freq : [R/2] fp32.
    cache : [blocks, block_size, D] paged compressed rows, written at ``slots [M]`` (< 0: nothing).
    eps : the norm's epsilon; ratio : tokens per compressed row. out : optional [M, D] for ``lat``.
    cross_row_reads : rows pool pending rows other rows of this call write (verification steps); the reference
        writes every row first anyway.

    Returns
    -------
    lat [M, D] in c.dtype: the normed pooled row before RoPE. No host sync.
    """
    del cross_row_reads  # every row's pending write precedes every pool (index_put_ below)
    D = cache.shape[-1]
    if c.dim() != 2 or c.shape[1] != (2 * D if ratio > 1 else D) or (ratio > 1) != (pending is not None):
        raise UserError(f"attention.sparse_mqa_compress: c {tuple(c.shape)} / pending "
                        f"{None if pending is None else tuple(pending.shape)} do not fit ratio {ratio} and D {D}: "
                        "pass [M, 2D] with the pending rows for ratio > 1, [M, D] and no pending rows for ratio 1")
    if pending is not None and (pending.dim() != 3 or pending.shape[1] < ratio or pending.shape[2] != 2 * D):
        raise UserError(f"attention.sparse_mqa_compress: pending has shape {tuple(pending.shape)}, needs a ring "
                        f"[rows, P >= {ratio}, {2 * D}]")
    x = c
    if ratio > 1:
        rws, P = rows.long(), pending.shape[1]
        pending.index_put_((rws, positions.long() % P), c.to(pending.dtype))
        ring = group_slots(positions, ratio, P)                                          # [M, r], oldest first
        group = pending[rws.unsqueeze(1), ring]                                          # [M, r, 2D]
        x = pool_softmax(group[..., :D], group[..., D:]).to(c.dtype)
    lat = rmsnorm_reference(x, norm_weight, eps)
    write_slots(cache, rope_tail(lat.unsqueeze(1), positions, rope_inv_freq).squeeze(1), slots)
    if out is not None:
        out.copy_(lat)
        return out
    return lat


def sparse_mqa_compress_index_reference(c: torch.Tensor, pending: torch.Tensor | None, rows: torch.Tensor,
                                        positions: torch.Tensor, norm_weight: torch.Tensor,
                                        rope_inv_freq: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                                        index_weight: torch.Tensor, index_norm_weight: torch.Tensor,
                                        index_cache: torch.Tensor, *, eps: float, ratio: int, index_eps: float,
                                        out: torch.Tensor | None = None,
                                        cross_row_reads: bool = False) -> torch.Tensor:
    """The compressor and the indexer's new key (module docstring, ``attention.sparse_mqa_compress_index``).

    Parameters
    ----------
    c ... slots, eps, ratio, out, cross_row_reads : as ``sparse_mqa_compress_reference``.
    index_weight : [Dk, D] the key projection (plain tensor). index_norm_weight : [Dk] its RMSNorm gain,
        index_eps its epsilon. index_cache : [blocks, block_size, Dk] the paged key cache, written at ``slots``.

    Returns
    -------
    lat [M, D] in c.dtype, as the compressor returns it. No host sync.
    """
    D = cache.shape[-1]
    if index_weight.dim() != 2 or index_weight.shape[1] != D or index_cache.shape[-1] != index_weight.shape[0] \
            or tuple(index_norm_weight.shape) != (index_weight.shape[0],):
        raise UserError(f"attention.sparse_mqa_compress_index: index_weight {tuple(index_weight.shape)}, "
                        f"index_norm_weight {tuple(index_norm_weight.shape)} and index_cache "
                        f"{tuple(index_cache.shape)} must be [Dk, D={D}], [Dk] and [blocks, block_size, Dk]")
    lat = sparse_mqa_compress_reference(c, pending, rows, positions, norm_weight, rope_inv_freq, cache, slots,
                                        eps=eps, ratio=ratio, out=out, cross_row_reads=cross_row_reads)
    k = (lat.float() @ index_weight.float().t()).to(lat.dtype)
    kf = index_key_rows(k, positions, rope_inv_freq, True, index_norm_weight, None, index_eps, "rms")
    write_slots(index_cache, kf.to(index_cache.dtype), slots)
    return lat


def _masked_supports(ctx: OpContext) -> bool | str:
    if not ctx.arch.startswith("sm_"):
        return "for CUDA-graph capture on GPUs; on the CPU the reference serves sparse attention"
    return True


def _torch_supports(ctx: OpContext) -> bool | str:
    if not ctx.arch.startswith("sm_"):
        return "the reference's math as a GPU fallback; on the CPU the reference serves sparse MQA"
    return True


IMPLEMENTATIONS = [
    Implementation("attention.sparse", "attention.sparse.torch_masked", sparse_decode_masked, _masked_supports,
                   priority=-50, description="gathered top-k rows, masked softmax with sinks: no host sync; GPUs only"),
    Implementation("attention.sparse_mqa", "attention.sparse_mqa.reference", sparse_mqa_decode_reference, always,
                   priority=-100, is_reference=True, strided_rows=True,
                   description="torch: head norm, kv norm, RoPE, ring write, gathered window + selected rows, "
                               "masked softmax with sinks, inverse RoPE (no host sync)"),
    Implementation("attention.sparse_mqa", "attention.sparse_mqa.torch", sparse_mqa_decode_reference, _torch_supports,
                   priority=-50, strided_rows=True,
                   description="the reference's torch composition (~20 kernels, no host sync) where no fused kernel "
                               "serves; GPUs only"),
    Implementation("attention.sparse_mqa_compress", "attention.sparse_mqa_compress.reference",
                   sparse_mqa_compress_reference, always, priority=-100, is_reference=True, strided_rows=True,
                   description="torch: pending write, softmax-gated pool, RMSNorm, RoPE, compressed-cache write"),
    Implementation("attention.sparse_mqa_compress", "attention.sparse_mqa_compress.torch",
                   sparse_mqa_compress_reference, _torch_supports, priority=-50, strided_rows=True,
                   description="the reference's torch composition (no host sync) where no fused kernel serves; "
                               "GPUs only"),
    Implementation("attention.sparse_mqa_compress_index", "attention.sparse_mqa_compress_index.reference",
                   sparse_mqa_compress_index_reference, always, priority=-100, is_reference=True, strided_rows=True,
                   description="torch: the compressor's reference, the key projection, RMSNorm, leading RoPE, "
                               "index-key cache write"),
]
