"""DeepSeek-V4.1-Flash config.json parsing: official layout (text_config flattened), warnings, errors, round trip."""

from __future__ import annotations

import copy
import warnings

import pytest

from latency_specialized.config_keys import UnknownConfigKeysWarning
from latency_specialized.errors import CheckpointError
from latency_specialized_models.deepseek_v41_flash.config import config_from_spec, full_config, spec_from_config
from latency_specialized_models.deepseek_v41_flash.spec import full_spec, tiny_spec


def test_full_config_is_the_full_spec():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert spec_from_config(full_config()) == full_spec()


@pytest.mark.parametrize("make", [full_spec, tiny_spec])
def test_round_trip(make):
    spec = make()
    assert spec_from_config(config_from_spec(spec), variant=spec.variant) == spec
    assert spec_from_config(config_from_spec(spec.shard(2)), variant=spec.variant) == spec


def test_text_fields_may_sit_at_top_level_and_must_agree():
    cfg = full_config()
    flat = {**{k: v for k, v in cfg.items() if k != "text_config"}, **cfg["text_config"]}
    assert spec_from_config(flat) == full_spec()
    both = copy.deepcopy(cfg)
    both["hidden_size"] = 4096
    with pytest.raises(CheckpointError, match="hidden_size"):
        spec_from_config(both)


def test_unknown_keys_warned_once_sorted():
    cfg = full_config()
    cfg["text_config"]["zz_new"] = 1
    cfg["aa_vendor"] = 2
    with pytest.warns(UnknownConfigKeysWarning) as rec:
        spec_from_config(cfg)
    assert len(rec) == 1 and "aa_vendor, text_config.zz_new" in str(rec[0].message)


@pytest.mark.parametrize("key", ["hidden_size", "compress_ratios", "hc_eps", "kv_source_layer_ids", "index_topk"])
def test_missing_key_is_named(key):
    cfg = full_config()
    del cfg["text_config"][key]
    with pytest.raises(CheckpointError, match=key):
        spec_from_config(cfg)


@pytest.mark.parametrize("key,value", [("scoring_func", "sigmoid"), ("expert_dtype", "fp8"), ("num_hash_layers", 3),
                                       ("compress_ratios", [4] * 40)])
def test_unimplemented_values_are_named(key, value):
    cfg = full_config()
    cfg["text_config"][key] = value
    with pytest.raises(CheckpointError, match=key):
        spec_from_config(cfg)


def test_bad_topology_names_the_file():
    cfg = full_config()
    cfg["text_config"]["index_source_layer_ids"] = [8, 14]   # layers 2..7 have no indexer below them
    with pytest.raises(CheckpointError, match="where.json"):
        spec_from_config(cfg, where="where.json")


def test_other_block_size_refused():
    cfg = full_config()
    cfg["quantization_config"]["weight_block_size"] = [128, 128]
    with pytest.raises(CheckpointError, match="weight_block_size"):
        spec_from_config(cfg)


def test_tiny_has_every_feature_and_shards():
    t = tiny_spec()
    assert set(t.compress_ratios()) == {0, 1, 2} and not t.engram.layers and t.residual.streams == 4  # Engram: refused
    assert set(t.index_source_layers) - set(t.kv_source_layers)     # an indexer reusing another's K cache
    assert any(t.index_source_for(i) != i for i, r in enumerate(t.compress_ratios()) if r)   # top-k reuse
    moe = t.layers[0].ffn
    assert moe.num_shared_experts == 1 and moe.activation.clamp == 10.0
    for tp in (1, 2, 8):
        assert t.shard(tp).full() == t
