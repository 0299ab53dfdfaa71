"""Central test configuration.

* GPU tests are skipped (with the reason) where torch sees no CUDA.
* Triton-interpreter cases (marker ``interpreter_case``) are collected only in a process started with
  ``TRITON_INTERPRET=1``, and their drivers (``interpreter_driver``) only in one without: elsewhere they
  are deselected, not skipped - the driver runs the cases in a child process (``tests/interpret.py``).
* Under pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup``): each worker uses one torch thread
  (``OMP_NUM_THREADS=1`` for its children too), so two workers do not oversubscribe two cores; tests that
  share a module-scoped fixture stay on one worker (``xdist_group`` = their file; so do the multi-process GPU
  worlds of ``tests/comm``), the matrix's TP>1 cells
  share one gloo pool per TP (group ``gloo-tpN``), and the interpreter drivers (long child runs) are
  scheduled first; then the GPU tests that took longest on the H200 (``tests/gpu_durations.json``, from the
  committed junit files by ``benchmarks/scripts/gpu_durations.py``), longest first, so that no worker starts one
  near the end of a time-boxed device call.
* GPU tests listed in ``tests/gpu_memory.json`` (node id prefix -> GiB) start only once that much fits the memory
  ledger the matrix cells use (``testing.gpu_share``: half the card, shared by every process on it), and hand their
  cached memory back after: the suite's workers then share a smaller card without running each other out of memory
  (an 80 GB H100 did with 6 workers in session 37). The figures: the peaks below where measured, else estimates from
  the tests' tensor sizes.
* ``LS_GPU_PEAKS=<dir>`` (``benchmarks/scripts/h200_suite.sh`` sets it): per GPU test, the peak of the memory its
  process holds on the GPU (``gib``: torch's reserved bytes, fixtures of earlier tests included: what the workers
  sharing the card compete for), its seconds (``s``, setup to teardown) and the seconds of them spent compiling
  (``testing.compile_clock``: Triton and CuTe DSL, with counts) go to ``<dir>/peaks_<worker>.json``: the data for
  sizing the suite's workers per card and for seeing what a cold compile cache costs; and every Triton and CuTe DSL
  kernel the process compiled to ``<dir>/compile_records_<worker>.json`` (``testing.compile_records``: the next
  machine compiles them on all its cores before the suite starts).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest

from tests.interpret import CASE, DRIVER, INTERPRETING


_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _XDIST_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported; children inherit it


def pytest_configure(config):
    if _XDIST_WORKER:
        try:
            import torch

            torch.set_num_threads(1)
        except Exception:  # noqa: BLE001 - torch missing: nothing to pin
            pass
    config.addinivalue_line("markers", f"{CASE}: runs only under TRITON_INTERPRET=1 from the process start "
                                       "(collected there only; its driver test runs it in a child process)")
    config.addinivalue_line("markers", f"{DRIVER}: runs {CASE} tests in a TRITON_INTERPRET=1 child process "
                                       "(not collected in an interpreting process)")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - torch missing means no CUDA
        return False


def _route_interpreter_tests(config, items) -> None:
    """Deselect what cannot run in this process: the interpreter cases without TRITON_INTERPRET=1 from
    the start, their drivers with it."""
    absent = DRIVER if INTERPRETING else CASE
    dropped = [item for item in items if item.get_closest_marker(absent) is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item.get_closest_marker(absent) is None]


def _gpu_seconds() -> dict[str, float]:
    """H200 seconds of the long GPU tests by node id (``tests/gpu_durations.json``; empty where it is missing)."""
    path = Path(__file__).with_name("gpu_durations.json")
    return json.loads(path.read_text()) if path.exists() else {}


def _xdist_layout(config, items) -> None:
    """Interpreter drivers first (the longest single tests), then the long GPU tests, longest first;
    ``xdist_group`` marks (used by ``--dist loadgroup``) for the tests that share a module-scoped fixture (by file)
    and for the matrix's TP>1 program cells (one gloo pool per TP and group). Order and marks are the same in every
    worker."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    seconds = _gpu_seconds()
    # stable: the rest keep their order
    items.sort(key=lambda item: (item.get_closest_marker(DRIVER) is None, -seconds.get(item.nodeid, 0.0)))
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        cell = getattr(getattr(item, "callspec", None), "params", {}).get("program_cell")
        group = None
        if cell is not None and getattr(cell, "tp", 1) > 1:
            group = f"gloo-tp{cell.tp}"
        elif item.nodeid.startswith("tests/comm/") and item.get_closest_marker("gpu") is not None:
            group = item.nodeid.split("::")[0]  # one multi-process GPU world at a time per file
        else:
            info = getattr(item, "_fixtureinfo", None)
            defs = info.name2fixturedefs.values() if info is not None else ()
            if any(getattr(d, "scope", "function") == "module" for ds in defs for d in ds):
                group = item.nodeid.split("::")[0]
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


