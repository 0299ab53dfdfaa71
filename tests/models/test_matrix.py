"""The cross-model matrix (see conftest.py for how cells are generated)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

from latency_specialized import hardware
from latency_specialized.ops import plan as plan_module
from latency_specialized.plugins import get_registry
from latency_specialized.testing import matrix
from latency_specialized.testing.matrix import (CONTEXTS, LONG_CONTEXTS, Cell, cell_plan, cells_for, context_adapter,
                                                contexts_for, kernel_sites, plan_cells, plan_kwargs,
                                                plan_takes_context, run_program_cell)

PLAN_TARGETS = (("sm_90", "full"), ("cpu", "tiny"))
"""(arch, variant) every plan cell is planned for."""


def _adapters(capability: str | None = None):
    reg = get_registry()
    return [a for _, a in sorted(reg.adapters.items()) if capability is None or capability in a.capabilities]


def _plans(cell: Cell):
    """The plans of a plan cell, one per PLAN_TARGETS entry (its context passed where the plan takes one; the
    tiny spec able to hold a long context: ``matrix.context_adapter``)."""
    reg = get_registry()
    adapter = reg.adapter(cell.adapter)
    return [plan_module.build_plan(context_adapter(adapter, variant, cell.context), reg.implementations,
                                   hardware.for_arch(arch), variant=variant, dtype="bfloat16", **plan_kwargs(cell))
            for arch, variant in PLAN_TARGETS]


def test_plan_resolves_every_site(plan_cell: Cell):
    for plan in _plans(plan_cell):
        assert (plan.parallel.tp, plan.batch) == (plan_cell.tp, plan_cell.batch)
        assert plan.counts()["unserved"] == 0, plan.to_text()
        assert plan.tokens == plan.bucket * (1 + plan_cell.spec_tokens)
        assert plan.in_scope, plan.scope_problems


def test_plan_cells_are_distinct_plans():
    """No two plan cells share an id or build the same plan, and none of the matrix's plan inputs is lost."""
    cells = [c for a in _adapters() for c in plan_cells(a)]
    ids = [c.id for c in cells]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    # the experts and linears axes change the spec the plan is built for (MoESpec.expert_format,
    # ModelSpec.linear_format), not build_plan's arguments
    inputs = [(c.adapter, c.experts, c.linears, tuple(sorted(plan_kwargs(c).items()))) for c in cells]
    assert len(inputs) == len(set(inputs)), "two plan cells build the same plan"
    full = {(c.adapter, c.tp, c.batch, c.spec_tokens) for a in _adapters() for c in cells_for(a, devices=("cpu",))}
    assert {(c.adapter, c.tp, c.batch, c.spec_tokens) for c in cells} == full


def _context_groups(cells):
    groups = defaultdict(set)
    for c in cells:
        groups[(c.adapter, c.tp, c.batch, c.spec_tokens)].add(c.context)
    return groups


def test_context_is_a_plan_cell_axis_exactly_where_it_reaches_the_plan():
    """Where build_plan takes a context, every plan cell group has every matrix context and the context
    changes the plan; where it does not, no plan cell claims one (it would be a duplicate)."""
    reg = get_registry()
    # the quantized-experts cells sample one context on purpose (testing.matrix.QUANTIZED_BATCHES): the
    # context axis is the bf16 cells'
    cells = [c for a in _adapters() for c in plan_cells(a) if c.experts is None]
    if plan_takes_context():
        served = {a.name: set(contexts_for(a)) for a in _adapters()}
        # every context each adapter's architecture serves (testing.matrix.contexts_for: Qwen3-MoE stops at 32K)
        assert all(ctxs == served[name] for (name, *_), ctxs in _context_groups(cells).items())
        assert set().union(*served.values()) == set(CONTEXTS)
        for a in _adapters():
            one = [c for c in cells if (c.adapter, c.tp, c.batch, c.spec_tokens) == (a.name, 1, 1, 0)]
            plans = [_plans(c) for c in one]
            for k in range(len(PLAN_TARGETS)):
                got = [p[k].to_dict() for p in plans]
                assert all(got[i] != got[j] for i in range(len(got)) for j in range(i)), \
                    f"{a.name}: the context does not reach the plan"
    else:
        assert all(c.context is None for c in cells)
        with pytest.raises(TypeError, match="context"):
            plan_module.build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.for_arch("cpu"),
                                   variant="tiny", context=CONTEXTS[0])


