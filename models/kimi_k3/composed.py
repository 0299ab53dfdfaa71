"""Kimi K3 as pieces: the composed model of a KimiK3Spec and the map from its checkpoint names.

Per layer (``spec.layers``): a KDA attention (``pieces/attention/kda.py``) or a NoPE absorbed MLA
with the sigmoid output gate (``pieces/attention/mla.py``), then a dense MLP (layer 0) or a latent
MoE (``pieces/ffn/latent_moe.py``); the residual is Block AttnRes (``pieces/residual/attnres.py``);
token embedding and LM head at the ends. What is truly Kimi's lives here and nowhere else:

* the numbers the pieces take from the spec: KDA's output-norm epsilon (``kda_norm_eps``, not the
  config eps), the latent MoE's norm after the experts (``latent_moe_norm``), the AttnRes blocks;
* the checkpoint names (``KimiLinearForCausalLM`` text model; ``weights.py`` lists them) of every
  piece weight: :func:`tensor_name`;
* the decode state of :class:`~latency_specialized_models.kimi_k3.cache.KimiK3Cache` as the pieces'
  states (:func:`cache_states`), so the reference's prefill feeds the composed program.

    model = composed_model(spec)
    program = composed_program(spec, weights, plans, cache, comm=comm)   # a runtime DecodeProgram

The composed model's ``op_sites`` equal ``sites.kimi_op_sites`` (names, families, contexts, layers,
weight bytes, order): plans and ``explain`` are the same for both programs.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.plan import Plan
from latency_specialized.pieces.attention.kda import KDAAttention
from latency_specialized.pieces.attention.mla import MLAAttention
from latency_specialized.pieces.embedding import TokenEmbedding
from latency_specialized.pieces.ffn.dense_mlp import DenseMLP
from latency_specialized.pieces.ffn.latent_moe import LatentMoE
from latency_specialized.pieces.ffn.moe import RoutedMoE
from latency_specialized.pieces.lm_head import LMHead
from latency_specialized.pieces.residual.attnres import BlockAttnRes
from latency_specialized.runtime.composed import MODEL, ComposedModel, ComposedProgram, weights_from_names
from latency_specialized.runtime.pieces_api import LayerPieces
from latency_specialized.runtime.states import ModelStates
from latency_specialized.spec import DenseMLPSpec, KDAAttentionSpec, MLAAttentionSpec, MoESpec
from latency_specialized.trace import Trace

from latency_specialized_models.kimi_k3.cache import KimiK3Cache
from latency_specialized_models.kimi_k3.spec import KimiK3Spec


@functools.lru_cache(maxsize=8)
def composed_model(spec: KimiK3Spec) -> ComposedModel:
    """The pieces of ``spec`` (unsharded), one piece object per layer kind."""
    if spec.tp != 1:
        raise UserError("build the Kimi K3 composed model from the unsharded spec (shard happens per rank)")
    by_kind: dict[str, tuple[Any, Any]] = {}
    layers = []
    for layer in spec.layers:
        if layer.kind not in by_kind:
            a, f = layer.attention, layer.ffn
            if isinstance(a, KDAAttentionSpec):
                attn: Any = KDAAttention(a, norm_eps=spec.kda_norm_eps)
            elif isinstance(a, MLAAttentionSpec):
                attn = MLAAttention(a, norm_eps=spec.norm.eps)
            else:  # pragma: no cover - the spec builder only makes KDA and MLA layers
                raise UserError(f"kimi_k3 has no {type(a).__name__} layers")
            if isinstance(f, DenseMLPSpec):
                ffn: Any = DenseMLP(f)
            elif isinstance(f, MoESpec) and f.latent_dim:
                ffn = LatentMoE(f, norm_eps=spec.norm.eps, output_norm=spec.latent_moe_norm)
            else:
                assert isinstance(f, MoESpec)
                ffn = RoutedMoE(f)   # a config without routed_expert_hidden_size: the plain MoE
            by_kind[layer.kind] = (attn, ffn)
        attn, ffn = by_kind[layer.kind]
        layers.append(LayerPieces(layer.index, layer.kind, attn, ffn))
    return ComposedModel(spec, TokenEmbedding(), BlockAttnRes.for_spec(spec), layers,
                         LMHead(tied=spec.tie_word_embeddings))


# ---------------------------------------------------------------------------------------------- names
_RESIDUAL = {"attn.norm": "self_attention_res_norm.weight", "attn.query": "self_attention_res_proj.weight",
             "attn.out_norm": "input_layernorm.weight", "ffn.norm": "mlp_res_norm.weight",
             "ffn.query": "mlp_res_proj.weight", "ffn.out_norm": "post_attention_layernorm.weight"}
_FINAL = {"norm": "model.output_attn_res_norm.weight", "query": "model.output_attn_res_proj.weight",
          "out_norm": "model.norm.weight"}
_KDA = {**{f"{n}_proj": f"{n}_proj.weight" for n in ("q", "k", "v", "g", "f_a", "b", "f_b", "o")},
        **{f"{n}_conv": f"{n}_conv1d.weight" for n in ("q", "k", "v")},
        "A_log": "A_log", "dt_bias": "dt_bias", "o_norm": "o_norm.weight"}
_MLA = {"q_a_proj": "q_a_proj.weight", "q_a_norm": "q_a_layernorm.weight", "q_b_proj": "q_b_proj.weight",
        "q_proj": "q_proj.weight", "kv_a_proj": "kv_a_proj_with_mqa.weight", "kv_a_norm": "kv_a_layernorm.weight",
        "kv_b_proj": "kv_b_proj.weight", "o_proj": "o_proj.weight", "g_proj": "g_proj.weight"}
_DENSE = {n: f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
_MOE = {"router": "gate.weight", "router_bias": "gate.e_score_correction_bias",
        "latent_down": "routed_expert_down_proj.weight", "latent_norm": "routed_expert_norm.weight",
        "latent_up": "routed_expert_up_proj.weight",
        "experts.w1": "experts.{e}.w1.weight", "experts.w3": "experts.{e}.w3.weight",
        "experts.w2": "experts.{e}.w2.weight",
        **{f"shared.{n}": f"shared_experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}}


def tensor_name_for(spec: KimiK3Spec):
    """``tensor_name(layer, role, local) -> str | None`` of ``spec``'s checkpoint (official names,
    ``{e}`` in the routed experts' names: the loader stacks them); None for a weight Kimi does not have."""

    def tensor_name(layer: int, role: str, local: str) -> str | None:
        if layer == MODEL:
            if role == "embed":
                return "model.embed_tokens.weight" if local == "weight" else None
            if role == "head":
                if local != "weight":
                    return None
                return "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
            return _FINAL.get(local) if role == "residual" else None
        p = f"model.layers.{layer}."
        if role == "residual":
            leaf = _RESIDUAL.get(local)
            return p + leaf if leaf else None
        L = spec.layers[layer]
        if role == "attn":
            table = _KDA if isinstance(L.attention, KDAAttentionSpec) else _MLA
            leaf = table.get(local)
            return p + "self_attn." + leaf if leaf else None
        if role == "ffn":
            if isinstance(L.ffn, DenseMLPSpec):
                leaf = _DENSE.get(local)
                return p + leaf if leaf else None
            leaf = _MOE.get(local)
            return p + "block_sparse_moe." + leaf if leaf else None
        return None

    return tensor_name


