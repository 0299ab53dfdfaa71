"""Row-wise top-k selection on the GPU: ``topk_triton.topk_select`` (split, two launches) vs ``torch.topk``
(as the indexer's torch path runs it: topk, -inf -> -1, copy into ``out``) vs the indexer's one-program-per-
row radix select kernel.

    python benchmarks/scripts/topk_bench.py --out benchmarks/results/h200/topk.json

For each (rows M, row length N, k): fp32 scores (``--kind``: ``normal``; ``relu`` - positive, skewed, like
the indexer's relu-weighted logits; ``quantised`` - few distinct values, the split select's slow case),
every ``valid_lens = N`` (``--live``: fewer, the rest of each row -inf - a block table wider than the rows,
for the radix select's half-width path: variant ``radix_wide`` has none). First a check of each variant (split
and radix: the exact set of ``topk_select_reference``; torch.topk: the same values), then each captured into a CUDA graph of ``calls``
back-to-back selections over distinct score buffers (at least ``--rotate-mb`` per graph up to
``--max-calls``, so the L2 holds no buffer from its previous use where the sizes allow it; small rows
cannot fill the L2), CUDA events around each replay after warm-up, median of ``--reps`` replays divided by
``calls``. Also recorded: the nodes of a one-call graph by type (``graph_runner.graph_node_counts``).

Writes ``--out`` (JSON) and the same name with ``.md``. ``--first-bits --tile --cand-tile --min-chunk --waves
--warps`` set ``topk_triton``'s tunables for sweeps (recorded in the file).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from latency_specialized.bench.ops_bench_moe_kda import time_graph  # noqa: E402 (after the path set-up)

TUNABLES = ("FIRST_BITS", "TILE", "CAND_TILE", "MIN_CHUNK", "WAVES", "WARPS")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _scores(M: int, N: int, kind: str, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(M, N, device="cuda", generator=g)
    if kind == "relu":
        x = x.clamp(min=0) + 0.5 * torch.randn(M, N, device="cuda", generator=g).clamp(min=0) ** 2
    elif kind == "quantised":
        x = (x * 2).round()
    return x


def _variants(tk, ix):
    radix = ix._kernels(False)["select"]

    def split(x, lens, k, out):
        tk.topk_select(x, lens, k, out)

    def torch_topk(x, lens, k, out):
        vals, idx = torch.topk(x, k, dim=-1)
        out.copy_(torch.where(vals > float("-inf"), idx, -1))

    def radix_with(bits=None, resident=None, warps=None, narrow_min=None, early=None, fine=None, packed=None):
        # resident: rows of up to this many logits stay in registers across the passes (0: never); narrow_min:
        # the smallest resident tile with the half-width path for short rows (0: never); early: the passes stop
        # once the K-th key's bucket holds only keys to take (indexer_triton.SELECT_EARLY_EXIT); fine: the width held
        # steps by the live length through 1/4 .. all of the tile (indexer_triton.SELECT_FINE_WIDTHS); packed: one
        # prefix sum ranks both kinds of kept key (indexer_triton.SELECT_PACKED_SCAN)
        def radix_select(x, lens, k, out):
            ix.launch_select(radix, x, lens, out, k, x.shape[1], bits=bits, resident_max=resident, warps=warps,
                             narrow_min=narrow_min, early=early, fine=fine, packed=packed)

        return radix_select

    big = 1 << 20
    return dict(split=split, torch_topk=torch_topk, radix=radix_with(),
                radix8_loop=radix_with(8, 0), radix8_res=radix_with(8, big), radix4_loop=radix_with(4, 0),
                radix4_res=radix_with(4, big), radix8_res_w16=radix_with(8, big, 16),
                radix4_res_w16=radix_with(4, big, 16), radix4_res_w4=radix_with(4, big, 4),
                radix_wide=radix_with(narrow_min=0), radix_early=radix_with(early=True),
                radix_late=radix_with(early=False), radix4_loop_early=radix_with(4, 0, early=True),
                radix_fine=radix_with(fine=True), radix_coarse=radix_with(fine=False),
                radix_packed=radix_with(packed=True), radix_fine_packed=radix_with(fine=True, packed=True))


def _kernel_nodes(fn) -> dict | None:
    """Nodes by type of a one-call CUDA graph (the graph runner's counter; None where unreadable)."""
    from latency_specialized.runtime.graph_runner import graph_node_counts, new_graph

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = new_graph()
    with torch.cuda.graph(g):
        fn()
    counts = graph_node_counts(g)
    del g
    return counts


def _check(name: str, got: torch.Tensor, x: torch.Tensor, lens: torch.Tensor, k: int, tk) -> bool:
    if name == "torch_topk":
        vals = torch.topk(x, k, dim=-1).values
        sel = x.gather(1, got.long().clamp(min=0))
        return bool(torch.equal(sel.sort(-1).values, vals.sort(-1).values))
    want = tk.topk_select_reference(x, lens, k)
    return bool(torch.equal(got.sort(-1).values, want.sort(-1).values))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/h200/topk.json", help="JSON path (.md beside it)")
    ap.add_argument("--rows", default="1,8,64", help="M values")
    ap.add_argument("--lengths", default="4096,16384,65536", help="N values")
    ap.add_argument("--ks", default="512,2048")
    ap.add_argument("--live", type=int, default=0,
                    help="live logits per row (valid_lens; the rest -inf): a table wider than the rows, 0: N")
    ap.add_argument("--kind", choices=("normal", "relu", "quantised"), default="normal")
    ap.add_argument("--variants", default="split,torch_topk,radix")
    ap.add_argument("--reps", type=int, default=50, help="timed replays per graph (median)")
    ap.add_argument("--rotate-mb", type=float, default=200.0, help="score bytes per graph at least (L2 is 50 MB)")
    ap.add_argument("--max-calls", type=int, default=64, help="selections (distinct buffers) per graph at most")
    for t in TUNABLES:
        ap.add_argument("--" + t.lower().replace("_", "-"), type=int, default=None, help=f"topk_triton.{t}")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("topk_bench: needs a CUDA GPU", file=sys.stderr)
        return 2

    from latency_specialized.bench.machine import machine_info
    from latency_specialized.kernels import indexer_triton as ix
    from latency_specialized.kernels import topk_triton as tk

    for t in TUNABLES:
        v = getattr(a, t.lower())
        if v is not None:
            setattr(tk, t, v)
    tuning = {t: getattr(tk, t) for t in TUNABLES}
    variants = {n: f for n, f in _variants(tk, ix).items() if n in a.variants.split(",")}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.time()
    print(f"topk_bench: kind={a.kind} {tuning} variants={list(variants)}", flush=True)
    rows = []
    for N in _ints(a.lengths):
        for M in _ints(a.rows):
            nbytes = M * N * 4
            calls = max(1, min(a.max_calls, math.ceil(a.rotate_mb * 1e6 / nbytes)))
            live = min(N, a.live) if a.live > 0 else N
            xs = [_scores(M, N, a.kind, g) for _ in range(calls)]
            for x in xs:
                x[:, live:] = float("-inf")
            lens = torch.full((M,), live, dtype=torch.int32, device="cuda")
            for k in _ints(a.ks):
                if k > live:
                    continue
                outs = [torch.empty(M, k, dtype=torch.int32, device="cuda") for _ in range(calls)]
                row = dict(M=M, N=N, live=live, k=k, MB=round(nbytes / 1e6, 3), calls_per_graph=calls,
                           splits=tk.choose_splits(M, N, sms), us={}, check={}, kernel_nodes={})
                for name, fn in variants.items():
                    fn(xs[0], lens, k, outs[0])
                    torch.cuda.synchronize()
                    row["check"][name] = _check(name, outs[0], xs[0], lens, k, tk)
                    row["kernel_nodes"][name] = _kernel_nodes(lambda: fn(xs[0], lens, k, outs[0]))
                    row["us"][name] = round(time_graph(lambda r: fn(xs[r], lens, k, outs[r]), calls,
                                                       replays=a.reps, warmup=3, sync_each=True), 2)
                rows.append(row)
                print(f"M={M:3d} N={N:6d} k={k:5d} " + "  ".join(f"{n} {row['us'][n]:8.2f} us" for n in variants)
                      + f"  check {row['check']} nodes {row['kernel_nodes']} [{time.time() - t0:.0f} s]", flush=True)
                del outs
            del xs
            torch.cuda.empty_cache()

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(kind=a.kind, tuning=tuning, reps=a.reps, rotate_mb=a.rotate_mb, machine=machine_info())
    out.write_text(json.dumps(dict(meta, rows=rows), indent=1))
    m = meta["machine"]
    names = list(variants)
    lines = [f"# top-k selection: split (topk_triton) vs torch.topk vs radix (one program per row), {a.kind} "
             "fp32 scores, valid_lens = live (N where live = N; the rest of a row -inf)", "",
             f"GPU {m['gpu']}, torch {m['torch']}, triton {m['triton']}, commit {m['git_commit']}; tuning {tuning}; "
             "median us per selection over CUDA-graph replays", "",
             "| M | N | live | k | MB | splits | " + " | ".join(f"{n} us" for n in names) + " | kernel nodes | check |",
             "|---|---|---|---|---|---|" + "---|" * len(names) + "---|---|"]
    for r in rows:
        lines.append(f"| {r['M']} | {r['N']} | {r['live']} | {r['k']} | {r['MB']} | {r['splits']} | "
                     + " | ".join(str(r["us"][n]) for n in names)
                     + " | " + ", ".join(f"{n} {(v or {}).get('kernel', '?')}" for n, v in r["kernel_nodes"].items())
                     + " | "
                     + ("ok" if all(r["check"].values()) else f"FAILED {r['check']}") + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out} and {out.with_suffix('.md')}", flush=True)
    return 0 if all(all(r["check"].values()) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
