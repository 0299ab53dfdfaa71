"""DeepSeek-V4.1-Flash ``config.json`` <-> :class:`DeepseekV41Spec`, with the official keys. Layout (vLLM 0.33
``transformers_utils/configs/deepseek_v41.py``): ``{"model_type": "deepseek_v41", "architectures": [...], "text_config":
{...}, "vision_config": {...}, "quantization_config": {...}}``; vLLM flattens ``text_config`` onto the top level, and so
do we (a key at both levels must agree). Text keys are those the vLLM model reads (``compress_ratios`` one per layer,
draft layers may follow; ``kv_source_layer_ids``, ``index_source_layer_ids``, ``candidate_*``, ``hc_*``, ``engram_*``,
``dspark_*``). Keys vLLM reads without a default are required. Unknown keys: one warning; missing / contradictory /
unimplemented: CheckpointError."""

from __future__ import annotations

from typing import Any, Mapping

from latency_specialized.config_keys import ConfigKeys
from latency_specialized.errors import CheckpointError

from latency_specialized_models.deepseek_v41_flash.spec import (
    NAME, DeepseekV41Spec, DraftSpec, EngramSpec, RopeSpec, build_spec)

ARCHS = ("DeepseekV41ForCausalLM", "DeepseekV41ForConditionalGeneration")
MODEL_TYPE = "deepseek_v41"
TOP = {"architectures", "model_type", "text_config", "vision_config", "quantization_config", "torch_dtype", "dtype",
       "transformers_version", "auto_map", "_name_or_path", "bos_token_id", "eos_token_id", "pad_token_id",
       "tie_word_embeddings", "image_token_id", "use_cache", "initializer_range"}
REQUIRED = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "head_dim", "qk_rope_head_dim",
            "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "compress_ratios", "n_routed_experts",
            "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "routed_scaling_factor",
            "swiglu_limit", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps", "rope_theta",
            "max_position_embeddings")
COMPRESSED = ("kv_source_layer_ids", "index_source_layer_ids", "index_n_heads", "index_head_dim", "index_topk",
              "compress_rope_theta")
ENGRAM = ("engram_num_embeddings", "engram_max_ngram_size", "engram_n_heads", "engram_head_dim")
OPTIONAL = ("candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size", "engram_layer_ids",
            "engram_vocab_size", "engram_pad_token_id", "engram_compressed_vocab_size", "num_nextn_predict_layers",
            "dspark_block_size", "dspark_n_routed_experts", "dspark_num_experts_per_tok", "dspark_target_layer_ids",
            "scoring_func", "norm_topk_prob", "expert_dtype", "rope_scaling", "rope_parameters", "topk_method",
            "hidden_act", "num_hash_layers", "num_key_value_heads", "index_score_func")
TEXT = {*REQUIRED, *COMPRESSED, *ENGRAM, *OPTIONAL, *TOP} - {"text_config", "vision_config"}
NOT_IMPLEMENTED = {"scoring_func": ("sqrtsoftplus", "only the sqrtsoftplus router"),
                   "norm_topk_prob": (True, "only renormalised top-k weights"),
                   "expert_dtype": ("fp4", "only FP4 routed experts (FP8 experts are DeepSeek-V4-Flash-Base)"),
                   "num_hash_layers": (0, "hash-routed MoE layers (DeepSeek-V4) are not implemented"),
                   "hidden_act": ("silu", "only SwiGLU experts")}

def _flatten(cfg: Mapping[str, Any], keys: ConfigKeys) -> dict[str, Any]:
    keys.section(cfg, TOP | (set() if "text_config" in cfg else TEXT))
    text = dict(keys.section(cfg.get("text_config") or {}, TEXT, prefix="text_config."))
    for k, v in cfg.items():
        if k in ("text_config", "vision_config"):
            continue
        if k in text and text[k] != v and k in TEXT - TOP:
            raise CheckpointError(f"{keys.where}: config keys {k} = {v!r} and text_config.{k} = {text[k]!r} "
                                  "contradict each other: they are one setting; make them equal or remove one")
        text.setdefault(k, v)
    return text


