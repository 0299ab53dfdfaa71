"""`latency-specialized explain`: the plan per op site, with the reason for every refusal.

Exit 0: the deployment is in the adapter's scope. Exit 2: it is not (arch, TP, batch, dtype, spec
tokens or a context beyond the model's): the plan is still printed where it can be built, and stderr
lists every reason.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("explain", help="print the dispatch plan of a decode step (works without a GPU)")
    p.add_argument("--model", required=True, help="adapter name (see `models`) or HF architecture")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--batch", type=int, default=1, help="sequences per decode step")
    p.add_argument("--arch", default=None, help="plan for this arch (sm_90, sm_100, sm_103, cpu); default: this machine")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--spec-tokens", type=int, default=0, help="speculative tokens verified per step")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="longest sequence (tokens) the plan serves; the attention sites carry it")
    p.add_argument("--size", default="full", choices=["full", "tiny"], help="architecture variant")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-refusals", action="store_true", help="hide the refused implementations")
    p.add_argument("--experts", choices=["native"], default=None,
                   help="plan for the routed experts in the release's stored format (as generate --experts native)")
    p.add_argument("--linears", choices=["native"], default=None,
                   help="plan for the dense projections in the release's stored format (as generate --linears native)")
    return p


def run(args: argparse.Namespace) -> int:
    from latency_specialized import hardware
    from latency_specialized.adapter_contract import SpecBoundAdapter
    from latency_specialized.errors import ScopeError
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry
    from latency_specialized.spec import Deployment

    reg = get_registry()
    adapter = reg.adapter(args.model)
    hw = hardware.for_arch(args.arch) if args.arch else hardware.probe()
    # One rule for every cause (arch, TP, batch, dtype, spec tokens): a deployment outside the scope
    # exits 2 with every reason on one stderr line; the plan (what would run anyway) is printed first
    # when it can be built - a batch beyond the graph buckets has none.
    scope = adapter.scope()
    problems = scope.problems(Deployment(arch=hw.arch, tp=args.tp, batch=args.batch, dtype=args.dtype,
                                         spec_tokens=args.spec_tokens, context=args.context), adapter.name,
                              max_context=adapter.spec(args.size).max_context)
    if problems and not 1 <= args.batch <= scope.max_batch:
        adapter.spec(args.size).shard(args.tp)  # a TP the architecture cannot be split by names its own fix
        raise ScopeError(adapter.name, problems)
    if args.experts or args.linears:
        adapter = SpecBoundAdapter(adapter, stored_spec(adapter, adapter.spec(args.size), args.experts, args.linears))
    plan = build_plan(adapter, reg.implementations, hw, tp=args.tp, batch=args.batch, dtype=args.dtype,
                      spec_tokens=args.spec_tokens, context=args.context, variant=args.size)
    print(plan.to_json() if args.json else plan.to_text(refusals=not args.no_refusals), flush=True)
    if plan.scope_problems:
        raise ScopeError(adapter.name, plan.scope_problems)
    return 0


def stored_spec(adapter: Any, spec: Any, experts: str | None, linears: str | None) -> Any:
    """``spec`` with the routed experts (``experts``) and the dense projections (``linears``) in the release's stored
    formats (the adapter's ``expert_formats[0]`` / ``native_linears``); a UserError naming the fix where it has none."""
    from latency_specialized.errors import UserError

    if experts:
        formats = getattr(adapter, "expert_formats", ())
        if not formats:
            raise UserError(f"{adapter.name} keeps its routed experts in the activation dtype only: drop --experts")
        spec = spec.with_expert_format(formats[0])
    if linears:
        if adapter.native_linears is None:
            raise UserError(f"{adapter.name} keeps its dense projections in the activation dtype only: drop --linears")
        spec = spec.with_linear_format(adapter.native_linears)
    return spec
