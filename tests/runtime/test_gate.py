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
