"""GLM-5.3 as pieces (the op sites of one decode step on one rank come from them).

``pieces.standard.compose_standard``: pre-norm residual, dense MLP (layers 0-2), routed MoE with its shared expert
(3-77), embedding, LM head, and MLA + the DSA indexer as the sparse MLA piece (``SparseMLAAttention``). IndexShare:
the indexer runs only on the 21 indexer layers, the other 57 reuse the latest top-k - a piece stands for every layer
of its kind, so the reuse layers are kinds of their own (``mla.reuse+moe``; layers 0-2 all run an indexer): their
sites have no ``attn.indexer`` and no indexer rows in the fused projections. Every layer attends to the top-2048
tokens (``attn.sparse_mla``). The indexer's RoPE layout is the MLA's (interleaved). Not a site: the MTP draft layer
(it runs in the draft step, not in this one).
"""

from __future__ import annotations

import functools

from latency_specialized.pieces.attention.sparse_mla import IndexerOptions, SparseMLAAttention, runs_own_indexer
from latency_specialized.pieces.standard import compose_standard
from latency_specialized.runtime.composed import ComposedModel
from latency_specialized.spec import LayerSpec, MLAAttentionSpec

from latency_specialized_models.glm53.spec import Glm53Spec


def _indexer(layer: LayerSpec) -> tuple[MLAAttentionSpec, bool]:
    a = layer.attention
    assert isinstance(a, MLAAttentionSpec) and a.indexer is not None
    return a, runs_own_indexer(a.indexer, layer.index)


@functools.lru_cache(maxsize=16)
def composed_model(spec: Glm53Spec) -> ComposedModel:
    """GLM-5.3's pieces (unsharded spec; a rank's shard: those of the spec it was sharded from): the standard
    ones, the sparse MLA with GLM's indexer RoPE layout and the reuse layers as kinds of their own."""
    if spec.unsharded is not None:
        return composed_model(spec.full())
    def attention(layer: LayerSpec) -> SparseMLAAttention:
        a, full = _indexer(layer)
        # q_a / kv_a norms: transformers builds them with eps 1e-6, not rms_norm_eps (spec.latent_norm_eps)
        return SparseMLAAttention(a, norm_eps=spec.latent_norm_eps,
                                  indexer=IndexerOptions(full=full, rope_interleaved=a.rope_interleaved))

    def kind(layer: LayerSpec) -> str:
        _, full = _indexer(layer)
        return layer.kind if full else layer.kind.replace("mla+", "mla.reuse+", 1)

    return compose_standard(spec, attention=attention, kind=kind)


__all__ = ["composed_model"]
