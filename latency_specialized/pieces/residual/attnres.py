"""Block AttnRes residual piece: every sublayer input is a learned softmax mix of block outputs.

There is no additive residual stream. Sources (one static, source-major buffer ``sources[R, M, H]``,
each source a contiguous ``[M, H]`` slab): source 0 is the embedding, source ``k + 1`` the running
sum of block ``k``'s sublayer outputs (``block_size`` layers per block, two sublayers each). For
layer ``i`` of block ``k = i // block_size``:

* ``attn.attnres`` (``residual.attnres``, ``out_norm``): the attention input = RMSNorm(mix of sources
  ``[:k + 1]``, plus the partial source ``k + 1`` once the block has started) with the layer's input
  norm as the mix's output norm;
* ``attn.allreduce`` (allreduce, residual, no norm): the attention's TP partial sum, all-reduced and
  added straight into the partial-block source ``k + 1`` (its residual *and* its output: no copy);
* ``ffn.attnres`` / ``ffn.allreduce`` the same around the FFN (sources ``[:k + 2]``: the partial
  block now holds the attention output);
* at the end ``final.attnres`` (no output norm) over all ``R = cdiv(layers, block_size) + 1``
  sources, then ``final_norm`` (norm).

Site order follows the step: each join comes after its sublayer's sites (see :meth:`BlockAttnRes.sites`).
The partial sources start empty each step (zeroed: ``0 + x == x`` exactly). Matches vLLM's
``attn_res`` kernel (fp32 math, one rounding) with the partial block as a source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

import torch

from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.runtime.pieces_api import StepContext, WeightDecl
from latency_specialized.spec import ModelSpec

SOURCES = "attnres.sources"
"""Name of the static sources buffer in the program's scratch."""


