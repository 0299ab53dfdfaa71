"""The plain-torch RMSNorm every norm implementation matches: the ``norm`` family's reference.

Defined here, at the kernel layer, because code below the op families computes it too: the kernels'
torch paths (MLA's unfused latent norm, ``kernels/mla_common.py``) and the CPU emulation of the fused
all-reduce + RMSNorm protocol (``comm/emulation.py``). ``ops/norm.py`` registers it as the family's
reference and re-exports it; callers above the kernels import it from there.
"""

from __future__ import annotations

import torch


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
