"""GLM-5.3 config.json (``model_type: glm_moe_dsa``, transformers' ``GlmMoeDsaConfig``) <-> :class:`Glm53Spec`.

Keys that size a tensor are required, and so are ``max_position_embeddings`` and the RoPE base (transformers'
defaults, 202752 and 1e4, are not GLM-5.3's). Which layers run their own indexer: vLLM's rule
(``index_topk_pattern``, else ``index_topk_freq`` / ``index_skip_topk_offset``, defaults 1 / 2); transformers'
``indexer_types`` (written by ``save_pretrained``) must agree with it. Dense layers: ``mlp_layer_types`` (or
``first_k_dense_replace``). A setting not implemented is a CheckpointError naming the key; unknown keys get
one warning."""

from __future__ import annotations

from typing import Any, Mapping

from latency_specialized.config_keys import ConfigKeys
from latency_specialized.errors import CheckpointError
from latency_specialized.spec import DenseMLPSpec, MoESpec

from latency_specialized_models.glm53.spec import NAME, Glm53Spec, WeightFormats, build_spec, index_share_layers

ARCH, MODEL_TYPE = "GlmMoeDsaForCausalLM", "glm_moe_dsa"
FP8 = "fp8_e4m3 blocks 128x128"
SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "q_lora_rank", "kv_lora_rank",
         "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk")
MOE = ("num_experts_per_tok", "moe_intermediate_size", "n_shared_experts")
UNSUPPORTED = {"attention_bias": (False, "q/kv/o biases are not implemented"),
               "mlp_bias": (False, "MLP biases are not implemented"), "hidden_act": ("silu", "only SiLU"),
               "tie_word_embeddings": (False, "a tied LM head is not implemented"),
               "scoring_func": ("sigmoid", "only the sigmoid router"),
               "topk_method": ("noaux_tc", "only noaux_tc (bias-corrected) routing"),
               "moe_layer_freq": (1, "only MoE on every layer after the dense ones"),
               "indexer_rope_interleave": (True, "GLM's indexer RoPE is interleaved (transformers' GlmMoeDsaIndexer)"),
               "rope_scaling": (None, "scaled RoPE (YaRN) is not implemented")}
KNOWN = (*SIZES, *MOE, *UNSUPPORTED, "architectures", "model_type", "intermediate_size", "n_routed_experts",
         "num_local_experts", "num_experts", "num_key_value_heads", "routed_scaling_factor", "n_group", "topk_group",
         "norm_topk_prob", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_theta",
         "first_k_dense_replace", "mlp_layer_types", "layer_types", "indexer_types", "index_topk_freq",
         "index_skip_topk_offset", "index_topk_pattern", "index_share_for_mtp_iteration", "num_nextn_predict_layers",
         "quantization_config", "head_dim", "qk_head_dim",  # derived: transformers recomputes both
         "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype", "attention_dropout",
         "initializer_range", "output_router_logits", "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "use_cache",
         "transformers_version", "ep_size", "pretraining_tp")
"""Keys read or checked, and the inert ones (training-only, bookkeeping, derived): never warned about."""


def _fail(where: str, key: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"{where}: config key {key} = {value!r}: {why}")


def _indexer_layers(cfg: Mapping[str, Any], n: int, where: str) -> tuple[int, int]:
    """(freq, offset) of the IndexShare rule; CheckpointError where a pattern or indexer_types disagree."""
    freq, offset = max(int(cfg.get("index_topk_freq") or 1), 1), int(cfg.get("index_skip_topk_offset", 2))
    rule = ["full" if l in index_share_layers(n, freq, offset) else "shared" for l in range(n)]
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        got = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
        if got != rule:
            raise _fail(where, "index_topk_pattern", pattern, f"only the index_topk_freq {freq} / "
                        f"index_skip_topk_offset {offset} rule is implemented, which gives {rule}")
    types = cfg.get("indexer_types")
    if types is not None and list(types) != rule:
        raise CheckpointError(f"{where}: config keys indexer_types = {list(types)} and index_topk_freq {freq} / "
                              f"index_skip_topk_offset {offset} (-> {rule}) contradict each other: make them agree")
    if rule[0] != "full":
        raise _fail(where, "index_skip_topk_offset", offset, "layer 0 must run its own indexer")
    return freq, offset


