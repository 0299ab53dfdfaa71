"""OpTable: per-bucket binding of a plan's choices, call counting, the trace, skipped/strided sets,
the public wrap hook (and communication calls through it), prepare, and its errors."""

from __future__ import annotations

import pytest

from latency_specialized import hardware
from latency_specialized.errors import UserError
from latency_specialized.ops.plan import Plan, SiteChoice
from latency_specialized.ops.registry import Implementation, always
from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.runtime.census import KernelCensus
from latency_specialized.runtime.op_table import OpTable
from latency_specialized.spec import ParallelSpec
from latency_specialized.trace import Trace


def impl(family, name, log, **flags):
    def fn(*a, **k):
        log.append((name, a, k))
        return name
    return Implementation(family, name, fn, always, **flags)


def make_plan(bucket: int, log: list, *, prepared: list | None = None, fast_fusing: bool = True,
              unserved: str | None = None) -> Plan:
    b = SiteBuilder("cpu", "float32", bucket, 1)
    b.prefix, b.layers = "k", (0, 1)
    b.gemm("attn.q_proj", 8, 4)
    b.add("moe.gate_down", "moe.gate_down", N=8, K=4, n_gate=4, attrs={"fuses": "moe.router_gemm,moe.latent_down"})
    b.gemm("moe.router_gemm", 4, 4)
    b.gemm("moe.latent_down", 4, 4)
    b.prefix, b.layers = "", ()
    b.gemm("lm_head", 16, 4)
    prep = (lambda ctx: prepared.append((bucket, ctx.family))) if prepared is not None else None
    impls = {
        "k/attn.q_proj": impl("gemm", f"gemm.strided_{bucket}", log, strided_rows=True, prepare=prep),
        "k/moe.gate_down": impl("moe.gate_down", f"gate_down.{'fast' if fast_fusing else 'ref'}_{bucket}", log,
                                strided_out=True, is_reference=not fast_fusing),
        "k/moe.router_gemm": impl("gemm", f"gemm.a_{bucket}", log),
        "k/moe.latent_down": impl("gemm", f"gemm.b_{bucket}", log),
        "lm_head": impl("gemm", f"gemm.head_{bucket}", log),
    }
    choices = [SiteChoice(s, None if s.name == unserved else impls[s.name], (("x.other", "refused: test"),))
               for s in b.sites]
    return Plan("toy", "tiny", hardware.for_arch("cpu"), ParallelSpec(tp=1), bucket, bucket, bucket, "float32", choices)


def test_binds_each_bucket_counts_calls_and_records_the_trace():
    log: list = []
    trace = Trace()
    table = OpTable({4: make_plan(4, log), 1: make_plan(1, log)}, trace)
    assert table.buckets == [1, 4]
    assert table[1]["k/attn.q_proj"]("x", 3, out=None) == "gemm.strided_1"
    assert table[4]["k/attn.q_proj"]("y") == "gemm.strided_4"
    assert table[4]["lm_head"]() == "gemm.head_4"
    assert log[0] == ("gemm.strided_1", ("x", 3), {"out": None})            # arguments passed through
    assert table.calls == {"k/attn.q_proj": 2, "lm_head": 1}                # all buckets, per site
    assert table.impl(4, "lm_head").name == "gemm.head_4"
    assert trace.counts["site"] == 10 and trace.impl_calls["gemm.head_1"] == 1
    assert any("not called" in e.message and "k/moe.router_gemm" in e.message for e in trace.events)
    ops = table[4]
    assert ops.strided_rows == {"k/attn.q_proj"} and ops.strided_out == {"k/moe.gate_down"}
    assert set(ops.skipped) == {"k/moe.router_gemm", "k/moe.latent_down"}  # a kernel serves the fusing site
    assert len(ops) == 5 and "lm_head" in ops and set(ops) == {c.site.name for c in ops.plan.choices}
    ref = OpTable({2: make_plan(2, log, fast_fusing=False)})[2]
    assert set(ref.skipped) == {"k/moe.gate_down"}                          # only its reference: the parts run


def test_wrap_hooks_every_op_keeps_counting_and_runs_communication_through_the_hooks():
    log: list = []
    table = OpTable({1: make_plan(1, log), 2: make_plan(2, log)})
    seen = []

    def tag(site, bucket, fn):
        def call(*a, **k):
            seen.append((site, bucket))
            return ("tagged", fn(*a, **k))
        return call

    assert table.wrap(tag) == 10
    assert table[2]["lm_head"]() == ("tagged", "gemm.head_2") and seen == [("lm_head", 2)]
    # a hook that replaces the op (the bench's one-rank all-reduce): still counted, outside every hook
    assert table.wrap(lambda site, bucket, fn: (lambda *a, **k: "replaced")) == 10
    assert table[1]["k/attn.q_proj"]() == "replaced" and table.calls["k/attn.q_proj"] == 1
    out = table[1].communicate("lm_head.all_gather", lambda t, dim: (t, dim), "logits", dim=-1)
    assert out == "replaced" and table.calls["lm_head.all_gather"] == 1    # hooked and counted like an op
    fresh = OpTable({1: make_plan(1, log)})
    fresh.wrap(tag)
    assert fresh[1].communicate("k/moe.all_gather", lambda x: x * 2, 21) == ("tagged", 42)
    assert seen[-1] == ("k/moe.all_gather", 1)


def test_census_instruments_through_wrap_and_counts_communication():
    class Driver:
        nodes = 0

        def capturing_graph(self, stream):
            return (7, 1)

        def kernel_nodes(self, graph):
            return self.nodes

    drv, log = Driver(), []
    table = OpTable({1: make_plan(1, log)})

    class Program:
        census = None
        op_table = table

    def launch(site, bucket, fn):  # innermost: every op "launches" kernels (2 for the head, else 1)
        def call(*a, **k):
            drv.nodes += 2 if site == "lm_head" else 1
            return fn(*a, **k)
        return call

    table.wrap(launch)
    census = KernelCensus(driver=drv)
    assert census.instrument(Program) == 5 and Program.census is census

    def gather(*_a):
        drv.nodes += 3

    table[1]["lm_head"]()
    table[1]["k/attn.q_proj"]()
    table[1]["k/attn.q_proj"]()
    table[1].communicate("lm_head.all_gather", gather)
    assert census.kernels(1) == {"lm_head": 2, "k/attn.q_proj": 2, "lm_head.all_gather": 1 + 3}


def test_prepare_and_errors():
    log, prepared = [], []
    table = OpTable({1: make_plan(1, log, prepared=prepared), 4: make_plan(4, log, prepared=prepared)})
    table.prepare(4)
    assert prepared == [(4, "gemm")]
    with pytest.raises(UserError, match=r"no plan for bucket 8 \(have \[1, 4\]\)"):
        table[8]
    with pytest.raises(UserError, match="has no op site 'k/attn.nope'"):
        table[1]["k/attn.nope"]
    with pytest.raises(UserError, match="at least one plan"):
        OpTable({})
    with pytest.raises(UserError, match="key plans by their bucket"):
        OpTable({2: make_plan(1, log)})
    with pytest.raises(UserError, match="no implementation serves lm_head at bucket 1: x.other: refused: test"):
        OpTable({1: make_plan(1, log, unserved="lm_head")})
    # an unserved site the plan skips is bound to a stub that names the problem if it is ever called
    t = OpTable({1: make_plan(1, log, unserved="k/moe.router_gemm")})
    with pytest.raises(UserError, match="must not call it"):
        t[1]["k/moe.router_gemm"]()
