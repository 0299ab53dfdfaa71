"""Plain routed MoE (no latent width): router -> top-k -> routed experts (+ shared experts).

Sites (in the layer kind's prefix)::

    moe.router_gemm   gemm         logits = x @ W_router^T   (fp32 out where RouterSpec.fp32)
    moe.router        moe.router   top-k weights and ids (sigmoid / sqrtsoftplus / softmax, bias, renorm)
    moe.experts       moe.experts  only the selected experts, combined with the routing weights
    moe.shared        mlp          shared experts (num_shared x expert_intermediate), side stream on GPUs

TP (``ops/tp_moe.py``): every expert's intermediate width is split across ranks (the routed and
shared outputs are partial sums, completed by the residual's FFN all-reduce). The router is split
by expert rows (``router_split``, the default where TP divides the experts): rank r scores experts
r*E/tp.., and one all-gather (``moe.all_gather``, communication, ``gather_parts``) assembles the
full logits on every rank, which then route identically; ``router_split=False`` replicates it
(stock vLLM's GateLinear). The selection bias (noaux_tc) is replicated, fp32.

Weights (per layer): ``router`` [E, H]; ``router_bias`` [E] fp32 where ``router.bias_corrected``;
``experts.w1`` / ``experts.w3`` [E, I, H] (gate / up) and ``experts.w2`` [E, H, I] (down), stacked
over experts (a name map with ``{e}`` per expert: ``runtime.composed.weights_from_names``); shared
experts ``shared.gate_proj`` / ``shared.up_proj`` [S*I, H] and ``shared.down_proj`` [H, S*I].

Qwen3-MoE: softmax router, ``renormalize=norm_topk_prob``, no bias, no shared experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.ops.tp_moe import gather_parts
from latency_specialized.pieces.ffn.latent_moe import arrange_experts, expert_format_attrs, router_attrs
from latency_specialized.runtime.pieces_api import StateDecl, StepContext, WeightDecl, join, with_stored
from latency_specialized.spec import ModelSpec, MoESpec

ADD_SHARED_IN_EXPERTS = True
"""The shared experts' output is the routed experts' ``addend`` (``kernels/moe_addend.py``): their last stage adds
it, instead of an add kernel after them (A/B: ``--ab add:latency_specialized.pieces.ffn.moe.ADD_SHARED_IN_EXPERTS=
False``)."""
SHARED = ("shared.gate_proj", "shared.up_proj", "shared.down_proj")
"""The shared experts' weights (one ``moe.shared`` site: kept in a stored format as a whole)."""