def _first_dense(cfg: Mapping[str, Any], n: int, where: str) -> int:
    k = int(cfg.get("first_k_dense_replace", 3))
    types = cfg.get("mlp_layer_types")
    if types is None:
        return min(k, n)
    d = sum(t == "dense" for t in types)
    if list(types) != ["dense"] * d + ["sparse"] * (n - d):
        raise _fail(where, "mlp_layer_types", types, "only leading dense layers, then MoE layers, are implemented")
    if "first_k_dense_replace" in cfg and min(k, n) != d:
        raise CheckpointError(f"{where}: config keys mlp_layer_types ({d} dense) and first_k_dense_replace = {k} "
                              "contradict each other: make them agree")
    return d


def spec_from_config(cfg: Mapping[str, Any], *, where: str = "config.json", variant: str = "full") -> Glm53Spec:
    """The spec of a GLM-5.3 ``config.json`` (CheckpointError naming a bad key; one warning naming unknown ones)."""
    keys = ConfigKeys(where=where, model=NAME)
    keys.section(cfg, KNOWN)
    rope = keys.section(cfg.get("rope_parameters") or {}, ("rope_theta", "rope_type"), prefix="rope_parameters.")
    quant = keys.section(cfg.get("quantization_config") or {}, ("quant_method", "fmt", "weight_block_size",
                                                               "activation_scheme", "modules_to_not_convert"),
                         prefix="quantization_config.")
    if cfg.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise _fail(where, "model_type", cfg["model_type"], f"not a GLM-5.3 config ({MODEL_TYPE})")
    if ARCH not in (cfg.get("architectures") or [ARCH]):
        raise _fail(where, "architectures", cfg["architectures"], f"not a GLM-5.3 config ({ARCH})")
    if rope.get("rope_type", "default") != "default":
        raise _fail(where, "rope_parameters.rope_type", rope["rope_type"], "only the default RoPE is implemented")
    for key, (ok, why) in UNSUPPORTED.items():
        if cfg.get(key, ok) != ok:
            raise _fail(where, key, cfg[key], why)
    if quant and (quant.get("quant_method") != "fp8" or list(quant.get("weight_block_size") or []) != [128, 128]
                  or quant.get("fmt", "e4m3") != "e4m3"):
        raise _fail(where, "quantization_config", dict(quant), "only FP8 e4m3 with 128x128 blocks is implemented")
    keys.require(cfg, SIZES)
    heads, n = int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
    if int(cfg.get("num_key_value_heads") or heads) != heads:
        raise _fail(where, "num_key_value_heads", cfg["num_key_value_heads"], f"MLA has one KV head per query head "
                    f"(num_attention_heads {heads})")
    groups, topk_groups = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if groups > 1 and topk_groups < groups:
        raise _fail(where, "topk_group", topk_groups, f"group-limited routing (n_group {groups}) is not implemented")
    keys.require(cfg, ("max_position_embeddings",), why="transformers' default (202752) is not the model's context")
    theta = keys.pick({"rope_theta": cfg.get("rope_theta"), "rope_parameters.rope_theta": rope.get("rope_theta")},
                      "rope_parameters.rope_theta", "rope_theta")
    freq, offset = _indexer_layers(cfg, n, where)
    first = _first_dense(cfg, n, where)
    experts = inter = 0
    if first < n:
        keys.require(cfg, MOE, why="the MoE layers need them")
        experts = int(keys.pick(cfg, "n_routed_experts", "num_local_experts", "num_experts"))
    if first:
        keys.require(cfg, ("intermediate_size",), why=f"the dense layers 0..{first - 1} need it")
        inter = int(cfg["intermediate_size"])
    keys.warn(stacklevel=2)
    spec = build_spec(
        variant=variant, hidden=int(cfg["hidden_size"]), vocab=int(cfg["vocab_size"]), num_layers=n,
        first_dense=first, heads=heads, q_lora=int(cfg["q_lora_rank"]), kv_lora=int(cfg["kv_lora_rank"]),
        nope=int(cfg["qk_nope_head_dim"]), rope=int(cfg["qk_rope_head_dim"]), v_dim=int(cfg["v_head_dim"]),
        idx_heads=int(cfg["index_n_heads"]), idx_dim=int(cfg["index_head_dim"]), idx_topk=int(cfg["index_topk"]),
        freq=freq, offset=offset, experts=experts or 1, top_k=int(cfg.get("num_experts_per_tok") or 1),
        shared=int(cfg.get("n_shared_experts") or 0), expert_inter=int(cfg.get("moe_intermediate_size") or 1),
        dense_inter=inter or 1, max_context=int(cfg["max_position_embeddings"]), rope_theta=float(theta),
        eps=float(cfg.get("rms_norm_eps") or 1e-5), mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        mtp_reuse=bool(cfg.get("index_share_for_mtp_iteration", False)),
        renormalize=bool(cfg.get("norm_topk_prob", True)), routed_scaling=float(cfg.get("routed_scaling_factor", 2.5)))
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    return spec.model_copy(update={"weights": WeightFormats(main=FP8 if quant else dtype, variants=())})


