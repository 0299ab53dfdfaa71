"""attention.dcp_merge: combine partial attention outputs across context-parallel ranks by LSE."""

from __future__ import annotations

import torch

from latency_specialized.ops.registry import Implementation, always


def dcp_merge_reference(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge P partial softmax-attention results over disjoint key sets.

    Parameters
    ----------
    outs : [P, B, H, D] each rank's normalised output over its keys.
    lses : [P, B, H] each rank's log-sum-exp of scores (-inf for a rank with no keys).

    Returns
    -------
    (out [B, H, D] in outs.dtype, lse [B, H] fp32) equal to attention over the union of keys.
    """
    lse = torch.logsumexp(lses.float(), dim=0)
    w = torch.exp(lses.float() - lse.unsqueeze(0))
    w = torch.nan_to_num(w, nan=0.0)  # every rank empty -> zeros rather than NaN
    out = (w.unsqueeze(-1) * outs.float()).sum(0)
    return out.to(outs.dtype), lse


IMPLEMENTATIONS = [
    Implementation("attention.dcp_merge", "attention.dcp_merge.reference", dcp_merge_reference, always,
                   priority=-100, is_reference=True, description="torch LSE-weighted merge"),
]
