"""Op sites of one GLM-5.3 decode step on one rank.

Starts from :func:`standard_op_sites` (kinds ``mla+dense`` for layers 0-2 and ``mla+moe`` for
3-77; every layer carries the DSA indexer spec) and edits it for IndexShare: the indexer and its
projections run only on the 21 indexer layers, the other 57 reuse the latest top-k. The MLA site
of every layer is sparse (top-2048 tokens). Not a site: the indexer's key LayerNorm (the norm
family is RMSNorm only) and the MTP draft layer (it runs in the draft step, not in this one).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from latency_specialized.ops.sites import OpSite, SiteBuilder, standard_op_sites
from latency_specialized.spec import MLAAttentionSpec, ModelSpec, ParallelSpec

from latency_specialized_models.glm53.spec import Glm53Spec


def _with(site: OpSite, *, layers: tuple[int, ...] | None = None, **attrs: Any) -> OpSite:
    """``site`` with other layers and/or extra attrs (contexts stay sorted so they hash equal)."""
    ctx = site.ctx
    if attrs:
        ctx = dataclasses.replace(ctx, attrs=tuple(sorted({**dict(ctx.attrs), **attrs}.items())))
    return dataclasses.replace(site, ctx=ctx, layers=site.layers if layers is None else tuple(layers))


def glm53_op_sites(spec: ModelSpec, parallel: ParallelSpec, tokens: int, arch: str, dtype: str) -> list[OpSite]:
    """Sites of one decode step (``spec`` full or per-rank; sharded to ``parallel.tp`` here)."""
    if not isinstance(spec, Glm53Spec):
        raise TypeError(f"glm53 sites need a Glm53Spec, got {type(spec).__name__}")
    rank = spec if spec.tp == parallel.tp else spec.shard(parallel.tp)
    attn = rank.layers[0].attention
    assert isinstance(attn, MLAAttentionSpec) and attn.indexer is not None and attn.q_lora_rank
    idx = attn.indexer
    full = set(spec.indexer_layers())
    b = SiteBuilder(arch, dtype, tokens, parallel.tp)

    out: list[OpSite] = []
    seen_indexer = False
    for site in standard_op_sites(rank, parallel, tokens, arch, dtype):
        kind, _, role = site.name.rpartition("/")
        if role == "attn.indexer":
            seen_indexer = True
            layers = tuple(l for l in site.layers if l in full)
            if not layers:  # a kind whose layers all reuse the top-k: no indexer work at all
                continue
            # Indexer projections, replicated on every rank (vLLM ReplicatedLinear): the query from
            # the q latent, then key + per-head weights from the hidden state in one GEMM.
            b.prefix, b.layers = kind, layers
            b.gemm("attn.indexer.q_proj", idx.num_heads * idx.head_dim, attn.q_lora_rank)
            b.gemm("attn.indexer.k_weights_proj", idx.head_dim + idx.num_heads, spec.hidden_size)
            out += b.sites
            b.sites = []
            site = _with(site, layers=layers, rope_interleaved=attn.rope_interleaved)
        elif role == "attn.mla":
            # Every layer attends to the top-k tokens only (its own indexer's or the shared one's).
            site = _with(site, sparse_topk=idx.topk, rope_interleaved=attn.rope_interleaved)
        elif role == "moe.router":
            site = _with(site, routed_scaling=rank.layers[-1].ffn.router.routed_scaling)  # type: ignore[union-attr]
        out.append(site)
    if not seen_indexer:  # the standard list changed shape: fail loudly rather than plan a dense MLA
        raise RuntimeError("glm53: standard op sites no longer contain attn.indexer")
    return out
