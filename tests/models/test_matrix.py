"""The cross-model matrix (see conftest.py for how cells are generated)."""

from __future__ import annotations

import pytest

from latency_specialized import hardware
from latency_specialized.ops.plan import build_plan
from latency_specialized.plugins import get_registry
from latency_specialized.testing.matrix import Cell


def test_plan_resolves_every_site(plan_cell: Cell):
    reg = get_registry()
    adapter = reg.adapter(plan_cell.adapter)
    for arch, variant in (("sm_90", "full"), ("cpu", "tiny")):
        plan = build_plan(adapter, reg.implementations, hardware.for_arch(arch), tp=plan_cell.tp,
                          batch=plan_cell.batch, spec_tokens=plan_cell.spec_tokens, variant=variant,
                          dtype="bfloat16")
        assert plan.counts()["unserved"] == 0, plan.to_text()
        assert plan.tokens == plan.bucket * (1 + plan_cell.spec_tokens)
        assert plan.in_scope, plan.scope_problems


def test_program_matches_reference(program_cell: Cell, gloo_pools):
    adapter = get_registry().adapter(program_cell.adapter)
    if program_cell.tp == 1:
        results = [adapter.verify_cell(program_cell, comm=None)]
    else:
        results = gloo_pools(program_cell.tp).run(program_cell)
    r0 = results[0]
    assert r0.steps > 0
    assert r0.fast_steps == r0.steps and r0.stock_steps == 0, "the fast path did not run every decode step"
    assert r0.max_abs_err <= r0.tolerance, f"max |program - reference| = {r0.max_abs_err} > {r0.tolerance}"
    assert r0.top1_agreement >= 0.99
    assert all(r.logits_digest == r0.logits_digest for r in results), "ranks disagree"
    assert any(not impl.endswith(".reference") for impl in r0.impls.values()) or program_cell.device == "cpu"
