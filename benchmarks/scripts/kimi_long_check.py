"""256-step teacher-forced Kimi K3 program vs reference on the H200 at batch 1, 8, 64 (bf16).

    python benchmarks/scripts/kimi_long_check.py --steps 256 --batches 1,8,64 --out $OUT/kimi_long_check.json
"""

import argparse
import json

import torch

from latency_specialized.plugins import get_registry
from latency_specialized.testing.long_check import as_dict, teacher_forced


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="kimi_long_check.json")
    ap.add_argument("--steps-by-batch", default="", help="e.g. 64:64 (fewer steps for big batches)")
    ap.add_argument("--no-floor", action="store_true", help="skip the fp32 reference (noise floor)")
    ap.add_argument("--runs", default="", help="batch:steps:router_scale,... (overrides --batches)")
    args = ap.parse_args()
    steps_for = {int(k): int(v) for k, v in (p.split(":") for p in args.steps_by_batch.split(",") if p)}
    runs = [tuple(float(v) for v in r.split(":")) for r in args.runs.split(",") if r] or \
        [(int(b), steps_for.get(int(b), args.steps), 1.0) for b in args.batches.split(",")]
    rows = []
    for b, n, scale in runs:
        b, n = int(b), int(n)
        r = teacher_forced(get_registry().adapter("kimi_k3"), b, n, device=args.device, fp32_floor=not args.no_floor,
                           router_scale=scale)
        print(f"batch {b}, router x{scale}: {n} steps, program vs bf16 reference: max rel err {r.max_rel_err:.3e} (first "
              f"{r.first_rel_err:.3e}, last {r.last_rel_err:.3e}), top-1 {r.top1_agreement:.4f}; bf16 reference vs "
              f"fp32 reference: {r.floor_max_rel_err}, top-1 {r.floor_top1}; program vs fp32 reference: "
              f"{r.prog_vs_fp32_max_rel_err}, top-1 {r.prog_vs_fp32_top1} (on the {r.decisive_fraction} decisive tokens: "
              f"{r.decisive_top1}); fast steps {r.fast_steps} ({r.graph_steps} from a CUDA graph), {r.seconds} s",
              flush=True)
        rows.append(as_dict(r))
        with open(args.out, "w") as f:  # after every batch: a time-limited run keeps what it measured
            json.dump({"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "runs": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