def _rope(t: Mapping[str, Any], keys: ConfigKeys) -> tuple[float, int]:
    """(YaRN factor, original context) of ``rope_scaling`` / ``rope_parameters`` (nested ``compress`` dict:
    the compressed layers' one, as vLLM's ``build_deepseek_v4_rope`` takes)."""
    r = keys.pick(t, "rope_scaling", "rope_parameters", default={})
    if isinstance(r.get("compress"), Mapping):
        r = r["compress"]
    kind = r.get("rope_type", r.get("type", "default"))
    if kind not in ("default", "yarn", "deepseek_yarn"):
        raise CheckpointError(f"{keys.where}: config key rope_scaling.rope_type = {kind!r}: only YaRN is implemented")
    return float(r.get("factor", 1.0)), int(r.get("original_max_position_embeddings", t["max_position_embeddings"]))


def spec_from_config(cfg: Mapping[str, Any], *, where: str = "config.json", variant: str = "full") -> DeepseekV41Spec:
    """The spec of an official DeepSeek-V4.1 ``config.json`` (text fields under ``text_config``, flattened)."""
    keys = ConfigKeys(where=where, model=NAME)
    if cfg.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise CheckpointError(f"{where}: config key model_type = {cfg['model_type']!r}: not a DeepSeek-V4.1 config "
                              f"(expected {MODEL_TYPE!r})")
    t = _flatten(cfg, keys)
    q = t.get("quantization_config") or {}
    for key, (ok, why) in NOT_IMPLEMENTED.items():
        value = t.get(key, q.get(key, ok) if key == "expert_dtype" else ok)
        if value != ok:
            raise CheckpointError(f"{where}: config key {key} = {value!r}: {why}")
    if q.get("weight_block_size", [32, 32]) != [32, 32]:
        raise CheckpointError(f"{where}: config key quantization_config.weight_block_size = "
                              f"{q['weight_block_size']!r}: only 32x32 FP8 blocks (ue8m0 scales) are implemented")
    keys.require(t, REQUIRED)
    n, ratios = int(t["num_hidden_layers"]), tuple(int(r) for r in t["compress_ratios"])
    if len(ratios) < n or any(r not in (0, 1, 2) for r in ratios):
        raise CheckpointError(f"{where}: config key compress_ratios = {list(ratios)}: give one of 0 / 1 / 2 per "
                              f"layer ({n} layers; draft layers may follow)")
    if any(ratios[:n]):
        keys.require(t, COMPRESSED, why="the compressed layers (compress_ratios > 0) need them")
    engram_layers = tuple(t.get("engram_layer_ids") or ())
    if engram_layers:
        keys.require(t, ENGRAM, why="the Engram layers (engram_layer_ids) need them")
    yarn, original = _rope(t, keys)
    g = t.get
    gi = lambda k, d=0: int(g(k) or d)  # noqa: E731
    keys.warn(stacklevel=2)
    try:
        return build_spec(
            variant=variant, hidden=int(t["hidden_size"]), vocab=int(t["vocab_size"]), ratios=ratios[:n],
            heads=int(t["num_attention_heads"]), head_dim=int(t["head_dim"]), rope_dim=int(t["qk_rope_head_dim"]),
            q_lora=int(t["q_lora_rank"]), o_groups=int(t["o_groups"]), o_lora=int(t["o_lora_rank"]),
            window=int(t["sliding_window"]), kv_sources=tuple(g("kv_source_layer_ids") or ()),
            index_sources=tuple(g("index_source_layer_ids") or ()), idx_heads=int(g("index_n_heads") or 0),
            idx_dim=int(g("index_head_dim") or 0), idx_topk=int(g("index_topk") or 0),
            candidate_layer=int(g("candidate_source_layer_id", -1)), candidate_blocks=int(g("candidate_topk_blocks", 0)),
            candidate_block=int(g("candidate_block_size", 0)), experts=int(t["n_routed_experts"]),
            top_k=int(t["num_experts_per_tok"]), shared=int(t["n_shared_experts"]),
            expert_inter=int(t["moe_intermediate_size"]),
            engram=EngramSpec(layers=engram_layers, num_embeddings=tuple(g("engram_num_embeddings") or ()),
                              max_ngram=gi("engram_max_ngram_size", 2), n_heads=gi("engram_n_heads"),
                              head_dim=gi("engram_head_dim")),
            draft=DraftSpec(num_layers=gi("num_nextn_predict_layers"), block_size=gi("dspark_block_size"),
                            num_speculative_tokens=gi("dspark_block_size"),  # MODELS.md: = block 5
                            num_experts=gi("dspark_n_routed_experts"), top_k=gi("dspark_num_experts_per_tok"),
                            target_layers=tuple(g("dspark_target_layer_ids") or ())),
            max_context=int(t["max_position_embeddings"]),
            rope=RopeSpec(theta=float(t["rope_theta"]), compress_theta=float(g("compress_rope_theta") or t["rope_theta"]),
                          yarn_factor=yarn, original_context=original),
            norm_eps=float(t["rms_norm_eps"]), routed_scaling=float(t["routed_scaling_factor"]),
            swiglu_clamp=float(t["swiglu_limit"]), hc_mult=int(t["hc_mult"]), hc_iters=int(t["hc_sinkhorn_iters"]),
            hc_eps=float(t["hc_eps"]))
    except ValueError as e:  # the spec's own topology checks: name the file
        raise CheckpointError(f"{where}: inconsistent DeepSeek-V4.1 config: {e}") from None


