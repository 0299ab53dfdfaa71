"""Stock stand-in kernels (Triton) of a DeepSeek-V4.1 decode layer (sparse MQA over a sliding window + compressed
KV, mHC residual, sqrtsoftplus MoE routing), written the way stock vLLM 0.33 writes them on Hopper
(``vllm/models/deepseek_v41/attention.py``, ``nvidia/flashmla.py``, ``nvidia/ops/mhc.py``,
``model_executor/kernels/mhc/tilelang.py``), one kernel where stock has one:

* ``mhc_post_mix`` - stand-in for the tilelang ``_MHC_FUSED_TILELANG_KERNEL`` (the previous sublayer's post
  ``R'_j = sum_i comb[i, j] R_i + post_j y`` written in place, folded into the pre-norm projection: per split of
  the channels the partial ``R' . fn`` rows and sum of squares);
* ``mhc_pre_norm`` - stand-in for ``MHC_PRE_NORM_KERNEL``: the splits summed, pre / post sigmoids, Sinkhorn comb,
  the collapse with the carried pre-mix, the sublayer's input RMSNorm;
* ``q_kv_rmsnorm`` - ``fused_q_kv_rmsnorm`` (q-lora and kv RMSNorms of the fused wq_a | wkv output);
* ``qnorm_rope_kv_insert`` - ``fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert`` (per-head
  weightless q RMSNorm + RoPE of the tail channels; kv RoPE + the sliding-window cache write);
* ``compress_insert`` - the compressor (``fused_compress_quant_cache``): the token's ``[kv | gate]`` into the
  pending rows, the softmax-gated pool of a completed group, its RMSNorm, RoPE and compressed-cache write;
* ``index_key_store`` - ``indexer_k_store``: the indexer key's RMSNorm + RoPE + fp8 (ue8m0) cache write;
* ``sqrtsoftplus_topk`` - ``fused_topk_bias`` with sqrtsoftplus scores (top-k of score + bias, renormalised, scaled);
* ``sparse_mqa_decode`` - FlashMLA's sparse decode (``flash_mla_with_kvcache`` with SWA indices + extra compressed
  indices and attention sinks; split + combine, 2 kernels), the output's inverse RoPE folded into the combine
  (stock: a kernel of ``dsv41_o_proj``), written in the output groups' layout for the grouped wo_a.

The indexer's query RoPE + fp8, its logits, the top-k and the top-k -> rows conversion are ``dsa_kernels``'.
``*_reference`` functions are the torch oracles (same roundings). ``tl.dot`` in fp32 under the Triton interpreter
(its bf16 dot is wrong). bf16 caches (stock: fp8 records); the roofline counts bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from latency_specialized.bench.stock.dsa_kernels import FP8_MAX, interpreting, partner, rope_vec, ue8m0_quantize

__all__ = ["compress_insert", "compress_insert_reference", "index_key_store", "index_key_store_reference",
           "mhc_post_mix", "mhc_pre_norm", "mhc_seam_reference", "q_kv_rmsnorm", "q_kv_rmsnorm_reference",
           "qnorm_rope_kv_insert", "qnorm_rope_kv_insert_reference", "rope_tail_reference", "sparse_mqa_decode",
           "sparse_mqa_decode_reference", "sqrtsoftplus_topk", "sqrtsoftplus_topk_reference"]

MHC_CHUNK = 32
"""Channels of one stream per program of ``mhc_post_mix`` (its splits: hidden / MHC_CHUNK)."""
MHC_TOKENS = 8
"""Tokens per program of ``mhc_post_mix`` (the fn chunk is read once per program)."""
SPLIT_ROWS = 32
"""KV rows per program of ``sparse_mqa_decode``'s split kernel."""


