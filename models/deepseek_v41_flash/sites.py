"""Op sites of one DeepSeek-V4.1-Flash decode step on one rank.

DeepSeek-V4.1-Flash as pieces (``pieces.standard.compose_standard``; one layer kind,
``sparse_mqa+moe``, for all 40 layers): the standard routed MoE with its shared expert
(``RoutedMoE``: router split across ranks, fp32 logits), the embedding, the LM head and the mHC
residual (``MHCResidual``, with Engram's injection: :class:`EngramMHCResidual`). Its attention has no
piece yet, so it is the old site list's, sites only (this adapter has no decode program):

* :class:`SparseMQASites` (sparse MQA over compressed KV, a sliding window and sinks): q LoRA with its
  norm, the single KV head; compressors only on the KV-source layers, indexers only on the
  index-source layers, the indexer's key projection only where a layer is both; the attention in
  three sites - window-only (layers 0-1), ratio-2 compressed (2-19), full-length compressed (20-39):
  different KV lengths and top-k; the grouped low-rank output projection;
* :class:`EngramMHCResidual`: the mHC piece's seams (``attn.mhc`` / ``ffn.mhc`` / ``final.mhc``,
  ``residual.mhc``: the 24 fp32 mixing coefficients from the 4 x 5120 streams, Sinkhorn, the carried
  pre-mix collapse and the sublayer's input norm in one call; ``hc_eps`` and the post multiplier from
  the spec) and its plain all-reduce sites at TP > 1, plus Engram on layers 1 and 14, which injects into
  the streams before the attention: the table rows (prefetch site) and the key/value projection.

Not a site (no op family exists yet, see README): the Engram gate (normalised q.k, signed sqrt,
sigmoid).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from latency_specialized.ops.sites import OpSite, SiteBuilder
from latency_specialized.pieces.residual.mhc import MHCResidual
from latency_specialized.pieces.standard import compose_standard
from latency_specialized.runtime.composed import ComposedModel
from latency_specialized.spec import ModelSpec, SparseMQAAttentionSpec

from latency_specialized_models.deepseek_v41_flash.spec import DeepseekV41Spec, EngramSpec

KIND = "sparse_mqa+moe"


def _with(site: OpSite, *, layers: tuple[int, ...] | None = None, **attrs: Any) -> OpSite:
    """``site`` with other layers and/or extra attrs (contexts stay sorted so they hash equal)."""
    ctx = site.ctx
    if attrs:
        ctx = dataclasses.replace(ctx, attrs=tuple(sorted({**dict(ctx.attrs), **attrs}.items())))
    return dataclasses.replace(site, ctx=ctx, layers=site.layers if layers is None else tuple(layers))


def _at(b: SiteBuilder, layers: tuple[int, ...]) -> SiteBuilder:
    b.layers = tuple(layers)
    return b


@dataclass(frozen=True)
class SparseMQASites:
    """The sparse MQA attention of every layer (see the module docstring); ``spec`` the unsharded model."""

    spec: DeepseekV41Spec
    role: str = "attn"

    def sites(self, b: SiteBuilder, rank_spec: ModelSpec) -> None:
        spec, hidden, group = self.spec, rank_spec.hidden_size, b.layers
        attn = rank_spec.layers[0].attention  # shapes shared by every layer (per rank)
        assert isinstance(attn, SparseMQAAttentionSpec)
        _at(b, group).gemm("attn.q_a_proj", attn.q_lora_rank, hidden)
        b.add("attn.q_norm", "norm", N=attn.q_lora_rank)
        b.gemm("attn.q_b_proj", attn.num_heads * attn.head_dim, attn.q_lora_rank)
        b.gemm("attn.kv_proj", attn.head_dim, hidden)
        b.add("attn.kv_norm", "norm", N=attn.head_dim)
        for ratio in (2, 1):
            src = tuple(s for s in spec.kv_source_layers if spec.layers[s].attention.compress_ratio == ratio)
            if src:
                # Compressor: kv latent (+ softmax pooling gate when ratio > 1), replicated.
                _at(b, src).gemm(f"attn.compressor.c{ratio}", attn.head_dim * (2 if ratio > 1 else 1), hidden)
        _at(b, spec.kv_source_layers).add("attn.compressor_norm", "norm", N=attn.head_dim)
        idx = spec.layers[spec.index_source_layers[0]].attention.indexer  # type: ignore[union-attr]
        assert idx is not None
        _at(b, spec.index_source_layers).gemm("attn.indexer.q_proj", idx.num_heads * idx.head_dim, attn.q_lora_rank)
        b.gemm("attn.indexer.weights_proj", idx.num_heads, hidden)
        # Index keys come from the compressor latent, only where the layer owns both.
        owns_k = tuple(l for l in spec.index_source_layers if l in spec.kv_source_layers)
        _at(b, owns_k).gemm("attn.indexer.k_proj", idx.head_dim, attn.head_dim)
        b.add("attn.indexer.k_norm", "norm", N=idx.head_dim)
        _at(b, spec.index_source_layers).add("attn.indexer", "attention.sparse", heads=idx.num_heads,
                                             head_dim=idx.head_dim, topk=idx.topk,
                                             attrs={"compressed": True, "candidates": spec.candidate_source_layer >= 0})
        window = spec.layers_with_ratio(0)
        if window:
            _at(b, window).add("attn.sparse_mqa.window", "attention.sparse", heads=attn.num_heads,
                               head_dim=attn.head_dim, topk=0, window=attn.sliding_window, attrs={"sinks": True})
        for ratio in (2, 1):
            layers = spec.layers_with_ratio(ratio)
            if layers:
                _at(b, layers).add(f"attn.sparse_mqa.c{ratio}", "attention.sparse", heads=attn.num_heads,
                                   head_dim=attn.head_dim, topk=spec.index_topk, window=attn.sliding_window,
                                   compress_ratio=ratio, attrs={"sinks": True})
        # A batched GEMM: each local output group maps its own heads' slice (K wide) to o_lora.
        _at(b, group).add("attn.o_a_proj", "gemm", weight_bytes=attn.o_groups * attn.o_lora_rank * attn.num_heads
                          * attn.head_dim // max(attn.o_groups, 1) * 2, N=attn.o_groups * attn.o_lora_rank,
                          K=attn.num_heads * attn.head_dim // max(attn.o_groups, 1),
                          attrs={"residual": False, "groups": attn.o_groups})
        b.gemm("attn.o_b_proj", hidden, attn.o_groups * attn.o_lora_rank)


@dataclass(frozen=True)
class EngramMHCResidual(MHCResidual):
    """The mHC residual with Engram's injection before the attention of its layers (``engram``)."""

    engram: EngramSpec | None = None

    def sites(self, b: SiteBuilder, rank_spec: ModelSpec, where: Literal["attn", "ffn", "final"]) -> None:
        e, group = self.engram, b.layers
        if where == "attn" and e is not None and any(l in group for l in e.layers):
            hidden, tp, rows = rank_spec.hidden_size, rank_spec.tp, e.rows_per_token
            # Tables are sharded by hash column across TP ranks (vLLM ParallelEngramEmbedding), so a
            # rank fetches its share of each token's rows.
            share = -(-rows // tp)
            bytes_per_value = 1 if e.table_dtype == "fp8_e4m3" else 2
            _at(b, tuple(l for l in e.layers if l in group)).add(
                "engram.prefetch", "prefetch", weight_bytes=b.tokens * share * e.head_dim * bytes_per_value,
                rows=share, row_width=e.head_dim, attrs={"side_stream": True, "source": "engram_table"})
            # wkv: all fetched rows -> one key per stream + a shared value; column-parallel output.
            b.gemm("engram.wkv", hidden * (self.streams + 1) // tp, rows * e.head_dim)
            b.layers = group
        super().sites(b, rank_spec, where)


def composed_model(spec: DeepseekV41Spec) -> ComposedModel:
    """DeepSeek-V4.1-Flash's pieces (unsharded spec): the standard MoE, embedding and head, the mHC residual
    with Engram, and the sparse-MQA stand-in (one layer kind)."""
    attention = SparseMQASites(spec)
    residual = EngramMHCResidual.for_spec(spec, hc_eps=spec.hyper.eps, post_mult=spec.hyper.post_alpha,
                                          engram=spec.engram)
    return compose_standard(spec, kind=lambda layer: KIND, attention=lambda layer: attention, residual=residual)


def dsv41_op_sites(spec: ModelSpec, sites: list[OpSite]) -> list[OpSite]:
    """The sites of :func:`composed_model` (one rank) with DeepSeek's SwiGLU clamp on the routed and
    shared experts (an activation parameter the MoE piece's sites do not carry)."""
    if not isinstance(spec, DeepseekV41Spec):
        raise TypeError(f"deepseek_v41_flash sites need a DeepseekV41Spec, got {type(spec).__name__}")
    clamp = spec.layers[0].ffn.activation.clamp
    return [_with(s, clamp=clamp) if s.name in (f"{KIND}/moe.experts", f"{KIND}/moe.shared") else s for s in sites]
