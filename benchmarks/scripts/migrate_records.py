"""Carry a kernel's compile records over a new constexpr argument (a new switch), and add records of its variants.

    python benchmarks/scripts/migrate_records.py tests/compile_records.json.gz --kernel select_kernel \\
        --add LOOPS=False --add "LOOP_TILE=min(2048, max(TILE // 4, 16))" \\
        --variant "NARROW and not FINE" LOOPS=True [--variant "num_warps == 16" num_warps=8 ...] [--out FILE]

A kernel that takes a new constexpr leaves its records stale (``precompile.py`` reports and skips them), so the device
compiles those kernels itself - seconds each, in the device's budget. This writes the records with the new arguments
(``--add NAME=EXPR``: EXPR a Python expression over the record's constexprs by name and ``num_warps``), at their
places in the kernel's current argument list, then for each ``--variant WHERE NAME=EXPR[,NAME=EXPR]`` a copy of every
record where WHERE holds with those values (the switch's other side, for an A/B or a pick on the device). Records of
other kernels pass unchanged; the output (default: the input) is merged as ``compile_records`` merges.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from latency_specialized.testing import compile_records  # noqa: E402
from latency_specialized.testing.triton_specs import record_constexprs, resolve, with_constexprs  # noqa: E402


def _evaluate(assignments: list[str], names: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for assignment in assignments:
        name, expr = assignment.split("=", 1)
        out[name.strip()] = eval(expr, {"min": min, "max": max}, dict(names))   # noqa: S307 (the user's own CLI)
    return out


def migrate(records: list[dict[str, str]], kernel: str, add: list[str],
            variants: list[tuple[str, list[str]]]) -> tuple[list[dict[str, str]], int, int]:
    """(records, migrated, variants added): ``kernel``'s records (``fn`` ending in its name) with ``add``'s
    arguments, then each variant's copies."""
    out, migrated, added = [], 0, 0
    for record in records:
        if not record["fn"].replace(":", ".").endswith("." + kernel):
            out.append(record)
            continue
        now = list(resolve(record["fn"]).arg_names)
        names = record_constexprs(record)
        new = with_constexprs(record, now, _evaluate(add, names))
        out.append(new)
        migrated += 1
        for where, settings in variants:
            names = record_constexprs(new)
            if eval(where, {}, dict(names)):   # noqa: S307
                out.append(with_constexprs(new, now, _evaluate(settings, names)))
                added += 1
    return out, migrated, added


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", type=Path)
    ap.add_argument("--kernel", required=True, help="the kernel's name (the end of its records' fn)")
    ap.add_argument("--add", action="append", default=[], metavar="NAME=EXPR")
    ap.add_argument("--variant", nargs=2, action="append", default=[], metavar=("WHERE", "NAME=EXPR[,NAME=EXPR]"),
                    help="a copy where WHERE holds, with these values (each EXPR without a comma)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    recs = compile_records.load(args.records)
    variants = [(where, settings.split(",")) for where, settings in args.variant]
    triton, migrated, added = migrate(recs["triton"], args.kernel, args.add, variants)
    out = args.out or args.records
    compile_records.save(compile_records.merge([{**recs, "triton": triton}]), out)
    print(f"{args.kernel}: {migrated} records migrated, {added} variant records added -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
