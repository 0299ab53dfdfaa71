"""`latency-specialized bench-ops`: per-op timings of our kernels vs cuBLAS/torch on this GPU.

Writes ``ops_<family>.json`` and ``ops_<family>.md`` per op family into ``--out`` and, with
``--write-table``, the measured gemm dispatch table (``kernels/tuning/h200_gemm.json`` layout)
that the gemm implementations' ``supports()`` read. Method: bench/ops_bench.py.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

DEFAULT_OUT = "benchmarks/results/h200"


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench-ops", help="time each op's kernels vs cuBLAS/torch on this GPU (needs CUDA)")
    p.add_argument("--ops", default="gemm,norm,prefetch",
                   help="comma-separated op families (see --list); default: gemm,norm,prefetch")
    p.add_argument("--list", action="store_true", help="list the registered families and exit")
    p.add_argument("--model", default="kimi_k3", help="adapter whose per-rank shapes are used")
    p.add_argument("--tp", default="8,16", help="TP shards, comma-separated")
    p.add_argument("--m", default="1,2,4,8,16,32,64", help="token counts M, comma-separated")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"results directory (default {DEFAULT_OUT})")
    p.add_argument("--write-table", nargs="?", const="", default=None, metavar="PATH",
                   help="write the gemm dispatch table (default path: the package's tuning/h200_gemm.json)")
    p.add_argument("--jobs", type=int, default=0, help="parallel compile processes (needs $LS_KERNEL_CACHE_DIR)")
    p.add_argument("--quick", action="store_true", help="one config per kernel (smoke run)")
    p.add_argument("--shapes", default="", metavar="N:K,...",
                   help="gemm: only these of the model's (N, K) shapes (e.g. a new fused projection); 'missing': "
                        "the model's shapes the dispatch table has no cell for at one of the --m token counts")
    p.add_argument("--merge-table", action="store_true",
                   help="with --write-table: add/replace the measured cells in the existing table, keep the others")
    p.add_argument("--compile-records", metavar="PATH", default=None,
                   help="write the CuTe DSL kernels these cases compile as compile records (testing.compile_records) "
                        "and stop; needs no GPU: another machine compiles them ahead "
                        "(benchmarks/scripts/precompile.py)")
    return p


def run(args: argparse.Namespace) -> int:
    from latency_specialized.bench import ops_bench
    from latency_specialized.errors import UserError

    if args.list:
        for f in ops_bench.families():
            print(f)
        return 0
    import torch

    if not torch.cuda.is_available() and args.compile_records is None:
        raise UserError("bench-ops needs a CUDA GPU and torch sees none: run it where one is visible "
                        "(bench-ops --list and --compile-records need no GPU)")
    if torch.cuda.is_available():
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_%d%da" % torch.cuda.get_device_capability())
    if args.shapes.strip() == "missing":
        from latency_specialized.bench.ops_bench_gemm_norm import shapes_missing_from_table

        shapes = shapes_missing_from_table(args.model, _ints(args.tp), _ints(args.m))
        print(f"--shapes missing: {args.model} at TP {args.tp} lacks table cells for "
              f"{','.join(f'{n}:{k}' for n, k in shapes) or 'no shape'}")
        if not shapes:
            return 0
    else:
        shapes = tuple(tuple(int(v) for v in item.split(":")) for item in args.shapes.split(",") if item.strip())
    if any(len(s) != 2 for s in shapes):
        raise UserError(f"--shapes takes N:K pairs separated by commas (or 'missing'), got {args.shapes!r}")
    if args.merge_table and args.write_table is None:
        raise UserError("--merge-table needs --write-table (the table to merge into)")
    settings = ops_bench.BenchSettings(model=args.model, tps=_ints(args.tp), ms=_ints(args.m), quick=args.quick,
                                       shapes=shapes)
    if args.compile_records is not None:
        return _write_compile_records(args, settings)
    out = Path(args.out)
    ops_bench.disk_tier_selftest()
    for note in ops_bench.load_case_modules():
        print(note)
    for family in [f.strip() for f in args.ops.split(",") if f.strip()]:
        rows = ops_bench.run_family(family, settings, precompile_jobs=args.jobs)
        md = None
        if family == "prefetch":
            from latency_specialized.bench.prefetch_bench import to_markdown

            md = to_markdown(rows)
        js, mdp = ops_bench.write_results(family, rows, out, settings, markdown=md)
        print(f"wrote {js} and {mdp}")
        if family == "gemm" and args.write_table is not None:
            from latency_specialized.bench.ops_bench_gemm_norm import build_gemm_table
            from latency_specialized.kernels.tuning import GEMM_TABLE

            path = Path(args.write_table) if args.write_table else GEMM_TABLE
            table = build_gemm_table(rows, ops_bench.environment())
            if args.merge_table and path.exists():
                old = json.loads(path.read_text())
                merged = dict(old.get("entries", {}))
                merged.update(table["entries"])
                print(f"merging {len(table['entries'])} measured cells into {len(old.get('entries', {}))} of {path}")
                table = dict(old, entries=merged,
                             merged=old.get("merged", []) + [dict(environment=table["environment"],
                                                                  cells=sorted(table["entries"]))])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
            won = {}
            for e in table["entries"].values():
                won[e["winner"]] = won.get(e["winner"], 0) + 1
            print(f"wrote {path}: {len(table['entries'])} cells, winners {won}")
    return 0


def _write_compile_records(args: argparse.Namespace, settings: "ops_bench.BenchSettings") -> int:  # noqa: F821
    """The compile units of every case of ``--ops`` as CuTe DSL compile records (no case is built or run)."""
    from latency_specialized.bench import ops_bench
    from latency_specialized.testing import compile_records, cute_units

    ops_bench.load_case_modules()
    records = []
    for family in [f.strip() for f in args.ops.split(",") if f.strip()]:
        for case_fn in ops_bench.CASES.get(family, ()):
            for case in case_fn(settings):
                records += [r for fn, a in case.compile_units if (r := cute_units.record(fn, tuple(a), {}))]
    compile_records.save({"triton": [], "cute": records}, Path(args.compile_records))
    print(f"{len(compile_records.load(Path(args.compile_records))['cute'])} CuTe DSL compile records of "
          f"{args.ops} ({args.model}, TP {args.tp}, M {args.m}) -> {args.compile_records}")
    return 0
