"""Kimi K3 as pieces: the composed model of a KimiK3Spec, its checkpoint names and its random weights.

Per layer: a KDA attention (``pieces/attention/kda.py``) or a NoPE absorbed MLA with the sigmoid output
gate (``pieces/attention/mla.py``), then a dense MLP (layer 0) or a latent MoE (``pieces/ffn/latent_moe.py``);
Block AttnRes residuals; token embedding and LM head. What is Kimi's lives here: the numbers the pieces
take from the spec (KDA's output-norm eps ``kda_norm_eps``, the latent MoE's norm after the experts,
the AttnRes blocks); the checkpoint names of every piece weight (``KimiLinearForCausalLM`` text model as
vLLM's ``kimi_k3`` loader reads it; routed experts ``w1`` gate, ``w3`` up, ``w2`` down): :func:`tensor_name_for`;
the checkpoint's tensor order, in which random weights are drawn (:func:`draw_order`). A spec for
speculative tokens (``ModelSpec.spec_tokens``) builds its KDA pieces (rollback tapes for that many tokens) with verification sites and tapes. What the checkpoint
stores in fp32 (A_log, dt_bias, conv taps, the KDA output-norm gain, the router bias) the pieces declare so.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

import torch

from latency_specialized.pieces.attention.kda import KDAAttention
from latency_specialized.pieces.attention.mla import MLAAttention
from latency_specialized.pieces.embedding import TokenEmbedding
from latency_specialized.pieces.ffn.dense_mlp import DenseMLP
from latency_specialized.pieces.ffn.latent_moe import LatentMoE
from latency_specialized.pieces.ffn.moe import RoutedMoE
from latency_specialized.pieces.lm_head import LMHead
from latency_specialized.pieces.residual.attnres import BlockAttnRes
from latency_specialized.runtime import composed as generic
from latency_specialized.runtime import random_weights as rw
from latency_specialized.runtime.composed import MODEL, ComposedModel, TensorName
from latency_specialized.runtime.pieces_api import LayerPieces
from latency_specialized.spec import DenseMLPSpec, KDAAttentionSpec

from latency_specialized_models.kimi_k3.spec import KimiK3Spec


@functools.lru_cache(maxsize=8)
def composed_model(spec: KimiK3Spec) -> ComposedModel:
    """The pieces of the unsharded ``spec``, one piece object per layer kind."""
    by_kind: dict[str, tuple[Any, Any]] = {}
    layers = []
    for layer in spec.layers:
        if layer.kind not in by_kind:
            a, f = layer.attention, layer.ffn   # the spec builder makes KDA and MLA layers only
            # the MLA layers verify as they decode (paged: every row its own request); KDA keeps tapes
            attn: Any = KDAAttention(a, norm_eps=spec.kda_norm_eps, spec_tokens=spec.spec_tokens) \
                if isinstance(a, KDAAttentionSpec) else MLAAttention(a, norm_eps=spec.norm.eps)
            if isinstance(f, DenseMLPSpec):
                ffn: Any = DenseMLP(f)
            elif f.latent_dim:
                ffn = LatentMoE(f, norm_eps=spec.norm.eps, output_norm=spec.latent_moe_norm)
            else:
                ffn = RoutedMoE(f)   # a config without routed_expert_hidden_size: the plain MoE
            by_kind[layer.kind] = (attn, ffn)
        attn, ffn = by_kind[layer.kind]
        layers.append(LayerPieces(layer.index, layer.kind, attn, ffn))
    return ComposedModel(spec, TokenEmbedding(), BlockAttnRes.for_spec(spec), layers,
                         LMHead(tied=spec.tie_word_embeddings))


# ---------------------------------------------------------------------------------------------- names
# piece-local name -> checkpoint leaf, each table in the checkpoint's order (the draw order of random weights)
_RESIDUAL = {"attn.out_norm": "input_layernorm.weight", "ffn.out_norm": "post_attention_layernorm.weight",
             "attn.norm": "self_attention_res_norm.weight", "attn.query": "self_attention_res_proj.weight",
             "ffn.norm": "mlp_res_norm.weight", "ffn.query": "mlp_res_proj.weight"}
_FINAL = {"norm": "model.output_attn_res_norm.weight", "query": "model.output_attn_res_proj.weight",
          "out_norm": "model.norm.weight"}
_KDA = {**{f"{n}_proj": f"{n}_proj.weight" for n in ("q", "k", "v", "g", "f_a", "f_b", "b")},
        **{f"{n}_conv": f"{n}_conv1d.weight" for n in ("q", "k", "v")},
        "A_log": "A_log", "dt_bias": "dt_bias", "o_norm": "o_norm.weight", "o_proj": "o_proj.weight"}
_MLA = {"q_a_proj": "q_a_proj.weight", "q_a_norm": "q_a_layernorm.weight", "q_b_proj": "q_b_proj.weight",
        "q_proj": "q_proj.weight", "kv_a_proj": "kv_a_proj_with_mqa.weight", "kv_a_norm": "kv_a_layernorm.weight",
        "kv_b_proj": "kv_b_proj.weight", "o_proj": "o_proj.weight", "g_proj": "g_proj.weight"}
_DENSE = {n: f"{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
_MOE = {"router": "gate.weight", "router_bias": "gate.e_score_correction_bias",
        "latent_down": "routed_expert_down_proj.weight", "latent_norm": "routed_expert_norm.weight",
        "latent_up": "routed_expert_up_proj.weight",
        "experts.w1": "experts.{e}.w1.weight", "experts.w3": "experts.{e}.w3.weight",
        "experts.w2": "experts.{e}.w2.weight",
        **{f"shared.{n}": f"shared_experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}}
_HEAD = "lm_head.weight"
_EMBED = "model.embed_tokens.weight"


def _layer_tables(spec: KimiK3Spec, layer: int) -> list[tuple[str, dict[str, str], str]]:
    """(role, local -> leaf, prefix of the leaves) of layer ``layer``, in the checkpoint's order."""
    L = spec.layers[layer]
    ffn = ("ffn", _DENSE, "mlp.") if isinstance(L.ffn, DenseMLPSpec) else ("ffn", _MOE, "block_sparse_moe.")
    return [("residual", _RESIDUAL, ""),
            ("attn", _KDA if isinstance(L.attention, KDAAttentionSpec) else _MLA, "self_attn."), ffn]


