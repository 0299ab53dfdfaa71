"""Compile the Triton kernels a recorded GPU run compiled, in a process pool, before the GPU suite starts.

    python benchmarks/scripts/triton_precompile.py tests/triton_specs.json.gz [--jobs N] [--time-limit S]

The records come from a GPU run with ``LS_GPU_PEAKS`` set (``tests/conftest.py``; `h200_suite.sh` merges them into
``$OUT/triton_specs_<part>.json.gz``). Kernels go into Triton's on-disk cache (``$TRITON_CACHE_DIR``, default
``~/.triton/cache``), where the suite's own launches find them (``latency_specialized.testing.triton_specs``).
Prints what it compiled, what was cached already and the records that failed (stale ones: a kernel renamed or with
another signature since).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from latency_specialized.testing.triton_specs import load, precompile, toolchain_fingerprint  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="+", type=Path, help="record files (.json or .json.gz)")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--time-limit", type=float, default=150.0, help="seconds; records left then are not compiled")
    ap.add_argument("--arch", type=int, default=90, help="compute capability of the target (90: H100 / H200)")
    args = ap.parse_args(argv)
    records = [r for p in args.specs if p.is_file() for r in load(p)]
    # whether another machine's cache would serve this one (the same fingerprint: the same cache keys)
    print(f"toolchain: {toolchain_fingerprint(('cuda', args.arch, 32))}")
    t0 = time.perf_counter()
    compiled, hits, errors = precompile(records, jobs=args.jobs, target=("cuda", args.arch, 32),
                                        time_limit_s=args.time_limit)
    print(f"triton precompile: {len(records)} records, {compiled} compiled, {hits} cached already, "
          f"{len(errors)} not compiled, {time.perf_counter() - t0:.0f} s on {args.jobs} processes")
    for e in errors[:20]:
        print("  " + e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
