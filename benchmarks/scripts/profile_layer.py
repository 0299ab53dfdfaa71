"""Per-kernel breakdown of the graphed Kimi K3 KDA+MoE or MLA+MoE layer: ours vs stock (H200 diagnostic).

The layer bench gives one figure per cell; this says where it goes. Both variants are captured as
in ``latency-specialized bench`` (K layers, TP rank shapes, one GPU) and replayed under the torch
profiler (CUPTI reports every kernel node of a graph replay). Per variant and batch it prints the
kernels sorted by device time per replay, and writes the table as JSON.

    python benchmarks/scripts/profile_layer.py --batches 1,8,64 --layers 2 --out $OUT/profile.json
    python benchmarks/scripts/profile_layer.py --kind mla --context 4096 --batches 1 --out $OUT/profile_mla.json
    python benchmarks/scripts/profile_layer.py --kind kda --batches 1 --spec-tokens 7 --routing shared --out $OUT/p.json
    python benchmarks/scripts/profile_layer.py --kind kda --batches 1,8 --experts mxfp4 --out $OUT/p_mxfp4.json

``--spec-tokens k`` (k > 0) profiles ours' verification program of k draft tokens (rows = batch x (1 + k)), built as
``bench --spec-tokens`` builds it (``layer_bench.build_spec_ours``); stock is not profiled then.

Kernels launched with PDL count the time they wait for their predecessor too: their figures overlap.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

import torch


def _short(name: str) -> str:
    name = re.sub(r"\(.*", "", name)
    for key in ("MmaExpertsKernel", "GateUpKernel", "DownKernel", "RouterKernel", "Gemv", "SmallM", "SplitK",
                "AttnRes", "RMSNorm", "Kda", "KDA", "MlpAct", "Situ", "Lamport", "TwoStage"):
        if key.lower() in name.lower():
            return key + ":" + name[:70]
    return name[:90]


def profile(variant, replays: int) -> tuple[dict[str, list[float]], float]:
    from torch.profiler import ProfilerActivity, profile as tprof

    for _ in range(3):
        variant.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with tprof(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(replays):
            variant.replay()
        end.record()
        torch.cuda.synchronize()
    wall = start.elapsed_time(end) * 1e3 / replays
    agg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        a = agg[_short(ev.name)]
        # kernels with PDL (griddepcontrol.wait) count the time they wait for their predecessor too
        a[0] += ev.device_time_total / replays if hasattr(ev, "device_time_total") else ev.cuda_time_total / replays
        a[1] += 1 / replays
    return dict(agg), wall


def timeline(variant, path: str) -> list[dict]:
    """One replay's kernels in order of their end (chrome trace of the torch profiler): stream, start
    and end relative to the first kernel's start, duration and ``gain`` = how much later it ends than
    every kernel before it (its marginal cost on the step's critical path: PDL overlap included)."""
    from torch.profiler import ProfilerActivity, profile as tprof

    for _ in range(3):
        variant.replay()
    torch.cuda.synchronize()
    with tprof(activities=[ProfilerActivity.CUDA]) as prof:
        variant.replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    ks = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not ks:
        return []
    t0 = min(e["ts"] for e in ks)
    rows, last_end = [], t0
    for e in sorted(ks, key=lambda e: e["ts"] + e["dur"]):
        end = e["ts"] + e["dur"]
        rows.append({"name": _short(e["name"]), "stream": e.get("args", {}).get("stream"),
                     "start": e["ts"] - t0, "end": end - t0, "dur": e["dur"], "gain": max(0.0, end - last_end)})
        last_end = max(last_end, end)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8,64")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--out", default="profile.json")
    ap.add_argument("--model", default="kimi_k3", help="adapter; other than kimi_k3: ours only")
    ap.add_argument("--kind", default="kda", help="a bench kind of the model (kimi_k3: kda, mla; muse_spark: swa, full)")
    ap.add_argument("--context", type=int, default=4096, help="MLA: cached tokens per sequence")
    ap.add_argument("--spec-tokens", type=int, default=0, help="draft tokens of ours' verification steps (0: plain)")
    ap.add_argument("--routing", default="random", help="ours' MoE routing, as bench --routing "
                    "(random, shared, scaled:X)")
    ap.add_argument("--experts", default=None, help="routed experts kept in this format in both variants, as bench "
                    "--experts (e.g. mxfp4: ours' 4-bit kernels, stock's MXFP4 MoE)")
    ap.add_argument("--timeline", action="store_true",
                    help="also print one replay's kernels in order of their end, with each one's marginal cost")
    ap.add_argument("--set", default="", help="settings applied before anything is built, as bench --ab's: "
                    "MODULE.ATTR=VALUE,... (e.g. latency_specialized.pieces.attention.sparse_mqa."
                    "INDEX_COMPRESSED_TABLE=True)")
    args = ap.parse_args()
    batches = tuple(int(b) for b in args.batches.split(","))
    if args.set:
        from latency_specialized.bench.ab import apply_settings, check_settings, parse_variant
        variant = parse_variant(f"set:{args.set}")
        check_settings(variant)
        apply_settings(variant.settings)
    from latency_specialized.bench.layer_bench import GraphedStep, _layer_index, build_spec_ours
    from latency_specialized.bench.stock.layers import build_stock_kda, build_stock_mla
    from latency_specialized.plugins import get_registry
    adapter = get_registry().adapter(args.model)
    full = adapter.spec("full")
    dev = torch.device("cuda")
    kimi = args.model == "kimi_k3"
    mla = args.kind == "mla" or (not kimi and adapter.bench_kinds()[args.kind].context)
    ctx = (args.context,) if mla else ()
    kw = dict(say=print, contexts=ctx, **({"routing": args.routing} if args.routing != "random" else {}),
              **({"experts": args.experts} if args.experts else {}))
    if args.spec_tokens:
        ours = build_spec_ours(adapter, full, args.tp, args.kind, args.layers, batches, dev, args.spec_tokens, **kw)
    else:
        ours = adapter.layer_bench().build_ours(full, args.tp, args.kind, args.layers, batches, dev, **kw)
    tag = (args.kind + (f"_k{args.spec_tokens}" if args.spec_tokens else "")
           + (f"_{args.experts}" if args.experts else ""))
    result = {}
    for b in batches:
        o_k, _ = ours.variants(b, *ctx)
        variants = [("ours", o_k)]
        stock_layers = stock = None
        if kimi and not args.spec_tokens:
            build_stock = build_stock_mla if mla else build_stock_kda
            stock_layers = build_stock(full, _layer_index(full, args.kind), args.tp, b, *ctx, args.layers, dev,
                                       experts=ours.expert_weights(args.layers))
            stock = GraphedStep("stock", args.layers, stock_layers.step, stock_layers.routed_ids)
            variants.append(("stock", stock))
        for name, v in variants:
            v.capture()
            agg, wall = profile(v, args.replays)
            total = sum(t for t, _ in agg.values())
            rows = sorted(agg.items(), key=lambda kv: -kv[1][0])
            print(f"\n=== {tag} {name} batch {b}: {args.layers} layers, graph replay {wall:.1f} us, "
                  f"sum of kernel times {total:.1f} us, {sum(n for _, n in agg.values()):.0f} kernels")
            for k, (t, n) in rows:
                print(f"  {t:8.1f} us  x{n:4.1f}  {k}")
            result[f"{tag}_{name}_b{b}"] = {"wall_us": wall, "kernel_sum_us": total,
                                      "kernels": {k: {"us": t, "count": n} for k, (t, n) in rows}}
            if args.timeline and name == "ours":
                tl = timeline(v, args.out + f".{tag}_b{b}.trace.json")
                print(f"  -- one replay, kernels by end time (us): start  end  dur  gain  stream  name")
                for r in tl:
                    print(f"  {r['start']:7.1f} {r['end']:7.1f} {r['dur']:6.1f} {r['gain']:6.1f}  s{r['stream']}  {r['name']}")
                result[f"{tag}_{name}_b{b}"]["timeline"] = tl
        del stock_layers, stock
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
