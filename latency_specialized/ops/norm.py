"""norm: RMSNorm variants - residual-fused, gated (sigmoid gate), zero-centred gains.

One public convention for all of them::

    y = rmsnorm(x, weight, eps, residual=r, zero_centered=zc, gate=g)

* ``residual`` given: ``h = x + residual`` is normalised and returned too: ``(y, h)``.
* ``zero_centered``: the gain is ``1 + weight`` (Muse Spark).
* ``gate`` given: ``y = y * sigmoid(gate)`` (KDA's output gate, Muse Spark's attention gate).
* ``weight`` None: weightless (Muse Spark's QK norm).
"""

from __future__ import annotations

import torch

from latency_specialized.ops.registry import Implementation, always


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                      residual: torch.Tensor | None = None, zero_centered: bool = False,
                      gate: torch.Tensor | None = None, out: torch.Tensor | None = None):
    """RMSNorm over the last dim in fp32, one rounding at the end.

    Parameters
    ----------
    x : [..., N]; weight : [N] or None; residual, gate : same shape as x.
        x may have strided rows (unit column stride, 16-byte aligned row starts: a column slice
        ``t[:, a:b]`` of a wider tensor, e.g. MLA's q_a_norm / kv_a_norm on the fused projection);
        residual, gate and out are contiguous.

    Returns
    -------
    y [..., N] in x.dtype, or (y, x + residual) when residual is given (the new residual keeps
    x.dtype: it is rounded exactly as an unfused add would round it).
    """
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        w = weight.float()
        y = y * ((1.0 + w) if zero_centered else w)
    if gate is not None:
        y = y * torch.sigmoid(gate.float())
    y = y.to(x.dtype)
    if out is not None:
        out.copy_(y)
        y = out
    return y if residual is None else (y, h)


IMPLEMENTATIONS = [
    Implementation("norm", "norm.reference", rmsnorm_reference, always, priority=-100, is_reference=True,
                   description="fp32 torch RMSNorm (+residual, +gate, zero-centred)", strided_rows=True),
]
