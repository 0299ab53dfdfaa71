"""allreduce: all-reduce fused with residual add and RMSNorm.

    normed, residual_out = allreduce_residual_rmsnorm(partial, residual, weight, eps, comm=comm)

``residual_out = sum_over_ranks(partial) + residual`` (rounded once to the activation dtype) and
``normed = rmsnorm(residual_out)``. With one rank this is the fused residual + RMSNorm.
"""

from __future__ import annotations

import torch

from latency_specialized.comm.base import Communicator, LocalCommunicator
from latency_specialized.ops.norm import rmsnorm_reference
from latency_specialized.ops.registry import Implementation, always


def allreduce_residual_rmsnorm_reference(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                                         eps: float, *, comm: Communicator | None = None,
                                         zero_centered: bool = False, out=None):
    """All-reduce + residual add + RMSNorm.

    Parameters
    ----------
    partial : [M, N] this rank's partial sum (e.g. a row-parallel o_proj output).
    residual : [M, N] residual stream (same on every rank).
    weight : [N] norm gain, or None to skip the norm (returns (None, residual_out)).
    out : optional (normed or None, residual_out) destinations [M, N]. ``residual_out`` may be
        ``residual`` itself (every implementation reads an element before it writes it), which
        saves the caller a copy of the residual stream.

    Returns
    -------
    (normed [M, N], residual_out [M, N]), both in partial.dtype, identical on every rank.
    """
    comm = comm or LocalCommunicator()
    acc = partial.float().clone()
    comm.all_reduce(acc)
    h = (acc + residual.float()).to(partial.dtype)
    y_out, h_out = out if out is not None else (None, None)
    if h_out is not None:
        h = h_out.copy_(h)
    if weight is None:
        return None, h
    y = rmsnorm_reference(h, weight, eps, zero_centered=zero_centered)
    return (y_out.copy_(y) if y_out is not None else y), h


IMPLEMENTATIONS = [
    Implementation("allreduce", "allreduce.reference", allreduce_residual_rmsnorm_reference, always, priority=-100,
                   is_reference=True, description="communicator all_reduce (fp32) + torch residual + RMSNorm"),
]
