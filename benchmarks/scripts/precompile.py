"""Compile the kernels a recorded GPU run compiled, in process pools, before the GPU suite starts.

    python benchmarks/scripts/precompile.py tests/compile_records.json.gz [--jobs N] [--time-limit S]
    python benchmarks/scripts/precompile.py tests/compile_records.json.gz --drop-stale tests/compile_records.json.gz

The records come from a GPU run with ``LS_GPU_PEAKS`` set (``tests/conftest.py``; `h200_suite.sh` merges them into
``$OUT/compile_records_<part>.json.gz``). Triton kernels go into Triton's on-disk cache (``$TRITON_CACHE_DIR``, default
``~/.triton/cache``; ``testing.triton_specs``), CuTe DSL kernels into ``$LS_KERNEL_CACHE_DIR``
(``testing.cute_units``, ``kernels.compile_cache.precompile``): the suite's own launches then find them. Triton goes
first (the larger share in session 30 / 32's junit files), then CuTe DSL in what is left of ``--time-limit``. Prints
what compiled, what was cached already, and the records that no longer fit the code (stale: renamed, re-typed).
``--drop-stale OUT`` compiles nothing: it writes the records less the Triton ones whose kernel is gone or takes other
arguments now (``triton_specs.stale_reason``; a kernel's signature change leaves its old records behind, which every
later build would compile into entries no launch asks for, or fail on).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from latency_specialized.testing import compile_records, cute_units  # noqa: E402
from latency_specialized.testing.triton_specs import precompile, stale_reason, toolchain_fingerprint  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="+", type=Path, help="record files (.json or .json.gz)")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--time-limit", type=float, default=150.0, help="seconds; Triton records left then are skipped")
    ap.add_argument("--arch", type=int, default=90, help="compute capability of the target (90: H100 / H200)")
    ap.add_argument("--drop-stale", type=Path, default=None, metavar="OUT",
                    help="write the records less the stale Triton ones to OUT, compile nothing")
    args = ap.parse_args(argv)
    recs = compile_records.merge(compile_records.load(p) for p in args.records if p.is_file())
    if args.drop_stale is not None:
        reasons = [stale_reason(r) for r in recs["triton"]]
        kept = [r for r, why in zip(recs["triton"], reasons) if why is None]
        compile_records.save({**recs, "triton": kept}, args.drop_stale)
        print(f"triton: {len(recs['triton']) - len(kept)} of {len(recs['triton'])} records stale, dropped -> "
              f"{args.drop_stale}")
        for why in sorted({w.split(" (added")[0] for w in reasons if w})[:10]:
            print("  " + why)
        return 0
    # whether another machine's Triton cache would serve this one (the same fingerprint: the same cache keys)
    print(f"toolchain: {toolchain_fingerprint(('cuda', args.arch, 32))}")
    t0 = time.perf_counter()
    compiled, hits, errors = precompile(recs["triton"], jobs=args.jobs, target=("cuda", args.arch, 32),
                                        time_limit_s=args.time_limit)
    print(f"triton: {len(recs['triton'])} records, {compiled} compiled, {hits} cached already, {len(errors)} not "
          f"compiled, {time.perf_counter() - t0:.0f} s on {args.jobs} processes")
    for e in errors[:10]:
        print("  " + e)
    from latency_specialized.kernels import compile_cache

    if not recs["cute"]:
        return 0
    if compile_cache.disk_dir() is None:
        print(f"cute: {len(recs['cute'])} records not compiled: set $LS_KERNEL_CACHE_DIR (the suite's disk cache)")
        return 0
    os.environ.setdefault("CUTE_DSL_ARCH", f"sm_{args.arch}a")
    units, stale = cute_units.units(recs["cute"])
    t1 = time.perf_counter()
    results = compile_cache.precompile(units, jobs=args.jobs)
    failed = [f"{unit}: {err}" for unit, _, err in results if err]
    print(f"cute: {len(recs['cute'])} records, {len(units) - len(failed)} compiled or loaded, {len(stale)} stale, "
          f"{len(failed)} failed, {time.perf_counter() - t1:.0f} s on {args.jobs} processes")
    for e in (stale + failed)[:10]:
        print("  " + e[:240])
    return 0


if __name__ == "__main__":
    sys.exit(main())
