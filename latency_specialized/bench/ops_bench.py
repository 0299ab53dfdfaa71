"""Per-op micro-benchmarks on one GPU: our kernels vs cuBLAS/torch, against the HBM roofline.

Method (PERF.md): every variant runs inside a CUDA graph that calls it over a rotation of input
sets whose weights together exceed the L2 several times (``rotate_bytes``, default 2.5 x 60 MB),
so each call reads its weights from HBM; the graph is warmed up, then replayed in groups timed
with CUDA events (median of the groups); every variant is timed twice, in two separate passes,
and both figures are kept. Before timing, each variant's output on a NaN-poisoned buffer is
compared with the case's fp32 reference: a wrong variant is reported and never timed.

**Adding cases** (one function per op family, from any module, e.g.
``latency_specialized/bench/ops_bench_moe_kda.py``)::

    from latency_specialized.bench.op_cases import BenchSettings, OpCase, register_cases

    @register_cases("moe")
    def moe_cases(settings: BenchSettings):
        for m in settings.ms:
            yield OpCase(family="moe", op="experts", shape={"E": 896, "K": 3584}, m=m,
                         bytes=...,                      # HBM bytes one call must move (roofline)
                         make=lambda i: {...},           # input set i (allocate lazily, on cuda)
                         variants={"torch": ..., "cutedsl": ...},   # fn(inputs) -> output
                         baseline="torch", reference=lambda d: ...)

and list the module in ``CASE_MODULES`` below (a missing module is skipped with a note).
``latency-specialized bench-ops --ops moe`` then runs it and writes ``ops_moe.json/.md``.
Families with their own protocol (the L2-prefetch experiment) register a whole runner with
:func:`register_runner` instead.
"""

from __future__ import annotations

import importlib
import json
import math
import statistics
import time
import traceback
from pathlib import Path
from typing import Any, Callable

# The case API (what case modules import) lives in bench/op_cases.py, so that the case modules this
# module loads by name do not import it back; re-exported here.
from latency_specialized.bench.op_cases import (CASES, RUNNERS, BenchSettings, CaseFactory,  # noqa: F401
                                                OpCase, Runner, graph_time_us, n_sets, register_cases,
                                                register_runner)

CASE_MODULES: tuple[str, ...] = (
    "latency_specialized.bench.ops_bench_gemm_norm",
    "latency_specialized.bench.prefetch_bench",
    "latency_specialized.bench.ops_bench_moe_kda",
)

_LOADED: list[str] = []


