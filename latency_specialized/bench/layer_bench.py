"""Per-layer decode bench on one GPU: ours (the adapter's program, graphed) vs the stock composition.

For every (layer kind, batch[, context]) cell, with random weights of the real per-rank shapes of a
TP shard (communication excluded on one GPU, and reported as such). The kinds are the adapter's
(``adapter.bench_kinds()`` -> ``adapter.BenchKind`` per ``--kinds`` name: the layer of the full spec it
stands for, whether its cells have a context axis - a KV cache read - its KV block size, and which
stock composition of ``bench/stock/compositions.py`` is its baseline): Kimi K3 ``kda`` (context-free)
and ``mla``; Muse Spark ``swa`` (sliding-window GQA + latent MoE) and ``full`` (NoPE full attention):

* **time**: each variant is captured into CUDA graphs and replayed; every replay is timed with CUDA
  events; a round's figure is the median of ``iters`` replays, and ``rounds`` rounds run
  alternately per variant (their spread is the measured noise). Each variant runs ``layers`` layer
  copies with their own weights back to back, so weights rotate beyond the L2 (a KDA+MoE layer
  touches > 100 MB per rank already at batch 1);
* **kernels per layer**: kernel nodes of the captured graph (``graph_runner.graph_node_counts``),
  and for ours also split by op site during capture (``runtime.census``): kernels of the
  communication sites (all-reduces, all-gathers: on one GPU stand-ins for the exchange) vs the rest;
* **roofline**: bytes a layer must read once on this rank (PERF.md "Which bytes count": every
  weight once per TP group, so a rank's share is weight/TP; routed experts = the *distinct* experts
  the batch actually selected; recurrent state read + written; the KV cache a step reads, the last
  ``window`` tokens of a windowed layer, and the new token's entry written) / the HBM bandwidth;
* ``fraction = t_roofline / t_ours`` and ``speedup = t_stock / t_ours``.

"Ours" comes from the adapter's ``layer_bench()`` hook (an object with ``build_ours(...)``: the generic
harness ``runtime/layer_harness.py`` over the adapter's pieces and its ``bench_spec``); its step also runs
the embedding, final norm and head, so the bench measures a 1-layer program too and reports
``(t_K - t_1) / (K - 1)`` per layer (kernels likewise).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from latency_specialized.errors import UserError
from latency_specialized.runtime.census import split_communication
from latency_specialized.runtime.graph_runner import graph_node_counts, new_graph
from latency_specialized.spec import (GQAAttentionSpec, KDAAttentionSpec, MLAAttentionSpec, ModelSpec, MoESpec,
                                      SparseMQAAttentionSpec)

HBM_BYTES_PER_S = 4.3e12
"""H200 achievable HBM read bandwidth (PERF.md): the roofline."""


@dataclass(frozen=True)
class BenchConfig:
    """One bench invocation."""

    model: str = "kimi_k3"
    tp: int = 8
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    contexts: tuple[int, ...] = (4096, 32768)
    kinds: tuple[str, ...] = ("kda",)
    layers: int = 3
    """Layer copies per variant (>= 2: the per-layer figure of 'ours' is a difference of K and 1 layers)."""
    iters: int = 40
    rounds: int = 2
    warmup: int = 5
    dtype: str = "bfloat16"
    seed: int = 0


class Variant(Protocol):
    """One thing to time: a captured step of ``layers`` layers."""

    name: str
    layers: int

    def capture(self) -> dict[str, int] | None:
        """Warm up and capture; returns graph node counts by type (None if unreadable)."""
        ...

    def replay(self) -> None:
        ...

    def eager(self) -> None:
        """The same step without a graph (timed when capture fails)."""
        ...

    def routing(self) -> list[torch.Tensor]:
        """Expert ids [batch, top_k] of every MoE layer of one step."""
        ...


class GraphedStep:
    """A Variant from a step function: eager warm-up on a side stream, then one graph capture."""

    def __init__(self, name: str, layers: int, step: Callable[[], None],
                 routing: Callable[[], list[torch.Tensor]] | None = None, warmup: int = 2):
        self.name, self.layers, self._step = name, layers, step
        self._routing = routing
        self._warmup = warmup
        self.graph: torch.cuda.CUDAGraph | None = None

    def capture(self) -> dict[str, int] | None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self._warmup):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = new_graph()
        with torch.cuda.graph(g):
            self._step()
        if hasattr(g, "instantiate"):
            try:
                g.instantiate()
            except RuntimeError:
                pass
        self.graph = g
        return graph_node_counts(g)

    def replay(self) -> None:
        assert self.graph is not None, "capture() first"
        self.graph.replay()

    def eager(self) -> None:
        self._step()

    def routing(self) -> list[torch.Tensor]:
        return self._routing() if self._routing else []


# ------------------------------------------------------------------------------------------ roofline
def layer_bytes(full: ModelSpec, layer: int, tp: int, batch: int, context: int | None,
                distinct_experts: float | None, *, weight_bytes: float = 2.0,
                router_weight_bytes: float | None = None) -> dict[str, float]:
    """Bytes one layer must move on one rank (weights once per TP group, split evenly; state r+w).

    ``full`` is the unsharded spec; routed experts count ``distinct_experts`` (the batch's actual
    routing); bf16 weights (``weight_bytes``) except fp32 parameters; the router weight counts
    ``router_weight_bytes`` per element (default ``weight_bytes``: Kimi K3 stores it bf16, its logits are
    fp32; 4 for a router kept in fp32). MLA: each rank reads the whole latent KV cache of ``context``
    tokens (no DCP). GQA: the q|k|v(|gate) and o projections (a weightless QK norm has no bytes) and the
    rank's KV heads' cache, ``batch * tokens_read * KV_rank * head_dim * 2 (k, v) * 2 bytes`` with
    ``tokens_read = min(context + 1, window)`` for a windowed layer, ``context + 1`` for full attention,
    plus the new token's k/v written. Residual norms: AttnRes (two mixes of three [N] vectors), else
    ``norms``: two pre-norm and two post-norm gains [N] (+ the two joins' per-channel gate
    coefficients, fp32 [N] x 2 each, for a gated residual) and a latent MoE's post-expert norm [L].
    Latent MoE: ``latent_proj`` = pre- and post-expert projections ([L, N], [N, L]) and the pre-expert
    (latent) norm [L]; routed experts ``3 * I * L`` each (gate/up [2I, L], down [L, I]).
    """
    spec = full.layers[layer]
    a, f = spec.attention, spec.ffn
    N, wb = full.hidden_size, weight_bytes
    rb = weight_bytes if router_weight_bytes is None else router_weight_bytes
    out: dict[str, float] = {}
    if full.residual.kind == "attnres":
        out["attnres"] = 2 * 3 * N * wb / tp
    elif full.residual.kind == "mhc":
        pass  # a sparse MQA layer's ``mhc`` term (bench.stock.sparse_mqa_moe.sparse_mqa_bytes): seams + their norms
    else:
        gates = 2 * 2 * N * 4 if full.residual.kind == "gated" else 0
        latent_norm = f.latent_dim * wb if (isinstance(f, MoESpec) and f.latent_dim) else 0
        out["norms"] = (4 * N * wb + gates + latent_norm) / tp
    if isinstance(a, KDAAttentionSpec):
        hd = a.num_heads * a.head_dim
        out["attn_weights"] = ((4 * hd + a.decay_rank + a.num_heads) * N + hd * a.decay_rank + N * hd) * wb / tp \
            + (3 * hd * a.conv_kernel + a.num_heads + hd + a.head_dim) * 4 / tp
        h_rank = a.num_heads // tp
        out["kda_state"] = batch * (h_rank * a.head_dim * a.head_dim * 4 * 2
                                    + 3 * h_rank * a.head_dim * (a.conv_kernel - 1) * wb * 2)
    elif isinstance(a, MLAAttentionSpec):
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = (a.q_lora_rank * N + a.q_lora_rank + a.num_heads * qk * a.q_lora_rank) if a.q_lora_rank else a.num_heads * qk * N
        out["attn_weights"] = (q + a.latent_width * N + a.kv_lora_rank
                               + a.num_heads * (a.qk_nope_head_dim + a.v_head_dim) * a.kv_lora_rank
                               + N * a.num_heads * a.v_head_dim
                               + (a.num_heads * a.v_head_dim * N if a.output_gate == "sigmoid" else 0)) * wb / tp
        if a.indexer is not None:  # DSA: the selected latents, plus the indexer's weights and keys where it runs
            from latency_specialized.bench.stock.dsa_moe import sparse_attention_bytes

            out.update(sparse_attention_bytes(full, layer, tp, batch, context, weight_bytes=wb))
        else:
            out["kv_cache"] = batch * ((context or 0) + 1) * a.latent_width * wb
    elif isinstance(a, SparseMQAAttentionSpec):  # DeepSeek-V4.1: window + selected compressed rows, indexer, mHC
        from latency_specialized.bench.stock.sparse_mqa_moe import sparse_mqa_bytes

        out.update(sparse_mqa_bytes(full, layer, tp, batch, context, weight_bytes=wb))
    elif isinstance(a, GQAAttentionSpec):
        q, kv, D = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.head_dim
        gate = q if a.output_gate == "sigmoid" else 0
        out["attn_weights"] = ((q + 2 * kv + gate) * N + N * q) * wb / tp
        kv_rank = (a.shard(tp) if tp > 1 else a).num_kv_heads  # KV heads replicate past TP = num_kv_heads
        out["kv_cache"] = batch * gqa_tokens_read(a, context) * kv_rank * D * 2 * 2
        out["kv_write"] = batch * kv_rank * D * 2 * 2
    if isinstance(f, MoESpec):
        L = f.latent_dim or N
        out["router"] = f.num_experts * N * rb / tp + f.num_experts * 4 / tp  # weight (fp32 logits), fp32 bias
        if f.latent_dim:
            out["latent_proj"] = (2 * L * N + L) * wb / tp
        per_expert = 3 * f.expert_intermediate * L * wb
        out["routed_experts"] = (distinct_experts or 0.0) * per_expert / tp
        out["shared_experts"] = 3 * f.num_shared_experts * f.expert_intermediate * N * wb / tp
    out["total"] = sum(out.values())
    return out


def gqa_tokens_read(a: GQAAttentionSpec, context: int | None) -> int:
    """KV positions one decode step of a GQA layer reads per sequence: the ``context`` cached tokens and
    the new one, the last ``sliding_window`` of them for a windowed layer."""
    n = (context or 0) + 1
    return min(n, a.sliding_window) if a.sliding_window else n


def add_stock_roofline(cell: dict[str, Any], full: ModelSpec, tp: int, **bytes_kw: Any) -> dict[str, Any]:
    """Stock's own roofline (the experts *its* routing touched) and the per-byte speed-up (``bytes_kw``: the
    kind's ``layer_bytes`` keywords, e.g. ``router_weight_bytes``).

    The two variants route with different random router weights, so at large batches they touch
    different numbers of distinct experts (the dominant bytes). ``stock_fraction`` is stock's time
    against its own floor; ``speedup_per_byte = fraction / stock_fraction`` compares the two at equal
    bytes (= the speed-up had both touched the same experts), next to the raw ``speedup``.
    """
    r, s = cell["roofline"], cell.get("stock") or {}
    d_stock = r.get("distinct_experts_stock")
    rb = layer_bytes(full, cell["layer_index"], tp, cell["batch"], cell.get("context"),
                     d_stock if d_stock is not None else r.get("distinct_experts"), **bytes_kw)
    us = rb["total"] / HBM_BYTES_PER_S * 1e6
    cell["roofline_stock"] = {"bytes": rb["total"], "us": us, "distinct_experts": d_stock}
    cell["stock_fraction"] = (us / s["us"]) if s.get("us") else None
    f, sf = cell.get("fraction"), cell["stock_fraction"]
    cell["speedup_per_byte"] = (f / sf) if (f and sf) else None
    return cell


# ------------------------------------------------------------------------------------------ timing
def _time(fn: Callable[[], None], iters: int, warmup: int) -> float:
    """Median microseconds of ``fn`` over ``iters`` CUDA-event-timed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


