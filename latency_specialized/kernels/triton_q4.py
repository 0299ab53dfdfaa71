"""Triton kernels for routed experts over 4-bit weights (MXFP4, NVFP4), dequantised in registers.

Weights stay as the checkpoints store them (``quant/formats.py``): packed e2m1 codes ``[E, N, K/2]``
(uint8, the even element in the low nibble) and one scale per ``GROUP`` values along K (``[E, N, K/GROUP]``:
ue8m0 bytes for MXFP4, GROUP 32; float8_e4m3fn for NVFP4, GROUP 16, times a per-expert fp32 global scale).
Hopper has no FP4 MMA: codes become fp32 through their fp16 bit pattern (below) and the products run on
CUDA cores (``gemv``) or, converted to bf16, on the bf16 tensor cores (``grouped``). Every kernel also takes the
codes in the paired layout (``PAIRED``; ``quant.codecs.PAIRED_SLOTS``, the mma experts' decode): the same words
with each value's bits elsewhere, so a site whose weights were rearranged once is served at every bucket.

Decoding a code ``c`` (sign bit 3, exponent bits 2-1, mantissa bit 0): the bits ``(c & 7) << 9 | (c & 8)
<< 12`` are an fp16 whose exponent field is e2m1's exponent and whose top mantissa bit is e2m1's mantissa,
so its value is the e2m1 value times 2^-14 - code 1 (0.5) lands on an fp16 subnormal, which the fp16 ->
fp32 conversion keeps exactly (no flush). The 2^14 is folded into the scale.

Two paths (``kernels/moe_experts_q4_triton.py`` registers them):

``gemv`` (few tokens): three kernels, no sort, the codes read as int32 words (8 codes; each code's fp16 bits
    come straight out of the word in two shifts and two masks). ``gate_up`` grid (pairs, ceil(I / BLOCK_I)):
    program (p, ib) streams BLOCK_I gate rows and the matching up rows of pair p's expert, BLOCK_W words at a
    time, sums code x activation per word in fp32, applies each word's scale to its partial sum, then the
    activation; stores ``h[p, i]``. ``down`` grid (pairs, ceil(N / BLOCK_N)): one route's BLOCK_N rows per
    program, the route's output rounded to bf16; ``route_sum`` weights the routes and sums them in fp32.
    Every selected expert is read once per token that chose it.
``grouped`` (from about 8 tokens): stock's fused-MoE shape (sort/align by expert, ``kernels/triton_moe.py``)
    with a 4-bit weight tile: each 16-row tile of one expert's pairs multiplies the dequantised bf16 weight
    tile on the tensor cores, the weight as the MMA's M side (``dot(W[BLOCK_N, BLOCK_K], X^T[BLOCK_K,
    BLOCK_M])``: the 16 pairs of a tile are the narrow side); K is split into the even and odd elements of
    each byte so the two nibbles never need interleaving.

Both are well short of the 4-bit roofline on the H200 (decode instructions per value, not bytes, bound them:
``NOTES_q4.md`` has the measurements and the variants that were slower - a packed bf16x2 inline-PTX decode
and ``tl.dot_scaled``).

Rounding follows ``ops.moe.experts_reference``: gate/up to bf16, activation to bf16, each route's down
output to bf16 before its routing weight, fp32 sum.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from latency_specialized.kernels.triton_moe import sigmoid, tanh, tile_pairs

# The interpreter (CPU tests) mis-computes bf16 tl.dot: it dots in fp32 there (as kernels/triton_moe.py).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

ACT_SWIGLU = 0
ACT_SITU = 1
SCALE_UE8M0 = 0
"""MXFP4: one ue8m0 byte per 32 values."""
SCALE_E4M3 = 1
"""NVFP4: one float8_e4m3fn per 16 values, times the expert's fp32 global scale."""
MAX_UE8M0 = 240
"""Largest ue8m0 byte the kernels take: its scale times the codes' 2^14 offset, 2^127, is fp32's largest
power of two (real checkpoints sit near 2^-10..2^0; the wrapper rejects larger ones when it first sees
a weight)."""


