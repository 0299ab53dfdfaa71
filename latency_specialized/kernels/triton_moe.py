"""Triton fused-MoE kernels: grouped top-k routing, sort/align, fused expert GEMM, activation, sum.

The stock composition of the bench runs them (``bench/stock``), and so does ours from about 8 tokens
per step (``moe.experts.triton_fused``, ``kernels/moe_experts_triton.py``), where the tensor cores pay.
This is the shape of stock vLLM's Triton fused MoE at decode:

1. ``grouped_topk`` - sigmoid scores + selection bias, top-k, renormalise, scale (one kernel);
2. ``moe_align`` - sort the (token, k) pairs by expert and pad each expert's run to BLOCK_M rows,
   so that every BLOCK_M tile of the GEMM reads one expert's weights (one kernel, one program:
   decode has at most 64 x 16 pairs);
3. ``moe_gemm`` - gate/up over the selected experts only (tiles beyond the padded count exit at
   once, so the grid is static and graph-capturable);
4. ``situ_and_mul`` - Kimi K3's SiTU-GLU activation;
5. ``moe_gemm`` again for the down projection, scaled by the routing weight per pair;
6. ``moe_sum`` - sum over the top-k pairs of each token.

Per-route results (``moe.experts`` with ``per_route=True``, for a per-expert post-norm applied by
``moe.finalize``): step 5 without ``topk_weights`` writes each pair's unweighted row straight into the
``[M*top_k, N]`` view of the result (``out`` row stride taken), and step 6 is skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


# The Triton interpreter (CPU tests) mis-computes bf16 tl.dot; it gets an fp32 dot instead.
# Compiled kernels always take the bf16 tensor-core path.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def sigmoid(x):
    """fp32 logistic function (a jit helper other Triton kernels call)."""
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def tanh(x):
    """fp32 tanh through the logistic function (a jit helper other Triton kernels call)."""
    return 2.0 * sigmoid(2.0 * x) - 1.0


_sigmoid, _tanh = sigmoid, tanh  # the names this module's kernels use


# ------------------------------------------------------------------------------------- routing
@triton.jit
def _topk_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, stride_l, E, scaling, renorm_eps,
                 TOPK: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    m = e < E
    s = _sigmoid(tl.load(logits_ptr + row * stride_l + e, mask=m, other=0.0).to(tl.float32))
    sel = tl.where(m, s + tl.load(bias_ptr + e, mask=m, other=0.0).to(tl.float32), -float("inf"))
    k = tl.arange(0, TOPK)
    ids = tl.zeros([TOPK], dtype=tl.int32)
    ws = tl.zeros([TOPK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        best = tl.argmax(sel, 0)  # first maximum: ties go to the lower expert id
        ids = tl.where(k == j, best, ids)
        ws = tl.where(k == j, tl.sum(tl.where(e == best, s, 0.0), 0), ws)
        sel = tl.where(e == best, -float("inf"), sel)
    if RENORM:
        ws = ws / (tl.sum(ws, 0) + renorm_eps)
    tl.store(w_ptr + row * TOPK + k, ws * scaling)
    tl.store(ids_ptr + row * TOPK + k, ids)


def grouped_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, *, renormalize: bool = True,
                 scaling: float = 1.0, renorm_eps: float = 0.0, weights: torch.Tensor, ids: torch.Tensor):
    """Sigmoid + bias-corrected top-k (one group). logits [M, E]; weights [M, k] fp32; ids [M, k] int32."""
    M, E = logits.shape
    _topk_kernel[(M,)](logits, bias, weights, ids, logits.stride(0), E, scaling, renorm_eps,
                       TOPK=top_k, RENORM=renormalize, BLOCK_E=triton.next_power_of_2(E), num_warps=4)
    return weights, ids


# ------------------------------------------------------------------------------------- sort / align
@dataclass(frozen=True)
class AlignSizes:
    """Static sizes of the align outputs for ``pairs`` (token, k) pairs over ``experts`` experts."""

    pairs: int
    experts: int
    block_m: int

    @property
    def max_padded(self) -> int:
        """Upper bound of the padded pair count: every used expert pads at most block_m - 1 rows."""
        used = min(self.experts, self.pairs)
        return triton.cdiv(self.pairs + used * (self.block_m - 1), self.block_m) * self.block_m

    @property
    def max_blocks(self) -> int:
        return self.max_padded // self.block_m


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, scratch_ptr, T, E,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                  MAX_RUN_BLOCKS: tl.constexpr, FILL_CHUNKS: tl.constexpr):
    t = tl.arange(0, BLOCK_T)
    tm = t < T
    # padding lands in bin BLOCK_E - 1, which is never an expert: BLOCK_E = next_pow2(E + 1) > E
    ids = tl.load(ids_ptr + t, mask=tm, other=BLOCK_E - 1).to(tl.int32)
    e = tl.arange(0, BLOCK_E)
    counts = tl.histogram(ids, BLOCK_E)
    counts = tl.where(e < E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = tl.cumsum(counts, 0) - counts
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    # expert of every BLOCK_M tile: each expert writes its own run of tiles
    nblk = padded // BLOCK_M
    for r in tl.static_range(MAX_RUN_BLOCKS):
        tl.store(expert_ids_ptr + pad_start // BLOCK_M + r, e, mask=(r < nblk) & (e < E))
    # every padded slot first holds the sentinel T (no pair) ...
    for c in tl.static_range(FILL_CHUNKS):
        tl.store(sorted_ptr + c * BLOCK_T + t, T)
    tl.store(scratch_ptr + e, pad_start - cnt_start)
    tl.debug_barrier()
    # ... then pairs go to their slot: sort by (expert, pair index), shift by the expert's padding
    key = tl.where(tm, ids * BLOCK_T + t, BLOCK_E * BLOCK_T + t)
    key = tl.sort(key, 0)
    expert = key // BLOCK_T
    pair = key % BLOCK_T
    valid = expert < E
    shift = tl.load(scratch_ptr + expert, mask=valid, other=0)
    tl.store(sorted_ptr + t + shift, pair, mask=valid)


def align_bins(experts: int) -> int:
    """Histogram bins of the align kernel: one more than the experts, so that the masked lanes' bin is never a
    real expert's (with E a power of two, bin E - 1 would count them: a wrong, overlong run past the buffers)."""
    return triton.next_power_of_2(experts + 1)


