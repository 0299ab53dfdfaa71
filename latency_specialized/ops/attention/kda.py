"""attention.kda: one decode step of Kimi Delta Attention, fused end to end.

Per token, for the projected ``mixed_qkv = [q | k | v]`` (each ``H*D`` wide):

1. short causal depthwise conv of width W over the last W inputs (W-1 kept in ``conv_state``), then SiLU;
2. q, k L2-normalised per head; q scaled by ``scale`` (default D**-0.5);
3. per-channel log-decay ``g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))`` (g in [lb, 0]);
   write strength ``beta = sigmoid(beta_logit)`` per head;
4. gated delta rule on the fp32 state ``S[h]`` of shape [D_v, D_k]:
   ``S <- S * exp(g)`` (decay along keys); ``v' = beta * (v - S k)``; ``S <- S + v' k^T``; ``o = S q``;
5. ``o <- RMSNorm_D(o) * norm_weight * sigmoid(g_out)`` per head (the full-rank output gate).

The output is ready for o_proj. ``state`` and ``conv_state`` are updated in place at the rows
``state_idx`` names, so a CUDA graph can replay over static buffers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from latency_specialized.ops.gemm import gemm_reference
from latency_specialized.ops.registry import Implementation, always


def kda_decode_reference(mixed_qkv: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
                         f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, beta_logit: torch.Tensor,
                         g_out: torch.Tensor, norm_weight: torch.Tensor, state: torch.Tensor,
                         state_idx: torch.Tensor, *, num_heads: int, eps: float = 1e-5,
                         gate_lower_bound: float = -5.0, scale: float | None = None,
                         f_b_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Fused KDA decode for one token per sequence.

    Parameters
    ----------
    mixed_qkv : [B, 3*H*D] q|k|v projections before the conv (activation dtype).
    conv_state : [S, 3*H*D, W-1] previous conv inputs, oldest first (activation dtype), updated in place.
    conv_weight : [3*H*D, W] depthwise conv taps (last tap multiplies the current token).
    f : [B, H*D] decay input (output of f_b_proj), or with ``f_b_weight`` [H*D, R] the low-rank f_a
        [B, R]: the decay input is then ``f_b_proj(f_a)`` (the gemm contract: fp32 accumulation, one
        rounding to the activation dtype), computed inside the op (implementations fuse it).
    A_log : [H]. dt_bias : [H*D].
    beta_logit : [B, H]. g_out : [B, H*D] output-gate logits. norm_weight : [D].
    state : [S, H, D, D] fp32 recurrent states [value, key], updated in place.
    state_idx : [B] int row of ``state`` / ``conv_state`` for each sequence.

    Returns
    -------
    [B, H*D] in mixed_qkv.dtype.
    """
    if f_b_weight is not None:
        f = gemm_reference(f, f_b_weight)
    idx = state_idx.long()
    tok = kda_token_reference(mixed_qkv, conv_state[idx], conv_weight, f, A_log, dt_bias, beta_logit, g_out,
                              norm_weight, state[idx], num_heads=num_heads, eps=eps,
                              gate_lower_bound=gate_lower_bound, scale=scale)
    conv_state[idx] = tok.conv
    state[idx] = tok.state
    return tok.out


class KDAToken(NamedTuple):
    """One token of KDA per sequence (:func:`kda_token_reference`): its output, the states after it and
    the three vectors its state update was made of (what a verification step keeps to roll back)."""

    out: torch.Tensor
    """[B, H*D] gated-norm output, activation dtype."""
    conv: torch.Tensor
    """[B, C, W-1] conv inputs after this token, conv-state dtype."""
    state: torch.Tensor
    """[B, H, Dv, Dk] fp32 state after this token."""
    k: torch.Tensor
    """[B, H, Dk] fp32 normalised key."""
    decay: torch.Tensor
    """[B, H, Dk] fp32 ``exp(g)``, the multiplier applied along keys."""
    v_new: torch.Tensor
    """[B, H, Dv] fp32 ``beta * (v - S k)``: the state gains ``v_new k^T``."""


def kda_token_reference(mixed_qkv: torch.Tensor, conv_prev: torch.Tensor, conv_weight: torch.Tensor,
                        f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, beta_logit: torch.Tensor,
                        g_out: torch.Tensor, norm_weight: torch.Tensor, S_prev: torch.Tensor, *, num_heads: int,
                        eps: float = 1e-5, gate_lower_bound: float = -5.0,
                        scale: float | None = None) -> KDAToken:
    """One KDA token per sequence on gathered states (no in-place writes): the math of
    :func:`kda_decode_reference`, shared with the verification op so that both round identically.

    ``conv_prev`` [B, C, W-1] and ``S_prev`` [B, H, Dv, Dk] fp32 are the sequences' states before the
    token; ``f`` is the full-width decay input [B, H*D] (f_b_proj already applied). Other shapes as in
    :func:`kda_decode_reference`.
    """
    B = mixed_qkv.shape[0]
    H = num_heads
    HD = mixed_qkv.shape[1] // 3
    D = HD // H
    scale = D ** -0.5 if scale is None else scale
    dtype = mixed_qkv.dtype

    # 1. causal conv over [previous W-1 inputs, current], then SiLU (fp32 math, rounded like a kernel would).
    window = torch.cat([conv_prev.float(), mixed_qkv.float().unsqueeze(-1)], dim=-1)  # [B, C, W]
    conv = torch.nn.functional.silu((window * conv_weight.float().unsqueeze(0)).sum(-1))
    conv_next = window[..., 1:].to(conv_prev.dtype)
    q, k, v = conv.to(dtype).float().view(B, 3, H, D).unbind(1)

    # 2. L2-normalise q, k per head.
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)

    # 3. decay and write strength.
    a = torch.exp(A_log.float()).view(1, H, 1)
    g = gate_lower_bound * torch.sigmoid(a * (f.float() + dt_bias.float()).view(B, H, D))
    beta = torch.sigmoid(beta_logit.float())  # [B, H]

    # 4. gated delta rule.
    decay = torch.exp(g)
    S = S_prev * decay.unsqueeze(-2)  # [B, H, Dv, Dk], decay along keys
    v_new = beta.unsqueeze(-1) * (v - torch.einsum("bhvk,bhk->bhv", S, k))
    S = S + v_new.unsqueeze(-1) * k.unsqueeze(-2)
    o = torch.einsum("bhvk,bhk->bhv", S, q)

    # 5. gated RMSNorm per head.
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    o = o * torch.sigmoid(g_out.float().view(B, H, D))
    return KDAToken(o.reshape(B, H * D).to(dtype), conv_next, S, k, decay, v_new)


IMPLEMENTATIONS = [
    Implementation("attention.kda", "attention.kda.reference", kda_decode_reference, always, priority=-100,
                   is_reference=True, description="torch conv + delta rule + gated RMSNorm (fp32 state)"),
]
