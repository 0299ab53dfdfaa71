"""Absorbed MLA attention piece over a paged latent KV cache (dense; the sparse variant plugs in later).

Sites (per rank, in call order):

* with a query LoRA (``q_lora_rank``): ``attn.qkv_a_proj`` (gemm): one projection of h for
  ``[q_a | kv_a (latent, rope key) | output-gate logits]`` (vLLM's ``fused_qkv_a_proj`` plus the
  gate rows, which read the same h: one GEMM less), ``attn.q_a_norm`` (norm) and ``attn.q_b_proj``
  (gemm, ``norm_site="attn.q_a_norm"``: where the q_b gemm's implementation has ``norm_prologue``
  it normalises the raw q_a slice itself and the plan skips the norm site);
  without: ``attn.kv_a_proj``, ``attn.q_proj`` and (gated) ``attn.gate_proj``, three gemms;
* ``attn.mla`` (``attention.mla``): writes the new latent into the cache and attends. The
  ``kv_a_layernorm`` is part of the op (``kv_norm_weight``): its only consumer is the attention,
  which normalises the raw latent slice as it writes the cache - no site. The sigmoid output gate
  is part of the op too (``gate``, strided rows of the fused projection);
* ``attn.o_proj`` (gemm, row-parallel: a TP partial sum).

RoPE: part of the op too. With ``use_rope`` this piece passes the tokens' positions, the rope inverse
frequencies and the pair layout (NeoX rotate-half, or interleaved pairs with ``rope_interleaved``) to
``attn.mla``, which rotates the query's rope part and the new token's rope key before it uses them
(``ops.rope.apply_rope``'s math: fp32, one rounding to the activation dtype; the Triton kernel inside
its prologue launch), so the cache holds rotated rope keys and no rope glue runs between the
projections and the attention. NoPE MLA passes none.

State per layer: ``kv`` paged, ``[kv_lora + rope]`` per token (RMS-normed latent, then the rope key).
TP: the rank's heads in q_b / q / kv_b / gate rows, row-parallel o_proj; the latent projections
(q_a, kv_a) and their norms are replicated (the latent is per token, not per head: every rank keeps
the whole latent cache).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.attention.dcp import dcp_mla_decode
from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.pieces.attention.rope import rope_inv_freq
from latency_specialized.runtime.pieces_api import (StateDecl, StepContext, WeightDecl, fused_gemm, join, split_plain,
                                                    with_stored)
from latency_specialized.spec import MLAAttentionSpec, ModelSpec


@functools.lru_cache(maxsize=64)
def _local(a: MLAAttentionSpec, tp: int) -> MLAAttentionSpec:
    return a.shard(tp) if tp > 1 else a


@dataclass(frozen=True)
class MLAAttention:
    """Absorbed MLA of every layer of one kind (see the module docstring).

    Weights (piece-local names, checkpoint granularity): ``q_a_proj`` ``[q_lora, hidden]``, ``q_a_norm``
    ``[q_lora]``, ``q_b_proj`` ``[H*(nope+rope), q_lora]`` (or ``q_proj`` ``[H*(nope+rope), hidden]``
    without a query LoRA); ``kv_a_proj`` ``[kv_lora + rope, hidden]``, ``kv_a_norm`` ``[kv_lora]``,
    ``kv_b_proj`` ``[H*(nope+v), kv_lora]``; ``g_proj`` ``[H*v, hidden]`` (sigmoid output gate only);
    ``o_proj`` ``[hidden, H*v]``.
    """

    spec: MLAAttentionSpec
    """The unsharded attention shape (RoPE or NoPE, gate, query LoRA)."""
    norm_eps: float = 1e-6
    """Epsilon of the q_a and kv_a RMSNorms (the model's rms_norm_eps)."""
    softmax_scale: float | None = None
    """Scale of the attention logits; None: (nope + rope) ** -0.5 (the family's default)."""
    indexer: Any = None
    """Options of the sparse variant's top-k token selector (DSA-style indexer). The dense piece takes
    none; a sparse subclass sets ``sparse = True`` and overrides :meth:`attend` (and adds its sites)."""

    role: ClassVar[str] = "attn"
    supports_dcp: ClassVar[bool] = True
    """Runs over a latent cache split across a DCP group (``StepContext.dcp``: ``ops.attention.dcp.dcp_mla_decode``);
    the sparse variant does not (its indexer keys and selection are per whole sequence)."""
    sparse: ClassVar[bool] = False
    """True for a subclass that attends over an indexer's top-k (it then accepts ``indexer``)."""

    def __post_init__(self) -> None:
        a = self.spec
        if a.use_rope and a.rope_theta is None:
            raise UserError("MLA with use_rope needs rope_theta: set it in the MLAAttentionSpec (or use_rope=False)")
        if a.use_rope and a.qk_rope_head_dim % 2:
            raise UserError(f"MLA RoPE needs an even rope width, got {a.qk_rope_head_dim}")
        if (a.indexer is not None or self.indexer is not None) and not self.sparse:
            raise UserError("sparse MLA (an indexer's top-k) is not implemented by the dense MLA piece: "
                            "use the sparse MLA piece for this spec")

    def local(self, tp: int) -> MLAAttentionSpec:
        """This rank's attention shape at TP ``tp``."""
        return _local(self.spec, tp)

    # ------------------------------------------------------------------ declarations
    def fused_a(self, a: MLAAttentionSpec) -> dict[str, int]:
        """The parts of the fused latent projection ``attn.qkv_a_proj`` (query LoRA only) in column order, with
        their rows at ``a``'s shapes (a rank's: the output gate's heads are the rank's)."""
        rows = {"q_a_proj": a.q_lora_rank or 0, "kv_a_proj": a.kv_lora_rank + a.qk_rope_head_dim}
        if a.output_gate == "sigmoid":
            rows["g_proj"] = a.num_heads * a.v_head_dim
        return rows

    def projections(self, spec: ModelSpec) -> dict[str, tuple[str, ...]]:
        """Gemm site role -> the piece-local weights it joins (a site keeps a stored format only where all of
        them are stored so: ``ModelSpec.kept_linear``; a fused projection whose trailing parts are plain splits
        into two sites: ``pieces_api.split_plain``). ``kv_b`` is no gemm: the absorbed attention takes it in the
        activation dtype (an FP8 checkpoint's is dequantised at bind, as vLLM does for its absorption)."""
        a = self.spec
        gate = ("g_proj",) if a.output_gate == "sigmoid" else ()
        if a.q_lora_rank:
            head, tail = split_plain(tuple(self.fused_a(a)), spec)
            out = {"attn.qkv_a_proj": head, "attn.q_b_proj": ("q_b_proj",)}
            if tail:
                out["attn.qkv_a_proj.plain"] = tail
        else:
            out = {"attn.kv_a_proj": ("kv_a_proj",), "attn.q_proj": ("q_proj",)}
            if gate:
                out["attn.gate_proj"] = gate
        out["attn.o_proj"] = ("o_proj",)
        return out

    def sites(self, b: SiteBuilder, rank_spec: ModelSpec) -> None:
        a, hidden = self.local(rank_spec.tp), rank_spec.hidden_size
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        gate = a.num_heads * a.v_head_dim if a.output_gate == "sigmoid" else 0
        fmt = {role: rank_spec.kept_linear(*parts) for role, parts in self.projections(rank_spec).items()}
        if a.q_lora_rank:
            self.fused_a_sites(b, a, rank_spec, fmt)
            b.add("attn.q_a_norm", "norm", N=a.q_lora_rank)
            b.gemm("attn.q_b_proj", a.num_heads * qk, a.q_lora_rank, norm_site="attn.q_a_norm",
                   weight_format=fmt["attn.q_b_proj"])
        else:
            b.gemm("attn.kv_a_proj", a.kv_lora_rank + a.qk_rope_head_dim, hidden, weight_format=fmt["attn.kv_a_proj"])
            b.gemm("attn.q_proj", a.num_heads * qk, hidden, weight_format=fmt["attn.q_proj"])
            if gate:
                b.gemm("attn.gate_proj", gate, hidden, weight_format=fmt["attn.gate_proj"])
        # no kv_a_norm site: the MLA op normalises the raw latent (and the site counts no weight bytes,
        # w_kv_b included, so the norm's kv_lora * 2 bytes are not added either)
        attrs: dict[str, Any] = {"gate": a.output_gate, "rope": a.use_rope}
        if a.use_rope:
            attrs["rope_interleaved"] = a.rope_interleaved
        b.add("attn.mla", "attention.mla", heads=a.num_heads, kv_lora=a.kv_lora_rank, rope=a.qk_rope_head_dim,
              nope=a.qk_nope_head_dim, v=a.v_head_dim, attrs=attrs)
        b.gemm("attn.o_proj", hidden, a.num_heads * a.v_head_dim, weight_format=fmt["attn.o_proj"])

    def fused_a_sites(self, b: SiteBuilder, a: MLAAttentionSpec, rank_spec: ModelSpec,
                      fmt: Mapping[str, str | None]) -> None:
        """``attn.qkv_a_proj`` over :meth:`fused_a` (``a``: the rank's shapes), and ``attn.qkv_a_proj.plain`` where
        its plain tail is split off (``pieces_api.split_plain``)."""
        rows = self.fused_a(a)
        head, tail = split_plain(tuple(rows), rank_spec)
        b.gemm("attn.qkv_a_proj", sum(rows[p] for p in head), rank_spec.hidden_size, weight_format=fmt["attn.qkv_a_proj"])
        if tail:
            b.gemm("attn.qkv_a_proj.plain", sum(rows[p] for p in tail), rank_spec.hidden_size)

    def weights(self, spec: ModelSpec, tp: int) -> Sequence[WeightDecl]:
        a, H = self.spec, spec.hidden_size
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        out: list[WeightDecl] = []
        if a.q_lora_rank:
            out += [WeightDecl("q_a_proj", (a.q_lora_rank, H)), WeightDecl("q_a_norm", (a.q_lora_rank,)),
                    WeightDecl("q_b_proj", (a.num_heads * qk, a.q_lora_rank), split=0)]
        else:
            out.append(WeightDecl("q_proj", (a.num_heads * qk, H), split=0))
        out += [WeightDecl("kv_a_proj", (a.kv_lora_rank + a.qk_rope_head_dim, H)),
                WeightDecl("kv_a_norm", (a.kv_lora_rank,)),
                WeightDecl("kv_b_proj", (a.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank), split=0),
                WeightDecl("o_proj", (H, a.num_heads * a.v_head_dim), split=1)]
        if a.output_gate == "sigmoid":
            out.append(WeightDecl("g_proj", (a.num_heads * a.v_head_dim, H), split=0))
        return with_stored(out, spec, self.projections(spec))

    def states(self, spec: ModelSpec, tp: int) -> Sequence[StateDecl]:
        return [StateDecl("kv", "paged", (self.spec.latent_width,))]

    def arrange(self, w: Mapping[str, torch.Tensor], rank_spec: ModelSpec) -> dict[str, torch.Tensor]:
        a = self.local(rank_spec.tp)
        gated = a.output_gate == "sigmoid"
        if a.q_lora_rank:
            # [q_a | kv_a] as vLLM's fused_qkv_a_proj, and the output-gate rows too: all read the same h (a plain
            # tail of it, where the head is kept stored: a second gemm into the same output, split_plain)
            head, tail = split_plain(tuple(self.fused_a(a)), rank_spec)
            out = {"qkv_a": join([w[p] for p in head]), "q_a_norm": w["q_a_norm"], "q_b": w["q_b_proj"]}
            if tail:
                out["qkv_a.plain"] = join([w[p] for p in tail])
        else:
            out = {"kv_a": w["kv_a_proj"], "q": w["q_proj"]}
            if gated:
                out["g"] = w["g_proj"]
        out.update(kv_a_norm=w["kv_a_norm"], kv_b=w["kv_b_proj"], o=w["o_proj"])
        if a.use_rope:
            assert a.rope_theta is not None
            out["rope_inv_freq"] = rope_inv_freq(a.rope_theta, a.qk_rope_head_dim, w["kv_a_norm"].device)
        return out

    # ------------------------------------------------------------------ computation
    def forward(self, step: StepContext, w: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
                h: torch.Tensor) -> torch.Tensor:
        a, eps = self.local(step.tp), self.norm_eps
        L, R, nope = a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim
        if a.q_lora_rank:
            ql = a.q_lora_rank
            y = fused_gemm(step, "attn.qkv_a_proj", h, w, "qkv_a")
            # column slices of the fused projection [q_a | kv_a (latent, rope key) | output-gate logits]
            kv = y[:, ql:ql + L + R]
            gate = y[:, ql + L + R:] if a.output_gate == "sigmoid" else None  # strided rows: the op takes them
            if step.skipped("attn.q_a_norm"):  # the q_b gemm normalises q_a itself
                q = step.op("attn.q_b_proj")(y[:, :ql], w["q_b"], norm_weight=w["q_a_norm"], norm_eps=eps)
            else:
                q_c = step.op("attn.q_a_norm")(step.contiguous_for("attn.q_a_norm", y[:, :ql]), w["q_a_norm"], eps)
                q = step.op("attn.q_b_proj")(q_c, w["q_b"])
        else:
            kv = step.op("attn.kv_a_proj")(h, w["kv_a"])
            q = step.op("attn.q_proj")(h, w["q"])
            gate = step.op("attn.gate_proj")(h, w["g"]) if "g" in w else None
        q = q.view(h.shape[0], a.num_heads, nope + R)
        # the rope part of q and the rope key go in unrotated: the op rotates them (rope_args)
        o = self.attend(step, w, state, h, q, kv[:, :L], kv[:, L:], gate)
        return step.op("attn.o_proj")(o, w["o"])

    def rope_args(self, step: StepContext, w: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The MLA op's RoPE keywords (positions, inverse frequencies, pair layout); none for NoPE MLA."""
        if not self.spec.use_rope:
            return {}
        return {"positions": step.meta["positions"], "rope_inv_freq": w["rope_inv_freq"],
                "rope_interleaved": self.spec.rope_interleaved}

    def attend(self, step: StepContext, w: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
               h: torch.Tensor, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
               gate: torch.Tensor | None) -> torch.Tensor:
        """The ``attn.mla`` call: ``q [M, H, nope + rope]`` and the rope key ``k_pe`` (both unrotated: the op
        applies the RoPE, :meth:`rope_args`), the raw latent ``kv_c`` (strided rows), the gate logits ->
        ``[M, H * v]`` (the sparse variant's hook)."""
        a = self.local(step.tp)
        if step.dcp is not None:  # this rank holds its tokens only: partial attention, merged across the group
            g = step.dcp
            return dcp_mla_decode(q, kv_c, k_pe, state["kv"], step.meta["block_table"], step.meta["seq_lens"],
                                  w["kv_b"], layout=g.layout, comm=g.comm, qk_nope_head_dim=a.qk_nope_head_dim,
                                  v_head_dim=a.v_head_dim, scale=self.softmax_scale, gate=gate,
                                  kv_norm_weight=w["kv_a_norm"], kv_norm_eps=self.norm_eps, merge=g.merge,
                                  partial=g.mla_partial, **self.rope_args(step, w))
        # kv_a_layernorm is part of the MLA op: the raw latent slice goes in as is (strided rows)
        return step.op("attn.mla")(q, kv_c, k_pe, state["kv"], step.meta["slots"], step.meta["block_table"],
                                   step.meta["seq_lens"], w["kv_b"], qk_nope_head_dim=a.qk_nope_head_dim,
                                   v_head_dim=a.v_head_dim, gate=gate, kv_norm_weight=w["kv_a_norm"],
                                   kv_norm_eps=self.norm_eps, **self.rope_args(step, w),
                                   **({"scale": self.softmax_scale} if self.softmax_scale is not None else {}))
