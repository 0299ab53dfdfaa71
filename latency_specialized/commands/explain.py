"""`latency-specialized explain`: the plan per op site, with the reason for every refusal."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("explain", help="print the dispatch plan of a decode step (works without a GPU)")
    p.add_argument("--model", required=True, help="adapter name (see `models`) or HF architecture")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--batch", type=int, default=1, help="sequences per decode step")
    p.add_argument("--arch", default=None, help="plan for this arch (sm_90, sm_100, sm_103, cpu); default: this machine")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--spec-tokens", type=int, default=0, help="speculative tokens verified per step")
    p.add_argument("--size", default="full", choices=["full", "tiny"], help="architecture variant")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-refusals", action="store_true", help="hide the refused implementations")
    return p


def run(args: argparse.Namespace) -> int:
    from latency_specialized import hardware
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry

    reg = get_registry()
    adapter = reg.adapter(args.model)
    hw = hardware.for_arch(args.arch) if args.arch else hardware.probe()
    plan = build_plan(adapter, reg.implementations, hw, tp=args.tp, batch=args.batch, dtype=args.dtype,
                      spec_tokens=args.spec_tokens, variant=args.size)
    print(plan.to_json() if args.json else plan.to_text(refusals=not args.no_refusals))
    return 0
