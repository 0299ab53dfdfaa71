"""Op sites of one DeepSeek-V4.1-Flash decode step on one rank.

Starts from :func:`standard_op_sites` (every layer is ``sparse_mqa+moe``, so the standard list has
one site per role for all 40 layers, shaped after layer 0) and edits it where layers differ:

* attention is three sites: window-only (layers 0-1), ratio-2 compressed (2-19), full-length
  compressed (20-39) - different KV lengths and top-k;
* compressors run only on the KV-source layers, indexers only on the index-source layers, and the
  indexer's key projection only where a layer is both;
* mHC: each sublayer computes 24 fp32 mixing coefficients from the 4 x 5120 stream (a GEMM site),
  and the all-reduce sites carry ``residual_kind=mhc`` - the post-mix / Sinkhorn / pre-mix collapse
  is fused there, as in vLLM's all-reduce + mHC kernel;
* Engram on layers 1 and 14: the table rows (prefetch site) and the key/value projection.

Not a site (no op family exists yet, see README): the Engram gate (normalised q.k, signed sqrt,
sigmoid) and the 4x4 Sinkhorn/collapse math itself, which rides on the all-reduce sites' attrs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from latency_specialized.ops.sites import OpSite, SiteBuilder, standard_op_sites
from latency_specialized.spec import ModelSpec, ParallelSpec

from latency_specialized_models.deepseek_v41_flash.spec import DeepseekV41Spec

KIND = "sparse_mqa+moe"


def _with(site: OpSite, *, layers: tuple[int, ...] | None = None, **attrs: Any) -> OpSite:
    """``site`` with other layers and/or extra attrs (contexts stay sorted so they hash equal)."""
    ctx = site.ctx
    if attrs:
        ctx = dataclasses.replace(ctx, attrs=tuple(sorted({**dict(ctx.attrs), **attrs}.items())))
    return dataclasses.replace(site, ctx=ctx, layers=site.layers if layers is None else tuple(layers))


def dsv41_op_sites(spec: ModelSpec, parallel: ParallelSpec, tokens: int, arch: str, dtype: str) -> list[OpSite]:
    """Sites of one decode step (``spec`` full or per-rank; sharded to ``parallel.tp`` here)."""
    if not isinstance(spec, DeepseekV41Spec):
        raise TypeError(f"deepseek_v41_flash sites need a DeepseekV41Spec, got {type(spec).__name__}")
    rank = spec if spec.tp == parallel.tp else spec.shard(parallel.tp)
    tp, hidden = parallel.tp, spec.hidden_size
    attn = rank.layers[0].attention  # shapes shared by every layer (per rank)
    streams = spec.residual.streams or 1
    mix = spec.hyper.mix_width(streams)
    mhc_attrs = {"residual_kind": "mhc", "streams": streams, "sinkhorn_iters": spec.residual.sinkhorn_iters}
    all_layers = tuple(range(spec.num_layers))
    act_clamp = rank.layers[0].ffn.activation.clamp  # SwiGLU clamp of routed and shared experts

    b = SiteBuilder(arch, dtype, tokens, tp)
    b.prefix = KIND

    def at(layers: tuple[int, ...]) -> SiteBuilder:
        b.layers = tuple(layers)
        return b

    def new_sites(fill) -> list[OpSite]:
        start = len(b.sites)
        fill()
        return b.sites[start:]

    def mhc_gemm(role: str) -> None:
        # Mixing coefficients from the whole flattened stream; the weight is fp32 and replicated.
        at(all_layers).add(role, "gemm", weight_bytes=mix * streams * hidden * 4, N=mix, K=streams * hidden,
                           attrs={"residual": False, "weight_dtype": "float32"})

    # ---- inserted before attn.norm: Engram injection, then the attention sublayer's mHC mixes
    def engram() -> None:
        e = spec.engram
        rows = e.rows_per_token
        # Tables are sharded by hash column across TP ranks (vLLM ParallelEngramEmbedding), so a
        # rank fetches its share of each token's rows.
        share = -(-rows // tp)
        bytes_per_value = 1 if e.table_dtype == "fp8_e4m3" else 2
        at(e.layers).add("engram.prefetch", "prefetch", weight_bytes=tokens * share * e.head_dim * bytes_per_value,
                         rows=share, row_width=e.head_dim, attrs={"side_stream": True, "source": "engram_table"})
        # wkv: all fetched rows -> one key per stream + a shared value; column-parallel output.
        at(e.layers).gemm("engram.wkv", hidden * (streams + 1) // tp, rows * e.head_dim)

    def attn_mhc() -> None:
        mhc_gemm("attn.mhc_gemm")

    # ---- inserted after attn.q_a_proj / attn.kv_proj
    def q_norm() -> None:
        at(all_layers).add("attn.q_norm", "norm", N=attn.q_lora_rank)

    def kv_side() -> None:
        at(all_layers).add("attn.kv_norm", "norm", N=attn.head_dim)
        for ratio in (2, 1):
            src = tuple(s for s in spec.kv_source_layers if spec.layers[s].attention.compress_ratio == ratio)
            if src:
                # Compressor: kv latent (+ softmax pooling gate when ratio > 1), replicated.
                at(src).gemm(f"attn.compressor.c{ratio}", attn.head_dim * (2 if ratio > 1 else 1), hidden)
        at(spec.kv_source_layers).add("attn.compressor_norm", "norm", N=attn.head_dim)
        idx = spec.layers[spec.index_source_layers[0]].attention.indexer  # type: ignore[union-attr]
        assert idx is not None
        at(spec.index_source_layers).gemm("attn.indexer.q_proj", idx.num_heads * idx.head_dim, attn.q_lora_rank)
        at(spec.index_source_layers).gemm("attn.indexer.weights_proj", idx.num_heads, hidden)
        # Index keys come from the compressor latent, only where the layer owns both.
        owns_k = tuple(l for l in spec.index_source_layers if l in spec.kv_source_layers)
        at(owns_k).gemm("attn.indexer.k_proj", idx.head_dim, attn.head_dim)
        at(owns_k).add("attn.indexer.k_norm", "norm", N=idx.head_dim)
        at(spec.index_source_layers).add("attn.indexer", "attention.sparse", heads=idx.num_heads,
                                         head_dim=idx.head_dim, topk=idx.topk,
                                         attrs={"compressed": True, "candidates": spec.candidate_source_layer >= 0})

    def attention() -> None:
        window = spec.layers_with_ratio(0)
        if window:
            at(window).add("attn.sparse_mqa.window", "attention.sparse", heads=attn.num_heads,
                           head_dim=attn.head_dim, topk=0, window=attn.sliding_window, attrs={"sinks": True})
        for ratio in (2, 1):
            layers = spec.layers_with_ratio(ratio)
            if layers:
                at(layers).add(f"attn.sparse_mqa.c{ratio}", "attention.sparse", heads=attn.num_heads,
                               head_dim=attn.head_dim, topk=spec.index_topk, window=attn.sliding_window,
                               compress_ratio=ratio, attrs={"sinks": True})

    def ffn_mhc() -> None:
        mhc_gemm("ffn.mhc_gemm")

    before = {f"{KIND}/attn.norm": new_sites(engram) + new_sites(attn_mhc)}
    after = {f"{KIND}/attn.q_a_proj": new_sites(q_norm), f"{KIND}/attn.kv_proj": new_sites(kv_side),
             f"{KIND}/attn.allreduce": new_sites(ffn_mhc)}
    replace = {f"{KIND}/attn.sparse_mqa": new_sites(attention)}

    std = standard_op_sites(rank, parallel, tokens, arch, dtype)
    missing = (set(before) | set(after) | set(replace)) - {s.name for s in std}
    if missing:  # the standard list changed shape: fail loudly rather than drop model-specific work
        raise RuntimeError(f"deepseek_v41_flash: standard op sites no longer contain {sorted(missing)}")
    out: list[OpSite] = []
    for site in std:
        out += before.get(site.name, [])
        if site.name in replace:
            out += replace[site.name]
            continue
        if site.family == "allreduce" or site.name in (f"{KIND}/attn.norm", "final_norm"):
            site = _with(site, **mhc_attrs)
        elif site.name in (f"{KIND}/moe.experts", f"{KIND}/moe.shared"):
            site = _with(site, clamp=act_clamp)
        elif site.name == f"{KIND}/attn.o_a_proj":
            # A batched GEMM: each local output group maps its own heads' slice (K wide) to o_lora.
            site = _with(site, groups=attn.o_groups)
        elif site.name == f"{KIND}/moe.router":
            site = _with(site, routed_scaling=rank.layers[0].ffn.router.routed_scaling)  # type: ignore[union-attr]
        out.append(site)
        out += after.get(site.name, [])
    return out
