"""Latent MoE piece: routed experts at a latent width between a down- and an up-projection.

The one definition of the latent-MoE sites; every model with a latent MoE uses them. Per rank, in
call order (``E`` experts, latent width ``Ld``, ``tp`` ranks):

* ``moe.gate_down`` (``moe.gate_down``, ``fuses="moe.router_gemm,moe.latent_down"``): the router
  logits and the latent input from one weight stream ``[W_gate; W_down]`` (both read the same h).
  Where a kernel serves it (the batch-1 GEMV) it is called instead of the two gemm sites below;
  where only its reference would serve, those two run and it is skipped (``Plan.skipped_sites``);
* ``moe.router_gemm`` (gemm, fp32 out: vLLM's GateLinear, bf16 x bf16 -> fp32) over the rank's
  ``E / tp`` experts, and ``moe.latent_down`` (gemm) of the rank's ``Ld / tp`` latent channels:
  split across ranks, unlike stock vLLM which replicates both; one all-gather (communication, not
  a site: ``ops/tp_moe.gather_parts``) joins both on every rank, bit-exactly;
* ``moe.router``: scores, bias-corrected top-k, renormalise, scaling (identical on every rank);
* ``moe.latent_norm`` (norm, only with ``input_norm``): RMSNorm of the gathered latent input;
* ``moe.experts``: the selected experts at the latent width (each rank: its slice of every
  expert's intermediate width, a partial sum);
* with a per-expert post-norm (``post_expert_norm``, Muse Spark: each selected expert's output is
  RMS-normed *before* its routing weight) the experts return per-route rows ``[M, k, Ld]`` instead
  (attr ``per_route``), ``moe.route_allreduce`` (allreduce, no residual, no norm; TP > 1 only) sums
  the per-route partials over ranks - the norm needs whole rows, as vLLM's pre-norm all-reduce - and
  ``moe.finalize`` norms each route, weights and sums them; ``moe.latent_allreduce`` is then not needed;
* ``moe.latent_allreduce`` (allreduce, no residual): the experts' partial latent summed over ranks,
  fused with the RMSNorm of the latent output (``output_norm``; vLLM: all-reduce, then norm);
* ``moe.shared`` (mlp, ``side_stream``): the shared experts, forked onto a side stream on GPUs
  (a graph branch) and joined before the up-projection;
* ``moe.latent_up`` (gemm): the up-projection of the rank's hidden slice ``H / tp`` only, with the
  shared experts' output as its residual (one rounding, as vLLM's ``addmm_``), written into that
  slice in place, so the FFN all-reduce counts the routed output once.

The output is the FFN's TP partial sum ``[M, H]``. A communicator with gather slots (the one-GPU
bench's stand-in) takes the router / latent slices in place where the implementation writes a
column slice directly (``strided_out``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Mapping, Sequence

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.ops.tp_moe import gather_parts
from latency_specialized.quant import layout as quant_layout
from latency_specialized.quant.checkpoint_io import QuantizedWeight
from latency_specialized.quant.formats import PAIRED_SUFFIX, QuantFormat
from latency_specialized.runtime.pieces_api import StateDecl, StepContext, WeightDecl, join
from latency_specialized.runtime.side_stream import SideStream
from latency_specialized.spec import ModelSpec, MoESpec, RouterSpec

SHARED_FORK_LATE_MAX_BATCH = 1
"""Largest bucket whose shared experts fork onto their side stream only after the router's inputs
(logits, latent) are computed, instead of at the start of the MoE block. Early, the shared experts'
33 MB (TP8) compete for DRAM and SMs with the small router/latent projection that the routed path
waits on (H200 profile at batch 1: that 8 MB kernel took 15 us beside them); late, they fill the
router kernel's idle DRAM instead. H200 layer A/B (TP8 shard, same machine, two runs each): batch 1
KDA 110.4 / 111.9 -> 108.6 / 109.4 us, MLA 120.9 / 120.5 -> 119.3 / 119.0 us; batch 2 KDA lost 3.3-6.9 us,
batch 8 KDA gained 11 us but MLA lost 5 us: late at batch 1 only. 0: always early."""

ROUTER_SIDE_MIN_BATCH = 2
"""Smallest bucket whose router GEMM runs on its own stream beside the latent down-projection. H200
layer bench (TP8 shard): batch 2-64 gained 2.7-9 us per layer; batch 1 lost ~1.7 us (its router GEMM
then starts only after the AttnRes kernel completes instead of early under PDL, and the router waits
on two branches), so batch 1 keeps them in one stream."""

PAIR_EXPERT_CODES = True
"""Routed experts kept in an e2m1 format (MXFP4, NVFP4) are rearranged once, when the program arranges its weights,
into the paired layout (``quant.layout.paired_nibbles``: the mma kernels decode it in fewer instructions; every
4-bit experts kernel reads it) and their site's ``weight_format`` names ``<fmt>/pairs``. One more copy of ``w2`` per
layer while the caller's tensors are alive (``w13`` is a joined copy already). On since session 44 (the layer A/B's
are in ``kernels/NOTES_q4.md``); the checkpoint packing back for an A/B:
``--ab checkpoint:latency_specialized.pieces.ffn.latent_moe.PAIR_EXPERT_CODES=False``."""

_ROUTER_DEFAULTS = RouterSpec(score_func="sigmoid")


def router_attrs(r: RouterSpec) -> dict[str, Any]:
    """Attributes of the ``moe.router`` site: score function and bias always, the other routing
    parameters where they differ from the defaults (so an implementation sees every non-default)."""
    attrs: dict[str, Any] = {"score_func": r.score_func, "bias": r.bias_corrected}
    for name in ("logit_scale", "renormalize", "renormalize_eps", "routed_scaling"):
        if getattr(r, name) != getattr(_ROUTER_DEFAULTS, name):
            attrs[name] = getattr(r, name)
    return attrs


def _paired(fmt: QuantFormat) -> bool:
    # the format object, not its name: derived names (``<fmt>/rows``, quant.layout.row_scaled) do not resolve by name
    return PAIR_EXPERT_CODES and fmt.pairable


def expert_format_attrs(f: MoESpec) -> dict[str, Any]:
    """The ``moe.experts`` site's ``weight_format`` where the experts stay quantized (``MoESpec.expert_format``,
    ``/pairs`` appended under ``PAIR_EXPERT_CODES``): the bf16 implementations refuse such a site, the 4-bit ones
    take it."""
    if not f.expert_format:
        return {}
    return {"weight_format": f.expert_format + (PAIRED_SUFFIX if _paired(QuantFormat.get(f.expert_format)) else "")}


def arrange_experts(w13: "torch.Tensor | QuantizedWeight", w2: "torch.Tensor | QuantizedWeight") -> dict[str, Any]:
    """``{"w13", "w2"}`` as the ``moe.experts`` site takes them (:func:`expert_format_attrs`): e2m1 experts in the
    paired layout under ``PAIR_EXPERT_CODES``, anything else as given."""
    if isinstance(w13, QuantizedWeight) and isinstance(w2, QuantizedWeight) and _paired(w13.fmt):
        return {"w13": quant_layout.paired_nibbles(w13), "w2": quant_layout.paired_nibbles(w2)}
    return {"w13": w13, "w2": w2}


@functools.lru_cache(maxsize=64)
def _local(f: MoESpec, tp: int) -> MoESpec:
    return f.shard(tp) if tp > 1 else f


@dataclass(frozen=True)
class LatentMoE:
    """The latent MoE of every layer of one kind (see the module docstring).

    Weights (piece-local names, checkpoint granularity): ``router`` ``[E, hidden]``, ``router_bias``
    ``[E]`` fp32 (bias-corrected routers), ``latent_down`` ``[Ld, hidden]``, ``latent_in_norm``
    ``[Ld]`` (``input_norm``), ``latent_norm`` ``[Ld]`` (``output_norm``), ``latent_up`` ``[hidden, Ld]``,
    ``experts.w1`` / ``experts.w3`` ``[E, I, Ld]`` (gate / up), ``experts.w2`` ``[E, Ld, I]``;
    shared experts ``shared.gate_proj`` / ``shared.up_proj`` ``[S*I, hidden]``, ``shared.down_proj``
    ``[hidden, S*I]``.
    """

    spec: MoESpec
    """The unsharded MoE shape (``latent_dim`` set)."""
    norm_eps: float = 1e-6
    """Epsilon of the latent RMSNorms (the model's rms_norm_eps)."""
    output_norm: bool = True
    """RMSNorm of the experts' combined latent output, after their all-reduce and before the
    up-projection (a ``routed_expert_norm``; fused into ``moe.latent_allreduce``)."""
    input_norm: bool = False
    """RMSNorm of the latent input before the experts (``moe.latent_norm`` site; a pre-expert norm)."""
    input_norm_zero_centered: bool = False
    """The pre-expert norm's gain is ``1 + w`` (Muse Spark)."""
    post_expert_norm: Literal["none", "weighted", "input_scaled"] = "none"
    """RMSNorm of every selected expert's output before its routing weight (``moe.finalize``):
    'input_scaled' scales by the gain before normalising (Muse Spark), 'weighted' after. Weight
    ``post_expert_norm`` [Ld], one for all experts."""
    post_expert_eps: float = 1e-6
    """Epsilon of the per-expert post-norm (Muse Spark: post_norm_eps 1e-8)."""
    post_expert_zero_centered: bool = True
    """The per-expert post-norm's gain is ``1 + w``."""
    shared_fork_late_max_batch: int = SHARED_FORK_LATE_MAX_BATCH
    """See :data:`SHARED_FORK_LATE_MAX_BATCH`."""
    router_side_min_batch: int = ROUTER_SIDE_MIN_BATCH
    """See :data:`ROUTER_SIDE_MIN_BATCH`."""
    role: ClassVar[str] = "ffn"

    def __post_init__(self) -> None:
        if not self.spec.latent_dim:
            raise UserError("the latent MoE piece needs MoESpec.latent_dim (routed_expert_hidden_size); "
                            "use the plain MoE piece for a MoE without a latent width")
        if self.post_expert_norm not in ("none", "weighted", "input_scaled"):
            raise UserError(f"latent MoE: post_expert_norm {self.post_expert_norm!r}: "
                            "use none, weighted or input_scaled")
        if self.per_route and self.output_norm:
            raise UserError("latent MoE: a per-expert post-norm and a norm of the combined output together are not "
                            "supported: set output_norm=False")

    @property
    def per_route(self) -> bool:
        """The experts return per-route rows, normed in ``moe.finalize`` (a per-expert post-norm)."""
        return self.post_expert_norm != "none"

    def local(self, tp: int) -> MoESpec:
        """This rank's MoE shape at TP ``tp`` (expert intermediate width split)."""
        return _local(self.spec, tp)

    @property
    def width(self) -> int:
        """The latent width the experts run at."""
        assert self.spec.latent_dim
        return self.spec.latent_dim

    def _check_tp(self, hidden: int, tp: int) -> None:
        for what, n in (("router experts (split across ranks)", self.spec.num_experts),
                        ("latent channels", self.width), ("hidden size (latent up-projection rows)", hidden)):
            if n % tp:
                raise UserError(f"TP={tp} not supported by the latent MoE: its {n} {what} must divide by TP")

    # ------------------------------------------------------------------ declarations
    def sites(self, b: SiteBuilder, rank_spec: ModelSpec) -> None:
        tp, hidden = rank_spec.tp, rank_spec.hidden_size
        f, width = self.local(tp), self.width
        n_gate, n_latent = f.num_experts // tp, width // tp
        b.add("moe.gate_down", "moe.gate_down", weight_bytes=(n_gate + n_latent) * hidden * 2,
              N=n_gate + n_latent, K=hidden, n_gate=n_gate, attrs={"fuses": "moe.router_gemm,moe.latent_down"})
        b.gemm("moe.router_gemm", n_gate, hidden, out_dtype="float32" if f.router.fp32 else None)
        b.add("moe.router", "moe.router", E=f.num_experts, topk=f.top_k, attrs=router_attrs(f.router))
        b.gemm("moe.latent_down", n_latent, hidden)
        if self.input_norm:
            b.add("moe.latent_norm", "norm", N=width)
        b.add("moe.experts", "moe.experts", E=f.num_experts, topk=f.top_k, N=f.expert_intermediate, K=width,
              attrs={"activation": f.activation.kind, **({"per_route": True} if self.per_route else {}),
                     **expert_format_attrs(f)})
        if self.per_route:
            if tp > 1:
                b.add("moe.route_allreduce", "allreduce", tokens=b.tokens * f.top_k, N=width,
                      attrs={"residual": False, "norm": False})
            b.add("moe.finalize", "moe.finalize", N=width, topk=f.top_k, attrs={"norm": self.post_expert_norm})
        else:
            b.add("moe.latent_allreduce", "allreduce", N=width, attrs={"residual": False, "norm": self.output_norm})
        if f.num_shared_experts:
            inter = f.num_shared_experts * f.expert_intermediate
            b.add("moe.shared", "mlp", weight_bytes=3 * hidden * inter * 2, N=inter, K=hidden,
                  attrs={"activation": f.activation.kind, "side_stream": True})
        b.gemm("moe.latent_up", hidden // tp, width, residual=bool(f.num_shared_experts))

    def weights(self, spec: ModelSpec, tp: int) -> Sequence[WeightDecl]:
        f, H, Ld = self.spec, spec.hidden_size, self.width
        self._check_tp(H, tp)
        E, inter = f.num_experts, f.expert_intermediate
        out = [WeightDecl("router", (E, H), split=0)]
        if f.router.bias_corrected:
            out.append(WeightDecl("router_bias", (E,), dtype="float32"))
        out.append(WeightDecl("latent_down", (Ld, H), split=0))
        if self.input_norm:
            out.append(WeightDecl("latent_in_norm", (Ld,)))
        if self.output_norm:
            out.append(WeightDecl("latent_norm", (Ld,)))
        if self.per_route:
            out.append(WeightDecl("post_expert_norm", (Ld,)))
        out += [WeightDecl("latent_up", (H, Ld), split=0),
                WeightDecl("experts.w1", (E, inter, Ld), split=1, stored=f.expert_format),
                WeightDecl("experts.w3", (E, inter, Ld), split=1, stored=f.expert_format),
                WeightDecl("experts.w2", (E, Ld, inter), split=2, stored=f.expert_format)]
        if f.num_shared_experts:
            s = f.num_shared_experts * inter
            out += [WeightDecl("shared.gate_proj", (s, H), split=0), WeightDecl("shared.up_proj", (s, H), split=0),
                    WeightDecl("shared.down_proj", (H, s), split=1)]
        return out

    def states(self, spec: ModelSpec, tp: int) -> Sequence[StateDecl]:
        return []

    def buffers(self, spec: ModelSpec, max_rows: int, dtype: torch.dtype,
                device: torch.device) -> dict[str, torch.Tensor]:
        """The residual input of the latent all-reduce: zeros (it has no residual; x + 0 == x exactly)."""
        rows = max_rows * self.spec.top_k if self.per_route else max_rows   # per-route rows
        name = self._route_zeros_name if self.per_route else self._zeros_name
        return {name: torch.zeros(rows, self.width, dtype=dtype, device=device)}

    @property
    def _route_zeros_name(self) -> str:
        return f"latent_moe.route_zeros.{self.width}x{self.spec.top_k}"

    @property
    def _zeros_name(self) -> str:
        return f"latent_moe.zeros.{self.width}"

    def arrange(self, w: Mapping[str, torch.Tensor], rank_spec: ModelSpec) -> dict[str, torch.Tensor]:
        # router rows, then latent-down rows, in one tensor (the moe.gate_down site streams both in one
        # kernel); "gate" and "down" are views of it for the two gemm sites
        gate_down = torch.cat([w["router"], w["latent_down"]])
        n_gate = w["router"].shape[0]
        out = {"gate_down": gate_down, "gate": gate_down[:n_gate], "down": gate_down[n_gate:],
               **arrange_experts(join([w["experts.w1"], w["experts.w3"]], dim=1), w["experts.w2"]),
               "up": w["latent_up"]}
        for name in ("router_bias", "latent_in_norm", "latent_norm", "post_expert_norm"):
            if name in w:
                out[name] = w[name]
        if self.spec.num_shared_experts:
            out["shared_gate_up"] = torch.cat([w["shared.gate_proj"], w["shared.up_proj"]])
            out["shared_down"] = w["shared.down_proj"]
        return out

    # ------------------------------------------------------------------ computation
    @staticmethod
    def side_streams(step: StepContext) -> tuple[SideStream | None, SideStream | None]:
        """(shared-experts stream, router stream): the program's ``'side'`` stream (made where the plan marks
        ``moe.shared`` with ``side_stream``) and its ``'router'`` stream (a higher priority: the router GEMM
        leads to the router and the experts, the critical path). Both exist on CUDA devices only; without
        them the work runs inline on the current stream."""
        return step.streams.get("side"), step.streams.get("router")

    def _finalize(self, step: StepContext, w: Mapping[str, torch.Tensor], x: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, f: MoESpec) -> torch.Tensor:
        """Per-route expert rows, summed over ranks, normed, weighted and combined: ``[M, Ld]``."""
        b, k = x.shape[0], f.top_k
        routes = step.op("moe.experts")(x, weights, ids, w["w13"], w["w2"], f.activation, per_route=True)
        if step.tp > 1:  # the norm needs each route's whole row: sum the partials first
            flat = routes.reshape(b * k, routes.shape[-1])
            zeros = step.scratch.get(self._route_zeros_name)
            zeros = zeros[: b * k] if zeros is not None else flat.new_zeros(flat.shape)
            _, flat = step.op("moe.route_allreduce")(flat, zeros, None, self.post_expert_eps,
                                                     comm=step.comm_at(step.site("moe.route_allreduce")))
            routes = flat.view(b, k, -1)
        return step.op("moe.finalize")(routes, weights, w["post_expert_norm"], self.post_expert_eps,
                                       gain_before_norm=self.post_expert_norm == "input_scaled",
                                       zero_centered=self.post_expert_zero_centered)

    def forward(self, step: StepContext, w: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
                h: torch.Tensor) -> torch.Tensor:
        f, eps, b = self.local(step.tp), self.norm_eps, h.shape[0]
        side, router_side = self.side_streams(step)

        # the shared experts depend only on h: forked onto the side stream (a graph branch) they overlap
        # the router, the latent down-projection and the routed experts; joined before latent_up.
        # Up to shared_fork_late_max_batch the fork waits for the router inputs (see there)
        def fork_shared():
            return side.run(step.op("moe.shared"), h, w["shared_gate_up"], w["shared_down"], f.activation) \
                if (side is not None and f.num_shared_experts) else None

        late = b <= self.shared_fork_late_max_batch
        pending = None if late else fork_shared()
        # router logits (fp32 from the bf16 weight) and the latent input: at TP > 1 each rank computes its
        # slice of both and one all-gather joins them - no rank repeats another's weight reads
        logits_dtype = torch.promote_types(h.dtype, torch.float32) if f.router.fp32 else h.dtype
        # a communicator with gather slots takes both slices in place: the projections write straight into
        # its gathered buffers and the all-gather copies nothing (only for implementations that write such
        # a slice without a temporary and a copy of their own)
        slot = getattr(step.comm, "gather_slot", None) if step.tp > 1 else None
        fused = step.skipped("moe.router_gemm")

        def slot_for(role: str, n: int, dtype: torch.dtype) -> torch.Tensor | None:
            return slot((b, n), dtype, h.device)[1] if slot is not None and step.strided_out(role) else None

        lg_out = slot_for("moe.gate_down" if fused else "moe.router_gemm", w["gate"].shape[0], logits_dtype)
        x_out = slot_for("moe.gate_down" if fused else "moe.latent_down", w["down"].shape[0], h.dtype)
        if fused:  # both from one weight stream, one kernel
            logits, x = step.op("moe.gate_down")(h, w["gate_down"], w["gate"].shape[0], logits_out=lg_out,
                                                 latent_out=x_out)
        elif router_side is not None and b >= self.router_side_min_batch:  # a graph branch, joined before the router
            routing = router_side.run(step.op("moe.router_gemm"), h, w["gate"], out_dtype=logits_dtype, out=lg_out)
            x = step.op("moe.latent_down")(h, w["down"], out=x_out)
            logits = routing.join()
        else:
            logits = step.op("moe.router_gemm")(h, w["gate"], out_dtype=logits_dtype, out=lg_out)
            x = step.op("moe.latent_down")(h, w["down"], out=x_out)
        if late:
            pending = fork_shared()
        if step.tp > 1:
            logits, x = step.communicate("moe.all_gather", gather_parts, step.comm, [logits, x])
        weights, ids = step.op("moe.router")(logits, w.get("router_bias"), f.top_k, f.router)
        if self.input_norm:
            x = step.op("moe.latent_norm")(x, w["latent_in_norm"], eps, zero_centered=self.input_norm_zero_centered)
        if self.per_route:
            y = self._finalize(step, w, x, weights, ids, f)
        else:
            y = step.op("moe.experts")(x, weights, ids, w["w13"], w["w2"], f.activation)  # partial at TP > 1
            # all-reduce of the experts' partial latent, fused with the latent RMSNorm (no residual: zeros)
            zeros = step.scratch.get(self._zeros_name)
            zeros = zeros[:b] if zeros is not None else y.new_zeros(b, y.shape[-1])
            normed, y = step.op("moe.latent_allreduce")(y, zeros, w.get("latent_norm"), eps,
                                                        comm=step.comm_at(step.site("moe.latent_allreduce")))
            y = y if normed is None else normed
        if pending is not None:
            shared = pending.join()
        else:
            shared = step.op("moe.shared")(h, w["shared_gate_up"], w["shared_down"], f.activation) \
                if f.num_shared_experts else None
        if step.tp == 1:
            return step.op("moe.latent_up")(y, w["up"], residual=shared)
        # only this rank's hidden slice gets the up-projection, so the FFN all-reduce counts it once;
        # the shared experts' output is this step's own tensor: the slice is written into it in place
        H = h.shape[-1]
        lo, hi = step.rank * H // step.tp, (step.rank + 1) * H // step.tp
        if shared is None:
            shared = h.new_zeros(b, H)
        part = shared[:, lo:hi]  # [b, H/tp] rows of stride H: the gemm contract takes strided rows
        step.op("moe.latent_up")(y, w["up"], residual=part, out=part)  # adds and writes in place
        return shared