def config_from_spec(spec: DeepseekV41Spec, dtype: str = "bfloat16") -> dict[str, Any]:
    """The official ``config.json`` of ``spec`` (``spec_from_config`` of it gives ``spec`` back)."""
    s = spec.full()
    a, moe = s.layers[0].attention, s.layers[0].ffn
    idx = next((l.attention.indexer for l in s.layers if l.attention.indexer is not None), None)  # type: ignore
    e, d, r = s.engram, s.draft, s.rope
    text = dict(
        hidden_size=s.hidden_size, num_hidden_layers=s.num_layers, vocab_size=s.vocab_size,
        num_attention_heads=a.num_heads, head_dim=a.head_dim, qk_rope_head_dim=a.rope_dim, q_lora_rank=a.q_lora_rank,
        o_groups=a.o_groups, o_lora_rank=a.o_lora_rank, sliding_window=a.sliding_window,
        compress_ratios=list(s.compress_ratios()), kv_source_layer_ids=list(s.kv_source_layers),
        index_source_layer_ids=list(s.index_source_layers), index_n_heads=idx.num_heads if idx else 0,
        index_head_dim=idx.head_dim if idx else 0, index_topk=s.index_topk,
        candidate_source_layer_id=s.candidate_source_layer, candidate_topk_blocks=s.candidate_topk_blocks,
        candidate_block_size=s.candidate_block_size, n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k, n_shared_experts=moe.num_shared_experts,
        moe_intermediate_size=moe.expert_intermediate, routed_scaling_factor=moe.router.routed_scaling,
        swiglu_limit=moe.activation.clamp, scoring_func="sqrtsoftplus", norm_topk_prob=True,
        hc_mult=s.residual.streams, hc_sinkhorn_iters=s.residual.sinkhorn_iters, hc_eps=s.hyper.eps,
        rms_norm_eps=s.norm.eps, rope_theta=r.theta, compress_rope_theta=r.compress_theta,
        rope_scaling=dict(rope_type="yarn", factor=r.yarn_factor, original_max_position_embeddings=r.original_context),
        max_position_embeddings=s.max_context, engram_layer_ids=list(e.layers),
        engram_num_embeddings=list(e.num_embeddings), engram_max_ngram_size=e.max_ngram, engram_n_heads=e.n_heads,
        engram_head_dim=e.head_dim, num_nextn_predict_layers=d.num_layers, dspark_block_size=d.block_size,
        dspark_n_routed_experts=d.num_experts, dspark_num_experts_per_tok=d.top_k,
        dspark_target_layer_ids=list(d.target_layers))
    return dict(architectures=[ARCHS[0]], model_type=MODEL_TYPE, torch_dtype=dtype, text_config=text,
                quantization_config=dict(quant_method="fp8", fmt="e4m3", scale_fmt="ue8m0",
                                         weight_block_size=[32, 32], expert_dtype="fp4"))


def full_config() -> dict[str, Any]:
    """The released model's config.json (decode-relevant keys; numbers from spec.full_spec)."""
    from latency_specialized_models.deepseek_v41_flash.spec import full_spec
    return config_from_spec(full_spec())


__all__ = ["config_from_spec", "full_config", "spec_from_config"]
