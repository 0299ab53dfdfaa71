"""Offline sm_90a SASS of the MXFP4 mma kernels (no GPU): instruction mix, registers and an issue-bound time.

    python benchmarks/scripts/offline_sass.py [--out DIR] [--paired]

Compiles the kernels' PTX with the ptxas Triton ships (PTX ``.version`` lowered to 8.4, which that ptxas reads;
the instructions are the same), disassembles with its nvdisasm, and reports per kernel: SASS instructions per
thread (straight-line code: every warp runs all of it), registers (cuobjdump) and the CTAs an SM holds with them
(waves of the grid), the warps of a Kimi K3 TP8 step,
and the time an H200 needs just to issue them (132 SMs x 4 schedulers x 1.98 GHz, one warp-instruction per
scheduler and cycle: a lower bound) next to the time of its bytes at 4.3 TB/s. A model, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os

ISSUE_PER_S = 132 * 4 * 1.98e9
HBM = 4.3e12  # the H200's achievable read bandwidth: an offline model of an H200, not of this machine


def main() -> None:
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    os.environ.pop("LS_KERNEL_CACHE_DIR", None)
    from latency_specialized.kernels import moe_experts_mma as mm
    from latency_specialized.kernels.dsl_common import ptx_of
    from latency_specialized.quant.formats import QuantFormat
    from latency_specialized.testing.offline_sass import sass_of

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    p.add_argument("--paired", action="store_true", help="the codes in the paired-nibble layout")
    a = p.parse_args()
    K, I, N, k, E = 3584, 384, 3584, 16, 896
    fmt = QuantFormat.get("mxfp4")
    expert_bytes = {"gate_up": fmt.nbytes((2 * I, K)), "down": fmt.nbytes((N, I))}
    rows = []
    for M, aligned, distinct in ((1, False, 16), (64, True, 610)):
        c13, c2 = mm.default_configs(M, k, E, K, I, N, aligned)
        live = M * k if not aligned else int(distinct * 1.02)  # aligned: blocks ~ distinct experts (+ runs > 8)
        down = "down" if aligned else "down_sum"
        for st, cfg, ctas, part in (
                (mm.ExpertsStage("gate_up", K, 2 * I, k, aligned, act="situ_glu", beta=4, beta_lin=25,
                                 paired=a.paired), c13, (I // 16) * live, "gate_up"),
                (mm.ExpertsStage(down, I, N, k, aligned, paired=a.paired), c2,
                 (N // (16 * c2.mt)) * (M if not aligned else live), "down")):
            sass = sass_of(ptx_of(mm.compile_stage(st, cfg)))
            ops, regs = sass.ops, sass.regs
            per_thread = sum(ops.values())
            warps = ctas * cfg.wk
            issue_us = per_thread * warps / ISSUE_PER_S * 1e6
            bytes_us = distinct * expert_bytes[part] / HBM * 1e6
            threads = 32 * cfg.wk
            per_sm = min(65536 // (regs * threads), 2048 // threads, 32)  # resident CTAs (registers, threads)
            waves = ctas / (132 * per_sm)
            rows.append(dict(M=M, stage=st.stage, config=cfg.label(), sass_per_thread=per_thread, regs=regs,
                             ctas_per_sm=per_sm, waves=round(waves, 2), warps=warps,
                             issue_bound_us=round(issue_us, 2), bytes_us=round(bytes_us, 2),
                             top=dict(ops.most_common(12))))
            print(f"M={M:3d} {st.stage:8s} {cfg.label():16s} SASS/thread {per_thread:6d} regs {regs:3d} "
                  f"CTAs/SM {per_sm:2d} waves {waves:5.2f} warps {warps:7d} issue >= {issue_us:7.2f} us  "
                  f"bytes {bytes_us:7.2f} us")
            print("    " + ", ".join(f"{o}:{c}" for o, c in ops.most_common(14)))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        name = "offline_sass_q4_experts_paired.json" if a.paired else "offline_sass_q4_experts.json"
        with open(os.path.join(a.out, name), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
