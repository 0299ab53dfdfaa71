"""mlp: dense gated MLP ``down(act(gate(x)) * up(x))`` - dense layers and shared experts."""

from __future__ import annotations

import torch

from latency_specialized.ops.activation import gated_activation
from latency_specialized.ops.registry import Implementation, always
from latency_specialized.spec import ActivationSpec


def mlp_reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  activation: ActivationSpec, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Gated MLP.

    Parameters
    ----------
    x : [M, K]; w_gate_up : [2*I, K] (gate rows first, then up rows); w_down : [N, I] - either may be a
        ``quant.QuantizedWeight`` kept as the checkpoint stores it (sites with ``weight_format``), dequantised here.

    Returns
    -------
    [M, N] in x.dtype. The intermediate is rounded to x.dtype before the down projection, as a
    bf16 serving stack does.
    """
    if not isinstance(w_gate_up, torch.Tensor):  # QuantizedWeight
        w_gate_up = w_gate_up.dequantize(torch.float32)
    if not isinstance(w_down, torch.Tensor):
        w_down = w_down.dequantize(torch.float32)
    gu = (x.float() @ w_gate_up.float().t()).to(x.dtype)
    inter = w_gate_up.shape[0] // 2
    h = gated_activation(gu[:, :inter], gu[:, inter:], activation).to(x.dtype)
    y = (h.float() @ w_down.float().t()).to(x.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


IMPLEMENTATIONS = [
    Implementation("mlp", "mlp.reference", mlp_reference, always, priority=-100, is_reference=True,
                   description="torch gate/up matmul, activation, down matmul"),
]
