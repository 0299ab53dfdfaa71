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
                                         zero_centered: bool = False):
    """All-reduce + residual add + RMSNorm.

    Parameters
    ----------
    partial : [M, N] this rank's partial sum (e.g. a row-parallel o_proj output).
    residual : [M, N] residual stream (same on every rank).
    weight : [N] norm gain, or None to skip the norm (returns (None, residual_out)).

    Returns
    -------
    (normed [M, N], residual_out [M, N]), both in partial.dtype, identical on every rank.
    """
    comm = comm or LocalCommunicator()
    acc = partial.float().clone()
    comm.all_reduce(acc)
    h = (acc + residual.float()).to(partial.dtype)
    if weight is None:
        return None, h
    return rmsnorm_reference(h, weight, eps, zero_centered=zero_centered), h


IMPLEMENTATIONS = [
    Implementation("allreduce", "allreduce.reference", allreduce_residual_rmsnorm_reference, always, priority=-100,
                   is_reference=True, description="communicator all_reduce (fp32) + torch residual + RMSNorm"),
]
