"""Per-route post-norm + weighted top-k sum of routed experts (``moe.finalize.triton``): one Triton kernel.

Muse Spark normalises every selected expert's output before the routing weight:
``out[m] = sum_j w[m, j] * rmsnorm(y[m, j])`` (contract: ``ops.moe.finalize_reference``). The input is
``experts(..., per_route=True)``'s ``[M, top_k, N]`` rows (at TP > 1 all-reduced first: the norm
needs each route's full sum).

Grid: one program per token. It reads the token's ``top_k`` route rows and the gain (whole rows in registers:
N <= ``MAX_N``), scales each row by the gain and rounds it to the activation dtype (input-scaled norm), takes its
sum of squares, and sums ``w * r * rsqrt(...)`` over the routes in fp32 (a fixed tree: deterministic), rounded once
at the store. Where the token's rows fit 16 warps' registers (``ALL_ROUTES_MAX``: Muse Spark's 8 x 4096 do) they are
one [top_k, N] tile, so every load is issued before the one block reduction; wider tokens loop over the routes, and
there each row's loads wait for the previous row's reduction (a barrier the compiler does not move loads across:
one dependent DRAM round trip per route; ``kernels/NOTES.md``, session 38).

Bytes (Muse TP8 rank: N 4096, top-8, bf16): 64 KiB in + 8 KiB out per token; M = 64 moves 4.7 MB (about a
microsecond of HBM time), M = 1 is latency-bound (one program). Measurements: ``kernels/NOTES.md``.
"""

from __future__ import annotations

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.kernels.triton_common import triton_gpu_refusal

NAME = "moe.finalize.triton"
MAX_N = 16384
"""Widest route row: the row sits in registers (BLOCK_N / (32 x warps) fp32 per thread, x2 with the
accumulator)."""
MAX_TOPK = 32
"""Most routes per token (the route loop is unrolled)."""

_kernel = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def finalize_kernel(y_ptr, w_ptr, g_ptr, out_ptr, N, eps, stride_ym, stride_yk, stride_wm, stride_wk,
                        stride_om, TOPK: tl.constexpr, HAS_GAIN: tl.constexpr, GAIN_FIRST: tl.constexpr,
                        ZERO_CENTERED: tl.constexpr, BLOCK_N: tl.constexpr, ALL_ROUTES: tl.constexpr,
                        TOPK_P2: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        n = tl.arange(0, BLOCK_N)
        nm = n < N
        if ALL_ROUTES:
            # every route row in one [TOPK_P2, BLOCK_N] tile: all loads issued before the one reduction (a
            # barrier: the per-route loop's row j + 1 waits for row j's, one DRAM round trip per route)
            j = tl.arange(0, TOPK_P2)
            jm = j < TOPK
            rows = tl.load(y_ptr + m * stride_ym + j[:, None] * stride_yk + n[None, :],
                           mask=jm[:, None] & nm[None, :], other=0.0).to(tl.float32)
            wt = tl.load(w_ptr + m * stride_wm + j * stride_wk, mask=jm, other=0.0).to(tl.float32)
            if HAS_GAIN:
                g = tl.load(g_ptr + n, mask=nm, other=0.0).to(tl.float32)
                if ZERO_CENTERED:
                    g = g + 1.0
                if GAIN_FIRST:
                    rows = (rows * g[None, :]).to(y_ptr.dtype.element_ty).to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(rows * rows, 1) / N + eps)
            rows = rows * (wt * inv)[:, None]
            if HAS_GAIN:
                if not GAIN_FIRST:
                    rows = rows * g[None, :]
            acc = tl.sum(rows, 0)
            tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=nm)
            return
        if HAS_GAIN:
            g = tl.load(g_ptr + n, mask=nm, other=0.0).to(tl.float32)
            if ZERO_CENTERED:
                g = g + 1.0
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            r = tl.load(y_ptr + m * stride_ym + j * stride_yk + n, mask=nm, other=0.0).to(tl.float32)
            if HAS_GAIN:
                if GAIN_FIRST:
                    # input-scaled norm: the scaled row is rounded to the activation dtype, as the model does
                    r = (r * g).to(y_ptr.dtype.element_ty).to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(r * r, 0) / N + eps)
            wt = tl.load(w_ptr + m * stride_wm + j * stride_wk).to(tl.float32)
            r = r * inv
            if HAS_GAIN:
                if not GAIN_FIRST:
                    r = r * g
            acc += wt * r
        tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=nm)

    return finalize_kernel