def tensor_name_for(spec: KimiK3Spec) -> TensorName:
    """``tensor_name(layer, role, local) -> str | None`` of ``spec``'s checkpoint (official names, ``{e}``
    in the routed experts' names: the loader stacks them); None for a weight Kimi does not have."""

    def tensor_name(layer: int, role: str, local: str) -> str | None:
        if layer == MODEL:
            if local != "weight" and role != "residual":
                return None
            return {"embed": _EMBED, "head": _EMBED if spec.tie_word_embeddings else _HEAD,
                    "residual": _FINAL.get(local)}.get(role)
        for r, table, prefix in _layer_tables(spec, layer):
            if r == role:
                leaf = table.get(local)
                return f"model.layers.{layer}.{prefix}{leaf}" if leaf else None
        return None

    return tensor_name


_IN_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


def draw_order(spec: KimiK3Spec) -> Callable[[str], tuple[int, int, int, int]]:
    """Sort key of checkpoint names in the checkpoint's order: embedding; per layer the residual gains,
    the attention's, the FFN's tensors (experts one after the other, w1 w3 w2 each); the final ones."""
    tail = [*_FINAL.values(), _HEAD]

    @functools.lru_cache(maxsize=None)
    def layer_leaves(i: int) -> list[str]:
        return [prefix + leaf for _, table, prefix in _layer_tables(spec, i) for leaf in table.values()]

    def key(name: str) -> tuple[int, int, int, int]:
        m = _IN_LAYER.match(name)
        if m is None:
            return (-1, 0, 0, 0) if name == _EMBED else (spec.num_layers, tail.index(name), 0, 0)
        i, rest = int(m.group(1)), m.group(2)
        leaves = layer_leaves(i)
        x = _EXPERT.match(rest)
        if x:
            return (i, leaves.index("block_sparse_moe.experts.{e}.w1.weight"), int(x.group(1)),
                    ("w1", "w3", "w2").index(x.group(2)))
        return (i, leaves.index(rest), 0, 0)

    return key


def expected_tensors(spec: KimiK3Spec) -> dict[str, tuple[tuple[int, ...], str]]:
    """Checkpoint name -> (shape, 'act' | 'float32') of every tensor of the text model."""
    return generic.expected_tensors(composed_model(spec), tensor_name_for(spec))


def random_weights(spec: KimiK3Spec, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                   device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Random weights of ``spec`` by official name (deterministic in ``seed``; drawn on the CPU in the
    checkpoint's order; ``runtime.random_weights`` says how each is drawn)."""
    return rw.random_weights(composed_model(spec), tensor_name_for(spec), seed=seed, dtype=dtype, device=device,
                             order=draw_order(spec))


def piece_weights(spec: KimiK3Spec, weights: dict[str, torch.Tensor]) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    """Official-name weights (the reference's dict) as the composed program's ``{layer: {role: {local}}}``."""
    return generic.weights_from_names(composed_model(spec), weights, tensor_name_for(spec))


__all__ = ["composed_model", "tensor_name_for", "draw_order", "expected_tensors", "random_weights",
           "piece_weights"]
