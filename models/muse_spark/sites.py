"""Op sites of one Muse Spark decode step on one rank.

Starts from :func:`standard_op_sites` (every layer is ``gqa+moe``, so the standard list is shaped
after layer 0, a sliding-window layer) and edits it where Muse Spark differs:

* attention is two sites: sliding window 2048 with RoPE (46 layers) and full attention without
  RoPE (16 layers, l % 4 == 1);
* weightless QK-norm after the QKV projection; the attention output goes RMSNorm -> sigmoid gate
  (the norm family's gated form) -> o_proj;
* sandwich norms and the gated residual: the all-reduce sites carry ``residual_kind=gated`` and the
  post-norm (eps 1e-8, zero-centred) that precede the next pre-norm;
* latent MoE with a norm on the experts' latent output too;
* RMS-normed embeddings (model-level site) and the logit softcap (attrs of ``lm_head``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from latency_specialized.ops.sites import OpSite, SiteBuilder, standard_op_sites
from latency_specialized.spec import GQAAttentionSpec, ModelSpec, ParallelSpec

from latency_specialized_models.muse_spark.spec import MuseSparkSpec

KIND = "gqa+moe"


def _with(site: OpSite, *, layers: tuple[int, ...] | None = None, **attrs: Any) -> OpSite:
    """``site`` with other layers and/or extra attrs (contexts stay sorted so they hash equal)."""
    ctx = site.ctx
    if attrs:
        ctx = dataclasses.replace(ctx, attrs=tuple(sorted({**dict(ctx.attrs), **attrs}.items())))
    return dataclasses.replace(site, ctx=ctx, layers=site.layers if layers is None else tuple(layers))


def muse_op_sites(spec: ModelSpec, parallel: ParallelSpec, tokens: int, arch: str, dtype: str) -> list[OpSite]:
    """Sites of one decode step (``spec`` full or per-rank; sharded to ``parallel.tp`` here)."""
    if not isinstance(spec, MuseSparkSpec):
        raise TypeError(f"muse_spark sites need a MuseSparkSpec, got {type(spec).__name__}")
    rank = spec if spec.tp == parallel.tp else spec.shard(parallel.tp)
    hidden = spec.hidden_size
    full_layers, window_layers = spec.full_attention_layers(), spec.window_layers()
    all_layers = tuple(range(spec.num_layers))
    attn = rank.layers[window_layers[0] if window_layers else 0].attention
    assert isinstance(attn, GQAAttentionSpec)
    moe = rank.layers[0].ffn
    pre = {"zero_centered": spec.norm.zero_centered, "eps": spec.norm.eps}
    gated = {"residual_kind": "gated", "post_norm_eps": spec.post_norm.eps,
             "zero_centered": spec.post_norm.zero_centered}

    b = SiteBuilder(arch, dtype, tokens, parallel.tp)

    def sites(fill) -> list[OpSite]:
        start = len(b.sites)
        fill()
        return b.sites[start:]

    def qk_norm() -> None:
        b.layers = all_layers
        # Weightless, per head over head_dim, on every local q and k head.
        b.add("attn.qk_norm", "norm", N=attn.head_dim, heads=attn.num_heads + attn.num_kv_heads,
              attrs={"weightless": True})

    def attention() -> None:
        common = {"heads": attn.num_heads, "kv_heads": attn.num_kv_heads, "head_dim": attn.head_dim}
        attrs = {"qk_norm": attn.qk_norm, "scale": attn.softmax_scale}
        if window_layers:
            b.layers = window_layers
            b.add("attn.gqa.window", "attention.gqa", window=attn.sliding_window or 0, **common,
                  attrs={**attrs, "rope": True})
        if full_layers:
            b.layers = full_layers
            b.add("attn.gqa.full", "attention.gqa", window=0, **common, attrs={**attrs, "rope": False})

    def out_norm() -> None:
        b.layers = all_layers
        # RMSNorm of the attention output fused with the sigmoid gate (norm's gated form).
        # guess: per head over head_dim, like Muse Glimmer's per-head gate; MODELS.md gives no width.
        b.add("attn.out_norm", "norm", N=attn.head_dim, heads=attn.num_heads, attrs={"gate": True})

    def latent_post_norm() -> None:
        b.layers = all_layers
        assert moe.kind == "moe" and moe.latent_dim
        b.add("moe.latent_post_norm", "norm", N=moe.latent_dim)

    first = sites(lambda: b.add("embed_norm", "norm", N=hidden, attrs={"weightless": True}))  # model level
    b.prefix = KIND
    after = {f"{KIND}/attn.qkv_proj": sites(qk_norm), f"{KIND}/attn.gate_proj": sites(out_norm),
             f"{KIND}/moe.experts": sites(latent_post_norm)}
    replace = {f"{KIND}/attn.gqa": sites(attention)}

    std = standard_op_sites(rank, parallel, tokens, arch, dtype)
    missing = (set(after) | set(replace)) - {s.name for s in std}
    if missing:  # the standard list changed shape: fail loudly rather than drop model-specific work
        raise RuntimeError(f"muse_spark: standard op sites no longer contain {sorted(missing)}")
    out: list[OpSite] = list(first) if spec.embed_norm else []
    for site in std:
        if site.name in replace:
            out += replace[site.name]
            continue
        if site.family == "allreduce":
            site = _with(site, **gated, eps=spec.norm.eps)
        elif site.name == f"{KIND}/attn.norm":
            site = _with(site, **pre, residual_kind="gated")
        elif site.name == f"{KIND}/moe.router":
            r = moe.router  # type: ignore[union-attr]
            site = _with(site, logit_scale=r.logit_scale, renormalize_eps=r.renormalize_eps,
                         routed_scaling=r.routed_scaling)
        elif site.name == "lm_head":
            site = _with(site, softcap=spec.logits.softcap, logit_scale=spec.logits.scale)
        out.append(site)
        out += after.get(site.name, [])
    return out
