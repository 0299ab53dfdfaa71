"""Qwen3-MoE as a ModelSpec, read from (and written as) a Hugging Face ``config.json``. Layer ``i`` is MoE when
``num_experts > 0``, ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (transformers'
``Qwen3MoeDecoderLayer``). Keys with a transformers default take it; keys that size a tensor are required; a
setting not implemented is a CheckpointError naming the key."""

from __future__ import annotations

from typing import Any, Mapping

from latency_specialized.config_keys import ConfigKeys
from latency_specialized.errors import CheckpointError
from latency_specialized.spec import DenseMLPSpec, GQAAttentionSpec, LayerSpec, ModelSpec, MoESpec, NormSpec, RouterSpec

NAME, ARCH = "qwen3_moe", "Qwen3MoeForCausalLM"

# config.json of Qwen/Qwen3-30B-A3B on the Hugging Face Hub (the same numbers as models/vllm_moe/spec.py)
QWEN3_30B_A3B: dict[str, Any] = dict(
    architectures=[ARCH], model_type=NAME, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
    rope_theta=1_000_000.0, max_position_embeddings=40960, vocab_size=151936, tie_word_embeddings=False)
# every feature at test size: a dense layer (mlp_only_layers), GQA 2 queries per KV head, top-2 of 8
TINY: dict[str, Any] = dict(
    QWEN3_30B_A3B, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0],
    rope_theta=10000.0, max_position_embeddings=256, vocab_size=128)
# 3 layers at widths the GPU kernels serve: on sm_90 in bf16 every site runs a kernel (a CUDA graph per step)
MEDIUM: dict[str, Any] = dict(
    TINY, hidden_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=128, intermediate_size=1024,
    moe_intermediate_size=256, num_experts=32, num_experts_per_tok=8, rope_theta=1_000_000.0,
    max_position_embeddings=4096, vocab_size=2048)
VARIANTS = {"full": QWEN3_30B_A3B, "medium": MEDIUM, "tiny": TINY}

UNSUPPORTED = {"attention_bias": (False, "q/k/v/o biases are not implemented"), "hidden_act": ("silu", "only SiLU"),
               "use_sliding_window": (False, "sliding-window attention is not implemented"),
               "rope_scaling": (None, "scaled RoPE (YaRN, dynamic) is not implemented")}
KNOWN = (*QWEN3_30B_A3B, *UNSUPPORTED, "num_local_experts", "rope_parameters", "sliding_window", "max_window_layers",
         "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype", "attention_dropout",
         "initializer_range", "output_router_logits", "router_aux_loss_coef", "use_cache", "transformers_version")
"""Keys read or checked, and the inert ones (training-only, bookkeeping): never warned about."""


class Qwen3MoESpec(ModelSpec):
    """A Qwen3-MoE model: the generic ModelSpec plus what it has no field for."""

    tie_word_embeddings: bool = False
    """lm_head reads the embedding table."""
    unsharded: ModelSpec | None = None
    """The spec this one was sharded from (None: this one is unsharded); the pieces are built from it."""

    def shard(self, tp: int) -> "Qwen3MoESpec":
        return super().shard(tp).model_copy(update={"unsharded": self})

    def full(self) -> "Qwen3MoESpec":
        return self.unsharded or self  # type: ignore[return-value]