def attnres_rows(num_layers: int, block_size: int) -> int:
    """Sources of the final mix: the embedding, every completed block and the partial one."""
    return -(-num_layers // block_size) + 1


@dataclass
class AttnResStream:
    """The stream state of one step: the sources of its rows."""

    sources: torch.Tensor
    """``[R, M, H]`` view of the static buffer."""


@dataclass(frozen=True)
class BlockAttnRes:
    """Block AttnRes of a model (see the module docstring).

    Weights per layer (piece-local names, checkpoint granularity): ``attn.norm`` ``[H]`` (the RMSNorm
    inside the mix logits), ``attn.query`` ``[1, H]`` (the pseudo-query, a Linear(H, 1) weight),
    ``attn.out_norm`` ``[H]`` (the attention's input norm), and the same three ``ffn.*`` for the FFN;
    final: ``norm``, ``query``, ``out_norm`` (the final norm before the LM head).
    """

    block_size: int
    """Layers per block (``ResidualSpec.block_size``)."""
    num_layers: int
    """Decoder layers of the model."""
    eps: float = 1e-6
    """Epsilon of the mix's RMSNorms and of the output norms (the model's rms_norm_eps)."""

    @classmethod
    def for_spec(cls, spec: ModelSpec) -> "BlockAttnRes":
        """The piece of a spec with ``residual.kind == 'attnres'``."""
        if spec.residual.kind != "attnres" or not spec.residual.block_size:
            raise ValueError(f"{spec.name}: residual {spec.residual.kind} with block size "
                             f"{spec.residual.block_size} is not Block AttnRes")
        return cls(spec.residual.block_size, spec.num_layers, spec.norm.eps)

    @property
    def rows(self) -> int:
        """Sources of the final mix (the buffer's first dimension)."""
        return attnres_rows(self.num_layers, self.block_size)

    # ------------------------------------------------------------------ declarations
    def sites(self, b: SiteBuilder, rank_spec: ModelSpec, where: Literal["attn", "ffn", "final"]) -> None:
        """The sites in the order a step calls them, given the program's order of calls (per layer kind
        'attn', the attention's sites, 'ffn', the FFN's sites; then 'final'): 'attn' adds the attention's
        mix; 'ffn' the attention's join then the FFN's mix; a kind's FFN join (``ffn.allreduce``, after
        the FFN's sites) is added by the next call - the next kind's 'attn', or 'final' before the
        final mix and norm."""
        self._pending_ffn_joins(b, rank_spec)
        H = rank_spec.hidden_size
        if where == "attn":
            self._mix_site(b, "attn.attnres", H, out_norm=True)
        elif where == "ffn":
            self._join_site(b, "attn.allreduce", H)
            self._mix_site(b, "ffn.attnres", H, out_norm=True)
        else:
            self._mix_site(b, "final.attnres", H, out_norm=False)
            b.add("final_norm", "norm", N=H)

    def _mix_site(self, b: SiteBuilder, role: str, hidden: int, *, out_norm: bool) -> None:
        b.add(role, "residual.attnres", weight_bytes=2 * hidden * 2, N=hidden, R=self.rows,
              attrs={"out_norm": out_norm})

    def _join_site(self, b: SiteBuilder, role: str, hidden: int) -> None:
        b.add(role, "allreduce", N=hidden, attrs={"residual": True, "norm": False})

    def _pending_ffn_joins(self, b: SiteBuilder, rank_spec: ModelSpec) -> None:
        """``ffn.allreduce`` of every other kind whose FFN mix is in ``b`` without its join (in its prefix)."""
        names = {s.name for s in b.sites}
        pending = [s for s in b.sites if s.name.endswith("/ffn.attnres")]
        prefix, layers = b.prefix, b.layers
        try:
            for s in pending:
                kind = s.name[:-len("/ffn.attnres")]
                if kind != prefix and f"{kind}/ffn.allreduce" not in names:
                    b.prefix, b.layers = kind, s.layers
                    self._join_site(b, "ffn.allreduce", rank_spec.hidden_size)
        finally:
            b.prefix, b.layers = prefix, layers

    def weights(self, spec: ModelSpec, tp: int, where: Literal["layer", "final"]) -> Sequence[WeightDecl]:
        H = spec.hidden_size
        if where == "final":
            return [WeightDecl("norm", (H,)), WeightDecl("query", (1, H)), WeightDecl("out_norm", (H,))]
        return [WeightDecl(f"{s}.{n}", shape) for s in ("attn", "ffn")
                for n, shape in (("norm", (H,)), ("query", (1, H)), ("out_norm", (H,)))]

    def buffers(self, spec: ModelSpec, max_rows: int, dtype: torch.dtype,
                device: torch.device) -> dict[str, torch.Tensor]:
        return {SOURCES: torch.zeros(self.rows, max_rows, spec.hidden_size, dtype=dtype, device=device)}

    # ------------------------------------------------------------------ computation
    def start(self, step: StepContext, x: torch.Tensor) -> AttnResStream:
        src = step.scratch[SOURCES][:, :step.rows]
        src.zero_()  # partial-block sources start empty: 0 + x == x exactly
        src[0].copy_(x)
        return AttnResStream(src)

    def before(self, step: StepContext, rs: AttnResStream, w: Mapping[str, torch.Tensor],
               which: Literal["attn", "ffn"]) -> torch.Tensor:
        i, bs = step.layer, self.block_size
        k = i // bs
        if which == "attn":
            n = k + 1 if i % bs == 0 else k + 2   # at a block start the partial source is still empty
        else:
            n = k + 2
        return step.op(f"{which}.attnres")(rs.sources, n, w[f"{which}.norm"], w[f"{which}.query"][0], self.eps,
                                           out_norm_weight=w[f"{which}.out_norm"], out_eps=self.eps)

    def after(self, step: StepContext, rs: AttnResStream, w: Mapping[str, torch.Tensor],
              which: Literal["attn", "ffn"], y: torch.Tensor) -> None:
        part = rs.sources[step.layer // self.block_size + 1]
        site = step.site(f"{which}.allreduce")
        # the sum goes straight back into the partial-block source (residual_out aliases residual)
        step.ops[site](y, part, None, self.eps, comm=step.comm_at(site), out=(None, part))

    def finish(self, step: StepContext, rs: AttnResStream, w: Mapping[str, torch.Tensor]) -> torch.Tensor:
        h = step.op("final.attnres")(rs.sources, self.rows, w["norm"], w["query"][0], self.eps)
        return step.op("final_norm")(h, w["out_norm"], self.eps)


__all__ = ["BlockAttnRes", "AttnResStream", "attnres_rows", "SOURCES"]
