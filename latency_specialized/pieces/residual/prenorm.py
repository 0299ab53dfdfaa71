"""Pre-norm additive residual: ``x = norm(h); y = f(x); h = h + y`` around every sublayer.

The residual stream ``h`` lives in one static buffer (``residual [max_rows, H]``) that the fused
all-reduce sites update in place (their ``residual_out`` aliases ``residual``). Sites, in the layer
kind's prefix:

* ``attn.norm`` (family ``norm``): the first layer's input norm of the embedding - only in the
  kind group that holds the model's first layer;
* ``attn.allreduce`` (family ``allreduce``): ``h += sum_ranks(attention partial)``, then the
  layer's post-attention norm gives the FFN input;
* ``ffn.allreduce``: ``h += sum_ranks(FFN partial)``, then the **next** layer's input norm - or,
  after the last layer, the model's final norm - gives the next input.

The final-norm rule: there is no ``final_norm`` site. Every sublayer output is joined by the fused
all-reduce of the sublayer that produced it, normalised with the weight of whatever consumes it;
so the last layer's ``ffn.allreduce`` applies the final norm (``finish``). That is vLLM's fused
add-RMSNorm chain: one kernel per sublayer boundary, none at the end.

Because the FFN all-reduce needs the next consumer's weight, ``after(.., 'ffn')`` only records the
partial and its site; the next ``before(.., 'attn')`` (with that layer's ``input_norm``) or
``finish`` (with the final ``norm``) makes the call - the site keeps the producing layer's name,
so a census counts it where it belongs.

Weights: per layer ``input_norm`` [H] and ``post_norm`` [H] (Hugging Face ``input_layernorm`` /
``post_attention_layernorm``); final ``norm`` [H] (``model.norm``). Norm flavour from the model's
``spec.norm`` (eps, zero-centred gains).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.runtime.pieces_api import StepContext, WeightDecl
from latency_specialized.spec import ModelSpec


@dataclass
class PreNormStream:
    """Stream state of one step."""

    residual: torch.Tensor
    """[M, H] the residual stream (a view of the static buffer)."""
    x: torch.Tensor | None = None
    """The normed input of the next sublayer (None before the first norm)."""
    pending: tuple[str, torch.Tensor] | None = None
    """(site, partial) of an FFN output not yet joined (see the module docstring)."""


@dataclass(frozen=True)
class PreNormResidual:
    """The classic pre-norm residual (Llama, Qwen, Mixtral ...)."""

    buffer: str = "residual"
    """Name of the static residual buffer in ``StepContext.scratch``."""

    # ------------------------------------------------------------------ declarations
    def sites(self, b: SiteBuilder, rank_spec: ModelSpec, where: Literal["attn", "ffn", "final"]) -> None:
        hidden = rank_spec.hidden_size
        if where == "attn":
            first = rank_spec.layers[0].index if rank_spec.layers else None
            if first in b.layers:  # called once per step, by the first layer only: the site stands for it alone
                group, b.layers = b.layers, (first,)
                b.add("attn.norm", "norm", N=hidden, attrs={"residual": False})
                b.layers = group
            b.add("attn.allreduce", "allreduce", N=hidden, attrs={"residual": True, "norm": True})
        elif where == "ffn":
            b.add("ffn.allreduce", "allreduce", N=hidden, attrs={"residual": True, "norm": True})

    def weights(self, spec: ModelSpec, tp: int, where: Literal["layer", "final"]) -> list[WeightDecl]:
        H = spec.hidden_size
        if where == "final":
            return [WeightDecl("norm", (H,))]
        return [WeightDecl("input_norm", (H,)), WeightDecl("post_norm", (H,))]

    def buffers(self, spec: ModelSpec, max_rows: int, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        return {self.buffer: torch.zeros(max_rows, spec.hidden_size, dtype=dtype, device=device)}

    # ------------------------------------------------------------------ forward
    def _join(self, step: StepContext, rs: PreNormStream, site: str, y: torch.Tensor, weight: torch.Tensor) -> None:
        norm = step.spec.norm
        x, _ = step.ops[site](y, rs.residual, weight, norm.eps, comm=step.comm_at(site),
                              zero_centered=norm.zero_centered, out=(None, rs.residual))
        rs.x = x

    def start(self, step: StepContext, x: torch.Tensor) -> PreNormStream:
        buf = step.scratch[self.buffer][: x.shape[0]]
        buf.copy_(x)
        return PreNormStream(buf)

    def before(self, step: StepContext, rs: PreNormStream, w: Mapping[str, torch.Tensor],
               which: Literal["attn", "ffn"]) -> torch.Tensor:
        if which == "attn":
            if rs.pending is not None:
                site, y = rs.pending
                rs.pending = None
                self._join(step, rs, site, y, w["input_norm"])
            elif rs.x is None:  # the first layer: its input norm of the embedding
                norm = step.spec.norm
                rs.x = step.op("attn.norm")(rs.residual, w["input_norm"], norm.eps, zero_centered=norm.zero_centered)
            else:
                raise UserError("pre-norm residual: before('attn') twice without an FFN in between")
        if rs.x is None:
            raise UserError(f"pre-norm residual: before({which!r}) of layer {step.layer} has no input")
        x, rs.x = rs.x, None
        return x

    def after(self, step: StepContext, rs: PreNormStream, w: Mapping[str, torch.Tensor],
              which: Literal["attn", "ffn"], y: torch.Tensor) -> None:
        if which == "attn":
            self._join(step, rs, step.site("attn.allreduce"), y, w["post_norm"])
        else:
            rs.pending = (step.site("ffn.allreduce"), y)

    def finish(self, step: StepContext, rs: PreNormStream, w: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if rs.pending is None:
            raise UserError("pre-norm residual: finish() without a last FFN output (a model needs >= 1 layer)")
        site, y = rs.pending
        rs.pending = None
        self._join(step, rs, site, y, w["norm"])
        x, rs.x = rs.x, None
        assert x is not None
        return x


__all__ = ["PreNormResidual", "PreNormStream"]
