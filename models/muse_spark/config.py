"""Muse Spark ``config.json`` <-> :class:`MuseSparkSpec`, with transformers 5.24's keys. Layouts: ``muse_spark``
(``MuseSparkConfig``: text keys under ``text_config``; vision / audio configs unread) and ``muse_spark_text`` (top
level). Absent keys take ``MuseSparkTextConfig``'s defaults (``layer_types`` / ``layer_rope_theta``: full NoPE where
(L - 1 - i) % 4 == 0; ``mlp_layer_types``: all sparse), except the shapes of ``_REQUIRED``. Unknown keys are named
in one warning; missing, contradictory or unimplemented values raise CheckpointError naming the key."""

from __future__ import annotations

from typing import Any

import torch

from latency_specialized.config_keys import ConfigKeys
from latency_specialized.errors import CheckpointError
from latency_specialized.spec import MoESpec

from latency_specialized_models.muse_spark.spec import (OUTPUT_MULTIPLIER, QK_SCALE_FACTOR, ROPE_THETA, MuseSparkSpec,
                                                        build_spec, full_spec, tiny_spec)

ARCH = "MuseSparkForConditionalGeneration"
_COMMON = {"architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "_name_or_path", "model_type",
           "use_cache", "initializer_range", "quantization_config", "output_router_logits", "pad_token_id",
           "bos_token_id", "eos_token_id", "tie_word_embeddings", "attention_dropout"}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "rms_norm_eps", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
             "moe_hidden_size")
_TEXT_KEYS = _COMMON | set(_REQUIRED) | {
    "intermediate_size", "max_position_embeddings", "rope_parameters", "rope_theta", "attention_bias",
    "sliding_window", "layer_types", "final_logit_softcapping", "qk_scale_factor", "output_multiplier",
    "post_norm_eps", "layer_rope_theta", "hidden_act", "routed_scaling_factor", "mlp_layer_types",
    "residual_gate_temperature", "num_shared_experts"}
_TOP_KEYS = _COMMON | {"text_config", "vision_config", "audio_config", "image_token_id", "video_token_id",
                       "audio_token_id", "out_hidden_size", "projector_hidden_size", "projector_hidden_act"}
