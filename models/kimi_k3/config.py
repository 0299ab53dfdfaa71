"""Kimi K3 ``config.json`` <-> :class:`KimiK3Spec`, with the official keys.

Two layouts are understood (both as vLLM reads them):

* ``kimi_k3``: the published multimodal checkpoint, ``{"model_type": "kimi_k3",
  "architectures": ["KimiK3ForConditionalGeneration"], "text_config": {...}, "vision_config": {...}}``;
  tensors carry the ``language_model.`` prefix;
* ``kimi_linear``: the text model alone (``KimiLinearForCausalLM``), the text config at top level.

Text-config keys are those of vLLM's ``KimiLinearConfig`` (``linear_attn_config`` with
``kda_layers``/``full_attn_layers`` 1-indexed, ``attn_res_block_size``, ``routed_expert_hidden_size``,
``latent_moe_use_norm``, ``activation_situ_beta`` ...), plus ``model_max_length``, the name
transformers' ``KimiLinearConfig.save_pretrained`` writes for ``max_position_embeddings``.
Unknown keys (those ``save_pretrained`` adds, vendors' extras) are ignored and named, sorted, in one
:class:`~latency_specialized.config_keys.UnknownConfigKeysWarning`. Missing keys, contradictory keys
(``max_position_embeddings`` vs ``model_max_length``) and values this adapter does not implement
(RoPE MLA, softmax routing, grouped top-k, the softplus KDA gate) raise :class:`CheckpointError`
naming the key(s).
"""

from __future__ import annotations

from typing import Any

from latency_specialized.config_keys import ConfigKeys
from latency_specialized.errors import CheckpointError
from latency_specialized.spec import ActivationSpec, MoESpec, RouterSpec

from latency_specialized_models.kimi_k3.spec import KimiK3Spec, build_spec, full_spec, tiny_spec

ARCH_K3 = "KimiK3ForConditionalGeneration"
ARCH_TEXT = "KimiLinearForCausalLM"

# Keys every Hugging Face config may carry; accepted and ignored.
_HF_COMMON = {"architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "_name_or_path",
              "use_cache", "initializer_range", "quantization_config", "model_type"}

# vLLM KimiLinearConfig's keys (those we map, those we check, those we accept as irrelevant to decode).
_TEXT_KEYS = _HF_COMMON | {
    "vocab_size", "hidden_size", "head_dim", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "rms_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id",
    "rope_parameters", "rope_scaling", "rope_theta", "tie_word_embeddings", "moe_intermediate_size",
    "moe_renormalize", "moe_router_activation_func", "num_experts", "num_experts_per_token", "num_shared_experts",
    "routed_scaling_factor", "first_k_dense_replace", "moe_layer_freq", "use_grouped_topk", "num_expert_group",
    "topk_group", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "mla_use_nope", "mla_use_output_gate", "num_nextn_predict_layers", "linear_attn_config", "attn_res_block_size",
    "latent_moe_use_norm", "activation_situ_beta", "activation_situ_linear_beta", "max_position_embeddings",
    "routed_expert_hidden_size", "topk_method",
    "model_max_length",  # transformers' spelling of max_position_embeddings (KimiLinearConfig.attribute_map)
}
_KDA_KEYS = {"kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size",
             "use_full_rank_gate", "gate_lower_bound"}
_K3_TOP_KEYS = _HF_COMMON | {"text_config", "vision_config", "media_placeholder_token_id", "ignore_index",
                             "pad_token_id", "bos_token_id", "eos_token_id", "image_placeholder",
                             "tie_word_embeddings"}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "hidden_act", "rms_norm_eps", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
             "num_experts", "num_experts_per_token", "moe_intermediate_size", "linear_attn_config",
             "attn_res_block_size")


def _fail(where: str, key: str, why: str) -> CheckpointError:
    return CheckpointError(f"{where}: config key {key} {why}")