@dataclass
class Measured:
    """One variant's figures in one cell."""

    name: str
    layers: int
    graph: bool = True
    nodes: dict[str, int] | None = None
    sites: dict[str, int] | None = None
    """Kernel nodes per op site (runtime.census), where the variant counts them."""
    rounds: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def us(self) -> float | None:
        return statistics.fmean(self.rounds) if self.rounds else None

    @property
    def noise(self) -> float | None:
        return (max(self.rounds) - min(self.rounds)) / min(self.rounds) if len(self.rounds) > 1 else None

    @property
    def kernels(self) -> int | None:
        return None if self.nodes is None else self.nodes.get("kernel", 0)


def measure(variants: Sequence[Variant], cfg: BenchConfig, say: Callable[[str], None]) -> list[Measured]:
    """Capture every variant, then time ``cfg.rounds`` alternating rounds of replays."""
    out = []
    for v in variants:
        m = Measured(v.name, v.layers)
        try:
            m.nodes = v.capture()
            site_kernels = getattr(v, "site_kernels", None)
            m.sites = site_kernels() if site_kernels is not None else None
        except Exception as e:  # noqa: BLE001 - e.g. a reference op that syncs: report it, time eagerly
            m.graph, m.error = False, f"not capturable: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            say(f"    {v.name}: {m.error}; timing it eagerly")
            torch.cuda.synchronize()
        out.append(m)
    failed: set[int] = set()
    for _ in range(cfg.rounds):
        for i, (v, m) in enumerate(zip(variants, out)):
            if i in failed:  # a variant that cannot run is reported as such; the others still run
                continue
            try:
                m.rounds.append(_time(v.replay if m.graph else v.eager, cfg.iters if m.graph else 5,
                                      cfg.warmup if m.graph else 1))
            except Exception as e:  # noqa: BLE001
                m.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                m.rounds = []
                failed.add(i)
                say(f"    {v.name}: {m.error}")
                torch.cuda.synchronize()
    return out


