"""Same-machine A/B of the layer bench: variants that differ by module constants or environment.

Two bench runs on different machines (or leases) of the same GPU model differ by up to ~2.5 % at
batch 1, more than the 1 % noise one run measures - too much to decide a change worth 1-3 us per
layer. This runs every variant on the same machine, interleaved (A B A B ...), each in a fresh
Python process whose settings are applied before anything else is imported:

    latency-specialized bench --kinds kda,mla --batch 1,2,4 --context 4096 \\
        --ab base --ab rounds:latency_specialized.kernels.moe_router.SORT_MAX_TOKENS=0 \\
        --ab oldtable:env.LS_GEMM_TABLE=/tmp/old.json --repeat 2

A variant is ``NAME`` or ``NAME:SETTING[,SETTING...]``; a setting is ``package.module.ATTR=VALUE``
(the module's attribute is replaced; VALUE is a Python literal, else a string) or ``env.VAR=VALUE``.
The first variant is the baseline of the summary: per cell the median of each variant's runs, the
difference to the baseline, and a verdict against the spread of the runs themselves.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from latency_specialized.errors import UserError


@dataclass(frozen=True)
class Setting:
    """One override: a module attribute (``target`` = module path) or an environment variable (``target`` = "env")."""

    target: str
    name: str
    value: Any

    def label(self) -> str:
        return f"{self.target}.{self.name}={self.value!r}"


@dataclass(frozen=True)
class Variant:
    name: str
    settings: tuple[Setting, ...] = ()


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_variant(text: str) -> Variant:
    """``NAME`` or ``NAME:a.b.ATTR=1,env.VAR=x`` -> Variant (UserError names the expected form)."""
    name, _, rest = text.partition(":")
    if not name.strip() or not name.replace("_", "").replace("-", "").isalnum():
        raise UserError(f"--ab '{text}': start with a variant name of letters, digits, '-' or '_' "
                        "(e.g. --ab rounds:latency_specialized.kernels.moe_router.SORT_MAX_TOKENS=0)")
    settings = []
    for item in (s.strip() for s in rest.split(",") if s.strip()):
        lhs, eq, value = item.partition("=")
        target, dot, attr = lhs.rpartition(".")
        if not eq or not dot or not target or not attr:
            raise UserError(f"--ab '{text}': setting '{item}' is not MODULE.ATTR=VALUE or env.VAR=VALUE")
        settings.append(Setting(target, attr, value if target == "env" else _literal(value)))
    return Variant(name.strip(), tuple(settings))


def check_settings(variant: Variant) -> None:
    """Every module imports and has the attribute (so a typo fails here, not after a GPU run)."""
    for s in variant.settings:
        if s.target == "env":
            continue
        try:
            mod = importlib.import_module(s.target)
        except ImportError as e:
            raise UserError(f"--ab {variant.name}: cannot import {s.target} ({e}): give a module path such as "
                            "latency_specialized.kernels.moe_router") from None
        if not hasattr(mod, s.name):
            upper = sorted(n for n in vars(mod) if n.isupper())
            raise UserError(f"--ab {variant.name}: {s.target} has no attribute {s.name} "
                            f"(its constants: {', '.join(upper) or 'none'})")


def apply_settings(settings: Sequence[Setting]) -> None:
    """In the child process, before the bench imports anything else."""
    for s in settings:
        if s.target == "env":
            os.environ[s.name] = str(s.value)
        else:
            setattr(importlib.import_module(s.target), s.name, s.value)


def child_command(variant: Variant, argv: Sequence[str]) -> list[str]:
    payload = {"settings": [[s.target, s.name, s.value] for s in variant.settings], "argv": list(argv)}
    return [sys.executable, "-m", "latency_specialized.bench.ab", json.dumps(payload)]


def _child_main(payload: str) -> int:
    data = json.loads(payload)
    apply_settings([Setting(*s) for s in data["settings"]])
    from latency_specialized.cli import main

    return main(data["argv"])


Runner = Callable[[list[str]], int]


def _subprocess_runner(cmd: list[str]) -> int:
    return subprocess.run(cmd, check=False).returncode


def run_ab(variants: Sequence[Variant], bench_argv: Sequence[str], out_dir: str | Path, *, repeat: int = 2,
           say: Callable[[str], None] = print, runner: Runner = _subprocess_runner) -> dict[str, list[dict]]:
    """Run ``bench`` once per (repeat, variant), interleaved, writing under ``out_dir/ab_runs``; return
    variant name -> list of result dicts."""
    from latency_specialized.bench import report

    if len(variants) < 2:
        raise UserError("--ab needs at least two variants (the first is the baseline)")
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise UserError(f"--ab variant names must differ (got {names})")
    if repeat < 1:
        raise UserError(f"--repeat {repeat}: give 1 or more")
    for v in variants:
        check_settings(v)
    out = Path(out_dir) / "ab_runs"   # every run's JSON/Markdown/PNG, apart from the committed results
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {v.name: [] for v in variants}
    for r in range(repeat):
        for v in variants:
            stem = f"ab_{v.name}_{r}"
            say(f"[ab] run {r + 1}/{repeat} variant {v.name}: " + (", ".join(s.label() for s in v.settings) or "as is"))
            rc = runner(child_command(v, list(bench_argv) + ["--name", stem, "--out", str(out)]))
            if rc != 0:
                raise UserError(f"[ab] variant {v.name} run {r + 1} failed (exit {rc}): see its output above")
            results[v.name].append(report.load_json(out / f"{stem}.json"))
    return results


def _ours_us(cell: dict) -> float | None:
    ours = cell.get("ours") or {}
    us = ours.get("us")
    return float(us) if isinstance(us, (int, float)) else None


def summarize(variants: Sequence[Variant], results: dict[str, list[dict]]) -> str:
    """Markdown: per cell and variant the median us (runs), the difference to the first variant, a verdict."""
    base = variants[0].name

    def key(c):  # verification cells (k > 0) are cells of their own, beside the single step they divide by
        return (c["kind"], c["batch"], c["context"], c.get("spec_tokens") or 0)

    per: dict[str, dict[tuple, list[float]]] = {}
    order: list[tuple] = []
    for name, runs in results.items():
        per[name] = {}
        for res in runs:
            for c in res["cells"]:
                us = _ours_us(c)
                if us is None:
                    continue
                if key(c) not in order:
                    order.append(key(c))
                per[name].setdefault(key(c), []).append(us)
    lines = [f"Same-machine A/B, baseline `{base}`; us per layer (ours), median of the runs [runs];",
             "verdict: the median moved by more than the larger spread (max - min) of the two variants' runs.", "",
             "| variant | settings |", "|---|---|"]
    lines += [f"| {v.name} | {', '.join(s.label() for s in v.settings) or '-'} |" for v in variants]
    lines += ["", "| layer | batch | context | k | " + " | ".join(v.name for v in variants) + " | "
              + " | ".join(f"{v.name} vs {base}" for v in variants[1:]) + " |",
              "|---|---|---|---|" + "---|" * (2 * len(variants) - 1)]
    for k in order:
        cols, diffs = [], []
        b = per.get(base, {}).get(k)
        for v in variants:
            runs = per.get(v.name, {}).get(k)
            cols.append(f"{statistics.median(runs):.1f} [{', '.join(f'{x:.1f}' for x in runs)}]" if runs else "-")
            if v.name == base:
                continue
            if not runs or not b:
                diffs.append("-")
                continue
            d = statistics.median(runs) - statistics.median(b)
            spread = max(max(runs) - min(runs), max(b) - min(b))
            verdict = "same" if abs(d) <= spread else ("faster" if d < 0 else "slower")
            diffs.append(f"{d:+.1f} us ({100 * d / statistics.median(b):+.1f} %) {verdict}")
        lines.append(f"| {k[0]} | {k[1]} | {k[2] if k[2] is not None else 'any'} | {k[3]} | " + " | ".join(cols) + " | "
                     + " | ".join(diffs) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
