"""Pick an A/B's winning switches on the device and set them in the tree the next suite call runs.

The device machine goes back after 30 s idle, so the call after a measurement cannot wait for a person to read its
tables; this script makes the decision the person would, by a rule fixed before the numbers came in, and the suite
calls after it apply what it wrote (each call runs on a fresh copy of the tree, so each applies it again).

    python3 benchmarks/scripts/ab_pick.py pick both --faster W/glm/ab.md \\
        [--not-slower W/dsv/ab.md:sideboth:side] >> picks.txt
    python3 benchmarks/scripts/ab_pick.py pick wide,wide8 --faster W/glm/ab.md --not-slower W/dsv/ab.md
    python3 benchmarks/scripts/ab_pick.py apply $(cat picks.txt)     # module.path.NAME=VALUE ...

`pick` prints the variant's settings (one per line) and exits 0 where the variant beats `base` in every
``--faster`` file at batch 1 - its median lower by more than the larger spread (max - min) of the two variants' runs
and by at least ``--min-us`` - and is slower at no batch of any file (its median higher by more than that spread),
nor slower in the ``--not-slower`` checks (another file's variant against its own baseline); else it prints why on
stderr and exits 1. Several variants (comma-separated) are alternatives: each is judged so, and of those that pass
the one with the lowest batch-1 median in the first ``--faster`` file is printed.
`apply` rewrites each ``NAME = ...`` line at the start of the module's file (it must be there
exactly once).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def read_ab(path: Path) -> tuple[dict[str, list[str]], dict[int, dict[str, tuple[float, list[float]]]]]:
    """An ``ab.md`` of ``bench --ab``: the variants' settings, and per batch each variant's (median, runs)."""
    settings: dict[str, list[str]] = {}
    rows: dict[int, dict[str, tuple[float, list[float]]]] = {}
    header: list[str] = []
    for line in path.read_text().splitlines():
        if not line.startswith("|") or line.startswith("|---"):
            continue
        cells = _cells(line)
        if cells[:2] == ["variant", "settings"] or cells[0] == "layer":
            header = cells
            continue
        if header[:2] == ["variant", "settings"]:
            settings[cells[0]] = [] if cells[1] == "-" else [s.strip() for s in cells[1].split(",")]
        elif header and header[0] == "layer":
            per_variant = {}
            for name, cell in zip(header[4:], cells[4:]):
                match = re.fullmatch(r"([-0-9.]+) \[([-0-9., ]+)\]", cell)
                if match:
                    per_variant[name] = (float(match[1]), [float(x) for x in match[2].split(",")])
            rows[int(cells[1])] = per_variant
    return settings, rows


def _spread(runs: list[float]) -> float:
    return max(runs) - min(runs)


def _check(path: Path, variant: str, base: str, need_faster: bool, min_us: float) -> list[str] | None:
    """The variant's settings if it is slower than ``base`` at no batch of ``path`` (and, with ``need_faster``,
    faster at batch 1); else None, the reason on stderr."""
    if not path.is_file():
        print(f"{path}: missing (the A/B did not finish)", file=sys.stderr)
        return None
    settings, rows = read_ab(path)
    if variant not in settings or base not in settings:
        print(f"{path}: no variant {variant!r} or {base!r}", file=sys.stderr)
        return None
    if not rows or (need_faster and 1 not in rows) or any({variant, base} - set(r) for r in rows.values()):
        print(f"{path}: no timings of {variant!r} and {base!r} at every batch (batch 1 among them)", file=sys.stderr)
        return None
    for batch, per_variant in sorted(rows.items()):
        (theirs, their_runs), (ours, our_runs) = per_variant[base], per_variant[variant]
        noise = max(_spread(their_runs), _spread(our_runs))
        if ours > theirs + noise + 1e-9:
            print(f"{path}: {variant} slower than {base} at batch {batch}: {ours} vs {theirs} (spread {noise:.1f})",
                  file=sys.stderr)
            return None
        if batch == 1 and need_faster and not ours < theirs - max(noise, min_us) - 1e-9:
            print(f"{path}: {variant} not faster than {base} at batch 1: {ours} vs {theirs} (spread {noise:.1f}, "
                  f"min {min_us})", file=sys.stderr)
            return None
    return settings[variant]


def pick(variant: str, faster: list[Path], not_slower: list[str], min_us: float) -> list[str] | None:
    """``variant``'s settings (from the first ``faster`` file) where it beats ``base`` in every ``faster`` file and
    each ``not_slower`` check (``PATH[:VARIANT[:BASE]]``, default this variant against ``base``) holds."""
    chosen: list[str] | None = None
    for path in faster:
        settings = _check(path, variant, "base", True, min_us)
        if settings is None:
            return None
        chosen = settings if chosen is None else chosen
    for spec in not_slower:
        path, other, base = (spec.split(":") + [variant, "base"][spec.count(":"):])[:3]
        if _check(Path(path), other, base, False, min_us) is None:
            return None
    return chosen


def apply(settings: list[str], root: Path = ROOT) -> None:
    """Rewrite ``NAME = ...`` in each setting's module file under ``root`` (``module.path.NAME=VALUE``)."""
    for setting in settings:
        target, value = setting.split("=", 1)
        module, name = target.rsplit(".", 1)
        path = root / (module.replace(".", "/") + ".py")
        text = path.read_text()
        pattern = re.compile(rf"^{re.escape(name)} = .*$", re.M)
        if len(pattern.findall(text)) != 1:
            raise SystemExit(f"{path}: {name} = ... is not there exactly once; set {setting} by hand")
        path.write_text(pattern.sub(f"{name} = {value}", text))
        print(f"set {setting}")


def pick_best(variants: list[str], faster: list[Path], not_slower: list[str],
              min_us: float) -> list[str] | None:
    """Of ``variants`` (alternatives), the settings of the one with the lowest batch-1 median in ``faster[0]`` among
    those ``pick`` accepts (a ``not_slower`` spec without a variant checks each variant under its own name)."""
    passing = {}
    for variant in variants:
        chosen = pick(variant, faster, not_slower, min_us)
        if chosen is not None:
            passing[variant] = chosen
    if not passing:
        return None
    batch1 = read_ab(faster[0])[1][1]
    best = min(passing, key=lambda v: batch1[v][0])
    print(f"picked {best} of {', '.join(variants)} (passing: {', '.join(passing)})", file=sys.stderr)
    return passing[best]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pick")
    p.add_argument("variant", help="a variant, or several comma-separated alternatives (the fastest passing)")
    p.add_argument("--faster", type=Path, action="append", default=[], required=True)
    p.add_argument("--not-slower", action="append", default=[], metavar="PATH[:VARIANT[:BASE]]")
    p.add_argument("--min-us", type=float, default=0.5)
    a = sub.add_parser("apply")
    a.add_argument("settings", nargs="*")
    args = parser.parse_args()
    if args.command == "apply":
        apply(args.settings)
        return
    chosen = pick_best(args.variant.split(","), args.faster, args.not_slower, args.min_us)
    if chosen is None:
        raise SystemExit(1)
    print("\n".join(chosen))


if __name__ == "__main__":
    main()
