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

**Verification steps** (``BenchConfig.spec_tokens``, ``bench --spec-tokens 3,7``): for every k > 0 each cell
is timed again with the program built for k draft tokens as the runtime builds it (:func:`build_spec_ours`:
``rows = batch x (1 + k)``; each step accepts the previous step's drafts, then verifies), stock on the same
rows (:func:`spec_notes` says how), and :func:`add_verify_ratios` divides by the k = 0 cell of the same run
(``cell['verify']['ratio']``: verification / single step) and splits what the extra rows cost.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from latency_specialized.errors import UserError
from latency_specialized.hardware import roofline_bandwidth
from latency_specialized.runtime.census import split_communication
from latency_specialized.runtime.graph_runner import graph_node_counts, new_graph
from latency_specialized.spec import (GQAAttentionSpec, KDAAttentionSpec, MLAAttentionSpec, ModelSpec, MoESpec,
                                      SparseMQAAttentionSpec)


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
    routing: str = "random"
    """How ours' MoE layers route (``runtime.layer_harness.ROUTINGS``): ``shared`` zeroes ours' router weights,
    so every row reads the same experts, ``scaled:X`` scales them by X (rows share part of their experts); stock
    still routes on random weights (its columns are then no comparison)."""
    experts: str | None = None
    """Stored format the routed experts are kept in on both sides (``mxfp4``: ours' 4-bit kernels, stock's
    humming MoE; the roofline counts the format's bytes); None: bf16."""
    spec_tokens: tuple[int, ...] = (0,)
    """Draft tokens per request of the steps timed: 0 = single-token decode steps; k > 0 = verification steps
    (speculative decoding) of ``batch x (1 + k)`` rows, timed beside the k = 0 step of the same batch, which
    the bench then always runs too (``verification / single step`` is a ratio of one run)."""

    def spec_ks(self) -> tuple[int, ...]:
        """The k values timed, ascending: 0 first (the single-step baseline of every verification cell)."""
        return tuple(sorted(set(self.spec_tokens) | {0}))


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
                router_weight_bytes: float | None = None, expert_format: str | None = None) -> dict[str, float]:
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
    (latent) norm [L]; routed experts ``3 * I * L`` each (gate/up [2I, L], down [L, I]), in ``expert_format``'s
    stored bits per value (codes + scales, e.g. MXFP4 4.25) where they are kept quantized.
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
        if expert_format:
            from latency_specialized.quant.formats import QuantFormat

            per_expert = 3 * f.expert_intermediate * L * QuantFormat.get(expert_format).bits_per_value() / 8
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
    us = rb["total"] / roofline_bandwidth() * 1e6
    cell["roofline_stock"] = {"bytes": rb["total"], "us": us, "distinct_experts": d_stock}
    cell["stock_fraction"] = (us / s["us"]) if s.get("us") else None
    f, sf = cell.get("fraction"), cell["stock_fraction"]
    cell["speedup_per_byte"] = (f / sf) if (f and sf) else None
    return cell


