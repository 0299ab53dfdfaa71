"""Routed experts through the Triton fused-MoE kernels (``moe.experts.triton_fused``), for many tokens.

Our CuTe DSL experts kernels (``moe_experts.py``) dot every selected expert's rows with its tokens
on CUDA cores. That is the fastest way to read an expert once when it serves one token, but the
work per weight byte grows with the tokens an expert serves, and from about 8 tokens per step the
kernels are compute-bound (H200, TP8 Kimi K3 layer: 135 vs ~129 us per layer at batch 4, 223 vs
186 us at batch 8, 1032 vs 625 us at batch 64, against the tensor-core Triton fused MoE of the
stock composition). Until a tensor-core CuTe DSL grouped kernel exists, multi-token buckets use the
same tensor-core Triton kernels stock vLLM's fused MoE uses (``kernels/triton_moe.py``, which the
stock composition runs too: sort/align, gate/up GEMM, SiTU-GLU, down GEMM x routing weight, sum over
top-k: 5 kernels), so our decode is never slower than stock's on the experts. Plans say which one serves each bucket (``latency-specialized explain``).

Static shapes: the align buffers depend on (tokens x top_k, experts) only and are allocated on the
first (eager, pre-capture) call of each shape; nothing syncs with the host.
"""

from __future__ import annotations

import importlib.util

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.registry import Implementation, OpContext, Support
from latency_specialized.spec import ActivationSpec

NAME = "moe.experts.triton_fused"
BLOCK_M = 16
"""Rows (token, expert) pairs per expert tile: the smallest tensor-core tile tl.dot takes."""

_align_cache: dict[tuple, object] = {}


def _align_buffers(pairs: int, experts: int, device: torch.device):
    from latency_specialized.kernels import triton_moe as moe_k

    key = (pairs, experts, device)
    buf = _align_cache.get(key)
    if buf is None:
        buf = moe_k.AlignBuffers.allocate(moe_k.AlignSizes(pairs, experts, BLOCK_M), device)
        _align_cache[key] = buf
    return buf


def experts_triton(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                   w_down: torch.Tensor, activation: ActivationSpec, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts (contract: ``ops.moe.experts_reference``) with the Triton fused-MoE kernels.

    Parameters
    ----------
    x : [M, K] bf16; weights : [M, top_k] fp32; ids : [M, top_k] int32/int64;
    w_gate_up : [E, 2I, K] (gate rows, then up rows); w_down : [E, N, I]; out : optional [M, N].

    Returns
    -------
    [M, N] in x.dtype. Rounding: gate/up to bf16, activation to bf16, each pair's down output
    x routing weight to bf16, fp32 sum over the top-k (stock vLLM's fused MoE order).
    """
    from latency_specialized.kernels import triton_moe as moe_k

    if activation.kind != "situ_glu":
        raise UserError(f"{NAME} implements SiTU-GLU only (got {activation.kind}): use moe.experts.cutedsl")
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
    align = _align_buffers(T, E, x.device)
    moe_k.moe_align(ids, align)
    gu = torch.empty(T, two_i, device=x.device, dtype=x.dtype)
    moe_k.moe_gemm(x, w_gate_up, align, top_k, out=gu, a_per_pair=False)
    act = torch.empty(T, I, device=x.device, dtype=x.dtype)
    moe_k.situ_and_mul(gu, activation.beta, activation.beta_lin, out=act)
    yp = torch.empty(T, N, device=x.device, dtype=x.dtype)
    w_flat = weights.reshape(-1)
    if w_flat.dtype != torch.float32:
        w_flat = w_flat.float()
    moe_k.moe_gemm(act, w_down, align, top_k, out=yp, a_per_pair=True, topk_weights=w_flat)
    y = out if out is not None else torch.empty(M, N, device=x.device, dtype=x.dtype)
    moe_k.moe_sum(yp, top_k, out=y)
    return y


MIN_TOKENS = 4
"""Buckets from which this implementation serves, measured in the graphed TP8 Kimi K3 layer on the
H200 (benchmarks/results/h200/profile_kimi_k3_tp8.json): batch 1 CuTe DSL 42 vs Triton 54 us per
layer; batch 4 CuTe DSL 135 vs Triton ~129 us; batch 8 223 vs 186; batch 64 1032 vs 625. Batch 2
was not measured separately and stays on the CuTe DSL kernels. From this bucket on, this
implementation outranks them (priority 15 vs 10)."""


def _supports(ctx: OpContext) -> Support:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if not ctx.arch.startswith("sm_") or int(ctx.arch[3:5]) < 80:
        return f"needs a CUDA GPU with tensor cores (sm_80+), got {ctx.arch}"
    if ctx.dtype != "bfloat16":
        return f"dtype {ctx.dtype} (bf16 only)"
    if ctx.attr("activation") != "situ_glu":
        return f"activation {ctx.attr('activation')} (SiTU-GLU only)"
    if ctx.tokens < MIN_TOKENS:
        return f"{ctx.tokens} tokens: the CuTe DSL experts kernels are faster below {MIN_TOKENS}"
    return True


IMPLEMENTATIONS = [
    Implementation("moe.experts", NAME, experts_triton, _supports, priority=15,
                   description="tensor-core Triton fused MoE (stock's kernels: align, gate/up, act, down, sum) "
                               f"for >= {MIN_TOKENS} tokens, where the CUDA-core CuTe DSL kernels are compute-bound"),
]
