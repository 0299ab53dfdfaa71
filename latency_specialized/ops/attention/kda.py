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
    B = mixed_qkv.shape[0]
    H = num_heads
    HD = mixed_qkv.shape[1] // 3
    D = HD // H
    scale = D ** -0.5 if scale is None else scale
    idx = state_idx.long()
    dtype = mixed_qkv.dtype

    # 1. causal conv over [previous W-1 inputs, current], then SiLU (fp32 math, rounded like a kernel would).
    window = torch.cat([conv_state[idx].float(), mixed_qkv.float().unsqueeze(-1)], dim=-1)  # [B, C, W]
    conv = torch.nn.functional.silu((window * conv_weight.float().unsqueeze(0)).sum(-1))
    conv_state[idx] = window[..., 1:].to(conv_state.dtype)
    q, k, v = conv.to(dtype).float().view(B, 3, H, D).unbind(1)

    # 2. L2-normalise q, k per head.
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)

    # 3. decay and write strength.
    a = torch.exp(A_log.float()).view(1, H, 1)
    g = gate_lower_bound * torch.sigmoid(a * (f.float() + dt_bias.float()).view(B, H, D))
    beta = torch.sigmoid(beta_logit.float())  # [B, H]

    # 4. gated delta rule.
    S = state[idx] * torch.exp(g).unsqueeze(-2)  # [B, H, Dv, Dk], decay along keys
    v_new = beta.unsqueeze(-1) * (v - torch.einsum("bhvk,bhk->bhv", S, k))
    S = S + v_new.unsqueeze(-1) * k.unsqueeze(-2)
    state[idx] = S
    o = torch.einsum("bhvk,bhk->bhv", S, q)

    # 5. gated RMSNorm per head.
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    o = o * torch.sigmoid(g_out.float().view(B, H, D))
    return o.reshape(B, H * D).to(dtype)


IMPLEMENTATIONS = [
    Implementation("attention.kda", "attention.kda.reference", kda_decode_reference, always, priority=-100,
                   is_reference=True, description="torch conv + delta rule + gated RMSNorm (fp32 state)"),
]
