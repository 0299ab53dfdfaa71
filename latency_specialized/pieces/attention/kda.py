"""KDA attention piece: gated delta-rule linear attention with a recurrent fp32 state per sequence.

Sites (per rank, in call order; ``hd`` = the rank's heads x head_dim):

* ``attn.in_proj`` (gemm): one projection of h for q | k | v | g_out (each ``hd`` wide), the low-rank
  decay input f_a (``decay_rank``, replicated on every rank) and the write strength beta (one per
  head), rows zero-padded to a multiple of 16 (vLLM's ``in_proj_qkvgfab``; cuBLAS picks an sm80
  kernel for N=6284 at M=64: 39 vs 27 us for N=6288, H200);
* ``attn.kda`` (``attention.kda``): short conv + SiLU, L2 norms, decay, the gated delta rule, the
  gated output RMSNorm; the decay input ``f_b_proj(f_a)`` is computed inside the op (its kernel
  fuses the small gemm per head, so f_b has no site of its own);
* ``attn.o_proj`` (gemm, row-parallel: a TP partial sum).

With ``spec_tokens > 0`` (speculative decoding, ``ops/attention/NOTES_verify.md``) two more sites, used by a
step that carries ``spec_tokens`` (1 + k request-major rows per request, ``meta['rows']`` per request):

* ``attn.kda_accept`` (``attention.kda_accept``), first (before ``attn.in_proj``): moves each request's
  live states on to the prefix its previous verification step had accepted (``meta['accepted']``, -1
  where nothing is pending);
* ``attn.kda_verify`` (``attention.kda_verify``) in place of ``attn.kda``: the 1 + k tokens of each
  request in order, every token's output, a per-token rollback tape per state row; the live states
  stay as they were.

States per layer (rows: one per sequence, row 0 = padding scratch): ``conv`` ``[3*hd, W-1]`` (the
last W-1 inputs of q|k|v, oldest first, activation dtype) and ``state`` ``[H, D, D]`` fp32
(``[value, key]``). With ``spec_tokens > 0`` also the rollback tapes ``tape_state`` ``[1 + k, H, 3, D]``
fp32 and ``tape_conv`` ``[1 + k, 3*hd]`` (``ops.attention.kda_verify``).

TP: column-parallel q/k/v/g/beta/f_b projections, conv taps, A_log and dt_bias of the rank's heads
(f_a replicated: every head reads all of it), row-parallel o_proj.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Mapping, Sequence

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.attention.kda_verify import tape_shapes
from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.runtime.pieces_api import StateDecl, StepContext, WeightDecl
from latency_specialized.spec import KDAAttentionSpec, ModelSpec


def in_proj_rows(a: KDAAttentionSpec) -> int:
    """Rows of the fused input projection (q, k, v, g_out, f_a, beta) padded to a multiple of 16."""
    rows = 4 * a.num_heads * a.head_dim + a.decay_rank + a.num_heads
    return rows + (-rows % 16)


@functools.lru_cache(maxsize=64)
def _local(a: KDAAttentionSpec, tp: int) -> KDAAttentionSpec:
    return a.shard(tp) if tp > 1 else a


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (the padded width of a fused projection)."""
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


