"""`latency-specialized bench`: per-layer decode time, kernels, roofline fraction and speed-up vs stock.

    latency-specialized bench --model kimi_k3 --tp 8 --batch 1,2,4,8,16,32,64 [--layers K]
    latency-specialized bench --kinds kda,mla --batch 1,2,4 --context 4096,32768
    latency-specialized bench --model muse_spark --tp 8 --kinds swa,full --context 4096,32768
    latency-specialized bench --model kimi_k3 --tp 8 --kinds kda,mla --batch 1,8 --context 4096 --spec-tokens 3,7
    latency-specialized bench --compare A.json B.json
    latency-specialized bench --kinds kda --batch 1,2 --ab base --ab rounds:pkg.module.CONST=0 [--repeat 2]

Runs on one GPU with random weights of the real per-rank shapes (communication excluded, and
reported as such); writes JSON + Markdown + PNG under ``--out`` and prints progress per cell.
``--compare`` needs no GPU: it puts two result files side by side and flags regressions beyond the
noise both runs measured. ``--ab`` runs variants that differ by module constants or environment on
this machine, interleaved, each in a fresh process, and summarises them against the first
(latency_specialized/bench/ab.py). The kinds are the model's (its adapter's ``bench_kinds()``);
``--context`` sets the cells of kinds with a KV cache (Kimi K3's mla, Muse Spark's swa and full) only:
without such a kind in ``--kinds`` it is an error, not ignored. ``--spec-tokens 3,7`` also times verification
steps (speculative decoding) of k draft tokens per request, rows = batch x (1 + k), with the program built for
k as the runtime builds it, beside the k = 0 step of the same batch (always run then): the report gives
'verification / single step' per cell. Method: latency_specialized/bench/layer_bench.py.
"""

from __future__ import annotations

import argparse
import sys

DEFAULT_OUT = "benchmarks/results/h200"
DEFAULT_CONTEXT = "4096,32768"


def _int_list(s: str, *, prefix: str, example: str, minimum: int, bound: str) -> tuple[int, ...]:
    """``s`` (comma-separated) as integers >= ``minimum``; UserError naming the flag (``prefix``) otherwise."""
    from latency_specialized.errors import UserError

    try:
        vals = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise UserError(f"{prefix}'{s}' is not a comma-separated list of integers (e.g. {example})") from None
    if not vals or min(vals) < minimum:
        raise UserError(f"{prefix}'{s}': give {bound}")
    return vals


def _ints(s: str) -> tuple[int, ...]:
    return _int_list(s, prefix="", example="1,2,4,8", minimum=1, bound="positive integers, e.g. 1,2,4,8")


def _spec_tokens(s: str) -> tuple[int, ...]:
    """``--spec-tokens`` as a tuple of k >= 0 (0 = single-token steps only)."""
    vals = _int_list(s, prefix="--spec-tokens ", example="3,7", minimum=0, bound="draft-token counts >= 0, e.g. 0,3,7")
    return tuple(sorted(set(vals)))


