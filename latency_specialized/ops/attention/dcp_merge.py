"""attention.dcp_merge: combine partial attention outputs across context-parallel ranks by LSE.

``dcp_merge_reference`` merges partials that are already side by side. ``dcp_merge_across`` runs the
merge across the ranks of a DCP group, through its communicator, two ways:

* ``"allgather"`` (default): each rank packs ``[o | lse]`` into one fp32 tensor, one all-gather, then
  every rank merges all W partials locally (``dcp_merge_reference``). One collective: in a small-batch
  decode step each collective costs a fixed latency far above the extra (W - 1) x B x H x D bytes;
* ``"rescale"``: all-gather of the lse alone (B x H floats), every rank rescales its own partial by
  ``exp(lse_r - lse)`` and a sum all-reduce adds them. Two collectives, but the second is a plain sum
  all-reduce of B x H x D values: what the ``allreduce`` family's fused one-shot kernels serve, and
  the shape that a reduce-scatter over heads (vLLM's ``cp_lse_ag_out_rs``) would take. The max of the
  lse is not reduced separately: the gathered lse gives the exact global log-sum-exp, the same bits on
  every rank (each rank reduces the same gathered values in the same order), and the Communicator
  protocol has no max all-reduce.

Both are sync-free (CUDA-graph capturable when the communicator's collectives are).
"""

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


MERGE_METHODS = ("allgather", "rescale")


def dcp_merge_across(o: torch.Tensor, lse: torch.Tensor, comm, *, method: str = "allgather"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge this rank's partial attention with the other ranks' of a DCP group.

    Parameters
    ----------
    o : [B, H, D] this rank's output normalised over its keys (fp32 or bf16; 0 where it has none).
    lse : [B, H] fp32 its log-sum-exp (-inf where it has no key).
    comm : the group's communicator (``all_gather(t, dim)`` in rank order, ``all_reduce(t)`` sum in place).
    method : ``"allgather"`` or ``"rescale"`` (module docstring).

    Returns
    -------
    (out [B, H, D] fp32, lse [B, H] fp32), the same on every rank: attention over the union of the
    ranks' keys (0 where no rank has a key).
    """
    if method not in MERGE_METHODS:
        raise ValueError(f"attention.dcp_merge: method {method!r}: use one of {', '.join(MERGE_METHODS)}")
    lse = lse.float()
    if method == "allgather":
        packed = torch.cat([o.float(), lse.unsqueeze(-1)], dim=-1).unsqueeze(0)      # [1, B, H, D + 1]
        parts = comm.all_gather(packed, dim=0)                                       # [W, B, H, D + 1]
        return dcp_merge_reference(parts[..., :-1], parts[..., -1])
    lses = comm.all_gather(lse.unsqueeze(0).contiguous(), dim=0)                      # [W, B, H]
    total = torch.logsumexp(lses, dim=0)
    w = torch.nan_to_num(torch.exp(lse - total), nan=0.0)   # every rank empty: -inf - -inf -> 0, not NaN
    y = (o.float() * w.unsqueeze(-1)).contiguous()
    return comm.all_reduce(y), total


IMPLEMENTATIONS = [
    Implementation("attention.dcp_merge", "attention.dcp_merge.reference", dcp_merge_reference, always,
                   priority=-100, is_reference=True, description="torch LSE-weighted merge"),
]
