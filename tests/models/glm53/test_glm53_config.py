"""GLM-5.3 spec and config.json: the tiny spec's features and shards, unknown keys warned once, missing and
contradictory keys named, config_from_spec -> transformers' GlmMoeDsaConfig -> spec_from_config round trips."""

from __future__ import annotations

import json
import warnings

import pytest

from latency_specialized.config_keys import UnknownConfigKeysWarning
from latency_specialized.errors import CheckpointError
from latency_specialized_models.glm53.config import config_from_spec, spec_from_config
from latency_specialized_models.glm53.spec import full_spec, tiny_spec


def _same(a, b):
    assert a.model_copy(update={"weights": b.weights}) == b


def test_tiny_has_every_feature_and_shards():
    t = tiny_spec()
    assert t.dense_layers() == (0, 1, 2) and t.shared_indexer_layers() == (3, 4, 5, 7) and t.mtp.num_layers == 1
    assert t.layers[0].attention.indexer.topk < 24
    for tp in (1, 2, 4, 8):
        s = t.shard(tp)
        assert s.tp == tp and s.full() is t and s.layers[0].attention.num_heads == 8 // tp


@pytest.mark.parametrize("make", [tiny_spec, full_spec])
def test_round_trip_through_transformers(make, tmp_path):
    transformers = pytest.importorskip("transformers")
    spec = make()
    cfg = config_from_spec(spec)
    hf = transformers.GlmMoeDsaConfig(**cfg)
    assert hf.indexer_types == cfg["indexer_types"] and hf.mlp_layer_types == cfg["mlp_layer_types"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownConfigKeysWarning)
        _same(spec_from_config(cfg, variant=spec.variant), spec)
        hf.save_pretrained(tmp_path)   # what transformers writes back
        _same(spec_from_config(json.loads((tmp_path / "config.json").read_text()), variant=spec.variant), spec)


def test_context_and_rope_base_come_from_the_config():
    cfg = config_from_spec(tiny_spec())
    s = spec_from_config(dict(cfg, max_position_embeddings=777, rope_parameters=None, rope_theta=123.0))
    assert s.max_context == 777 and s.layers[0].attention.rope_theta == 123.0
    for key in ("max_position_embeddings", "rope_parameters"):
        with pytest.raises(CheckpointError, match=key if key != "rope_parameters" else "rope_theta"):
            spec_from_config({k: v for k, v in cfg.items() if k != key}, where="x/config.json")


def test_unknown_keys_warned_once():
    cfg = dict(config_from_spec(tiny_spec()), shiny_new_key=1, another=2)
    with pytest.warns(UnknownConfigKeysWarning, match="another, shiny_new_key") as rec:
        spec_from_config(cfg)
    assert len([w for w in rec if w.category is UnknownConfigKeysWarning]) == 1


@pytest.mark.parametrize("key", ["hidden_size", "kv_lora_rank", "index_topk", "moe_intermediate_size"])
def test_missing_key_is_named(key):
    cfg = {k: v for k, v in config_from_spec(tiny_spec()).items() if k != key}
    with pytest.raises(CheckpointError, match=f"x/config.json: config key {key} is missing"):
        spec_from_config(cfg, where="x/config.json")


@pytest.mark.parametrize("change, match", [
    (dict(indexer_types=["full"] * 8), "indexer_types .* contradict"),
    (dict(rope_theta=1.0), "rope_parameters.rope_theta = .* and rope_theta = 1.0 contradict"),
    (dict(first_k_dense_replace=1), "mlp_layer_types .* first_k_dense_replace = 1 contradict"),
    (dict(n_group=4, topk_group=2), "topk_group"),
    (dict(indexer_rope_interleave=False), "indexer_rope_interleave"),
    (dict(num_key_value_heads=1), "num_key_value_heads"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 8e6}), "rope_type"),
    (dict(model_type="deepseek_v32"), "model_type"),
    (dict(index_topk_pattern="FFFSFFFF"), "index_topk_pattern"),
])
def test_contradictory_or_unsupported_keys_are_named(change, match):
    with pytest.raises(CheckpointError, match=match):
        spec_from_config(dict(config_from_spec(tiny_spec()), **change))