@dataclass(frozen=True)
class RoutedMoE:
    """Plain MoE piece (``role`` 'ffn')."""

    role: ClassVar[str] = "ffn"
    spec: MoESpec
    """The unsharded MoE (experts, top-k, widths, activation, router)."""
    router_split: bool = True
    """Split the router's expert rows across ranks + one all-gather (else: replicated)."""

    def __post_init__(self) -> None:
        if self.spec.latent_dim:
            raise UserError("RoutedMoE is the plain MoE: this spec has a latent width (routed_expert_hidden_size); "
                            "use the latent MoE piece (pieces/ffn/latent_moe.py)")

    def _split(self, tp: int) -> bool:
        if not (self.router_split and tp > 1):
            return False
        if self.spec.num_experts % tp:
            raise UserError(f"router split across TP={tp}: {self.spec.num_experts} experts not divisible by TP; "
                            "pick a TP that divides them or build the piece with router_split=False")
        return True

    def sites(self, b: SiteBuilder, rank_spec: ModelSpec) -> None:
        f, tp, hidden = self.spec, rank_spec.tp, rank_spec.hidden_size
        local = f.shard(tp)
        rows = f.num_experts // tp if self._split(tp) else f.num_experts
        b.gemm("moe.router_gemm", rows, hidden, out_dtype="float32" if f.router.fp32 else None)
        b.add("moe.router", "moe.router", E=f.num_experts, topk=f.top_k, attrs=router_attrs(f.router))
        # the SwiGLU clamp (DeepSeek-V4) is an attr: an implementation that cannot clamp refuses the site
        act = {"activation": f.activation.kind, **({"clamp": f.activation.clamp} if f.activation.clamp else {})}
        b.add("moe.experts", "moe.experts", E=f.num_experts, topk=f.top_k, N=local.expert_intermediate, K=hidden,
              attrs={**act, **expert_format_attrs(f)})
        if f.num_shared_experts:
            b.mlp("moe.shared", f.num_shared_experts * local.expert_intermediate, hidden, activation=f.activation.kind,
                  clamp=f.activation.clamp, side_stream=True, weight_format=rank_spec.kept_linear(*SHARED))

    def weights(self, spec: ModelSpec, tp: int) -> list[WeightDecl]:
        f, H = self.spec, spec.hidden_size
        f.shard(tp)  # UserError naming the fix
        E, I = f.num_experts, f.expert_intermediate
        out = [WeightDecl("router", (E, H), split=0 if self._split(tp) else None)]
        if f.router.bias_corrected:
            out.append(WeightDecl("router_bias", (E,), dtype="float32"))
        kept = f.expert_format
        out += [WeightDecl("experts.w1", (E, I, H), split=1, stored=kept),
                WeightDecl("experts.w3", (E, I, H), split=1, stored=kept),
                WeightDecl("experts.w2", (E, H, I), split=2, stored=kept)]
        if f.num_shared_experts:
            S = f.num_shared_experts * I
            out += [WeightDecl("shared.gate_proj", (S, H), split=0), WeightDecl("shared.up_proj", (S, H), split=0),
                    WeightDecl("shared.down_proj", (H, S), split=1)]
        return with_stored(out, spec, {"moe.shared": SHARED})

    def states(self, spec: ModelSpec, tp: int) -> list[StateDecl]:
        return []

    def arrange(self, w: Mapping[str, torch.Tensor], rank_spec: ModelSpec) -> dict[str, torch.Tensor]:
        out = {"router": w["router"].contiguous(),
               **arrange_experts(join([w["experts.w1"], w["experts.w3"]], dim=1).contiguous(),
                                 w["experts.w2"].contiguous())}
        if "router_bias" in w:
            out["router_bias"] = w["router_bias"]
        if self.spec.num_shared_experts:
            out["shared_gate_up"] = join([w["shared.gate_proj"], w["shared.up_proj"]])
            out["shared_down"] = w["shared.down_proj"].contiguous()
        return out

    def forward(self, step: StepContext, w: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
                h: torch.Tensor) -> torch.Tensor:
        f = self.spec
        side = step.streams.get("side") if f.num_shared_experts else None
        # the shared experts depend only on h: on a GPU they run on the side stream (a graph branch)
        # beside the router and the routed experts, joined before the sum
        pending = side.run(step.op("moe.shared"), h, w["shared_gate_up"], w["shared_down"], f.activation) \
            if side is not None else None
        if f.router.fp32:
            logits = step.op("moe.router_gemm")(h, w["router"], out_dtype=torch.promote_types(h.dtype, torch.float32))
        else:
            logits = step.op("moe.router_gemm")(h, w["router"])
        if step.tp > 1 and logits.shape[-1] != f.num_experts:  # this rank's experts: gather every rank's
            logits, = step.communicate("moe.all_gather", gather_parts, step.comm, [logits])
        weights, ids = step.op("moe.router")(logits, w.get("router_bias"), f.top_k, f.router)
        experts = step.op("moe.experts")
        if not f.num_shared_experts:
            return experts(h, weights, ids, w["w13"], w["w2"], f.activation)
        # the join is handed over uncalled: the experts call it right before the stage that adds it
        shared = pending.join if pending is not None else \
            step.op("moe.shared")(h, w["shared_gate_up"], w["shared_down"], f.activation)
        if ADD_SHARED_IN_EXPERTS:
            return experts(h, weights, ids, w["w13"], w["w2"], f.activation, addend=shared)
        y = experts(h, weights, ids, w["w13"], w["w2"], f.activation)
        return y + (shared() if callable(shared) else shared)


__all__ = ["RoutedMoE"]
