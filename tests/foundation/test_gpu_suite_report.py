"""The GPU suite's bookkeeping on the CPU: the out-of-memory failures `h200_suite.sh` reruns (and only those), the
per-test records it merges, and the compile clock that fills them (`testing.compile_clock`)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.script_loader import load_script

report = load_script("benchmarks/scripts/gpu_suite_report.py")

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.ops.test_moe_experts_mma_gpu" name="test_a[kimi_tp8-16]" time="3.1">
  <failure message="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 12.50 GiB">trace</failure>
</testcase>
<testcase classname="tests.ops.test_moe_experts_mma_gpu" name="test_b[dsv4_like-1]" time="0.0">
  <error message="failed on setup with &quot;RuntimeError: boom&quot;">E CUBLAS_STATUS_ALLOC_FAILED</error>
</testcase>
<testcase classname="tests.ops.test_moe_experts_mma_gpu" name="test_c[1]" time="1.0">
  <failure message="AssertionError: 0.02 &gt; 0.015">assert rel &lt;= REL_TOL</failure>
</testcase>
<testcase classname="tests.ops.test_moe_experts_mma_gpu" name="test_d[1]" time="1.0"/>
<testcase classname="tests.foundation.test_cli.TestBench" name="test_e" time="1.0">
  <failure message="x">RuntimeError: CUDA error: out of memory</failure>
</testcase>
</testsuite></testsuites>"""


def test_only_allocation_failures_are_rerun_with_their_node_ids(tmp_path):
    (tmp_path / "tests/ops").mkdir(parents=True)
    (tmp_path / "tests/ops/test_moe_experts_mma_gpu.py").write_text("")
    (tmp_path / "tests/foundation").mkdir(parents=True)
    (tmp_path / "tests/foundation/test_cli.py").write_text("")
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    assert report.oom_failures([junit], root=tmp_path) == [
        "tests/ops/test_moe_experts_mma_gpu.py::test_a[kimi_tp8-16]",
        "tests/ops/test_moe_experts_mma_gpu.py::test_b[dsv4_like-1]",   # a fixture's allocation (setup error)
        "tests/foundation/test_cli.py::TestBench::test_e"]               # a test class keeps its name


def test_node_id_of_a_real_test_file():
    assert report.nodeid("tests.foundation.test_gpu_suite_report", "test_x[1]") == \
        "tests/foundation/test_gpu_suite_report.py::test_x[1]"


def test_merge_reads_both_record_forms_and_sums_compile_time(tmp_path, capsys):
    (tmp_path / "peaks_gw0.json").write_text(json.dumps({"a.py::t1": {"gib": 1.5, "s": 10.0, "triton_s": 6.0,
                                                                      "triton_n": 3, "triton_hits": 1, "cute_s": 2.0,
                                                                      "cute_n": 1}}))
    (tmp_path / "peaks_gw1.json").write_text(json.dumps({"b.py::t2": 7.25}))   # before the compile clock
    out = tmp_path / "merged.json"
    report.main(["merge", str(tmp_path), str(out)])
    merged = json.loads(out.read_text())
    assert list(merged) == ["b.py::t2", "a.py::t1"] and merged["b.py::t2"] == {"gib": 7.25}
    assert not list(tmp_path.glob("peaks_*.json"))          # merged files go: $OUT returns at most 8 files
    text = capsys.readouterr().out
    assert "2 tests, 10 s of test time: compiling 6 s Triton (3 kernels, 1 cache hits), 2 s CuTe DSL (1 kernels)" \
        in text
    assert "compile     8.0 s  a.py" in text


