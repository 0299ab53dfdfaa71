"""norm: RMSNorm variants - residual-fused, gated (sigmoid gate), zero-centred gains.

One public convention for all of them::

    y = rmsnorm(x, weight, eps, residual=r, zero_centered=zc, gate=g)

* ``residual`` given: ``h = x + residual`` is normalised and returned too: ``(y, h)``.
* ``zero_centered``: the gain is ``1 + weight`` (Muse Spark).
* ``gate`` given: ``y = y * sigmoid(gate)`` (KDA's output gate, Muse Spark's attention gate).
* ``weight`` None: weightless (Muse Spark's QK norm).
"""

from __future__ import annotations

from latency_specialized.kernels.norm_reference import rmsnorm_reference
from latency_specialized.ops.registry import Implementation, always

__all__ = ["IMPLEMENTATIONS", "rmsnorm_reference"]

IMPLEMENTATIONS = [
    Implementation("norm", "norm.reference", rmsnorm_reference, always, priority=-100, is_reference=True,
                   description="fp32 torch RMSNorm (+residual, +gate, zero-centred)", strided_rows=True),
]
