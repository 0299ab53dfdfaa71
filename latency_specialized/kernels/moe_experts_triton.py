"""Routed experts through the Triton fused-MoE kernels (``moe.experts.triton_fused``), for many tokens.

Our CuTe DSL experts kernels (``moe_experts.py``) dot every selected expert's rows with its tokens
on CUDA cores. That is the fastest way to read an expert once when it serves few tokens, but the
work per weight byte grows with the tokens an expert serves: for Kimi K3 TP8 (expert width 384 per
rank) the tensor-core Triton fused MoE of the stock composition is faster from 8 tokens
(``MIN_TOKENS``); for narrow experts (TP16, 192) the CuTe DSL kernels win at every measured batch
(``MAX_CUTEDSL_WIDTH``). Until a tensor-core CuTe DSL grouped kernel exists, the other cells use
the same tensor-core Triton kernels stock vLLM's fused MoE uses (``kernels/triton_moe.py``, which the
stock composition runs too: sort/align, gate/up GEMM, SiTU-GLU, down GEMM x routing weight, sum over
top-k: 5 kernels), so our decode is never slower than stock's on the experts. Plans say which one serves each bucket (``latency-specialized explain``).

Static shapes: the align buffers depend on (tokens x top_k, experts) only and are allocated on the
first (eager, pre-capture) call of each shape; nothing syncs with the host.
"""

from __future__ import annotations

import importlib.util

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.kernels.moe_addend import Addend, accumulate_target, check_addend_use
from latency_specialized.spec import ActivationSpec

NAME = "moe.experts.triton_fused"
BLOCK_M = 16
"""Rows (token, expert) pairs per expert tile: the smallest tensor-core tile tl.dot takes."""

_align_cache: dict[tuple, object] = {}


def align_buffers(pairs: int, experts: int, device: torch.device):
    """The align outputs for (pairs, experts) on ``device``, allocated on first use and reused (static for graphs)."""
    from latency_specialized.kernels import triton_moe as moe_k

    key = (pairs, experts, device)
    buf = _align_cache.get(key)
    if buf is None:
        buf = moe_k.AlignBuffers.allocate(moe_k.AlignSizes(pairs, experts, BLOCK_M), device)
        _align_cache[key] = buf
    return buf