def _get_kernel():
    global _kernel
    if _kernel is None:
        _kernel = _build()
    return _kernel


ALL_ROUTES_MAX = 32768
"""Largest route tile (top_k rounded up to a power of two x BLOCK_N) read at once: 64 fp32 a thread at 16 warps.
Wider tokens take the per-route loop (one row in registers at a time)."""


def _warps(block_n: int) -> int:
    # 16 fp32 per thread per row at N = 4096 with 8 warps: 16-byte loads, a short reduction tree
    return max(1, min(16, block_n // 512))


def all_routes(top_k: int, block_n: int) -> bool:
    """Whether a token's route rows are read as one tile (every load before the reduction) - on 16 warps."""
    return _next_power_of_2(top_k) * block_n <= ALL_ROUTES_MAX


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def finalize_triton(y: torch.Tensor, weights: torch.Tensor, gain: torch.Tensor | None, eps: float, *,
                    gain_before_norm: bool = True, zero_centered: bool = True,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-route RMSNorm + weighted sum (contract: ``ops.moe.finalize_reference``), one kernel.

    Parameters
    ----------
    y : [M, top_k, N] (bf16/fp16/fp32, unit stride in N). weights : [M, top_k] (fp32; other float
    dtypes are read and widened). gain : [N] or None. eps, gain_before_norm, zero_centered : as the
    reference. out : optional [M, N] in y.dtype, unit column stride (rows may be strided).

    Returns
    -------
    [M, N] in y.dtype.
    """
    import triton

    if y.dim() != 3 or tuple(weights.shape) != tuple(y.shape[:2]):
        raise UserError(f"{NAME}: y {tuple(y.shape)} and weights {tuple(weights.shape)} must be [M, top_k, N] "
                        "and [M, top_k]")
    M, top_k, N = y.shape
    if N > MAX_N or top_k > MAX_TOPK:
        raise UserError(f"{NAME}: N={N} (<= {MAX_N}) and top_k={top_k} (<= {MAX_TOPK}): use moe.finalize.reference")
    if gain is not None and (tuple(gain.shape) != (N,) or gain.stride(0) != 1):
        raise UserError(f"{NAME}: gain {tuple(gain.shape)} must be a contiguous [{N}]")
    if y.stride(2) != 1:
        y = y.contiguous()
    if weights.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        weights = weights.float()
    o = out if out is not None else torch.empty(M, N, dtype=y.dtype, device=y.device)
    if tuple(o.shape) != (M, N) or o.stride(1) != 1 or o.dtype != y.dtype:
        raise UserError(f"{NAME}: out {tuple(o.shape)} {o.dtype} must be [{M}, {N}] {y.dtype} with unit column stride")
    if M == 0:
        return o
    block_n = triton.next_power_of_2(N)
    tile = all_routes(top_k, block_n)
    _get_kernel()[(M,)](y, weights, gain if gain is not None else y, o, N, float(eps),
                        y.stride(0), y.stride(1), weights.stride(0), weights.stride(1), o.stride(0),
                        TOPK=top_k, HAS_GAIN=gain is not None, GAIN_FIRST=bool(gain_before_norm),
                        ZERO_CENTERED=bool(zero_centered), BLOCK_N=block_n, ALL_ROUTES=tile,
                        TOPK_P2=_next_power_of_2(top_k), num_warps=16 if tile else _warps(block_n))
    return o


def _dim(ctx: OpContext, name: str) -> int | None:
    try:
        return ctx.dim(name)
    except KeyError:
        return None


def _supports(ctx: OpContext) -> Support:
    refusal = triton_gpu_refusal(ctx, "the per-route norm + sum")
    if refusal:
        return refusal
    n, k = _dim(ctx, "N"), _dim(ctx, "topk")
    if n is None or k is None:
        return "the site declares no N (route width) / topk dims"
    if n > MAX_N:
        return f"N={n} > {MAX_N} (a route row must fit one program's registers)"
    if k > MAX_TOPK:
        return f"topk={k} > {MAX_TOPK} (the route loop is unrolled)"
    return True


IMPLEMENTATIONS = [
    Implementation("moe.finalize", NAME, finalize_triton, _supports, priority=10, strided_out=True,
                   description="one program per token: each route row read once, (gain,) RMSNorm in fp32, "
                               "weighted fp32 sum over the routes in order, one rounding"),
]

__all__ = ["finalize_triton", "IMPLEMENTATIONS", "NAME", "MAX_N", "MAX_TOPK"]
