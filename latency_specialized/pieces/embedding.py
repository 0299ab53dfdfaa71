"""Token embedding: ``x = E[tokens]`` (glue: one gather), optionally RMS-normed.

The table is replicated on every rank (vocab-parallel embedding would need an all-reduce per step
for a gather that reads ``M * H`` values). ``normed=True`` RMS-normalises the embedding with its own
weight (site ``embed_norm``, family ``norm``; the model's ``spec.norm`` flavour) - for models that
norm the embedding before the first layer; ``norm_weight=False`` makes that norm weightless (Muse
Spark's ``embed_norm``: no weight of its own, eps from ``spec.norm``, no zero-centred gain).

Weights (model level): ``weight`` [vocab, H] (Hugging Face ``model.embed_tokens.weight``), and with
``normed`` ``norm`` [H].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping

import torch

from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.runtime.pieces_api import StateDecl, StepContext, WeightDecl
from latency_specialized.spec import ModelSpec


@dataclass(frozen=True)
class TokenEmbedding:
    """Token embedding piece (``role`` 'embed'): token ids ``[M]`` -> ``[M, H]``."""

    role: ClassVar[str] = "embed"
    normed: bool = False
    """RMS-normalise the embedding (site ``embed_norm``, weight ``norm``)."""
    norm_weight: bool = True
    """The embedding norm has a gain ``norm`` [H]; False: weightless."""

    def sites(self, b: SiteBuilder, rank_spec: ModelSpec) -> None:
        if self.normed:
            b.add("embed_norm", "norm", N=rank_spec.hidden_size, attrs={"residual": False,
                                                                        "weight": self.norm_weight})

    def weights(self, spec: ModelSpec, tp: int) -> list[WeightDecl]:
        out = [WeightDecl("weight", (spec.vocab_size, spec.hidden_size))]
        if self.normed and self.norm_weight:
            out.append(WeightDecl("norm", (spec.hidden_size,)))
        return out

    def states(self, spec: ModelSpec, tp: int) -> list[StateDecl]:
        return []

    def arrange(self, w: Mapping[str, torch.Tensor], rank_spec: ModelSpec) -> dict[str, torch.Tensor]:
        return dict(w)

    def forward(self, step: StepContext, w: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
                h: torch.Tensor) -> torch.Tensor:
        x = w["weight"].index_select(0, h)
        if self.normed:
            norm = step.spec.norm
            if self.norm_weight:
                x = step.op("embed_norm")(x, w["norm"], norm.eps, zero_centered=norm.zero_centered)
            else:
                x = step.op("embed_norm")(x, None, norm.eps)
        return x


__all__ = ["TokenEmbedding"]