# ------------------------------------------------------------------------------------------ timing
def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn: Callable[[], None], iters: int, warmup: int) -> float:
    """Median microseconds of ``fn`` over ``iters`` CUDA-event-timed calls (host-timed calls where torch sees
    no GPU: the CPU smoke test of the bench's wiring, whose figures mean nothing)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)
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
            _sync()
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
                _sync()
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


# ------------------------------------------------------------------------------------------ verification steps
TARGET_VERIFY_RATIO = 1.3
"""Issue 25: a k = 7 verification step at batch 1 costs <= 1.3x a single-token step of the same model."""


def _spec_variant_class():
    """ProgramVariant of a verification program (imported lazily: the runtime harness needs torch.cuda only
    when it runs)."""
    from latency_specialized.runtime.layer_harness import ProgramVariant

    class SpecProgramVariant(ProgramVariant):
        """A verification-step Variant: ``batch`` requests of ``1 + k`` rows each (request-major). Every load
        writes random drafts and a pending accept of all ``k`` drafts per request (the most rank-1 updates the
        accept replays from the previous step's tape: the steady state of a fully accepted stream)."""

        def __init__(self, name, built, batch, bucket, all_buckets, context=None, *, spec_tokens: int):
            self.k = spec_tokens  # before ProgramVariant.__init__: it loads
            super().__init__(name, built, batch, bucket, all_buckets, context)

        def _load(self) -> None:
            super()._load()
            b, k = self.batch, self.k
            g = torch.Generator().manual_seed(2000 + b * 8 + k)
            drafts = torch.randint(0, self.b.spec.vocab_size, (b, k), generator=g)
            bufs = self.b.buffers
            bufs.set_drafts(drafts.to(bufs.device))
            bufs.set_accepted([k] * b)

        @property
        def rows(self) -> int:
            return self.batch * (1 + self.k)

        def routing(self) -> list[torch.Tensor]:
            """Expert ids of every MoE layer of one eager verification step: all ``batch x (1 + k)`` rows."""
            return [t[: self.rows] for t in self.b.routing.record(lambda: self.b.runner.body(self.bucket))]

    return SpecProgramVariant


def build_spec_ours(adapter: Any, full: ModelSpec, tp: int, kind: str, layers: int, batches: Sequence[int],
                    device: torch.device, spec_tokens: int, *, seed: int = 0, say: Callable[[str], None] = print,
                    contexts: Sequence[int] = (), steps: int = 256, routing: str = "random",
                    experts: str | None = None) -> Any:
    """"Ours" for verification steps of ``spec_tokens`` = k draft tokens: the K-layer and 1-layer programs of
    ``runtime/layer_harness.OursBench`` built the way the runtime builds a verification program - the adapter's
    bench spec ``with_spec_tokens(k)`` (Kimi K3: the KDA pieces get their verify/accept sites and rollback
    tapes), plans ``build_plan(spec_tokens=k)`` (``tokens = bucket x (1 + k)``), ``BufferSpec(spec_tokens=k)``,
    a gate for ``spec_tokens=(k,)`` and a graph runner that does not feed next tokens back (a verification
    step's outputs are ``[batch, 1 + k]``; the host writes positions, drafts and accepts) - then captured and
    timed like the plain programs. Same weights (same seeds) as the k = 0 programs.

    UserError naming what is missing when the adapter cannot build one (no ``with_spec_tokens`` on its bench
    spec, or a piece that cannot verify: ``runtime.composed.verification_problems``)."""
    from latency_specialized import hardware
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
    from latency_specialized.runtime.composed import ComposedProgram, verification_problems
    from latency_specialized.runtime.gate import DecodeGate
    from latency_specialized.runtime.graph_runner import CUDAGraphRunner
    from latency_specialized.runtime.harness import OutputRecorder, SpecBoundAdapter, exclude_communication
    from latency_specialized.runtime.layer_harness import (BuiltProgram, OursBench, bench_communicator, bench_kind,
                                                         check_routing, routing_scale, share_routing, with_experts)
    from latency_specialized.runtime.random_weights import quantize_routed_experts, random_rank_weights
    from latency_specialized.runtime.states import ModelStates
    from latency_specialized.trace import Trace

    if spec_tokens < 1:
        raise UserError(f"build_spec_ours: {spec_tokens} draft tokens; k = 0 is the plain program (build_ours)")
    check_routing(routing)
    bk = bench_kind(adapter, kind, contexts)
    k = spec_tokens
    # the last draft of the last replay sits k positions past the plain step's: the cache holds k more tokens
    max_len, block = (max(contexts) + 1 + steps + k, bk.kv_block_size) if bk.context else (4096, 16)
    reg = get_registry()
    hw = hardware.probe()
    Variant_ = _spec_variant_class()

    class SpecOursBench(OursBench):
        def __init__(self) -> None:  # OursBench.__init__ builds k = 0 programs; this mirrors it for k
            self.kind, self.batches, self.spec_tokens = kind, tuple(batches), k
            self.notes: list[str] = []
            self.built: dict[int, BuiltProgram] = {}
            self.served_by_reference: list[str] = []
            self.experts = experts
            for n_layers in (layers, 1):
                base = with_experts(adapter.bench_spec(full, tp, kind, n_layers), experts)
                with_k = getattr(base, "with_spec_tokens", None)
                if not callable(with_k):
                    raise UserError(f"{adapter.name}: its bench spec ({type(base).__name__}) has no "
                                    f"with_spec_tokens(k), so the bench cannot build the verification program for "
                                    f"k = {k} (the runtime builds one from spec.with_spec_tokens(k))")
                spec = with_k(k)
                model = adapter.composed_model(spec)
                problems = verification_problems(model, k, tp)
                if problems:
                    raise UserError(f"{adapter.name} {kind}: the runtime cannot build a verification program for "
                                    f"k = {k}: " + "; ".join(problems))
                comm = bench_communicator(tp, routing)
                plans = {}
                for b in self.batches:
                    plan = build_plan(SpecBoundAdapter(adapter, spec), reg.implementations, hw, tp=tp, batch=b,
                                      dtype="bfloat16", comm=comm, spec_tokens=k)
                    plans[plan.bucket] = plan
                weights = random_rank_weights(model, tp, device=device, seed=seed + n_layers)
                if experts:
                    quantize_routed_experts(weights, experts)
                if routing != "random":
                    share_routing(weights, routing_scale(routing))
                states = ModelStates.allocate(model, max(self.batches), max_len, tp=tp, block_size=block,
                                              device=device, shuffle_seed=seed if bk.context else None)
                for t in states.tensors():  # a live state (and tape), not zeros
                    t.normal_(0.0, 0.05)
                trace = Trace()
                program = ComposedProgram(model, weights, plans, states, comm=comm, trace=trace, weights_sharded=True)
                del weights
                excluded = exclude_communication(program) if tp > 1 else 0
                buffers = DecodeBuffers(BufferSpec(max_batch=program.max_batch,
                                                   max_blocks_per_seq=len(states.slots[0].blocks), block_size=block,
                                                   pad_state=0, spec_tokens=k), device=device)
                gate = DecodeGate(max_batch=program.max_batch, buckets=tuple(sorted(plans)), spec_tokens=(k,))
                runner = CUDAGraphRunner(program, buffers, gate=gate, trace=trace, feed_back_tokens=False,
                                         preserve_state=False)
                built = BuiltProgram(spec, program, buffers, runner,
                                     OutputRecorder(program, "/moe.router", lambda o: o[1]))
                built.census.instrument(program)
                self.built[n_layers] = built
                if n_layers == layers:
                    self._notes(plans, tp, excluded, program, kind)
                    self.notes = [f"[k={k}] {n}" for n in self.notes]
                    self.served_by_reference = reference_sites(plans)
                    if self.served_by_reference:
                        self.notes.append(
                            f"[k={k}] ours {kind}: sites served by their torch reference (no GPU kernel registered "
                            f"for them yet), timed as they run: {', '.join(self.served_by_reference)}.")
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    say(f"  built {n_layers}-layer verification program, k = {k} "
                        f"({torch.cuda.memory_allocated() / 2**30:.1f} GiB on the GPU)")
            self.layers = layers
            self.description = (f"ComposedProgram x {layers} (+1) {kind}+moe layers, verification steps of k = {k} "
                                f"draft tokens (rows = batch x {1 + k}), TP{tp} rank shapes, "
                                f"buckets {sorted(self.built[layers].program.plans)}")

        def variants(self, batch: int, context: int | None = None) -> tuple[Any, Any]:
            out = []
            for n in (self.layers, 1):
                built = self.built[n]
                bucket = next(b for b in sorted(built.program.plans) if b >= batch)
                out.append(Variant_(f"ours[{n}] k={k}", built, batch, bucket, sorted(built.program.plans), context,
                                    spec_tokens=k))
            return out[0], out[1]

    return SpecOursBench()


def reference_sites(plans: dict[int, Any]) -> list[str]:
    """Called sites of ``plans`` whose implementation is a family's torch reference (``*.reference``), as
    'site=impl' (site names without their kind prefix), sorted."""
    out = set()
    for p in plans.values():
        choices = p.called_choices() if hasattr(p, "called_choices") else p.choices
        for c in choices:
            if c.impl is not None and c.impl.name.endswith(".reference"):
                out.add(f"{c.site.name.split('/')[-1]}={c.impl.name}")
    return sorted(out)


def verify_bytes(full: ModelSpec, layer: int, tp: int, batch: int, spec_tokens: int) -> dict[str, float]:
    """Bytes a verification step moves beyond :func:`layer_bytes` at ``batch`` requests: a KDA layer's rollback
    tape (``ops.attention.kda_verify.tape_shapes``: per request and token k | exp(g) | v' fp32 per head and the
    conv input), written by the verify op and read back by the next step's accept. Empty for other layers and
    k = 0 (weights, states and KV cache count once per request whatever k: ``layer_bytes`` at ``batch``)."""
    a = full.layers[layer].attention
    if spec_tokens <= 0 or not isinstance(a, KDAAttentionSpec):
        return {}
    h_rank, D = a.num_heads // tp, a.head_dim
    per_token = h_rank * 3 * D * 4 + 3 * h_rank * D * 2
    return {"kda_tape": batch * (1 + spec_tokens) * per_token * 2}


def add_verify_ratios(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give every verification cell (``spec_tokens`` k > 0) its ``verify`` record against the k = 0 cell of the
    same kind, batch and context of the same run: ``ratio`` = ours us/layer at k / ours us/layer at k = 0 (the
    'verification / single step' of issue 25), the same for stock, and what the extra ``batch x k`` rows cost:
    ``extra_us`` (and per extra row), the extra distinct experts and the part of the extra time the roofline
    gives to their bytes (``extra_expert_us``), extra kernels. ``None`` fields where a side was not measured."""
    base = {(c["kind"], c["batch"], c.get("context")): c for c in cells if not c.get("spec_tokens")}
    for c in cells:
        k = c.get("spec_tokens") or 0
        if not k:
            continue
        b = base.get((c["kind"], c["batch"], c.get("context")))
        o, s = c.get("ours") or {}, c.get("stock") or {}
        rec: dict[str, Any] = {"k": k, "rows": c.get("rows"), "single_rows": c["batch"],
                               "target_ratio": TARGET_VERIFY_RATIO}
        if b is None:
            rec["error"] = "no k = 0 cell of this kind, batch and context in the run"
            c["verify"] = rec
            continue
        bo, bs = b.get("ours") or {}, b.get("stock") or {}
        t, t0 = o.get("us"), bo.get("us")
        extra_rows = (c.get("rows") or c["batch"] * (1 + k)) - c["batch"]
        rec.update(single_us=t0, us=t,
                   ratio=(t / t0) if (t and t0) else None,
                   extra_us=(t - t0) if (t is not None and t0 is not None) else None,
                   stock_single_us=bs.get("us"), stock_us=s.get("us"),
                   stock_ratio=(s["us"] / bs["us"]) if (s.get("us") and bs.get("us")) else None,
                   kernels=o.get("kernels"), single_kernels=bo.get("kernels"),
                   extra_kernels=(o["kernels"] - bo["kernels"]) if (o.get("kernels") is not None
                                                                   and bo.get("kernels") is not None) else None)
        rec["extra_us_per_row"] = rec["extra_us"] / extra_rows if (rec["extra_us"] is not None and extra_rows) else None
        r, r0 = c.get("roofline") or {}, b.get("roofline") or {}
        d, d0 = r.get("distinct_experts"), r0.get("distinct_experts")
        rec.update(distinct_experts=d, single_distinct_experts=d0,
                   extra_experts=(d - d0) if (d is not None and d0 is not None) else None,
                   roofline_us=r.get("us"), single_roofline_us=r0.get("us"),
                   roofline_ratio=(r["us"] / r0["us"]) if (r.get("us") and r0.get("us")) else None)
        br, br0 = r.get("breakdown") or {}, r0.get("breakdown") or {}
        if "routed_experts" in br and "routed_experts" in br0:
            rec["extra_expert_us"] = (br["routed_experts"] - br0["routed_experts"]) / roofline_bandwidth() * 1e6
        noise = [x for x in (o.get("noise"), bo.get("noise")) if x is not None]
        rec["noise"] = max(noise) if noise else None
        rec["meets_target"] = (rec["ratio"] <= TARGET_VERIFY_RATIO) if rec["ratio"] is not None else None
        c["verify"] = rec
    return cells


def spec_notes(kinds: dict[str, Any], ks: Sequence[int], scope_ks: Sequence[int] | None) -> list[str]:
    """What the verification cells measure (method, stock's rows, out-of-scope k)."""
    ks = [k for k in ks if k > 0]
    if not ks:
        return []
    notes = [
        f"Verification steps (speculative decoding), k = {', '.join(map(str, ks))} draft tokens: ours runs the program "
        "built for k as the runtime builds it (spec.with_spec_tokens(k), build_plan(spec_tokens=k), BufferSpec("
        "spec_tokens=k); rows = batch x (1 + k), request-major; each step first accepts all k drafts of the previous "
        "step from the tape, then verifies 1 + k new rows), captured and timed like the single step; 'verification / "
        "single step' divides by the k = 0 cell of the same kind, batch and context measured in this run. Roofline of "
        "a verification cell: weights, states and KV cache once per request (not per row), the distinct experts of "
        "all its rows, plus KDA's rollback tape (written, read back by the accept).",
    ]
    for name, bk in kinds.items():
        if bk.stock == "kda_moe":
            notes.append(
                f"Stock {name} at k > 0: the stock KDA kernels (bench/stock/kda.py: causal_conv1d_update + "
                "fused_recurrent_kda, one token per sequence) have no multi-token path, so stock's verification "
                "cells time them on batch x (1 + k) rows as that many independent sequences (each row its own "
                "conv/recurrent state, read and written; projections, router and experts over all rows). That is "
                "the cost of stock's single-token kernels at those rows, not exactly vLLM's multi-token recurrent "
                "verify (which runs a request's tokens in order over one state); compare it as such.")
        elif bk.stock == "mla_moe":
            notes.append(
                f"Stock {name} at k > 0: batch x (1 + k) rows as that many decode sequences of 'context' cached "
                "tokens each through the same stock kernels (the per-token form of a verification step: each row "
                "reads its sequence's latent cache, so stock reads it 1 + k times per request where ours' paged "
                "rows share the request's blocks).")
        else:
            notes.append(f"Stock {name} at k > 0: batch x (1 + k) rows as independent decode sequences through "
                         "the same stock kernels.")
    if scope_ks is not None:
        out = [k for k in ks if k not in scope_ks]
        if out:
            notes.append(f"k = {', '.join(map(str, out))} is outside the adapter's scope (spec_tokens "
                         f"{list(scope_ks)}): the runtime's gate does not route such steps to the fast path; timed "
                         "for the curve only.")
    notes.append(f"Issue 25 target: a k = 7 verification step at batch 1 costs <= {TARGET_VERIFY_RATIO}x a "
                 "single-token step (column 'verification / single step').")
    return notes


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


def _bytes_kw(bk: Any, experts: str | None = None) -> dict[str, Any]:
    """``layer_bytes`` keywords a bench kind (and quantized experts) set, only where they differ from the defaults."""
    kw: dict[str, Any] = {} if bk.router_weight_bytes == 2 else {"router_weight_bytes": bk.router_weight_bytes}
    if experts:
        kw["expert_format"] = experts
    return kw


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


def _weights_note(full: ModelSpec, experts: str | None = None) -> str:
    if experts:
        from latency_specialized.quant.formats import QuantFormat

        bits = QuantFormat.get(experts).bits_per_value()
        return (f"Routed experts are {experts.upper()} in both variants (the same codes and scales: ours' 4-bit "
                f"kernels, stock's {experts.upper()} MoE); the roofline counts their stored {bits:g} bits a value, "
                "every other weight bf16.")
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


def routing_note(harness: Any, routing: str) -> list[str]:
    """The notes of ``routing`` (``runtime.layer_harness.ROUTINGS``); UserError for an unknown one or a
    harness whose ``build_ours`` takes no ``routing``."""
    import inspect

    from latency_specialized.runtime.layer_harness import check_routing

    check_routing(routing)
    if routing == "random":
        return []
    if "routing" not in inspect.signature(harness.build_ours).parameters:
        raise UserError(f"--routing {routing}: this adapter's layer-bench harness ({type(harness).__name__}) takes "
                        "no routing= keyword; bench it with --routing random")
    stock = ("Stock still routes on random weights: its columns and the speed-ups of this run are no comparison; "
             "read 'verification / single step' of ours.")
    if routing == "shared":
        return [f"Routing '{routing}': ours' router weights are zeroed, so every row of every step takes the experts "
                "its layer's selection bias ranks first - a verification step's draft rows read exactly the experts "
                "of their request's first row (the best case for speculative decoding: the weights read do not grow "
                "with the rows). " + stock]
    return [f"Routing '{routing}': ours' router weights are scaled by {routing.partition(':')[2]}, so the selection "
            "bias decides part of every row's choice and a step's rows share some of their experts (between "
            "'random' and 'shared'; column 'experts' says how many distinct experts each cell read). " + stock]


def bench_notes(full: ModelSpec, kinds: dict[str, Any], tp: int, experts: str | None = None) -> list[str]:
    """The result's notes before "ours" adds its own: the method, then per benched kind the adapter's notes
    (``BenchKind.notes``), the roofline's terms, and what each stock composition ran (stand-ins, shared kernels)."""
    from latency_specialized.bench.stock.compositions import composition

    notes = [
        "One GPU, rank 0 of the TP shard: communication (all-reduces) is excluded from both variants.",
        _weights_note(full, experts),
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
    ks = cfg.spec_ks() if any(cfg.spec_tokens) else (0,)
    if min(ks) < 0:
        raise UserError(f"--spec-tokens {list(cfg.spec_tokens)}: give draft-token counts >= 0")
    routing_notes = routing_note(harness, cfg.routing)
    t_start = time.perf_counter()
    machine = machine_info()
    summary = {name: kind_summary(full, cfg.tp, name, bk) for name, bk in kinds.items()}

    def result() -> dict[str, Any]:
        return {"schema": 1, "machine": machine,
                "config": {"model": cfg.model, "tp": cfg.tp, "batches": list(cfg.batches),
                           "contexts": list(cfg.contexts), "kinds": list(cfg.kinds), "layers": cfg.layers,
                           "spec_tokens": list(ks), "routing": cfg.routing, "experts": cfg.experts,
                           "iters": cfg.iters, "rounds": cfg.rounds, "dtype": cfg.dtype,
                           "hbm_tb_s": roofline_bandwidth() / 1e12, "comm": "Communication excluded (one GPU).",
                           "seconds": round(time.perf_counter() - t_start, 1)},
                "kinds": summary, "notes": notes, "cells": add_verify_ratios(cells)}

    cells: list[dict[str, Any]] = []
    notes = bench_notes(full, kinds, cfg.tp, cfg.experts)
    scope = getattr(adapter, "scope", None)
    notes.extend(spec_notes(kinds, ks, scope().spec_tokens if scope is not None else None))
    notes.extend(routing_notes)
    for kind, bk in kinds.items():
        stock = composition(bk.stock)
        if cfg.experts and cfg.experts not in stock.expert_formats:
            raise UserError(f"--experts {cfg.experts}: the stock composition of {kind} ({stock.name}) runs "
                            f"{', '.join(stock.expert_formats) or 'bf16'} experts only; bench {kind} without --experts")
        contexts: tuple[int | None, ...] = tuple(cfg.contexts) if bk.context else (None,)
        for k in ks:  # one program per k at a time (each holds its layers' weights), k = 0 first
            what = "" if not k else f" (verification steps, k = {k})"
            say(f"[{kind}] building ours{what}: {cfg.layers} + 1 layers of real TP{cfg.tp} rank shapes ...")
            t0 = time.perf_counter()
            kw = dict(seed=cfg.seed, say=say, contexts=cfg.contexts if bk.context else (), steps=steps_per_cell(cfg))
            if cfg.routing != "random":  # only then: a third-party harness need not know the keyword
                kw["routing"] = cfg.routing
            if cfg.experts:  # likewise
                kw["experts"] = cfg.experts
            if k:
                ours = build_spec_ours(adapter, full, cfg.tp, kind, cfg.layers, cfg.batches, device, k, **kw)
            else:
                ours = harness.build_ours(full, cfg.tp, kind, cfg.layers, cfg.batches, device, **kw)
            say(f"[{kind}] ours ready in {time.perf_counter() - t0:.0f} s: {ours.description}")
            notes.extend(ours.notes)
            for context in contexts:
                for batch in cfg.batches:
                    cells.append(_cell(cfg, full, bk, kind, batch, context, ours, say, stock.build, spec_tokens=k))
                    if checkpoint is not None:
                        checkpoint(result())
            ours.close()
            del ours
            # the program, its graph runner and trace refer to each other: only the cycle collector frees
            # them (session 24's batch-8 run kept every earlier k's program and ran out of memory)
            gc.collect()
            torch.cuda.empty_cache()
    return result()


def steps_per_cell(cfg: BenchConfig) -> int:
    """Decode steps one cell runs after loading its positions: every timed or warm-up replay and eager
    step (a variant that could not be captured runs 6 per round), the routing step, and a margin."""
    return cfg.rounds * (max(cfg.warmup + cfg.iters, 6)) + 1 + 8


def _cell(cfg: BenchConfig, full: ModelSpec, bk: Any, kind: str, batch: int, context: int | None, ours: Any,
          say: Callable[[str], None], build_stock: Callable[..., Any], *, spec_tokens: int = 0,
          device: torch.device | None = None) -> dict[str, Any]:
    """Measure one (kind, batch, context[, k]) cell: ours K and 1 layers, stock K layers, roofline.

    ``spec_tokens`` k > 0: ``ours`` is a verification "ours" (:func:`build_spec_ours`) and every side runs
    ``rows = batch x (1 + k)`` rows - stock as that many decode sequences (:func:`spec_notes`); the roofline
    counts weights, states and KV once per request, the distinct experts of all rows (+ KDA's tape)."""
    t1 = time.perf_counter()
    device = torch.device("cuda") if device is None else device
    li = bk.layer
    k = spec_tokens
    rows = batch * (1 + k)
    torch.manual_seed(cfg.seed + batch + 1000 * k)
    stock_layers = build_stock(full, bk, cfg.tp, rows, context, cfg.layers, device,
                               experts=ours.expert_weights(cfg.layers))
    stock = GraphedStep("stock" if not k else f"stock k={k}", cfg.layers, stock_layers.step, stock_layers.routed_ids)
    ours_k, ours_1 = ours.variants(batch, context)
    m_k, m_1, m_s = measure([ours_k, ours_1, stock], cfg, say)
    o = per_layer(m_k, m_1)
    s = per_layer(m_s, None, no_comm_sites=True)  # stock: no communication on one GPU
    ids = ours_k.routing() if o["us"] is not None else []
    d_ours = _distinct(ids, rows)
    d_stock = _distinct(stock_layers.routed_ids(), rows)
    distinct = d_ours if d_ours is not None else d_stock   # ours failed (no fraction of ours): stock's routing
    kw = _bytes_kw(bk, cfg.experts)
    rb = layer_bytes(full, li, cfg.tp, batch, context, distinct, **kw)
    extra = verify_bytes(full, li, cfg.tp, batch, k)
    if extra:
        rb = {**{n: v for n, v in rb.items() if n != "total"}, **extra}
        rb["total"] = sum(rb.values())
    r_us = rb["total"] / roofline_bandwidth() * 1e6
    cell = {"kind": kind, "batch": batch, "context": context, "spec_tokens": k, "rows": rows,
            "layer_index": li, "ours": o, "stock": s,
            "roofline": {"bytes": rb["total"], "us": r_us, "breakdown": rb, "distinct_experts": distinct,
                         "distinct_experts_stock": d_stock,
                         "experts_routed_by": "ours" if d_ours is not None else "stock"},
            "fraction": (r_us / o["us"]) if o.get("us") else None,
            "speedup": (s["us"] / o["us"]) if (o.get("us") and s.get("us")) else None}
    a = full.layers[li].attention
    if isinstance(a, GQAAttentionSpec):
        cell["roofline"]["kv_tokens_read"] = gqa_tokens_read(a, context)
    add_stock_roofline(cell, full, cfg.tp, **kw)
    if extra:  # stock's floor is the same task's: its tape-free layer_bytes + the tape ours must move
        rs = cell["roofline_stock"]
        rs["bytes"] += sum(extra.values())
        rs["us"] = rs["bytes"] / roofline_bandwidth() * 1e6
        cell["stock_fraction"] = (rs["us"] / s["us"]) if s.get("us") else None
        f, sf = cell.get("fraction"), cell["stock_fraction"]
        cell["speedup_per_byte"] = (f / sf) if (f and sf) else None
    where = f"batch {batch:>2}" + (f", context {context}" if context is not None else "") + \
        (f", k {k} ({rows} rows)" if k else "")
    say(f"[{kind}] {where}: ours {_fmt(o.get('us'))} us/layer ({_fmt(o.get('kernels'), '{:.1f}')} "
        f"kernels, {_fmt(o.get('kernels_no_comm'), '{:.1f}')} without communication) | stock {_fmt(s.get('us'))} us ({_fmt(s.get('kernels'), '{:.1f}')} kernels) | roofline "
        f"{r_us:.1f} us ({distinct or 0:.0f} experts) | {_fmt(cell['fraction'] and 100 * cell['fraction'], '{:.0f}%')} "
        f"| speed-up {_fmt(cell['speedup'], '{:.2f}x')} [{time.perf_counter() - t1:.0f} s]")
    del stock_layers, stock
    gc.collect()
    torch.cuda.empty_cache()
    return cell


def _fmt(x: Any, fmt: str = "{:.1f}") -> str:
    return "-" if x is None or x is False else fmt.format(x)
