"""Sparse MLA piece (DSA-style): an indexer picks ``topk`` cached tokens; absorbed MLA attends to them.

A subclass of the dense MLA piece (``pieces/attention/mla.py``) that overrides :meth:`attend` (the
``attn.sparse_mla`` call over the selection instead of ``attn.mla`` over the whole context) and, on
layers that run their own indexer, adds it.

**Full vs reuse layers** (``IndexerSpec.full_layers``; empty: every layer runs its own). A piece
stands for every layer of its kind, and the two kinds of layer differ in weights, states and sites,
so an adapter gives them two kinds: ``SparseMLAAttention(spec, indexer=IndexerOptions(full=True))``
for the layers in ``full_layers`` and ``IndexerOptions(full=False)`` for the others
(:func:`runs_own_indexer` says which; the forward checks it per layer). A full layer writes its
top-k into the static buffer ``indexer.topk [max_rows, K]`` (int32, shared by every sparse MLA
piece); a reuse layer attends over what the latest full layer wrote there in this step.

Sites of a full layer (per rank, in call order; a reuse layer has the dense piece's, with
``attn.sparse_mla`` for ``attn.mla``):

* ``attn.qkv_a_proj`` (gemm): ``[q_a | kv_a | output-gate logits | indexer key | indexer head weights]``
  - the indexer's key and weight projections read the same h (vLLM: ``wk_weights_proj``, a GEMM of
  its own): one GEMM;
* ``attn.q_a_norm`` (norm; skipped where the q_b gemm normalises its input) and ``attn.q_b_proj``
  (gemm): ``[this rank's query heads | the indexer's query heads]`` from the normed query latent
  (vLLM: ``q_b_proj`` and ``indexer.wq_b``, both on ``q_c``): one GEMM;
* ``attn.indexer`` (``attention.indexer``, ``ops/attention/sparse_mla.py``): key LayerNorm, RoPE of
  the leading ``qk_rope_head_dim`` channels of key and queries, key-cache write, relu-weighted scores,
  top-k;
* ``attn.sparse_mla`` (``attention.sparse_mla``): RoPE of the query's rope part and the rope key, latent
  write (kv_a norm fused, as in ``attn.mla``) and absorbed attention over the selection; ``attn.o_proj``
  (gemm, row-parallel).

Static shapes: the selection is always ``[M, K]`` (-1 for slots a short context does not fill); no
host syncs in the piece (the ops' references: see their module).

Weights of a full layer, beyond the dense piece's (all replicated: every rank runs the whole indexer):
``indexer.q_proj`` ``[h_i * d_i, q_lora]`` (wq_b), ``indexer.k_proj`` ``[d_i, hidden]`` (wk),
``indexer.weights_proj`` ``[h_i, hidden]``, ``indexer.k_norm`` / ``indexer.k_norm_bias`` ``[d_i]``
(fp32 LayerNorm). State: ``indexer_k`` paged, ``[d_i]`` per token (unquantised; vLLM keeps it fp8).

Needs a query LoRA (the indexer projects the normed query latent). The indexer's RoPE uses the MLA
rope's frequencies; its layout is its own (``IndexerOptions.rope_interleaved``: vLLM reads
``indexer_rope_interleave`` from the checkpoint config, NeoX otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Mapping, Sequence

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.pieces.attention.mla import MLAAttention
from latency_specialized.runtime.pieces_api import StateDecl, StepContext, WeightDecl, fused_gemm, join, with_stored
from latency_specialized.spec import IndexerSpec, MLAAttentionSpec, ModelSpec

TOPK = "indexer.topk"
"""Name of the static top-k buffer ``[max_rows, K]`` (int32) in the program's scratch."""
INDEXER_BESIDE_ATTENTION = True
"""On a GPU, a full layer's indexer runs on the side stream (a graph branch) beside ``attn.sparse_mla``'s first
stage: the sparse MLA implementations take ``before_split`` - the side stream's join - and call it once they need the
selection, so the latent write and the absorbed query (the Triton kernels' prologue launch) no longer wait for the
indexer's score and select launches (GLM-5.3 at batch 1: the select is one program per row, on one SM). The indexer
site is marked ``side_stream`` so that the program makes the stream. On since session 53 (GLM-5.3 NOTES: the A/B)."""