def route_rows(y: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The ``[M*top_k, N]`` rows view of a per-route result ``y [M, top_k, N]`` that a GEMM can store into in
    place (pair p = m * top_k + j is row p; a row stride is taken), and True; or a temporary and False where
    (m, j) do not collapse into one strided dimension (the caller copies it back)."""
    M, top_k, N = y.shape
    if y.stride(2) == 1 and (M == 1 or y.stride(0) == top_k * y.stride(1)):
        return y.as_strided((M * top_k, N), (y.stride(1), 1)), True
    return torch.empty(M * top_k, N, device=y.device, dtype=y.dtype), False


def experts_triton(x: torch.Tensor, weights: torch.Tensor | None, ids: torch.Tensor, w_gate_up: torch.Tensor,
                   w_down: torch.Tensor, activation: ActivationSpec, *, per_route: bool = False,
                   out: torch.Tensor | None = None, addend: Addend = None) -> torch.Tensor:
    """Routed experts (contract: ``ops.moe.experts_reference``) with the Triton fused-MoE kernels.

    Parameters
    ----------
    x : [M, K] bf16; weights : [M, top_k] fp32 (ignored with ``per_route``); ids : [M, top_k] int32/int64;
    w_gate_up : [E, 2I, K] (gate rows, then up rows); w_down : [E, N, I].
    per_route : every route's expert output, unweighted, instead of the combination.
    out : optional [M, N] ([M, top_k, N] with ``per_route``; unit stride in N).
    addend : [M, N] (or a callable returning it) that the sum kernel adds (``kernels/moe_addend.py``).

    Returns
    -------
    [M, N] in x.dtype. Rounding: gate/up to bf16, activation to bf16, each pair's down output
    x routing weight to bf16, fp32 sum over the top-k (stock vLLM's fused MoE order).
    ``per_route``: [M, top_k, N], each pair's down output rounded once to bf16 (the down GEMM writes
    the rows in place: 4 kernels, no weighting, no sum).
    """
    from latency_specialized.kernels import triton_moe as moe_k

    if activation.kind not in ("situ_glu", "swiglu"):
        raise UserError(f"{NAME} implements SiTU-GLU and SwiGLU (got {activation.kind}): use moe.experts.cutedsl")
    check_addend_use(addend, per_route, NAME)
    M, K = x.shape
    top_k = ids.shape[1]
    E, two_i, K2 = w_gate_up.shape
    I = two_i // 2
    N = w_down.shape[1]
    if K2 != K or tuple(w_down.shape) != (E, N, I):
        raise UserError(f"{NAME}: shapes x{tuple(x.shape)} w_gate_up{tuple(w_gate_up.shape)} "
                        f"w_down{tuple(w_down.shape)} do not match the [M,K], [E,2I,K], [E,N,I] contract")
    x = x.contiguous()
    T = M * top_k
    align = align_buffers(T, E, x.device)
    moe_k.moe_align(ids, align)
    gu = torch.empty(T, two_i, device=x.device, dtype=x.dtype)
    moe_k.moe_gemm(x, w_gate_up, align, top_k, out=gu, a_per_pair=False)
    act = torch.empty(T, I, device=x.device, dtype=x.dtype)
    if activation.kind == "swiglu":
        moe_k.silu_and_mul(gu, activation.clamp, out=act)
    else:
        moe_k.situ_and_mul(gu, activation.beta, activation.beta_lin, out=act)
    if per_route:
        y = out if out is not None else torch.empty(M, top_k, N, device=x.device, dtype=x.dtype)
        if tuple(y.shape) != (M, top_k, N):
            raise UserError(f"{NAME}: per_route out {tuple(y.shape)} must be [{M}, {top_k}, {N}]")
        yp, direct = route_rows(y)
        moe_k.moe_gemm(act, w_down, align, top_k, out=yp, a_per_pair=True)
        if not direct:
            y.copy_(yp.view(M, top_k, N))
        return y
    yp = torch.empty(T, N, device=x.device, dtype=x.dtype)
    w_flat = weights.reshape(-1)
    if w_flat.dtype != torch.float32:
        w_flat = w_flat.float()
    moe_k.moe_gemm(act, w_down, align, top_k, out=yp, a_per_pair=True, topk_weights=w_flat)
    return sum_routes(yp, top_k, out, addend, x.dtype, NAME)


def sum_routes(yp: torch.Tensor, top_k: int, out: torch.Tensor | None, addend: Addend, dtype: torch.dtype,
               what: str) -> torch.Tensor:
    """The last stage of the Triton fused-MoE paths: ``yp [M*top_k, N]`` (weighted route rows) summed per token into
    ``out`` (or a new ``[M, N]``), the addend added in the same kernel (resolved here, after the GEMMs)."""
    from latency_specialized.kernels import triton_moe as moe_k

    M, N = yp.shape[0] // top_k, yp.shape[1]
    y = accumulate_target(addend, out, M, N, dtype, what)
    if y is None:
        y = out if out is not None else torch.empty(M, N, device=yp.device, dtype=dtype)
    return moe_k.moe_sum(yp, top_k, out=y, accumulate=addend is not None)


MIN_TOKENS = 8
"""Buckets from which this implementation serves. H200, Kimi K3 TP8 (per-rank expert width 384),
routed experts alone (benchmarks/results/h200/ops_moe_experts_sweep.md, after the CuTe DSL ``down``
grid went to one wave): CuTe DSL vs Triton 74.2 vs 85.0 us at 2 tokens, 141.5 vs 144.0 at 4, 266.5
vs 253.4 at 8, 477 vs 446 at 16, 1306 vs 1198 at 64. From this bucket on, this implementation
outranks them (priority 15 vs 10).

Counted in rows, also for verification steps (1 + k rows per request) whose rows share their request's
experts: the CuTe DSL kernels read such an expert once but dot it with every row on CUDA cores, so their
cost grows with the rows all the same (H200, Kimi K3 TP8, 8 rows of one request, all on the same 16
experts: gate/up 103 + down 42 us vs ~60 us here; the whole KDA layer 227 vs 144 us, NOTES_verify.md
session 28)."""
MAX_CUTEDSL_WIDTH = 192
"""Per-rank expert widths up to this stay on the CuTe DSL kernels at every batch: Kimi K3 TP16 (192),
same sweep: CuTe DSL 41 / 74 / 130 / 240 / 406 / 662 us vs Triton 58 / 91 / 155 / 272 / 446 / 700
at 2 / 4 / 8 / 16 / 32 / 64 tokens (the gate/up rows of a narrow expert are too few for Triton's
16-row tensor-core tiles to pay)."""


def _supports(ctx: OpContext) -> Support:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if not ctx.arch.startswith("sm_") or int(ctx.arch[3:5]) < 80:
        return f"needs a CUDA GPU with tensor cores (sm_80+), got {ctx.arch}"
    if ctx.dtype != "bfloat16":
        return f"dtype {ctx.dtype} (bf16 only)"
    if ctx.attr("weight_format"):
        return f"weights {ctx.attr('weight_format')}: bf16 expert weights only (the 4-bit experts serve these)"
    if ctx.attr("activation") not in ("situ_glu", "swiglu"):
        return f"activation {ctx.attr('activation')} (SiTU-GLU or SwiGLU only)"
    if ctx.tokens < MIN_TOKENS:
        return f"{ctx.tokens} tokens: the CuTe DSL experts kernels are faster below {MIN_TOKENS}"
    width = ctx.dim("N")
    if width <= MAX_CUTEDSL_WIDTH:
        return (f"per-rank expert width {width} <= {MAX_CUTEDSL_WIDTH}: the CuTe DSL experts kernels are faster "
                "at every measured batch")
    return True


IMPLEMENTATIONS = [
    Implementation("moe.experts", NAME, experts_triton, _supports, priority=15,
                   description="tensor-core Triton fused MoE (stock's kernels: align, gate/up, act, down, sum) "
                               f"for >= {MIN_TOKENS} tokens and experts wider than {MAX_CUTEDSL_WIDTH} per rank, where the "
                               "CUDA-core CuTe DSL kernels are slower (per_route: unweighted down rows, no sum)"),
]