@triton.jit
def _code_f32(c):
    """int32 e2m1 codes (0..15) -> their value x 2^-14 in fp32 (exact; see the module docstring)."""
    h = ((c & 7) << 9) | ((c & 8) << 12)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scale_f32(s, SCALE: tl.constexpr):
    """Stored block scales -> fp32 multipliers, times 2^14 (the codes' offset)."""
    if SCALE == 0:
        # 2^(e-127) x 2^14 = 2^(e-113): the fp32 with exponent field e + 14 (exact for e <= MAX_UE8M0)
        return ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
    else:
        # e4m3 bytes -> the fp16 with the same exponent / mantissa bits (low 4 of fp16's exponent): its value
        # is the e4m3 value x 2^-8, subnormals included; x 2^8 x 2^14 (the codes' offset) = x 2^22
        b = s.to(tl.int32)
        h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 4194304.0


@triton.jit
def _act(g, u, beta, beta_lin, clamp, ACT: tl.constexpr, CLAMP: tl.constexpr):
    if ACT == 0:
        if CLAMP:
            g = tl.minimum(g, clamp)
            u = tl.minimum(tl.maximum(u, -clamp), clamp)
        return g * sigmoid(g) * u
    else:
        return beta * tanh(g / beta) * sigmoid(g) * (beta_lin * tanh(u / beta_lin))


# ------------------------------------------------------------------------------------- gemv path
@triton.jit
def _code_f16_bits(w, C: tl.constexpr):
    """int32 words -> int32 holding, in its low 16 bits, the fp16 bits of code C of every word (the value x
    2^-14: see the module docstring), straight from the word (two shifts, two masks, one or)."""
    if 4 * C >= 9:
        a = (w >> (4 * C - 9)) & 0xE00
    else:
        a = (w << (9 - 4 * C)) & 0xE00
    if 4 * C >= 12:
        b = (w >> (4 * C - 12)) & 0x8000
    else:
        b = (w << (12 - 4 * C)) & 0x8000
    return a | b


@triton.jit
def _move_bits(w, SRC: tl.constexpr, DST: tl.constexpr, MASK: tl.constexpr):
    """The bits of ``w`` at SRC.. moved to DST.. and masked (MASK is in DST's place)."""
    if DST >= SRC:
        return (w << (DST - SRC)) & MASK
    else:
        return (w >> (SRC - DST)) & MASK


