"""Muse Spark as pieces, and the map from its Hugging Face tensor names onto the pieces' weights.

Every piece is a shared one, with options (transformers 5.24 ``modeling_muse_spark``; vLLM 0.33
``models/muse_spark``):

* attention: ``GQAAttention`` with the weightless QK norm, NeoX RoPE on the sliding-window layers and
  NoPE full attention on the others, the per-head weightless output norm (``out_norm``) before the
  sigmoid gate; the config's qk_scale_factor is folded into the softmax scale (the spec's);
* FFN: ``LatentMoE`` (the one latent-MoE piece, shared with Kimi K3) with the zero-centred pre-expert
  norm and the input-scaled per-expert post-norm (``moe.finalize``), no shared experts; dense layers
  (``mlp_layer_types``) are ``DenseMLP``;
* residual: ``SandwichResidual`` with the norm-preserving gate (weightless attention post-norm,
  input-scaled FFN post-norm, fp32 stream, a final norm whose gain is not zero-centred);
* ``TokenEmbedding`` with a weightless norm; ``LMHead`` with the logit soft cap.

Layer kinds (the sites' prefixes): ``gqa.window+moe`` (sliding window with RoPE) / ``gqa.full+moe`` (full
attention without RoPE; the last layer and every 4th before it), ``+dense`` for dense layers, and
``.nope`` / ``.rope`` where a config pairs a window or full attention the other way.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import torch

from latency_specialized.errors import UserError
from latency_specialized.pieces import DenseMLP, GQAAttention, LMHead, TokenEmbedding
from latency_specialized.pieces.ffn.latent_moe import LatentMoE
from latency_specialized.pieces.residual.gated import NormPreservingGate
from latency_specialized.pieces.residual.sandwich import SandwichResidual
from latency_specialized.quant.layout import cut
from latency_specialized.runtime.composed import MODEL, ComposedModel, LayerPieces
from latency_specialized.spec import GQAAttentionSpec, LayerSpec, MoESpec

from latency_specialized_models.muse_spark.spec import MuseSparkSpec

PREFIX = "model.language_model."
"""Canonical names: the text part of transformers' MuseSparkForConditionalGeneration (``names.py``)."""
RESIDUAL = {"attn.pre_norm": "input_layernorm.weight", "ffn.pre_norm": "pre_feedforward_layernorm.weight",
            "attn.gate": "post_attention_residual_gate.gate", "ffn.gate": "post_feedforward_residual_gate.gate",
            "ffn.post_norm": "post_feedforward_layernorm.weight"}
MOE = {"router": "mlp.gate.weight", "router_bias": "mlp.gate.e_score_correction_bias",
       "latent_down": "mlp.pre_expert_proj.weight", "latent_in_norm": "mlp.pre_expert_norm.weight",
       "latent_up": "mlp.post_expert_proj.weight", "post_expert_norm": "mlp.experts.post_expert_norm.weight",
       "experts.w2": "mlp.experts.down_proj",
       # halves of the fused [E, 2I, Ld] gate_up_proj (split_fused makes them views)
       "experts.w1": "mlp.experts.gate_up_proj:gate", "experts.w3": "mlp.experts.gate_up_proj:up"}


def layer_kind(layer: LayerSpec) -> str:
    a = layer.attention
    assert isinstance(a, GQAAttentionSpec)
    window, rope = a.sliding_window is not None, a.rope_theta is not None
    odd = "" if window == rope else (".rope" if rope else ".nope")   # the released pairing needs no suffix
    return f"gqa.{'window' if window else 'full'}{odd}+{layer.ffn.kind}"


@functools.lru_cache(maxsize=16)
def composed_model(spec: MuseSparkSpec) -> ComposedModel:
    """The pieces of ``spec`` (a rank's shard: those of the spec it was sharded from)."""
    if not isinstance(spec, MuseSparkSpec):
        raise UserError(f"muse_spark needs a MuseSparkSpec (adapter.spec('tiny'), or a checkpoint's), got {spec.name}")
    if spec.unsharded is not None:
        return composed_model(spec.full())
    if spec.tp != 1:
        raise UserError(f"muse_spark: compose the pieces from the unsharded spec (this one is for TP={spec.tp})")
    eps = spec.norm.eps
    kinds: dict[str, tuple[Any, Any]] = {}
    for L in spec.layers:
        kind = layer_kind(L)
        if kind in kinds:
            continue
        attn = GQAAttention(L.attention, qk_norm="weightless", qk_norm_eps=eps, out_norm=spec.attn_output_norm)
        if isinstance(L.ffn, MoESpec):
            ffn: Any = LatentMoE(L.ffn, norm_eps=eps, input_norm=spec.latent_pre_norm,
                                 input_norm_zero_centered=spec.norm.zero_centered,
                                 output_norm=False,
                                 post_expert_norm="input_scaled" if spec.latent_post_norm else "none",
                                 post_expert_eps=spec.post_norm.eps, post_expert_zero_centered=spec.post_norm.zero_centered)
        else:
            ffn = DenseMLP(L.ffn)
        kinds[kind] = (attn, ffn)
    residual = SandwichResidual.for_spec(
        spec, gate=NormPreservingGate(temperature=spec.residual_gate.temperature, eps=spec.residual_gate.floor),
        final_zero_centered=spec.final_norm.zero_centered, post_attn=spec.post_attn_norm, post_ffn=spec.post_ffn_norm,
        post_eps=spec.post_norm.eps,
        post_zero_centered=spec.post_norm.zero_centered, stream_dtype="float32")
    layers = [LayerPieces(L.index, layer_kind(L), *kinds[layer_kind(L)]) for L in spec.layers]
    return ComposedModel(spec, TokenEmbedding(normed=spec.embed_norm, norm_weight=False), residual, layers,
                         LMHead(softcap=spec.logits.softcap, logit_scale=spec.logits.scale))


def tensor_name_for(spec: MuseSparkSpec) -> Callable[[int, str, str], str]:
    """``tensor_name(layer, role, local)``: the canonical (Hugging Face) name; ``name:gate`` / ``name:up``
    are the halves of a fused tensor that :func:`split_fused` adds."""
    del spec  # one naming for every size

    def tensor_name(layer: int, role: str, local: str) -> str:
        if layer == MODEL:
            return {"embed": PREFIX + "embed_tokens.weight", "residual": PREFIX + "norm.weight",
                    "head": "lm_head.weight"}[role]
        p = f"{PREFIX}layers.{layer}."
        if role == "residual":
            return p + RESIDUAL[local]
        if role == "attn":
            return f"{p}self_attn.{'gate_proj' if local == 'g_proj' else local}.weight"
        if local in MOE:
            return p + MOE[local]
        return f"{p}mlp.{local}.weight"   # a dense layer's gate_proj / up_proj / down_proj

    return tensor_name


def split_fused(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``named`` plus the gate / up halves (views, or cuts of kept codes) of every fused ``experts.gate_up_proj``."""
    out = dict(named)
    for name, t in named.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            half = t.shape[1] // 2
            out[name + ":gate"], out[name + ":up"] = cut(t, 1, 0, half), cut(t, 1, half, half)
    return out


__all__ = ["composed_model", "layer_kind", "split_fused", "tensor_name_for"]
