"""Rotary position embedding math (static-shaped glue in the pieces; the ``attention.qk_norm_rope``
family fuses it with the per-head QK norm).

``apply_rope(x, positions, inv_freq, style)`` rotates the first ``2 * len(inv_freq)`` channels of
every head of ``x [M, heads, D]`` by the angles ``positions[m] * inv_freq[i]`` (fp32 math, one
rounding to x's dtype); the remaining channels pass through (partial rotary).

* ``neox`` (rotate-half, Llama / Qwen / Hugging Face ``apply_rotary_pos_emb``): channel ``i`` pairs
  with ``i + rot/2``;
* ``interleaved`` (GPT-J / GLM): channel ``2i`` pairs with ``2i + 1``.

``inv_freq[i] = theta ** (-2i / rot)`` as Hugging Face's default ``rope_init_fn`` computes it
(``1 / theta ** (arange(0, rot, 2) / rot)`` in fp32). Scaled RoPE variants (YaRN, llama3) are not
implemented.
"""

from __future__ import annotations

from typing import Literal

import torch

RopeStyle = Literal["neox", "interleaved"]


def rope_inv_freq(theta: float, rotary_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[rotary_dim / 2] fp32 inverse frequencies (Hugging Face default RoPE)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim {rotary_dim} must be a positive even number")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    return 1.0 / (theta ** exponents)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, style: RopeStyle = "neox") -> torch.Tensor:
    """``x [M, heads, D]`` rotated at ``positions [M]`` (see the module docstring); same dtype as x."""
    half = inv_freq.shape[0]
    rot = 2 * half
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq.float().unsqueeze(0)   # [M, rot/2]
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)                      # [M, 1, rot/2]
    xf = x[..., :rot].float()
    if style == "neox":
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    elif style == "interleaved":
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:
        raise ValueError(f"rope style {style!r}: use 'neox' or 'interleaved'")
    out = out.to(x.dtype)
    if rot == x.shape[-1]:
        return out
    return torch.cat([out, x[..., rot:]], dim=-1)


__all__ = ["apply_rope", "rope_inv_freq", "RopeStyle"]
