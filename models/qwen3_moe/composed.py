"""Qwen3-MoE as pieces, and the map from its Hugging Face tensor names onto the pieces' weights.

Per layer GQA (weighted per-head QK RMSNorm, then NeoX RoPE) and a dense SwiGLU MLP (``mlp_only_layers``) or a
softmax top-k MoE, router replicated as vLLM's (``router_split=False``); pre-norm residual, embedding, LM head.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

import torch

from latency_specialized.errors import CheckpointError, UserError
from latency_specialized.pieces import DenseMLP, GQAAttention, LMHead, PreNormResidual, RoutedMoE, TokenEmbedding
from latency_specialized.runtime import random_weights as rw
from latency_specialized.runtime.checkpoint import load_checkpoint, read_config
from latency_specialized.runtime.composed import MODEL, ComposedModel, LayerPieces, expected_tensors
from latency_specialized.spec import MoESpec

from latency_specialized_models.qwen3_moe.spec import Qwen3MoESpec, spec_from_config

RESIDUAL = {"input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight"}
EXPERT = {"experts.w1": "gate_proj", "experts.w3": "up_proj", "experts.w2": "down_proj"}


@functools.lru_cache(maxsize=16)
def composed_model(spec: Qwen3MoESpec) -> ComposedModel:
    """The pieces of ``spec`` (a rank's shard: those of the spec it was sharded from)."""
    if not isinstance(spec, Qwen3MoESpec):
        raise UserError(f"qwen3_moe needs a Qwen3MoESpec (adapter.spec('tiny'), or a checkpoint's), got {spec.name}")
    if spec.unsharded is not None:
        return composed_model(spec.full())
    kinds: dict[str, tuple[Any, Any]] = {}
    for L in spec.layers:
        if L.kind not in kinds:
            ffn = RoutedMoE(L.ffn, router_split=False) if isinstance(L.ffn, MoESpec) else DenseMLP(L.ffn)
            kinds[L.kind] = (GQAAttention(L.attention, qk_norm="weighted"), ffn)
    layers = [LayerPieces(L.index, L.kind, *kinds[L.kind]) for L in spec.layers]
    return ComposedModel(spec, TokenEmbedding(), PreNormResidual(), layers, LMHead(tied=spec.tie_word_embeddings))


def tensor_name_for(spec: Qwen3MoESpec) -> Callable[[int, str, str], str]:
    """``tensor_name(layer, role, local)``: the Hugging Face name (``{e}``: the loader stacks the experts)."""
    head = "model.embed_tokens.weight" if spec.full().tie_word_embeddings else "lm_head.weight"

    def tensor_name(layer: int, role: str, local: str) -> str:
        if layer == MODEL:
            return {"embed": "model.embed_tokens.weight", "residual": "model.norm.weight", "head": head}[role]
        p = f"model.layers.{layer}."
        if role == "residual":
            return p + RESIDUAL[local]
        if role == "attn":
            return f"{p}self_attn.{local}.weight"
        if local in EXPERT:
            return f"{p}mlp.experts.{{e}}.{EXPERT[local]}.weight"
        return p + ("mlp.gate.weight" if local == "router" else f"mlp.{local}.weight")

    return tensor_name


def load(directory: str | Path, dtype: torch.dtype, device: Any = "cpu") -> tuple[Qwen3MoESpec, dict, dict]:
    """(spec, tensors by Hugging Face name, config) of a Qwen3-MoE model directory."""
    cfg = read_config(directory)
    if cfg is None:
        raise CheckpointError(f"{directory}: no config.json: point at a Hugging Face model directory")
    spec = spec_from_config(cfg, where=str(Path(directory) / "config.json"))
    expected = expected_tensors(composed_model(spec), tensor_name_for(spec))   # name -> (shape, dtype kind)
    return spec, load_checkpoint(directory, expected, dtype, device=device).tensors, cfg


def random_weights(spec: Qwen3MoESpec, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: Any = "cpu"):
    """Random tensors by Hugging Face name (``runtime.random_weights``: gains ~1, projections 1/sqrt(fan-in))."""
    return rw.random_weights(composed_model(spec), tensor_name_for(spec), seed=seed, dtype=dtype, device=device)
