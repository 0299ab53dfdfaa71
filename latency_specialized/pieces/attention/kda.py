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

States per layer (rows: one per sequence, row 0 = padding scratch): ``conv`` ``[3*hd, W-1]`` (the
last W-1 inputs of q|k|v, oldest first, activation dtype) and ``state`` ``[H, D, D]`` fp32
(``[value, key]``).

TP: column-parallel q/k/v/g/beta/f_b projections, conv taps, A_log and dt_bias of the rank's heads
(f_a replicated: every head reads all of it), row-parallel o_proj.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Mapping, Sequence

import torch

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
                StateDecl("state", "rows", (a.num_heads, a.head_dim, a.head_dim), dtype="float32", split=0)]

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
        y = step.op("attn.in_proj")(h, w["in_proj"])
        mixed, g_out = y[:, :3 * hd], y[:, 3 * hd:4 * hd]
        f_a, beta = y[:, 4 * hd:4 * hd + R], y[:, 4 * hd + R:4 * hd + R + a.num_heads]
        # the decay input f_b_proj(f_a) is computed inside the KDA op (its kernel fuses the small gemm)
        o = step.op("attn.kda")(mixed, state["conv"], w["conv"], f_a, w["A_log"], w["dt_bias"], beta, g_out,
                                w["o_norm"], state["state"], step.meta["rows"], num_heads=a.num_heads,
                                eps=self.norm_eps, gate_lower_bound=a.gate_lower_bound, f_b_weight=w["f_b_proj"])
        return step.op("attn.o_proj")(o, w["o_proj"])