_PEAKS: dict[str, dict[str, float]] = {}
_CLOCK = None
"""``testing.compile_clock.CompileClock`` of this process once a recorded GPU test ran (``LS_GPU_PEAKS``)."""
_RECORDER = None
"""``testing.triton_specs.SpecRecorder`` of this process (same condition): the Triton kernels it compiled (and
``testing.cute_units`` records the CuTe DSL ones)."""


def _recording_clock():
    """The compile clock of this process, made with the kernel recorders at the first recorded GPU test."""
    global _CLOCK, _RECORDER
    if _CLOCK is None:
        from latency_specialized.testing import cute_units
        from latency_specialized.testing.compile_clock import CompileClock
        from latency_specialized.testing.triton_specs import SpecRecorder

        _CLOCK, _RECORDER = CompileClock(), SpecRecorder()
        _CLOCK.install()
        _RECORDER.install()
        cute_units.start()
    return _CLOCK


def _gpu_gib() -> dict[str, float]:
    """GiB the memory-heavy GPU tests are admitted with, by node id prefix (``tests/gpu_memory.json``)."""
    path = Path(__file__).with_name("gpu_memory.json")
    return json.loads(path.read_text()) if path.exists() else {}


def _admission_gib(nodeid: str, table: dict[str, float]) -> float:
    """The longest matching prefix's GiB (0: not a listed test)."""
    hits = [k for k in table if nodeid.startswith(k)]
    return float(table[max(hits, key=len)]) if hits else 0.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    on_gpu = item.get_closest_marker("gpu") is not None and _cuda_available()
    record = on_gpu and bool(os.environ.get("LS_GPU_PEAKS"))
    gib = _admission_gib(item.nodeid, _gpu_gib()) if on_gpu else 0.0
    gate = contextlib.nullcontext()
    if gib:
        from latency_specialized.testing.gpu_share import admitted

        gate = admitted(int(gib * 2 ** 30), label=item.nodeid)
    if record:
        import time

        import torch

        from latency_specialized.testing.compile_clock import delta

        torch.cuda.reset_peak_memory_stats()
        clock = _recording_clock()
    with gate:
        if record:  # after the ledger admitted it: the seconds are the test's, not its wait
            before, t0 = clock.snapshot(), time.perf_counter()
        yield
        if gib:
            from latency_specialized.testing.gpu_share import release_cached_memory

            release_cached_memory()
    if record:
        _PEAKS[item.nodeid] = {"gib": round(torch.cuda.max_memory_reserved() / 2 ** 30, 2),
                               "s": round(time.perf_counter() - t0, 2), **delta(clock.snapshot(), before)}


def pytest_sessionfinish(session, exitstatus):
    folder = os.environ.get("LS_GPU_PEAKS")
    if folder and _PEAKS:
        Path(folder).mkdir(parents=True, exist_ok=True)
        path = Path(folder) / f"peaks_{_XDIST_WORKER or 'main'}.json"
        path.write_text(json.dumps(_PEAKS, indent=0))
    if folder and _RECORDER is not None:
        from latency_specialized.testing import compile_records, cute_units

        Path(folder).mkdir(parents=True, exist_ok=True)
        compile_records.save({"triton": _RECORDER.values(), "cute": cute_units.recorded()},
                             Path(folder) / f"compile_records_{_XDIST_WORKER or 'main'}.json")


def pytest_collection_modifyitems(config, items):
    _route_interpreter_tests(config, items)
    _xdist_layout(config, items)
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `make test-gpu` (pytest -m gpu) on the H200")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