def test_plan_cells_pass_the_context_once_the_plan_takes_one(monkeypatch):
    """With a build_plan that takes ``context`` the plan cells regain the context axis and each cell's
    context is what its plans are built for."""
    real = plan_module.build_plan
    seen = []

    def build_plan(*args, context: int, **kw):
        seen.append(context)
        return real(*args, **kw)

    monkeypatch.setattr(plan_module, "build_plan", build_plan)
    adapter = get_registry().adapter("kimi_k3")
    cells = plan_cells(adapter)
    assert len(cells) == len(set(cells)) and set(cells_for(adapter, devices=("cpu",))) <= set(cells)
    assert all(ctxs == set(CONTEXTS) for ctxs in _context_groups(cells).values())
    for c in [c for c in cells if (c.tp, c.batch) == (1, 1)]:
        seen.clear()
        _plans(c)
        assert seen == [c.context] * len(PLAN_TARGETS)


_ID = re.compile(r"\b([a-z0-9_]+)-tp(\d+)-b(\d+)(?:-ctx(\d+))?-s(\d+)(?:-(cuda))?\b")


def _documented_ids() -> list[str]:
    here = Path(__file__).parent
    docs = [matrix.__doc__ or "", ast.get_docstring(ast.parse((here / "conftest.py").read_text())) or "",
            __doc__ or ""]
    src = Path(matrix.__file__).read_text()
    docs.append(src[src.index("CONTEXTS:"):src.index("CELL_DTYPE")])    # the CONTEXTS docstring
    return [m.group(0) for d in docs for m in _ID.finditer(d)]


def test_documented_cell_ids_are_matrix_cells():
    """Every cell id the matrix docs give as an example is a cell of the matrix (its context one it has)."""
    ids = _documented_ids()
    assert ids, "the matrix docstring gives an example id"
    program = {c.id for a in _adapters("program") for c in cells_for(a)}
    plans = {c.id for a in _adapters() for c in plan_cells(a)}
    for i in ids:
        assert i in program | plans, f"documented cell {i} is not in the matrix (contexts {CONTEXTS})"


def test_program_cells_have_distinct_ids_and_the_matrix_contexts():
    cells = [c for a in _adapters("program") for c in cells_for(a)]
    ids = [c.id for c in cells]
    assert cells and len(ids) == len(set(ids))
    assert {c.context for c in cells} == set(CONTEXTS)


def test_long_context_cells_sample_the_cpu_and_cover_the_gpu():
    """Long contexts: on the CPU one (TP, batch) per adapter and long context it serves (spec 0, readable ids);
    on the GPU every TP x LONG_GPU_BATCHES (and the spec sample) within the memory bound, every long context."""
    for a in _adapters("program"):
        cells = [c for c in cells_for(a) if c.context in LONG_CONTEXTS]
        cpu = [c for c in cells if c.device == "cpu"]
        assert sorted(c.context for c in cpu) == sorted(matrix.long_contexts(a))
        assert all(c.spec_tokens == 0 and (c.tp, c.batch) == matrix.LONG_CPU_SAMPLE[c.context] for c in cpu)
        assert all(f"-ctx{c.context}-" in c.id for c in cells)
        gpu = {(c.tp, c.batch, c.context, c.spec_tokens) for c in cells if c.device == "cuda"}
        tps = {c.tp for c in cells_for(a) if c.device == "cuda"}
        for ctx in matrix.long_contexts(a):
            for tp in tps:
                for batch in matrix.LONG_GPU_BATCHES:
                    cell = Cell(a.name, batch, tp, ctx, 0, "cuda")
                    fits = matrix.long_cell_bytes(a, cell) <= matrix.LONG_GPU_BYTES
                    assert ((tp, batch, ctx, 0) in gpu) == fits, cell.id
            assert (1, 1, ctx, 0) in gpu, f"{a.name}: no GPU cell at {ctx}"


def test_verification_cells_are_admitted_at_the_plain_estimate(monkeypatch):
    """A GPU verification cell asks the memory ledger for the plain cell's estimate (its reference snapshots the
    per-row states only: the peak does not grow with k), and run_program_cell passes that figure to
    gpu_share.admitted."""
    import contextlib

    from latency_specialized.plugins import get_registry

    a = get_registry().adapter("muse_spark")
    plain, spec = Cell(a.name, 4, 1, 131072, 0, "cuda"), Cell(a.name, 4, 1, 131072, 7, "cuda")
    assert matrix.admission_bytes(a, plain) == matrix.long_cell_bytes(a, plain) > 0
    assert matrix.admission_bytes(a, spec) == matrix.long_cell_bytes(a, plain)
    asked = []

    def fake_admitted(nbytes, label=None):
        asked.append((nbytes, label))
        return contextlib.nullcontext()

    monkeypatch.setattr(matrix, "admitted", fake_admitted)
    monkeypatch.setattr(matrix, "release_cached_memory", lambda: None)
    monkeypatch.setattr(type(a), "verify_cell", lambda self, cell, comm=None: "ran")
    assert matrix.run_program_cell(spec, pools=None) == ["ran"]
    assert asked == [(matrix.admission_bytes(a, spec), spec.id)]