def config_from_spec(spec: Glm53Spec, dtype: str = "bfloat16") -> dict[str, Any]:
    """The Hugging Face ``config.json`` of ``spec`` (transformers' ``GlmMoeDsaConfig`` loads it;
    ``spec_from_config`` of it gives ``spec`` back, its ``weights`` formats aside)."""
    s = spec.full()
    a = s.layers[0].attention
    ix = a.indexer
    moe = next((l.ffn for l in s.layers if isinstance(l.ffn, MoESpec)), None)
    mlp = next((l.ffn for l in s.layers if isinstance(l.ffn, DenseMLPSpec)), None)
    full = set(s.indexer_layers())
    out: dict[str, Any] = dict(
        architectures=[ARCH], model_type=MODEL_TYPE, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
        vocab_size=s.vocab_size, num_attention_heads=a.num_heads, num_key_value_heads=a.num_heads,
        q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim, index_n_heads=ix.num_heads,
        index_head_dim=ix.head_dim, index_topk=ix.topk, index_topk_freq=s.index_share.freq,
        index_skip_topk_offset=s.index_share.skip_offset, indexer_rope_interleave=True,
        indexer_types=["full" if l in full else "shared" for l in range(s.num_layers)],
        index_share_for_mtp_iteration=s.index_share.mtp_reuse, num_nextn_predict_layers=s.mtp.num_layers,
        max_position_embeddings=s.max_context, rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta},
        rms_norm_eps=s.norm.eps, first_k_dense_replace=len(s.dense_layers()),
        mlp_layer_types=["dense" if isinstance(l.ffn, DenseMLPSpec) else "sparse" for l in s.layers],
        hidden_act="silu", attention_bias=False, tie_word_embeddings=False, n_group=1, topk_group=1, dtype=dtype)
    if mlp is not None:
        out["intermediate_size"] = mlp.intermediate
    if moe is not None:
        out.update(n_routed_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   n_shared_experts=moe.num_shared_experts, moe_intermediate_size=moe.expert_intermediate,
                   norm_topk_prob=moe.router.renormalize, routed_scaling_factor=moe.router.routed_scaling)
    return out


__all__ = ["ARCH", "MODEL_TYPE", "KNOWN", "config_from_spec", "spec_from_config"]