def _distinct(ids: list[torch.Tensor], batch: int) -> float | None:
    if not ids:
        return None
    return statistics.fmean(float(torch.unique(t[:batch].flatten()).numel()) for t in ids)


def per_layer(m: Measured, base: Measured | None, *, no_comm_sites: bool = False) -> dict[str, Any]:
    """Per-layer figures of a measured variant (minus its 1-layer baseline, when it has one);
    ``no_comm_sites``: the variant has no communication kernels (see :func:`add_kernel_split`)."""
    rec: dict[str, Any] = {"graph": m.graph, "error": m.error, "layers": m.layers}
    if m.us is None:
        rec.update(us=None, kernels=None, noise=None)
        return rec
    if base is not None:
        if base.us is None:
            rec.update(us=None, kernels=None, noise=None, error=base.error or "baseline not measured")
            return rec
        n = m.layers - base.layers
        rec["us"] = (m.us - base.us) / n
        rec["kernels"] = (m.kernels - base.kernels) / n if (m.kernels is not None and base.kernels is not None) else None
        if m.sites is not None and base.sites is not None:
            rec["site_kernels"] = {k: (m.sites.get(k, 0) - base.sites.get(k, 0)) / n
                                   for k in sorted(set(m.sites) | set(base.sites))}
        rec["step_us"], rec["baseline_step_us"] = m.us, base.us
        spread = [((a - b) / n) for a, b in zip(m.rounds, base.rounds)]
        rec["rounds"] = spread
        rec["noise"] = (max(spread) - min(spread)) / min(spread) if len(spread) > 1 and min(spread) > 0 else None
    else:
        rec["us"] = m.us / m.layers
        rec["kernels"] = m.kernels / m.layers if m.kernels is not None else None
        if m.sites is not None:
            rec["site_kernels"] = {k: v / m.layers for k, v in sorted(m.sites.items())}
        rec["rounds"] = [r / m.layers for r in m.rounds]
        rec["noise"] = m.noise
    rec["nodes"] = m.nodes
    add_kernel_split(rec, no_comm_sites=no_comm_sites)
    return rec


