"""Bench results: JSON (the record), Markdown (the table), PNG (us/layer vs batch), and comparisons.

A result is a plain dict (see ``layer_bench.run_bench``)::

    {"schema": 1, "machine": {...}, "config": {...}, "notes": [...],
     "kinds": {name: {"layer_index", "layer_kind", "context_axis", "stock", "stock_description",
                      "window", "kv_bytes_per_token", ...}},      # what each kind's cells measure
     "cells": [{"kind", "batch", "context",
                "ours":  {"us", "rounds", "noise", "kernels", "graph", "error", ...},
                "stock": {...},
                "roofline": {"bytes", "us", "breakdown", "distinct_experts"},
                "fraction", "stock_fraction", "speedup",
                "spec_tokens", "rows",                 # k draft tokens per request (0: single step); rows
                "verify": {"ratio", "single_us", "extra_us", "extra_us_per_row", "extra_experts",
                           "extra_expert_us", "stock_ratio", ...}}]}     # k > 0 only (layer_bench.add_verify_ratios)

Cells of k > 0 (``bench --spec-tokens``) get their own table ("Verification steps": rows, verification /
single step, what the extra rows cost) and plot panels (the ratio against k); the main table and the
us-vs-batch panels keep the single steps.

``compare(a, b)`` matches cells by (kind, batch, context, k) and flags a regression where B is slower
than A by more than the noise both runs measured (the spread of their repeated rounds), plus a
1% floor so that identical runs never flag.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from latency_specialized.bench.machine import describe
from latency_specialized.errors import UserError

NOISE_FLOOR = 0.01
"""Relative slowdown below which nothing is flagged, whatever the measured noise."""


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def write_json(result: dict[str, Any], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=1, default=str))
    return p


def load_json(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"no bench result at {p}: pass a JSON written by `latency-specialized bench`")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{p} is not valid JSON ({e.msg}): pass a bench result file") from None
    if not isinstance(data, dict) or "cells" not in data:
        raise UserError(f"{p} has no 'cells': pass a JSON written by `latency-specialized bench`")
    return data


def to_markdown(result: dict[str, Any]) -> str:
    """The result as a Markdown page: machine, config, notes, one row per cell."""
    cfg = result.get("config", {})
    experts = f", routed experts {cfg['experts'].upper()}" if cfg.get("experts") else ""
    lines = [f"# Layer bench: {cfg.get('model')} TP{cfg.get('tp')} shard on one GPU{experts}", "",
             f"Machine: {describe(result.get('machine', {}))}", "",
             f"Config: layers per variant {cfg.get('layers')}, {cfg.get('iters')} timed replays x "
             f"{cfg.get('rounds')} rounds (median per round), dtype {cfg.get('dtype')}, "
             f"roofline {cfg.get('hbm_tb_s')} TB/s. {cfg.get('comm')}", ""]
    for n in result.get("notes", []):
        lines.append(f"- {n}")
    kinds = kinds_table(result)
    if kinds:
        lines += ["", "## Layer kinds", "", kinds.rstrip("\n")]
    lines += ["", "Kernels: graph kernel nodes per layer, all of them / without communication (ours: kernels of the "
              "all-reduce and all-gather sites, counted per site during capture, taken out; stock has no "
              "communication kernels on one GPU).", "",
              "| layer | batch | context | ours us/layer | kernels (no comm) | stock us/layer | kernels | "
              "roofline us | "
              "ours % roofline | stock % roofline | speed-up | speed-up per byte | experts ours/stock | "
              "noise ours/stock |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in single_cells(result):
        o, s, r = c.get("ours") or {}, c.get("stock") or {}, c.get("roofline") or {}
        ours_us = _f(o.get("us")) + ("" if o.get("graph", True) else " (eager)") if o.get("us") is not None else \
            f"n/a ({o.get('error', 'not run')})"
        lines.append(
            f"| {c['kind']} | {c['batch']} | {_ctx(c)} | {ours_us} | {_kernels(o)} | "
            f"{_f(s.get('us'))} | {_f(s.get('kernels'), '{:.1f}')} | {_f(r.get('us'))} | "
            f"{_f(_pct(c.get('fraction')), '{:.0f}%')} | {_f(_pct(c.get('stock_fraction')), '{:.0f}%')} | "
            f"{_f(c.get('speedup'), '{:.2f}x')} | {_f(c.get('speedup_per_byte'), '{:.2f}x')} | "
            f"{_f(r.get('distinct_experts'), '{:.0f}')}/{_f(r.get('distinct_experts_stock'), '{:.0f}')} | "
            f"{_f(_pct(o.get('noise')), '{:.1f}%')}/{_f(_pct(s.get('noise')), '{:.1f}%')} |")
    verify = verify_table(result)
    if verify:
        lines += ["", "## Verification steps (speculative decoding)", "",
                  "rows = batch x (1 + k). 'verification / single step' = ours us/layer at k over ours us/layer of "
                  "the single-token step (k = 0) of the same kind, batch and context in this run (stock likewise); "
                  f"target {_target(result)}x for k = 7 at batch 1 (issue 25). Extra rows: what the batch x k extra "
                  "rows cost per layer (us, us per extra row); 'of it experts' = the roofline time of the extra "
                  "distinct experts those rows route to (bytes the single step does not read); the rest is the "
                  "rows' compute and any serial work (KDA verifies a request's tokens in order).", "",
                  verify.rstrip("\n")]
    sites = site_table(result)
    if sites:
        lines += ["", "## Ours: kernels per layer by op site", "",
                  "Counted during capture (`runtime.census`); '(between sites)' = copies the program makes between "
                  "ops (column slices made contiguous).", "", sites.rstrip("\n")]
    return "\n".join(lines) + "\n"


def single_cells(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The single-token-step cells (k = 0; every cell of a result written before verification cells)."""
    return [c for c in result["cells"] if not c.get("spec_tokens")]


