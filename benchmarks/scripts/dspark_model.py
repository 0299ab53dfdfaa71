"""MODEL (not a measurement) of Kimi K3's single-user decode speed at TP8 with speculative decoding (DSpark).

    python benchmarks/scripts/dspark_model.py \\
        --bench benchmarks/results/h200/bench_kimi_k3_tp8_spec_kda.json \\
                benchmarks/results/h200/bench_kimi_k3_tp8_spec_mla.json \\
        [--allreduce benchmarks/results/h200x2/allreduce_x2.json] [--context 4096] [--draft-us 0] \\
        [--out benchmarks/results/h200] [--name dspark_model_kimi_k3_tp8]

Inputs, all measured elsewhere:

* **per-layer times**: ``bench --spec-tokens`` results (``latency-specialized bench --kinds kda,mla --batch 1
  --spec-tokens 3,7``): ours us/layer of a KDA+MoE and an MLA+MoE layer at batch 1 (one TP8 rank, one GPU,
  communication excluded) for each measured k (rows = 1 + k). k between two measured values is interpolated
  linearly (and marked so); k outside the measured range is not modelled.
* **all-reduce time**: the fused all-reduce (+ residual + RMSNorm) measured on **2** real H200s over NVLink
  (``benchmarks/results/h200x2/allreduce_x2.json``, ``multi_process`` rows, one-shot, CUDA-graph us per call),
  linear in the message bytes between its points. It is the only real multi-GPU figure in the tree: the
  ``benchmarks/results/h200/allreduce_single_gpu_ipc.json`` rows run every rank on ONE GPU (context switching /
  shared SMs, its own header says: not an NVLink figure). TP8 needs 7 peers, not 1: its all-reduce is slower.
  ``--allreduce benchmarks/results/h200x2/nccl_allreduce_norm.json`` models stock's NCCL + residual + RMSNorm
  (same 2 GPUs) instead.
* **layer counts**: the Kimi K3 spec (``adapter.spec('full')``): layers by attention kind; the one dense-MLP layer
  (layer 0, KDA) is counted at the KDA+MoE layer's time (its dense MLP is not benched: an overestimate).
* **all-reduces per layer**: the bench cell's communication sites (``ours.site_kernels``: the ``*allreduce`` sites
  with kernels; an all-gather site counted at the all-reduce time of its message), else 3 (attention, FFN,
  latent MoE: Kimi K3's program).

    step_us(k) = sum over kinds (layers of that kind x ours us/layer at rows 1 + k)
                 + sum over kinds (layers x all-reduces per layer x AR us at that message) + draft_us
    tok/s(a)   = a / step_us(k) * 1e6,   a = mean tokens emitted per step (accepted drafts + 1), a <= k + 1

Two policies per a: **best k** (the modelled k >= a - 1 with the highest tok/s: the smallest, as step time grows
with k) and **k = 7**. Not in the model: the LM head and embedding (the bench's head has a 512-token
vocabulary and cancels out of the per-layer figure; the note gives the real head's HBM floor), sampling and
the rejection sampler, the DSpark drafter's own time (``--draft-us`` adds a per-step figure), host work, and
the overlap of communication with compute. Writes ``<name>.md``, ``.json`` and ``.png`` with the reference line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

LABEL = "MODEL, not a measurement"
REFERENCE_TOK_S = 842.0
"""The single-user decode speed to compare against (issue 25's reference)."""
DEFAULT_AR = "benchmarks/results/h200x2/allreduce_x2.json"
MAX_A = 8


# ------------------------------------------------------------------------------------------ inputs
def load_cells(paths: Sequence[str | Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Cells and configs of bench result files (later files win for the same kind, batch, context, k)."""
    cells: dict[tuple, dict[str, Any]] = {}
    configs = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        if "cells" not in data:
            raise SystemExit(f"{p}: no 'cells' (pass JSON written by `latency-specialized bench`)")
        configs.append({"file": str(p), **(data.get("config") or {}), "machine": data.get("machine")})
        for c in data["cells"]:
            cells[(c["kind"], c["batch"], c.get("context"), c.get("spec_tokens") or 0)] = c
    return list(cells.values()), configs


def layer_times(cells: list[dict[str, Any]], kind: str, batch: int, context: int | None) -> dict[int, dict[str, Any]]:
    """k -> {'us', 'allreduces', 'all_gathers', 'rows'} of ours for one kind at ``batch`` (the context for kinds
    that have one; the only / smallest one when ``context`` is None)."""
    mine = [c for c in cells if c["kind"] == kind and c["batch"] == batch and (c.get("ours") or {}).get("us")]
    ctxs = sorted({c.get("context") for c in mine if c.get("context") is not None})
    if ctxs:
        want = context if context is not None else ctxs[0]
        if want not in ctxs:
            raise SystemExit(f"{kind}: no cells at context {want} (have {ctxs}): pass --context")
        mine = [c for c in mine if c.get("context") == want]
    out = {}
    for c in mine:
        k = c.get("spec_tokens") or 0
        o = c["ours"]
        ars, ags = comm_sites(o.get("site_kernels"))
        out[k] = {"us": o["us"], "allreduces": ars, "all_gathers": ags, "rows": c.get("rows", batch * (1 + k)),
                  "context": c.get("context"), "noise": o.get("noise"),
                  "ratio": (c.get("verify") or {}).get("ratio")}
    return out


def comm_sites(site_kernels: dict[str, float] | None) -> tuple[list[str] | None, list[str]]:
    """(all-reduce sites, all-gather sites) with kernels in a cell's per-layer site counts (None: not counted)."""
    if not site_kernels:
        return None, []
    names = {k.split("/", 1)[-1]: v for k, v in site_kernels.items()}
    ars = sorted(n for n, v in names.items() if n.endswith("allreduce") and v > 0)
    ags = sorted(n for n, v in names.items() if "all_gather" in n and v > 0)
    return ars, ags


def at_k(times: dict[int, dict[str, Any]], k: int) -> dict[str, Any] | None:
    """The layer time at ``k``: measured, linearly interpolated between the nearest measured k on each side,
    or None outside the measured range. Communication sites: those of the nearest measured k below."""
    if k in times:
        return {**times[k], "source": "measured"}
    lo = [m for m in times if m < k]
    hi = [m for m in times if m > k]
    if not lo or not hi:
        return None
    a, b = max(lo), min(hi)
    f = (k - a) / (b - a)
    rec = dict(times[a])
    rec.update(us=times[a]["us"] + f * (times[b]["us"] - times[a]["us"]), rows=None, noise=None, ratio=None,
               source=f"interpolated between k={a} and k={b}")
    return rec


def allreduce_table(path: str | Path, world: int = 2, algo: str = "one_shot") -> dict[str, Any]:
    """The measured all-reduce calls of ``path``: [(message bytes, us)] ascending (CUDA-graph us per call)."""
    data = json.loads(Path(path).read_text())
    if "rows" in data and "multi_process" not in data:  # nccl_allreduce_norm.py's file: NCCL + residual + norm
        hidden = 7168
        pts = sorted((r["tokens"] * r["hidden"] * 2, r["us"]) for r in data["rows"] if r.get("hidden") == hidden)
        if data.get("world") != world or not pts:
            raise SystemExit(f"{path}: no world-{world} rows at hidden {hidden}")
        return {"file": str(path), "world": world, "algo": "nccl+norm", "hidden": hidden, "points": pts,
                "device": data.get("gpu"), "date": None}
    rows = [r for r in data.get("multi_process", []) if r.get("world_size") == world and r.get("algo") == algo]
    if not rows:
        raise SystemExit(f"{path}: no multi_process rows of world {world}, algo {algo}")
    pts = sorted((r["message_bytes"], r["graph_us"]) for r in rows)
    return {"file": str(path), "world": world, "algo": algo, "hidden": data.get("hidden"), "points": pts,
            "device": data.get("device"), "date": data.get("date")}


def allreduce_us(table: dict[str, Any], message_bytes: float) -> float:
    """Linear in bytes between the measured points; the end points' figure outside them (a smaller message is
    latency-bound: not faster than the smallest measured one; a larger one is left at the largest: say so)."""
    pts = table["points"]
    if message_bytes <= pts[0][0]:
        return pts[0][1]
    for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
        if message_bytes <= b1:
            return t0 + (message_bytes - b0) / (b1 - b0) * (t1 - t0)
    return pts[-1][1]


def site_width(site: str, hidden: int, latent: int | None) -> int:
    """Elements per row of a communication site's message: the latent MoE's all-reduce carries the latent width."""
    return latent if ("latent" in site and latent) else hidden


def model_shape(counts: dict[str, int] | None = None) -> dict[str, Any]:
    """Kimi K3's layer counts by bench kind, hidden / latent width, vocabulary, from the adapter's full spec."""
    from latency_specialized.plugins import get_registry
    from latency_specialized.spec import MoESpec

    full = get_registry().adapter("kimi_k3").spec("full")
    by_kind: dict[str, int] = {}
    dense: dict[str, int] = {}
    for layer in full.layers:
        by_kind[layer.attention.kind] = by_kind.get(layer.attention.kind, 0) + 1
        if not isinstance(layer.ffn, MoESpec):
            dense[layer.attention.kind] = dense.get(layer.attention.kind, 0) + 1
    moe = next(l.ffn for l in full.layers if isinstance(l.ffn, MoESpec))
    return {"layers": dict(counts) if counts else by_kind, "dense_layers": dense, "hidden": full.hidden_size,
            "latent": moe.latent_dim, "vocab": full.vocab_size, "num_layers": full.num_layers}


# ------------------------------------------------------------------------------------------ the model
def build_model(cells: list[dict[str, Any]], ar: dict[str, Any], shape: dict[str, Any], *, batch: int = 1,
                context: int | None = None, draft_us: float = 0.0, tp: int = 8,
                default_allreduces: Sequence[str] = ("attn.allreduce", "ffn.allreduce", "moe.latent_allreduce"),
                reference: float = REFERENCE_TOK_S, measured_only: bool = False) -> dict[str, Any]:
    """The modelled step time per k and tok/s per mean accepted tokens (the module docstring);
    ``measured_only``: 'best k' picks among measured k only (interpolated steps still listed)."""
    kinds = sorted(shape["layers"])
    times = {kind: layer_times(cells, kind, batch, context) for kind in kinds}
    missing = [kind for kind in kinds if not times[kind]]
    if missing:
        raise SystemExit(f"no measured batch-{batch} cells of kind(s) {missing} in the bench files: run the bench "
                         f"with --kinds {','.join(kinds)} --batch {batch}")
    measured = {kind: sorted(t) for kind, t in times.items()}
    ks = [k for k in range(0, MAX_A) if all(at_k(times[kind], k) is not None for kind in kinds)]
    steps = []
    for k in ks:
        rows = batch * (1 + k)
        parts, comm_parts, sources = {}, {}, {}
        for kind in kinds:
            lt = at_k(times[kind], k)
            n = shape["layers"][kind]
            sites = lt["allreduces"] if lt["allreduces"] is not None else list(default_allreduces)
            per_layer_comm = 0.0
            detail = []
            for site in list(sites) + list(lt["all_gathers"]):
                msg = rows * site_width(site, shape["hidden"], shape["latent"]) * 2
                us = allreduce_us(ar, msg)
                per_layer_comm += us
                detail.append({"site": site, "message_bytes": msg, "us": us})
            parts[kind] = {"layers": n, "us_per_layer": lt["us"], "us": n * lt["us"], "source": lt["source"],
                           "comm_sites": detail, "comm_sites_from": "bench cell" if lt["allreduces"] is not None
                           else "assumed (no site counts in the cell)",
                           "comm_us_per_layer": per_layer_comm, "comm_us": n * per_layer_comm}
            comm_parts[kind] = n * per_layer_comm
            sources[kind] = lt["source"]
        layers_us = sum(p["us"] for p in parts.values())
        comm_us = sum(comm_parts.values())
        step = layers_us + comm_us + draft_us
        steps.append({"k": k, "rows": rows, "layers_us": layers_us, "comm_us": comm_us, "draft_us": draft_us,
                      "step_us": step, "kinds": parts,
                      "interpolated": any(s != "measured" for s in sources.values())})
    by_k = {s["k"]: s for s in steps}
    curve = []
    for a in range(1, MAX_A + 1):
        feasible = [s for s in steps if s["k"] + 1 >= a and not (measured_only and s["interpolated"])]
        best = max(feasible, key=lambda s: a / s["step_us"]) if feasible else None
        k7 = by_k.get(7)
        curve.append({"a": a,
                      "best_k": best["k"] if best else None,
                      "tok_s_best_k": a / best["step_us"] * 1e6 if best else None,
                      "best_k_interpolated": best["interpolated"] if best else None,
                      "tok_s_k7": a / k7["step_us"] * 1e6 if k7 else None,
                      "vs_reference_best_k": (a / best["step_us"] * 1e6 / reference) if best else None})
    from latency_specialized.hardware import roofline_bandwidth

    head_bytes = shape["vocab"] * shape["hidden"] * 2 / tp
    head_us = head_bytes / roofline_bandwidth() * 1e6
    notes = [
        f"{LABEL}: arithmetic over measured pieces; nothing here ran as a whole.",
        f"Per-layer times: ours us/layer of the bench files at batch {batch} (one H200 running one TP{tp} rank's "
        "shapes, communication excluded), measured k: " + "; ".join(f"{kind} {measured[kind]}" for kind in kinds)
        + ". Other k between two measured ones: linear interpolation, marked 'interpolated'; k outside the "
        "measured range is not modelled.",
        f"All-reduce: {ar['file']} (world {ar['world']}, {ar['algo']}, CUDA-graph us per call, measured on 2 H200s "
        "over NVLink), linear in message bytes between its points; at TP8 a call has 7 peers, not 1, so this 2-GPU "
        "figure is optimistic for TP8. The bench's layers already run the one-rank fused residual(+RMSNorm) kernel "
        "at each all-reduce site, so the model counts that local kernel twice (a few us per site: pessimistic).",
        "Layers: " + ", ".join(f"{n} {kind}" for kind, n in shape["layers"].items())
        + (f" (incl. {', '.join(f'{n} dense-MLP {kind}' for kind, n in shape['dense_layers'].items())}, counted at "
           "the MoE layer's time: an overestimate)" if shape["dense_layers"] else "") + ".",
        f"Not modelled: the LM head and embedding (the real head reads {head_bytes / 1e6:.0f} MB per rank per step, "
        f">= {head_us:.0f} us at {roofline_bandwidth() / 1e12:.1f} TB/s, plus its all-gather), sampling and the "
        "rejection sampler, the DSpark drafter" + (f" (here: {draft_us:.0f} us per step added)" if draft_us else
                                         " (0 us: tok/s is an upper bound for a given a)")
        + ", host work between steps, communication overlapped with compute.",
        "a = mean tokens emitted per verification step (accepted drafts + 1), a <= k + 1. 'best k': the modelled k "
        ">= a - 1 with the highest tok/s (the smallest, as the step time grows with k); 'k = 7': every step verifies "
        "7 drafts. Which a a drafter reaches at a given k (its acceptance rate) is not modelled.",
    ]
    if any(s["interpolated"] for s in steps):
        notes.append("Interpolated k: " + ", ".join(str(s["k"]) for s in steps if s["interpolated"])
                     + (" (listed, not used for 'best k': --measured-only)." if measured_only else
                        " ('best k' may pick them: marked 'interp.')."))
    return {"label": LABEL, "model": "kimi_k3", "tp": tp, "batch": batch, "context": context,
            "reference_tok_s": reference, "allreduce": ar, "shape": shape, "measured_k": measured,
            "steps": steps, "curve": curve, "notes": notes}


# ------------------------------------------------------------------------------------------ outputs
def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _source(s: dict[str, Any]) -> str:
    machine = s.get("machine") or {}
    gpu = machine.get("gpu") if isinstance(machine.get("gpu"), dict) else {}
    return f"{s['file']} ({gpu.get('name', '?')}, git {machine.get('git_commit', '?')}, k {s.get('spec_tokens', [0])})"


def to_markdown(m: dict[str, Any], sources: list[dict[str, Any]]) -> str:
    kinds = sorted(m["shape"]["layers"])
    lines = [f"# {m['label'].upper()}: Kimi K3 TP{m['tp']} single-user decode speed with DSpark", "",
             f"**{m['label']}.** Modelled from per-layer bench times, a 2-GPU all-reduce figure and the layer "
             f"counts; reference: {m['reference_tok_s']:.0f} tok/s.", "",
             "Bench files: " + "; ".join(_source(s) for s in sources), ""]
    lines += [f"- {n}" for n in m["notes"]]
    lines += ["", "## Step time per k (batch %d%s)" % (m["batch"], "" if m["context"] is None else
                                                       f", MLA context {m['context']}"), "",
              "| k | rows | " + " | ".join(f"{k} us/layer" for k in kinds) + " | layers us | all-reduce us | "
              "draft us | step us | source |",
              "|---|---|" + "---|" * len(kinds) + "---|---|---|---|---|"]
    for s in m["steps"]:
        src = "; ".join(f"{k}: {s['kinds'][k]['source']}" for k in kinds)
        lines.append(f"| {s['k']} | {s['rows']} | " + " | ".join(_f(s['kinds'][k]['us_per_layer']) for k in kinds)
                     + f" | {s['layers_us']:.0f} | {s['comm_us']:.0f} | {s['draft_us']:.0f} | {s['step_us']:.0f} | "
                     f"{src} |")
    lines += ["", "All-reduces per layer and their modelled time (k = 0): " + "; ".join(
        f"{k}: " + ", ".join(f"{d['site']} {d['us']:.1f} us" for d in m["steps"][0]["kinds"][k]["comm_sites"])
        + f" ({m['steps'][0]['kinds'][k]['comm_sites_from']})" for k in kinds) if m["steps"] else "", "",
              f"## tok/s against mean accepted tokens per step ({m['label']})", "",
              f"| a | best k | tok/s (best k) | x {m['reference_tok_s']:.0f} tok/s | tok/s (k = 7) |",
              "|---|---|---|---|---|"]
    for c in m["curve"]:
        bk = "-" if c["best_k"] is None else (f"{c['best_k']}" + (" (interp.)" if c["best_k_interpolated"] else ""))
        lines.append(f"| {c['a']} | {bk} | {_f(c['tok_s_best_k'], '{:.0f}')} | "
                     f"{_f(c['vs_reference_best_k'], '{:.2f}x')} | {_f(c['tok_s_k7'], '{:.0f}')} |")
    return "\n".join(lines) + "\n"


def write_plot(m: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for key, style, label in (("tok_s_best_k", "o-", "best k per a"), ("tok_s_k7", "s--", "k = 7")):
        pts = [(c["a"], c[key]) for c in m["curve"] if c[key] is not None]
        if pts:
            ax.plot(*zip(*pts), style, label=f"{label} ({m['label']})")
    for c in m["curve"]:
        if c["tok_s_best_k"] is not None:
            ax.annotate(f"k={c['best_k']}" + ("*" if c["best_k_interpolated"] else ""), (c["a"], c["tok_s_best_k"]),
                        textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    ax.axhline(m["reference_tok_s"], color="k", ls=":", label=f"reference {m['reference_tok_s']:.0f} tok/s")
    ax.set_xlabel("mean accepted tokens per step a (accepted drafts + 1)")
    ax.set_ylabel("single-user decode tok/s")
    ax.set_xticks(range(1, MAX_A + 1))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{m['label'].upper()}: Kimi K3 TP{m['tp']} + DSpark, batch {m['batch']}\n"
                 f"measured per-layer times x layers + {m['allreduce']['world']}-GPU all-reduce figure"
                 + (" (* = interpolated k)" if any(s["interpolated"] for s in m["steps"]) else ""), fontsize=9)
    ax.text(0.5, 0.5, m["label"].upper(), transform=ax.transAxes, fontsize=26, color="red", alpha=0.12,
            ha="center", va="center", rotation=20)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bench", nargs="+", required=True, help="bench JSON files with spec cells (kda and mla)")
    p.add_argument("--allreduce", default=DEFAULT_AR, help=f"all-reduce results (default {DEFAULT_AR})")
    p.add_argument("--allreduce-world", type=int, default=2)
    p.add_argument("--allreduce-algo", default="one_shot")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=None, help="MLA cells' context (default: the smallest measured)")
    p.add_argument("--draft-us", type=float, default=0.0, help="per-step drafter time to add (default 0)")
    p.add_argument("--reference", type=float, default=REFERENCE_TOK_S)
    p.add_argument("--measured-only", action="store_true", help="'best k' among measured k only")
    p.add_argument("--out", default="benchmarks/results/h200")
    p.add_argument("--name", default="dspark_model_kimi_k3_tp8")
    args = p.parse_args(argv)
    cells, sources = load_cells(args.bench)
    tps = {s.get("tp") for s in sources}
    if tps - {8}:
        print(f"warning: bench files of TP {sorted(t for t in tps if t is not None)}; the model is labelled TP8",
              file=sys.stderr)
    ar = allreduce_table(args.allreduce, args.allreduce_world, args.allreduce_algo)
    m = build_model(cells, ar, model_shape(), batch=args.batch, context=args.context, draft_us=args.draft_us,
                    reference=args.reference, measured_only=args.measured_only)
    m["sources"] = sources
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(m, indent=1, default=str))
    md = to_markdown(m, sources)
    (out / f"{args.name}.md").write_text(md)
    png = write_plot(m, out / f"{args.name}.png")
    print(md)
    print(f"wrote {out / (args.name + '.json')}, {out / (args.name + '.md')}"
          + (f", {png}" if png else " (no matplotlib: no plot)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