def add_kernel_split(rec: dict[str, Any], *, no_comm_sites: bool = False) -> dict[str, Any]:
    """Per-layer kernels split into communication sites and the rest (``rec['site_kernels']``).

    ``comm_kernels``: kernels of the all-reduce and all-gather sites (runtime.census);
    ``kernels_no_comm`` = ``kernels`` - ``comm_kernels`` (kernels outside any site, e.g. copies
    between ops, stay in it). Without a census (stock composition: it has no communication on one
    GPU) ``comm_kernels`` is 0 when ``no_comm_sites`` is set, else unknown."""
    sites = rec.get("site_kernels")
    if rec.get("kernels") is None:
        return rec
    if sites is not None:
        comm, _ = split_communication(sites)
        rec["comm_kernels"] = comm
        rec["kernels_no_comm"] = rec["kernels"] - comm
        rec["unattributed_kernels"] = rec["kernels"] - sum(sites.values())
    elif no_comm_sites:
        rec["comm_kernels"], rec["kernels_no_comm"] = 0, rec["kernels"]
    return rec


# ------------------------------------------------------------------------------------------ the sweep
def _layer_index(full: ModelSpec, kind: str) -> int:
    """The first layer of attention kind ``kind`` with a MoE (scripts' helper; the bench itself takes the layer
    from the adapter's ``bench_kinds()``)."""
    for layer in full.layers:
        if layer.attention.kind == kind and isinstance(layer.ffn, MoESpec):
            return layer.index
    raise UserError(f"{full.name} has no {kind}+moe layer: use --kinds with one of its layer kinds")


