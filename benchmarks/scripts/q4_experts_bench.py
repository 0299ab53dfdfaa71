"""H200: routed experts over 4-bit weights (ours per launch variant, bf16 ours, humming's MXFP4 MoE).

    python benchmarks/scripts/q4_experts_bench.py --tp 8 --batch 1,2,4,8,16,32,64 --fmt mxfp4 --out DIR

Writes DIR/ops_moe_experts_q4_<fmt>_tp<tp>.{json,md} (``latency_specialized/bench/ops_bench_q4.py``)."""

from __future__ import annotations

import argparse
import time

from latency_specialized.bench import ops_bench_q4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--batch", default="1,2,4,8,16,32,64")
    p.add_argument("--fmt", default="mxfp4")
    p.add_argument("--gemv-max-tokens", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="default variants only (Triton); mma: --mma-variants")
    p.add_argument("--mma-variants", default=None,
                   help="comma-separated names of ops_bench_q4.MMA_VARIANTS to run (default: all; 'none': skip)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.quick:
        ops_bench_q4.GEMV_VARIANTS = {"default": {}}
        ops_bench_q4.GROUPED_VARIANTS = {"default": {}}
    if a.mma_variants:
        names = [] if a.mma_variants == "none" else a.mma_variants.split(",")
        ops_bench_q4.MMA_VARIANTS = {n: ops_bench_q4.MMA_VARIANTS[n] for n in names}
    t0 = time.perf_counter()
    rows = []
    for b in a.batch.split(","):  # results written after every batch: a cut-off run keeps what it measured
        rows += ops_bench_q4.bench_q4_experts(a.tp, [int(b)], fmt=a.fmt, gemv_max_tokens=a.gemv_max_tokens, seed=int(b),
                                              log=lambda s: print(f"[{time.perf_counter() - t0:6.1f}s] {s}", flush=True))
        ops_bench_q4.write(rows, a.out, stem=f"ops_moe_experts_q4_{a.fmt}_tp{a.tp}")


if __name__ == "__main__":
    main()
