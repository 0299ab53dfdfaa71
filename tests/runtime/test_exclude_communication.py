"""``runtime.harness.exclude_communication`` (the one-GPU layer bench of a TP rank): an all-reduce fused with a
residual and / or a norm runs the one-rank fused kernel; a sum-only all-reduce (attrs without residual or norm:
mHC and gated residual streams, per-route partials) runs nothing - the rank's partial is its sum - as the stock
compositions leave those all-reduces out."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from latency_specialized.runtime import harness

from latency_specialized import hardware
from latency_specialized.ops.plan import Plan, SiteChoice
from latency_specialized.ops.registry import Implementation, always
from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.runtime.harness import exclude_communication
from latency_specialized.runtime.op_table import OpTable
from latency_specialized.spec import ParallelSpec


def _program(bucket: int, log: list) -> SimpleNamespace:
    b = SiteBuilder("cpu", "float32", bucket, 8)
    b.prefix, b.layers = "k", (0,)
    b.add("attn.allreduce", "allreduce", N=16, attrs={"residual": False, "norm": False})      # mHC / gated
    b.add("ffn.allreduce", "allreduce", N=16, attrs={"residual": True, "norm": True})         # pre-norm
    b.add("moe.latent_allreduce", "allreduce", N=8, attrs={"residual": False, "norm": True})  # latent + norm
    b.gemm("attn.o_proj", 16, 16)

    def fn(name):
        def call(*a, **k):
            log.append(name)
            return name
        return Implementation("allreduce" if "allreduce" in name else "gemm", name, call, always)

    choices = [SiteChoice(s, fn(s.name), ()) for s in b.sites]
    plan = Plan("toy", "tiny", hardware.for_arch("cpu"), ParallelSpec(tp=8), bucket, bucket, bucket, "float32",
                choices)
    return SimpleNamespace(plans={bucket: plan}, op_table=OpTable({bucket: plan}))


def test_sum_only_sites_run_nothing_and_fused_sites_keep_the_one_rank_kernel():
    log: list = []
    fused_calls: list = []
    registry = {"allreduce.cutedsl_local": SimpleNamespace(fn=lambda *a, **k: fused_calls.append((a, k)) or "fused")}
    prog = _program(1, log)
    assert exclude_communication(prog, SimpleNamespace(get=registry.__getitem__)) == 3
    ops = prog.op_table[1]
    partial, zeros = torch.randn(2, 16), torch.zeros(2, 16)
    normed, summed = ops["k/attn.allreduce"](partial, zeros, None, 1e-6, comm="peers")
    assert normed is None and summed is partial and not fused_calls      # no kernel, no copy
    dest = torch.full((2, 16), float("nan"))
    normed, summed = ops["k/attn.allreduce"](partial, zeros, None, 1e-6, out=(None, dest))
    assert summed is dest and torch.equal(dest, partial)                  # a caller's destination is honoured
    assert ops["k/ffn.allreduce"](partial, zeros, torch.ones(16), 1e-6, comm="peers") == "fused"
    assert ops["k/moe.latent_allreduce"](partial[:, :8], None, torch.ones(8), 1e-6) == "fused"
    assert len(fused_calls) == 2 and all(k["comm"] is None for _, k in fused_calls)   # the exchange left out
    assert ops["k/attn.o_proj"]() == "k/attn.o_proj" and log == ["k/attn.o_proj"]   # other sites untouched
    assert prog.op_table.calls["k/attn.allreduce"] == 2                   # still counted as calls of the site


def test_the_ab_switch_runs_the_one_rank_kernel_at_sum_only_sites_too(monkeypatch):
    fused_calls: list = []
    registry = {"allreduce.cutedsl_local": SimpleNamespace(fn=lambda *a, **k: fused_calls.append(a) or "fused")}
    monkeypatch.setattr(harness, "SUM_ONLY_KERNEL", True)
    prog = _program(1, [])
    assert exclude_communication(prog, SimpleNamespace(get=registry.__getitem__)) == 3
    assert prog.op_table[1]["k/attn.allreduce"](torch.ones(1, 16), torch.zeros(1, 16), None, 1e-6) == "fused"
    assert len(fused_calls) == 1
