"""Dense gated MLP: ``down(act(gate(x)) * up(x))`` in one site (``mlp``, family ``mlp``).

TP: gate/up rows (the intermediate width) are split across ranks, down's columns with them; the
output is a partial sum that the residual's FFN all-reduce completes.

Weights (per layer): ``gate_proj`` [I, H], ``up_proj`` [I, H], ``down_proj`` [H, I] (Hugging Face
``mlp.{gate,up,down}_proj.weight``); ``arrange`` fuses gate|up into the family's ``w_gate_up``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping

import torch

from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.runtime.pieces_api import StateDecl, StepContext, WeightDecl, join, with_stored
from latency_specialized.spec import DenseMLPSpec, ModelSpec


@dataclass(frozen=True)
class DenseMLP:
    """Dense gated MLP piece (``role`` 'ffn')."""

    role: ClassVar[str] = "ffn"
    spec: DenseMLPSpec
    """The unsharded MLP (intermediate width, activation)."""

    PROJECTIONS: ClassVar[dict[str, tuple[str, ...]]] = {"mlp": ("gate_proj", "up_proj", "down_proj")}
    """The site and the weights it joins (kept in a stored format as a whole: ``ModelSpec.kept_linear``)."""

    def sites(self, b: SiteBuilder, rank_spec: ModelSpec) -> None:
        inter, hidden = self.spec.shard(rank_spec.tp).intermediate, rank_spec.hidden_size
        b.mlp("mlp", inter, hidden, activation=self.spec.activation.kind,
              weight_format=rank_spec.kept_linear(*self.PROJECTIONS["mlp"]))

    def weights(self, spec: ModelSpec, tp: int) -> list[WeightDecl]:
        self.spec.shard(tp)  # UserError naming the fix for a TP the width cannot be split by
        I, H = self.spec.intermediate, spec.hidden_size
        return with_stored([WeightDecl("gate_proj", (I, H), split=0), WeightDecl("up_proj", (I, H), split=0),
                            WeightDecl("down_proj", (H, I), split=1)], spec, self.PROJECTIONS)

    def states(self, spec: ModelSpec, tp: int) -> list[StateDecl]:
        return []

    def arrange(self, w: Mapping[str, torch.Tensor], rank_spec: ModelSpec) -> dict[str, torch.Tensor]:
        return {"gate_up": join([w["gate_proj"], w["up_proj"]]), "down": w["down_proj"].contiguous()}

    def forward(self, step: StepContext, w: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
                h: torch.Tensor) -> torch.Tensor:
        return step.op("mlp")(h, w["gate_up"], w["down"], self.spec.activation)


__all__ = ["DenseMLP"]
