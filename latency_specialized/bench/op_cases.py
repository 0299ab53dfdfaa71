"""The op-bench case API: settings, one case, the case/runner registries, graph timing.

Case modules (``ops_bench_gemm_norm.py``, ``prefetch_bench.py``, ``ops_bench_moe_kda.py``) import
this module and register their cases; ``ops_bench.py`` loads them by name and runs what they
registered (it re-exports these names: ``from latency_specialized.bench.ops_bench import OpCase``
keeps working). Method and how to add cases: ``ops_bench.py``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from latency_specialized.hardware import roofline_bandwidth


@dataclass(frozen=True)
class BenchSettings:
    """What to sweep and how to time it."""

    model: str = "kimi_k3"
    """Adapter whose per-rank shapes are benchmarked."""
    tps: tuple[int, ...] = (8, 16)
    """Tensor-parallel shards (per-rank shapes)."""
    ms: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Token counts M."""
    rotate_bytes: int = int(2.5 * 60e6)
    """Input sets rotate until their bytes exceed this (L2 is 60 MB)."""
    max_sets: int = 512
    """Cap on rotated input sets (tiny ops)."""
    min_calls: int = 32
    """Calls per captured graph (the rotation is repeated to reach it)."""
    groups: int = 11
    """Timed groups of graph replays; the median is reported."""
    group_us: float = 600.0
    """Target duration of one timed group."""
    quick: bool = False
    """Fewer kernel configs (smoke runs)."""
    shapes: tuple[tuple[int, int], ...] = ()
    """gemm: only these (N, K) of the model's shapes (empty: all of them)."""
    hbm_bytes_per_s: float = field(default_factory=roofline_bandwidth)


@dataclass
class OpCase:
    """One benchmark cell: an op at one shape and token count, with its variants."""

    family: str
    """Group of the results file (ops_<family>.json)."""
    op: str
    """Op label, e.g. 'kda+moe/attn.in_proj (tp8)'."""
    shape: dict[str, int]
    """Static sizes shown in the table."""
    m: int
    """Tokens (rows) per call."""
    bytes: int
    """HBM bytes one call must move at least (roofline = bytes / bandwidth)."""
    make: Callable[[int], dict[str, Any]]
    """Input set i (tensors on the GPU)."""
    variants: dict[str, Callable[[dict[str, Any]], Any]]
    """name -> fn(inputs); must be graph-capturable and return the output tensor."""
    baseline: str = "torch"
    """The variant that stands for stock (cuBLAS / torch)."""
    reference: Callable[[dict[str, Any]], Any] | None = None
    """fp32 oracle on one input set; None: no check."""
    tolerance: float = 2e-2
    """Max relative error ||out - ref|| / ||ref|| of a correct variant."""
    poison: tuple[str, ...] = ("out",)
    """Input keys filled with NaN before the correctness run (every element must be written)."""
    compile_units: list[tuple[Callable[..., Any], tuple]] = field(default_factory=list)
    """(compile function, args) to precompile in parallel before timing."""
    meta: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per variant: {'impl': implementation name, 'config': {...}} (for dispatch tables)."""
    checks: dict[str, Callable[[dict[str, Any]], Any]] = field(default_factory=dict)
    """Per-variant reference overriding ``reference`` (context variants named 'ref: ...' that
    compute something else, shown for comparison only)."""


CaseFactory = Callable[[BenchSettings], Iterable[OpCase]]
Runner = Callable[[BenchSettings], list[dict[str, Any]]]
CASES: dict[str, list[CaseFactory]] = {}
RUNNERS: dict[str, Runner] = {}


def register_cases(family: str) -> Callable[[CaseFactory], CaseFactory]:
    """Decorator: ``fn(settings) -> iterable of OpCase`` joins ``family`` (idempotent per function)."""

    def deco(fn: CaseFactory) -> CaseFactory:
        lst = CASES.setdefault(family, [])
        if all(f.__qualname__ != fn.__qualname__ or f.__module__ != fn.__module__ for f in lst):
            lst.append(fn)
        return fn

    return deco


def register_runner(family: str) -> Callable[[Runner], Runner]:
    """Decorator for a family with its own protocol: ``fn(settings) -> rows`` (JSON-able dicts)."""

    def deco(fn: Runner) -> Runner:
        RUNNERS[family] = fn
        return fn

    return deco


def graph_time_us(call_all: Callable[[], None], calls: int, settings: BenchSettings) -> float:
    """Median device time per call of ``call_all`` (which makes ``calls`` calls), from graph replays."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call_all()  # eager warm-up (compiles, allocator) outside the graph
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call_all()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    g.replay()
    e1.record()
    e1.synchronize()
    one = max(e0.elapsed_time(e1) * 1000.0, 1.0)
    reps = max(1, min(200, int(settings.group_us / one)))
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
           for _ in range(settings.groups)]
    for a, b in evs:
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
    torch.cuda.synchronize()
    per_call = [a.elapsed_time(b) * 1000.0 / (reps * calls) for a, b in evs]
    del g
    return statistics.median(per_call)


def n_sets(case_bytes: int, settings: BenchSettings) -> int:
    return max(2, min(settings.max_sets, math.ceil(settings.rotate_bytes / max(case_bytes, 1))))
