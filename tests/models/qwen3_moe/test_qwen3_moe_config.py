"""Qwen3-MoE spec and config.json parsing: the published numbers, every variant's layer kinds and TP shards,
config round trips, unknown keys warned once, missing / contradictory / unsupported keys named."""

from __future__ import annotations

import warnings

import pytest

from latency_specialized import hardware
from latency_specialized.config_keys import UnknownConfigKeysWarning
from latency_specialized.errors import CheckpointError, UserError
from latency_specialized.ops.plan import build_plan
from latency_specialized.plugins import get_registry
from latency_specialized.spec import DenseMLPSpec, MoESpec

from latency_specialized_models.qwen3_moe import spec as q

from tests.models.qwen3_moe.helpers import adapter


def parse(cfg, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownConfigKeysWarning)
        return q.spec_from_config(cfg, **kw)


def test_registered_through_its_entry_point():
    reg = get_registry()
    assert "qwen3_moe" not in {f.name for f in reg.failures}
    assert reg.providers["qwen3_moe"] == "qwen3_moe"
    a = reg.adapter("qwen3_moe")
    assert a.capabilities == {"spec", "reference", "program", "checkpoint"}
    assert a.variants == ("full", "medium", "tiny")
    # vLLM's Qwen3MoeForCausalLM stays with the adapter that has a vLLM binding
    assert reg.adapter_for_architecture(["Qwen3MoeForCausalLM"]).name == "vllm_moe"


def test_full_spec_is_qwen3_30b_a3b():
    s = adapter().spec("full")
    assert (s.name, s.hidden_size, s.num_layers, s.vocab_size, s.max_context) == ("qwen3_moe", 2048, 48, 151936, 40960)
    assert s.layer_kinds() == {"gqa+moe": tuple(range(48))} and s.norm.eps == 1e-6 and not s.tie_word_embeddings
    a, f = s.layers[0].attention, s.layers[0].ffn
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.rope_theta, a.qk_norm) == (32, 4, 128, 1e6, True)
    assert isinstance(f, MoESpec)
    assert (f.num_experts, f.top_k, f.num_shared_experts, f.expert_intermediate) == (128, 8, 0, 768)
    r = f.router
    assert (r.score_func, r.bias_corrected, r.renormalize, r.routed_scaling) == ("softmax", False, True, 1.0)


@pytest.mark.parametrize("variant", ["full", "medium", "tiny"])
def test_variants_shard_and_plan(variant):
    a = adapter()
    s = a.spec(variant)
    for tp in a.scope().tp_sizes:
        r = s.shard(tp)
        assert r.tp == tp and r.full() == s and r.layers[0].attention.num_heads * tp == s.layers[0].attention.num_heads
        plan = build_plan(a, get_registry().implementations, hardware.for_arch("sm_90"), tp=tp, batch=8,
                          variant=variant)
        assert plan.counts()["unserved"] == 0 and plan.in_scope
    with pytest.raises(UserError, match="query heads divisible by TP"):
        s.shard(3)


def test_tiny_and_medium_have_every_feature():
    for s in (q.variant_spec("tiny"), q.variant_spec("medium")):
        assert s.layer_kinds() == {"gqa+dense": (0,), "gqa+moe": (1, 2)}
        a = s.layers[0].attention
        assert a.num_heads // a.num_kv_heads == 2 and a.qk_norm and a.rope_theta
        assert isinstance(s.layers[0].ffn, DenseMLPSpec) and s.layers[1].ffn.router.renormalize


@pytest.mark.parametrize("cfg", [q.QWEN3_30B_A3B, q.MEDIUM, q.TINY], ids=["full", "medium", "tiny"])
def test_config_round_trip(cfg):
    s = parse(cfg)
    assert parse(q.config_from_spec(s)) == s
    assert parse(q.config_from_spec(s.shard(2))) == s