def tensor_name(spec: KimiK3Spec, layer: int, role: str, local: str) -> str | None:
    """Checkpoint name of piece weight ``(layer, role, local)`` of ``spec`` (see :func:`tensor_name_for`)."""
    return tensor_name_for(spec)(layer, role, local)


def piece_weights(spec: KimiK3Spec,
                  weights: Mapping[str, torch.Tensor]) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    """Full official-name weights (the reference's dict) as the composed program's ``{layer: {role: {local}}}``."""
    return weights_from_names(composed_model(spec), weights, tensor_name_for(spec))


# ---------------------------------------------------------------------------------------------- states
def cache_states(spec: KimiK3Spec, cache: KimiK3Cache) -> dict[int, dict[str, torch.Tensor]]:
    """The tensors of ``cache`` (the rank's: ``tp.shard_cache`` at TP > 1) as the pieces' states
    (KDA: 'conv', 'state'; MLA: 'kv'), shared, not copied: the program updates the cache in place."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for layer in spec.layers:
        i = layer.index
        if i in cache.state:
            out[i] = {"conv": cache.conv[i], "state": cache.state[i]}
        elif i in cache.kv:
            out[i] = {"kv": cache.kv[i]}
    return out


def composed_program(spec: KimiK3Spec, weights: Mapping[str, torch.Tensor], plans: Plan | Mapping[int, Plan],
                     cache: KimiK3Cache, *, comm: Any = None, trace: Trace | None = None,
                     weights_sharded: bool = False) -> ComposedProgram:
    """The generic program over Kimi K3's pieces: full (or, with ``weights_sharded``, this rank's)
    official-name weights, plans of this model, and the rank's cache (updated in place)."""
    model = composed_model(spec)
    w = piece_weights(spec, weights)   # by name; shapes are checked against the declarations (full or rank's)
    tp = comm.world_size if comm is not None else 1
    states = ModelStates.external(model, cache_states(spec, cache), tp=tp)
    return ComposedProgram(model, w, plans, states, comm=comm, trace=trace, weights_sharded=weights_sharded)


__all__ = ["composed_model", "tensor_name", "tensor_name_for", "piece_weights", "cache_states", "composed_program"]
