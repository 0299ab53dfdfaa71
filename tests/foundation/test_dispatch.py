"""Op registry, selection with refusal reasons, plan building, batch buckets."""

from __future__ import annotations

import pytest
import torch

from latency_specialized import hardware
from latency_specialized.errors import PluginError, UserError
from latency_specialized.ops.plan import BATCH_BUCKETS, build_plan, bucket_for
from latency_specialized.ops.registry import (FAMILIES, Implementation, ImplementationRegistry, always,
                                              make_context)
from latency_specialized.plugins import get_registry


def _ctx(**kw):
    base = dict(arch="sm_90", dtype="bfloat16", tokens=2, dims={"N": 4096, "K": 7168})
    base.update(kw)
    return make_context("gemm", **base)


def _registry_with(*impls):
    reg = ImplementationRegistry()
    for i in impls:
        reg.register(i)
    return reg


def _fn(*a, **k):
    return None


def test_select_prefers_priority_and_records_refusals():
    fast = Implementation("gemm", "gemm.fast", _fn, lambda c: True if c.tokens <= 2 else f"M={c.tokens} > 2", priority=10)
    mid = Implementation("gemm", "gemm.mid", _fn, lambda c: "needs sm_100" if c.arch != "sm_100" else True, priority=5)
    ref = Implementation("gemm", "gemm.ref", _fn, always, priority=-100, is_reference=True)
    reg = _registry_with(ref, mid, fast)
    impl, refusals = reg.select(_ctx(tokens=2))
    assert impl.name == "gemm.fast" and refusals == []
    impl, refusals = reg.select(_ctx(tokens=8))
    assert impl.name == "gemm.ref"
    assert refusals == [("gemm.fast", "M=8 > 2"), ("gemm.mid", "needs sm_100")]
    impl, refusals = reg.select(_ctx(tokens=8), only="gemm.fast")
    assert impl is None and refusals == [("gemm.fast", "M=8 > 2")]
    impl, _ = reg.select(_ctx(tokens=8), allow_reference=False)
    assert impl is None


def test_buggy_supports_is_reported_not_raised():
    def boom(ctx):
        raise RuntimeError("bad table")

    reg = _registry_with(Implementation("gemm", "gemm.buggy", _fn, boom, priority=1),
                         Implementation("gemm", "gemm.ref", _fn, always, priority=-100, is_reference=True))
    impl, refusals = reg.select(_ctx())
    assert impl.name == "gemm.ref"
    assert refusals == [("gemm.buggy", "supports() raised RuntimeError: bad table")]


def test_registration_errors_name_the_fix():
    reg = ImplementationRegistry()
    with pytest.raises(PluginError, match="unknown family 'gemv'"):
        reg.register(Implementation("gemv", "x", _fn, always))
    reg.register(Implementation("gemm", "gemm.a", _fn, always))
    reg.register(Implementation("gemm", "gemm.a", _fn, always))  # same fn: idempotent
    with pytest.raises(PluginError, match="already registered"):
        reg.register(Implementation("gemm", "gemm.a", lambda: None, always))


def test_context_dims_and_attrs():
    ctx = make_context("moe.router", arch="cpu", dtype="float32", tokens=4, dims={"topk": 8, "E": 64},
                       attrs={"score_func": "sigmoid"})
    assert ctx.dim("E") == 64 and ctx.attr("score_func") == "sigmoid" and ctx.attr("missing", 3) == 3
    assert ctx == make_context("moe.router", arch="cpu", dtype="float32", tokens=4, dims={"E": 64, "topk": 8},
                               attrs={"score_func": "sigmoid"})
    with pytest.raises(KeyError):
        ctx.dim("N")


def test_every_family_has_a_reference_registered():
    impls = get_registry().implementations
    for family in FAMILIES:
        assert impls.reference(family).is_reference, family


@pytest.mark.parametrize("batch,bucket", [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 24), (33, 40), (64, 64)])
def test_bucket_for(batch, bucket):
    assert bucket_for(batch) == bucket
    assert bucket in BATCH_BUCKETS


def test_bucket_for_rejects_out_of_scope():
    with pytest.raises(UserError, match="batch 65 beyond the scope: use 1..64"):
        bucket_for(65)
    with pytest.raises(UserError, match="batch 0 is not valid"):
        bucket_for(0)
    assert bucket_for(20, max_batch=20) == 20  # a scope limit between buckets still gets a bucket


def test_plan_for_kimi_tp8_covers_every_site_with_reasons():
    reg = get_registry()
    plan = build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.for_arch("sm_90"), tp=8, batch=4)
    assert plan.bucket == 4 and plan.tokens == 4 and plan.in_scope
    counts = plan.counts()
    assert counts["unserved"] == 0 and counts["sites"] == len(plan.choices) > 20
    families = {c.site.family for c in plan.choices}
    assert {"gemm", "norm", "allreduce", "moe.router", "moe.experts", "attention.kda", "attention.mla"} <= families
    text = plan.to_text()
    assert "kda+moe/attn.o_proj" in text and "TP=8" in text
    d = plan.to_dict()
    assert all(s["impl"] for s in d["sites"])


def test_plan_on_cpu_uses_references_and_says_why():
    reg = get_registry()
    plan = build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.for_arch("cpu"), tp=1, batch=1,
                      dtype="float32", variant="tiny")
    gemm = [c for c in plan.choices if c.site.family == "gemm"][0]
    assert gemm.impl.is_reference
    assert ("gemm.cublas", "CPU: the reference serves (same math, fp32 accumulate)") in gemm.refusals


def test_plan_force_picks_an_implementation():
    reg = get_registry()
    plan = build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.for_arch("sm_90"), tp=8, batch=1,
                      force={"gemm": "gemm.reference"})
    assert all(c.impl.name == "gemm.reference" for c in plan.choices if c.site.family == "gemm")


def test_plan_keeps_scope_problems_and_rejects_bad_tp():
    reg = get_registry()
    a = reg.adapter("kimi_k3")
    plan = build_plan(a, reg.implementations, hardware.for_arch("sm_80"), tp=8, batch=1, dtype="float16")
    assert not plan.in_scope
    assert any("arch sm_80" in p for p in plan.scope_problems)
    assert any("dtype float16" in p for p in plan.scope_problems)
    with pytest.raises(UserError, match="TP=5 not supported: kimi_k3 needs 96 KDA heads divisible by TP"):
        build_plan(a, reg.implementations, hardware.for_arch("sm_90"), tp=5, batch=1)


def test_hardware_for_arch_and_probe():
    assert hardware.for_arch("sm90a").arch == "sm_90"
    assert hardware.for_arch("SM_100f").arch == "sm_100"
    with pytest.raises(UserError, match="unknown arch 'sm_42'"):
        hardware.for_arch("sm_42")
    hw = hardware.probe()
    assert hw.arch == ("cpu" if not torch.cuda.is_available() else hw.arch)
    assert hw.probed == torch.cuda.is_available()