def bench_kinds(adapter: Any, kinds: Sequence[str]) -> dict[str, Any]:
    """The adapter's ``BenchKind`` of each of ``kinds`` (in that order); a UserError naming the model's kinds
    for any it does not have."""
    hook = getattr(adapter, "bench_kinds", None)  # ModelAdapter's; a bare AdapterContract has none
    known = hook() if hook is not None else {}
    bad = [k for k in kinds if k not in known]
    if bad:
        have = ", ".join(known) if known else "none"
        raise UserError(f"layer kind(s) {bad} not benchable for {adapter.name}: use --kinds with {have}")
    return {k: known[k] for k in kinds}


def _bytes_kw(bk: Any) -> dict[str, Any]:
    """``layer_bytes`` keywords a bench kind sets (only where they differ from the defaults)."""
    return {} if bk.router_weight_bytes == 2 else {"router_weight_bytes": bk.router_weight_bytes}


def kind_summary(full: ModelSpec, tp: int, name: str, bk: Any) -> dict[str, Any]:
    """What one kind's cells measure (the result's ``kinds`` entry): its layer, context axis, stock
    composition, and for a KV cache the bytes one cached token costs on this rank (and a window)."""
    from latency_specialized.bench.stock.compositions import composition

    layer = full.layers[bk.layer]
    a = layer.attention
    rec: dict[str, Any] = {"layer_index": bk.layer, "layer_kind": layer.kind, "context_axis": bk.context,
                           "stock": bk.stock, "stock_description": composition(bk.stock).description}
    if bk.context:
        rec["kv_block_size"] = bk.kv_block_size
    if isinstance(a, GQAAttentionSpec):
        local = a.shard(tp) if tp > 1 else a
        rec.update(window=a.sliding_window, rope_theta=a.rope_theta, kv_heads_rank=local.num_kv_heads,
                   kv_bytes_per_token=local.num_kv_heads * a.head_dim * 2 * 2)
    elif isinstance(a, MLAAttentionSpec):
        rec.update(window=None, kv_bytes_per_token=a.latent_width * 2)
    elif isinstance(a, SparseMQAAttentionSpec):
        rec.update(window=a.sliding_window, compress_ratio=a.compress_ratio, kv_bytes_per_token=a.head_dim * 2)
    if bk.router_weight_bytes != 2:
        rec["router_weight_bytes"] = bk.router_weight_bytes
    return rec


def _weights_note(full: ModelSpec) -> str:
    fmt = getattr(full, "routed_expert_format", None)
    stored = f" (the published checkpoint stores {fmt.upper()})" if fmt and fmt not in ("bf16", "bfloat16") else ""
    return f"Routed experts are bf16 in both variants{stored}; the roofline counts bf16."


