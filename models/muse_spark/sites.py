"""Op sites of one Muse Spark decode step on one rank.

The sites of Muse Spark as standard pieces (``pieces.standard.compose_standard``), with what is Muse's:

* two layer kinds: ``gqa.window+moe`` (sliding window 2048 with RoPE, 46 layers) and ``gqa.full+moe``
  (full attention without RoPE, 16 layers, l % 4 == 1): GQA pieces with the weightless QK norm
  (``attn.q_norm`` / ``attn.k_norm``) and the sigmoid output gate, whose rows ride in ``attn.qkv_proj``;
* the attention output's RMSNorm before the gate (``attn.out_norm``, the norm family's gated form,
  per head) - the GQA piece has no output norm, so it is inserted after ``attn.gqa``;
* latent MoE (``LatentMoE(input_norm=True, output_norm=False)``): the pre-expert RMSNorm is
  ``moe.latent_norm``; the post-expert norm applies per expert, before the routing weight, so it is
  part of ``moe.experts`` (attr ``post_expert_norm``), not a site;
* the gated residual with sandwich norms: ``SandwichResidual`` with the norm-preserving gate
  (temperature 0.3, floor 1e-3), zero-centred pre-norms (eps 1e-5), a weightless attention post-norm
  and an input-scaled FFN post-norm (eps 1e-8), an fp32 stream and a final norm whose gain is not
  zero-centred (vLLM 0.33's Muse Spark, as the piece documents): every join is a ``residual.gated``
  site (``attn.join`` / ``ffn.join``: post-norm, gate, next pre-norm in one call; layer 0's input norm
  ``attn.norm``; the final norm in the last ``ffn.join``), the sublayers' partial sums are plain
  all-reduce sites (no residual, no norm) at TP > 1;
* RMS-normed embeddings (``embed_norm``, weightless) and the logit softcap (attrs of ``lm_head``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from latency_specialized.ops.sites import OpSite, SiteBuilder
from latency_specialized.pieces.embedding import TokenEmbedding
from latency_specialized.pieces.ffn.latent_moe import LatentMoE
from latency_specialized.pieces.residual.gated import NormPreservingGate
from latency_specialized.pieces.residual.sandwich import SandwichResidual
from latency_specialized.pieces.standard import compose_standard
from latency_specialized.runtime.composed import ComposedModel
from latency_specialized.spec import GQAAttentionSpec, LayerSpec, ModelSpec, MoESpec

from latency_specialized_models.muse_spark.spec import MuseSparkSpec

WINDOW_KIND, FULL_KIND = "gqa.window+moe", "gqa.full+moe"


def _with(site: OpSite, *, layers: tuple[int, ...] | None = None, **attrs: Any) -> OpSite:
    """``site`` with other layers and/or extra attrs (contexts stay sorted so they hash equal)."""
    ctx = site.ctx
    if attrs:
        ctx = dataclasses.replace(ctx, attrs=tuple(sorted({**dict(ctx.attrs), **attrs}.items())))
    return dataclasses.replace(site, ctx=ctx, layers=site.layers if layers is None else tuple(layers))


def _kind(layer: LayerSpec) -> str:
    a = layer.attention
    assert isinstance(a, GQAAttentionSpec)
    return FULL_KIND if a.sliding_window is None else WINDOW_KIND


def composed_model(spec: MuseSparkSpec) -> ComposedModel:
    """Muse Spark's pieces (unsharded spec): standard GQA, the latent MoE with the pre-expert norm, the
    sandwich-normed gated residual, the normed embedding (see the module docstring)."""
    def ffn(layer: LayerSpec) -> LatentMoE:
        assert isinstance(layer.ffn, MoESpec) and layer.ffn.latent_dim
        return LatentMoE(layer.ffn, norm_eps=spec.norm.eps, input_norm=True, output_norm=False)

    residual = SandwichResidual.for_spec(
        spec, gate=NormPreservingGate(temperature=spec.residual_gate.temperature, eps=spec.residual_gate.floor),
        final_zero_centered=False, post_attn="weightless", post_ffn="input_scaled", post_eps=spec.post_norm.eps,
        post_zero_centered=spec.post_norm.zero_centered, stream_dtype="float32")
    return compose_standard(spec, kind=_kind, ffn=ffn, residual=residual,
                            embedding=TokenEmbedding(normed=spec.embed_norm))


def muse_op_sites(spec: ModelSpec, sites: list[OpSite]) -> list[OpSite]:
    """The sites of :func:`composed_model` (one rank, ``sites``) with what Muse adds to its pieces: the
    attention output norm after every ``attn.gqa``, the per-expert post-norm of ``moe.experts``, the
    weightless embedding norm and the logit softcap (``spec``: the Muse spec, full or per rank)."""
    if not isinstance(spec, MuseSparkSpec):
        raise TypeError(f"muse_spark sites need a MuseSparkSpec, got {type(spec).__name__}")
    out: list[OpSite] = []
    for site in sites:
        kind, _, role = site.name.rpartition("/")
        if site.name == "embed_norm":
            site = _with(site, weightless=True)
        elif role == "moe.experts" and spec.latent_post_norm:
            site = _with(site, post_expert_norm=True)
        elif site.name == "lm_head":
            site = _with(site, softcap=spec.logits.softcap, logit_scale=spec.logits.scale)
        out.append(site)
        if role == "attn.gqa" and spec.attn_output_norm:
            # RMSNorm of the attention output fused with the sigmoid gate (norm's gated form), per head over
            # head_dim (guess: like Muse Glimmer's per-head gate; MODELS.md gives no width), rows = M x heads
            # as the GQA piece's per-head QK norms
            c = site.ctx
            b = SiteBuilder(c.arch, c.dtype, c.tokens, c.world_size)
            b.prefix, b.layers = kind, site.layers
            b.add("attn.out_norm", "norm", tokens=c.tokens * c.dim("heads"), N=c.dim("head_dim"),
                  attrs={"per_head": True, "gate": True})
            out += b.sites
    if spec.attn_output_norm and not any(s.name.endswith("/attn.out_norm") for s in out):
        raise RuntimeError("muse_spark: the composed sites no longer contain attn.gqa")  # fail loudly
    return out
