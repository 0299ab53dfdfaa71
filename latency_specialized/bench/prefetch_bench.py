"""The L2-prefetch experiment: does warming a projection's weights from a side stream pay?

One decode "step" on the main stream = a proxy for the attention kernel that precedes the
projection (``torch.cuda._sleep``: it holds the stream for a fixed time and uses no memory
bandwidth - the idle window a KDA decode kernel or an all-reduce leaves) followed by the
projection itself at M = 1 (our GEMV kernel and cuBLAS). The projection's weights rotate over
copies well beyond the 60 MB L2, so without help every step reads them cold from HBM.

Variants, each captured in one CUDA graph and timed like every other op (ops_bench.graph_time_us):

* ``cold``: proxy, then the gemm on cold weights;
* ``prefetch``: the side stream prefetches this step's weights while the proxy runs, joined
  before the gemm (L2Prefetcher: fork/join events, graph-capturable);
* ``warm``: proxy, then the gemm on one weight copy that stays L2-resident (upper bound);
* ``proxy``: the proxy alone; ``gemm cold`` / ``gemm warm``: the gemm alone.

The gain is ``cold - prefetch`` per step; reported as measured, however small.
"""

from __future__ import annotations

import math
from typing import Any

from latency_specialized.bench.op_cases import BenchSettings, graph_time_us, register_runner

# (label, N, K, prefetch cap in bytes): Kimi K3 TP8 per-rank projections
PREFETCH_CASES = (
    ("kda attn.o_proj tp8", 7168, 1536, None),
    ("mla attn.qkv_a_proj tp8", 2112, 7168, None),
    ("kda attn.in_proj tp8 (first 32 MB)", 6284, 7168, 32 << 20),
)
PROXY_US = (5.0, 15.0)


def _configs():
    from latency_specialized.kernels.prefetch import PrefetchConfig

    return (PrefetchConfig(), PrefetchConfig(grid=132), PrefetchConfig(grid=132, evict_last=True),
            PrefetchConfig(grid=132, mode="lines"))


def _sleep_cycles(us: float) -> int:
    # H200 boost clock; the proxy's real duration is measured (``proxy``) and reported
    return int(us * 1e-6 * 1.98e9)


@register_runner("prefetch")
def prefetch_experiment(settings: BenchSettings) -> list[dict[str, Any]]:
    import torch

    from latency_specialized.kernels.gemm_gemv import GemvConfig, gemm_gemv
    from latency_specialized.kernels.prefetch import L2Prefetcher, PrefetchConfig

    rows = []
    for label, n, k, cap in PREFETCH_CASES:
        wbytes = n * k * 2
        copies = max(3, math.ceil(settings.rotate_bytes / wbytes))
        ws = [(torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        outs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        pf_sets = {c.label(): [L2Prefetcher([w], max_bytes=cap, config=c) for w in ws] for c in _configs()}
        pfs = next(iter(pf_sets.values()))
        gemms = {
            "gemv": lambda w, o: gemm_gemv(x, w, out=o, config=GemvConfig(rows_per_warp=1)),
            "cublas": lambda w, o: torch.matmul(x, w.t(), out=o),
        }
        for proxy_us in PROXY_US:
            cycles = _sleep_cycles(proxy_us)
            row: dict[str, Any] = {"op": label, "N": n, "K": k, "weight_mb": wbytes / 1e6,
                                   "prefetch_mb": (pfs[0].bytes / 1e6), "copies": copies,
                                   "proxy_target_us": proxy_us, "times_us": {}}

            def proxy_only() -> None:
                for _ in range(copies):
                    torch.cuda._sleep(cycles)

            row["times_us"]["proxy"] = graph_time_us(proxy_only, copies, settings)
            for gname, gemm in gemms.items():
                def cold() -> None:
                    for i in range(copies):
                        torch.cuda._sleep(cycles)
                        gemm(ws[i], outs[i])

                def prefetch(pfs) -> None:
                    for i in range(copies):
                        pfs[i].start()
                        torch.cuda._sleep(cycles)
                        pfs[i].join()
                        gemm(ws[i], outs[i])

                def warm() -> None:
                    for i in range(copies):
                        torch.cuda._sleep(cycles)
                        gemm(ws[0], outs[i])

                def gemm_cold() -> None:
                    for i in range(copies):
                        gemm(ws[i], outs[i])

                def gemm_warm() -> None:
                    for i in range(copies):
                        gemm(ws[0], outs[i])

                variants = [("cold", cold), ("warm", warm), ("gemm_cold", gemm_cold), ("gemm_warm", gemm_warm)]
                variants += [(f"prefetch[{lab}]", lambda p=p: prefetch(p)) for lab, p in pf_sets.items()]
                for vname, fn in variants:
                    runs = [graph_time_us(fn, copies, settings) for _ in range(2)]
                    row["times_us"][f"{gname}.{vname}"] = runs
                cold_t = sum(row["times_us"][f"{gname}.cold"]) / 2
                best = min(pf_sets, key=lambda lab: sum(row["times_us"][f"{gname}.prefetch[{lab}]"]))
                row[f"{gname}.best_prefetch"] = best
                row[f"{gname}.gain_us"] = cold_t - sum(row["times_us"][f"{gname}.prefetch[{best}]"]) / 2
            rows.append(row)
            print(f"[prefetch] {label} proxy {proxy_us}us: " + ", ".join(
                f"{kk}={(sum(v) / len(v)) if isinstance(v, list) else v:.2f}" for kk, v in row["times_us"].items()))
        del ws, pfs, pf_sets, outs
        torch.cuda.empty_cache()
    return rows


def to_markdown(rows: list[dict[str, Any]], header: str = "") -> str:
    lines = ["# ops bench: prefetch (L2 warm-up from a side stream)", ""]
    if header:
        lines += [header, ""]
    lines += ["Per step: proxy kernel (torch.cuda._sleep, no memory traffic) then the projection at M=1. "
              "Times per step in us, mean of two passes (each a median of graph-replay groups). "
              "`prefetch` = the best prefetch config of the row (all configs are in the JSON).", "",
              "| projection | weight MB | prefetched MB | proxy us | gemm | cold | prefetch | config | warm | gain | "
              "gemm alone cold | gemm alone warm |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["times_us"]
        for g in ("gemv", "cublas"):
            def mean(key: str) -> float:
                v = t[f"{g}.{key}"]
                return sum(v) / len(v)

            best = r[f"{g}.best_prefetch"]
            lines.append(f"| {r['op']} | {r['weight_mb']:.1f} | {r['prefetch_mb']:.1f} | {t['proxy']:.2f} | {g} | "
                         f"{mean('cold'):.2f} | {mean(f'prefetch[{best}]'):.2f} | {best} | {mean('warm'):.2f} | "
                         f"{r[f'{g}.gain_us']:+.2f} | {mean('gemm_cold'):.2f} | {mean('gemm_warm'):.2f} |")
    return "\n".join(lines) + "\n"