def runs_own_indexer(ix: IndexerSpec, layer: int) -> bool:
    """Whether ``layer`` runs its own indexer (else it reuses the latest full layer's top-k)."""
    return not ix.full_layers or layer in ix.full_layers


@dataclass(frozen=True)
class IndexerOptions:
    """How a sparse MLA piece's layers select tokens."""

    full: bool = True
    """The piece's layers run their own indexer; False: they reuse the latest full layer's top-k."""
    rope_interleaved: bool = False
    """Interleaved-pair RoPE in the indexer (vLLM: ``indexer_rope_interleave``); False: NeoX rotate-half."""
    k_norm_eps: float = 1e-6
    """Epsilon of the indexer key's LayerNorm."""
    buffer: str = TOPK
    """Scratch buffer the selection goes through."""


@dataclass(frozen=True)
class SparseMLAAttention(MLAAttention):
    """Absorbed MLA over an indexer's top-k (see the module docstring); ``indexer``: :class:`IndexerOptions`
    (default: a full layer)."""

    supports_dcp: ClassVar[bool] = False
    """No DCP path: the indexer scores and selects over whole sequences (``runtime.composed.dcp_problems``)."""

    sparse: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.indexer is None:
            object.__setattr__(self, "indexer", IndexerOptions())
        if not isinstance(self.indexer, IndexerOptions):
            raise UserError(f"sparse MLA: indexer={self.indexer!r}; pass IndexerOptions(full=...)")
        a = self.spec
        if a.indexer is None:
            raise UserError("sparse MLA needs MLAAttentionSpec.indexer (heads, head_dim, topk): set it, or use the "
                            "dense MLA piece")
        if not a.q_lora_rank:
            raise UserError("sparse MLA: the indexer projects the normed query latent, so the spec needs q_lora_rank")
        if a.use_rope and a.indexer.head_dim < a.qk_rope_head_dim:
            raise UserError(f"sparse MLA: indexer head_dim {a.indexer.head_dim} < rope width {a.qk_rope_head_dim} "
                            "(the indexer rotates its leading rope channels)")

    @property
    def options(self) -> IndexerOptions:
        assert isinstance(self.indexer, IndexerOptions)
        return self.indexer

    @property
    def ix(self) -> IndexerSpec:
        assert self.spec.indexer is not None
        return self.spec.indexer

    # ------------------------------------------------------------------ declarations
    def fused_a(self, a: MLAAttentionSpec) -> dict[str, int]:
        """The dense piece's, with a full layer's indexer key and head-weight rows at the end (they read h too)."""
        rows = super().fused_a(a)
        if self.options.full:
            rows.update({"indexer.k_proj": self.ix.head_dim, "indexer.weights_proj": self.ix.num_heads})
        return rows

    def projections(self, spec: ModelSpec) -> dict[str, tuple[str, ...]]:
        """The dense piece's (its fused ``qkv_a``: :meth:`fused_a`), with a full layer's indexer query rows on ``q_b``."""
        out = super().projections(spec)
        if self.options.full:
            out["attn.q_b_proj"] += ("indexer.q_proj",)
        return out

    def sites(self, b: SiteBuilder, rank_spec: ModelSpec) -> None:
        a, hidden, ix, full = self.local(rank_spec.tp), rank_spec.hidden_size, self.ix, self.options.full
        assert a.q_lora_rank
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        extra_b = ix.num_heads * ix.head_dim if full else 0
        fmt = {role: rank_spec.kept_linear(*parts) for role, parts in self.projections(rank_spec).items()}
        self.fused_a_sites(b, a, rank_spec, fmt)
        b.add("attn.q_a_norm", "norm", N=a.q_lora_rank)
        b.gemm("attn.q_b_proj", a.num_heads * qk + extra_b, a.q_lora_rank, norm_site="attn.q_a_norm",
               weight_format=fmt["attn.q_b_proj"])
        if full:
            b.add("attn.indexer", "attention.indexer", heads=ix.num_heads, head_dim=ix.head_dim, topk=ix.topk,
                  rope=a.qk_rope_head_dim if a.use_rope else 0,
                  attrs={"rope_interleaved": self.options.rope_interleaved, "k_norm": "layer_norm",
                         **({"side_stream": True} if INDEXER_BESIDE_ATTENTION else {})})
        attrs: dict[str, object] = {"gate": a.output_gate, "rope": a.use_rope}
        if a.use_rope:
            attrs["rope_interleaved"] = a.rope_interleaved
        b.add("attn.sparse_mla", "attention.sparse_mla", heads=a.num_heads, kv_lora=a.kv_lora_rank,
              rope=a.qk_rope_head_dim, nope=a.qk_nope_head_dim, v=a.v_head_dim, topk=ix.topk, attrs=attrs)
        b.gemm("attn.o_proj", hidden, a.num_heads * a.v_head_dim, weight_format=fmt["attn.o_proj"])

    def weights(self, spec: ModelSpec, tp: int) -> Sequence[WeightDecl]:
        out = list(super().weights(spec, tp))
        if self.options.full:
            ix, a = self.ix, self.spec
            assert a.q_lora_rank
            out += [WeightDecl("indexer.q_proj", (ix.num_heads * ix.head_dim, a.q_lora_rank)),
                    WeightDecl("indexer.k_proj", (ix.head_dim, spec.hidden_size)),
                    WeightDecl("indexer.weights_proj", (ix.num_heads, spec.hidden_size)),
                    WeightDecl("indexer.k_norm", (ix.head_dim,), dtype="float32"),
                    WeightDecl("indexer.k_norm_bias", (ix.head_dim,), dtype="float32")]
        return with_stored(out, spec, self.projections(spec))

    def states(self, spec: ModelSpec, tp: int) -> Sequence[StateDecl]:
        out = list(super().states(spec, tp))
        if self.options.full:
            out.append(StateDecl("indexer_k", "paged", (self.ix.head_dim,)))
        return out

    def buffers(self, spec: ModelSpec, max_rows: int, dtype: torch.dtype,
                device: torch.device) -> dict[str, torch.Tensor]:
        return {self.options.buffer: torch.full((max_rows, self.ix.topk), -1, dtype=torch.int32, device=device)}

    def arrange(self, w: Mapping[str, torch.Tensor], rank_spec: ModelSpec) -> dict[str, torch.Tensor]:
        out = super().arrange(w, rank_spec)
        if self.options.full:
            # the indexer's h projections ride on the fused latent projection (fused_a), its queries on q_b
            out["q_b"] = join([out["q_b"], w["indexer.q_proj"]])
            out["indexer.k_norm"] = w["indexer.k_norm"]
            out["indexer.k_norm_bias"] = w["indexer.k_norm_bias"]
        return out

    # ------------------------------------------------------------------ computation
    def _topk_buffer(self, step: StepContext, rows: int) -> torch.Tensor:
        buf = step.scratch.get(self.options.buffer)
        if buf is None:
            raise UserError(f"sparse MLA: no scratch buffer {self.options.buffer!r}: the program allocates it from "
                            "the piece's buffers()")
        return buf[:rows]

    def _check_layer(self, step: StepContext) -> None:
        if step.layer < 0:
            return
        own = runs_own_indexer(self.ix, step.layer)
        if own != self.options.full:
            raise UserError(f"sparse MLA: layer {step.layer} {'runs' if own else 'does not run'} its own indexer "
                            f"(IndexerSpec.full_layers) but its piece has IndexerOptions(full={self.options.full}): "
                            "give full and reuse layers different kinds and pieces")
        if not own and step.layer < min(self.ix.full_layers):
            raise UserError(f"sparse MLA: layer {step.layer} reuses a top-k before the first full indexer layer "
                            f"{min(self.ix.full_layers)}")

    def forward(self, step: StepContext, w: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
                h: torch.Tensor) -> torch.Tensor:
        self._check_layer(step)
        if not self.options.full:
            return super().forward(step, w, state, h)   # the dense projections; attend() reads the shared top-k
        a, eps, ix = self.local(step.tp), self.norm_eps, self.ix
        assert a.q_lora_rank
        M, ql, L, R, nope = h.shape[0], a.q_lora_rank, a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim
        G = a.num_heads * a.v_head_dim if a.output_gate == "sigmoid" else 0
        y = fused_gemm(step, "attn.qkv_a_proj", h, w, "qkv_a")
        # column slices of [q_a | kv_a | gate | indexer key | indexer weights] (strided rows)
        kv, at = y[:, ql:ql + L + R], ql + L + R
        gate = y[:, at:at + G] if G else None
        ik, iw = y[:, at + G:at + G + ix.head_dim], y[:, at + G + ix.head_dim:at + G + ix.head_dim + ix.num_heads]
        if step.skipped("attn.q_a_norm"):
            qq = step.op("attn.q_b_proj")(y[:, :ql], w["q_b"], norm_weight=w["q_a_norm"], norm_eps=eps)
        else:
            q_c = step.op("attn.q_a_norm")(step.contiguous_for("attn.q_a_norm", y[:, :ql]), w["q_a_norm"], eps)
            qq = step.op("attn.q_b_proj")(q_c, w["q_b"])
        nq = a.num_heads * (nope + R)
        q = qq[:, :nq].view(M, a.num_heads, nope + R)
        iq = qq[:, nq:].view(M, ix.num_heads, ix.head_dim)
        meta = step.meta
        index_args = (iq, ik, iw, state["indexer_k"], meta["slots"], meta["block_table"], meta["seq_lens"])
        index_kw = dict(topk=ix.topk, positions=meta["positions"],
                        rope_inv_freq=w.get("rope_inv_freq") if a.use_rope else None,
                        rope_interleaved=self.options.rope_interleaved, k_norm_weight=w["indexer.k_norm"],
                        k_norm_bias=w["indexer.k_norm_bias"], k_norm_eps=self.options.k_norm_eps,
                        cross_row_reads=step.spec_tokens > 0, out=self._topk_buffer(step, M))
        side = step.streams.get("side") if INDEXER_BESIDE_ATTENTION else None
        before_split = None
        if side is not None:   # a graph branch (its tensors kept alive for the side stream); joined by the attention
            before_split = side.run(step.op("attn.indexer"), *index_args, **index_kw).join
        else:
            step.op("attn.indexer")(*index_args, **index_kw)
        # q's rope part and the rope key unrotated: attn.sparse_mla rotates them (rope_args)
        o = self.attend(step, w, state, h, q, kv[:, :L], kv[:, L:], gate, before_split=before_split)
        return step.op("attn.o_proj")(o, w["o"])

    def attend(self, step: StepContext, w: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
               h: torch.Tensor, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
               gate: torch.Tensor | None, before_split: Callable[[], object] | None = None) -> torch.Tensor:
        """The ``attn.sparse_mla`` call over the selection in the top-k buffer (this layer's, or the latest
        full layer's); ``before_split``: the join of the side stream writing it (``INDEXER_BESIDE_ATTENTION``)."""
        a = self.local(step.tp)
        extra = {"before_split": before_split} if before_split is not None else {}
        return step.op("attn.sparse_mla")(q, kv_c, k_pe, state["kv"], step.meta["slots"], step.meta["block_table"],
                                          step.meta["seq_lens"], w["kv_b"], self._topk_buffer(step, q.shape[0]),
                                          qk_nope_head_dim=a.qk_nope_head_dim, v_head_dim=a.v_head_dim, gate=gate,
                                          kv_norm_weight=w["kv_a_norm"], kv_norm_eps=self.norm_eps,
                                          **self.rope_args(step, w),
                                          **({"scale": self.softmax_scale} if self.softmax_scale is not None else {}),
                                          **extra)


__all__ = ["IndexerOptions", "SparseMLAAttention", "TOPK", "runs_own_indexer"]
