"""Gated norm-preserving residual: ``s = alpha * s + beta * y`` at every join, ``x = norm(s)``.

Per sublayer a learned gate ``w`` (per channel, ``[H]``; or one scalar) gives ``beta =
sigmoid(w / T)`` and ``alpha = sqrt(max(sigmoid(-w / T) (1 + beta), eps))`` (``= sqrt(1 - beta^2)``:
for unit-RMS, uncorrelated ``s`` and ``y`` the joined stream keeps unit RMS - "norm-preserving"). The
next sublayer's input is the pre-norm of the joined stream. Muse Spark's values: ``T = 0.3``,
``eps = 1e-3``, per channel (vLLM 0.33: ``models/muse_spark/common/layers.py``,
``MuseSpark1xNormPreservingResidualConnection.coefficients``).

Every join is one call of the ``residual.gated`` family (``ops/residual_gated.py``: post-norm, gate,
next norm in one pass, as vLLM's fused boundary kernel), so that a post-sublayer norm (sandwich
norms, ``pieces/residual/sandwich.py``) is an option of the same join: :class:`GatedResidual` is the
join with no post norm; ``SandwichResidual`` subclasses it and adds the post norms.

Sites, in the layer kind's prefix:

* ``attn.norm`` (``residual.gated``, no join): the first layer's input norm of the embedding stream,
  only in the kind group that holds the model's first layer;
* ``attn.allreduce`` / ``ffn.allreduce`` (``allreduce``, no residual, no norm: a zero residual), only at
  TP > 1: the sublayer's partial sums, summed before the join (a gate does not commute with the sum);
* ``attn.join`` (``residual.gated``): the attention output joined; the FFN's input norm;
* ``ffn.join``: the FFN output joined; the **next** layer's input norm - or, after the last layer,
  the model's final norm. As in the pre-norm residual, the join needs its consumer's weight: it runs
  in the next ``before('attn')`` (or ``finish``) under the producing layer's site name, with the
  producing layer's gate (and post norm).

The stream lives in one static buffer (``gated.stream``), in the activation dtype or fp32
(``stream_dtype``; Muse Spark keeps fp32); sublayer inputs are in the activation dtype.

Weights per layer: ``attn.pre_norm``, ``ffn.pre_norm`` ``[H]``; with a gate ``attn.gate``,
``ffn.gate`` ``[H]`` (``[1]`` for a scalar gate; fp32); final ``norm`` ``[H]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.residual_gated import PostNorm
from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.runtime.pieces_api import StepContext, WeightDecl
from latency_specialized.spec import ModelSpec

STREAM = "gated.stream"
"""Name of the static stream buffer ``[max_rows, H]`` in the program's scratch."""
ZEROS = "gated.zeros"
"""Name of the static zero residual ``[max_rows, H]`` the TP all-reduce sites add to."""


@dataclass(frozen=True)
class NormPreservingGate:
    """The gate of one join: ``beta = sigmoid(w / temperature)``, ``alpha = sqrt(max(1 - beta^2, eps))``."""

    temperature: float = 0.3
    """Divides the gate logits (Muse Spark: 0.3, the config's residual_gate_temperature)."""
    eps: float = 1e-3
    """Floor of ``alpha^2``."""
    channel_wise: bool = True
    """One logit per channel ``[H]``; False: one scalar ``[1]``."""

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise UserError(f"gate temperature {self.temperature}: use a positive temperature")

    def shape(self, hidden: int) -> tuple[int, ...]:
        return (hidden,) if self.channel_wise else (1,)

    def call_kw(self, logits: torch.Tensor) -> dict[str, Any]:
        """The gate's arguments of a ``residual.gated`` call."""
        return {"gate": logits, "gate_temperature": self.temperature, "gate_eps": self.eps}


@dataclass
class GatedStream:
    """Stream state of one step."""

    stream: torch.Tensor
    """[M, H] the residual stream (a view of the static buffer)."""
    act_dtype: torch.dtype
    """Dtype of the sublayer inputs (the embedding's)."""
    x: torch.Tensor | None = None
    """The normed input of the next sublayer (None before the first norm)."""
    pending: tuple[str, torch.Tensor, Mapping[str, torch.Tensor]] | None = None
    """(site, summed FFN output, the producing layer's weights) of an FFN output not yet joined."""


