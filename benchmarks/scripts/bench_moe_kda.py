"""MoE router / routed experts / shared-expert overlap / KDA decode benchmarks on the H200.

    python benchmarks/scripts/bench_moe_kda.py --precompile          # fill $LS_KERNEL_CACHE_DIR (any machine)
    python benchmarks/scripts/bench_moe_kda.py --out benchmarks/results/h200   # measure (GPU)

``--precompile`` compiles every kernel configuration that the benchmark and
``tests/ops/test_moe_kda_gpu.py`` use, in parallel worker processes, into the disk tier of the
compile cache (``$LS_KERNEL_CACHE_DIR``), so that GPU time is not spent compiling. The case
definitions and the timing method live in ``latency_specialized/bench/ops_bench_moe_kda.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def compile_units(sweep_only: bool = False) -> list:
    """(compile function, args) for every configuration the GPU tests and the benchmark use
    (``sweep_only``: those of ``--experts-sweep``)."""
    from latency_specialized.kernels import kda_decode as kd
    from latency_specialized.kernels import moe_experts as me
    from latency_specialized.kernels import moe_router as mr
    from latency_specialized.spec import ActivationSpec, RouterSpec

    situ = ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)
    swiglu = ActivationSpec(kind="swiglu", clamp=10.0)
    units = []
    # router: (E, k, RouterSpec kwargs, logits dtype, has bias, ids dtype)
    for E, k, rkw, ldt, bias, idt in [
        (896, 16, dict(score_func="sigmoid"), torch.float32, True, torch.int64),
        (896, 16, dict(score_func="sigmoid"), torch.float32, False, torch.int64),
        (896, 16, dict(score_func="sigmoid"), torch.float32, True, torch.int32),
        (384, 6, dict(score_func="sqrtsoftplus", routed_scaling=1.5), torch.float32, True, torch.int64),
        (250, 8, dict(score_func="sigmoid", logit_scale=2 ** -2.5, renormalize_eps=1e-15), torch.bfloat16, True,
         torch.int64),
        (37, 5, dict(score_func="softmax", logit_scale=0.7, bias_corrected=False, renormalize_eps=1e-6,
                     routed_scaling=2.5), torch.float32, True, torch.int64),
        (256, 8, dict(score_func="sigmoid", renormalize=False, routed_scaling=2.5), torch.float32, True, torch.int64),
    ]:
        for sort in (None, False):  # the default (sort where it applies) and the rounds kernel
            cfg = mr.make_config(_meta(1, E, dtype=ldt), _meta(E) if bias else None, k, RouterSpec(**rkw), idt,
                                 sort=sort)
            units.append((mr._compile, (cfg,)))
    # experts: (M, K, I, N, k, activation, dtype, tuning)
    from latency_specialized.bench.ops_bench_moe_kda import EXPERT_VARIANTS, EXPERT_VARIANTS_MULTI

    tuned = [t for t in EXPERT_VARIANTS.values() if t] + [dict(pdl=True)]
    sweep = [(m, 3584, i, 3584, 16, situ, torch.bfloat16, t) for i in (384, 192) for m in (2, 4, 8, 16, 32, 64)
             for t in EXPERT_VARIANTS_MULTI.values()]
    if sweep_only:
        # gate_up does not depend on the down fields (its compile key drops them): one unit per bucket
        return list(dict.fromkeys(u for M, K, I, N, k, act, dt, tuning in sweep
                                  for c in [me.make_config(M, K, I, N, k, dt, torch.int64, act, **tuning)]
                                  for u in ((me.compile_gate_up, (dataclasses.replace(c, dn_rows=0, dn_warps=0),)),
                                            (me.compile_down, (c,)))))
    for M, K, I, N, k, act, dt, tuning in (
        [(m, 3584, 384, 3584, 16, situ, torch.bfloat16, {}) for m in (1, 3, 8, 64)]
        + [(1, 3584, 384, 3584, 16, situ, torch.bfloat16, t) for t in tuned]
        + [(3, 3584, 384, 3584, 16, situ, torch.bfloat16, dict(pdl=True))]
        + [(m, 3584, 192, 3584, 16, situ, torch.bfloat16, {}) for m in (1, 64)] + sweep
        + [(5, 512, 136, 200, 3, swiglu, torch.bfloat16, {}), (1, 512, 136, 200, 3, situ, torch.bfloat16, {}),
           (6, 1024, 384, 1024, 8, situ, torch.bfloat16, {}), (4, 1024, 256, 1024, 4, situ, torch.bfloat16, {})]):
        cfg = me.make_config(M, K, I, N, k, dt, torch.int64, act, **tuning)
        units += [(me.compile_gate_up, (cfg,)), (me.compile_down, (cfg,))]
    # KDA: (H, activation dtype, parameter dtype)
    for H, dt, pdt in [(12, torch.bfloat16, torch.float32), (6, torch.bfloat16, torch.bfloat16),
                       (6, torch.bfloat16, torch.float32), (3, torch.float32, torch.float32)]:
        for rs in (1, 2):
            HD3 = 3 * H * 128
            cfg = kd.make_config(_meta(1, HD3, dtype=dt), _meta(2, HD3, 3, dtype=dt), _meta(HD3, 4, dtype=pdt),
                                 _meta(2, H, 128, 128), _meta(1, dtype=torch.int32), _meta(H, dtype=pdt),
                                 num_heads=H, eps=1e-5, gate_lower_bound=-5.0, scale=None, row_split=rs)
            units.append((kd._compile, (cfg,)))
    return list(dict.fromkeys(units))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precompile", action="store_true", help="only fill the disk compile cache")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile processes")
    ap.add_argument("--out", default="benchmarks/results/h200", help="where ops_moe_kda.{json,md} go")
    ap.add_argument("--quick", action="store_true", help="routed experts at TP8 only")
    ap.add_argument("--experts-sweep", default=None, metavar="BATCHES",
                    help="only the routed-expert variants at these batches (e.g. 2,4,8,16,32,64) vs stock Triton")
    ap.add_argument("--tps", default="8,16", help="TP degrees of --experts-sweep")
    args = ap.parse_args(argv)
    if args.precompile:
        from latency_specialized.kernels.compile_cache import disk_dir, precompile

        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        if disk_dir() is None:
            print("set LS_KERNEL_CACHE_DIR to a directory first", file=sys.stderr)
            return 2
        units = compile_units(sweep_only=bool(args.experts_sweep))
        t0 = time.perf_counter()
        res = precompile(units, jobs=args.jobs)
        bad = [r for r in res if r[2]]
        for name, secs, err in res:
            print(f"{secs:6.1f} s  {name[:150]} {err}")
        print(f"{len(units)} units in {time.perf_counter() - t0:.1f} s, {len(bad)} failed -> {disk_dir()}")
        return 1 if bad else 0
    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    from latency_specialized.bench.ops_bench_moe_kda import run_all, run_experts_sweep

    os.makedirs(args.out, exist_ok=True)
    if args.experts_sweep:
        run_experts_sweep(args.out, [int(b) for b in args.experts_sweep.split(",")],
                          [int(t) for t in args.tps.split(",")], log=lambda s: print(s, flush=True))
        return 0
    run_all(args.out, quick=args.quick, log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
