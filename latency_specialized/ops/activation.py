"""Gated activations shared by MLPs and experts: ``act(gate) * lin(up)`` in fp32."""

from __future__ import annotations

import torch

from latency_specialized.spec import ActivationSpec


def gated_activation(gate: torch.Tensor, up: torch.Tensor, act: ActivationSpec) -> torch.Tensor:
    """Returns act(gate) * lin(up) in fp32.

    swiglu: silu(g) * u, with DeepSeek-V4's clamp (g <= c, |u| <= c) when ``act.clamp`` is set.
    situ_glu (Kimi K3): b*tanh(g/b)*sigmoid(g) * bl*tanh(u/bl), b = beta, bl = beta_lin.
    """
    g, u = gate.float(), up.float()
    if act.kind == "swiglu":
        if act.clamp is not None:
            g = g.clamp(max=act.clamp)
            u = u.clamp(-act.clamp, act.clamp)
        return torch.nn.functional.silu(g) * u
    if act.kind == "situ_glu":
        b, bl = float(act.beta), float(act.beta_lin)  # validated non-None by ActivationSpec
        return b * torch.tanh(g / b) * torch.sigmoid(g) * (bl * torch.tanh(u / bl))
    raise ValueError(f"unknown activation {act.kind}")
