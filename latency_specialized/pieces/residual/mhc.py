"""mHC residual piece: ``n`` parallel residual streams mixed by Sinkhorn-normalised matrices.

There is no single additive stream: the residual is ``R [M, n, H]`` (one static buffer,
``mhc.streams``). The embedding starts every stream (``R_i = x``). Every sublayer is framed by seams
(the ``residual.mhc`` family, ``ops/residual_mhc.py``, has the formulas):

* the seam in front of a sublayer folds the previous sublayer's output into the streams with that
  sublayer's ``post`` / ``comb`` mappings (``R_j <- sum_i comb[i, j] R_i + post_j y``), computes this
  sublayer's mappings from the updated streams (``pre``, ``post`` by sigmoids, ``comb`` by Sinkhorn),
  and collapses the streams into the sublayer input with the *carried* pre-mapping - the one the
  previous seam computed (stream 0 at the model's first seam) - then RMS-normalises it;
* after the last layer, ``final.mhc`` folds the last FFN output in and collapses with the last
  FFN seam's pre-mapping, then applies the model's final norm.

Sites, in the layer kind's prefix:

* ``attn.mhc`` / ``ffn.mhc`` (``residual.mhc``): the seam in front of the attention / the FFN (with
  the previous sublayer's post, except at the model's first seam);
* ``attn.allreduce`` / ``ffn.allreduce`` (``allreduce``, no residual, no norm: a zero residual from
  ``mhc.zeros``), only at TP > 1: the sublayer's partial sums, summed before the next seam reads them
  (every rank keeps the whole streams; the mixing is per token and replicated);
* ``final.mhc`` (model level): the last seam, with the final norm.

The coefficients (``pre`` / ``post`` / ``comb``, fp32) are step-local tensors the seams return; the
stream buffer is the only state across layers (it is written in place by the seams).

Weights per layer (piece-local names; fp32 as the checkpoint stores them): ``attn.fn``
``[(2 + n) n, n H]``, ``attn.base`` ``[(2 + n) n]``, ``attn.scale`` ``[3]`` and ``attn.norm`` ``[H]``
(the attention's input RMSNorm), the same four ``ffn.*``; final ``norm`` ``[H]``. All replicated.

Semantics checked against vLLM 0.33 (``models/deepseek_v41/nvidia/model.py``, the decoder layer's
``forward`` and ``DeepseekV4Model.forward``; ``model_executor/kernels/mhc/torch.py``:
``mhc_pre_delayed_torch``, ``mhc_post_torch``): the first seam projects the broadcast embedding
(vLLM folds the broadcast into the projection: ``fn`` summed over its stream blocks, equal in real
arithmetic), the post multiplier is 2, the same ``hc_eps`` serves the pre offset and Sinkhorn.
The paper's undelayed form (collapse with the seam's own pre-mapping, a learned final head) is not
implemented: no target model uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.residual_mhc import mhc_mix_width
from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.runtime.pieces_api import StepContext, WeightDecl
from latency_specialized.spec import ModelSpec

STREAMS = "mhc.streams"
"""Name of the static streams buffer ``[max_rows, n, H]`` in the program's scratch."""
ZEROS = "mhc.zeros"
"""Name of the static zero residual ``[max_rows, H]`` the TP all-reduce sites add to."""


