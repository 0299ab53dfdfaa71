"""attention.qk_norm_rope: per-head RMSNorm of q and k, then rotary embedding, in one call.

    q, k = qk_norm_rope(qkv, heads, kv_heads, head_dim, eps, *, q_weight=None, k_weight=None,
                        positions=None, inv_freq=None, style="neox")

``qkv`` [M, W] is a GQA layer's fused projection: q in columns ``[0, Hq*D)``, k in ``[Hq*D, (Hq+KV)*D)``
(rows may be strided: unit column stride). Each head's ``D`` values are RMS-normalised in fp32
(``x * rsqrt(mean(x^2) + eps)``, times ``q_weight`` / ``k_weight`` [D] where given: weightless
otherwise), then - with ``inv_freq`` [D/2] - rotated at ``positions`` [M] (``ops/rope.py``: 'neox'
rotate-half or 'interleaved' pairs; NoPE layers pass no ``inv_freq``), and rounded once to qkv's dtype.
Returns contiguous ``q [M, Hq, D]`` and ``k [M, KV, D]``.

The unfused composition (two ``norm`` sites, then the rope glue) rounds after the norm as well; the GQA
piece declares this family's site with ``fuses='attn.q_norm,attn.k_norm'`` so that, where a kernel
serves it, one launch replaces the two norms and the rope's elementwise kernels (vLLM:
``fused_qk_norm_rope``), and where only this reference would, the unfused sites run instead.
"""

from __future__ import annotations

import torch

from latency_specialized.ops.registry import Implementation, always
from latency_specialized.ops.rope import RopeStyle, apply_rope

__all__ = ["IMPLEMENTATIONS", "qk_norm_rope_reference"]


def _norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return y * weight.float() if weight is not None else y


def qk_norm_rope_reference(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, eps: float, *,
                           q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                           positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
                           style: RopeStyle = "neox") -> tuple[torch.Tensor, torch.Tensor]:
    """q [M, Hq, D], k [M, KV, D] (see the module docstring); fp32 math, one rounding."""
    M, nq, nk = qkv.shape[0], heads * head_dim, kv_heads * head_dim
    out = []
    for lo, n, h, w in ((0, nq, heads, q_weight), (nq, nk, kv_heads, k_weight)):
        x = _norm(qkv[:, lo:lo + n].reshape(M, h, head_dim), w, eps)
        if inv_freq is not None:
            if positions is None:
                raise ValueError("qk_norm_rope: inv_freq given without positions")
            x = apply_rope(x, positions, inv_freq, style)  # fp32 in, fp32 out: no rounding yet
        out.append(x.to(qkv.dtype).contiguous())
    return out[0], out[1]


IMPLEMENTATIONS = [
    Implementation("attention.qk_norm_rope", "attention.qk_norm_rope.reference", qk_norm_rope_reference, always,
                   priority=-100, is_reference=True, strided_rows=True,
                   description="torch per-head RMSNorm of q and k + RoPE, fp32, one rounding"),
]