@dataclass(frozen=True)
class GatedResidual:
    """Pre-norm residual with norm-preserving gated joins (see the module docstring)."""

    gate: NormPreservingGate | None = NormPreservingGate()
    """The joins' gate; None: plain adds (a sandwich-normed model without gates)."""
    eps: float = 1e-6
    """Epsilon of the sublayer-input norms and the final norm (the model's rms_norm_eps)."""
    zero_centered: bool = False
    """Sublayer-input norm gains are ``1 + w``."""
    final_zero_centered: bool | None = None
    """The final norm's gain is ``1 + w``; None: as ``zero_centered`` (Muse Spark: False - its output
    norm's gain centre is 0 while every other norm's is 1)."""
    stream_dtype: Literal["act", "float32"] = "act"
    """Storage of the residual stream."""

    # ------------------------------------------------------------------ options of the join (sandwich overrides)
    def post_norm(self, which: Literal["attn", "ffn"]) -> PostNorm:
        """The post-sublayer norm of ``which``'s output: none here."""
        return "none"

    def post_kw(self, which: Literal["attn", "ffn"], w: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The post-norm arguments of the join of ``which`` (``w``: the producing layer's weights)."""
        return {}

    @classmethod
    def for_spec(cls, spec: ModelSpec, **kw: Any) -> "GatedResidual":
        """The piece of a spec (norm eps and zero-centred gains from ``spec.norm``; ``kw``: the rest)."""
        piece = cls(**{"eps": spec.norm.eps, "zero_centered": spec.norm.zero_centered, **kw})
        if (piece.gate is not None) != (spec.residual.kind == "gated"):
            raise UserError(f"{spec.name}: residual kind {spec.residual.kind!r} with "
                            f"{'a' if piece.gate is not None else 'no'} gate: gated joins go with kind 'gated'")
        return piece

    # ------------------------------------------------------------------ declarations
    def _site_attrs(self, which: str) -> dict[str, Any]:
        return {"join": True, "post": self.post_norm(which), "gate": self.gate is not None,  # type: ignore[arg-type]
                "stream": self.stream_dtype}

    def sites(self, b: SiteBuilder, rank_spec: ModelSpec, where: Literal["attn", "ffn", "final"]) -> None:
        H = rank_spec.hidden_size
        if where == "attn":
            first = rank_spec.layers[0].index if rank_spec.layers else None
            if first in b.layers:  # called once per step, by the first layer only
                group, b.layers = b.layers, (first,)
                b.add("attn.norm", "residual.gated", N=H, attrs={"join": False, "post": "none", "gate": False,
                                                                 "stream": self.stream_dtype})
                b.layers = group
        elif where == "ffn":
            for which in ("attn", "ffn"):
                if rank_spec.tp > 1:
                    b.add(f"{which}.allreduce", "allreduce", N=H, attrs={"residual": False, "norm": False})
                b.add(f"{which}.join", "residual.gated", N=H, attrs=self._site_attrs(which))

    def weights(self, spec: ModelSpec, tp: int, where: Literal["layer", "final"]) -> list[WeightDecl]:
        H = spec.hidden_size
        if where == "final":
            return [WeightDecl("norm", (H,))]
        out = [WeightDecl("attn.pre_norm", (H,)), WeightDecl("ffn.pre_norm", (H,))]
        if self.gate is not None:
            out += [WeightDecl(f"{s}.gate", self.gate.shape(H), dtype="float32") for s in ("attn", "ffn")]
        return out + self.post_weights(H)

    def post_weights(self, hidden: int) -> list[WeightDecl]:
        """Per-layer weights of the post norms: none here."""
        return []

    def buffers(self, spec: ModelSpec, max_rows: int, dtype: torch.dtype,
                device: torch.device) -> dict[str, torch.Tensor]:
        H = spec.hidden_size
        sdt = dtype if self.stream_dtype == "act" else (torch.float64 if dtype == torch.float64 else torch.float32)
        return {STREAM: torch.zeros(max_rows, H, dtype=sdt, device=device),
                ZEROS: torch.zeros(max_rows, H, dtype=dtype, device=device)}

    # ------------------------------------------------------------------ forward
    def _summed(self, step: StepContext, which: str, y: torch.Tensor) -> torch.Tensor:
        if step.tp == 1:
            return y
        site = step.site(f"{which}.allreduce")
        _, y = step.ops[site](y, step.scratch[ZEROS][: y.shape[0]], None, self.eps, comm=step.comm_at(site))
        return y

    def _join(self, step: StepContext, rs: GatedStream, site: str, which: Literal["attn", "ffn"], y: torch.Tensor,
              producer: Mapping[str, torch.Tensor], weight: torch.Tensor, zero_centered: bool) -> torch.Tensor:
        kw = dict(self.post_kw(which, producer))
        if self.gate is not None:
            kw.update(self.gate.call_kw(producer[f"{which}.gate"]))
        x, _ = step.ops[site](y, rs.stream, weight, self.eps, zero_centered=zero_centered,
                              post=self.post_norm(which), out_dtype=rs.act_dtype, **kw)
        return x

    def start(self, step: StepContext, x: torch.Tensor) -> GatedStream:
        buf = step.scratch[STREAM][: x.shape[0]]
        buf.copy_(x)
        return GatedStream(buf, x.dtype)

    def before(self, step: StepContext, rs: GatedStream, w: Mapping[str, torch.Tensor],
               which: Literal["attn", "ffn"]) -> torch.Tensor:
        if which == "attn":
            if rs.pending is not None:
                site, y, producer = rs.pending
                rs.pending = None
                rs.x = self._join(step, rs, site, "ffn", y, producer, w["attn.pre_norm"], self.zero_centered)
            elif rs.x is None:  # the first layer: its input norm of the embedding stream
                rs.x, _ = step.op("attn.norm")(None, rs.stream, w["attn.pre_norm"], self.eps,
                                               zero_centered=self.zero_centered, out_dtype=rs.act_dtype)
            else:
                raise UserError("gated residual: before('attn') twice without an FFN in between")
        if rs.x is None:
            raise UserError(f"gated residual: before({which!r}) of layer {step.layer} has no input")
        x, rs.x = rs.x, None
        return x

    def after(self, step: StepContext, rs: GatedStream, w: Mapping[str, torch.Tensor],
              which: Literal["attn", "ffn"], y: torch.Tensor) -> None:
        y = self._summed(step, which, y)
        if which == "attn":
            rs.x = self._join(step, rs, step.site("attn.join"), "attn", y, w, w["ffn.pre_norm"], self.zero_centered)
        else:
            rs.pending = (step.site("ffn.join"), y, w)

    def finish(self, step: StepContext, rs: GatedStream, w: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if rs.pending is None:
            raise UserError("gated residual: finish() without a last FFN output (a model needs >= 1 layer)")
        site, y, producer = rs.pending
        rs.pending = None
        zc = self.zero_centered if self.final_zero_centered is None else self.final_zero_centered
        return self._join(step, rs, site, "ffn", y, producer, w["norm"], zc)


__all__ = ["GatedResidual", "GatedStream", "NormPreservingGate", "STREAM", "ZEROS"]
