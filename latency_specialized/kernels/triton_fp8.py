"""Triton kernel for block-scaled FP8 weights: ``y[M, N] = x[M, K] @ deq(W)[N, K]^T (+ residual)`` at decode M.

Weights stay as the checkpoints store them (``quant/formats.py``): e4m3 codes ``[N, K]`` (float8_e4m3fn) and one
scale per ``SCALE_N x SCALE_K`` block, ``[ceil(N / SCALE_N), ceil(K / SCALE_K)]``: fp32 multipliers for 128 x 128
blocks (GLM-5.3, DeepSeek-V3's ``weight_scale_inv``), ue8m0 exponent bytes for 32 x 32 (DeepSeek-V4.1-Flash).

One kernel, two ways to meet the tensor cores (``A8``):

``W8A16`` (``A8=False``): the e4m3 weight tile becomes bf16 in registers - exact: e4m3's 3 mantissa bits and its
    range fit bf16 - and multiplies the bf16 activations; with ue8m0 scales the tile is multiplied by its power-of-two
    scales before the conversion (still exact), with fp32 scales each ``BLOCK_K`` (= SCALE_K) partial product is
    scaled per row afterwards. No activation rounding beyond the bf16 input.
``W8A8`` (``A8=True``): the activations are quantized to e4m3 per (token, ``BLOCK_K`` = SCALE_K slice of K) inside
    the kernel (scale = amax / 448: stock vLLM's ``per_token_group_quant_fp8`` rule, without its separate launch),
    and the e4m3 x e4m3 products run on Hopper's FP8 tensor cores (``wgmma`` reads the codes from shared memory:
    no per-weight conversion instruction at all); each partial is scaled by the weight block's scale and the
    token's. Costs activation rounding (e4m3: 3 mantissa bits per element, per-slice scale).

Decode shapes (M <= 64) are weight-streaming: the MMA runs swapped (``dot(W[BLOCK_N, BLOCK_K], X^T[BLOCK_K,
BLOCK_M])``: the weight rows are the MMA's wide side, the few tokens its narrow one), and K is split across
``SPLIT_K`` programs where N alone gives too few. The split partials meet without a second launch: each program
writes its fp32 partial ``[BLOCK_N, M]`` to a workspace and takes a ticket from its N tile's counter
(``atomic_add``, acquire-release); the program that draws the last ticket sums the partials in split order (the
same order whatever program finishes last: deterministic), adds the residual, rounds once, stores, and resets
the counter to zero for the next call (and the next graph replay).

Rounding follows ``ops.gemm.gemm_reference`` on the dequantised weight (fp32 accumulate, residual added in
fp32, one rounding); W8A8 additionally rounds the activations as :func:`quantize_activations_reference` does.

Routed experts (:func:`moe_gemm_fp8`, ``kernels/moe_experts_fp8_triton.py``): stock's fused-MoE tile (16 aligned
pairs of one expert x ``BLOCK_N`` weight rows) with the W8A16 conversion above, fp32 scales per 128 x 128 block (or
per row: ``quant.layout.row_scaled``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from latency_specialized.kernels.stream_workspace import zeroed_int32_per_stream
from latency_specialized.kernels.triton_moe import tile_pairs

# The interpreter (CPU tests) mis-computes bf16 tl.dot: it dots in fp32 there (as kernels/triton_moe.py).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

SCALE_FP32 = 0
"""One fp32 multiplier per block (GLM-5.3's 128 x 128 ``weight_scale_inv``)."""
SCALE_UE8M0 = 1
"""One ue8m0 byte per block: 2^(e - 127) (DeepSeek-V4.1-Flash's 32 x 32)."""
E4M3_MAX = 448.0
ACT_EPS = 1e-10
"""Floor of a (token, K slice)'s amax before it becomes the activation scale (stock's ``eps``)."""
MIN_UE8M0 = 10
MAX_UE8M0 = 246
"""ue8m0 bytes the kernel decodes exactly: the W8A16 path multiplies each e4m3 value (down to its subnormal 2^-9)
by 2^(e-127) in fp32 and converts the product to bf16, so every product must be a normal number - below e = 10 the
H200 flushed them to zero (the GPU test of every code, session 32: scale byte 1 read 2^-135 values back as 0) - and
448 x 2^(e-127) must stay below bf16's / fp32's largest finite value (e <= 246). Real checkpoints sit near 2^-10
(e ~ 117); the wrapper rejects others with a UserError when it first sees a weight."""


@triton.jit
def _ue8m0_f32(e):
    """ue8m0 bytes (1..254) -> 2^(e - 127) in fp32, from its bits (exact; no exp2 approximation)."""
    return (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(v):
    """fp32 ``v`` (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32 (then exact in e4m3).

    Normals keep 3 mantissa bits (round-to-nearest-even on the bits; a carry moves into the exponent by itself);
    below 2^-6 the grid is multiples of 2^-9 (adding and removing 1.5 x 2^14, whose ulp is 2^-9). Done by hand,
    not by the fp32 -> e4m3 conversion, because Triton's interpreter (the CPU tests) rounds that conversion wrongly
    at some exponent carries; the GPU then converts already-exact values."""
    b = v.to(tl.int32, bitcast=True)
    b = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576
    return tl.where(tl.abs(v) < 0.015625, (v + 24576.0) - 24576.0, b.to(tl.float32, bitcast=True))


@triton.jit
def _e4m3_columns(xt):
    """``X^T [BLOCK_K, BLOCK_M]`` -> (each column divided by its scale and rounded to e4m3 - exact e4m3 values in
    fp32 -, the scales [BLOCK_M] = max(column amax, 1e-10) / 448): stock's per-token-group rule, IEEE divisions
    (Triton's ``/`` is approximate on the GPU) so the codes equal :func:`quantize_activations_reference`'s."""
    xf = xt.to(tl.float32)
    sx = tl.div_rn(tl.maximum(tl.max(tl.abs(xf), axis=0), 1e-10), 448.0)
    return _round_e4m3(tl.clamp(tl.div_rn(xf, sx[None, :]), -448.0, 448.0)), sx


@triton.jit
def _round_bf16(v):
    """fp32 ``v`` (finite) rounded to the nearest bf16 value, ties to even, still in fp32 (then exact in bf16): by
    hand on the bits, as the interpreter (the CPU tests) converts fp32 -> bf16 wrongly; a few integer instructions on
    the activation tile only."""
    b = v.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, res_ptr, part_ptr, cnt_ptr, g_ptr, eps,
                     M, N, K, KB, KB_PER_SPLIT, n_split, stride_xm, stride_wn, stride_sn, stride_om, stride_rm,
                     SCALE: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, A8: tl.constexpr,
                     HAS_RES: tl.constexpr, SPLIT: tl.constexpr, NORM: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    rows = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if NORM:
        # RMSNorm prologue: every program reduces the whole rows first (M x K x 2 bytes, from L2 after the first)
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None],
                         mask=m_ok[None, :] & (offs_k < K)[:, None], other=0.0).to(tl.float32)
            ss += tl.sum(xv * xv, axis=0)
        rstd = tl.rsqrt(ss / K + eps)
    kb0 = pid_k * KB_PER_SPLIT
    kb1 = tl.minimum(kb0 + KB_PER_SPLIT, KB)
    for kb in range(kb0, kb1):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        wb = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                     other=0)
        w8 = wb.to(tl.float8e4nv, bitcast=True)
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None], mask=m_ok[None, :] & k_ok[:, None],
                     other=0.0)  # [BLOCK_K, BLOCK_M]: X^T
        if NORM:  # the norm's output, rounded to the activation dtype as the norm op would store it
            gv = tl.load(g_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            xt = _round_bf16((xt.to(tl.float32) * rstd[None, :]) * gv[:, None]).to(x_ptr.dtype.element_ty)
        if SCALE == 1 and not A8:
            # power-of-two scales folded into the tile before the bf16 conversion (exact)
            se = tl.load(s_ptr + (offs_n // SCALE_N)[:, None] * stride_sn + (offs_k // SCALE_K)[None, :],
                         mask=n_ok[:, None] & k_ok[None, :], other=127)
            w = (w8.to(tl.float32) * _ue8m0_f32(se))
            if UPCAST:
                part = tl.dot(w, xt.to(tl.float32))
            else:
                part = tl.dot(w.to(tl.bfloat16), xt.to(tl.bfloat16))
            acc += part
        else:
            # BLOCK_K == SCALE_K: one weight scale per row of this K block
            sv = tl.load(s_ptr + (offs_n // SCALE_N) * stride_sn + kb, mask=n_ok, other=0)
            if SCALE == 1:
                ws = _ue8m0_f32(sv)
            else:
                ws = sv.to(tl.float32)
            if A8:
                xq, sx = _e4m3_columns(xt)
                if UPCAST:
                    part = tl.dot(w8.to(tl.float32), xq)
                else:
                    part = tl.dot(w8, xq.to(tl.float8e4nv))
                part = part * sx[None, :]
            elif UPCAST:
                part = tl.dot(w8.to(tl.float32), xt.to(tl.float32))
            else:
                part = tl.dot(w8.to(tl.bfloat16), xt.to(tl.bfloat16))
            acc += part * ws[:, None]

    out_mask = n_ok[:, None] & m_ok[None, :]
    if not SPLIT:
        y = acc
        if HAS_RES:
            y += tl.load(res_ptr + offs_m[None, :] * stride_rm + offs_n[:, None], mask=out_mask, other=0.0).to(
                tl.float32)
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], y.to(out_ptr.dtype.element_ty),
                 mask=out_mask)
    else:
        # partials [n_split, M, N] fp32; the last program of this N tile reduces them in split order
        pbase = part_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        tl.store(pbase + pid_k.to(tl.int64) * M * N, acc, mask=out_mask)
        ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if ticket == n_split - 1:
            y = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(n_split):
                y += tl.load(pbase + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_RES:
                y += tl.load(res_ptr + offs_m[None, :] * stride_rm + offs_n[:, None], mask=out_mask,
                             other=0.0).to(tl.float32)
            tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], y.to(out_ptr.dtype.element_ty),
                     mask=out_mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 ticket counters, one per N tile (at least 256, so most calls share one set), kept per (device,
    stream): every call leaves them zero (``stream_workspace``)."""
    return zeroed_int32_per_stream("fp8_block_gemm.tiles", (max(tiles, 256),), device)


def fp8_block_gemm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, out: torch.Tensor, *, scale_kind: int,
                   scale_block: tuple[int, int], a8: bool, residual: torch.Tensor | None = None,
                   norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
                   block_n: int = 128, block_k: int | None = None, split_k: int = 1, num_warps: int = 4,
                   num_stages: int = 4) -> torch.Tensor:
    """out[M, N] = x @ deq(w, s)^T (+ residual), rounded once to out's dtype; with ``norm_weight [K]``, x is first
    RMS-normalised with that gain (fp32, rounded to x's dtype: ``ops.gemm.gemm_reference``'s norm prologue).

    x [M, K] bf16 (unit column stride); w [N, K] e4m3 codes (float8_e4m3fn or uint8, unit column stride);
    s [ceil(N / scale_block[0]), ceil(K / scale_block[1])] fp32 or ue8m0 bytes; out / residual [M, N] (unit column
    stride, any row stride). ``block_k``: K per step (default: the scale block's K; with A8 or fp32 scales it must
    equal it). ``split_k``: programs per N tile along K (<= the K steps)."""
    M, K = x.shape
    N = w.shape[0]
    sn, sk = scale_block
    if block_k is None:
        block_k = sk
    if (a8 or scale_kind == SCALE_FP32) and block_k != sk:
        raise ValueError(f"fp8_block_gemm: block_k={block_k} must equal the scale block's K ({sk}) with "
                         f"{'W8A8' if a8 else 'fp32 scales'}")
    if scale_kind == SCALE_UE8M0 and not a8 and block_k % sk:
        raise ValueError(f"fp8_block_gemm: block_k={block_k} must be a multiple of the scale block's K ({sk})")
    kb = triton.cdiv(K, block_k)
    split_k = max(1, min(split_k, kb))
    per = triton.cdiv(kb, split_k)
    split_k = triton.cdiv(kb, per)  # no empty split
    block_m = max(16, triton.next_power_of_2(M))
    tiles = triton.cdiv(N, block_n)
    if split_k > 1:
        part = torch.empty(split_k, M, N, device=x.device, dtype=torch.float32)
        cnt = _tile_counters(x.device, tiles)
    else:
        part, cnt = out, out  # unused
    res = residual if residual is not None else out
    w8 = w.view(torch.uint8) if w.dtype != torch.uint8 else w
    g = norm_weight if norm_weight is not None else out  # unused without NORM
    _fp8_gemm_kernel[(tiles, split_k)](
        x, w8, s, out, res, part, cnt, g, float(norm_eps), M, N, K, kb, per, split_k, x.stride(0), w8.stride(0),
        s.stride(0), out.stride(0), res.stride(0), SCALE=scale_kind, SCALE_N=sn, SCALE_K=sk, A8=a8,
        HAS_RES=residual is not None, SPLIT=split_k > 1, NORM=norm_weight is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, BLOCK_M=block_m, UPCAST=_INTERPRET, num_warps=num_warps, num_stages=num_stages)
    return out


# ------------------------------------------------------------------------------------- routed experts
@triton.jit
def _moe_gemm_fp8_kernel(a_ptr, w_ptr, s_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, topk_w_ptr,
                         N, K, T, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                         TOPK: tl.constexpr, A_PER_PAIR: tl.constexpr, MUL_W: tl.constexpr, SCALE_N: tl.constexpr,
                         A8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         UPCAST: tl.constexpr):
    """One aligned 16-pair tile of one expert x BLOCK_N output rows (stock's fused-MoE grid): the e4m3 weight tile
    to bf16 (exact) - or, with ``A8``, the pairs' activation rows quantized to e4m3 per K block for the FP8 tensor
    cores - ``dot(W[BLOCK_N, BLOCK_K], A^T[BLOCK_K, BLOCK_M])`` per K block, each partial scaled by its rows' fp32
    block scale (BLOCK_K = the scale block's K)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair, valid, a_row, expert = tile_pairs(sorted_ptr, expert_ids_ptr, pid_m, T, TOPK, A_PER_PAIR, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    w_rows = w_ptr + expert * stride_we + n.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + expert * stride_se + (n // SCALE_N).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < K
        w8 = tl.load(w_rows + k[None, :], mask=nm[:, None] & km[None, :], other=0).to(tl.float8e4nv, bitcast=True)
        at = tl.load(a_ptr + a_row[None, :] * stride_am + k[:, None], mask=valid[None, :] & km[:, None], other=0.0)
        sv = tl.load(s_rows + k0 // BLOCK_K, mask=nm, other=0.0)
        if A8:
            xq, sx = _e4m3_columns(at)
            if UPCAST:
                part = tl.dot(w8.to(tl.float32), xq) * sx[None, :]
            else:
                part = tl.dot(w8, xq.to(tl.float8e4nv)) * sx[None, :]
        elif UPCAST:
            part = tl.dot(w8.to(tl.float32), at.to(tl.float32))
        else:
            part = tl.dot(w8.to(tl.bfloat16), at.to(tl.bfloat16))
        acc += part * sv[:, None]
    if MUL_W:
        acc = acc.to(tl.bfloat16).to(tl.float32) * tl.load(topk_w_ptr + pair, mask=valid, other=0.0)[None, :]
    o_ptrs = out_ptr + pair.to(tl.int64)[None, :] * stride_om + n[:, None]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[None, :] & nm[:, None])


def moe_gemm_fp8(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor, align, top_k: int, *, out: torch.Tensor,
                 a_per_pair: bool, scale_block: tuple[int, int], topk_weights: torch.Tensor | None = None,
                 a8: bool = False, block_n: int = 64, num_warps: int = 4, num_stages: int = 3) -> None:
    """out[pair] = a[row of pair] @ deq(W[expert of pair])^T (x routing weight) over the aligned tiles.

    a [M, K] (token rows) or [M*k, K] (a_per_pair) bf16; w [E, N, K] e4m3 codes (uint8 or float8_e4m3fn);
    s [E, ceil(N / r), ceil(K / c)] fp32 block scales (``scale_block`` = (r, c)); out [M*k, N] (unit column stride);
    align: ``triton_moe.AlignBuffers``; topk_weights [M*k] fp32 (multiplied after the bf16 rounding of the row);
    ``a8``: the activation rows quantized to e4m3 per (row, K block) in the kernel (W8A8)."""
    E, N, K = w.shape
    sz = align.sizes
    w8 = w.view(torch.uint8) if w.dtype != torch.uint8 else w
    grid = (sz.max_blocks, triton.cdiv(N, block_n))
    _moe_gemm_fp8_kernel[grid](a, w8, s, out, align.sorted_ids, align.expert_ids, align.num_padded,
                               topk_weights if topk_weights is not None else s, N, K, sz.pairs, a.stride(0),
                               w8.stride(0), w8.stride(1), s.stride(0), s.stride(1), out.stride(0),
                               TOPK=top_k, A_PER_PAIR=a_per_pair, MUL_W=topk_weights is not None,
                               SCALE_N=scale_block[0], A8=a8, BLOCK_M=sz.block_m, BLOCK_N=block_n,
                               BLOCK_K=scale_block[1], UPCAST=_INTERPRET, num_warps=num_warps, num_stages=num_stages)


def quantize_activations_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The W8A8 path's activation rounding in torch: ``x [M, K]`` -> (e4m3 codes as fp32 ``[M, K]``, scales fp32
    ``[M, ceil(K / group)]``), scale = max(amax of the (token, group) slice, 1e-10) / 448."""
    M, K = x.shape
    g = -(-K // group)
    xp = torch.nn.functional.pad(x.float(), (0, g * group - K)).reshape(M, g, group)
    sx = xp.abs().amax(-1).clamp_min(ACT_EPS) / E4M3_MAX
    q = (xp / sx[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return q.reshape(M, g * group)[:, :K], sx


__all__ = ["SCALE_FP32", "SCALE_UE8M0", "E4M3_MAX", "ACT_EPS", "MIN_UE8M0", "MAX_UE8M0", "fp8_block_gemm",
           "moe_gemm_fp8", "quantize_activations_reference"]
