"""Kernel census: kernels per op site counted during capture (fake driver on the CPU, real graph on a GPU),
and the bench's split of per-layer kernels into communication and the rest."""

from __future__ import annotations

import pytest
import torch

from latency_specialized.bench import report
from latency_specialized.bench.layer_bench import Measured, add_kernel_split, per_layer
from latency_specialized.runtime.census import KernelCensus, is_communication, split_communication


class DictOpTable:
    """A program's op table over plain ``{bucket: {site: fn}}`` dicts, wrapped in place (``wrap(hook)``)."""

    def __init__(self, tables):
        self.tables = tables

    def wrap(self, hook):
        for bucket, ops in self.tables.items():
            for site in list(ops):
                ops[site] = hook(site, bucket, ops[site])
        return sum(len(ops) for ops in self.tables.values())


class FakeDriver:
    """A capture in progress is (id, graph=1); 'launching' a kernel adds a node."""

    def __init__(self) -> None:
        self.capture_id: int | None = None
        self.nodes = 0

    def capturing_graph(self, stream: int):
        return None if self.capture_id is None else (self.capture_id, 1)

    def kernel_nodes(self, graph: int) -> int:
        assert graph == 1
        return self.nodes


def _op(drv: FakeDriver, kernels: int):
    def fn(*_a, **_k):
        drv.nodes += kernels
        return kernels
    return fn


def test_sites_count_only_under_capture_and_nested_once():
    drv = FakeDriver()
    census = KernelCensus(driver=drv)
    assert census.available
    a = census.wrap("kda+moe/attn.in_proj", 1, _op(drv, 2))
    assert a() == 2 and census.kernels(1) is None  # eager: nothing recorded
    drv.capture_id = 7

    def outer():
        drv.nodes += 1
        return inner()
    inner = census.wrap("inner", 1, _op(drv, 3))
    o = census.wrap("kda+moe/moe.shared", 1, outer)
    a()
    o()
    assert census.kernels(1) == {"kda+moe/attn.in_proj": 2, "kda+moe/moe.shared": 4}  # inner counted in outer
    # a new capture of the same bucket restarts its count; other buckets are separate
    drv.capture_id = 8
    a()
    assert census.kernels(1) == {"kda+moe/attn.in_proj": 2}
    census.wrap("x.allreduce", 2, _op(drv, 1))()
    assert census.kernels(2) == {"x.allreduce": 1}


def test_instrument_wraps_every_bound_op_and_sets_program_census():
    drv = FakeDriver()
    drv.capture_id = 1

    ops = {1: {"a": _op(drv, 1), "b.allreduce": _op(drv, 1)}, 4: {"a": _op(drv, 5)}}

    class Prog:
        census = None
        op_table = DictOpTable(ops)

    p = Prog()
    census = KernelCensus(driver=drv)
    assert census.instrument(p) == 3 and p.census is census
    ops[1]["a"](), ops[1]["b.allreduce"](), ops[4]["a"]()
    assert census.kernels(1) == {"a": 1, "b.allreduce": 1} and census.kernels(4) == {"a": 5}


def test_a_driver_error_stops_the_census_without_breaking_the_step():
    drv = FakeDriver()
    drv.capture_id = 3
    census = KernelCensus(driver=drv)
    census.wrap("a", 1, _op(drv, 1))()

    def broken(graph):
        raise RuntimeError("cuGraphGetNodes failed (CUresult 1)")
    drv.kernel_nodes = broken
    assert census.wrap("b", 1, _op(drv, 2))() == 2  # the op still ran
    assert census.kernels(1) is None and not census.available and "CUresult 1" in census.error


def test_without_driver_nothing_is_recorded():
    census = KernelCensus(driver=None)
    if census.available:  # a CUDA machine found libcuda: that case is the GPU test below
        pytest.skip("CUDA driver present")
    assert census.wrap("s", 1, lambda: 3)() == 3 and census.kernels(1) is None


class FakeCuda:
    """cuGraphGetNodes / cuGraphNodeGetType over a list of node types; like the driver, a node array of
    length 0 is an invalid value."""

    def __init__(self, types: list[int]) -> None:
        self.types = types

    def cuGraphGetNodes(self, graph, nodes, num):
        n = num._obj
        if nodes is None:
            n.value = len(self.types)
            return 0
        if n.value == 0:
            return 1  # CUDA_ERROR_INVALID_VALUE
        for i in range(n.value):
            nodes[i] = i + 1
        return 0

    def cuGraphNodeGetType(self, node, out):
        out._obj.value = self.types[node.value - 1]
        return 0


