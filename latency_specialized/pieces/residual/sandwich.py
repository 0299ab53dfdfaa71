"""Sandwich norms: every sublayer is framed by a pre-norm and a post-sublayer norm before the join.

``x = pre_norm(s); y = f(x); s = join(s, post_norm(y))`` around every sublayer, where the join is a
plain add or the norm-preserving gate of ``pieces/residual/gated.py``. The post norm of each sublayer
is one of (``ops/residual_gated.py``, step 1):

* ``'weighted'``: ``rmsnorm(y) * g`` (Gemma-style sandwich);
* ``'weightless'``: ``rmsnorm(y)`` (Muse Spark's attention post-norm);
* ``'input_scaled'``: ``rmsnorm(y * g)`` - the gain scales *before* normalising (Muse Spark's FFN
  post-norm, vLLM's ``MuseSpark1xRMSNormWithInputScale``);
* ``'none'``.

``g = w`` or, zero-centred, ``1 + w``.

**Why the gate is an option of this piece and not a piece of its own.** A model has exactly one
residual piece, and the post norm, the gate and the next pre-norm all act at the same point - the
join of one sublayer output into the stream - on the same row of values: they are one op call (the
``residual.gated`` family; vLLM fuses the three into one boundary kernel,
``models/muse_spark/common/ops/fused_rmsnorm.py``). So :class:`SandwichResidual` is the gated
residual (``GatedResidual``: sites, stream buffer, the deferred FFN join) plus the post norms; a model
with both (Muse Spark) sets ``gate=NormPreservingGate(...)``, a sandwich model without gates leaves
``gate=None`` (plain adds), and a gated model without post norms uses ``GatedResidual`` itself.

Sites and stream as in ``pieces/residual/gated.py``; the joins' site attrs carry the post-norm kind.
Weights per layer: those of the gated residual plus ``attn.post_norm`` / ``ffn.post_norm`` ``[H]`` for
each sublayer whose post norm has a gain.

Muse Spark (vLLM 0.33, ``models/muse_spark/nvidia/model.py``: ``MuseSpark1xDecoderLayer.__init__`` /
``forward``, ``MuseSpark1xModel``): ``SandwichResidual(gate=NormPreservingGate(0.3), eps=1e-5,
zero_centered=True, final_zero_centered=False, post_attn='weightless', post_ffn='input_scaled',
post_eps=1e-8, stream_dtype='float32')``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.residual_gated import POST_KINDS, PostNorm
from latency_specialized.pieces.residual.gated import GatedResidual, NormPreservingGate
from latency_specialized.runtime.pieces_api import WeightDecl

_WITH_GAIN = ("weighted", "input_scaled")


@dataclass(frozen=True)
class SandwichResidual(GatedResidual):
    """Sandwich-normed residual, optionally with norm-preserving gated joins (see the module docstring)."""

    gate: NormPreservingGate | None = None
    """The joins' gate; None: plain adds."""
    post_attn: PostNorm = "weighted"
    """Post norm of the attention output."""
    post_ffn: PostNorm = "weighted"
    """Post norm of the FFN output."""
    post_eps: float = 1e-6
    """Epsilon of the post norms (Muse Spark: 1e-8)."""
    post_zero_centered: bool | None = None
    """Post-norm gains are ``1 + w``; None: as ``zero_centered``."""

    def __post_init__(self) -> None:
        for which, kind in (("attn", self.post_attn), ("ffn", self.post_ffn)):
            if kind not in POST_KINDS:
                raise UserError(f"sandwich residual: post norm {kind!r} of the {which} output: use one of "
                                f"{', '.join(POST_KINDS)}")

    def post_norm(self, which: Literal["attn", "ffn"]) -> PostNorm:
        return self.post_attn if which == "attn" else self.post_ffn

    def post_kw(self, which: Literal["attn", "ffn"], w: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        kind = self.post_norm(which)
        zc = self.zero_centered if self.post_zero_centered is None else self.post_zero_centered
        kw: dict[str, Any] = {"post_eps": self.post_eps, "post_zero_centered": zc}
        if kind in _WITH_GAIN:
            kw["post_weight"] = w[f"{which}.post_norm"]
        return kw

    def post_weights(self, hidden: int) -> list[WeightDecl]:
        return [WeightDecl(f"{which}.post_norm", (hidden,)) for which in ("attn", "ffn")
                if self.post_norm(which) in _WITH_GAIN]  # type: ignore[arg-type]


__all__ = ["SandwichResidual"]