def test_compile_clock_counts_triton_compiles_and_hits(tmp_path, monkeypatch):
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from latency_specialized.testing.compile_clock import CompileClock, delta

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    monkeypatch.setattr(triton.knobs.compilation, "listener", None)

    @triton.jit
    def add_one(x_ptr, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(x_ptr + o, tl.load(x_ptr + o) + 1)

    clock = CompileClock()
    assert clock.install()
    before = clock.snapshot()
    src = ASTSource(fn=add_one, signature={"x_ptr": "*fp32", "N": "constexpr"}, constexprs={"N": 16})
    for _ in range(2):
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    d = delta(clock.snapshot(), before)
    assert (d["triton_n"], d["triton_hits"]) == (1, 1) and d["triton_s"] > 0


def test_compile_clock_reads_cute_compiles_not_disk_loads(monkeypatch):
    from latency_specialized.kernels import compile_cache
    from latency_specialized.testing.compile_clock import CompileClock, delta

    clock = CompileClock()                     # not installed: Triton counters stay 0
    before = clock.snapshot()
    monkeypatch.setattr(compile_cache, "COMPILE_LOG", compile_cache.COMPILE_LOG + [
        ("gemv(7168,)@sm_90a", 1.5), ("gemv(4096,)@sm_90a (disk)", 0.01),
        ("disk load failed for ('x',): OSError: y", 0.0), ("kda_decode(cfg)@sm_90a", 2.25)])
    d = delta(clock.snapshot(), before)
    assert d == {"triton_s": 0, "triton_n": 0, "triton_hits": 0, "cute_s": 3.75, "cute_n": 2}


def test_the_protocol_records_memory_seconds_and_compile_time(tmp_path, monkeypatch):
    """With ``LS_GPU_PEAKS`` set, a GPU test's record gets its peak memory, its seconds and the compile deltas, and the
    worker's file is written at the session's end (the hook is driven by hand: no GPU here)."""
    import contextlib
    from types import SimpleNamespace

    import torch

    import tests.conftest as conftest
    from latency_specialized.kernels import compile_cache

    monkeypatch.setattr(conftest, "_cuda_available", lambda: True)
    monkeypatch.setattr(conftest, "_gpu_gib", lambda: {})
    monkeypatch.setattr(conftest, "_PEAKS", {})
    monkeypatch.setattr(conftest, "_CLOCK", None)
    monkeypatch.setattr(conftest, "_RECORDER", None)
    monkeypatch.setattr(compile_cache, "UNIT_LOG", None)
    if importlib.util.find_spec("triton") is not None:   # the clock and recorder hook Triton: put it back after
        import triton
        import triton.runtime.jit as jit

        monkeypatch.setattr(triton.knobs.compilation, "listener", triton.knobs.compilation.listener)
        monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", triton.knobs.runtime.jit_cache_hook)
        monkeypatch.setattr(jit, "serialize_specialization_data", jit.serialize_specialization_data)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 3 << 29)
    monkeypatch.setattr(compile_cache, "COMPILE_LOG", list(compile_cache.COMPILE_LOG))
    monkeypatch.setenv("LS_GPU_PEAKS", str(tmp_path))

    class Item(SimpleNamespace):
        def get_closest_marker(self, name):
            return object() if name == "gpu" else None

    hook = conftest.pytest_runtest_protocol(Item(nodeid="t.py::test_gpu"), None)
    next(hook)
    compile_cache.COMPILE_LOG.append(("kda_decode(cfg)@sm_90a", 1.25))   # the test compiles one CuTe DSL kernel
    with contextlib.suppress(StopIteration):
        next(hook)
    rec = conftest._PEAKS["t.py::test_gpu"]
    assert rec["gib"] == 1.5 and rec["s"] >= 0 and (rec["cute_s"], rec["cute_n"]) == (1.25, 1)
    conftest.pytest_sessionfinish(None, 0)
    written = json.loads(next(tmp_path.glob("peaks_*.json")).read_text())
    assert written["t.py::test_gpu"] == rec
    from latency_specialized.testing import compile_records

    assert compile_records.load(next(tmp_path.glob("compile_records_*.json"))) == {"triton": [], "cute": []}


def test_records_merges_the_workers_compile_records(tmp_path, capsys):
    from latency_specialized.testing import compile_records

    compile_records.save({"triton": [{"fn": "m:a", "data": "1"}, {"fn": "m:b", "data": "2"}], "cute": []},
                         tmp_path / "compile_records_gw0.json")
    compile_records.save({"triton": [{"fn": "m:a", "data": "1"}], "cute": [{"fn": "k:c", "args": [], "kwargs": {}}]},
                         tmp_path / "compile_records_gw1.json")
    out = tmp_path / "merged.json.gz"
    report.main(["records", str(tmp_path), str(out)])
    merged = compile_records.load(out)
    assert [r["fn"] for r in merged["triton"]] == ["m:a", "m:b"] and len(merged["cute"]) == 1
    assert not list(tmp_path.glob("compile_records_*.json"))
    assert "compile records of 2 workers" in capsys.readouterr().out