def _kinds(args: argparse.Namespace) -> tuple[str, ...]:
    """``--kinds`` as a tuple (default: the model's first bench kind). UserError for a kind the model's
    adapter does not bench (naming its kinds), and when ``--context`` is given but no kind in ``--kinds``
    has a context axis (``BenchKind.context``: the layer reads a KV cache)."""
    from latency_specialized.errors import UserError
    from latency_specialized.plugins import get_registry

    hook = getattr(get_registry().adapter(args.model), "bench_kinds", None)  # ModelAdapter's hook
    known = hook() if hook is not None else {}
    if args.kinds is None:
        kinds = tuple(known)[:1]
    else:
        kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    bad = [k for k in kinds if k not in known]
    if bad or not kinds:
        have = ", ".join(known) if known else "none"
        raise UserError(f"layer kind(s) {bad} not benchable for {args.model}: use --kinds with {have}")
    if args.context is not None and not any(known[k].context for k in kinds):
        with_ctx = [k for k, bk in known.items() if bk.context]
        given = ",".join(kinds)
        if not with_ctx:
            raise UserError(f"--context {args.context}: {args.model} has no layer kind with a context axis; "
                            "drop --context")
        it = "it" if len(with_ctx) == 1 else "one"
        raise UserError(f"--context {args.context} sets the {'/'.join(k.upper() for k in with_ctx)} cells' context "
                        f"but --kinds {given} has no {' or '.join(with_ctx)}: add {it} "
                        f"(--kinds {given},{with_ctx[0]}) or drop --context")
    return kinds


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="per-layer decode bench on one GPU: ours vs the stock composition vs roofline")
    p.add_argument("--model", default="kimi_k3", help="adapter name (see `models`)")
    p.add_argument("--tp", type=int, default=8, help="TP size whose rank-0 shard is benched (default 8)")
    p.add_argument("--batch", default="1,2,4,8,16,32,64", help="batch sizes, comma-separated")
    p.add_argument("--context", default=None,
                   help=f"context lengths of the cells of kinds with a KV cache, comma-separated (default "
                        f"{DEFAULT_CONTEXT}; needs such a kind in --kinds, e.g. mla, swa, full)")
    p.add_argument("--kinds", default=None,
                   help="layer kinds, comma-separated, the model's (its adapter's bench_kinds): kimi_k3 kda "
                        "(context-free), mla (one cell per --context); muse_spark swa, full; glm53 moe, moe_shared_topk "
                        "(per --context). "
                        "Default: the model's first kind")
    p.add_argument("--layers", type=int, default=3, help="layer copies per variant, K >= 2 (weights rotate beyond L2)")
    p.add_argument("--spec-tokens", default="0",
                   help="draft tokens per request of verification steps to time, comma-separated (default 0: "
                        "single-token steps only); k > 0 adds cells of batch x (1 + k) rows with the program built "
                        "for k, and the k = 0 cells they are divided by (kimi_k3's scope: 0, 3, 7)")
    p.add_argument("--routing", default="random",
                   help="how ours' MoE layers route: random (default: random router weights), shared (router "
                        "weights zeroed: every row reads the same experts, e.g. a verification step's draft rows "
                        "those of their request's first row) or scaled:X (router weights x X, 0 < X < 1: rows "
                        "share part of their experts); stock's columns are no comparison unless random")
    p.add_argument("--experts", default=None, choices=("mxfp4",),
                   help="keep the routed experts quantized in both variants (kimi_k3 kda / mla: ours' 4-bit kernels, "
                        "stock vLLM 0.33's humming MXFP4 MoE; the roofline counts 4.25 bits a value). Default: bf16")
    p.add_argument("--iters", type=int, default=40, help="timed graph replays per round")
    p.add_argument("--rounds", type=int, default=2, help="rounds per variant (their spread is the noise)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"results directory (default {DEFAULT_OUT})")
    p.add_argument("--name", default=None, help="file stem (default bench_<model>_tp<tp>)")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="compare two result files and exit")
    p.add_argument("--ab", action="append", metavar="NAME[:MODULE.ATTR=VALUE,env.VAR=VALUE,...]",
                   help="a variant of a same-machine A/B (repeat the flag; the first is the baseline)")
    p.add_argument("--repeat", type=int, default=2, help="--ab: runs per variant, interleaved (default 2)")
    return p


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from latency_specialized.bench import report

    if args.compare:
        a, b = (report.load_json(p) for p in args.compare)
        text, regressions = report.compare(a, b)
        print(text)
        return 1 if regressions else 0
    kinds = _kinds(args)
    spec_tokens = _spec_tokens(getattr(args, "spec_tokens", "0") or "0")
    if args.ab:
        return _run_ab(args, kinds)
    import torch

    from latency_specialized.bench.layer_bench import BenchConfig, run_bench
    from latency_specialized.errors import UserError

    if not torch.cuda.is_available():
        raise UserError("bench needs a CUDA GPU and torch sees none: run it where one is visible "
                        "(bench --compare A.json B.json needs no GPU)")
    cfg = BenchConfig(model=args.model, tp=args.tp, batches=_ints(args.batch),
                      contexts=_ints(args.context or DEFAULT_CONTEXT), kinds=kinds, layers=args.layers,
                      iters=args.iters, rounds=args.rounds, spec_tokens=spec_tokens,
                      routing=getattr(args, "routing", "random"), experts=getattr(args, "experts", None))

    def say(msg: str) -> None:
        print(msg, flush=True)

    stem = args.name or f"bench_{cfg.model}_tp{cfg.tp}" + (f"_{cfg.experts}" if cfg.experts else "")
    out = Path(args.out)

    def checkpoint(partial: dict) -> None:
        report.write_json(partial, out / f"{stem}.json")  # replaced by the final file at the end

    result = run_bench(cfg, say, checkpoint)
    paths = [report.write_json(result, out / f"{stem}.json"), report.write_markdown(result, out / f"{stem}.md")]
    png = report.write_plot(result, out / f"{stem}.png")
    if png is None:
        print("matplotlib not installed: no plot written", file=sys.stderr)
    else:
        paths.append(png)
    print(report.to_markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _run_ab(args: argparse.Namespace, kinds: tuple[str, ...]) -> int:
    from pathlib import Path

    from latency_specialized.bench import ab

    variants = [ab.parse_variant(v) for v in args.ab]
    argv = ["bench", "--model", args.model, "--tp", str(args.tp), "--batch", args.batch,
            "--kinds", ",".join(kinds), "--layers", str(args.layers), "--iters", str(args.iters), "--rounds", str(args.rounds)]
    if args.context is not None:
        argv += ["--context", args.context]
    # verification cells and the routing travel to every variant (the summary keys cells by k too)
    if getattr(args, "spec_tokens", "0") not in (None, "", "0"):
        argv += ["--spec-tokens", args.spec_tokens]
    if getattr(args, "routing", "random") != "random":
        argv += ["--routing", args.routing]
    if getattr(args, "experts", None):
        argv += ["--experts", args.experts]
    results = ab.run_ab(variants, argv, args.out, repeat=args.repeat, say=lambda m: print(m, flush=True))
    text = ab.summarize(variants, results)
    path = Path(args.out) / f"{args.name or 'ab'}.md"
    path.write_text(text)
    print(text)
    print(f"wrote {path}")
    return 0