@dataclass
class MHCStream:
    """Stream state of one step."""

    streams: torch.Tensor
    """``[M, n, H]`` view of the static buffer."""
    pre: torch.Tensor | None = None
    """``[M, n]`` fp32 pre-mapping carried to the next seam (None before the first seam)."""
    pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(output, post, comb) of the last sublayer, not yet folded into the streams."""
    post: torch.Tensor | None = None
    """``[M, n]`` post-mapping of the sublayer now running (from the seam in front of it)."""
    comb: torch.Tensor | None = None
    """``[M, n, n]`` its stream-mixing matrix."""
    seams: int = 0
    """Seams run this step (the first one folds nothing in)."""


@dataclass(frozen=True)
class MHCResidual:
    """mHC residual of a model (see the module docstring)."""

    streams: int
    """Parallel residual streams ``n`` (``ResidualSpec.streams``)."""
    sinkhorn_iters: int
    """Sinkhorn iterations of every stream-mixing matrix (``ResidualSpec.sinkhorn_iters``)."""
    eps: float = 1e-6
    """Epsilon of the sublayer-input RMSNorms, the final norm and the mixing projection's RMS (the
    model's rms_norm_eps)."""
    hc_eps: float = 1e-6
    """Offset of the pre-mapping and the Sinkhorn denominators (the checkpoint config's ``hc_eps``)."""
    post_mult: float = 2.0
    """Multiplier of the post-mapping's sigmoid."""

    def __post_init__(self) -> None:
        if self.streams < 1 or self.sinkhorn_iters < 1:
            raise UserError(f"mHC needs >= 1 stream and >= 1 Sinkhorn iteration, got {self.streams} / "
                            f"{self.sinkhorn_iters}")

    @classmethod
    def for_spec(cls, spec: ModelSpec, **kw) -> "MHCResidual":
        """The piece of a spec with ``residual.kind == 'mhc'`` (``kw``: hc_eps, post_mult)."""
        r = spec.residual
        if r.kind != "mhc" or not r.streams or not r.sinkhorn_iters:
            raise UserError(f"{spec.name}: residual {r.kind} with {r.streams} streams and {r.sinkhorn_iters} "
                            "Sinkhorn iterations is not mHC: set kind='mhc', streams and sinkhorn_iters")
        return cls(r.streams, r.sinkhorn_iters, spec.norm.eps, **kw)

    # ------------------------------------------------------------------ declarations
    def sites(self, b: SiteBuilder, rank_spec: ModelSpec, where: Literal["attn", "ffn", "final"]) -> None:
        H = rank_spec.hidden_size
        if where == "attn":
            self._seam(b, "attn.mhc", H, mix=True)
        elif where == "ffn":
            if rank_spec.tp > 1:
                self._allreduce(b, "attn.allreduce", H)
            self._seam(b, "ffn.mhc", H, mix=True)
            if rank_spec.tp > 1:  # joined before the next seam (listed here, as pre-norm lists its FFN join)
                self._allreduce(b, "ffn.allreduce", H)
        else:
            self._seam(b, "final.mhc", H, mix=False)

    def _seam(self, b: SiteBuilder, role: str, hidden: int, *, mix: bool) -> None:
        n = self.streams
        wbytes = mhc_mix_width(n) * n * hidden * 4 if mix else 0   # the fp32 projection, read per call
        b.add(role, "residual.mhc", weight_bytes=wbytes + hidden * 2, N=hidden, streams=n,
              iters=self.sinkhorn_iters if mix else 0, attrs={"mix": mix})

    def _allreduce(self, b: SiteBuilder, role: str, hidden: int) -> None:
        b.add(role, "allreduce", N=hidden, attrs={"residual": False, "norm": False})

    def weights(self, spec: ModelSpec, tp: int, where: Literal["layer", "final"]) -> list[WeightDecl]:
        H, n = spec.hidden_size, self.streams
        if where == "final":
            return [WeightDecl("norm", (H,))]
        return [d for s in ("attn", "ffn") for d in (
            WeightDecl(f"{s}.fn", (mhc_mix_width(n), n * H), dtype="float32"),
            WeightDecl(f"{s}.base", (mhc_mix_width(n),), dtype="float32"),
            WeightDecl(f"{s}.scale", (3,), dtype="float32"),
            WeightDecl(f"{s}.norm", (H,)))]

    def buffers(self, spec: ModelSpec, max_rows: int, dtype: torch.dtype,
                device: torch.device) -> dict[str, torch.Tensor]:
        H = spec.hidden_size
        return {STREAMS: torch.zeros(max_rows, self.streams, H, dtype=dtype, device=device),
                ZEROS: torch.zeros(max_rows, H, dtype=dtype, device=device)}

    # ------------------------------------------------------------------ computation
    def _call(self, step: StepContext, rs: MHCStream, site: str, w: Mapping[str, torch.Tensor] | None,
              norm: torch.Tensor) -> torch.Tensor:
        y, post, comb = rs.pending if rs.pending is not None else (None, None, None)
        if rs.seams and y is None:
            raise UserError(f"mHC residual: {site} of layer {step.layer} has no sublayer output to fold in "
                            "(before() twice without after() in between?)")
        pre_in = rs.pre
        fn, scale, base = (w["fn"], w["scale"], w["base"]) if w is not None else (None, None, None)
        x, pre, rs.post, rs.comb = step.ops[site](rs.streams, fn, scale, base, norm, self.eps, pre=pre_in, y=y,
                                                  post=post, comb=comb, rms_eps=self.eps, hc_eps=self.hc_eps,
                                                  post_mult=self.post_mult, sinkhorn_iters=self.sinkhorn_iters)
        if pre is not None:
            rs.pre = pre
        rs.pending, rs.seams = None, rs.seams + 1
        return x

    def start(self, step: StepContext, x: torch.Tensor) -> MHCStream:
        buf = step.scratch[STREAMS][: x.shape[0]]
        buf.copy_(x.unsqueeze(1).expand_as(buf))   # every stream starts as the embedding
        return MHCStream(buf)

    def before(self, step: StepContext, rs: MHCStream, w: Mapping[str, torch.Tensor],
               which: Literal["attn", "ffn"]) -> torch.Tensor:
        own = {k: w[f"{which}.{k}"] for k in ("fn", "scale", "base")}
        return self._call(step, rs, step.site(f"{which}.mhc"), own, w[f"{which}.norm"])

    def after(self, step: StepContext, rs: MHCStream, w: Mapping[str, torch.Tensor],
              which: Literal["attn", "ffn"], y: torch.Tensor) -> None:
        if rs.post is None or rs.comb is None:
            raise UserError(f"mHC residual: after({which!r}) of layer {step.layer} without its seam")
        if step.tp > 1:
            site = step.site(f"{which}.allreduce")
            _, y = step.ops[site](y, step.scratch[ZEROS][: y.shape[0]], None, self.eps, comm=step.comm_at(site))
        rs.pending = (y, rs.post, rs.comb)
        rs.post = rs.comb = None

    def finish(self, step: StepContext, rs: MHCStream, w: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if rs.pending is None:
            raise UserError("mHC residual: finish() without a last FFN output (a model needs >= 1 layer)")
        return self._call(step, rs, step.site("final.mhc"), None, w["norm"])


__all__ = ["MHCResidual", "MHCStream", "STREAMS", "ZEROS"]
