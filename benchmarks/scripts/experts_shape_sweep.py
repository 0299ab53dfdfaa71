"""Routed-expert kernel tuning at the GLM-5.3 / DeepSeek-V4.1-Flash / Kimi K3 TP8 rank shapes (H200).

    python benchmarks/scripts/experts_shape_sweep.py --out $OUT/experts_sweep.json

Each variant (``ExpertsConfig`` tuning fields) is timed over a CUDA graph of ``--rotations`` calls with
different random routings (so each call reads other experts: beyond L2), twice, median us per call; the
roofline counts the distinct experts' gate/up + down bytes of each routing at the device's HBM bandwidth
(``hardware.roofline_bandwidth()``). Every variant is checked against the default's output first (the same
arithmetic up to fp32 summation order).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from latency_specialized.bench.ops_bench_moe_kda import routing, time_graph
from latency_specialized.hardware import roofline_bandwidth
from latency_specialized.spec import ActivationSpec

SHAPES = {
    # name: (experts, top_k, K, I per rank, N, activation)
    "glm53_tp8": (256, 8, 6144, 256, 6144, ActivationSpec(kind="swiglu")),
    "dsv41_tp8": (384, 6, 5120, 288, 5120, ActivationSpec(kind="swiglu", clamp=10.0)),
    "muse_spark_tp8": (256, 8, 4096, 512, 4096, ActivationSpec(kind="swiglu")),
    "kimi_k3_tp8": (896, 16, 3584, 384, 3584, ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)),
}
VARIANTS_B1 = {
    "default": {},
    "kvec0": dict(gu_kvec=0),
    "kvec8": dict(gu_kvec=8),
    "dn12": dict(dn_rows=12),
    "dn16": dict(dn_rows=16),
    "w8dn16": dict(dn_warps=8, dn_rows=16),
    "dn4": dict(dn_rows=4),
}
VARIANTS_MULTI = {
    "default": {},
    "kvec0": dict(gu_kvec=0),
    "kvec12": dict(gu_kvec=12),
    "kvec6": dict(gu_kvec=6),
    "dn8": dict(dn_rows=8),
    "kvec6_dn8": dict(gu_kvec=6, dn_rows=8),
    "kvec6_dn12": dict(gu_kvec=6, dn_rows=12),
}


def units(shapes: list[str], batches: list[int]) -> list:
    """(compile function, args) of every variant: ``--precompile`` fills $LS_KERNEL_CACHE_DIR with them."""
    import dataclasses

    from latency_specialized.kernels import moe_experts as me

    out = []
    for name in shapes:
        E, k, K, I, N, act = SHAPES[name]
        for M in batches:
            for tuning in (VARIANTS_B1 if M == 1 else VARIANTS_MULTI).values():
                c = me.make_config(M, K, I, N, k, torch.bfloat16, torch.int64, act, sms=132, **tuning)
                out += [(me.compile_gate_up, (dataclasses.replace(c, dn_rows=0, dn_warps=0, dn_trigger=False,
                                                                   per_route=False),)), (me.compile_down, (c,))]
    return list(dict.fromkeys(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="glm53_tp8,dsv41_tp8,muse_spark_tp8,kimi_k3_tp8")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--rotations", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--precompile", action="store_true", help="only fill $LS_KERNEL_CACHE_DIR (any machine)")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    if a.precompile:
        from latency_specialized.kernels.compile_cache import precompile

        us = units(a.shapes.split(","), [int(b) for b in a.batches.split(",")])
        print(f"precompiling {len(us)} units", flush=True)
        precompile(us, jobs=a.jobs)
        return 0
    from latency_specialized.kernels.moe_experts import experts

    dev = "cuda"
    rows = []
    for name in a.shapes.split(","):
        E, k, K, I, N, act = SHAPES[name]
        g = torch.Generator(device=dev).manual_seed(0)
        w13 = torch.empty(E, 2 * I, K, device=dev, dtype=torch.bfloat16).normal_(0, K ** -0.5, generator=g)
        w2 = torch.empty(E, N, I, device=dev, dtype=torch.bfloat16).normal_(0, I ** -0.5, generator=g)
        for M in [int(b) for b in a.batches.split(",")]:
            R = a.rotations
            xs = [torch.randn(M, K, generator=g, device=dev).bfloat16() for _ in range(R)]
            routes = [routing(M, E, k, g, dev) for _ in range(R)]
            distinct = statistics.mean(len(torch.unique(ids)) for _, ids in routes)
            nbytes = distinct * 3 * I * K * 2 + M * (K + N) * 2
            roof = nbytes / roofline_bandwidth() * 1e6
            ref = None
            for vname, tuning in (VARIANTS_B1 if M == 1 else VARIANTS_MULTI).items():
                outs = [torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16) for _ in range(R)]
                wss = [dict() for _ in range(R)]

                def step(r, tuning=tuning, outs=outs, wss=wss):
                    w, ids = routes[r]
                    experts(xs[r], w, ids, w13, w2, act, out=outs[r], workspace=wss[r], **tuning)

                row = dict(shape=name, M=M, variant=vname, tuning=tuning, distinct=distinct, roofline_us=roof)
                try:
                    step(0)
                    torch.cuda.synchronize()
                    if ref is None:
                        ref = outs[0].float().clone()
                    err = ((outs[0].float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                    us = [round(time_graph(step, R), 2) for _ in range(2)]
                    row.update(us=us, best=min(us), frac=roof / min(us), err_vs_default=err,
                               finite=bool(torch.isfinite(outs[0]).all()))
                except Exception as e:  # noqa: BLE001 - a failing variant is reported, the others still run
                    row.update(error=f"{type(e).__name__}: {e}"[:300])
                rows.append(row)
                print(json.dumps(row), flush=True)
        del w13, w2
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(0), roofline_bytes_per_s=roofline_bandwidth(), rows=rows), f,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
