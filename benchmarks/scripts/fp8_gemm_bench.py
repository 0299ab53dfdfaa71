"""H200: block-FP8 decode gemms (ours per launch config, humming's W8A16, the stock W8A8 stand-in, bf16 cuBLAS).

    python benchmarks/scripts/fp8_gemm_bench.py --batch 1,4,8,16,64 --out DIR [--quick] [--shapes LABEL,...]

Writes DIR/ops_gemm_fp8.{json,md} after every shape (``latency_specialized/bench/ops_bench_fp8.py``): a cut-off
run keeps what it measured."""

from __future__ import annotations

import argparse
import time

from latency_specialized.bench import ops_bench_fp8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", default="1,4,8,16,64")
    p.add_argument("--shapes", default=",".join(ops_bench_fp8.SHAPES), help="labels of ops_bench_fp8.SHAPES")
    p.add_argument("--quick", action="store_true", help="the default config only")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    t0 = time.perf_counter()
    rows = []
    for label in a.shapes.split(","):
        say = lambda s: print(f"[{time.perf_counter() - t0:6.1f}s] {s}", flush=True)  # noqa: E731
        rows += ops_bench_fp8.bench_fp8_gemms([label], [int(b) for b in a.batch.split(",")], quick=a.quick, log=say)
        ops_bench_fp8.write(rows, a.out)


if __name__ == "__main__":
    main()