def _state_phrase(full: ModelSpec, kinds: dict[str, Any]) -> str:
    """What the roofline counts besides weights, per attention kind benched."""
    phrases = []
    for bk in kinds.values():
        a = full.layers[bk.layer].attention
        p = None
        if isinstance(a, KDAAttentionSpec):
            p = "KDA state read + written"
        elif isinstance(a, SparseMQAAttentionSpec):
            p = ("the sparse MQA rows read (min(context + 1, window) window rows + min(compressed rows, top-k) selected "
                 "ones), the indexer keys where the layer runs its indexer, mHC seams (sparse_mqa_bytes)")
        elif isinstance(a, GQAAttentionSpec):
            p = ("the KV cache read (min(context + 1, window) tokens per sequence for a windowed layer, context + 1 "
                 "for full attention) + the new token's k/v written")
        if p and p not in phrases:
            phrases.append(p)
    return "".join(f", {p}" for p in phrases)


def bench_notes(full: ModelSpec, kinds: dict[str, Any], tp: int) -> list[str]:
    """The result's notes before "ours" adds its own: the method, then per benched kind the adapter's notes
    (``BenchKind.notes``), the roofline's terms, and what each stock composition ran (stand-ins, shared kernels)."""
    from latency_specialized.bench.stock.compositions import composition

    notes = [
        "One GPU, rank 0 of the TP shard: communication (all-reduces) is excluded from both variants.",
        _weights_note(full),
    ]
    for bk in kinds.values():
        notes.extend(bk.notes)
    notes.append(
        "Roofline bytes: weights once per TP group split evenly (router and latent projections / TP even where a "
        f"variant replicates them), distinct routed experts of the measured step{_state_phrase(full, kinds)}. "
        "Each variant's % roofline counts the experts its own routing touched (the two route with different random "
        "router weights); 'speed-up per byte' = ours % / stock % (the speed-up at equal bytes).")
    for name, bk in kinds.items():
        for n in composition(bk.stock).notes(full, name, bk, tp):
            if n not in notes:
                notes.append(n)
    return notes


