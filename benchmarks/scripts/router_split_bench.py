"""Router kernel: warps per token (split) at small batches, H200 (diagnostic for moe_router.choose_split).

CUDA graph of 20 back-to-back route() calls over 8 rotating logits sets; median per call of 5 replays.

    python benchmarks/scripts/router_split_bench.py
"""

import statistics

import torch

from latency_specialized.kernels.moe_router import route
from latency_specialized.spec import RouterSpec


def main() -> None:
    router = RouterSpec(score_func="sigmoid")
    E, k, calls = 896, 16, 20
    bias = torch.randn(E, device="cuda") * 0.1
    print("M split us/call")
    for M in (1, 4, 8, 16, 64):
        sets = [torch.randn(M, E, device="cuda") for _ in range(8)]
        w = torch.empty(M, k, device="cuda")
        ids = torch.empty(M, k, dtype=torch.int64, device="cuda")
        for split in (1, 2, 4, 8):
            if M > 16 and split > 1:
                continue
            route(sets[0], bias, k, router, out_weights=w, out_ids=ids, split=split)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for c in range(calls):
                    route(sets[c % 8], bias, k, router, out_weights=w, out_ids=ids, split=split)
            times = []
            for _ in range(7):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / calls)
            print(f"{M:>3} {split:>5} {statistics.median(times[2:]):7.2f}")


if __name__ == "__main__":
    main()
