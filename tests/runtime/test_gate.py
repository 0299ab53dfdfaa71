"""Host-state gate: every stock reason, bucket choice, captured-bucket check."""

from __future__ import annotations

import random

import pytest

from latency_specialized.ops.plan import BATCH_BUCKETS
from latency_specialized.runtime.gate import DecodeGate, StepState, bucket_of


def test_bucket_choice_is_smallest_fitting_for_every_batch():
    gate = DecodeGate(max_batch=64)
    assert gate.all_buckets() == BATCH_BUCKETS
    for n in range(1, 65):
        d = gate.decide(StepState(num_seqs=n))
        assert d.fast and d.reason == ""
        assert d.bucket >= n and d.bucket in BATCH_BUCKETS
        assert all(b < n for b in BATCH_BUCKETS if b < d.bucket)


def test_bucket_of_beyond_every_bucket_is_none():
    assert bucket_of(65, BATCH_BUCKETS) is None
    assert bucket_of(3, (4, 2, 8)) == 4


@pytest.mark.parametrize("state,needle", [
    (StepState(num_seqs=4, num_prefill_tokens=17), "prefill"),
    (StepState(num_seqs=80), "beyond the fast path"),
    (StepState(num_seqs=0), "empty"),
    (StepState(num_seqs=4, spec_tokens=3), "speculative"),
    (StepState(num_seqs=4, features=("logprobs", "structured_output")), "structured_output"),
])
def test_stock_reasons_name_the_cause(state, needle):
    gate = DecodeGate(max_batch=64, unsupported_features=frozenset({"structured_output"}))
    d = gate.decide(state)
    assert not d.fast and d.bucket is None
    assert needle in d.reason


def test_disabled_gate_always_stock():
    d = DecodeGate(enabled=False).decide(StepState(num_seqs=1))
    assert not d.fast and "disabled" in d.reason


def test_uncaptured_bucket_goes_stock_with_reason():
    gate = DecodeGate(max_batch=64)
    rng = random.Random(0)
    captured = set(rng.sample(list(BATCH_BUCKETS), 4))
    for n in range(1, 65):
        d = gate.decide(StepState(num_seqs=n), captured)
        expect = bucket_of(n, BATCH_BUCKETS)
        if expect in captured:
            assert d.fast and d.bucket == expect
        else:
            assert not d.fast and f"bucket {expect} was not captured" in d.reason


def test_custom_buckets_and_max_batch():
    gate = DecodeGate(max_batch=16, buckets=(16, 1, 4))
    assert gate.all_buckets() == (1, 4, 16)
    assert gate.decide(StepState(num_seqs=3)).bucket == 4
    assert not gate.decide(StepState(num_seqs=17)).fast


# ---------------------------------------------------------------------------------------------- one bucket rule
@pytest.mark.parametrize("max_batch,limit", [(64, 64), (8, 64), (12, 64), (20, 20), (5, 5), (3, 64), (1, 1), (70, 70)])
def test_planner_gate_and_vllm_binding_use_one_bucket_rule(max_batch, limit):
    """The planner (``bucket_for``, a plan's ``bucket``), the gate and the vLLM binding's SiteTable put
    every batch in the same bucket: the gate re-exports the planner's ``bucket_of``, the binding plans
    ``buckets_upto`` and each of its plans has the bucket it is keyed by."""
    from latency_specialized import hardware
    from latency_specialized.ops import plan as plan_mod
    from latency_specialized.ops.plan import bucket_for, buckets_upto
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime import gate as gate_mod
    from latency_specialized.runtime.vllm_binding import SiteTable
    from latency_specialized.spec import DecodeScope, Deployment

    from latency_specialized_models.vllm_moe.adapter import VllmMoEAdapter
    from latency_specialized_models.vllm_moe.spec import tiny_spec

    assert gate_mod.bucket_of is plan_mod.bucket_of  # one definition
    buckets = buckets_upto(max_batch, limit)
    assert DecodeGate(max_batch=limit).all_buckets() == buckets_upto(limit)

    class Limited(VllmMoEAdapter):
        def scope(self) -> DecodeScope:
            return super().scope().model_copy(update={"max_batch": limit})

    sites = SiteTable.build(Limited(tiny_spec()), get_registry().implementations, hardware.for_arch("cpu"),
                            Deployment(dtype="float32"), max_batch)
    assert sites.buckets == buckets and all(p.bucket == b for b, p in sites.plans.items())
    gate = DecodeGate(max_batch=max_batch, buckets=sites.buckets)
    for n in range(1, max_batch + 1):
        want = bucket_for(n, limit)
        assert gate.decide(StepState(num_seqs=n)).bucket == want == sites.bucket(n), n
    assert not gate.decide(StepState(num_seqs=max_batch + 1)).fast


def test_a_limit_between_buckets_is_a_bucket_of_its_own():
    from latency_specialized.ops.plan import bucket_for, buckets_upto

    assert bucket_for(17, 20) == 20 and bucket_for(16, 20) == 16
    assert buckets_upto(20) == (1, 2, 4, 8, 16, 20) and buckets_upto(64) == BATCH_BUCKETS
    assert DecodeGate(max_batch=20).decide(StepState(num_seqs=17)).bucket == 20
