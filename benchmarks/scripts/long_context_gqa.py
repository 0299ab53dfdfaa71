"""GQA decode at long contexts on the GPU (issue 25): the Triton split-KV kernel at Muse Spark's TP8 full-attention
shape (16 query heads, 2 KV heads x 64 per rank, no window) for contexts 32K / 128K / 1M and batch 1-8.

Timing as ``tests/ops/test_gqa_triton_gpu.py``'s ``_time_cell`` (one CUDA graph of calls over distinct caches so the
L2 cannot hold them, CUDA events, median); roofline = the KV bytes read once at the device's HBM bandwidth
(``hardware.roofline_bandwidth()``). Writes JSON + Markdown.
    PYTHONPATH=.:tests/ops python benchmarks/scripts/long_context_gqa.py --out $OUT/res   (tests/ops: gpu_helpers)

Sweeps: ``--config TAG:CONST=VALUE,...`` (repeatable) sets tuning constants of ``kernels/gqa_decode_triton.py`` (e.g.
``w1s4:WAVES=1,NUM_STAGES=4``; every config starts from the defaults) and writes ``long_context_gqa_TAG.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from latency_specialized.hardware import roofline_bandwidth
from tests.ops.test_gqa_triton_gpu import MUSE_TP8, _time_cell


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/h200")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--contexts", default="32768,131072,1048576")
    ap.add_argument("--config", action="append", default=None,
                    help="TAG:CONST=VALUE,... tuning constants of kernels/gqa_decode_triton.py (repeatable)")
    args = ap.parse_args()
    from latency_specialized.kernels import gqa_decode_triton as gk
    defaults = {c: v for c, v in vars(gk).items() if c.isupper() and isinstance(v, int)}
    for cfg in args.config or [":"]:
        tag, _, sets = cfg.partition(":")
        for c, v in defaults.items():
            setattr(gk, c, v)
        for item in filter(None, sets.split(",")):
            c, _, v = item.partition("=")
            if c not in defaults:
                raise SystemExit(f"long_context_gqa: {c!r} is not an integer constant of kernels/gqa_decode_triton.py")
            setattr(gk, c, int(v))
        print(f"=== config {tag or 'defaults'}: {sets or 'defaults'}", flush=True)
        _run(args, f"_{tag}" if tag else "", sets)


def _run(args: argparse.Namespace, suffix: str, sets: str) -> None:
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            r = _time_cell(MUSE_TP8, b, ctx, None, groups=7)
            rows.append({"batch": b, "context": ctx, **{k: r[k] for k in ("us", "floor_us", "roofline", "bytes",
                                                                          "num_splits", "kernels")}})
            print(f"gqa muse tp8 full: batch {b} context {ctx}: {r['us']:.1f} us, floor {r['floor_us']:.1f} us, "
                  f"{r['roofline']:.0%} of the roofline, {r['num_splits']} splits", flush=True)
    os.makedirs(args.out, exist_ok=True)
    dev = torch.cuda.get_device_name(0)
    with open(os.path.join(args.out, f"long_context_gqa{suffix}.json"), "w") as f:
        json.dump({"device": dev, "torch": torch.__version__, "git": os.environ.get("LS_GIT_COMMIT"),
                   "shape": MUSE_TP8, "tuning": sets or "defaults", "roofline_bytes_per_s": roofline_bandwidth(),
                   "rows": rows}, f, indent=1)
    lines = [f"# GQA decode at long contexts, Muse Spark TP8 full-attention shape ({dev})", "",
             "`benchmarks/scripts/long_context_gqa.py`: `attention.gqa` Triton split-KV kernel, 16 q heads / 2 KV "
             "heads x 64 per rank, bf16 paged KV (block 16), no window; CUDA graphs over distinct caches, median. "
             f"Roofline: the KV bytes once at {roofline_bandwidth() / 1e12:.1f} TB/s."
             + (f" Tuning: {sets}." if sets else ""), "",
             "| context | batch | us | floor us | % roofline | splits | kernels |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['context']} | {r['batch']} | {r['us']:.1f} | {r['floor_us']:.1f} | {r['roofline']:.0%} | "
              f"{r['num_splits']} | {r['kernels']} |" for r in rows]
    with open(os.path.join(args.out, f"long_context_gqa{suffix}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
