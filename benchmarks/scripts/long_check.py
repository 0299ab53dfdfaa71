"""Long check of a model's program against its reference (``testing/long_check.py``), any adapter: teacher-forced
drift in bf16 and/or fp32 (logits and recurrent/cache states), NaN/inf on every step, free-running determinism.

    python benchmarks/scripts/long_check.py --model kimi_k3 --runs 1:256:0,8:256:0,64:256:0 \\
        --out $OUT/kimi_long_check.json
    python benchmarks/scripts/long_check.py --model kimi_k3 --dtypes bf16,fp32 --runs 1:4000:0,8:4000:0 \\
        --floor-steps 500 --repeat-batches 1,8,64 --repeat-steps 1000 --out $OUT/kimi_long_check_4k.json
    python benchmarks/scripts/long_check.py --model deepseek_v41_flash --runs 1:1000:1,8:1000:1 \\
        --out $OUT/deepseek_v41_flash_long_check.json

``--model``: a registered adapter that provides the long-check protocol (``spec(variant)`` with ``--variant``,
default medium; ``reference``, ``composed_model``, ``tensor_names``, ``program``). ``--runs batch:steps:router_scale``
(comma-separated; router_scale 0 fixes the routing by the selection bias, 1 keeps the random routers) or the older
``--batches`` / ``--steps`` / ``--steps-by-batch`` (router x1); every run in every ``--dtypes`` mode (bf16: program
vs the bf16 reference, plus the fp32 reference as the floor for ``--floor-steps`` steps, default all, 0 = none;
fp32: the program in fp32 vs the fp32 reference, eager on a GPU where the plan calls torch references).
``--state-every``: steps between state-drift checkpoints (and one at the end). ``--repeat-batches`` /
``--repeat-steps``: the determinism check (two fresh programs, free-running greedy, tokens and logit bits equal) in
``--repeat-dtypes`` (default bf16) with the routing of the first run (router x0 with ``--runs none``). The JSON and
the markdown (``--md``, default the JSON's name with .md) are rewritten after every run (the JSON also at every
checkpoint, the run under way as "partial"), so a run stopped by ``timeout`` keeps what it measured. Exit status 1,
after writing both, when any step had a NaN/inf (logits or states) or a repeat differed.
``kimi_long_check.py`` is this with ``--model kimi_k3``.

The medium specs' max_context is 4096: prompt + steps + 1 must fit (4,000 steps from the default 12-token prompt do).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

PROTOCOL = ("spec", "reference", "composed_model", "tensor_names", "program")
"""What ``testing.long_check.teacher_forced`` calls on the adapter."""


def parse_runs(runs: str, batches: str, steps: int, steps_by_batch: str) -> list[tuple[int, int, float]]:
    """(batch, steps, router_scale) of every run: ``runs`` 'b:n:s,...' when given ('none': no run, e.g. only the
    determinism check), else ``batches`` at ``steps``."""
    if runs == "none":
        return []
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


def parse_dtypes(text: str) -> list[str]:
    """'bf16,fp32' -> ['bfloat16', 'float32'] (SystemExit naming the choices otherwise)."""
    from latency_specialized.testing.long_check import DTYPES

    out = []
    for d in (p.strip() for p in text.split(",") if p.strip()):
        if d not in DTYPES:
            raise SystemExit(f"--dtypes {d!r}: use bf16 and/or fp32")
        out.append(DTYPES[d])
    return out


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


def describe(r) -> str:
    """One line of a teacher-forced run."""
    ms = r.ms_per_step
    head = (f"batch {r.batch} {r.dtype}, router x{r.router_scale}: {r.steps_run}/{r.steps} steps, program vs "
            f"{'fp32' if r.dtype == 'float32' else 'bf16'} reference: max rel err {r.max_rel_err:.3e} (first "
            f"{r.first_rel_err:.3e}, last {r.last_rel_err:.3e}), top-1 {r.top1_agreement:.4f}; ")
    floor = ""
    if r.floor_steps:
        floor = (f"over {r.floor_steps} steps bf16 reference vs fp32 reference: {r.floor_max_rel_err:.3e}, top-1 "
                 f"{r.floor_top1:.4f}; program vs fp32 reference: {r.prog_vs_fp32_max_rel_err:.3e}, top-1 "
                 f"{r.prog_vs_fp32_top1:.4f} (on the {r.decisive_fraction} decisive tokens: {r.decisive_top1}); ")
    state = (f"state rel err max {r.state_max_rel_err:.3e} ({r.state_worst}), last {r.state_last_rel_err:.3e}"
             + (f", state floor {r.state_floor_max_rel_err:.3e}" if r.state_floor_max_rel_err is not None else "")
             if r.state_max_rel_err is not None else "state not checked")
    return (head + floor + state + f"; non-finite logits {r.nonfinite_logits} (references {r.nonfinite_ref_logits}), "
            f"states {r.nonfinite_states}; fast steps {r.fast_steps} ({r.graph_steps} from a CUDA graph"
            f"{'; eager: ' + r.eager_reason if r.eager_reason else ''}); per step {ms.get('total', 0):.1f} ms (program "
            f"{ms.get('program', 0):.1f}, reference {ms.get('reference', 0):.1f}, floor {ms.get('floor', 0):.1f}), "
            f"{r.seconds} s")


def main(argv: list[str] | None = None, *, model: str = "kimi_k3", out: str = "") -> int:
    from latency_specialized.testing import long_check as lc

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=model, help="registered adapter name (default %(default)s)")
    ap.add_argument("--variant", default="medium", help="spec variant (default %(default)s)")
    ap.add_argument("--runs", default="", help="batch:steps:router_scale,... (overrides --batches; none: no run)")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps-by-batch", default="", help="e.g. 64:64 (fewer steps for big batches)")
    ap.add_argument("--dtypes", default="bf16", help="modes of every run: bf16 and/or fp32 (default %(default)s)")
    ap.add_argument("--prompt", type=int, default=12, help="longest prefilled prompt (sequences: prompt - b %% 4)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=out, help="JSON (default <model>_long_check.json)")
    ap.add_argument("--md", default="", help="markdown results (default: the JSON's path with .md)")
    ap.add_argument("--no-floor", action="store_true", help="skip the fp32 reference (noise floor) in bf16 runs")
    ap.add_argument("--floor-steps", type=int, default=None,
                    help="bf16: run the fp32 reference (floor) for the first N steps only (default: all)")
    ap.add_argument("--state-every", type=int, default=500,
                    help="steps between state checkpoints (default %(default)s)")
    ap.add_argument("--progress-every", type=int, default=0,
                    help="steps between progress lines (default: 64 up to 1000 steps, else 250)")
    ap.add_argument("--graphs", choices=("auto", "on", "off"), default="auto",
                    help="CUDA graphs: auto = unless the plan calls a torch reference (default)")
    ap.add_argument("--repeat-batches", default="", help="determinism check at these batches, e.g. 1,8,64")
    ap.add_argument("--repeat-steps", type=int, default=256, help="free-running steps of each repeat")
    ap.add_argument("--repeat-dtypes", default="bf16", help="modes of the determinism check (default %(default)s)")
    ap.add_argument("--repeat-runs", type=int, default=2, help="fresh programs compared (default %(default)s)")
    ap.add_argument("--title", default="", help="the markdown's title")
    args = ap.parse_args(argv)
    adapter = adapter_for(args.model, args.variant)
    out_path = args.out or f"{args.model}_long_check.json"
    md_path = args.md or os.path.splitext(out_path)[0] + ".md"
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    runs = parse_runs(args.runs, args.batches, args.steps, args.steps_by_batch)
    dtypes = parse_dtypes(args.dtypes)
    for b, n, _ in runs:
        cap = adapter.spec(args.variant).max_context
        if args.prompt + n + 1 > cap:
            raise SystemExit(f"--runs {b}:{n}: prompt {args.prompt} + {n} steps + 1 > max_context {cap} of "
                             f"{args.model} {args.variant}: use at most {cap - args.prompt - 1} steps")
    rows, repeats, results = [], [], []
    title = args.title or (f"{args.model} program vs reference, teacher-forced ({'/'.join(args.dtypes.split(','))}), "
                           f"{device_name}")
    header = (f"`python benchmarks/scripts/long_check.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
              f"(model {args.model}, variant {args.variant}, prompts of {args.prompt - 3}-{args.prompt} tokens, "
              f"device {device_name}). \"rel err\" = max over steps of max|a - b| / max|b| on the logits; state rel "
              f"err = max over the declared states of max|program - reference| / max|reference| over the sequences' "
              f"rows and KV blocks at the checkpoints.")

    def write(partial: dict | None = None) -> None:
        # after every run and checkpoint: a time-limited run keeps what it measured ("partial": the run under way)
        with open(out_path, "w") as f:
            json.dump({"model": args.model, "variant": args.variant, "prompt": args.prompt, "device": device_name,
                       "runs": rows, "repeats": repeats, **({"partial": partial} if partial else {})}, f, indent=1)
        with open(md_path, "w") as f:
            f.write(lc.markdown(title, header, rows, repeats))

    for dtype in dtypes:
        for b, n, scale in runs:
            every = args.progress_every or (64 if n <= 1000 else 250)
            floor = not args.no_floor and args.floor_steps != 0
            r = lc.teacher_forced(adapter, b, n, variant=args.variant, device=args.device, prompt=args.prompt,
                                  fp32_floor=floor, floor_steps=args.floor_steps, router_scale=scale, dtype=dtype,
                                  state_every=args.state_every, progress_every=every, graphs=args.graphs,
                                  say=lambda s: print(s, flush=True), on_checkpoint=write)
            print(describe(r), flush=True)
            rows.append(lc.as_dict(r))
            results.append(r)
            write()
    if args.repeat_batches:
        scale = runs[0][2] if runs else 0.0
        for dtype in parse_dtypes(args.repeat_dtypes):
            for b in (int(x) for x in args.repeat_batches.split(",") if x):
                p = lc.free_running(adapter, b, args.repeat_steps, variant=args.variant, device=args.device,
                                    prompt=args.prompt, dtype=dtype, router_scale=scale, runs=args.repeat_runs,
                                    graphs=args.graphs, say=lambda s: print(s, flush=True))
                repeats.append(lc.as_dict(p))
                results.append(p)
                write()
    write()
    try:
        lc.check(results)
    except AssertionError as e:
        print(f"LONG CHECK FAILED: {e}", flush=True)
        return 1
    print(f"long check passed: {len(rows)} run(s), {len(repeats)} repeat(s), no NaN/inf; {out_path}, {md_path}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
