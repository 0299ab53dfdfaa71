"""Specs: frozen, extra keys rejected, documented fields, shard() errors that name the fix, scope checks."""

from __future__ import annotations

import pydantic
import pytest

from latency_specialized.errors import UserError
from latency_specialized.spec import (ActivationSpec, DecodeScope, Deployment, GQAAttentionSpec, KDAAttentionSpec,
                                      LayerSpec, MLAAttentionSpec, ModelSpec, MoESpec, ParallelSpec, RouterSpec)


def _toy(heads: int = 8, experts: int = 8) -> ModelSpec:
    attn = GQAAttentionSpec(num_heads=heads, num_kv_heads=2, head_dim=16)
    moe = MoESpec(num_experts=experts, top_k=2, num_shared_experts=1, expert_intermediate=64,
                  router=RouterSpec(score_func="sigmoid"))
    return ModelSpec(name="toy", hidden_size=128, vocab_size=100, max_context=1024,
                     layers=tuple(LayerSpec(index=i, attention=attn, ffn=moe) for i in range(2)))


def test_specs_are_frozen_and_reject_unknown_keys():
    spec = _toy()
    with pytest.raises(pydantic.ValidationError):
        spec.hidden_size = 3  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="extra"):
        RouterSpec(score_func="sigmoid", routed_scale=2.0)  # misspelled key
    assert hash(spec) == hash(_toy())  # frozen -> hashable, equal specs hash equal


def test_every_field_has_a_docstring():
    for cls in (KDAAttentionSpec, MLAAttentionSpec, GQAAttentionSpec, MoESpec, RouterSpec, ModelSpec, DecodeScope,
                ParallelSpec, Deployment, ActivationSpec):
        undocumented = [n for n, f in cls.model_fields.items() if not f.description and n != "kind"]
        assert not undocumented, f"{cls.__name__} fields without docstring: {undocumented}"


def test_discriminated_union_round_trips_through_json():
    spec = _toy()
    again = ModelSpec.model_validate_json(spec.model_dump_json())
    assert again == spec
    assert isinstance(again.layers[0].attention, GQAAttentionSpec)


def test_shard_divides_heads_and_widths():
    rank = _toy().shard(4)
    assert rank.tp == 4
    assert rank.layers[0].attention.num_heads == 2
    assert rank.layers[0].attention.num_kv_heads == 1  # 2 KV heads replicate past TP=2
    assert rank.layers[0].ffn.expert_intermediate == 16


def test_shard_error_names_the_fix():
    with pytest.raises(UserError, match=r"TP=3 not supported: toy needs 8 query heads divisible by TP"):
        _toy().shard(3)
    with pytest.raises(UserError, match="already sharded"):
        _toy().shard(2).shard(2)


def test_activation_validation_names_the_fix():
    with pytest.raises(pydantic.ValidationError, match="beta and beta_lin"):
        ActivationSpec(kind="situ_glu")


def test_moe_topk_validation():
    with pytest.raises(pydantic.ValidationError, match="top_k"):
        MoESpec(num_experts=4, top_k=5, num_shared_experts=0, expert_intermediate=8,
                router=RouterSpec(score_func="softmax"))


def test_parallel_spec_validation():
    assert ParallelSpec(tp=8, dcp=2).dcp == 2
    with pytest.raises(pydantic.ValidationError, match="must divide"):
        ParallelSpec(tp=8, dcp=3)


def test_scope_lists_every_problem_at_once():
    scope = DecodeScope(archs=("sm_90",), tp_sizes=(8,), max_batch=64, dtypes=("bfloat16",), spec_tokens=(0,),
                        needs_cuda_graphs=True)
    problems = scope.problems(Deployment(arch="sm_80", tp=4, batch=65, dtype="float16", spec_tokens=3,
                                         cuda_graphs=False))
    assert len(problems) == 6
    joined = " | ".join(problems)
    for fragment in ("arch sm_80", "TP=4", "batch 65", "dtype float16", "3 speculative", "--enforce-eager"):
        assert fragment in joined
    assert scope.problems(Deployment(arch="sm_90", tp=8, batch=64)) == []


def test_layer_kinds_group_layers():
    spec = _toy()
    assert spec.layer_kinds() == {"gqa+moe": (0, 1)}