def test_layer_rules_of_transformers():
    """MoE where num_experts > 0, not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    base = dict(q.TINY, num_hidden_layers=6)
    kinds = lambda cfg: [l.ffn.kind for l in parse(cfg).layers]  # noqa: E731
    assert kinds(dict(base, mlp_only_layers=[], decoder_sparse_step=2)) == ["dense", "moe"] * 3
    assert kinds(dict(base, mlp_only_layers=[3], decoder_sparse_step=1)) == ["moe"] * 3 + ["dense"] + ["moe"] * 2
    assert kinds(dict(base, num_experts=0)) == ["dense"] * 6
    # transformers' spellings: num_local_experts (v5 saves it), rope_parameters, null lists, head_dim defaulted
    cfg = {k: v for k, v in q.TINY.items() if k not in ("num_experts", "rope_theta", "head_dim")}
    s = parse(dict(cfg, num_local_experts=8, rope_parameters={"rope_theta": 500.0, "rope_type": "default"},
                   mlp_only_layers=None))
    a = s.layers[0].attention
    assert (s.layers[0].ffn.num_experts, a.rope_theta, a.head_dim) == (8, 500.0, 64 // 4)
    # keys with a transformers default take it
    bare = {k: v for k, v in q.TINY.items() if k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                      "num_key_value_heads", "vocab_size", "num_experts",
                                                      "num_experts_per_tok", "moe_intermediate_size")}
    s = parse(bare)
    assert (s.max_context, s.norm.eps, s.layers[0].attention.rope_theta) == (32768, 1e-6, 10000.0)
    assert not s.layers[0].ffn.router.renormalize and not s.tie_word_embeddings


def test_unknown_keys_warned_once_by_name():
    cfg = dict(q.TINY, quantization_hint="x", zz_vendor=1, rope_parameters={"rope_theta": 1e4, "factor_x": 2})
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        q.spec_from_config(cfg, where="ck/config.json")
    w = [x for x in got if issubclass(x.category, UnknownConfigKeysWarning)]
    assert len(w) == 1
    assert "ck/config.json: qwen3_moe ignores 3 unknown config keys: quantization_hint, rope_parameters.factor_x, " \
           "zz_vendor" in str(w[0].message)
    parse(dict(q.TINY, initializer_range=0.02, use_cache=True, transformers_version="5.0"))  # inert: no warning


@pytest.mark.parametrize("drop,match", [
    ("hidden_size", "config key hidden_size is missing"),
    ("num_key_value_heads", "config key num_key_value_heads is missing"),
    ("num_experts", r"config key num_experts \(or num_local_experts\) is missing"),
    ("moe_intermediate_size", "config key moe_intermediate_size is missing: the MoE layers need"),
    ("intermediate_size", r"config key intermediate_size is missing: the dense layers \[0\] need it"),
])
def test_missing_keys_are_named(drop, match):
    with pytest.raises(CheckpointError, match=match):
        parse({k: v for k, v in q.TINY.items() if k != drop}, where="ck/config.json")


def test_moe_free_config_does_not_need_moe_keys():
    cfg = {k: v for k, v in q.TINY.items() if k not in ("moe_intermediate_size", "num_experts_per_tok")}
    assert parse(dict(cfg, num_experts=0)).layer_kinds() == {"gqa+dense": (0, 1, 2)}


@pytest.mark.parametrize("extra,match", [
    ({"num_local_experts": 16}, "num_experts = 8 and num_local_experts = 16 contradict"),
    ({"rope_parameters": {"rope_theta": 5.0}}, "rope_theta = 10000.0 and rope_parameters.rope_theta = 5.0 contradict"),
    ({"attention_bias": True}, "attention_bias = True: q/k/v/o biases are not implemented"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu': only SiLU"),
    ({"use_sliding_window": True}, "use_sliding_window = True: sliding-window attention is not implemented"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling = .*scaled RoPE"),
    ({"rope_parameters": {"rope_type": "yarn"}}, "rope_parameters.rope_type = 'yarn'"),
    ({"model_type": "qwen3"}, "model_type = 'qwen3': not a Qwen3-MoE config"),
    ({"architectures": ["LlamaForCausalLM"]}, r"architectures = \['LlamaForCausalLM'\]: not a Qwen3-MoE config"),
])
def test_contradictory_and_unsupported_keys_are_named(extra, match):
    with pytest.raises(CheckpointError, match=match):
        parse(dict(q.TINY, **extra))
