"""CUDA-graph runner: one graph per batch bucket, replayed per decode step.

Start-up (``capture``): every bucket's ``program.prepare`` runs first (all kernels compiled, all
workspaces allocated), then a few eager warm-up steps on a side stream, then one capture per
bucket, **largest first**, all into **one shared memory pool** (smaller graphs reuse the larger
ones' blocks). The program's state and the static buffers are snapshotted before warm-up and
restored after, so start-up leaves no trace in live sequences.

One captured step = ``buffers.metadata`` (slot mapping, sequence lengths from positions and block
tables) -> ``program.step`` (with its side streams forked and joined inside) -> ``buffers.advance``
(positions + 1, optionally the in-graph sampled tokens as next input). A step replays one graph;
nothing is read back unless the caller reads the outputs.

Per step (``run``): the host-state gate picks the bucket or names why the stock path runs (the
caller's ``fallback``); the trace records either. Without CUDA (CPU tests) the same body runs
eagerly over the padded bucket, so padding and bookkeeping are exercised identically.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from latency_specialized.errors import UserError
from latency_specialized.runtime.buffers import DecodeBuffers
from latency_specialized.runtime.gate import DecodeGate, StepState
from latency_specialized.runtime.program import DecodeProgram, check_program
from latency_specialized.trace import Trace


@dataclass(frozen=True)
class CaptureInfo:
    """One captured bucket."""

    bucket: int
    """Batch bucket."""
    seconds: float
    """Wall time of the capture (instantiate included)."""
    nodes: Mapping[str, int] | None
    """Graph nodes by type ('kernel', 'memcpy', 'memset', ...), None where they cannot be read."""


@dataclass
class StepResult:
    """What one ``run`` did."""

    fast: bool
    """True when the program ran (graph replay or eager fast path)."""
    bucket: int | None
    """Bucket used on the fast path."""
    outputs: Any
    """Fast path: the program's outputs sliced to the live rows; stock path: the fallback's result."""
    reason: str = ""
    """Why the stock path ran."""
    graph: bool = False
    """True when a CUDA graph was replayed."""


def new_graph() -> torch.cuda.CUDAGraph:
    """A CUDA graph whose nodes can be counted (:func:`graph_node_counts`) after capture."""
    # keep_graph=True keeps the cudaGraph_t so its nodes can be counted (torch >= 2.8).
    try:
        return torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        return torch.cuda.CUDAGraph()


_NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
               7: "event_record", 8: "ext_semas_signal", 9: "ext_semas_wait", 10: "mem_alloc", 11: "mem_free",
               12: "batch_mem_op", 13: "conditional"}


def _cuda_driver() -> Any:
    return ctypes.CDLL("libcuda.so.1")


def count_nodes(lib: Any, graph_handle: int, counts: dict[str, int]) -> None:
    """Add the nodes of a graph (finished, or under capture) to ``counts`` by type; child graphs count
    what they hold. RuntimeError names the CUresult of a failing driver call."""
    n = ctypes.c_size_t(0)
    h = ctypes.c_void_p(graph_handle)
    rc = lib.cuGraphGetNodes(h, None, ctypes.byref(n))
    if rc != 0:
        raise RuntimeError(f"cuGraphGetNodes failed (CUresult {rc})")
    if n.value == 0:  # an empty graph (e.g. at the first site of a capture): the driver rejects a 0-long array
        return
    nodes = (ctypes.c_void_p * n.value)()
    rc = lib.cuGraphGetNodes(h, nodes, ctypes.byref(n))
    if rc != 0:
        raise RuntimeError(f"cuGraphGetNodes failed (CUresult {rc})")
    for i in range(n.value):
        t = ctypes.c_int(-1)
        lib.cuGraphNodeGetType(ctypes.c_void_p(nodes[i]), ctypes.byref(t))
        name = _NODE_TYPES.get(t.value, f"type{t.value}")
        if name == "graph":  # a child graph: count what it holds
            child = ctypes.c_void_p()
            lib.cuGraphChildGraphNodeGetGraph(ctypes.c_void_p(nodes[i]), ctypes.byref(child))
            count_nodes(lib, child.value, counts)
            continue
        counts[name] = counts.get(name, 0) + 1


def graph_node_counts(graph: torch.cuda.CUDAGraph) -> dict[str, int] | None:
    """Nodes of a captured graph by type (kernel launches are 'kernel'), or None if unreadable.

    Needs the graph kept after capture (``keep_graph=True``) and the CUDA driver library.
    """
    try:
        handle = graph.raw_cuda_graph()
    except Exception:  # noqa: BLE001 - graph not kept / torch too old: the caller reports "unknown"
        return None
    try:
        counts: dict[str, int] = {}
        count_nodes(_cuda_driver(), int(handle), counts)
        return counts
    except (OSError, RuntimeError):
        return None


@dataclass
class _Snapshot:
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def restore(self) -> None:
        for live, saved in self.pairs:
            live.copy_(saved)


class CUDAGraphRunner:
    """Captures and replays one CUDA graph per batch bucket of a DecodeProgram.

    Parameters
    ----------
    program : the DecodeProgram (``prepare`` / ``step`` / ``state_tensors`` / ``outputs``).
    buffers : its static inputs (rows = ``program.max_batch``).
    gate : host-state gate (default: buckets up to ``program.max_batch``).
    trace : records captures, fast steps and stock steps with reasons.
    fallback : ``fallback(state) -> Any``, the stock path for steps the gate refuses.
    use_graphs : capture/replay CUDA graphs (default: when the buffers live on a CUDA device).
    feed_back_tokens : when the program outputs 'next_tokens', the graph writes them into
        ``buffers.tokens`` as the next step's input (in-graph greedy decode, no host round trip).
    warmup_steps : eager steps per bucket before capture (lazy inits, cuBLAS workspaces).
    preserve_state : snapshot program state + buffers before warm-up and restore after capture.
    """

    def __init__(self, program: DecodeProgram, buffers: DecodeBuffers, *, gate: DecodeGate | None = None,
                 trace: Trace | None = None, fallback: Callable[[StepState], Any] | None = None,
                 use_graphs: bool | None = None, feed_back_tokens: bool = True, warmup_steps: int = 2,
                 preserve_state: bool = True):
        check_program(program)
        if buffers.spec.max_batch < program.max_batch:
            raise UserError(f"buffers hold {buffers.spec.max_batch} rows but the program needs {program.max_batch}: "
                            "size BufferSpec.max_batch to the program")
        self.program, self.buffers = program, buffers
        self.gate = gate or DecodeGate(max_batch=program.max_batch)
        if max(self.gate.all_buckets()) > buffers.spec.max_batch:
            raise UserError(f"gate bucket {max(self.gate.all_buckets())} exceeds the static buffers "
                            f"({buffers.spec.max_batch} rows): drop it or enlarge the buffers")
        self.trace = trace if trace is not None else Trace()
        self.fallback = fallback
        self.use_graphs = (buffers.device.type == "cuda") if use_graphs is None else use_graphs
        if self.use_graphs and not torch.cuda.is_available():
            raise UserError("CUDA graphs need a CUDA device: run on a GPU or pass use_graphs=False")
        self.feed_back_tokens = feed_back_tokens
        self.warmup_steps = warmup_steps
        self.preserve_state = preserve_state
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.captures: dict[int, CaptureInfo] = {}
        self.pool: Any = None
        self._prepared: set[int] = set()

    # ------------------------------------------------------------------ the captured body
    def body(self, bucket: int) -> None:
        """One decode step over rows ``[:bucket]``: exactly what a graph of that bucket holds."""
        self.buffers.metadata(bucket)
        self.program.step(self.buffers, bucket)
        nxt = self.program.outputs().get("next_tokens") if self.feed_back_tokens else None
        self.buffers.advance(bucket, None if nxt is None else nxt[:bucket])

    # ------------------------------------------------------------------ start-up
    def prepare(self, buckets: Iterable[int]) -> None:
        """Run the program's compile/allocate hook for every bucket not yet prepared."""
        for b in buckets:
            if b not in self._prepared:
                self.program.prepare(b)
                self._prepared.add(b)

    def _snapshot(self) -> _Snapshot:
        snap = _Snapshot()
        tensors = list(self.program.state_tensors()) + list(self.buffers.tensors().values())
        for t in tensors:
            snap.pairs.append((t, t.clone()))
        return snap

    def capture(self, buckets: Iterable[int] | None = None,
                progress: Callable[[str], None] | None = None) -> list[CaptureInfo]:
        """Prepare, warm up and capture one graph per bucket (largest first, one memory pool)."""
        if not self.use_graphs:
            raise UserError("capture needs CUDA graphs: this runner runs eagerly (no CUDA device)")
        order = sorted(set(buckets if buckets is not None else self.gate.all_buckets()), reverse=True)
        bad = [b for b in order if b > self.buffers.spec.max_batch or b < 1]
        if bad:
            raise UserError(f"cannot capture buckets {bad}: use 1..{self.buffers.spec.max_batch}")
        say = progress or (lambda _msg: None)
        t0 = time.perf_counter()
        self.prepare(order)  # everything compiled and allocated before any capture
        say(f"prepared buckets {order} in {time.perf_counter() - t0:.1f} s")
        snap = self._snapshot() if self.preserve_state else None
        side = torch.cuda.Stream(device=self.buffers.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in order:
                for _ in range(self.warmup_steps):
                    self.body(b)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize(self.buffers.device)
        if snap is not None:
            snap.restore()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        infos = []
        for b in order:
            t1 = time.perf_counter()
            g = new_graph()
            with torch.cuda.graph(g, pool=self.pool):
                self.body(b)
            if hasattr(g, "instantiate"):
                try:
                    g.instantiate()  # keep_graph=True defers instantiation; do it now, not on first replay
                except RuntimeError:
                    pass  # already instantiated (keep_graph unsupported)
            self.graphs[b] = g
            info = CaptureInfo(b, time.perf_counter() - t1, graph_node_counts(g))
            self.captures[b] = info
            nodes = info.nodes.get("kernel") if info.nodes else None
            self.trace.record("capture", f"captured bucket {b}" + (f": {nodes} kernel nodes" if nodes is not None else ""),
                              data={"bucket": b, "nodes": dict(info.nodes or {}), "seconds": info.seconds})
            say(f"captured bucket {b} ({info.seconds * 1e3:.0f} ms"
                + (f", {nodes} kernels" if nodes is not None else "") + ")")
            infos.append(info)
        torch.cuda.synchronize(self.buffers.device)
        if snap is not None:
            snap.restore()  # capture does not execute, but keep the contract explicit and cheap
        return infos

    # ------------------------------------------------------------------ per step
    def replay(self, bucket: int) -> None:
        """Replay the graph of ``bucket`` (raises UserError when it was not captured)."""
        g = self.graphs.get(bucket)
        if g is None:
            raise UserError(f"bucket {bucket} has no graph: call capture() first (captured: {sorted(self.graphs)})")
        g.replay()

    def run(self, state: StepState, tokens: torch.Tensor | None = None) -> StepResult:
        """One decode step: gate on host state, then replay (or run eagerly) or fall back to stock.

        ``tokens`` (optional, ``[num_seqs]``) are externally sampled input tokens copied into the
        static buffer first; without them the step uses what the previous graph fed back. A step
        whose position would reach the block-table capacity is refused like any out-of-scope step
        (the host counts the steps the graph advanced: ``buffers.capacity_problem``).
        """
        captured = self.graphs.keys() if self.use_graphs else None
        decision = self.gate.decide(state, captured)
        if decision.fast and state.num_seqs != self.buffers.num_active:
            decision = type(decision)(False, None, f"static buffers hold {self.buffers.num_active} live rows, "
                                                   f"step has {state.num_seqs}: call buffers.load() first")
        full = self.buffers.capacity_problem() if decision.fast else None
        if full is not None:
            decision = type(decision)(False, None, full)
        if not decision.fast:
            self.trace.stock(decision.reason, batch=state.num_seqs)
            if self.fallback is None:
                raise UserError(f"stock path needed ({decision.reason}) but the runner has no fallback: "
                                "pass fallback= (the stock decode step)")
            return StepResult(False, None, self.fallback(state), decision.reason)
        bucket = decision.bucket
        assert bucket is not None
        if tokens is not None:
            self.buffers.set_tokens(tokens)
        if self.use_graphs:
            self.replay(bucket)
        else:
            self.prepare([bucket])
            self.body(bucket)
        self.buffers.count_step()
        self.trace.fast(state.num_seqs, bucket, graph=self.use_graphs)
        n = state.num_seqs
        outs = {k: v[:n] for k, v in self.program.outputs().items()}
        return StepResult(True, bucket, outs, graph=self.use_graphs)