def load_case_modules() -> list[str]:
    """Import CASE_MODULES; returns notes about the ones that are not there."""
    notes = []
    for name in CASE_MODULES:
        if name in _LOADED:
            continue
        try:
            importlib.import_module(name)
            _LOADED.append(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            notes.append(f"{name} not present: skipped")
    return notes


def families() -> list[str]:
    load_case_modules()
    return sorted(set(CASES) | set(RUNNERS))


# ----------------------------------------------------------------------------------- timing
def _rel_err(out: Any, ref: Any) -> float:
    import torch

    o, r = out.float(), ref.float()
    if not torch.isfinite(o).all():
        return math.inf
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


def disk_tier_selftest(log: Callable[[str], None] = print) -> bool:
    """On the GPU: kernels loaded back from the disk tier compute exactly what fresh compiles compute.

    If not (or if loading fails), the disk tier is switched off for this process - compiles then
    happen serially here, slower but never wrong.
    """
    import os

    import torch

    from latency_specialized.kernels import compile_cache, gemm_gemv, rmsnorm

    if compile_cache.disk_dir() is None:
        return False
    x = torch.randn(3, 256, device="cuda").to(torch.bfloat16)
    r = torch.randn(3, 256, device="cuda").to(torch.bfloat16)
    w = torch.randn(256, device="cuda").to(torch.bfloat16)
    wt = torch.randn(100, 256, device="cuda").to(torch.bfloat16)

    def run_both() -> list:
        y = rmsnorm.rmsnorm_cute(x, w, 1e-5, residual=r, config=rmsnorm.NormConfig(cluster=2))
        g = gemm_gemv.gemm_gemv(x[:2], wt, config=gemm_gemv.GemvConfig())
        return [y[0], y[1], g]

    try:
        fresh = run_both()
        compile_cache.forget()
        n = len(compile_cache.COMPILE_LOG)
        loaded = run_both()
        from_disk = sum(1 for d, _ in compile_cache.COMPILE_LOG[n:] if d.endswith("(disk)"))
        same = all(torch.equal(a, b) for a, b in zip(fresh, loaded))
        if same and from_disk == 2:
            log("disk tier self-test: ok (2 kernels loaded back, identical results)")
            return True
        log(f"disk tier self-test FAILED (from disk: {from_disk}, identical: {same}): tier off")
    except Exception as e:  # noqa: BLE001
        log(f"disk tier self-test FAILED ({type(e).__name__}: {e}): tier off")
    os.environ.pop(compile_cache.CACHE_DIR_ENV, None)
    compile_cache.forget()
    return False


def run_case(case: OpCase, settings: BenchSettings, passes: int = 2) -> dict[str, Any]:
    """Check then time every variant of one case; one row of the results."""
    import torch

    sets = n_sets(case.bytes, settings)
    inputs = [case.make(i) for i in range(sets)]
    loops = max(1, math.ceil(settings.min_calls / sets))
    row: dict[str, Any] = {"family": case.family, "op": case.op, "shape": case.shape, "m": case.m,
                           "bytes": case.bytes, "floor_us": case.bytes / settings.hbm_bytes_per_s * 1e6,
                           "sets": sets, "calls_per_graph": sets * loops, "baseline": case.baseline,
                           "variants": {}}
    ref = case.reference(inputs[0]) if case.reference is not None else None
    ok_variants = []
    for name, fn in case.variants.items():
        v: dict[str, Any] = {"runs_us": [], **case.meta.get(name, {})}
        row["variants"][name] = v
        try:
            for key in case.poison:
                if key in inputs[0]:
                    inputs[0][key].fill_(float("nan"))
            out = fn(inputs[0])
            torch.cuda.synchronize()
            vref = case.checks[name](inputs[0]) if name in case.checks else ref
            if vref is not None:
                err = _rel_err(out, vref)
                v["rel_err"] = err
                if not err <= case.tolerance:
                    v["error"] = f"wrong result: rel err {err:.3g} > {case.tolerance}"
                    continue
            ok_variants.append(name)
        except Exception as e:  # noqa: BLE001 - one broken variant must not stop the sweep
            v["error"] = f"{type(e).__name__}: {e}"
            v["trace"] = traceback.format_exc(limit=4)
    for _ in range(passes):
        for name in ok_variants:
            fn = case.variants[name]
            v = row["variants"][name]
            if "error" in v:
                continue

            def call_all(fn=fn) -> None:
                for _ in range(loops):
                    for d in inputs:
                        fn(d)

            try:
                v["runs_us"].append(graph_time_us(call_all, sets * loops, settings))
            except Exception as e:  # noqa: BLE001
                v["error"] = f"timing failed: {type(e).__name__}: {e}"
                v["trace"] = traceback.format_exc(limit=4)
    for v in row["variants"].values():
        if v["runs_us"]:
            v["us"] = statistics.mean(v["runs_us"])
            v["roofline"] = row["floor_us"] / v["us"]
    best = {n: v["us"] for n, v in row["variants"].items() if "us" in v}
    if best:
        row["best"] = min(best, key=best.get)
    del inputs
    return row


def run_family(family: str, settings: BenchSettings, *, precompile_jobs: int = 0,
               log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """All cases of ``family`` (or its runner): precompile, then check and time each."""
    load_case_modules()
    if family in RUNNERS:
        return RUNNERS[family](settings)
    if family not in CASES:
        from latency_specialized.errors import UserError

        raise UserError(f"no benchmark cases for '{family}': use one of {', '.join(families())}")
    cases = [c for f in CASES[family] for c in f(settings)]
    units = [u for c in cases for u in c.compile_units]
    if units:
        from latency_specialized.kernels import compile_cache

        t0 = time.perf_counter()
        res = compile_cache.precompile(units, jobs=precompile_jobs or None)
        bad = [r for r in res if r[2]]
        log(f"[{family}] precompiled {len(res)} kernels in {time.perf_counter() - t0:.1f} s"
            + (f", {len(bad)} failed: {bad[:3]}" if bad else ""))
    rows = []
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        row = run_case(case, settings)
        rows.append(row)
        cases[i] = None  # type: ignore[call-overload]  # free its inputs
        log(f"[{family}] {case.op} M={case.m}: " + ", ".join(
            f"{n}={v['us']:.2f}us" if "us" in v else f"{n}=ERR" for n, v in row["variants"].items())
            + f"  ({time.perf_counter() - t0:.1f}s)")
    return rows


# ----------------------------------------------------------------------------------- output
def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def to_markdown(family: str, rows: list[dict[str, Any]], header: str = "") -> str:
    """One table: per op/shape/M, the baseline, our best variant, speedup, roofline fractions."""
    lines = [f"# ops bench: {family}", ""]
    if header:
        lines += [header, ""]
    lines += ["| op | shape | M | MB | floor us | baseline us | (roof) | best ours | us | (roof) | speedup | errors |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "variants" not in r:
            continue
        base = r["variants"].get(r["baseline"], {})
        ours = {n: v for n, v in r["variants"].items()
                if n != r["baseline"] and not n.startswith("ref:") and "us" in v}
        bn = min(ours, key=lambda n: ours[n]["us"]) if ours else None
        b = ours.get(bn, {}) if bn else {}
        errs = [n for n, v in r["variants"].items() if "error" in v]
        shape = " ".join(f"{k}={v}" for k, v in r["shape"].items())
        speed = base["us"] / b["us"] if "us" in base and "us" in b else None
        lines.append(f"| {r['op']} | {shape} | {r['m']} | {r['bytes'] / 1e6:.1f} | {r['floor_us']:.2f} | "
                     f"{_fmt(base.get('us'), '.2f')} | {_fmt(base.get('roofline'), '.0%')} | {bn or '-'} | "
                     f"{_fmt(b.get('us'), '.2f')} | {_fmt(b.get('roofline'), '.0%')} | {_fmt(speed, '.2f')} | "
                     f"{', '.join(errs) or ''} |")
    lines += ["", "Each variant was timed twice (two passes); every run is in the JSON (`runs_us`)."]
    return "\n".join(lines) + "\n"


def environment() -> dict[str, Any]:
    import platform

    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                           "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, sms=p.multi_processor_count, l2_bytes=getattr(p, "L2_cache_size", None),
                   capability=f"{p.major}.{p.minor}")
    try:
        from importlib import metadata

        env["cutlass_dsl"] = metadata.version("nvidia-cutlass-dsl")
    except Exception:  # noqa: BLE001
        env["cutlass_dsl"] = None
    return env


def write_results(family: str, rows: list[dict[str, Any]], out_dir: Path, settings: BenchSettings,
                  markdown: str | None = None) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    js = out_dir / f"ops_{family}.json"
    md = out_dir / f"ops_{family}.md"
    js.write_text(json.dumps({"family": family, "environment": env, "settings": settings.__dict__,
                              "rows": rows}, indent=1, default=str))
    header = (f"{env.get('device', '?')}, torch {env['torch']}, cutlass-dsl {env.get('cutlass_dsl')}, "
              f"{env['time']}. Roofline: {settings.hbm_bytes_per_s / 1e12:.1f} TB/s; inputs rotated over "
              f">= {settings.rotate_bytes / 1e6:.0f} MB; CUDA-graph replays, median of {settings.groups} groups.")
    md.write_text(markdown if markdown is not None else to_markdown(family, rows, header))
    return js, md
