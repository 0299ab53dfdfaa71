"""gemm: decode projections ``y[M, N] = x[M, K] @ W[N, K]^T (+ residual[M, N])``.

Implementations are shape-adaptive (GEMV for M=1-2, small-M, split-K); the plan picks one per
(N, K, M) site. The reference accumulates in fp32 and rounds once to the activation dtype, which
is what every fast implementation must match within the dtype tolerance.
"""

from __future__ import annotations

import torch

from latency_specialized.ops.registry import Implementation, OpContext, Support, always


def gemm_reference(x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ residual).

    Parameters
    ----------
    x : [M, K] activations.
    weight : [N, K] weight (row-major, as nn.Linear stores it).
    residual : optional [M, N] added before the single rounding to x.dtype.
    out : optional [M, N] destination.

    Returns
    -------
    [M, N] in x.dtype.
    """
    y = x.float() @ weight.float().t()
    if residual is not None:
        y = y + residual.float()
    y = y.to(x.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


def gemm_torch(x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """cuBLAS (torch.nn.functional.linear) with an unfused residual add: the stock composition."""
    y = torch.nn.functional.linear(x, weight)
    if residual is not None:
        y = y + residual
    if out is not None:
        out.copy_(y)
        return out
    return y


def _torch_supports(ctx: OpContext) -> Support:
    return True if ctx.arch != "cpu" else "CPU: the reference serves (same math, fp32 accumulate)"


IMPLEMENTATIONS = [
    Implementation("gemm", "gemm.reference", gemm_reference, always, priority=-100, is_reference=True,
                   description="fp32-accumulate torch matmul"),
    Implementation("gemm", "gemm.cublas", gemm_torch, _torch_supports, priority=0,
                   description="torch.nn.functional.linear (cuBLAS), residual unfused"),
]