# Tiny towers, so that transformers' MuseSparkConfig loads what config_from_spec writes (the decoder ignores them).
_VISION = {"model_type": "muse_spark_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 2, "pos_emb_height": 4, "pos_emb_width": 4, "merge_size": 2}
_AUDIO = {"model_type": "muse_spark_audio", "hidden_sizes": [8, 16], "patch_sizes": [2, 2], "depths": [1, 1]}


def spec_from_config(cfg: dict[str, Any], *, where: str = "config.json") -> MuseSparkSpec:
    """The spec of a parsed config.json of either layout; ``where`` (the file) starts every message."""
    keys, mt = ConfigKeys(where, "Muse Spark"), cfg.get("model_type")
    if mt == "muse_spark":
        keys.section(cfg, _TOP_KEYS)
        t, pre = cfg.get("text_config"), "text_config."
        got = t.get("model_type", "muse_spark_text") if isinstance(t, dict) else f"{type(t).__name__} {t!r}"
        if got != "muse_spark_text":
            raise CheckpointError(f"{where}: config key text_config.model_type is {got!r}: a muse_spark config nests "
                                  "a muse_spark_text object there")
    elif mt == "muse_spark_text":
        t, pre = cfg, ""
    else:
        raise CheckpointError(f"{where}: config key model_type is {mt!r}: not Muse Spark (expected 'muse_spark', or "
                              "'muse_spark_text' for the text model)")
    rope = t.get("rope_parameters") or {}
    keys.section(t, _TEXT_KEYS, pre)
    keys.section(rope, {"rope_type", "rope_theta"}, pre + "rope_parameters.")
    keys.warn()
    keys.require(t, _REQUIRED, pre)

    def fail(key: str, why: str) -> CheckpointError:
        return CheckpointError(f"{where}: config key {pre}{key} {why}")

    for key, ok, why in (("hidden_act", t.get("hidden_act", "silu") == "silu", "SiLU-gated experts"),
                         ("attention_bias", not t.get("attention_bias"), "no attention bias"),
                         ("num_shared_experts", not t.get("num_shared_experts"), "no shared experts"),
                         ("tie_word_embeddings", not t.get("tie_word_embeddings", cfg.get("tie_word_embeddings")),
                          "an untied lm_head"),
                         ("rope_parameters", rope.get("rope_type", "default") == "default", "rope_type default")):
        if not ok:
            raise fail(key, f"= {t.get(key)!r} is not implemented: Muse Spark has {why}")
    theta = float(keys.pick({**rope, "legacy": t.get("rope_theta")}, "rope_theta", "legacy",
                            prefix=pre + "rope_parameters.", default=ROPE_THETA))
    L = int(t["num_hidden_layers"])

    def per_layer(key: str, allowed: set | None = None) -> list | None:
        v = t.get(key)
        if v is not None and (not isinstance(v, list) or len(v) != L or (allowed and not set(v) <= allowed)):
            raise fail(key, f"= {v!r} must list one value{f' of {sorted(allowed)}' if allowed else ''} per layer "
                            f"({L} layers)")
        return v

    types = per_layer("layer_types", {"full_attention", "sliding_attention"})
    thetas, mlp = per_layer("layer_rope_theta"), per_layer("mlp_layer_types", {"sparse", "dense"})
    for i, th in enumerate(thetas or ()):
        if th and float(th) != theta:
            raise fail(f"layer_rope_theta[{i}]", f"= {th} differs from {pre}rope_parameters.rope_theta = {theta}: "
                       "per-layer RoPE bases are not implemented (transformers 5.24 rotates by the global one)")
    full = None if types is None else [i for i, k in enumerate(types) if k == "full_attention"]
    window = t.get("sliding_window", 2048)
    if not (isinstance(window, int) and window > 0) and not (full is not None and len(full) == L):
        raise fail("sliding_window", f"= {window!r} must be a positive integer: the sliding layers need a window")
    try:
        spec = build_spec(
            variant="custom", hidden=int(t["hidden_size"]), vocab=int(t["vocab_size"]), num_layers=L,
            heads=int(t["num_attention_heads"]), kv_heads=int(t["num_key_value_heads"]), head_dim=int(t["head_dim"]),
            window=int(window or 1), experts=int(t["num_local_experts"]), top_k=int(t["num_experts_per_tok"]),
            latent=int(t["moe_hidden_size"]), expert_inter=int(t["moe_intermediate_size"]),
            max_context=int(t.get("max_position_embeddings", 1_048_576)), full_layers=full,
            nope_layers=None if thetas is None else [i for i, th in enumerate(thetas) if not th],
            dense_layers=[i for i, k in enumerate(mlp or ()) if k == "dense"],
            dense_inter=int(t.get("intermediate_size", 16384)), rope_theta=theta,
            qk_scale_factor=float(t.get("qk_scale_factor", QK_SCALE_FACTOR)),
            output_multiplier=float(t.get("output_multiplier", OUTPUT_MULTIPLIER)),
            softcap=float(t.get("final_logit_softcapping", 20.0)), eps=float(t["rms_norm_eps"]),
            post_eps=float(t.get("post_norm_eps", 1e-8)), routed_scaling=float(t.get("routed_scaling_factor", 1.0)),
            gate_temperature=float(t.get("residual_gate_temperature", 0.3)))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{where}: inconsistent config values: {e}") from e
    return next((k for k in (full_spec(), tiny_spec()) if spec.model_copy(update={"variant": k.variant}) == k), spec)


def config_from_spec(spec: MuseSparkSpec, dtype: str | torch.dtype = "bfloat16") -> dict[str, Any]:
    """A ``muse_spark`` config.json of ``spec`` that transformers 5.24's ``MuseSparkConfig`` loads
    (``architectures: [MuseSparkForConditionalGeneration]``, tiny vision / audio towers)."""
    attn = [l.attention for l in spec.layers]
    moe = next((l.ffn for l in spec.layers if isinstance(l.ffn, MoESpec)), None)
    windows, thetas = {a.sliding_window for a in attn} - {None}, {a.rope_theta for a in attn} - {None}
    if spec.tp != 1 or moe is None or len(windows) > 1 or len(thetas) > 1:
        raise CheckpointError("config_from_spec needs the unsharded spec, a latent MoE layer, one window and one "
                              f"RoPE base (got TP {spec.tp}, windows {windows}, bases {thetas})")
    a, theta, big = attn[0], thetas.pop() if thetas else ROPE_THETA, spec.vocab_size > 200_001
    text = {
        "model_type": "muse_spark_text", "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": next((l.ffn.intermediate for l in spec.layers if l.ffn.kind == "dense"),  # type: ignore
                                  2 * spec.hidden_size),
        "num_hidden_layers": spec.num_layers, "num_attention_heads": a.num_heads,  # type: ignore[union-attr]
        "num_key_value_heads": a.num_kv_heads, "head_dim": a.head_dim,  # type: ignore[union-attr]
        "max_position_embeddings": spec.max_context, "rms_norm_eps": spec.norm.eps, "post_norm_eps": spec.post_norm.eps,
        "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False, "sliding_window": windows.pop() if windows else 2048,
        "layer_types": ["full_attention" if x.sliding_window is None else "sliding_attention" for x in attn],
        "layer_rope_theta": [0 if x.rope_theta is None else theta for x in attn],
        "mlp_layer_types": ["dense" if l.ffn.kind == "dense" else "sparse" for l in spec.layers],
        "qk_scale_factor": spec.qk_scale_factor, "output_multiplier": spec.logits.scale,
        "final_logit_softcapping": spec.logits.softcap, "hidden_act": "silu",
        "moe_intermediate_size": moe.expert_intermediate, "moe_hidden_size": moe.latent_dim,
        "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "routed_scaling_factor": moe.router.routed_scaling, "residual_gate_temperature": spec.residual_gate.temperature,
        # the released special tokens exist only in the full vocabulary
        "bos_token_id": 200_000 if big else None, "eos_token_id": 200_001 if big else None, "pad_token_id": None}
    return {"architectures": [ARCH], "model_type": "muse_spark", "dtype": str(dtype).removeprefix("torch."),
            "text_config": text, "vision_config": dict(_VISION), "projector_hidden_size": 32,
            "audio_config": {**_AUDIO, "num_hidden_layers": 2, "out_hidden_size": spec.hidden_size},
            "out_hidden_size": _VISION["hidden_size"] * _VISION["merge_size"] ** 2}
