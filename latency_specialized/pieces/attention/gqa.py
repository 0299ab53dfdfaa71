"""Grouped-query attention over a paged KV cache (Llama / Qwen / Mistral / gpt-oss style decode).

Per step (``M`` rows, one new token each; per rank ``Hq`` query heads, ``KV`` key/value heads)::

    qkv = x @ [Wq; Wk; Wv; (Wg)]^T                attn.qkv_proj  (gemm; one weight stream)
    q, k = rmsnorm per head (optional)            attn.q_norm / attn.k_norm  (norm, rows = M * heads)
    q, k = rope(q, k, positions) (optional)       glue (fp32, one rounding; pieces/attention/rope.py)
      (both in one call where a kernel serves     attn.qk_prep (attention.qk_norm_rope,
       attn.qk_prep; the three above skipped)       fuses='attn.q_norm,attn.k_norm'; with a QK norm)
    o = attention(q, write(k, v) into the cache)  attn.gqa  (attention.gqa, KV-write convention)
    o = rmsnorm per head (optional, weightless)   attn.out_norm (norm: gated form with the output gate)
    o = o * sigmoid(g) (optional output gate)     glue, or inside attn.out_norm
    y = o @ Wo^T                                  attn.o_proj (a TP partial sum)

Order and numerics follow Hugging Face's Qwen3 attention: q/k are per-head RMS-normed (eps inside the
rsqrt of the mean square, the norm weight multiplies the normed value) *before* RoPE, which rotates
half (NeoX) with ``inv_freq = theta ** (-2i / D)``; the softmax scale is ``head_dim ** -0.5`` unless
the spec sets one. Options: weightless QK norm (Muse Spark), interleaved / partial RoPE, NoPE
(``rope_theta=None``), a weightless per-head RMSNorm of the attention output before the gate
(``out_norm``, Muse Spark's ``o_norm``), a sliding window (``spec.sliding_window``: the last ``window`` tokens, the new
one included), attention sinks (a per-head logit added to the softmax denominator, gpt-oss), and a
sigmoid output gate (``spec.output_gate``).

TP: query heads split across ranks; KV heads too, or replicated past TP = num_kv_heads (rank r keeps
KV head ``r // (tp / KV)``, the one its query heads read - vLLM's layout); o_proj's columns with
the heads. The KV cache per rank holds its KV heads (states ``k`` and ``v``, paged, ``[KV, D]`` per
token).

Weights (per layer; Hugging Face ``self_attn.*``): ``q_proj`` [Hq*D, H], ``k_proj`` / ``v_proj``
[KV*D, H], ``o_proj`` [H, Hq*D]; ``g_proj`` [Hq*D, H] with the output gate; ``q_norm`` / ``k_norm``
[D] with a weighted QK norm; ``sinks`` [Hq] fp32 with sinks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Literal, Mapping

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.attention.dcp import dcp_gqa_decode
from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.pieces.attention.rope import RopeStyle, apply_rope, rope_inv_freq
from latency_specialized.runtime.pieces_api import StateDecl, StepContext, WeightDecl, join
from latency_specialized.spec import GQAAttentionSpec, ModelSpec

QKNorm = Literal["none", "weighted", "weightless"]


@functools.lru_cache(maxsize=None)
def _local(spec: GQAAttentionSpec, tp: int) -> GQAAttentionSpec:
    return spec.shard(tp) if tp > 1 else spec


def kv_replicas(spec: GQAAttentionSpec, tp: int) -> int:
    """Ranks that hold the same KV head (1 unless TP exceeds the KV heads)."""
    if spec.num_kv_heads >= tp:
        return 1
    if tp % spec.num_kv_heads:
        raise UserError(f"TP={tp} not supported: {spec.num_kv_heads} KV heads replicate only when TP is a multiple "
                        "of them; pick a TP that divides or is a multiple of the KV heads")
    return tp // spec.num_kv_heads


@dataclass(frozen=True)
class GQAAttention:
    """GQA decode piece (``role`` 'attn'); see the module docstring."""

    role: ClassVar[str] = "attn"
    supports_dcp: ClassVar[bool] = True
    """Runs over a KV cache split across a DCP group (``StepContext.dcp``: ``ops.attention.dcp.dcp_gqa_decode``)."""
    spec: GQAAttentionSpec
    """The unsharded attention (heads, KV heads, head_dim, window, rope_theta, scale, output gate)."""
    qk_norm: QKNorm | None = None
    """Per-head RMSNorm of q and k: 'weighted' (Qwen3), 'weightless' (Muse Spark) or 'none'. None: 'none';
    a spec with ``qk_norm`` set must say which."""
    qk_norm_eps: float | None = None
    """Epsilon of the QK norm (default: the model's ``spec.norm.eps``)."""
    rope_style: RopeStyle = "neox"
    """Rotary layout (used where ``spec.rope_theta`` is set)."""
    rotary_dim: int | None = None
    """Channels rotated per head (default: all of head_dim)."""
    sinks: bool = False
    """Per-head attention sinks (weight ``sinks``)."""
    out_norm: bool = False
    """Weightless RMSNorm of each head's attention output (eps as the QK norm's) before the output gate
    (Muse Spark's ``o_norm``): site ``attn.out_norm``, the norm family's gated form when gated."""

    def __post_init__(self) -> None:
        if self.qk_norm is None and self.spec.qk_norm:
            raise UserError("GQAAttention: the spec has qk_norm set: say which one, qk_norm='weighted' (Qwen3: "
                            "q_norm/k_norm weights) or qk_norm='weightless' (Muse Spark)")
        rot = self.rotary_dim if self.rotary_dim is not None else self.spec.head_dim
        if self.spec.rope_theta is not None and (rot <= 0 or rot % 2 or rot > self.spec.head_dim):
            raise UserError(f"GQAAttention: rotary_dim {rot} must be even and <= head_dim {self.spec.head_dim}")

    @property
    def norm_kind(self) -> QKNorm:
        return self.qk_norm or "none"

    def _gated(self) -> bool:
        return self.spec.output_gate == "sigmoid"

    def _eps(self, step: StepContext) -> float:
        return self.qk_norm_eps if self.qk_norm_eps is not None else step.spec.norm.eps

    def _width(self, a: GQAAttentionSpec) -> int:
        return (a.num_heads * (2 if self._gated() else 1) + 2 * a.num_kv_heads) * a.head_dim

    # ------------------------------------------------------------------ declarations
    def sites(self, b: SiteBuilder, rank_spec: ModelSpec) -> None:
        a, hidden = _local(self.spec, rank_spec.tp), rank_spec.hidden_size
        kv_replicas(self.spec, rank_spec.tp)
        b.gemm("attn.qkv_proj", self._width(a), hidden)
        if self.norm_kind != "none":
            rot = self.rotary_dim if self.rotary_dim is not None else a.head_dim
            b.add("attn.qk_prep", "attention.qk_norm_rope", heads=a.num_heads, kv_heads=a.num_kv_heads,
                  head_dim=a.head_dim, attrs={"fuses": "attn.q_norm,attn.k_norm", "weight": self.norm_kind == "weighted",
                                              "rope": a.rope_theta is not None, "rope_style": self.rope_style,
                                              "rotary_dim": rot})
            for which, heads in (("q", a.num_heads), ("k", a.num_kv_heads)):
                b.add(f"attn.{which}_norm", "norm", tokens=b.tokens * heads, N=a.head_dim,
                      attrs={"per_head": True, "weight": self.norm_kind == "weighted"})
        b.add("attn.gqa", "attention.gqa", heads=a.num_heads, kv_heads=a.num_kv_heads, head_dim=a.head_dim,
              window=a.sliding_window or 0, attrs={"sinks": self.sinks, "kv_write": True})
        if self.out_norm:
            b.add("attn.out_norm", "norm", tokens=b.tokens * a.num_heads, N=a.head_dim,
                  attrs={"per_head": True, "weight": False, "gate": self._gated()})
        b.gemm("attn.o_proj", hidden, a.num_heads * a.head_dim)

    def weights(self, spec: ModelSpec, tp: int) -> list[WeightDecl]:
        a, H = self.spec, spec.hidden_size
        _local(a, tp)  # UserError naming the fix
        reps = kv_replicas(a, tp)
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        out = [WeightDecl("q_proj", (q, H), split=0), WeightDecl("k_proj", (kv, H), split=0, replicas=reps),
               WeightDecl("v_proj", (kv, H), split=0, replicas=reps)]
        if self._gated():
            out.append(WeightDecl("g_proj", (q, H), split=0))
        out.append(WeightDecl("o_proj", (H, q), split=1))
        if self.norm_kind == "weighted":
            out += [WeightDecl("q_norm", (a.head_dim,)), WeightDecl("k_norm", (a.head_dim,))]
        if self.sinks:
            out.append(WeightDecl("sinks", (a.num_heads,), split=0, dtype="float32"))
        return out

    def states(self, spec: ModelSpec, tp: int) -> list[StateDecl]:
        a, reps = _local(self.spec, tp), kv_replicas(self.spec, tp)
        return [StateDecl(n, "paged", (a.num_kv_heads, a.head_dim), split=0, replicas=reps) for n in ("k", "v")]

    def arrange(self, w: Mapping[str, torch.Tensor], rank_spec: ModelSpec) -> dict[str, torch.Tensor]:
        parts = [w["q_proj"], w["k_proj"], w["v_proj"]] + ([w["g_proj"]] if self._gated() else [])
        out = {"qkv": join(parts).contiguous(), "o_proj": w["o_proj"].contiguous()}  # views of a fused qkv stay views
        for name in ("q_norm", "k_norm", "sinks"):
            if name in w:
                out[name] = w[name]
        if self.spec.rope_theta is not None:
            rot = self.rotary_dim if self.rotary_dim is not None else self.spec.head_dim
            out["rope_inv_freq"] = rope_inv_freq(self.spec.rope_theta, rot, device=w["q_proj"].device)
        return out

    # ------------------------------------------------------------------ forward
    def forward(self, step: StepContext, w: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
                h: torch.Tensor) -> torch.Tensor:
        a = _local(self.spec, step.tp)
        M, Hq, KV, D = h.shape[0], a.num_heads, a.num_kv_heads, a.head_dim
        nq, nkv = Hq * D, KV * D
        qkv = step.op("attn.qkv_proj")(h, w["qkv"])
        # column slices of the fused projection, viewed per head (views: unit stride within a row)
        q, k = qkv[:, :nq], qkv[:, nq:nq + nkv]
        v = qkv[:, nq + nkv:nq + 2 * nkv].view(M, KV, D)
        fused = self.norm_kind != "none" and not step.skipped("attn.qk_prep")
        if fused:  # per-head norms and RoPE of q and k in one call
            q, k = step.op("attn.qk_prep")(qkv, Hq, KV, D, self._eps(step), q_weight=w.get("q_norm"),
                                           k_weight=w.get("k_norm"), positions=step.meta["positions"],
                                           inv_freq=w.get("rope_inv_freq"), style=self.rope_style)
        else:
            if self.norm_kind != "none":
                q = step.op("attn.q_norm")(q.reshape(M * Hq, D), w.get("q_norm"), self._eps(step))
                k = step.op("attn.k_norm")(k.reshape(M * KV, D), w.get("k_norm"), self._eps(step))
            q, k = q.reshape(M, Hq, D), k.reshape(M, KV, D)
            if "rope_inv_freq" in w:
                pos = step.meta["positions"]
                q = apply_rope(q, pos, w["rope_inv_freq"], self.rope_style)
                k = apply_rope(k, pos, w["rope_inv_freq"], self.rope_style)
        meta = step.meta
        if step.dcp is not None:  # this rank holds its tokens only: partial attention, merged across the group
            g = step.dcp
            o = dcp_gqa_decode(q, state["k"], state["v"], meta["block_table"], meta["seq_lens"], layout=g.layout,
                               comm=g.comm, scale=a.softmax_scale, sinks=w.get("sinks"), k=k, v=v,
                               window=a.sliding_window, merge=g.merge, partial=g.gqa_partial)
        else:
            o = step.op("attn.gqa")(q, state["k"], state["v"], meta["block_table"], meta["seq_lens"],
                                    scale=a.softmax_scale, window=a.sliding_window, sinks=w.get("sinks"),
                                    k=k, v=v, slot_mapping=meta["slots"], cross_row_reads=step.spec_tokens > 0)
        if self.out_norm:  # per head over head_dim, with the gate (a column slice: made contiguous)
            g = qkv[:, nq + 2 * nkv:].reshape(M * Hq, D) if self._gated() else None
            o = step.op("attn.out_norm")(o.reshape(M * Hq, D), None, self._eps(step), gate=g).reshape(M, nq)
        else:
            o = o.reshape(M, nq)
            if self._gated():
                o = (o.float() * torch.sigmoid(qkv[:, nq + 2 * nkv:].float())).to(o.dtype)
        return step.op("attn.o_proj")(o, w["o_proj"])


__all__ = ["GQAAttention", "QKNorm", "kv_replicas"]