def run_bench(cfg: BenchConfig, say: Callable[[str], None] = print,
              checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the sweep of ``cfg`` on the current GPU and return the result dict (see report.py).

    The kinds are the adapter's (``adapter.bench_kinds()``: per name, the layer it stands for, whether
    its cells have a context axis, its stock composition). ``checkpoint(partial_result)`` is called after
    every cell (a time-limited run keeps what it measured).
    """
    if not torch.cuda.is_available():
        raise UserError("the bench needs a CUDA GPU and torch sees none: run it where one is visible")
    if cfg.layers < 2:
        raise UserError("--layers must be >= 2 (ours per layer = (t_K - t_1) / (K - 1))")
    from latency_specialized.bench.machine import machine_info
    from latency_specialized.bench.stock.compositions import composition
    from latency_specialized.plugins import get_registry

    reg = get_registry()
    adapter = reg.adapter(cfg.model)
    kinds = bench_kinds(adapter, cfg.kinds)
    full = adapter.spec("full")
    full.shard(cfg.tp)  # UserError naming the fix for an unsupported TP
    harness = adapter.layer_bench()  # the adapter's hook (UserError when it has no graphed bench program)
    device = torch.device("cuda")
    t_start = time.perf_counter()
    machine = machine_info()
    summary = {name: kind_summary(full, cfg.tp, name, bk) for name, bk in kinds.items()}

    def result() -> dict[str, Any]:
        return {"schema": 1, "machine": machine,
                "config": {"model": cfg.model, "tp": cfg.tp, "batches": list(cfg.batches),
                           "contexts": list(cfg.contexts), "kinds": list(cfg.kinds), "layers": cfg.layers,
                           "iters": cfg.iters, "rounds": cfg.rounds, "dtype": cfg.dtype,
                           "hbm_tb_s": HBM_BYTES_PER_S / 1e12, "comm": "Communication excluded (one GPU).",
                           "seconds": round(time.perf_counter() - t_start, 1)},
                "kinds": summary, "notes": notes, "cells": cells}

    cells: list[dict[str, Any]] = []
    notes = bench_notes(full, kinds, cfg.tp)
    for kind, bk in kinds.items():
        stock = composition(bk.stock)
        contexts: tuple[int | None, ...] = tuple(cfg.contexts) if bk.context else (None,)
        say(f"[{kind}] building ours: {cfg.layers} + 1 layers of real TP{cfg.tp} rank shapes ...")
        t0 = time.perf_counter()
        ours = harness.build_ours(full, cfg.tp, kind, cfg.layers, cfg.batches, device, seed=cfg.seed, say=say,
                                  contexts=cfg.contexts if bk.context else (), steps=steps_per_cell(cfg))
        say(f"[{kind}] ours ready in {time.perf_counter() - t0:.0f} s: {ours.description}")
        notes.extend(ours.notes)
        for context in contexts:
            for batch in cfg.batches:
                cells.append(_cell(cfg, full, bk, kind, batch, context, ours, say, stock.build))
                if checkpoint is not None:
                    checkpoint(result())
        ours.close()
        del ours
        torch.cuda.empty_cache()
    return result()


def steps_per_cell(cfg: BenchConfig) -> int:
    """Decode steps one cell runs after loading its positions: every timed or warm-up replay and eager
    step (a variant that could not be captured runs 6 per round), the routing step, and a margin."""
    return cfg.rounds * (max(cfg.warmup + cfg.iters, 6)) + 1 + 8


def _cell(cfg: BenchConfig, full: ModelSpec, bk: Any, kind: str, batch: int, context: int | None, ours: Any,
          say: Callable[[str], None], build_stock: Callable[..., Any]) -> dict[str, Any]:
    """Measure one (kind, batch, context) cell: ours K and 1 layers, stock K layers, roofline."""
    t1 = time.perf_counter()
    device = torch.device("cuda")
    li = bk.layer
    torch.manual_seed(cfg.seed + batch)
    stock_layers = build_stock(full, bk, cfg.tp, batch, context, cfg.layers, device,
                               experts=ours.expert_weights(cfg.layers))
    stock = GraphedStep("stock", cfg.layers, stock_layers.step, stock_layers.routed_ids)
    ours_k, ours_1 = ours.variants(batch, context)
    m_k, m_1, m_s = measure([ours_k, ours_1, stock], cfg, say)
    o = per_layer(m_k, m_1)
    s = per_layer(m_s, None, no_comm_sites=True)  # stock: no communication on one GPU
    ids = ours_k.routing() if o["us"] is not None else []
    d_ours = _distinct(ids, batch)
    d_stock = _distinct(stock_layers.routed_ids(), batch)
    distinct = d_ours if d_ours is not None else d_stock
    kw = _bytes_kw(bk)
    rb = layer_bytes(full, li, cfg.tp, batch, context, distinct, **kw)
    r_us = rb["total"] / HBM_BYTES_PER_S * 1e6
    cell = {"kind": kind, "batch": batch, "context": context, "layer_index": li, "ours": o, "stock": s,
            "roofline": {"bytes": rb["total"], "us": r_us, "breakdown": rb, "distinct_experts": distinct,
                         "distinct_experts_stock": d_stock},
            "fraction": (r_us / o["us"]) if o.get("us") else None,
            "speedup": (s["us"] / o["us"]) if (o.get("us") and s.get("us")) else None}
    a = full.layers[li].attention
    if isinstance(a, GQAAttentionSpec):
        cell["roofline"]["kv_tokens_read"] = gqa_tokens_read(a, context)
    add_stock_roofline(cell, full, cfg.tp, **kw)
    where = f"batch {batch:>2}" + (f", context {context}" if context is not None else "")
    say(f"[{kind}] {where}: ours {_fmt(o.get('us'))} us/layer ({_fmt(o.get('kernels'), '{:.1f}')} "
        f"kernels, {_fmt(o.get('kernels_no_comm'), '{:.1f}')} without communication) | stock {_fmt(s.get('us'))} us ({_fmt(s.get('kernels'), '{:.1f}')} kernels) | roofline "
        f"{r_us:.1f} us ({distinct or 0:.0f} experts) | {_fmt(cell['fraction'] and 100 * cell['fraction'], '{:.0f}%')} "
        f"| speed-up {_fmt(cell['speedup'], '{:.2f}x')} [{time.perf_counter() - t1:.0f} s]")
    del stock_layers, stock
    torch.cuda.empty_cache()
    return cell


def _fmt(x: Any, fmt: str = "{:.1f}") -> str:
    return "-" if x is None or x is False else fmt.format(x)
