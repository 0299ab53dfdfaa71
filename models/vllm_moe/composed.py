"""vLLM's Qwen3-MoE-style decoder as pieces - the pieces ``models/qwen3_moe`` composes, without a head.

Per layer: GQA with weighted per-head QK RMSNorm before NeoX RoPE (``GQAAttention``), then a dense
SwiGLU MLP (``mlp_only_layers``) or a softmax top-k MoE without shared experts whose router is
replicated on every rank as vLLM's ``GateLinear`` is (``RoutedMoE(router_split=False)``); pre-norm
residual and token embedding. No LM head: vLLM's ``compute_logits`` runs after the forward, so the
program stops at the final hidden state (``ComposedModel(head=None)``).

The plan (``VllmMoEAdapter.op_sites``), ``explain`` and the vLLM binding's program all use
:func:`composed_model`, so they see one list of sites.
"""

from __future__ import annotations

import functools
from typing import Any

from latency_specialized.errors import UserError
from latency_specialized.pieces import DenseMLP, GQAAttention, PreNormResidual, RoutedMoE, TokenEmbedding
from latency_specialized.runtime.composed import ComposedModel, LayerPieces
from latency_specialized.spec import ModelSpec, MoESpec


@functools.lru_cache(maxsize=16)
def composed_model(spec: ModelSpec) -> ComposedModel:
    """The pieces of ``spec`` (unsharded; one piece object per layer kind), head-less."""
    if spec.tp != 1:
        raise UserError(f"{spec.name}: build the composed model from the unsharded spec (it is for TP={spec.tp})")
    kinds: dict[str, tuple[Any, Any]] = {}
    for layer in spec.layers:
        if layer.kind not in kinds:
            ffn = RoutedMoE(layer.ffn, router_split=False) if isinstance(layer.ffn, MoESpec) else DenseMLP(layer.ffn)
            kinds[layer.kind] = (GQAAttention(layer.attention, qk_norm="weighted"), ffn)
    layers = [LayerPieces(layer.index, layer.kind, *kinds[layer.kind]) for layer in spec.layers]
    return ComposedModel(spec, TokenEmbedding(), PreNormResidual(), layers, None)


__all__ = ["composed_model"]