def test_synthetic_history_refuses_states_it_cannot_fill():
    """The generic fill refuses a reference's ModelStates subclass (its own history would disagree with the
    states), naming the method; DeepSeek's reference has one, which testing.history.seed_history takes."""
    import torch

    from latency_specialized.errors import UserError
    from latency_specialized.testing.history import seed_history, seed_states

    a = get_registry().adapter("deepseek_v41_flash")
    ref = a.reference(a.spec("tiny"), seed=0, dtype="float32", tokenizer=False)
    states = ref.new_cache(1, 64, block_size=4)
    with pytest.raises(UserError, match="seed_history"):
        seed_states(ref, states, states.slots[0], 40, torch.Generator())
    seed_history(ref, states, states.slots[0], 40, torch.Generator().manual_seed(0))
    assert states.seqs[states.slots[0].row].length == 40


def test_kernel_sites_follow_the_plans_rules():
    """kernel_sites: on the GPU exactly the called sites a kernel serves (some); on the CPU none, until a
    kernel says it supports the CPU - then that site, by the registry's rule, not a list."""
    from latency_specialized.ops.registry import Implementation, ImplementationRegistry

    reg = get_registry()
    adapter = reg.adapter("kimi_k3")
    cpu = cell_plan(adapter, reg.implementations, Cell("kimi_k3", 4, 1, CONTEXTS[0], 0, "cpu"))
    assert kernel_sites(cpu, reg.implementations) == {}
    assert all(c.impl.is_reference for c in cpu.called_choices())
    sm90 = plan_module.build_plan(adapter, reg.implementations, hardware.for_arch("sm_90"), batch=4,
                                  dtype=matrix.CELL_DTYPE, variant="tiny")
    fast = {c.site.name: c.impl.name for c in sm90.called_choices() if c.is_fast}
    assert fast and kernel_sites(sm90, reg.implementations) == fast
    mixed = ImplementationRegistry()
    for impl in reg.implementations:
        mixed.register(impl)
    mixed.register(Implementation("attention.mla", "attention.mla.test_cpu", reg.implementations.reference(
        "attention.mla").fn, lambda ctx: ctx.arch == "cpu" or "cpu only", priority=1, provider="test"))
    cpu = cell_plan(adapter, mixed, Cell("kimi_k3", 4, 1, CONTEXTS[0], 0, "cpu"))
    assert kernel_sites(cpu, mixed) == {"mla+moe/attn.mla": "attention.mla.test_cpu"}


def test_program_matches_reference(program_cell: Cell, gloo_pools):
    reg = get_registry()
    adapter = reg.adapter(program_cell.adapter)
    results = run_program_cell(program_cell, gloo_pools)
    r0 = results[0]
    assert r0.steps > 0
    assert r0.fast_steps == r0.steps and r0.stock_steps == 0, "the fast path did not run every decode step"
    assert r0.max_abs_err <= r0.tolerance, f"max |program - reference| = {r0.max_abs_err} > {r0.tolerance}"
    assert r0.top1_agreement >= 0.99, f"top-1 agreement {r0.top1_agreement} on the decisive positions"
    assert r0.decisive >= matrix.MIN_DECISIVE, f"only {r0.decisive:.0%} of the positions are decisive"
    assert all(r.logits_digest == r0.logits_digest for r in results), "ranks disagree"
    # Which implementation served each site: the one the cell's plan (this device, TP, batch) gives it,
    # on every rank; kernels at exactly the called sites the plan's rules give a kernel (on the CPU, as
    # no kernel supports it, none: every called site runs its family's reference), some on a GPU.
    plan = cell_plan(adapter, reg.implementations, program_cell)
    assert r0.impls == {c.site.name: c.impl.name for c in plan.choices}, "not bound to the cell's plan"
    assert all(r.impls == r0.impls for r in results), "ranks bound different implementations"
    called = [c.site.name for c in plan.called_choices()]
    served_fast = {s: r0.impls[s] for s in called if not reg.implementations.get(r0.impls[s]).is_reference}
    want_fast = kernel_sites(plan, reg.implementations)
    assert served_fast == want_fast, (f"sites on a reference: {sorted(set(called) - set(served_fast))}; "
                                      f"want kernels at {want_fast}")
    assert want_fast or program_cell.device != "cuda", "no kernel serves any site on the GPU"
