"""Muse Spark spec, config.json parsing and tensor names (no transformers needed)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from latency_specialized.config_keys import UnknownConfigKeysWarning
from latency_specialized.errors import CheckpointError
from latency_specialized.runtime.checkpoint import save_checkpoint
from latency_specialized.spec import DenseMLPSpec, MoESpec
from latency_specialized_models.muse_spark import names
from latency_specialized_models.muse_spark.config import config_from_spec, spec_from_config
from latency_specialized_models.muse_spark.reference import MuseSparkReference
from latency_specialized_models.muse_spark.spec import QK_SCALE_FACTOR, full_spec, tiny_spec

# The required keys of a text config; everything else takes MuseSparkTextConfig's defaults.
MINIMAL = {"model_type": "muse_spark_text", "vocab_size": 202048, "hidden_size": 8192, "num_hidden_layers": 62,
           "num_attention_heads": 128, "num_key_value_heads": 16, "head_dim": 64, "rms_norm_eps": 1e-5,
           "num_local_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 4096, "moe_hidden_size": 4096}


def parse(cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownConfigKeysWarning)
        return spec_from_config(cfg, where="ck/config.json")


@pytest.mark.parametrize("spec", [tiny_spec(), full_spec()], ids=["tiny", "full"])
def test_config_round_trips(spec):
    cfg = config_from_spec(spec, torch.float32)
    assert cfg["architectures"] == ["MuseSparkForConditionalGeneration"] and cfg["model_type"] == "muse_spark"
    assert cfg["dtype"] == "float32" and cfg["audio_config"]["out_hidden_size"] == spec.hidden_size
    assert parse(cfg) == spec
    assert parse({**cfg["text_config"]}) == spec   # text-only layout


def test_defaults_give_the_released_model_and_the_pattern_counts_from_the_back():
    s = parse(MINIMAL)
    assert s == full_spec()
    assert s.full_attention_layers() == s.nope_layers() == tuple(range(1, 62, 4)) and len(s.window_layers()) == 46
    assert s.qk_scale_factor == QK_SCALE_FACTOR == 5.4730064863875
    assert s.layers[0].attention.softmax_scale == 5.4730064863875 / math.sqrt(64)
    assert s.logits.scale == s.layers[0].ffn.router.logit_scale == 0.1767766952966369
    eight = parse({**MINIMAL, "num_hidden_layers": 8})
    assert eight.full_attention_layers() == eight.nope_layers() == (3, 7)
    assert tiny_spec().full_attention_layers() == (3, 7)


def test_explicit_layer_lists_override_the_pattern():
    cfg = {**MINIMAL, "num_hidden_layers": 4, "sliding_window": 128,
           "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"],
           "layer_rope_theta": [0, 5e5, 0, 5e5], "mlp_layer_types": ["dense", "sparse", "sparse", "dense"],
           "intermediate_size": 1024, "qk_scale_factor": 3.25}
    s = parse(cfg)
    assert s.full_attention_layers() == (0,) and s.nope_layers() == (0, 2)
    assert s.layers[2].attention.sliding_window == 128 and s.layers[1].attention.rope_theta == 5e5
    assert s.dense_layers() == (0, 3)
    assert isinstance(s.layers[0].ffn, DenseMLPSpec) and s.layers[0].ffn.intermediate == 1024
    assert isinstance(s.layers[1].ffn, MoESpec)
    assert s.qk_scale_factor == 3.25 and s.layers[0].attention.softmax_scale == 3.25 / 8
    exp = names.expected_tensors(s)
    assert exp["model.language_model.layers.0.mlp.down_proj.weight"] == ((8192, 1024), "act")
    assert "model.language_model.layers.0.mlp.gate.weight" not in exp
    assert parse(config_from_spec(s)) == s


def test_unknown_keys_are_named_in_one_warning():
    cfg = config_from_spec(tiny_spec())
    cfg["vendor_note"] = "x"
    cfg["text_config"]["fancy_flag"] = True
    with pytest.warns(UnknownConfigKeysWarning) as got:
        assert spec_from_config(cfg, where="ck/config.json") == tiny_spec()
    assert len(got) == 1 and "text_config.fancy_flag, vendor_note" in str(got[0].message)


@pytest.mark.parametrize("drop, layout", [("head_dim", "muse_spark"), ("num_local_experts", "muse_spark_text")])
def test_missing_key_is_an_error_naming_it(drop, layout):
    cfg = config_from_spec(tiny_spec())
    cfg = cfg if layout == "muse_spark" else cfg["text_config"]
    t = cfg["text_config"] if layout == "muse_spark" else cfg
    del t[drop]
    key = ("text_config." if layout == "muse_spark" else "") + drop
    with pytest.raises(CheckpointError, match=rf"ck/config.json: config key {key} is missing"):
        parse(cfg)


@pytest.mark.parametrize("change, match", [
    ({"rope_theta": 1e4}, r"rope_parameters.rope_theta = 500000.0 and .*legacy = 10000.0 contradict"),
    ({"layer_rope_theta": [1e4] * 8}, r"layer_rope_theta\[0\] = 10000.0 differs"),
    ({"layer_types": ["full_attention"] * 7}, r"layer_types .* per layer \(8 layers\)"),
    ({"mlp_layer_types": ["moe"] * 8}, r"mlp_layer_types"),
    ({"hidden_act": "gelu"}, r"hidden_act = 'gelu' is not implemented"),
    ({"num_shared_experts": 1}, r"num_shared_experts = 1"),
    ({"model_type": "llama"}, r"text_config.model_type is 'llama'"),
])
def test_contradictory_or_unimplemented_values_fail(change, match):
    cfg = config_from_spec(tiny_spec())
    cfg["text_config"].update(change)
    with pytest.raises(CheckpointError, match=match):
        parse(cfg)
    with pytest.raises(CheckpointError, match="model_type is 'gpt2'"):
        parse({**MINIMAL, "model_type": "gpt2"})


def test_spec_facts_and_sharding():
    s = full_spec()
    assert (s.norm.eps, s.norm.zero_centered, s.post_norm.eps) == (1e-5, True, 1e-8)
    assert (s.post_attn_norm, s.post_ffn_norm, s.final_norm.zero_centered) == ("weightless", "input_scaled", False)
    assert s.attn_output_norm and s.latent_pre_norm and s.latent_post_norm and s.embed_norm
    assert (s.residual_gate.temperature, s.residual_gate.floor, s.logits.softcap) == (0.3, 1e-3, 20.0)
    assert s.dense_layers() == () and tiny_spec().dense_layers() == ()
    for tp in (1, 2, 4, 8):
        assert tiny_spec().shard(tp).tp == tp
    for tp in (1, 2, 4, 8, 16):
        assert full_spec().shard(tp).qk_scale_factor == QK_SCALE_FACTOR


def test_canonical_names_and_kinds():
    exp = names.expected_tensors(full_spec())
    L = "model.language_model.layers.61."
    assert exp[L + "mlp.experts.gate_up_proj"] == ((256, 8192, 4096), "act")
    assert exp[L + "mlp.experts.down_proj"] == ((256, 4096, 4096), "act")
    assert exp[L + "self_attn.gate_proj.weight"] == ((8192, 8192), "act")
    assert exp[L + "self_attn.k_proj.weight"] == ((1024, 8192), "act")
    fp32 = {n for n, (_, k) in exp.items() if k == "float32"}
    assert fp32 == {f"model.language_model.layers.{i}.{s}" for i in range(62) for s in (
        "mlp.gate.weight", "mlp.gate.e_score_correction_bias", "post_attention_residual_gate.gate",
        "post_feedforward_residual_gate.gate")}
    assert {"lm_head.weight", f"{names.PREFIX}embed_tokens.weight", f"{names.PREFIX}norm.weight"} <= set(exp)
    assert len(exp) == 3 + 62 * 18   # 5 attention projections, 3 norms, 2 gates, 8 MoE tensors a layer


def test_random_weights_save_load_and_layouts(tmp_path):
    spec = tiny_spec()
    w = names.random_weights(spec, seed=1, dtype=torch.bfloat16)
    assert list(w) == list(names.expected_tensors(spec))
    gate = w["model.language_model.layers.0.post_attention_residual_gate.gate"]
    assert gate.dtype == torch.float32 and 0.3 < gate.std() < 0.7
    assert w["model.language_model.layers.0.input_layernorm.weight"].abs().mean() < 0.2   # (1 + w): near neutral
    assert torch.equal(names.random_weights(spec, seed=1, dtype=torch.bfloat16)["lm_head.weight"], w["lm_head.weight"])
    names.save(tmp_path / "ck", spec, w, torch.bfloat16)
    spec2, named, cfg = names.load(tmp_path / "ck", torch.bfloat16)
    assert spec2 == spec and cfg["model_type"] == "muse_spark"
    assert all(torch.equal(named[n], t) and named[n].dtype == t.dtype for n, t in w.items())
    save_checkpoint(tmp_path / "bad", {"transformer.wte.weight": torch.zeros(2)}, config_from_spec(spec))
    with pytest.raises(CheckpointError, match="no Muse Spark text tensors: expected one of model.language_model.emb"):
        names.load(tmp_path / "bad")
    cfg["text_config"]["num_hidden_layers"] = 6
    cfg["text_config"] = {k: v for k, v in cfg["text_config"].items()
                          if k not in ("layer_types", "layer_rope_theta", "mlp_layer_types")}
    (tmp_path / "ck" / "config.json").write_text(__import__("json").dumps(cfg))
    with pytest.raises(CheckpointError, match="not in this config's 6-layer text model"):
        names.load(tmp_path / "ck", torch.bfloat16)


def test_reference_chunks_and_decode_agree_with_one_prefill():
    spec = tiny_spec()
    ref = MuseSparkReference(spec, names.random_weights(spec, seed=2, dtype=torch.float32))
    ids = torch.randint(0, spec.vocab_size, (21,), generator=torch.Generator().manual_seed(0))
    c = ref.new_cache(3, 24, block_size=4, shuffle_seed=5)
    whole = ref.prefill(c, c.slots[0], 0, ids)
    assert whole.shape == (21, spec.vocab_size) and whole.abs().max() < spec.logits.softcap
    k = c.layer(3)["k"]
    assert k.shape[1:] == (4, 8, 16)
    parts = [ref.prefill(c, c.slots[1], 0, ids[:9]), ref.prefill(c, c.slots[1], 9, ids[9:20])]
    ref.prefill(c, c.slots[2], 0, ids[:17])
    dec = ref.decode(c, [c.slots[1], c.slots[2]], [20, 17], torch.stack([ids[20], ids[17]]))
    scale = whole.abs().max()
    assert ((torch.cat(parts) - whole[:20]).abs().max() / scale) < 1e-3
    assert ((dec - whole[[20, 17]]).abs().max() / scale) < 1e-3