@dataclass
class AlignBuffers:
    """Static outputs of :func:`moe_align` (allocated once, before capture)."""

    sizes: AlignSizes
    sorted_ids: torch.Tensor
    """[max_padded] int32: pair index per padded row (sentinel = pairs)."""
    expert_ids: torch.Tensor
    """[max_blocks] int32: expert of each BLOCK_M tile."""
    num_padded: torch.Tensor
    """[1] int32: padded rows actually used."""
    scratch: torch.Tensor
    """[BLOCK_E] int32 workspace."""

    @classmethod
    def allocate(cls, sizes: AlignSizes, device: torch.device | str) -> "AlignBuffers":
        block_t = triton.next_power_of_2(sizes.pairs)
        fill = triton.cdiv(sizes.max_padded, block_t) * block_t
        return cls(sizes,
                   torch.empty(fill, dtype=torch.int32, device=device),
                   torch.empty(sizes.max_blocks, dtype=torch.int32, device=device),
                   torch.empty(1, dtype=torch.int32, device=device),
                   torch.empty(align_bins(sizes.experts), dtype=torch.int32, device=device))


def moe_align(ids: torch.Tensor, buf: AlignBuffers) -> AlignBuffers:
    """Group the [M, k] expert ids by expert, each run padded to BLOCK_M (see AlignBuffers)."""
    sz = buf.sizes
    T = ids.numel()
    assert T == sz.pairs, f"align buffers are for {sz.pairs} pairs, got {T}"
    block_t = triton.next_power_of_2(T)
    max_run = triton.cdiv(T // max(1, ids.shape[-1]) if ids.dim() > 1 else T, sz.block_m)
    _align_kernel[(1,)](ids, buf.sorted_ids, buf.expert_ids, buf.num_padded, buf.scratch, T, sz.experts,
                        BLOCK_T=block_t, BLOCK_E=align_bins(sz.experts), BLOCK_M=sz.block_m,
                        MAX_RUN_BLOCKS=max(1, max_run), FILL_CHUNKS=buf.sorted_ids.numel() // block_t,
                        num_warps=8)
    return buf


# ------------------------------------------------------------------------------------- expert GEMM
@triton.jit
def tile_pairs(sorted_ptr, expert_ids_ptr, pid_m, T, TOPK: tl.constexpr, A_PER_PAIR: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """Aligned tile ``pid_m`` of the sorted (token, route) pairs (``moe_align``'s layout): its pair ids [BLOCK_M],
    which of them are real (padding ids are >= T), the activation row each reads (int64: the token row, or the
    pair's own row with ``A_PER_PAIR``) and the tile's expert (int64). Shared by every fused-MoE GEMM here and in
    the 4-bit / FP8 kernels."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < T
    if A_PER_PAIR:
        a_row = pair.to(tl.int64)
    else:
        a_row = (pair // TOPK).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    return pair, valid, a_row, expert


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, topk_w_ptr,
                     N, K, T, stride_am, stride_we, stride_wn, stride_om,
                     TOPK: tl.constexpr, A_PER_PAIR: tl.constexpr, MUL_W: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair, valid, a_row, expert = tile_pairs(sorted_ptr, expert_ids_ptr, pid_m, T, TOPK, A_PER_PAIR, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + kk[None, :]
    w_ptrs = w_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn + kk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        km = (k0 + kk) < K
        a = tl.load(a_ptrs, mask=valid[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=km[:, None] & nm[None, :], other=0.0)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
        else:
            acc += tl.dot(a, w)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if MUL_W:
        acc = acc * tl.load(topk_w_ptr + pair, mask=valid, other=0.0)[:, None]
    o_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nm[None, :])


def moe_gemm(a: torch.Tensor, w: torch.Tensor, align: AlignBuffers, top_k: int, *, out: torch.Tensor,
             a_per_pair: bool, topk_weights: torch.Tensor | None = None, block_n: int = 64,
             block_k: int = 128) -> torch.Tensor:
    """out[pair] = a[row of pair] @ w[expert of pair]^T (x routing weight) over the aligned tiles only.

    a : [M, K] (a_per_pair=False: token rows) or [M*k, K] (a_per_pair=True). w : [E, N, K].
    out : [M*k, N]. topk_weights : [M*k] fp32 (flattened) to scale each pair's row.
    """
    N, K = w.shape[1], w.shape[2]
    sz = align.sizes
    grid = (sz.max_blocks, triton.cdiv(N, block_n))
    _moe_gemm_kernel[grid](a, w, out, align.sorted_ids, align.expert_ids, align.num_padded,
                           topk_weights if topk_weights is not None else a, N, K, sz.pairs,
                           a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                           TOPK=top_k, A_PER_PAIR=a_per_pair, MUL_W=topk_weights is not None,
                           BLOCK_M=sz.block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=_INTERPRET,
                           num_warps=4, num_stages=4)
    return out


# ------------------------------------------------------------------------------------- activation, sum
@triton.jit
def _situ_kernel(x_ptr, out_ptr, I, beta, beta_lin, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < I
    g = tl.load(x_ptr + row * 2 * I + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * I + I + c, mask=m, other=0.0).to(tl.float32)
    y = beta * _tanh(g / beta) * _sigmoid(g) * (beta_lin * _tanh(u / beta_lin))
    tl.store(out_ptr + row * I + c, y.to(out_ptr.dtype.element_ty), mask=m)


def situ_and_mul(x: torch.Tensor, beta: float, beta_lin: float, *, out: torch.Tensor) -> torch.Tensor:
    """SiTU-GLU: x [R, 2I] = [gate | up] -> out [R, I]."""
    R, two_i = x.shape
    I = two_i // 2
    BLOCK = min(1024, triton.next_power_of_2(I))
    _situ_kernel[(R, triton.cdiv(I, BLOCK))](x, out, I, beta, beta_lin, BLOCK=BLOCK, num_warps=4)
    return out


@triton.jit
def _silu_kernel(x_ptr, out_ptr, I, clamp, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < I
    g = tl.load(x_ptr + row * 2 * I + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * I + I + c, mask=m, other=0.0).to(tl.float32)
    if CLAMP:  # DeepSeek-V4's SwiGLU clamp (ops.activation): g <= c, |u| <= c
        g = tl.minimum(g, clamp)
        u = tl.minimum(tl.maximum(u, -clamp), clamp)
    y = g * _sigmoid(g) * u
    tl.store(out_ptr + row * I + c, y.to(out_ptr.dtype.element_ty), mask=m)


def silu_and_mul(x: torch.Tensor, clamp: float | None = None, *, out: torch.Tensor) -> torch.Tensor:
    """SwiGLU: x [R, 2I] = [gate | up] -> out [R, I] = silu(g) * u (clamped where ``clamp`` is set)."""
    R, two_i = x.shape
    I = two_i // 2
    BLOCK = min(1024, triton.next_power_of_2(I))
    _silu_kernel[(R, triton.cdiv(I, BLOCK))](x, out, I, float(clamp or 0.0), CLAMP=clamp is not None, BLOCK=BLOCK,
                                             num_warps=4)
    return out


@triton.jit
def _moe_sum_kernel(x_ptr, out_ptr, N, TOPK: tl.constexpr, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    prior = tl.zeros([BLOCK], dtype=tl.float32)
    if ACCUMULATE:  # loaded first: its latency overlaps the pairs' loads
        prior = tl.load(out_ptr + row * N + c, mask=m, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(x_ptr + (row * TOPK + j) * N + c, mask=m, other=0.0).to(tl.float32)
    y = acc.to(out_ptr.dtype.element_ty)
    if ACCUMULATE:  # the sum rounded first, then one more rounding: y + addend as torch adds two bf16 tensors
        y = (y.to(tl.float32) + prior).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + c, y, mask=m)


def moe_sum(x: torch.Tensor, top_k: int, *, out: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """x [M*k, N] -> out [M, N]: sum over each token's k pairs (fp32 accumulate). ``accumulate``: ``out`` holds an
    addend, ``out = round(round(sum) + out)`` (``kernels/moe_addend.py``). ``out`` contiguous."""
    N = x.shape[1]
    M = out.shape[0]
    if accumulate and (out.stride(-1) != 1 or out.stride(0) != N):
        raise ValueError(f"moe_sum: accumulate needs a contiguous [M, {N}] out, got strides {out.stride()}")
    BLOCK = 1024
    _moe_sum_kernel[(M, triton.cdiv(N, BLOCK))](x, out, N, TOPK=top_k, BLOCK=BLOCK, ACCUMULATE=bool(accumulate),
                                                num_warps=4)
    return out