@triton.jit
def _paired_f16_bits(w, C: tl.constexpr):
    """As :func:`_code_f16_bits` for words in the paired layout (``quant.codecs.PAIRED_SLOTS``): value C = 4 h + j
    of a word sits in half h (bits 16 h..) with its magnitude bits (e1 e0 m) together at 6 - 3j.. and its sign at
    15 - 3j for j < 3; value 3's e1 at 13, e0 m at 11-10, sign at 14."""
    if C % 4 < 3:
        return _move_bits(w, 16 * (C // 4) + 6 - 3 * (C % 4), 9, 0xE00) | \
            _move_bits(w, 16 * (C // 4) + 15 - 3 * (C % 4), 15, 0x8000)
    else:
        return _move_bits(w, 16 * (C // 4) + 10, 9, 0x600) | _move_bits(w, 16 * (C // 4) + 13, 11, 0x800) | \
            _move_bits(w, 16 * (C // 4) + 14, 15, 0x8000)


@triton.jit
def _paired_codes(w):
    """Words in the paired layout ``[R, 1, W]`` int32 -> the e2m1 codes (0..15) of their 8 values ``[R, 8, W]``
    (value C of word i is logical K position 8 i + C); the shifts as tensors, for the tiled paths."""
    c = tl.arange(0, 8)[None, :, None]
    o = 16 * (c // 4)
    j = c % 4
    lo_at = tl.where(j == 3, o + 10, o + 6 - 3 * j)      # e0 m: bits 1-0 of the code
    e1_at = tl.where(j == 3, o + 13, o + 8 - 3 * j)
    sign_at = tl.where(j == 3, o + 14, o + 15 - 3 * j)
    return (((w >> sign_at) & 1) << 3) | (((w >> e1_at) & 1) << 2) | ((w >> lo_at) & 3)


@triton.jit
def _word_dot(w, x_ptrs, x_mask, PAIRED: tl.constexpr):
    """sum over the 8 codes of each word of code x activation: w [R, C] int32, x_ptrs [C] -> [R, C] fp32
    (x_ptrs point at each word's first K position; the activations are fp32 after the load). PAIRED: the words
    are in the paired layout."""
    part = tl.zeros(w.shape, dtype=tl.float32)
    for c in tl.static_range(8):
        xc = tl.load(x_ptrs + c, mask=x_mask, other=0.0).to(tl.float32)
        if PAIRED:
            bits = _paired_f16_bits(w, c)
        else:
            bits = _code_f16_bits(w, c)
        v = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        part += v * xc[None, :]
    return part


@triton.jit
def _gate_up_words_kernel(x_ptr, ids_ptr, q_ptr, s_ptr, gs_ptr, h_ptr, K, I, stride_xm, stride_qe, stride_qn,
                          stride_se, stride_sn, stride_hp, beta, beta_lin, clamp,
                          TOPK: tl.constexpr, ACT: tl.constexpr, CLAMP: tl.constexpr, SCALE: tl.constexpr,
                          GROUP: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_W: tl.constexpr,
                          PAIRED: tl.constexpr):
    # q_ptr: codes as int32 words [E, 2I, K/8]; a program holds BLOCK_I gate and up rows, BLOCK_W words each
    p = tl.program_id(0)
    ib = tl.program_id(1)
    m = (p // TOPK).to(tl.int64)
    e = tl.load(ids_ptr + p).to(tl.int64)
    i = ib * BLOCK_I + tl.arange(0, BLOCK_I)
    im = i < I
    wi = tl.arange(0, BLOCK_W)
    words = K // 8
    qg = q_ptr + e * stride_qe + i.to(tl.int64)[:, None] * stride_qn
    qu = qg + I * stride_qn
    sg_ = s_ptr + e * stride_se + i.to(tl.int64)[:, None] * stride_sn
    su_ = sg_ + I * stride_sn
    acc_g = tl.zeros([BLOCK_I, BLOCK_W], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I, BLOCK_W], dtype=tl.float32)
    for w0 in range(0, words, BLOCK_W):
        wk = w0 + wi
        wm = wk < words
        m2 = im[:, None] & wm[None, :]
        xp = x_ptr + m * stride_xm + 8 * wk
        sgrp = (8 * wk[None, :]) // GROUP
        wg = tl.load(qg + wk[None, :], mask=m2, other=0)
        wu = tl.load(qu + wk[None, :], mask=m2, other=0)
        acc_g += _word_dot(wg, xp, wm, PAIRED) * _scale_f32(tl.load(sg_ + sgrp, mask=m2, other=0), SCALE)
        acc_u += _word_dot(wu, xp, wm, PAIRED) * _scale_f32(tl.load(su_ + sgrp, mask=m2, other=0), SCALE)
    tg = tl.sum(acc_g, axis=1)
    tu = tl.sum(acc_u, axis=1)
    if SCALE == 1:
        gsc = tl.load(gs_ptr + e)
        tg = tg * gsc
        tu = tu * gsc
    gate = tg.to(tl.bfloat16).to(tl.float32)
    up = tu.to(tl.bfloat16).to(tl.float32)
    y = _act(gate, up, beta, beta_lin, clamp, ACT, CLAMP)
    tl.store(h_ptr + p.to(tl.int64) * stride_hp + i, y.to(h_ptr.dtype.element_ty), mask=im)


@triton.jit
def _down_words_kernel(h_ptr, ids_ptr, q_ptr, s_ptr, gs_ptr, y_ptr, N, I, stride_hp, stride_qe, stride_qn,
                       stride_se, stride_sn, stride_yp, SCALE: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PAIRED: tl.constexpr):
    # one program per (pair, BLOCK_N rows): y[p, n] = round(h[p] @ W2[ids[p]][n]^T), the route's own row
    p = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    wi = tl.arange(0, BLOCK_W)
    words = I // 8
    qn = q_ptr + e * stride_qe + n.to(tl.int64)[:, None] * stride_qn
    sn = s_ptr + e * stride_se + n.to(tl.int64)[:, None] * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    for w0 in range(0, words, BLOCK_W):
        wk = w0 + wi
        wm = wk < words
        m2 = nm[:, None] & wm[None, :]
        w = tl.load(qn + wk[None, :], mask=m2, other=0)
        acc += _word_dot(w, h_ptr + p * stride_hp + 8 * wk, wm, PAIRED) * _scale_f32(
            tl.load(sn + (8 * wk[None, :]) // GROUP, mask=m2, other=0), SCALE)
    t = tl.sum(acc, axis=1)
    if SCALE == 1:
        t = t * tl.load(gs_ptr + e)
    tl.store(y_ptr + p * stride_yp + n, t.to(y_ptr.dtype.element_ty), mask=nm)


@triton.jit
def _route_sum_kernel(y_ptr, w_ptr, out_ptr, N, stride_yp, stride_om, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = c < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        wj = tl.load(w_ptr + m * TOPK + j).to(tl.float32)
        acc += wj * tl.load(y_ptr + (m * TOPK + j) * stride_yp + c, mask=cm, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + c, acc.to(out_ptr.dtype.element_ty), mask=cm)


def gate_up_words(x, ids, q, s, gs, h, *, scale_kind: int, group: int, act: int, beta: float, beta_lin: float,
                  clamp: float | None, block_i: int = 4, block_w: int | None = None, num_warps: int = 4,
                  paired: bool = False) -> None:
    """h[p] = act(x[p // top_k] @ W13[ids[p]]^T) for every routing pair p (codes read as int32 words).

    x [M, K] bf16; ids [M, top_k] int; q [E, 2I, K/2] uint8 (K/2 a multiple of 4; ``paired``: in the paired
    layout); s [E, 2I, K/group] scale bytes (ue8m0 or e4m3 as uint8); gs [E] fp32 (NVFP4 global scales; any tensor
    for MXFP4); h [M*top_k, I] bf16."""
    M, K = x.shape
    top_k = ids.shape[1]
    I = q.shape[1] // 2
    qw = q.view(torch.int32)
    block_w = block_w or triton.next_power_of_2(K // 8)
    _gate_up_words_kernel[(M * top_k, triton.cdiv(I, block_i))](
        x, ids, qw, s, gs, h, K, I, x.stride(0), qw.stride(0), qw.stride(1), s.stride(0), s.stride(1), h.stride(0),
        float(beta), float(beta_lin), float(clamp or 0.0), TOPK=top_k, ACT=act, CLAMP=clamp is not None,
        SCALE=scale_kind, GROUP=group, BLOCK_I=block_i, BLOCK_W=block_w, PAIRED=paired, num_warps=num_warps)


def down_words(h, weights, ids, q, s, gs, out, *, scale_kind: int, group: int, per_route: bool,
               block_n: int = 16, block_w: int | None = None, num_warps: int = 4, paired: bool = False) -> None:
    """Down projection per route (one program per pair and BLOCK_N rows), then the weighted sum over the routes
    (a third small kernel) unless ``per_route``. h [M*top_k, I]; q uint8 [E, N, I/2]; out [M, N] / [M, top_k, N]."""
    M, top_k = ids.shape
    N, I = q.shape[1], q.shape[2] * 2
    qw = q.view(torch.int32)
    block_w = block_w or triton.next_power_of_2(I // 8)
    T = M * top_k
    from latency_specialized.kernels.moe_experts_triton import route_rows

    yp, direct = route_rows(out) if per_route else (torch.empty(T, N, device=h.device, dtype=h.dtype), False)
    _down_words_kernel[(T, triton.cdiv(N, block_n))](
        h, ids, qw, s, gs, yp, N, I, h.stride(0), qw.stride(0), qw.stride(1), s.stride(0), s.stride(1),
        yp.stride(0), SCALE=scale_kind, GROUP=group, BLOCK_N=block_n, BLOCK_W=block_w, PAIRED=paired,
        num_warps=num_warps)
    if per_route:
        if not direct:
            out.copy_(yp.view(M, top_k, N))
        return
    route_sum(yp, weights, out)


def route_sum(yp: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
    """out[m] = sum_j weights[m, j] x yp[m x top_k + j] in fp32, routes in order j = 0 .. top_k - 1, rounded once.
    yp [M x top_k, N] (unit column stride); weights [M, top_k] fp32 contiguous; out [M, N] (unit column stride)."""
    M, top_k = weights.shape
    N = yp.shape[1]
    _route_sum_kernel[(M, triton.cdiv(N, 1024))](yp, weights, out, N, yp.stride(0), out.stride(0), TOPK=top_k,
                                                 BLOCK=1024, num_warps=4)


# ------------------------------------------------------------------------------------- grouped path
@triton.jit
def _moe_gemm_q4_kernel(a_ptr, q_ptr, s_ptr, gs_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr,
                        topk_w_ptr, N, K, T, stride_am, stride_qe, stride_qn, stride_se, stride_sn, stride_om,
                        TOPK: tl.constexpr, A_PER_PAIR: tl.constexpr, MUL_W: tl.constexpr, SCALE: tl.constexpr,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        UPCAST: tl.constexpr, PAIRED: tl.constexpr):
    # PAIRED: q_ptr is the codes as int32 words [E, N, K/8] in the paired layout (strides in words); a K step's
    # tile is decoded value-major (position C of every word, then C + 1, ...) and the activations read in that order
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair, valid, a_row, expert = tile_pairs(sorted_ptr, expert_ids_ptr, pid_m, T, TOPK, A_PER_PAIR, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    sg = tl.arange(0, BLOCK_K // GROUP)      # scale group within the K step
    s_ptrs = s_ptr + expert * stride_se + n.to(tl.int64)[:, None] * stride_sn + sg[None, :]
    if PAIRED:
        kw = tl.arange(0, BLOCK_K // 8)      # word within the K step
        q_ptrs = q_ptr + expert * stride_qe + n.to(tl.int64)[:, None] * stride_qn + kw[None, :]
        kk = tl.arange(0, BLOCK_K)           # tile column C x (BLOCK_K / 8) + word -> K position 8 word + C
        a_ptrs = a_ptr + a_row[None, :] * stride_am + (8 * (kk % (BLOCK_K // 8)) + kk // (BLOCK_K // 8))[:, None]
    else:
        kb = tl.arange(0, BLOCK_K // 2)      # byte within the K step
        q_ptrs = q_ptr + expert * stride_qe + n.to(tl.int64)[:, None] * stride_qn + kb[None, :]
        a_ptrs = a_ptr + a_row[None, :] * stride_am + 2 * kb[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        sc = _scale_f32(tl.load(s_ptrs, mask=nm[:, None], other=0), SCALE)
        if PAIRED:
            wv = tl.load(q_ptrs, mask=nm[:, None], other=0)
            scw = tl.reshape(tl.broadcast_to(sc[:, :, None], [BLOCK_N, BLOCK_K // GROUP, GROUP // 8]),
                             [BLOCK_N, BLOCK_K // 8])
            v = tl.reshape(_code_f32(_paired_codes(wv[:, None, :])) * scw[:, None, :], [BLOCK_N, BLOCK_K])
            a = tl.load(a_ptrs, mask=valid[None, :], other=0.0)
            if UPCAST:
                acc += tl.dot(v, a.to(tl.float32))
            else:
                acc += tl.dot(v.to(tl.bfloat16), a)
            q_ptrs += BLOCK_K // 8
        else:
            q = tl.load(q_ptrs, mask=nm[:, None], other=0).to(tl.int32)
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [BLOCK_N, BLOCK_K // GROUP, GROUP // 2]),
                            [BLOCK_N, BLOCK_K // 2])
            ae = tl.load(a_ptrs, mask=valid[None, :], other=0.0)
            ao = tl.load(a_ptrs + 1, mask=valid[None, :], other=0.0)
            if UPCAST:
                acc += tl.dot(_code_f32(q & 15) * sc, ae.to(tl.float32))
                acc += tl.dot(_code_f32(q >> 4) * sc, ao.to(tl.float32))
            else:
                acc += tl.dot((_code_f32(q & 15) * sc).to(tl.bfloat16), ae)
                acc += tl.dot((_code_f32(q >> 4) * sc).to(tl.bfloat16), ao)
            q_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // GROUP
        a_ptrs += BLOCK_K
    if SCALE == 1:
        acc = acc * tl.load(gs_ptr + expert)
    if MUL_W:
        acc = acc.to(tl.bfloat16).to(tl.float32) * tl.load(topk_w_ptr + pair, mask=valid, other=0.0)[None, :]
    o_ptrs = out_ptr + pair.to(tl.int64)[None, :] * stride_om + n[:, None]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[None, :] & nm[:, None])


def moe_gemm_q4(a, q, s, gs, align, top_k: int, *, out, a_per_pair: bool, scale_kind: int, group: int,
                topk_weights=None, block_n: int = 64, block_k: int = 128, num_warps: int = 4,
                num_stages: int = 3, paired: bool = False) -> None:
    """out[pair] = a[row of pair] @ deq(W[expert of pair])^T (x routing weight) over the aligned tiles.

    a [M, K] (token rows) or [M*k, K] (a_per_pair); q [E, N, K/2] uint8 (``paired``: in the paired layout);
    s [E, N, K/group]; gs [E] fp32 (NVFP4); out [M*k, N]; align: ``triton_moe.AlignBuffers``; topk_weights [M*k]
    fp32."""
    N, K = q.shape[1], q.shape[2] * 2
    if K % block_k:
        raise ValueError(f"moe_gemm_q4: K={K} must be a multiple of block_k={block_k}")
    if paired:
        q = q.view(torch.int32)
    sz = align.sizes
    grid = (sz.max_blocks, triton.cdiv(N, block_n))
    _moe_gemm_q4_kernel[grid](a, q, s, gs, out, align.sorted_ids, align.expert_ids, align.num_padded,
                              topk_weights if topk_weights is not None else a, N, K, sz.pairs, a.stride(0),
                              q.stride(0), q.stride(1), s.stride(0), s.stride(1), out.stride(0),
                              TOPK=top_k, A_PER_PAIR=a_per_pair, MUL_W=topk_weights is not None, SCALE=scale_kind,
                              GROUP=group, BLOCK_M=sz.block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=_INTERPRET,
                              PAIRED=paired, num_warps=num_warps, num_stages=num_stages)


# ------------------------------------------------------------------------------------- dequantise
@triton.jit
def _dequant_kernel(q_ptr, s_ptr, gs_ptr, out_ptr, N, K, SCALE: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, PAIRED: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    row = e * N + n.to(tl.int64)
    if PAIRED:  # q_ptr: int32 words in the paired layout, BLOCK_B / 4 of them a step
        c = tl.arange(0, 8)[None, :, None]
        for w0 in range(0, K // 8, BLOCK_B // 4):
            wi = w0 + tl.arange(0, BLOCK_B // 4)
            m = nm[:, None] & (wi[None, :] < K // 8)
            wv = tl.load(q_ptr + row[:, None] * (K // 8) + wi[None, :], mask=m, other=0)
            s = tl.load(s_ptr + row[:, None] * (K // GROUP) + (8 * wi[None, :]) // GROUP, mask=m, other=0)
            v = _code_f32(_paired_codes(wv[:, None, :])) * _scale_f32(s, SCALE)[:, None, :]
            if SCALE == 1:
                v = v * tl.load(gs_ptr + e)
            tl.store(out_ptr + row[:, None, None] * K + 8 * wi[None, None, :] + c, v, mask=m[:, None, :])
    else:
        for b0 in range(0, K // 2, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            m = nm[:, None] & (b[None, :] < K // 2)
            q = tl.load(q_ptr + row[:, None] * (K // 2) + b[None, :], mask=m, other=0).to(tl.int32)
            s = tl.load(s_ptr + row[:, None] * (K // GROUP) + (2 * b[None, :]) // GROUP, mask=m, other=0)
            sf = _scale_f32(s, SCALE)
            lo = _code_f32(q & 15) * sf
            hi = _code_f32(q >> 4) * sf
            if SCALE == 1:
                gsc = tl.load(gs_ptr + e)
                lo = lo * gsc
                hi = hi * gsc
            o = out_ptr + row[:, None] * K + 2 * b[None, :]
            tl.store(o, lo, mask=m)
            tl.store(o + 1, hi, mask=m)


def dequantize_q4(q, s, gs, out, *, scale_kind: int, group: int, block_n: int = 16, block_b: int = 64,
                  paired: bool = False) -> None:
    """out [E, N, K] fp32 = the stored 4-bit weight dequantised with the experts kernels' own decoding.

    q [E, N, K/2] uint8 codes (``paired``: in the paired layout, K/2 a multiple of 4); s [E, N, K/group] scale
    bytes; gs [E] fp32 global scales (NVFP4)."""
    E, N, K = out.shape
    _dequant_kernel[(E, triton.cdiv(N, block_n))](q.view(torch.int32) if paired else q, s, gs, out, N, K,
                                                  SCALE=scale_kind, GROUP=group, BLOCK_N=block_n, BLOCK_B=block_b,
                                                  PAIRED=paired, num_warps=4)
