"""Stand-in for stock vLLM 0.33's block-FP8 linear on Hopper (W8A8, 1 x 128 activation / 128 x 128 weight blocks).

What stock runs (``kernels/linear/scaled_mm/cutlass.py::CutlassFp8BlockScaledMMKernel``, the first entry of
``_POSSIBLE_FP8_BLOCK_KERNELS[CUDA]`` that a plain vLLM install has on an H200; the two DeepGEMM ones before it need
the ``deep_gemm`` package): the activations quantized to e4m3 per (token, 128-column group) by one kernel
(``per_token_group_quant_fp8``: scale = max(amax, 1e-10) / 448), then vLLM's CUTLASS sm90 block-scaled GEMM. That
GEMM lives in vLLM's ``_C`` library, which cannot load here (its CUDA build pins torch 2.14), so this stand-in runs
the same recipe through cuBLAS's block-scaled FP8 GEMM (``torch._scaled_mm`` with BlockWise1x128 activation scales
and BlockWise128x128 weight scales, torch >= 2.9 and CUDA >= 12.9): two launches, like stock's. Results name it a
stand-in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from latency_specialized.errors import UserError

GROUP = 128
E4M3_MAX = 448.0
EPS = 1e-10
STAND_IN = ("stand-in for vLLM 0.33's CutlassFp8BlockScaledMMKernel: one Triton per-token-group e4m3 quant + "
            "cuBLAS block-scaled FP8 GEMM (torch._scaled_mm, 1x128 / 128x128)")


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, K, G, stride_xm, stride_sk, GROUP: tl.constexpr):
    m = tl.program_id(0)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    ok = offs < K
    x = tl.load(x_ptr + m * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10) / 448.0
    q = tl.clamp(x / s, -448.0, 448.0).to(tl.float8e4nv)
    tl.store(q_ptr + m * K + offs, q, mask=ok)
    tl.store(s_ptr + m + g * stride_sk, s)  # scales [M, G] stored M-major (column-major), as cuBLAS reads them


def per_token_group_quant(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16 -> (e4m3 [M, K], fp32 scales [M, ceil(K / group)] with M-major strides), one launch."""
    M, K = x.shape
    G = triton.cdiv(K, group)
    q = torch.empty(M, K, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(G, M, device=x.device, dtype=torch.float32).t()
    _group_quant_kernel[(M, G)](x, q, s, K, G, x.stride(0), s.stride(1), GROUP=group)
    return q, s


class StockBlockFp8Linear:
    """``y = x @ deq(W)^T`` the way stock vLLM's block-FP8 linear computes it (activation quant + block-scaled GEMM)."""

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> None:
        """weight [N, K] float8_e4m3fn; weight_scale_inv [ceil(N/128), ceil(K/128)] fp32 (the checkpoint's)."""
        if weight.dtype != torch.float8_e4m3fn or weight_scale_inv.dtype != torch.float32:
            raise UserError(f"stock block-FP8 linear: e4m3 weight and fp32 block scales, got {weight.dtype} / "
                            f"{weight_scale_inv.dtype}")
        if not hasattr(torch.nn.functional, "scaled_mm"):
            raise UserError(f"torch {torch.__version__} has no block-scaled FP8 GEMM (torch >= 2.9 with CUDA >= 12.9)")
        self.w_t = weight.t()  # [K, N] column-major: cuBLAS's B operand, no copy
        self.s_w = weight_scale_inv.t()  # [K/128, N/128]
        self.n = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bf16 -> [M, N] bf16."""
        from torch.nn.functional import ScalingType, scaled_mm

        q, s = per_token_group_quant(x)
        return scaled_mm(q, self.w_t, s, ScalingType.BlockWise1x128, self.s_w, ScalingType.BlockWise128x128,
                         output_dtype=torch.bfloat16)


__all__ = ["StockBlockFp8Linear", "per_token_group_quant", "STAND_IN"]
