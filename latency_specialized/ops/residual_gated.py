"""residual.gated: one join of a sublayer output into the residual stream, sandwich-normed and gated.

    x, stream = gated_join(y, stream, weight, eps, post=..., post_weight=..., gate=..., ...)

1. **post-sublayer norm** of ``y`` (the sublayer output summed over ranks), by ``post``:
   ``'none'``: ``b = y``; ``'weightless'``: ``b = rmsnorm(y)``; ``'weighted'``: ``b = rmsnorm(y) * g``;
   ``'input_scaled'``: ``b = rmsnorm(y * g)`` (the gain scales *before* normalising), where
   ``g = post_weight`` (``1 + post_weight`` with ``post_zero_centered``) and the norm uses ``post_eps``;
2. **join**: without ``gate``, ``s = s + b``; with gate logits ``w`` (``[N]`` per channel or ``[1]``),
   the norm-preserving gate ``beta = sigmoid(w / T)``, ``alpha = sqrt(max(sigmoid(-w / T) (1 + beta),
   gate_eps))`` (``= sqrt(1 - beta^2)`` above the floor) and ``s = alpha s + beta b``; the new stream
   is stored in the stream's own dtype (fp32 streams: Muse-style), in place;
3. **next norm**: ``x = rmsnorm(s, weight)`` with gain ``weight`` (``1 + weight`` with
   ``zero_centered``; None: weightless) and ``eps``, of the stored stream, rounded once to
   ``out_dtype`` (default: ``y``'s dtype).

With ``y`` None only step 3 runs (the model's first sublayer input: the norm of the embedding stream).
fp32 math throughout, no rounding between the steps but the stream's store (vLLM 0.33's fused
boundary kernel, ``models/muse_spark/common/ops/fused_rmsnorm.py``: post-norm, blend, next pre-norm
in one pass). No host syncs.
"""

from __future__ import annotations

from typing import Literal

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.registry import Implementation, always

__all__ = ["IMPLEMENTATIONS", "POST_KINDS", "gated_join_reference", "norm_preserving_coefficients"]

PostNorm = Literal["none", "weightless", "weighted", "input_scaled"]
POST_KINDS: tuple[str, ...] = ("none", "weightless", "weighted", "input_scaled")


def norm_preserving_coefficients(gate: torch.Tensor, temperature: float,
                                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha, beta) fp32 of gate logits ``gate`` (step 2)."""
    w = gate.float() / temperature
    beta = torch.sigmoid(w)
    alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=eps))
    return alpha, beta


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _gain(weight: torch.Tensor, zero_centered: bool) -> torch.Tensor:
    w = weight.float()
    return 1.0 + w if zero_centered else w


def gated_join_reference(y: torch.Tensor | None, stream: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                         zero_centered: bool = False, post: PostNorm = "none", post_weight: torch.Tensor | None = None,
                         post_eps: float = 1e-6, post_zero_centered: bool = False, gate: torch.Tensor | None = None,
                         gate_temperature: float = 0.3, gate_eps: float = 1e-3, out_dtype: torch.dtype | None = None,
                         out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A join (see the module docstring).

    Parameters
    ----------
    y : [M, N] sublayer output (rows may be strided), or None (no join: the norm of the stream only).
    stream : [M, N] residual stream (contiguous), updated in place.
    weight, eps, zero_centered : the next consumer's RMSNorm.
    post, post_weight, post_eps, post_zero_centered : the post-sublayer norm (``post_weight`` [N] for
        'weighted' / 'input_scaled', unused otherwise).
    gate : [N] or [1] gate logits (fp32) or None (plain add); gate_temperature, gate_eps as above.
    out_dtype : dtype of ``x`` (default y's, or the stream's without y); out : optional [M, N] destination.

    Returns
    -------
    (x [M, N], stream).
    """
    if post not in POST_KINDS:
        raise UserError(f"residual.gated: post norm {post!r}: use one of {', '.join(POST_KINDS)}")
    if y is not None:
        if y.shape != stream.shape:
            raise UserError(f"residual.gated: output {tuple(y.shape)} and stream {tuple(stream.shape)} differ")
        b = y.float()
        if post in ("weighted", "input_scaled"):
            if post_weight is None:
                raise UserError(f"residual.gated: post norm {post!r} needs post_weight")
            g = _gain(post_weight, post_zero_centered)
            b = _rms(b, post_eps) * g if post == "weighted" else _rms(b * g, post_eps)
        elif post == "weightless":
            b = _rms(b, post_eps)
        if gate is None:
            s = stream.float() + b
        else:
            alpha, beta = norm_preserving_coefficients(gate, gate_temperature, gate_eps)
            s = alpha * stream.float() + beta * b
        stream.copy_(s.to(stream.dtype))
    x = _rms(stream.float(), eps)
    if weight is not None:
        x = x * _gain(weight, zero_centered)
    x = x.to(out_dtype or (y.dtype if y is not None else stream.dtype))
    if out is not None:
        out.copy_(x)
        x = out
    return x, stream


IMPLEMENTATIONS = [
    Implementation("residual.gated", "residual.gated.reference", gated_join_reference, always, priority=-100,
                   is_reference=True, description="torch post-norm + (gated) residual add + next RMSNorm, fp32"),
]