def split_config(cfg: dict[str, Any], where: str = "config.json",
                 keys: ConfigKeys | None = None) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(layout, text config, top-level config) of a parsed config.json; CheckpointError if not Kimi K3.

    Unknown top-level keys of the kimi_k3 layout are noted in ``keys`` (the caller warns); without
    ``keys`` they are warned about here.
    """
    own = keys is None
    keys = keys if keys is not None else ConfigKeys(where, "Kimi K3")
    mt = cfg.get("model_type")
    if mt == "kimi_k3" or "text_config" in cfg:
        keys.section(cfg, _K3_TOP_KEYS)
        if own:
            keys.warn()
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise _fail(where, "text_config", "is missing or not an object: a kimi_k3 config nests the text model there")
        if text.get("model_type", "kimi_linear") != "kimi_linear":
            raise _fail(where, "text_config.model_type", f"is {text.get('model_type')!r}: expected 'kimi_linear'")
        return "kimi_k3", text, cfg
    if mt == "kimi_linear":
        return "kimi_linear", cfg, cfg
    raise _fail(where, "model_type", f"is {mt!r}: not Kimi K3 (expected 'kimi_k3', or 'kimi_linear' for the text model)")


def spec_from_config(cfg: dict[str, Any], where: str = "config.json") -> tuple[KimiK3Spec, dict[str, Any]]:
    """The spec of a config.json (either layout) and its extras (layout, special token ids)."""
    keys = ConfigKeys(where, "Kimi K3")
    layout, t, top = split_config(cfg, where, keys)
    pre = "text_config." if layout == "kimi_k3" else ""
    keys.section(t, _TEXT_KEYS, pre)
    if isinstance(t.get("linear_attn_config"), dict):
        keys.section(t["linear_attn_config"], _KDA_KEYS, pre + "linear_attn_config.")
    keys.warn()  # one warning for every section, before any error (a renamed key shows up there)
    keys.require(t, _REQUIRED, pre)
    max_context = int(keys.pick(t, "max_position_embeddings", "model_max_length", prefix=pre, default=4096))

    def need(key: str, ok: bool, why: str) -> None:
        if not ok:
            raise _fail(where, pre + key, f"= {t.get(key)!r} {why}")

    kda = t["linear_attn_config"]
    need("linear_attn_config", isinstance(kda, dict), "must be an object")
    keys.require(kda, ("kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size"),
                 pre + "linear_attn_config.")
    L = int(t["num_hidden_layers"])
    kda_l, full_l = list(kda["kda_layers"]), list(kda["full_attn_layers"])
    if sorted(kda_l + full_l) != list(range(1, L + 1)):
        raise _fail(where, pre + "linear_attn_config.kda_layers/full_attn_layers",
                    f"must split the 1-indexed layers 1..{L} between KDA and MLA exactly once each")
    if not kda.get("use_full_rank_gate", False):
        raise _fail(where, pre + "linear_attn_config.use_full_rank_gate",
                    "is not true: the low-rank KDA output gate (Kimi-Linear) is not implemented; Kimi K3 sets it")
    if kda.get("gate_lower_bound") is None:
        raise _fail(where, pre + "linear_attn_config.gate_lower_bound",
                    "is missing: the softplus KDA gate (no lower bound) is not implemented; Kimi K3 uses -5.0")
    need("mla_use_nope", t.get("mla_use_nope") is True, "is not true: RoPE MLA is not implemented (Kimi K3 is NoPE)")
    need("moe_router_activation_func", t.get("moe_router_activation_func", "sigmoid") == "sigmoid",
         "is not implemented: Kimi K3 routes with sigmoid")
    need("topk_method", t.get("topk_method", "noaux_tc") == "noaux_tc", "is not implemented: use noaux_tc")
    grouped = t.get("use_grouped_topk", True) and (t.get("num_expert_group", 1) != 1 or t.get("topk_group", 1) != 1)
    need("num_expert_group", not grouped, "with topk_group: grouped top-k is not implemented (Kimi K3 uses 1 group)")
    need("moe_layer_freq", t.get("moe_layer_freq", 1) == 1, "is not implemented: every layer after the dense ones is MoE")
    need("attn_res_block_size", isinstance(t["attn_res_block_size"], int) and t["attn_res_block_size"] > 0,
         "must be a positive integer (Kimi K3: 12)")
    act = t["hidden_act"]
    if act == "situ":
        for k in ("activation_situ_beta", "activation_situ_linear_beta"):
            if t.get(k) is None:
                raise _fail(where, pre + k, "is missing: hidden_act situ needs both SiTU betas (Kimi K3: 4.0, 25.0)")
        activation = ActivationSpec(kind="situ_glu", beta=float(t["activation_situ_beta"]),
                                    beta_lin=float(t["activation_situ_linear_beta"]))
    elif act == "silu":
        activation = ActivationSpec(kind="swiglu")
    else:
        raise _fail(where, pre + "hidden_act", f"= {act!r} is not implemented (situ or silu)")
    router = RouterSpec(score_func="sigmoid", bias_corrected=True, renormalize=bool(t.get("moe_renormalize", True)),
                        routed_scaling=float(t.get("routed_scaling_factor", 1.0)))
    quant = t.get("quantization_config") or top.get("quantization_config") or {}
    expert_format = "mxfp4" if "mxfp4" in str(quant.get("quant_method", "")) + str(quant.get("format", "")) else "bf16"
    dense = tuple(range(int(t.get("first_k_dense_replace", 0))))
    try:
        spec = build_spec(
            variant="custom", hidden=int(t["hidden_size"]), vocab=int(t["vocab_size"]), num_layers=L,
            mla_layers=tuple(sorted(j - 1 for j in full_l)), kda_heads=int(kda["num_heads"]),
            head_dim=int(kda["head_dim"]), conv=int(kda["short_conv_kernel_size"]),
            gate_lower_bound=float(kda["gate_lower_bound"]), mla_heads=int(t["num_attention_heads"]),
            q_lora=t.get("q_lora_rank"), kv_lora=int(t["kv_lora_rank"]), nope=int(t["qk_nope_head_dim"]),
            rope=int(t["qk_rope_head_dim"]), v_dim=int(t["v_head_dim"]), experts=int(t["num_experts"]),
            top_k=int(t["num_experts_per_token"]), shared=int(t.get("num_shared_experts") or 0),
            expert_inter=int(t["moe_intermediate_size"]), latent=t.get("routed_expert_hidden_size"),
            dense_layers=dense, dense_inter=int(t["intermediate_size"]), block_size=int(t["attn_res_block_size"]),
            max_context=max_context, eps=float(t["rms_norm_eps"]),
            activation=activation, router=router, latent_norm=bool(t.get("latent_moe_use_norm", False)),
            expert_format=expert_format,  # type: ignore[arg-type]
            tie_embeddings=bool(t.get("tie_word_embeddings", top.get("tie_word_embeddings", False))))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{where}: inconsistent config values: {e}") from e
    if spec.mla_layers and t.get("mla_use_output_gate") is not True:
        raise _fail(where, pre + "mla_use_output_gate", "is not true: MLA without the sigmoid output gate is not "
                                                        "implemented (Kimi K3 sets it)")
    for variant, known in (("full", full_spec()), ("tiny", tiny_spec())):
        if spec.model_copy(update={"variant": variant}) == known:
            spec = known
    extras = {"layout": layout, "num_nextn_predict_layers": int(t.get("num_nextn_predict_layers", 0) or 0)}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        extras[k] = t.get(k, top.get(k))
    return spec, extras


def config_from_spec(spec: KimiK3Spec, *, layout: str = "kimi_k3", bos_token_id: int = 1, eos_token_id: int = 2,
                     pad_token_id: int = 0, torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json of ``spec`` with the official keys (``layout`` kimi_k3 or kimi_linear)."""
    if spec.tp != 1:
        raise CheckpointError("write the unsharded spec: checkpoints hold every rank's weights")
    kda = next(l.attention for l in spec.layers if l.attention.kind == "kda")
    mla = next(l.attention for l in spec.layers if l.attention.kind == "mla")
    moe = next(l.ffn for l in spec.layers if isinstance(l.ffn, MoESpec))
    dense = spec.dense_layers
    dense_inter = next((l.ffn.intermediate for l in spec.layers if l.ffn.kind == "dense"), moe.expert_intermediate)
    act = moe.activation
    text: dict[str, Any] = {
        "model_type": "kimi_linear",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size, "intermediate_size": dense_inter,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": mla.num_heads,
        "num_key_value_heads": mla.num_heads, "hidden_act": "situ" if act.kind == "situ_glu" else "silu",
        "rms_norm_eps": spec.norm.eps, "max_position_embeddings": spec.max_context,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
        "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim, "mla_use_nope": True,
        "mla_use_output_gate": mla.output_gate == "sigmoid",
        "num_experts": moe.num_experts, "num_experts_per_token": moe.top_k,
        "num_shared_experts": moe.num_shared_experts, "moe_intermediate_size": moe.expert_intermediate,
        "routed_expert_hidden_size": moe.latent_dim, "latent_moe_use_norm": spec.latent_moe_norm,
        "moe_renormalize": moe.router.renormalize, "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": moe.router.routed_scaling, "topk_method": "noaux_tc", "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": len(dense), "moe_layer_freq": 1,
        "attn_res_block_size": spec.attnres_block, "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "kda_layers": [i + 1 for i in spec.kda_layers], "full_attn_layers": [i + 1 for i in spec.mla_layers],
            "num_heads": kda.num_heads, "head_dim": kda.head_dim, "short_conv_kernel_size": kda.conv_kernel,
            "use_full_rank_gate": True, "gate_lower_bound": kda.gate_lower_bound,
        },
        "torch_dtype": torch_dtype,
    }
    if act.kind == "situ_glu":
        text["activation_situ_beta"] = act.beta
        text["activation_situ_linear_beta"] = act.beta_lin
    if tuple(range(len(dense))) != dense:
        raise CheckpointError(f"dense layers {dense} cannot be written as first_k_dense_replace: use the first layers")
    if spec.routed_expert_format == "mxfp4":
        text["quantization_config"] = {"quant_method": "mxfp4", "format": "mxfp4-pack-quantized",
                                       "config_groups": {"group_0": {"weights": {"group_size": 32, "num_bits": 4}}}}
    if layout == "kimi_linear":
        return {"architectures": [ARCH_TEXT], **text}
    if layout != "kimi_k3":
        raise CheckpointError(f"unknown checkpoint layout {layout!r}: use kimi_k3 or kimi_linear")
    return {"architectures": [ARCH_K3], "model_type": "kimi_k3", "text_config": text,
            "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
            "torch_dtype": torch_dtype}
