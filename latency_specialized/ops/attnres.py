"""residual.attnres: Block Attention Residuals, the op-family reference.

A model with Block AttnRes (``pieces/residual/attnres.py``) has no additive residual stream. Each
sublayer (attention or FFN) reads a softmax-weighted mix of *sources*: the token embedding, the sum
of every completed block of layers, and the running sum of the current (partial) block. With ``v_s``
the sources of one token::

    logit_s = < RMSNorm(v_s) * norm_weight , query >      (query: the learned pseudo-query, [N])
    mixed   = sum_s softmax(logit)_s * v_s                 (raw sources, not normed)
    out     = RMSNorm(mixed) * out_norm_weight             (the sublayer's input norm; optional)

The sources live in one static, source-major buffer ``sources[R, M, N]``: source 0 is the
embedding, source ``k + 1`` the sum of block ``k``'s sublayer outputs; a call mixes sources
``[:num_sources]``. Source-major keeps each source a contiguous ``[M, N]`` slab, so the partial
block can be the (contiguous) residual of a fused all-reduce. This matches vLLM's ``attn_res``
kernel (fp32 math, one rounding) with the partial block as a source instead of a ``prefix`` argument.

A GPU kernel registers for the same family (``kernels/attnres.py``) and is tested against
:func:`attnres_mix_reference`.
"""

from __future__ import annotations

import torch

from latency_specialized.ops.registry import Implementation, always


def attnres_mix_reference(sources: torch.Tensor, num_sources: int, norm_weight: torch.Tensor,
                          query: torch.Tensor, eps: float, *, out_norm_weight: torch.Tensor | None = None,
                          out_eps: float = 1e-5, out: torch.Tensor | None = None) -> torch.Tensor:
    """Mix the first ``num_sources`` sources per token.

    Parameters
    ----------
    sources : [R, M, N] source-major (R >= num_sources), activation dtype; any strides.
    num_sources : sources mixed (static per call site: a Python int, so a graph captures it).
    norm_weight : [N] gain of the RMSNorm inside the logits. query : [N] pseudo-query (res_proj row).
    eps : epsilon of that RMSNorm. out_norm_weight : [N] gain of the output RMSNorm, or None for none.
    out_eps : epsilon of the output RMSNorm. out : optional [M, N] destination.

    Returns
    -------
    [M, N] in sources.dtype (fp32 math, one rounding).
    """
    v = sources[:num_sources].float()                                  # [S, M, N]
    w = norm_weight.float() * query.float()
    logits = (v * w).sum(-1) * torch.rsqrt(v.pow(2).mean(-1) + eps)    # [S, M]
    mixed = (torch.softmax(logits, dim=0).unsqueeze(-1) * v).sum(0)    # [M, N]
    if out_norm_weight is not None:
        mixed = mixed * torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + out_eps) * out_norm_weight.float()
    y = mixed.to(sources.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


IMPLEMENTATIONS = [
    Implementation("residual.attnres", "residual.attnres.reference", attnres_mix_reference, always,
                   priority=-100, is_reference=True, description="torch softmax mix of block sources (+ RMSNorm)"),
]