@triton.jit
def _sig(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tail_rope(x, xp, d, pos, inv_ptr, D: tl.constexpr, R: tl.constexpr, SIGN: tl.constexpr):
    """RoPE (interleaved pairs) of the last ``R`` of ``D`` channels at ``SIGN * pos``; ``xp`` = x at ``d ^ 1``."""
    t = d - (D - R)
    rot = t >= 0
    inv = tl.load(inv_ptr + tl.maximum(t, 0) // 2, mask=rot, other=0.0)
    ang = SIGN * pos.to(tl.float32) * inv
    sign = tl.where(t % 2 == 0, -1.0, 1.0)
    return tl.where(rot, x * tl.cos(ang) + sign * xp * tl.sin(ang), x)


@triton.jit
def _tail_partner(d, D: tl.constexpr, R: tl.constexpr):
    return tl.where(d >= D - R, d ^ 1, d)


@triton.jit
def _slot_c(bt_ptr, s_bt, m, seq, RATIO: tl.constexpr, BS_C: tl.constexpr):
    """Flat compressed-cache slot of the row this token completes (-1: it completes none)."""
    done = (seq % RATIO == 0) & (seq > 0)
    j = tl.maximum(seq // RATIO - 1, 0)
    blk = tl.load(bt_ptr + m * s_bt + j // BS_C).to(tl.int64)
    return tl.where(done, blk * BS_C + j % BS_C, -1)


# ------------------------------------------------------------------------------------------ mHC seam
@triton.jit
def _mhc_post_mix_kernel(st_ptr, y_ptr, post_ptr, comb_ptr, fn_ptr, mix_ptr, sq_ptr, M, H,
                         N: tl.constexpr, X: tl.constexpr, BX: tl.constexpr, CH: tl.constexpr, TM: tl.constexpr):
    c = tl.program_id(0)
    m0 = tl.program_id(1) * TM
    h = c * CH + tl.arange(0, CH)
    hm = h < H
    i = tl.arange(0, N)
    x = tl.arange(0, BX)
    fn = tl.load(fn_ptr + x[:, None, None] * (N * H) + i[None, :, None] * H + h[None, None, :],
                 mask=(x < X)[:, None, None] & hm[None, None, :], other=0.0)            # [BX, N, CH] fp32
    for mm in range(0, TM):
        m = (m0 + mm).to(tl.int64)
        if m < M:
            base = st_ptr + m * N * H + i[:, None] * H + h[None, :]
            r = tl.load(base, mask=hm[None, :], other=0.0).to(tl.float32)                # [N(i), CH]
            cmb = tl.load(comb_ptr + m * N * N + i[:, None] * N + i[None, :])            # [N(i), N(j)]
            rn = tl.sum(cmb[:, :, None] * r[:, None, :], axis=0)                         # [N(j), CH]
            yv = tl.load(y_ptr + m * H + h, mask=hm, other=0.0).to(tl.float32)
            rn = rn + tl.load(post_ptr + m * N + i)[:, None] * yv[None, :]
            rb = rn.to(st_ptr.dtype.element_ty)
            tl.store(base, rb, mask=hm[None, :])
            rf = rb.to(tl.float32)
            part = tl.sum(tl.sum(fn * rf[None, :, :], axis=2), axis=1)                  # [BX]
            tl.store(mix_ptr + (c * M + m) * BX + x, part)
            tl.store(sq_ptr + c * M + m, tl.sum(tl.sum(rf * rf, axis=1), axis=0))


def mhc_post_mix(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                 *, mix: torch.Tensor, sqrsum: torch.Tensor) -> None:
    """``streams`` [M, n, H] bf16 updated in place by the post (``y`` [M, H], ``post`` [M, n], ``comb`` [M, n, n]
    fp32); ``mix`` [S, M, BX] / ``sqrsum`` [S, M] fp32 (S = cdiv(H, MHC_CHUNK), BX = next_pow2(rows of fn)) get the
    per-split projection ``R' . fn^T`` and sum of squares. One launch."""
    M, n, H = streams.shape
    S, BX = triton.cdiv(H, MHC_CHUNK), mix.shape[2]
    _mhc_post_mix_kernel[(S, triton.cdiv(M, MHC_TOKENS))](streams, y, post, comb, fn, mix, sqrsum, M, H, N=n,
                                                         X=fn.shape[0], BX=BX, CH=MHC_CHUNK, TM=MHC_TOKENS,
                                                         num_warps=4)


@triton.jit
def _mhc_pre_norm_kernel(mix_ptr, sq_ptr, scale_ptr, base_ptr, st_ptr, pre_in_ptr, pre_ptr, post_ptr, comb_ptr, w_ptr,
                         out_ptr, M, H, S, rms_eps, hc_eps, post_mult, norm_eps, iters,
                         N: tl.constexpr, BX: tl.constexpr, BS: tl.constexpr, BH: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BS)
    sm = s < S
    i = tl.arange(0, N)
    row = (s * M + m) * BX
    rs = tl.rsqrt(tl.sum(tl.load(sq_ptr + s * M + m, mask=sm, other=0.0), 0) / (N * H) + rms_eps)
    pre_l = tl.sum(tl.load(mix_ptr + row[:, None] + i[None, :], mask=sm[:, None], other=0.0), 0) * rs
    post_l = tl.sum(tl.load(mix_ptr + row[:, None] + N + i[None, :], mask=sm[:, None], other=0.0), 0) * rs
    cij = i[:, None] * N + i[None, :]
    comb_l = tl.sum(tl.load(mix_ptr + row[:, None, None] + 2 * N + cij[None, :, :], mask=sm[:, None, None],
                            other=0.0), 0) * rs
    pin = tl.load(pre_in_ptr + m * N + i)
    pre = _sig(pre_l * tl.load(scale_ptr) + tl.load(base_ptr + i)) + hc_eps
    post = _sig(post_l * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + i)) * post_mult
    z = comb_l * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + cij)
    e = tl.exp(z - tl.max(z, 1)[:, None])
    cm = e / tl.sum(e, 1)[:, None] + hc_eps
    cm = cm / (tl.sum(cm, 0)[None, :] + hc_eps)
    for _ in range(iters - 1):
        cm = cm / (tl.sum(cm, 1)[:, None] + hc_eps)
        cm = cm / (tl.sum(cm, 0)[None, :] + hc_eps)
    tl.store(pre_ptr + m * N + i, pre)
    tl.store(post_ptr + m * N + i, post)
    tl.store(comb_ptr + m * N * N + cij, cm)
    acc = tl.zeros([BH], dtype=tl.float32)
    for h0 in range(0, H, BH):
        hh = h0 + tl.arange(0, BH)
        r = tl.load(st_ptr + m * N * H + i[:, None] * H + hh[None, :], mask=(hh < H)[None, :], other=0.0)
        hv = tl.sum(pin[:, None] * r.to(tl.float32), 0).to(st_ptr.dtype.element_ty).to(tl.float32)
        acc += hv * hv
    rstd = tl.rsqrt(tl.sum(acc, 0) / H + norm_eps)
    for h0 in range(0, H, BH):
        hh = h0 + tl.arange(0, BH)
        hm = hh < H
        r = tl.load(st_ptr + m * N * H + i[:, None] * H + hh[None, :], mask=hm[None, :], other=0.0)
        hv = tl.sum(pin[:, None] * r.to(tl.float32), 0).to(st_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + hh, mask=hm, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * H + hh, (hv * rstd * w).to(out_ptr.dtype.element_ty), mask=hm)


def mhc_pre_norm(mix: torch.Tensor, sqrsum: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                 streams: torch.Tensor, pre_in: torch.Tensor, norm_weight: torch.Tensor, *, rms_eps: float,
                 hc_eps: float, post_mult: float, norm_eps: float, iters: int, pre: torch.Tensor, post: torch.Tensor,
                 comb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The seam's coefficients (``pre`` [M, n], ``post`` [M, n], ``comb`` [M, n, n] fp32, written) from
    :func:`mhc_post_mix`'s partials, and ``out`` [M, H] = RMSNorm(sum_i pre_in_i R'_i). ``pre_in`` must not be
    ``pre`` (a program reads its row after writing the new one). One launch."""
    assert pre_in.data_ptr() != pre.data_ptr(), "mhc_pre_norm: the carried pre-mix and the new one need two buffers"
    M, n, H = streams.shape
    S = mix.shape[0]
    _mhc_pre_norm_kernel[(M,)](mix, sqrsum, scale, base, streams, pre_in, pre, post, comb, norm_weight, out, M, H, S,
                               rms_eps, hc_eps, post_mult, norm_eps, iters, N=n, BX=mix.shape[2],
                               BS=triton.next_power_of_2(S), BH=1024, num_warps=4)
    return out


def mhc_seam_reference(streams, y, post, comb, fn, scale, base, pre_in, norm_weight, *, rms_eps, hc_eps, post_mult,
                       norm_eps, iters):
    """Both kernels in torch (the op family's reference, ``ops/residual_mhc.py``): (x, pre, post, comb)."""
    from latency_specialized.ops.residual_mhc import mhc_seam_reference as seam

    return seam(streams, fn, scale, base, norm_weight, norm_eps, pre=pre_in, y=y, post=post, comb=comb,
                rms_eps=rms_eps, hc_eps=hc_eps, post_mult=post_mult, sinkhorn_iters=iters)


# ------------------------------------------------------------------------------------------ attention front
@triton.jit
def _q_kv_rmsnorm_kernel(y_ptr, s_y, qw_ptr, kvw_ptr, q_ptr, kv_ptr, eps, QL, D,
                         BQ: tl.constexpr, BD: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    # the two branches hold tiles of different widths: their names differ (Triton unifies a name's type
    # across the branches of an if)
    if tl.program_id(1) == 0:
        cq = tl.arange(0, BQ)
        mq = cq < QL
        xq = tl.load(y_ptr + m * s_y + cq, mask=mq, other=0.0).to(tl.float32)
        rq = tl.rsqrt(tl.sum(xq * xq, 0) / QL + eps)
        wq = tl.load(qw_ptr + cq, mask=mq, other=0.0).to(tl.float32)
        tl.store(q_ptr + m * QL + cq, (xq * rq * wq).to(q_ptr.dtype.element_ty), mask=mq)
    else:
        ck = tl.arange(0, BD)
        mk = ck < D
        xk = tl.load(y_ptr + m * s_y + QL + ck, mask=mk, other=0.0).to(tl.float32)
        rk = tl.rsqrt(tl.sum(xk * xk, 0) / D + eps)
        wk = tl.load(kvw_ptr + ck, mask=mk, other=0.0).to(tl.float32)
        tl.store(kv_ptr + m * D + ck, (xk * rk * wk).to(kv_ptr.dtype.element_ty), mask=mk)


def q_kv_rmsnorm(y: torch.Tensor, q_w: torch.Tensor, kv_w: torch.Tensor, eps: float, *, q_lora: int,
                 out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``y`` [M, q_lora + D] (the fused wq_a | wkv output) -> (RMSNorm(q part) [M, q_lora], RMSNorm(kv) [M, D]) in
    ``out``. One launch."""
    qr, kv = out
    D = kv.shape[1]
    _q_kv_rmsnorm_kernel[(y.shape[0], 2)](y, y.stride(0), q_w, kv_w, qr, kv, eps, q_lora, D,
                                         BQ=triton.next_power_of_2(q_lora), BD=triton.next_power_of_2(D), num_warps=4)
    return qr, kv


def q_kv_rmsnorm_reference(y, q_w, kv_w, eps, *, q_lora):
    from latency_specialized.ops.norm import rmsnorm_reference

    return rmsnorm_reference(y[:, :q_lora], q_w, eps), rmsnorm_reference(y[:, q_lora:], kv_w, eps)


@triton.jit
def _qnorm_rope_kv_kernel(q_ptr, kv_ptr, pos_ptr, inv_ptr, win_ptr, srow_ptr, eps, H, W,
                          D: tl.constexpr, R: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + m)
    d = tl.arange(0, D)
    p = _tail_partner(d, D, R)
    if h < H:        # the query head: weightless RMSNorm, RoPE, in place
        base = q_ptr + (m * H + h) * D
        x = tl.load(base + d).to(tl.float32)
        xp = tl.load(base + p).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        y = _tail_rope(x * r, xp * r, d, pos, inv_ptr, D, R, 1.0)
        tl.debug_barrier()
        tl.store(base + d, y.to(q_ptr.dtype.element_ty))
    else:            # the kv row: RoPE, into the window ring (position p at slot p % W)
        x = tl.load(kv_ptr + m * D + d).to(tl.float32)
        xp = tl.load(kv_ptr + m * D + p).to(tl.float32)
        y = _tail_rope(x, xp, d, pos, inv_ptr, D, R, 1.0)
        srow = tl.load(srow_ptr + m).to(tl.int64)
        tl.store(win_ptr + (srow * W + pos % W) * D + d, y.to(win_ptr.dtype.element_ty))


def qnorm_rope_kv_insert(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                         window: torch.Tensor, state_rows: torch.Tensor, eps: float) -> None:
    """``q`` [M, H, D] contiguous: per-head weightless RMSNorm + RoPE of its tail, in place; ``kv`` [M, D]: RoPE'd
    into ``window`` [rows, W, D] at (``state_rows``, position % W). One launch."""
    M, H, D = q.shape
    _qnorm_rope_kv_kernel[(M, H + 1)](q, kv, positions, inv_freq, window, state_rows, eps, H, window.shape[1], D=D,
                                      R=2 * inv_freq.shape[0], num_warps=4)


def rope_tail_reference(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """fp32 RoPE (interleaved pairs) of the last ``2 len(inv)`` channels of ``x [M, ..., D]`` at ``sign * pos``."""
    R, x = 2 * inv.shape[0], x.float()
    ang = sign * pos.float().view(-1, *([1] * (x.dim() - 1))) * inv.float()
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., -R::2], x[..., -R + 1::2]
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)
    return torch.cat([x[..., :-R], rot], -1)


def qnorm_rope_kv_insert_reference(q, kv, positions, inv_freq, window, state_rows, eps) -> None:
    qf = q.float()
    qf = qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + eps)
    q.copy_(rope_tail_reference(qf, positions, inv_freq).to(q.dtype))
    k = rope_tail_reference(kv.float(), positions, inv_freq).to(window.dtype)
    window[state_rows.long(), positions.long() % window.shape[1]] = k


# ------------------------------------------------------------------------------------------ compressor + keys
@triton.jit
def _compress_kernel(c_ptr, pend_ptr, srow_ptr, pos_ptr, w_ptr, inv_ptr, cache_ptr, bt_ptr, s_bt, lat_ptr, eps,
                     D: tl.constexpr, R: tl.constexpr, RATIO: tl.constexpr, BR: tl.constexpr, BS_C: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + m)
    seq = pos + 1
    d = tl.arange(0, D)
    if RATIO > 1:
        k = tl.arange(0, BR)
        cur = pos % RATIO
        srow = tl.load(srow_ptr + m).to(tl.int64)
        cv = tl.load(c_ptr + m * 2 * D + d)
        cg = tl.load(c_ptr + m * 2 * D + D + d)
        prow = pend_ptr + (srow * RATIO + k[:, None]) * 2 * D + d[None, :]
        other = (k < RATIO)[:, None] & (k != cur)[:, None]
        pv = tl.load(prow, mask=other, other=0.0).to(tl.float32)
        pg = tl.load(prow + D, mask=other, other=0.0).to(tl.float32)
        pv = tl.where((k == cur)[:, None], cv.to(tl.float32)[None, :], pv)
        pg = tl.where((k == cur)[:, None], cg.to(tl.float32)[None, :], pg)
        pg = tl.where((k < RATIO)[:, None], pg, -float("inf"))
        tl.store(pend_ptr + (srow * RATIO + cur) * 2 * D + d, cv.to(pend_ptr.dtype.element_ty))
        tl.store(pend_ptr + (srow * RATIO + cur) * 2 * D + D + d, cg.to(pend_ptr.dtype.element_ty))
        e = tl.exp(pg - tl.max(pg, 0)[None, :])
        x = tl.sum(e / tl.sum(e, 0)[None, :] * pv, 0).to(lat_ptr.dtype.element_ty).to(tl.float32)
    else:
        x = tl.load(c_ptr + m * D + d).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    lat = (x * r * tl.load(w_ptr + d).to(tl.float32)).to(lat_ptr.dtype.element_ty)
    tl.store(lat_ptr + m * D + d, lat)
    tl.debug_barrier()
    xp = tl.load(lat_ptr + m * D + _tail_partner(d, D, R)).to(tl.float32)
    y = _tail_rope(lat.to(tl.float32), xp, d, pos, inv_ptr, D, R, 1.0)
    slot = _slot_c(bt_ptr, s_bt, m, seq, RATIO, BS_C)
    tl.store(cache_ptr + slot * D + d, y.to(cache_ptr.dtype.element_ty), mask=(slot + d * 0) >= 0)


def compress_insert(c: torch.Tensor, pending: torch.Tensor | None, state_rows: torch.Tensor, positions: torch.Tensor,
                    norm_w: torch.Tensor, inv_freq: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                    ratio: int, eps: float, *, lat: torch.Tensor) -> torch.Tensor:
    """``c`` [M, 2D] (ratio > 1: ``[kv | gate]``, into ``pending`` [rows, ratio, 2D] at position % ratio) or [M, D];
    where the token completes a group: RMSNorm of the softmax(gate)-pooled rows (ratio 1: of ``c``), RoPE'd, into the
    paged ``cache`` [blocks, bs, D] at compressed position seq // ratio - 1. ``lat`` [M, D]: the pre-RoPE row (the
    indexer key's input). One launch."""
    M, D = lat.shape
    pend = pending if pending is not None else c
    _compress_kernel[(M,)](c, pend, state_rows, positions, norm_w, inv_freq, cache, block_table, block_table.stride(0),
                           lat, eps, D=D, R=2 * inv_freq.shape[0], RATIO=ratio, BR=max(triton.next_power_of_2(ratio), 2),
                           BS_C=cache.shape[1], num_warps=4)
    return lat


def _slot_c_reference(block_table, seq, ratio, bs):
    j = (seq // ratio - 1).clamp(min=0)
    blk = block_table.long().gather(1, (j // bs).unsqueeze(1)).squeeze(1)
    return torch.where((seq % ratio == 0) & (seq > 0), blk * bs + j % bs, -1)


def compress_insert_reference(c, pending, state_rows, positions, norm_w, inv_freq, cache, block_table, ratio, eps):
    from latency_specialized.ops.norm import rmsnorm_reference

    D, pos, rows = cache.shape[-1], positions.long(), state_rows.long()
    if ratio > 1:
        pending[rows, pos % ratio] = c.to(pending.dtype)
        g = pending[rows].float()
        x = (torch.softmax(g[..., D:], 1) * g[..., :D]).sum(1).to(c.dtype)
    else:
        x = c
    lat = rmsnorm_reference(x, norm_w, eps)
    slot = _slot_c_reference(block_table, pos + 1, ratio, cache.shape[1])
    live = slot >= 0
    cache.view(-1, D)[slot[live]] = rope_tail_reference(lat, pos, inv_freq)[live].to(cache.dtype)
    return lat


@triton.jit
def _index_key_kernel(k_ptr, w_ptr, pos_ptr, inv_ptr, kc_ptr, ks_ptr, bt_ptr, s_bt, eps,
                      D: tl.constexpr, R: tl.constexpr, RATIO: tl.constexpr, BS_C: tl.constexpr, FMAX: tl.constexpr,
                      EXACT: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + m)
    d = tl.arange(0, D)
    p = partner(d, R, True)
    x = tl.load(k_ptr + m * D + d).to(tl.float32)
    xp = tl.load(k_ptr + m * D + p).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    x = x * r * tl.load(w_ptr + d).to(tl.float32)
    xp = xp * r * tl.load(w_ptr + p).to(tl.float32)
    y = rope_vec(x, xp, d, pos, inv_ptr, R, True)
    q8, scale = ue8m0_quantize(y, FMAX, EXACT)
    slot = _slot_c(bt_ptr, s_bt, m, pos + 1, RATIO, BS_C)
    tl.store(kc_ptr + slot * D + d, q8, mask=(slot + d * 0) >= 0)
    tl.store(ks_ptr + slot, scale, mask=slot >= 0)


def index_key_store(k: torch.Tensor, norm_w: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                    key_cache: torch.Tensor, key_scales: torch.Tensor, block_table: torch.Tensor, ratio: int,
                    eps: float) -> None:
    """``k`` [M, D_i]: RMSNorm + RoPE of its leading channels + fp8 e4m3 with a power-of-two scale, into the paged
    ``key_cache`` [blocks, bs, D_i] / ``key_scales`` [blocks, bs] at the compressed row the token completes (if
    any). One launch."""
    M, D = k.shape
    _index_key_kernel[(M,)](k, norm_w, positions, inv_freq, key_cache, key_scales, block_table, block_table.stride(0),
                            eps, D=D, R=2 * inv_freq.shape[0], RATIO=ratio, BS_C=key_cache.shape[1], FMAX=FP8_MAX,
                            EXACT=interpreting(), num_warps=1)


def index_key_store_reference(k, norm_w, positions, inv_freq, key_cache, key_scales, block_table, ratio, eps) -> None:
    from latency_specialized.bench.stock.dsa_kernels import fp8_quantize_reference, rope_reference

    kf = k.float()
    kf = kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + eps) * norm_w.float()
    q8, s = fp8_quantize_reference(rope_reference(kf[:, None], positions, inv_freq, True)[:, 0])
    slot = _slot_c_reference(block_table, positions.long() + 1, ratio, key_cache.shape[1])
    live = slot >= 0
    key_cache.view(torch.uint8).view(-1, k.shape[1])[slot[live]] = q8.view(torch.uint8)[live]
    key_scales.view(-1)[slot[live]] = s[live]


# ------------------------------------------------------------------------------------------ routing
@triton.jit
def _sqrtsoftplus_topk_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, stride_l, E, scaling, renorm_eps,
                              TOPK: tl.constexpr, BK: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    m = e < E
    z = tl.load(logits_ptr + row * stride_l + e, mask=m, other=0.0).to(tl.float32)
    s = tl.sqrt(tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0)))))   # torch's softplus threshold
    sel = tl.where(m, s + tl.load(bias_ptr + e, mask=m, other=0.0).to(tl.float32), -float("inf"))
    k = tl.arange(0, BK)
    ids = tl.zeros([BK], dtype=tl.int32)
    ws = tl.zeros([BK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        best = tl.argmax(sel, 0)
        ids = tl.where(k == j, best, ids)
        ws = tl.where(k == j, tl.sum(tl.where(e == best, s, 0.0), 0), ws)
        sel = tl.where(e == best, -float("inf"), sel)
    if RENORM:
        ws = ws / (tl.sum(ws, 0) + renorm_eps)
    tl.store(w_ptr + row * TOPK + k, ws * scaling, mask=k < TOPK)
    tl.store(ids_ptr + row * TOPK + k, ids, mask=k < TOPK)


def sqrtsoftplus_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, *, renormalize: bool = True,
                      scaling: float = 1.0, renorm_eps: float = 0.0, weights: torch.Tensor,
                      ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sqrt(softplus(logits)) scores, top-k of score + bias (ties: the lower id), weights = the unbiased scores
    renormalised and scaled. logits [M, E]; weights [M, k] fp32; ids [M, k] int32. One launch (any k)."""
    M, E = logits.shape
    _sqrtsoftplus_topk_kernel[(M,)](logits, bias, weights, ids, logits.stride(0), E, scaling, renorm_eps, TOPK=top_k,
                                    BK=triton.next_power_of_2(top_k), RENORM=renormalize,
                                    BLOCK_E=triton.next_power_of_2(E), num_warps=4)
    return weights, ids


def sqrtsoftplus_topk_reference(logits, bias, top_k, router):
    from latency_specialized.ops.moe import route_reference

    return route_reference(logits, bias, top_k, router)


# ------------------------------------------------------------------------------------------ sparse MQA decode
@triton.jit
def _sparse_split_kernel(q_ptr, win_ptr, comp_ptr, srow_ptr, seq_ptr, rows_ptr, cnt_ptr, o_ptr, mx_ptr, l_ptr, scale,
                         H, W, K, NS, s_rows, D: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                         ROWS: tl.constexpr, F32: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    h = tl.arange(0, BH)
    hm = h < H
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (m * H + h[:, None]) * D + d[None, :], mask=hm[:, None], other=0.0)
    seq = tl.load(seq_ptr + m)
    cnt = tl.load(cnt_ptr + m)
    srow = tl.load(srow_ptr + m).to(tl.int64)
    mx = tl.full([BH], -float("inf"), dtype=tl.float32)
    lsum = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, D], dtype=tl.float32)
    for t0 in range(0, ROWS, BN):
        t = sp * ROWS + t0 + tl.arange(0, BN)
        is_w = t < W
        j = t - W
        is_c = (t >= W) & (j < K)
        crow = tl.load(rows_ptr + m * s_rows + j, mask=is_c, other=0).to(tl.int64)
        vw = is_w & (t < seq)
        vc = is_c & (j < cnt)
        kw = tl.load(win_ptr + (srow * W + t)[:, None] * D + d[None, :], mask=vw[:, None], other=0.0)
        kc = tl.load(comp_ptr + crow[:, None] * D + d[None, :], mask=vc[:, None], other=0.0)
        kv = kw + kc
        if F32:
            s = tl.dot(q.to(tl.float32), tl.trans(kv.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kv))
        s = tl.where((vw | vc)[None, :], s * scale, -float("inf"))
        m_new = tl.maximum(mx, tl.max(s, 1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(mx - m_safe)
        lsum = lsum * alpha + tl.sum(p, 1)
        if F32:
            pv = tl.dot(p, kv.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(kv.dtype), kv)
        acc = acc * alpha[:, None] + pv
        mx = m_new
    base = (m * NS + sp) * H + h
    tl.store(o_ptr + base[:, None] * D + d[None, :], acc, mask=hm[:, None])
    tl.store(mx_ptr + base, mx, mask=hm)
    tl.store(l_ptr + base, lsum, mask=hm)


@triton.jit
def _sparse_merge_kernel(o_ptr, mx_ptr, l_ptr, sink_ptr, pos_ptr, inv_ptr, out_ptr, M, H, NS, HPG,
                         D: tl.constexpr, R: tl.constexpr, BS: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BS)
    d = tl.arange(0, D)
    dp = _tail_partner(d, D, R)
    mx = tl.load(mx_ptr + (m * NS + s) * H + h, mask=s < NS, other=-float("inf"))
    sink = tl.load(sink_ptr + h).to(tl.float32)
    g = tl.maximum(tl.max(mx, 0), sink)
    denom = tl.exp(sink - g)
    o = tl.zeros([D], dtype=tl.float32)
    op = tl.zeros([D], dtype=tl.float32)
    for i in range(0, NS):          # one split's partial row at a time (registers: two [D] vectors)
        base = (m * NS + i) * H + h
        w = tl.exp(tl.load(mx_ptr + base) - g)
        denom += w * tl.load(l_ptr + base)
        o += w * tl.load(o_ptr + base * D + d)
        op += w * tl.load(o_ptr + base * D + dp)
    y = _tail_rope(o / denom, op / denom, d, tl.load(pos_ptr + m), inv_ptr, D, R, -1.0)
    grp = h // HPG
    tl.store(out_ptr + (grp * M + m) * (HPG * D) + (h % HPG) * D + d, y.to(out_ptr.dtype.element_ty))


def sparse_mqa_decode(q: torch.Tensor, window: torch.Tensor, state_rows: torch.Tensor, seq_lens: torch.Tensor,
                      comp: torch.Tensor | None, rows: torch.Tensor | None, counts: torch.Tensor | None,
                      sinks: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *, groups: int,
                      out: torch.Tensor) -> torch.Tensor:
    """Sparse MQA decode with one K = V head: ``q`` [M, H, D] attends to the window rows (``window`` [rows, W, D],
    ring slot i valid for i < seq_lens) and the ``counts`` selected compressed rows ``rows`` [M, K] (physical rows
    of the paged ``comp``; None on window-only layers), a per-head sink logit ``sinks`` [H] fp32 in the softmax
    denominator; the output's inverse RoPE (tail channels, at ``positions``); ``out`` [groups, M, H/groups * D] (the
    grouped wo_a's input). Two launches (split, combine)."""
    M, H, D = q.shape
    W = window.shape[1]
    if comp is None:
        comp, rows, counts = window, state_rows.view(M, 1), torch.zeros_like(seq_lens)
        K = 0
    else:
        K = rows.shape[1]
    NS = triton.cdiv(W + K, SPLIT_ROWS)
    part = torch.empty(M, NS, H, D, device=q.device, dtype=torch.float32)
    mx = torch.empty(M, NS, H, device=q.device, dtype=torch.float32)
    ls = torch.empty_like(mx)
    _sparse_split_kernel[(M, NS)](q, window, comp, state_rows, seq_lens, rows, counts, part, mx, ls, D ** -0.5, H, W,
                                  K, NS, rows.stride(0), D=D, BH=max(16, triton.next_power_of_2(H)), BN=SPLIT_ROWS,
                                  ROWS=SPLIT_ROWS, F32=interpreting(), num_warps=8)
    _sparse_merge_kernel[(M, H)](part, mx, ls, sinks, positions, inv_freq, out, M, H, NS, H // groups, D=D,
                                 R=2 * inv_freq.shape[0], BS=max(2, triton.next_power_of_2(NS)), num_warps=4)
    return out


def sparse_mqa_decode_reference(q, window, state_rows, seq_lens, comp, rows, counts, sinks, positions, inv_freq, *,
                                groups):
    """:func:`sparse_mqa_decode` in torch (fp32): [groups, M, H/groups * D] in q.dtype."""
    M, H, D = q.shape
    W = window.shape[1]
    keys = window[state_rows.long()].float()                                           # [M, W, D]
    valid = torch.arange(W, device=q.device)[None, :] < seq_lens.long()[:, None]
    if comp is not None:
        flat = comp.view(-1, D)
        keys = torch.cat([keys, flat[rows.long().clamp(min=0)].float()], 1)
        valid = torch.cat([valid, torch.arange(rows.shape[1], device=q.device)[None, :] < counts.long()[:, None]], 1)
    s = torch.einsum("mhd,mtd->mht", q.float(), keys) * D ** -0.5
    s = torch.cat([s.masked_fill(~valid[:, None, :], float("-inf")), sinks.float().view(1, H, 1).expand(M, H, 1)], -1)
    o = torch.einsum("mht,mtd->mhd", torch.softmax(s, -1)[..., :-1], keys)
    o = rope_tail_reference(o, positions, inv_freq, sign=-1.0)
    return o.reshape(M, groups, H // groups * D).transpose(0, 1).to(q.dtype)
