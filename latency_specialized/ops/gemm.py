"""gemm: decode projections ``y[M, N] = x[M, K] @ W[N, K]^T (+ residual[M, N])``.

Implementations are shape-adaptive (GEMV for M=1-2, small-M, split-K); the plan picks one per
(N, K, M) site. The reference accumulates in fp32 and rounds once to the activation dtype, which
is what every fast implementation must match within the dtype tolerance.
"""

from __future__ import annotations

import torch

from latency_specialized.ops.registry import Implementation, OpContext, Support, always


def gemm_reference(x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                   norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6) -> torch.Tensor:
    """y = x @ weight.T (+ residual).

    Parameters
    ----------
    x : [M, K] activations.
    weight : [N, K] weight (row-major, as nn.Linear stores it), or a ``quant.QuantizedWeight`` [N, K] kept as the
        checkpoint stores it (block-FP8 sites: ``weight_format``), dequantised here to fp32.
    residual : optional [M, N] added before the single rounding to x.dtype.
    out : optional [M, N] destination. ``residual`` and ``out`` may have strided rows (unit column
        stride: a column slice of a wider tensor) and may be the same tensor (in-place add).
    out_dtype : dtype of the result (default x.dtype); fp32 for router logits (vLLM's GateLinear:
        bf16 x bf16 -> fp32, no rounding to bf16).
    norm_weight : optional [K] RMSNorm gain: x is first replaced by ``rmsnorm_reference(x, norm_weight,
        norm_eps)`` (rounded to x.dtype) - the norm prologue of implementations with ``norm_prologue``.

    Returns
    -------
    [M, N] in out_dtype (x.dtype by default).
    """
    if norm_weight is not None:
        from latency_specialized.ops.norm import rmsnorm_reference

        x = rmsnorm_reference(x, norm_weight, norm_eps)
    if not isinstance(weight, torch.Tensor):  # a QuantizedWeight
        weight = weight.dequantize(torch.float32)
    acc = torch.float64 if torch.float64 in (x.dtype, weight.dtype) else torch.float32
    y = x.to(acc) @ weight.to(acc).t()
    if residual is not None:
        y = y + residual.to(acc)
    y = y.to(out_dtype or x.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


def gemm_torch(x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
               out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """cuBLAS (torch.nn.functional.linear) with an unfused residual add: the stock composition.

    ``out_dtype=torch.float32`` on bf16 inputs uses cuBLAS's fp32-output epilogue
    (``torch.mm(..., out_dtype=)``, what vLLM's GateLinear runs for router logits).
    """
    if out_dtype is not None and out_dtype != x.dtype:
        if x.is_cuda and _MM_HAS_OUT_DTYPE:
            y = torch.mm(x, weight.t(), out_dtype=out_dtype)
        else:  # CPU: same math (products of bf16 are exact in fp32), fp32 accumulate
            y = x.to(out_dtype) @ weight.to(out_dtype).t()
        if residual is not None:
            y = y + residual.to(out_dtype)
        if out is not None:
            out.copy_(y)
            return out
        return y
    y = torch.nn.functional.linear(x, weight)
    if residual is not None:
        y = y + residual
    if out is not None:
        out.copy_(y)
        return out
    return y


def _mm_has_out_dtype() -> bool:
    import inspect

    try:
        return "out_dtype" in str(inspect.signature(torch.mm)) or "out_dtype" in (torch.mm.__doc__ or "")
    except (TypeError, ValueError):
        return "out_dtype" in (torch.mm.__doc__ or "")


_MM_HAS_OUT_DTYPE = _mm_has_out_dtype()


def _torch_supports(ctx: OpContext) -> Support:
    if ctx.attr("weight_format"):
        return f"weights {ctx.attr('weight_format')}: bf16 weights only (the block-FP8 gemms serve these)"
    return True if ctx.arch != "cpu" else "CPU: the reference serves (same math, fp32 accumulate)"


IMPLEMENTATIONS = [
    Implementation("gemm", "gemm.reference", gemm_reference, always, priority=-100, is_reference=True,
                   description="fp32-accumulate torch matmul", strided_rows=True, norm_prologue=True),
    # cuBLAS takes a row stride (lda) >= K directly: a column slice is not copied
    Implementation("gemm", "gemm.cublas", gemm_torch, _torch_supports, priority=0,
                   description="torch.nn.functional.linear (cuBLAS), residual unfused", strided_rows=True),
]