@dataclass(frozen=True)
class KDAAttention:
    """KDA attention of every layer of one kind (see the module docstring).

    Weights (piece-local names, checkpoint granularity): ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj``
    ``[H*D, hidden]``; ``f_a_proj`` ``[R, hidden]``; ``b_proj`` ``[H, hidden]``; ``f_b_proj``
    ``[H*D, R]``; ``q_conv``, ``k_conv``, ``v_conv`` ``[H*D, 1, W]`` fp32; ``A_log`` ``[H]`` fp32;
    ``dt_bias`` ``[H*D]`` fp32; ``o_norm`` ``[D]`` fp32; ``o_proj`` ``[hidden, H*D]``.
    """

    spec: KDAAttentionSpec
    """The unsharded attention shape."""
    norm_eps: float = 1e-5
    """Epsilon of the gated output RMSNorm (vLLM's FusedRMSNormGated default; a model's config eps may differ)."""
    spec_tokens: int = 0
    """The most draft tokens per step this piece verifies; 0: no verification sites and no tapes (the tapes
    are states of 1 + k tokens per sequence row and layer: allocate them only where speculation runs)."""

    role: ClassVar[str] = "attn"

    def local(self, tp: int) -> KDAAttentionSpec:
        """This rank's attention shape at TP ``tp``."""
        return _local(self.spec, tp)

    # ------------------------------------------------------------------ declarations
    def sites(self, b: SiteBuilder, rank_spec: ModelSpec) -> None:
        a, hidden = self.local(rank_spec.tp), rank_spec.hidden_size
        hd = a.num_heads * a.head_dim
        b.gemm("attn.in_proj", in_proj_rows(a), hidden)
        b.add("attn.kda", "attention.kda", weight_bytes=hd * a.decay_rank * 2, heads=a.num_heads,
              head_dim=a.head_dim, conv=a.conv_kernel, decay_rank=a.decay_rank)
        b.gemm("attn.o_proj", hidden, hd)
        if self.spec_tokens:
            dims = dict(heads=a.num_heads, head_dim=a.head_dim, conv=a.conv_kernel)
            attrs = {"spec_tokens": self.spec_tokens}
            b.add("attn.kda_accept", "attention.kda_accept", attrs=attrs, **dims)
            b.add("attn.kda_verify", "attention.kda_verify", weight_bytes=hd * a.decay_rank * 2, attrs=attrs,
                  decay_rank=a.decay_rank, **dims)

    def weights(self, spec: ModelSpec, tp: int) -> Sequence[WeightDecl]:
        a, H = self.spec, spec.hidden_size
        hd, R, W = a.num_heads * a.head_dim, a.decay_rank, a.conv_kernel
        return [
            *(WeightDecl(f"{n}_proj", (hd, H), split=0) for n in ("q", "k", "v", "g")),
            WeightDecl("f_a_proj", (R, H)),
            WeightDecl("b_proj", (a.num_heads, H), split=0),
            WeightDecl("f_b_proj", (hd, R), split=0),
            *(WeightDecl(f"{n}_conv", (hd, 1, W), split=0, dtype="float32") for n in ("q", "k", "v")),
            WeightDecl("A_log", (a.num_heads,), split=0, dtype="float32"),
            WeightDecl("dt_bias", (hd,), split=0, dtype="float32"),
            WeightDecl("o_norm", (a.head_dim,), dtype="float32"),
            WeightDecl("o_proj", (H, hd), split=1),
        ]

    def states(self, spec: ModelSpec, tp: int) -> Sequence[StateDecl]:
        a = self.local(tp)
        hd = a.num_heads * a.head_dim
        return [StateDecl("conv", "rows", (3 * hd, a.conv_kernel - 1), split=0, parts=(hd, hd, hd)),
                StateDecl("state", "rows", (a.num_heads, a.head_dim, a.head_dim), dtype="float32", split=0),
                *self._tapes(a)]

    def _tapes(self, a: KDAAttentionSpec) -> Sequence[StateDecl]:
        if not self.spec_tokens:
            return []
        hd = a.num_heads * a.head_dim
        ts, tc = tape_shapes(a.num_heads, a.head_dim, self.spec_tokens)
        return [StateDecl("tape_state", "rows", ts, dtype="float32", split=1),
                StateDecl("tape_conv", "rows", tc, split=1, parts=(hd, hd, hd))]

    def arrange(self, w: Mapping[str, torch.Tensor], rank_spec: ModelSpec) -> dict[str, torch.Tensor]:
        a = self.local(rank_spec.tp)
        return {
            # q | k | v | g_out | f_a | beta, zero-padded to 16 rows
            "in_proj": _pad_rows(torch.cat([w["q_proj"], w["k_proj"], w["v_proj"], w["g_proj"], w["f_a_proj"],
                                            w["b_proj"]]), in_proj_rows(a)),
            "f_b_proj": w["f_b_proj"],
            "conv": torch.cat([w[f"{n}_conv"][:, 0] for n in ("q", "k", "v")]),   # [3*hd, W]
            "A_log": w["A_log"], "dt_bias": w["dt_bias"], "o_norm": w["o_norm"], "o_proj": w["o_proj"],
        }

    # ------------------------------------------------------------------ computation
    def forward(self, step: StepContext, w: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
                h: torch.Tensor) -> torch.Tensor:
        a = self.local(step.tp)
        hd, R = a.num_heads * a.head_dim, a.decay_rank
        k = step.spec_tokens  # draft tokens per request of this step (0: a plain decode step)
        if k:
            self._accept(step, k, state, h.shape[0])
        y = step.op("attn.in_proj")(h, w["in_proj"])
        mixed, g_out = y[:, :3 * hd], y[:, 3 * hd:4 * hd]
        f_a, beta = y[:, 4 * hd:4 * hd + R], y[:, 4 * hd + R:4 * hd + R + a.num_heads]
        if k:
            return step.op("attn.o_proj")(self._verify(step, state, w, mixed, f_a, beta, g_out), w["o_proj"])
        # the decay input f_b_proj(f_a) is computed inside the KDA op (its kernel fuses the small gemm)
        o = step.op("attn.kda")(mixed, state["conv"], w["conv"], f_a, w["A_log"], w["dt_bias"], beta, g_out,
                                w["o_norm"], state["state"], step.meta["rows"], num_heads=a.num_heads,
                                eps=self.norm_eps, gate_lower_bound=a.gate_lower_bound, f_b_weight=w["f_b_proj"])
        return step.op("attn.o_proj")(o, w["o_proj"])

    def _accept(self, step: StepContext, k: int, state: Mapping[str, torch.Tensor], rows_of_step: int) -> None:
        """Move the live states on to the prefix the previous verification step accepted
        (``meta['accepted']``, -1 where nothing is pending). Called before the input projection, not next
        to the verification op: a KDA kernel requests its state before its programmatic-dependent-launch
        wait, so two kernels on the same state rows must not be adjacent in the stream."""
        rows = step.meta["rows"]
        if k > self.spec_tokens:
            raise UserError(f"a step with {k} speculative tokens, but this KDA piece keeps tapes for "
                            f"{self.spec_tokens}: build it with spec_tokens >= {k}")
        if rows.shape[0] * (1 + k) != rows_of_step:
            raise UserError(f"a verification step of {rows_of_step} rows with {rows.shape[0]} state rows: pass "
                            f"meta['rows'] per request ({rows_of_step // (1 + k)} for 1 + {k} tokens each)")
        step.op("attn.kda_accept")(state["conv"], state["state"], rows, step.meta["accepted"], state["tape_state"],
                                   state["tape_conv"])

    def _verify(self, step: StepContext, state: Mapping[str, torch.Tensor], w: Mapping[str, torch.Tensor],
                mixed: torch.Tensor, f_a: torch.Tensor, beta: torch.Tensor, g_out: torch.Tensor) -> torch.Tensor:
        """A verification step: 1 + k rows per request (request-major), ``meta['rows']`` one state row per
        request; every token's output, the tapes written, the live states left as they are."""
        a = self.local(step.tp)
        return step.op("attn.kda_verify")(mixed, state["conv"], w["conv"], f_a, w["A_log"], w["dt_bias"], beta, g_out,
                                          w["o_norm"], state["state"], step.meta["rows"], state["tape_state"],
                                          state["tape_conv"], num_heads=a.num_heads, eps=self.norm_eps,
                                          gate_lower_bound=a.gate_lower_bound, f_b_weight=w["f_b_proj"])