def spec_cells(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The verification cells (k > 0), by kind, context, batch, k."""
    cells = [c for c in result["cells"] if c.get("spec_tokens")]
    return sorted(cells, key=lambda c: (c["kind"], c.get("context") or 0, c["batch"], c["spec_tokens"]))


def _target(result: dict[str, Any]) -> float:
    for c in result["cells"]:
        t = (c.get("verify") or {}).get("target_ratio")
        if t is not None:
            return t
    return 1.3


def verify_table(result: dict[str, Any]) -> str:
    """Markdown: one row per verification cell (empty without any)."""
    cells = spec_cells(result)
    if not cells:
        return ""
    lines = ["| layer | batch | context | k | rows | ours us/layer | single step us/layer | verification / single step "
             "| meets target | extra rows us (per row) | of it experts us | experts k / single | kernels k / single | "
             "roofline us (k / single) | stock us/layer | stock verification / single | noise ours |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        o, s, v = c.get("ours") or {}, c.get("stock") or {}, c.get("verify") or {}
        ours_us = _f(o.get("us")) + ("" if o.get("graph", True) else " (eager)") if o.get("us") is not None else \
            f"n/a ({o.get('error', 'not run')})"
        meets = "-" if v.get("meets_target") is None else ("yes" if v["meets_target"] else "no")
        if c["batch"] != 1 or c["spec_tokens"] != 7:
            meets = f"({meets})" if meets != "-" else meets  # the target is stated for k = 7, batch 1
        extra = "-" if v.get("extra_us") is None else \
            f"{v['extra_us']:.1f} ({_f(v.get('extra_us_per_row'), '{:.2f}')})"
        lines.append(
            f"| {c['kind']} | {c['batch']} | {_ctx(c)} | {c['spec_tokens']} | {c.get('rows', '-')} | {ours_us} | "
            f"{_f(v.get('single_us'))} | **{_f(v.get('ratio'), '{:.2f}x')}** | {meets} | {extra} | "
            f"{_f(v.get('extra_expert_us'))} | {_f(v.get('distinct_experts'), '{:.0f}')} / "
            f"{_f(v.get('single_distinct_experts'), '{:.0f}')} | "
            f"{_kernels(o)} / {_f(v.get('single_kernels'), '{:.0f}')} | "
            f"{_f(v.get('roofline_us'))} / {_f(v.get('single_roofline_us'))} | {_f(s.get('us'))} | "
            f"{_f(v.get('stock_ratio'), '{:.2f}x')} | {_f(_pct(o.get('noise')), '{:.1f}%')} |")
    lines.append("")
    lines.append("'meets target' in parentheses: the 1.3x target is stated for k = 7 at batch 1 only.")
    return "\n".join(lines) + "\n"


def kinds_table(result: dict[str, Any]) -> str:
    """Markdown: one row per benched kind - the layer it stands for, its context axis, the window and KV
    bytes per cached token on this rank (kinds with a KV cache), the stock composition. Empty for results
    written before the bench recorded its kinds."""
    kinds = result.get("kinds") or {}
    if not kinds:
        return ""
    lines = ["| kind | layer | context axis | window | KV bytes / token (rank) | stock composition |",
             "|---|---|---|---|---|---|"]
    for name, k in kinds.items():
        window = "-" if not k.get("context_axis") else (str(k["window"]) if k.get("window") else "none (full)")
        kv = _f(k.get("kv_bytes_per_token"), "{:.0f}")
        lines.append(f"| {name} | {k.get('layer_index')} ({k.get('layer_kind')}) | "
                     f"{'per --context' if k.get('context_axis') else 'none (any)'} | {window} | {kv} | "
                     f"{k.get('stock')}: {k.get('stock_description', '')} |")
    return "\n".join(lines) + "\n"


def _kernels(o: dict[str, Any]) -> str:
    """'17 (12)': all kernels per layer and, where counted, those outside communication sites."""
    k = _f(o.get("kernels"), "{:.0f}")
    return k if o.get("kernels_no_comm") is None else f"{k} ({o['kernels_no_comm']:.0f})"


def site_table(result: dict[str, Any]) -> str:
    """Markdown: kernels per layer by op site of ours, one column per (kind, batch, context) cell (sites
    with no kernel in any cell, e.g. the LM head that the per-layer difference cancels, are left out)."""
    cells = [c for c in result["cells"] if (c.get("ours") or {}).get("site_kernels")]
    if not cells:
        return ""
    sites = sorted({s.split("/", 1)[-1] for c in cells for s, n in c["ours"]["site_kernels"].items() if n})
    head = [f"{c['kind']} b{c['batch']}" + ("" if c.get("context") is None else f" c{c['context']}")
            + (f" k{c['spec_tokens']}" if c.get("spec_tokens") else "") for c in cells]
    lines = ["| site | " + " | ".join(head) + " |", "|---|" + "---|" * len(cells)]

    def per_site(c: dict[str, Any], site: str) -> float:
        return sum(v for k, v in c["ours"]["site_kernels"].items() if k.split("/", 1)[-1] == site)

    for site in sites:
        lines.append(f"| {site} | " + " | ".join(f"{per_site(c, site):.0f}" for c in cells) + " |")
    lines.append("| (between sites) | " + " | ".join(_f(c["ours"].get("unattributed_kernels"), "{:.0f}")
                                                   for c in cells) + " |")
    lines.append("| **all** | " + " | ".join(_f(c["ours"].get("kernels"), "{:.0f}") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _bk(c: dict[str, Any]) -> str:
    """'8', or '8 (k=7)' for a verification cell."""
    return str(c["batch"]) + (f" (k={c['spec_tokens']})" if c.get("spec_tokens") else "")


def _ctx(c: dict[str, Any]) -> str:
    return "any" if c.get("context") is None else str(c["context"])


def _pct(x: float | None) -> float | None:
    return None if x is None else 100.0 * x


def write_markdown(result: dict[str, Any], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(to_markdown(result))
    return p


def write_plot(result: dict[str, Any], path: str | Path) -> Path | None:
    """us/layer vs batch per (kind, context): ours, stock, roofline. None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for c in single_cells(result):
        groups.setdefault((c["kind"], _ctx(c)), []).append(c)
    spec_groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in spec_cells(result):
        spec_groups.setdefault((c["kind"], _ctx(c)), []).append(c)
    n = max(1, len(groups), len(spec_groups))
    fig, axes = plt.subplots(2 if spec_groups else 1, n, figsize=(5.5 * n, 4.2 * (2 if spec_groups else 1)),
                             squeeze=False)
    for ax, ((kind, ctx), cells) in zip(axes[1] if spec_groups else (), sorted(spec_groups.items())):
        _plot_verify(ax, kind, ctx, cells, _target(result))
    for ax in list(axes[0][len(groups):]) + (list(axes[1][len(spec_groups):]) if spec_groups else []):
        ax.axis("off")
    for ax, ((kind, ctx), cells) in zip(axes[0], sorted(groups.items())):
        cells = sorted(cells, key=lambda c: c["batch"])
        xs = [c["batch"] for c in cells]
        for key, label, style in (("ours", "ours", "o-"), ("stock", "stock composition", "s--")):
            ys = [(c.get(key) or {}).get("us") for c in cells]
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        rs = [(c.get("roofline") or {}).get("us") for c in cells]
        pts = [(x, y) for x, y in zip(xs, rs) if y is not None]
        if pts:
            ax.plot(*zip(*pts), "k:", label="HBM roofline")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_xlabel("batch (sequences)")
        ax.set_ylabel("us per layer")
        ax.set_title(f"{kind} layer, context {ctx}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    cfg = result.get("config", {})
    machine = describe(result.get("machine", {}))
    fig.suptitle(f"{cfg.get('model')} TP{cfg.get('tp')} shard, one GPU (communication excluded)\n"
                 + machine.replace(", torch", ",\ntorch", 1), fontsize=7)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def _plot_verify(ax: Any, kind: str, ctx: str, cells: list[dict[str, Any]], target: float) -> None:
    """Verification / single step against k, one line per batch (ours solid, stock dashed), the target line."""
    batches = sorted({c["batch"] for c in cells})
    ks = sorted({c["spec_tokens"] for c in cells} | {0})
    for i, b in enumerate(batches):
        mine = sorted((c for c in cells if c["batch"] == b), key=lambda c: c["spec_tokens"])
        for key, style, label in (("ratio", "o-", "ours"), ("stock_ratio", "s--", "stock")):
            pts = [(0, 1.0)] + [(c["spec_tokens"], (c.get("verify") or {}).get(key)) for c in mine]
            pts = [(x, y) for x, y in pts if y is not None]
            if len(pts) > 1:
                ax.plot(*zip(*pts), style, color=f"C{i}", label=f"{label}, batch {b}")
    ax.axhline(target, color="k", ls=":", lw=1, label=f"target {target}x (k = 7, batch 1)")
    ax.set_xticks(ks)
    ax.set_xlabel("k draft tokens (rows = batch x (1 + k))")
    ax.set_ylabel("verification / single step (us per layer)")
    ax.set_title(f"{kind} layer, context {ctx}: verification steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def compare(a: dict[str, Any], b: dict[str, Any], *, variant: str = "ours") -> tuple[str, list[dict[str, Any]]]:
    """Side-by-side table of two results and the regressions of B vs A beyond the measured noise."""
    def key(c):
        return (c["kind"], c["batch"], c["context"], c.get("spec_tokens") or 0)

    cells_a = {key(c): c for c in a["cells"]}
    rows, regressions = [], []
    lines = [f"A: {describe(a.get('machine', {}))}", f"B: {describe(b.get('machine', {}))}", "",
             f"| layer | batch | context | A {variant} us | B {variant} us | B/A | noise | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for cb in b["cells"]:
        ca = cells_a.get(key(cb))
        if ca is None:
            continue
        ta, tb = (ca.get(variant) or {}).get("us"), (cb.get(variant) or {}).get("us")
        if ta is None or tb is None:
            lines.append(f"| {cb['kind']} | {_bk(cb)} | {_ctx(cb)} | {_f(ta)} | {_f(tb)} | - | - | not comparable |")
            continue
        noise = max(NOISE_FLOOR, (ca.get(variant) or {}).get("noise") or 0.0, (cb.get(variant) or {}).get("noise") or 0.0)
        ratio = tb / ta
        verdict = "REGRESSION" if ratio > 1 + noise else ("faster" if ratio < 1 - noise else "same (within noise)")
        row = {"kind": cb["kind"], "batch": cb["batch"], "context": cb["context"],
               "spec_tokens": cb.get("spec_tokens") or 0, "a_us": ta, "b_us": tb,
               "ratio": ratio, "noise": noise, "verdict": verdict}
        rows.append(row)
        if verdict == "REGRESSION":
            regressions.append(row)
        lines.append(f"| {cb['kind']} | {_bk(cb)} | {_ctx(cb)} | {ta:.1f} | {tb:.1f} | {ratio:.3f} | "
                     f"{100 * noise:.1f}% | {verdict} |")
    missing = sorted(set(cells_a) - {key(c) for c in b["cells"]})
    if missing:
        lines.append(f"\ncells only in A: {missing}")
    lines.append(f"\n{len(regressions)} regression(s) beyond the measured noise")
    return "\n".join(lines), regressions
