"""Long teacher-forced bf16 check of a model's program against its reference (``testing/long_check.py``), any adapter.

    python benchmarks/scripts/long_check.py --model kimi_k3 --runs 1:256:0,8:256:0,64:256:0 --out $OUT/kimi_long_check.json
    python benchmarks/scripts/long_check.py --model deepseek_v41_flash --runs 1:1000:1,8:1000:1 \\
        --out $OUT/deepseek_v41_flash_long_check.json

``--model``: a registered adapter that provides the long-check protocol (``spec(variant)`` with ``--variant``,
default medium; ``reference``, ``composed_model``, ``tensor_names``, ``program``). ``--runs batch:steps:router_scale``
(comma-separated; router_scale 0 fixes the routing by the selection bias, 1 keeps the random routers) or the older
``--batches`` / ``--steps`` / ``--steps-by-batch`` (router x1). The JSON is rewritten after every run, so a run
stopped by ``timeout`` keeps what it measured. ``kimi_long_check.py`` is this with ``--model kimi_k3``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

PROTOCOL = ("spec", "reference", "composed_model", "tensor_names", "program")
"""What ``testing.long_check.teacher_forced`` calls on the adapter."""


def parse_runs(runs: str, batches: str, steps: int, steps_by_batch: str) -> list[tuple[int, int, float]]:
    """(batch, steps, router_scale) of every run: ``runs`` 'b:n:s,...' when given, else ``batches`` at ``steps``."""
    if runs:
        out = []
        for r in runs.split(","):
            parts = r.split(":")
            if len(parts) != 3:
                raise SystemExit(f"--runs {r!r}: give batch:steps:router_scale, e.g. 8:1000:1")
            out.append((int(parts[0]), int(parts[1]), float(parts[2])))
        return out
    steps_for = {int(k): int(v) for k, v in (p.split(":") for p in steps_by_batch.split(",") if p)}
    return [(int(b), steps_for.get(int(b), steps), 1.0) for b in batches.split(",") if b]


def adapter_for(model: str, variant: str):
    """The registered adapter ``model``; SystemExit naming the fix when it lacks the protocol or ``variant``."""
    from latency_specialized.plugins import get_registry

    adapter = get_registry().adapter(model)
    missing = [m for m in PROTOCOL if not callable(getattr(adapter, m, None))]
    if missing:
        raise SystemExit(f"{model}: the long check needs {', '.join(PROTOCOL)} on the adapter; missing: "
                         f"{', '.join(missing)}")
    if variant not in getattr(adapter, "variants", (variant,)):
        raise SystemExit(f"{model} has no --variant {variant} (variants: {', '.join(adapter.variants)})")
    return adapter


def main(argv: list[str] | None = None, *, model: str = "kimi_k3", out: str = "") -> None:
    from latency_specialized.testing.long_check import as_dict, teacher_forced

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=model, help="registered adapter name (default %(default)s)")
    ap.add_argument("--variant", default="medium", help="spec variant (default %(default)s)")
    ap.add_argument("--runs", default="", help="batch:steps:router_scale,... (overrides --batches)")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps-by-batch", default="", help="e.g. 64:64 (fewer steps for big batches)")
    ap.add_argument("--prompt", type=int, default=12, help="longest prefilled prompt (sequences: prompt - b %% 4)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=out, help="JSON (default <model>_long_check.json)")
    ap.add_argument("--no-floor", action="store_true", help="skip the fp32 reference (noise floor)")
    args = ap.parse_args(argv)
    adapter = adapter_for(args.model, args.variant)
    out_path = args.out or f"{args.model}_long_check.json"
    rows = []
    for b, n, scale in parse_runs(args.runs, args.batches, args.steps, args.steps_by_batch):
        r = teacher_forced(adapter, b, n, variant=args.variant, device=args.device, prompt=args.prompt,
                           fp32_floor=not args.no_floor, router_scale=scale)
        print(f"batch {b}, router x{scale}: {n} steps, program vs bf16 reference: max rel err {r.max_rel_err:.3e} (first "
              f"{r.first_rel_err:.3e}, last {r.last_rel_err:.3e}), top-1 {r.top1_agreement:.4f}; bf16 reference vs "
              f"fp32 reference: {r.floor_max_rel_err}, top-1 {r.floor_top1}; program vs fp32 reference: "
              f"{r.prog_vs_fp32_max_rel_err}, top-1 {r.prog_vs_fp32_top1} (on the {r.decisive_fraction} decisive tokens: "
              f"{r.decisive_top1}); fast steps {r.fast_steps} ({r.graph_steps} from a CUDA graph), {r.seconds} s",
              flush=True)
        rows.append(as_dict(r))
        with open(out_path, "w") as f:  # after every run: a time-limited run keeps what it measured
            json.dump({"model": args.model, "variant": args.variant, "prompt": args.prompt,
                       "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "runs": rows},
                      f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