def spec_from_config(cfg: Mapping[str, Any], variant: str = "full", where: str = "config.json") -> Qwen3MoESpec:
    """The spec of a ``config.json`` (CheckpointError naming a bad key; one warning naming the unknown ones)."""
    keys = ConfigKeys(where=where, model=NAME)
    keys.section(cfg, KNOWN)
    rope = keys.section(cfg.get("rope_parameters") or {}, ("rope_theta", "rope_type"), prefix="rope_parameters.")
    checks = {"model_type": (cfg.get("model_type", NAME) == NAME, "not a Qwen3-MoE config"),
              "architectures": (ARCH in (cfg.get("architectures") or [ARCH]), f"not a Qwen3-MoE config ({ARCH})"),
              "rope_parameters.rope_type": (rope.get("rope_type", "default") == "default", "only the default RoPE"),
              **{k: (cfg.get(k, ok) == ok, why) for k, (ok, why) in UNSUPPORTED.items()}}
    for key, (ok, why) in checks.items():
        if not ok:
            value = rope["rope_type"] if key.startswith("rope_parameters") else cfg[key]
            raise CheckpointError(f"{where}: config key {key} = {value!r}: {why}")
    keys.require(cfg, ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"))
    experts = int(keys.pick(cfg, "num_experts", "num_local_experts"))
    theta = keys.pick({"rope_theta": cfg.get("rope_theta"), "rope_parameters.rope_theta": rope.get("rope_theta")},
                      "rope_theta", "rope_parameters.rope_theta", default=10000.0)
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    attn = GQAAttentionSpec(num_heads=heads, num_kv_heads=int(cfg["num_key_value_heads"]), qk_norm=True,
                            head_dim=int(cfg.get("head_dim") or hidden // heads), rope_theta=float(theta))
    dense, step = set(cfg.get("mlp_only_layers") or []), int(cfg.get("decoder_sparse_step") or 1)
    is_moe = [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(int(cfg["num_hidden_layers"]))]
    moe = mlp = None
    if any(is_moe):
        keys.require(cfg, ("moe_intermediate_size", "num_experts_per_tok"), why="the MoE layers need them")
        router = RouterSpec(score_func="softmax", bias_corrected=False, renormalize=bool(cfg.get("norm_topk_prob")),
                            fp32=False)   # logits in the activation dtype, as transformers' and vLLM's gate
        moe = MoESpec(num_experts=experts, top_k=int(cfg["num_experts_per_tok"]), num_shared_experts=0,
                      expert_intermediate=int(cfg["moe_intermediate_size"]), router=router)
    if not all(is_moe):
        dense_at = [i for i, m in enumerate(is_moe) if not m]
        keys.require(cfg, ("intermediate_size",), why=f"the dense layers {dense_at[:4]} need it")
        mlp = DenseMLPSpec(intermediate=int(cfg["intermediate_size"]))
    keys.warn(stacklevel=2)
    return Qwen3MoESpec(name=NAME, variant=variant, hidden_size=hidden, vocab_size=int(cfg["vocab_size"]),
                        max_context=int(cfg.get("max_position_embeddings") or 32768),
                        norm=NormSpec(eps=float(cfg.get("rms_norm_eps") or 1e-6)),
                        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                        layers=tuple(LayerSpec(index=i, attention=attn, ffn=moe if m else mlp)
                                     for i, m in enumerate(is_moe)))


def config_from_spec(spec: Qwen3MoESpec, dtype: str = "bfloat16") -> dict[str, Any]:
    """The Hugging Face ``config.json`` of ``spec`` (``spec_from_config`` of it gives ``spec`` back)."""
    spec = spec.full()
    a, ffns = spec.layers[0].attention, [l.ffn for l in spec.layers]
    moe = next((f for f in ffns if isinstance(f, MoESpec)), None)
    mlp = next((f for f in ffns if isinstance(f, DenseMLPSpec)), None)
    return dict(
        architectures=[ARCH], model_type=NAME, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim,
        vocab_size=spec.vocab_size, max_position_embeddings=spec.max_context, rms_norm_eps=spec.norm.eps,
        rope_theta=a.rope_theta, tie_word_embeddings=spec.tie_word_embeddings, hidden_act="silu", attention_bias=False,
        decoder_sparse_step=1, torch_dtype=dtype, num_experts=moe.num_experts if moe else 0,
        mlp_only_layers=[i for i, f in enumerate(ffns) if isinstance(f, DenseMLPSpec)],
        **(dict(num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.expert_intermediate,
                norm_topk_prob=moe.router.renormalize) if moe else {}),
        **(dict(intermediate_size=mlp.intermediate) if mlp else {}))


def variant_spec(variant: str) -> Qwen3MoESpec:
    """The spec of a variant: 'full' (Qwen3-30B-A3B), 'medium' or 'tiny'."""
    return spec_from_config(VARIANTS[variant], variant)
