"""LM head: ``logits = x @ W^T`` over this rank's vocabulary rows (site ``lm_head``, family ``gemm``).

At TP > 1 each rank holds ``vocab / tp`` rows and returns its logits slice; the program
all-gathers the slices (communication site ``lm_head.all_gather``). A vocabulary that TP does not
divide is replicated instead (every rank computes all logits, no gather).

``tied=True``: the head reads the embedding table (``tie_word_embeddings``). The head still declares
its ``weight`` (same shape); an adapter's name map points it at the embedding's checkpoint tensor,
and a program given no head weight takes the embedding's (``ComposedProgram``).

``softcap``: logits ``softcap * tanh(logit_scale * z / softcap)`` (Gemma / Muse Spark; Muse scales by its
``output_multiplier`` first) as fp32 glue on the rank's slice (elementwise: it commutes with the
gather), rounded once to the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping

import torch

from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.runtime.pieces_api import StateDecl, StepContext, WeightDecl
from latency_specialized.spec import ModelSpec


def vocab_split(vocab: int, tp: int) -> bool:
    """True when the head's rows are split across ``tp`` ranks (else replicated)."""
    return tp > 1 and vocab % tp == 0


@dataclass(frozen=True)
class LMHead:
    """LM head piece (``role`` 'head'): final hidden ``[M, H]`` -> logits ``[M, vocab / tp]``."""

    role: ClassVar[str] = "head"
    tied: bool = False
    """The weight is the embedding table (see the module docstring)."""
    softcap: float | None = None
    """Final logit soft cap (None: raw logits)."""
    logit_scale: float = 1.0
    """Multiplier of the raw logits before the cap (with ``softcap`` only)."""

    def sites(self, b: SiteBuilder, rank_spec: ModelSpec) -> None:
        tp = rank_spec.tp
        n = rank_spec.vocab_size // tp if vocab_split(rank_spec.vocab_size, tp) else rank_spec.vocab_size
        b.gemm("lm_head", n, rank_spec.hidden_size)

    def weights(self, spec: ModelSpec, tp: int) -> list[WeightDecl]:
        split = 0 if vocab_split(spec.vocab_size, tp) else None
        return [WeightDecl("weight", (spec.vocab_size, spec.hidden_size), split=split)]

    def states(self, spec: ModelSpec, tp: int) -> list[StateDecl]:
        return []

    def arrange(self, w: Mapping[str, torch.Tensor], rank_spec: ModelSpec) -> dict[str, torch.Tensor]:
        return {"weight": w["weight"].contiguous()}

    def forward(self, step: StepContext, w: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
                h: torch.Tensor) -> torch.Tensor:
        z = step.op("lm_head")(step.contiguous_for("lm_head", h), w["weight"])
        if self.softcap is None:
            return z
        return (torch.tanh(z.float() * (self.logit_scale / self.softcap)) * self.softcap).to(z.dtype)


__all__ = ["LMHead", "vocab_split"]