def test_node_count_of_an_empty_graph_under_capture_and_by_type():
    from latency_specialized.runtime.census import _Driver
    from latency_specialized.runtime.graph_runner import count_nodes

    counts: dict[str, int] = {}
    count_nodes(FakeCuda([]), 1, counts)  # the first site of a capture sees an empty graph
    assert counts == {}
    count_nodes(FakeCuda([0, 1, 0, 7]), 1, counts)
    assert counts == {"kernel": 2, "memcpy": 1, "event_record": 1}
    drv = _Driver.__new__(_Driver)  # the census's shim over the same walk
    drv._lib = FakeCuda([0, 2, 0])
    assert drv.kernel_nodes(1) == 2
    drv._lib = FakeCuda([])
    assert drv.kernel_nodes(1) == 0


def test_communication_sites_and_split():
    assert is_communication("kda+moe/attn.allreduce") and is_communication("kda+moe/moe.latent_allreduce")
    assert is_communication("lm_head.all_gather") and is_communication("kda+moe/moe.all_gather")
    assert not is_communication("kda+moe/moe.router") and not is_communication("allreduce_norm")
    comm, rest = split_communication({"a/attn.allreduce": 1, "a/moe.all_gather": 2, "a/attn.kda": 1})
    assert (comm, rest) == (3, 1)


def test_per_layer_site_kernels_and_split():
    k = Measured("ours[3]", 3, nodes={"kernel": 3 * 17 + 9},
                 sites={"kda+moe/attn.allreduce": 6, "kda+moe/moe.all_gather": 6, "kda+moe/attn.kda": 3,
                        "lm_head": 1},
                 rounds=[300.0, 302.0])
    one = Measured("ours[1]", 1, nodes={"kernel": 17 + 9},
                   sites={"kda+moe/attn.allreduce": 2, "kda+moe/moe.all_gather": 2, "kda+moe/attn.kda": 1,
                          "lm_head": 1},
                   rounds=[100.0, 101.0])
    rec = per_layer(k, one)
    assert rec["kernels"] == 17
    assert rec["site_kernels"] == {"kda+moe/attn.allreduce": 2, "kda+moe/moe.all_gather": 2,
                                   "kda+moe/attn.kda": 1, "lm_head": 0}
    assert rec["comm_kernels"] == 4 and rec["kernels_no_comm"] == 13
    assert rec["unattributed_kernels"] == 17 - 5
    stock = per_layer(Measured("stock", 3, nodes={"kernel": 75}, rounds=[1.0]), None, no_comm_sites=True)
    assert stock["kernels"] == 25 and stock["comm_kernels"] == 0 and stock["kernels_no_comm"] == 25
    unknown = add_kernel_split(per_layer(Measured("x", 3, nodes={"kernel": 75}, rounds=[1.0]), None))
    assert "kernels_no_comm" not in unknown


def test_report_shows_both_counts_and_the_site_table():
    ours = {"us": 100.0, "kernels": 17.0, "kernels_no_comm": 12.0, "unattributed_kernels": 0.0,
            "site_kernels": {"kda+moe/attn.allreduce": 1.0, "kda+moe/attn.kda": 1.0, "lm_head": 0.0}}
    result = {"config": {}, "cells": [{"kind": "kda", "batch": 1, "context": None, "ours": ours,
                                       "stock": {"us": 150.0, "kernels": 25.0}, "roofline": {"us": 60.0}}]}
    md = report.to_markdown(result)
    assert "| 17 (12) |" in md
    assert "| attn.allreduce | 1 |" in md and "| attn.kda | 1 |" in md and "| **all** | 17 |" in md
    assert "| lm_head |" not in md  # a site without kernels in any cell (cancelled per layer) is left out


@pytest.mark.gpu
def test_census_counts_real_graph_kernels_per_site():
    census = KernelCensus()
    assert census.available, census.error
    x = torch.randn(64, device="cuda")
    one = census.wrap("one", 1, lambda: x.add_(1.0))
    two = census.wrap("two.allreduce", 1, lambda: x.mul_(2.0).add_(0.5))
    for _ in range(2):  # warm-up, eager: not counted
        one(), two()
    assert census.kernels(1) is None
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        one()
        two()
        x.sub_(1.0)  # between sites
    assert census.kernels(1) == {"one": 1, "two.allreduce": 2}
    before = x.clone()
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(x, ((before + 1.0) * 2.0 + 0.5) - 1.0)
