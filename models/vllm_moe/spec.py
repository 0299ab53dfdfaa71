"""Specs of the models the generic vLLM MoE adapter serves, read off a Hugging Face config.

``spec_from_config(cfg)`` describes a Qwen3-MoE-style decoder (pre-norm GQA with per-head QK
RMSNorm and RoPE, softmax top-k MoE without shared experts, optional dense ``mlp_only_layers``)
from the config object vLLM loaded (or any object/dict with the same fields). ``full`` is the public
Qwen3-30B-A3B config; ``tiny`` is the checkpoint of :mod:`latency_specialized_models.vllm_moe.checkpoint`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Mapping

from latency_specialized.errors import UserError
from latency_specialized.spec import (DenseMLPSpec, GQAAttentionSpec, LayerSpec, ModelSpec, MoESpec, NormSpec,
                                      RouterSpec)
from latency_specialized_models.vllm_moe.checkpoint import TinyQwen3MoeConfig

NAME = "vllm_moe"

# Public config.json of Qwen/Qwen3-30B-A3B (the smallest released Qwen3-MoE).
QWEN3_30B_A3B: dict[str, Any] = {
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "max_position_embeddings": 40960, "vocab_size": 151936,
}


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = cfg.get(n) if isinstance(cfg, Mapping) else getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def _rope_theta(cfg: Any) -> float | None:
    theta = _get(cfg, "rope_theta")
    if theta is None:  # transformers >= 5 keeps it in rope_parameters
        params = _get(cfg, "rope_parameters") or {}
        theta = params.get("rope_theta") if isinstance(params, Mapping) else None
    return float(theta) if theta is not None else None


def spec_from_config(cfg: Any, variant: str = "full") -> ModelSpec:
    """ModelSpec of a Qwen3-MoE-style config (raises UserError naming a missing field)."""
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [n for n in required if _get(cfg, n) is None]
    if missing:
        raise UserError(f"{NAME}: config lacks {', '.join(missing)}: the generic MoE adapter reads Qwen3-MoE-style configs")
    hidden, heads = int(_get(cfg, "hidden_size")), int(_get(cfg, "num_attention_heads"))
    head_dim = int(_get(cfg, "head_dim", default=hidden // heads))
    attention = GQAAttentionSpec(num_heads=heads, num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
                                 head_dim=head_dim, rope_theta=_rope_theta(cfg), qk_norm=True)
    experts = int(_get(cfg, "num_experts", "num_local_experts", default=0))
    step = int(_get(cfg, "decoder_sparse_step", default=1)) or 1
    dense_layers = set(_get(cfg, "mlp_only_layers", default=[]) or [])
    renormalize = bool(_get(cfg, "norm_topk_prob", default=False))
    router = RouterSpec(score_func="softmax", bias_corrected=False, renormalize=renormalize, fp32=False)
    layers = []
    for i in range(int(_get(cfg, "num_hidden_layers"))):
        if experts > 0 and i not in dense_layers and (i + 1) % step == 0:
            ffn: Any = MoESpec(num_experts=experts, top_k=int(_get(cfg, "num_experts_per_tok")), num_shared_experts=0,
                               expert_intermediate=int(_get(cfg, "moe_intermediate_size")), router=router)
        else:
            ffn = DenseMLPSpec(intermediate=int(_get(cfg, "intermediate_size")))
        layers.append(LayerSpec(index=i, attention=attention, ffn=ffn))
    return ModelSpec(name=NAME, variant=variant, hidden_size=hidden, vocab_size=int(_get(cfg, "vocab_size")),
                     max_context=int(_get(cfg, "max_position_embeddings", default=4096)), layers=tuple(layers),
                     norm=NormSpec(eps=float(_get(cfg, "rms_norm_eps", default=1e-6))))


def full_spec() -> ModelSpec:
    """Qwen3-30B-A3B."""
    return spec_from_config(QWEN3_30B_A3B, "full")


def tiny_spec() -> ModelSpec:
    """The tiny test checkpoint (3 layers: one dense, two MoE)."""
    t = TinyQwen3MoeConfig()
    cfg = {**asdict(t), "mlp_only_layers": [0], "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "decoder_sparse_step": 1}
    return spec_from_config(cfg, "tiny")
