"""The cross-model test matrix: cells, results, and the multi-rank (gloo) runner.

A cell is one (adapter, batch, TP, context, speculative tokens, device) combination with a
readable id (``qwen3_moe-tp2-b4-ctx40-s0``). Every installed adapter joins the matrix by being
installed: the cells come from the registry and from each adapter's scope. Adapters with the
``program`` capability implement :meth:`ModelAdapter.verify_cell`, which runs the decode program
against the model reference for that cell on one rank and returns a :class:`CellResult`; TP>1
cells run on several CPU processes joined by gloo (see :class:`GlooPool`).

Plan cells (:func:`plan_cells`) are the distinct inputs of ``build_plan``: (adapter, batch, TP,
context, speculative tokens) - the context is one of them because ``build_plan`` takes it (the
attention sites carry it), so no two plan cells build the same plan (``qwen3_moe-tp2-b4-ctx40-s0``).
:func:`cell_plan` is the plan a program cell is verified with, and
:func:`kernel_sites` what the plan's rules say must run a kernel (not a reference) in it.

Contexts: the short ones (``SHORT_CONTEXTS``, prompts the reference prefills) and the long ones
(``LONG_CONTEXTS``: 32K and 128K tokens, ``kimi_k3-tp1-b1-ctx131072-s0``) where the adapter's full architecture
serves them (``contexts_for``). A long cell prefills nothing: its sequences get a synthetic history
(``testing.history.seed_history``) in states with page tables sized to the context, and the
tiny spec's ``max_context`` is raised to hold it (``context_spec``). Plan cells take every context for every
(TP, batch, speculative tokens); program cells take the long contexts as a sample on the CPU
(``LONG_CPU_SAMPLE``: one TP x batch per adapter and long context) and on a GPU every TP x ``LONG_GPU_BATCHES``
plus the spec sample, within ``LONG_GPU_BYTES`` of estimated memory (``long_cell_bytes``).
"""

from __future__ import annotations

import functools
import inspect
import os
import socket
import traceback
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from latency_specialized.testing.gpu_share import admitted, release_cached_memory

BATCHES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
TPS: tuple[int, ...] = (1, 2, 8)
SHORT_CONTEXTS: tuple[int, ...] = (8, 40)
"""Prompt lengths of the short cells (tiny models, prefilled by the reference): a short one (two KV pages of 4
tokens in the ``testing.verify`` cells) and one of many pages (ten)."""
LONG_CONTEXTS: tuple[int, ...] = (32768, 131072)
"""History lengths of the long-context cells (``qwen3_moe-tp2-b2-ctx32768-s0``): a synthetic history
(``testing.history``: every cache and recurrent state of positions 0..ctx-1 drawn at random, the same for
reference and program) instead of a prefill, page tables of ~ctx / 4 entries, then the usual decode steps. An
adapter has the long contexts its full architecture serves (``contexts_for``: Qwen3-MoE's 40960 tokens stop
it at 32K)."""
CONTEXTS: tuple[int, ...] = SHORT_CONTEXTS + LONG_CONTEXTS
"""Every context of the matrix (a plan cell group has each that its adapter serves)."""
LONG_HEADROOM = 64
"""Tokens past the longest history a long-context spec holds (decode steps, drafts)."""
LONG_CPU_SAMPLE: dict[int, tuple[int, int]] = {32768: (2, 2), 131072: (1, 1)}
"""(TP, batch) of the CPU long-context cells, spec 0, one per adapter and long context: a sample (a 128K
history of the widest tiny model is ~1 GiB per sequence; the GPU cells take the batch and TP axes)."""
LONG_GPU_BATCHES: tuple[int, ...] = (1, 8, 64)
"""Batches of the GPU long-context cells (every TP; plus the spec cells of ``SPEC_SAMPLE``)."""
LONG_GPU_BYTES = 24 << 30
"""Largest estimated memory of a GPU long-context cell (``long_cell_bytes``: every TP rank holds the whole
reference states and its program copy; the H200 suite runs four matrix workers on one GPU): a cell beyond it
(e.g. Muse Spark at 128K, batch 64) is left out, as a TP its tiny spec cannot be split by is."""
QUANTIZED_BATCHES: tuple[int, ...] = (1, 8)
QUANTIZED_TPS: tuple[int, ...] = (1, 2)
"""Batches and TPs of the quantized-experts cells (the gemv and grouped sides of the 4-bit kernels' split)."""
SPEC_SAMPLE: tuple[tuple[int, int], ...] = ((1, 1), (1, 4), (2, 2))
"""(TP, batch) of the speculative cells (each k > 0 of the adapter's scope, both contexts, every device): a
sample - a verification cell runs 1 + k reference steps per step, and the plain cells cover the batches and
TPs of the same program."""
MIN_DECISIVE = 0.5
"""Fewest decisive positions a cell may have (a cell of near ties would check no token)."""
CELL_DTYPE = "float32"
"""Activation dtype program cells are verified in (the tiny models run fp32; fp32 tolerances)."""


@dataclass(frozen=True)
class Cell:
    adapter: str
    batch: int
    tp: int
    context: int | None
    """Prompt length (``LONG_CONTEXTS``: synthetic history length); None in a plan cell whose plan does not take a
    context (see ``plan_cells``)."""
    spec_tokens: int
    device: str = "cpu"
    experts: str | None = None
    """Routed experts kept in this stored format (``MoESpec.expert_format``); None: the tiny spec's bf16."""
    linears: str | None = None
    """Dense projections kept in this stored format too (the adapter's ``native_linears``: ``ModelSpec.linear_format``);
    None: the activation dtype."""

    @property
    def id(self) -> str:
        dev = "" if self.device == "cpu" else f"-{self.device}"
        ctx = "" if self.context is None else f"-ctx{self.context}"
        q = ("" if self.experts is None else f"-{self.experts}") + ("" if self.linears is None else
                                                                   f"-dense-{self.linears}")
        return f"{self.adapter}-tp{self.tp}-b{self.batch}{ctx}-s{self.spec_tokens}{q}{dev}"


@dataclass
class CellResult:
    """What a rank reports for one cell."""

    max_abs_err: float
    """Largest |program - reference| over the compared logits."""
    tolerance: float
    """Bound the adapter states for this dtype/cell."""
    top1_agreement: float
    """Fraction of the decisive positions (``verify.decisive_agreement``: no error within the bound can flip the
    reference's top-1 there) where program and reference pick the same token."""
    fast_steps: int
    """Decode steps the trace says ran the program (the fast path)."""
    stock_steps: int
    """Decode steps that fell back to the stock/reference path."""
    steps: int
    """Decode steps run."""
    impls: dict[str, str] = field(default_factory=dict)
    """Op site -> implementation that served it."""
    logits_digest: float = 0.0
    """Sum of the program's logits: equal on every rank when the ranks agree."""
    decisive: float = 1.0
    """Fraction of the compared positions that are decisive."""
    top1_raw: float = 1.0
    """Fraction of all compared positions where the argmaxes agree (near ties included)."""

    @property
    def ok(self) -> bool:
        return (self.max_abs_err <= self.tolerance and self.fast_steps == self.steps and self.stock_steps == 0
                and self.top1_agreement >= 0.99 and self.decisive >= MIN_DECISIVE)


def _splits(adapter: Any, fmt: str, tp: int, linears: str | None = None) -> bool:
    """Whether the tiny spec with its experts (and, with ``linears``, its dense projections: the adapter's
    ``native_linears``) kept as stored splits by ``tp`` (whole scale blocks per rank)."""
    try:
        spec = adapter.spec("tiny").with_expert_format(fmt)
        if linears is not None:
            spec = spec.with_linear_format(adapter.native_linears)
        spec.shard(tp)
        return not (linears and adapter.composed_model(spec).stored_split_problems(tp))
    except Exception:  # noqa: BLE001 - the UserError naming why: not a cell
        return False


def long_contexts(adapter: Any) -> tuple[int, ...]:
    """The long contexts of ``adapter``'s cells: those its full architecture serves (with ``LONG_HEADROOM``)."""
    top = adapter.spec("full").max_context
    return tuple(c for c in LONG_CONTEXTS if c + LONG_HEADROOM <= top)


def contexts_for(adapter: Any) -> tuple[int, ...]:
    """Every context of ``adapter``'s cells: the short ones and ``long_contexts``."""
    return SHORT_CONTEXTS + long_contexts(adapter)


def context_spec(spec: Any, context: int | None) -> Any:
    """``spec`` able to hold ``context`` (+ ``LONG_HEADROOM``) tokens: the tiny specs' ``max_context`` (4096,
    Qwen3-MoE's 256) raised to the longest long context for the long-context cells; else ``spec`` itself."""
    if context is None or context + LONG_HEADROOM <= spec.max_context:
        return spec
    return spec.model_copy(update={"max_context": max(LONG_CONTEXTS) + LONG_HEADROOM})


def context_adapter(adapter: Any, variant: str, context: int | None) -> Any:
    """``adapter`` for planning ``variant`` at ``context``: bound to ``context_spec`` of that variant where the
    variant's spec is too short for it (the tiny specs at the long contexts), else ``adapter`` itself."""
    from latency_specialized.adapter_contract import SpecBoundAdapter

    spec = adapter.spec(variant)
    longer = context_spec(spec, context)
    return adapter if longer is spec else SpecBoundAdapter(adapter, longer)


@functools.lru_cache(maxsize=None)
def _bytes_per_token(adapter: Any) -> float:
    """Measured bytes per history token of one sequence of the tiny reference's states (fp32, CPU)."""
    import torch

    from latency_specialized.testing.history import long_states, states_bytes

    n = 1024
    ref = adapter.reference(context_spec(adapter.spec("tiny"), max(LONG_CONTEXTS)), seed=0, dtype=CELL_DTYPE,
                            device="cpu", tokenizer=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        states, _ = long_states(ref, n, 1, n, seed=0)
    finally:
        torch.set_num_threads(threads)
    return states_bytes(states) / n


def long_cell_bytes(adapter: Any, cell: Cell) -> int:
    """Estimated memory of a long-context cell: each of its TP ranks holds the whole reference states (history
    of every sequence, measured per token: ``_bytes_per_token``) and its program copy (at most as large)."""
    return int(2 * cell.tp * cell.batch * (cell.context or 0) * _bytes_per_token(adapter))


def admission_bytes(adapter: Any, cell: Cell) -> int:
    """Memory a GPU cell is admitted with (``gpu_share.admitted``): ``long_cell_bytes``, verification cells
    included - their reference rolls back to snapshots of the per-row states only (``ModelStates.clone(paged=
    False)``), so their peak no longer grows with k (``ops/attention/NOTES_verify.md``, session 37; until then
    whole-state snapshots per draft made it ~(1 + k) x and the ledger asked for that much)."""
    return long_cell_bytes(adapter, cell)


def _long_cells(adapter: Any, device: str, tps: list[int], spec_options: list[int]) -> list[Cell]:
    """The long-context cells of one device (``LONG_CPU_SAMPLE`` on the CPU; on a GPU every TP x
    ``LONG_GPU_BATCHES`` and the ``SPEC_SAMPLE`` spec cells, within ``LONG_GPU_BYTES``)."""
    scope, out = adapter.scope(), []
    for ctx in long_contexts(adapter):
        if device == "cpu":
            tp, batch = LONG_CPU_SAMPLE[ctx]
            if tp in tps and batch <= scope.max_batch:
                out.append(Cell(adapter.name, batch, tp, ctx, 0, device))
            continue
        for tp in tps:
            for batch in BATCHES:
                if batch > scope.max_batch:
                    continue
                ks = ([0] if batch in LONG_GPU_BATCHES else []) + (spec_options if (tp, batch) in SPEC_SAMPLE else [])
                for k in ks:
                    cell = Cell(adapter.name, batch, tp, ctx, k, device)
                    if long_cell_bytes(adapter, cell) <= LONG_GPU_BYTES:
                        out.append(cell)
    return out


def cells_for(adapter: Any, *, devices: tuple[str, ...] = ("cpu", "cuda")) -> list[Cell]:
    """Every matrix cell of an adapter, limited to the TPs its tiny spec can be split by: the short contexts
    over every TP x batch (spec cells: ``SPEC_SAMPLE``), the long ones as ``_long_cells`` samples them."""
    scope = adapter.scope()
    spec_options = sorted(k for k in scope.spec_tokens if k > 0)
    cells = []
    for device in devices:
        tps = []
        for tp in TPS:
            if tp not in scope.tp_sizes:
                continue
            try:
                adapter.spec("tiny").shard(tp)
            except Exception:  # noqa: BLE001 - tiny spec cannot be split: not a cell
                continue
            tps.append(tp)
            for batch in BATCHES:
                if batch > scope.max_batch:
                    continue
                for ctx in SHORT_CONTEXTS:
                    cells.append(Cell(adapter.name, batch, tp, ctx, 0, device))
                    if (tp, batch) in SPEC_SAMPLE:
                        cells.extend(Cell(adapter.name, batch, tp, ctx, k, device) for k in spec_options)
                # quantized experts (adapters that keep them as stored): a sample of the axis, TP splits of the
                # codes and scales included - the long tail of batches and contexts is the bf16 cells'
                for fmt in getattr(adapter, "expert_formats", ()):
                    if batch in QUANTIZED_BATCHES and tp in QUANTIZED_TPS and _splits(adapter, fmt, tp):
                        cells.append(Cell(adapter.name, batch, tp, CONTEXTS[0], 0, device, experts=fmt))
                # the release's whole format: its routed experts and its dense projections as stored
                lin = adapter.native_linears
                if lin is not None and batch in QUANTIZED_BATCHES and tp in QUANTIZED_TPS \
                        and _splits(adapter, adapter.expert_formats[0], tp, lin.format):
                    cells.append(Cell(adapter.name, batch, tp, CONTEXTS[0], 0, device,
                                      experts=adapter.expert_formats[0], linears=lin.format))
        cells.extend(_long_cells(adapter, device, tps, spec_options))
    return cells


def plan_takes_context() -> bool:
    """Whether ``build_plan`` takes a ``context`` (the longest sequence the plan serves)."""
    from latency_specialized.ops.plan import build_plan

    return "context" in inspect.signature(build_plan).parameters


def plan_cells(adapter: Any) -> list[Cell]:
    """The matrix cells of ``adapter`` that build distinct plans (CPU cells; a plan names its arch).

    The context is a plan input where ``build_plan`` takes it (it does: ``plan.context`` and the attention
    sites' attr ``context``); a ``build_plan`` without one would make the cells of one (TP, batch, spec
    tokens) that differ only in context build the same plan, so they would be one plan cell (context None)."""
    cells = cells_for(adapter, devices=("cpu",))
    # plans are cheap: every bf16 (TP, batch, spec tokens) group is planned at every long context (the CPU
    # program cells sample them)
    have = set(cells)
    groups = dict.fromkeys((c.tp, c.batch, c.spec_tokens) for c in cells if c.experts is None)
    cells += [c for tp, batch, k in groups for ctx in long_contexts(adapter)
              if (c := Cell(adapter.name, batch, tp, ctx, k)) not in have]
    if plan_takes_context():
        return cells
    return list(dict.fromkeys(replace(c, context=None) for c in cells))


def plan_kwargs(cell: Cell) -> dict[str, Any]:
    """The deployment arguments of ``build_plan`` a cell stands for (``context`` where it takes one)."""
    kw: dict[str, Any] = {"tp": cell.tp, "batch": cell.batch, "spec_tokens": cell.spec_tokens}
    if cell.context is not None:
        kw["context"] = cell.context
    return kw


def cell_hardware(cell: Cell) -> Any:
    """The hardware a cell runs on: the probed GPU for 'cuda' cells, else the CPU."""
    from latency_specialized import hardware

    return hardware.probe() if cell.device == "cuda" else hardware.for_arch("cpu")


def cell_spec(adapter: Any, cell: Cell) -> Any:
    """The tiny spec a program cell runs: able to hold the cell's context (``context_spec``), its experts kept in
    the cell's format, and built for the cell's speculative tokens (``spec.with_spec_tokens(k)``: e.g. KDA's
    rollback tapes; UserError where the adapter's spec has no such form)."""
    from latency_specialized.errors import UserError

    spec = context_spec(adapter.spec("tiny"), cell.context)
    if cell.experts is not None:
        spec = spec.with_expert_format(cell.experts)
    if cell.linears is not None:
        spec = spec.with_linear_format(adapter.native_linears)
    if cell.spec_tokens:
        if not callable(getattr(spec, "with_spec_tokens", None)):
            raise UserError(f"{cell.id}: {adapter.name}'s scope lists {cell.spec_tokens} speculative tokens but its "
                            "spec has no with_spec_tokens(k) to build the model for them")
        spec = spec.with_spec_tokens(cell.spec_tokens)
    return spec


def cell_plan(adapter: Any, registry: Any, cell: Cell) -> Any:
    """The plan a program cell verifies: the tiny variant (:func:`cell_spec`) in ``CELL_DTYPE`` on the cell's
    hardware, at its TP, batch and speculative tokens, for the deployment's default communicator
    (``build_plan``)."""
    from latency_specialized.ops.plan import build_plan

    from latency_specialized.adapter_contract import SpecBoundAdapter

    kw = plan_kwargs(cell)
    if not plan_takes_context():
        kw.pop("context", None)
    if cell.experts is not None or cell.linears is not None or cell.spec_tokens or cell.context in LONG_CONTEXTS:
        adapter = SpecBoundAdapter(adapter, cell_spec(adapter, cell))
    return build_plan(adapter, registry, cell_hardware(cell), dtype=CELL_DTYPE, variant="tiny", **kw)


def kernel_sites(plan: Any, registry: Any) -> dict[str, str]:
    """The sites a program calls under ``plan`` that the plan's rules give to a kernel: called site ->
    the best non-reference implementation whose ``supports()`` accepts the site's context. Every other
    called site may only run its family's reference."""
    out: dict[str, str] = {}
    for c in plan.called_choices():
        impl, _ = registry.select(c.site.ctx, allow_reference=False)
        if impl is not None:
            out[c.site.name] = impl.name
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, jobs, results) -> None:  # pragma: no cover - runs in a subprocess
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from latency_specialized.comm import TorchDistributedCommunicator
    from latency_specialized.plugins import get_registry

    comm = TorchDistributedCommunicator()
    reg = get_registry()
    while True:
        job = jobs.get()
        if job is None:
            break
        cell = Cell(**job)
        try:
            res = reg.adapter(cell.adapter).verify_cell(cell, comm=comm)
            results.put((rank, cell.id, "ok", asdict(res)))
        except BaseException as e:  # noqa: BLE001 - reported to the test process
            results.put((rank, cell.id, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        release_cached_memory()  # the pool lives all session beside other workers' pools on the same GPU
    dist.destroy_process_group()


class GlooPool:
    """``world`` CPU processes joined by gloo that run matrix cells rank-parallel (started once per TP)."""

    def __init__(self, world: int, timeout_s: float = 300.0):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.world, self.timeout_s = world, timeout_s
        self.broken = False
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.jobs[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, cell: Cell) -> list[CellResult]:
        """Run ``cell`` on every rank; returns the per-rank results in rank order (raises on any error)."""
        import queue

        if self.broken:
            raise RuntimeError(f"{cell.id}: this pool's ranks stopped answering earlier; start a new GlooPool")
        for q in self.jobs:
            q.put(asdict(cell))
        got: dict[int, Any] = {}
        errors = []
        while len(got) + len(errors) < self.world:
            try:
                rank, cell_id, status, payload = self.results.get(timeout=self.timeout_s)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                self.broken = True  # ranks may still answer this cell later: never read them for the next one
                self.close()
                raise TimeoutError(f"{cell.id}: no answer from ranks within {self.timeout_s}s (dead ranks: {dead})")
            if cell_id != cell.id:
                raise RuntimeError(f"{cell.id}: rank {rank} answered for {cell_id} (a pool runs one cell at a time)")
            if status == "ok":
                got[rank] = CellResult(**payload)
            else:
                errors.append(f"rank {rank}: {payload}")
        if errors:
            raise RuntimeError(f"{cell.id} failed:\n" + "\n".join(errors))
        return [got[r] for r in range(self.world)]

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=0 if self.broken else 10)
            if p.is_alive():
                p.kill()


def run_program_cell(cell: Cell, pools: Any) -> list[CellResult]:
    """Run a program cell: in this process at TP1, else on ``pools(tp)`` (a ``GlooPool`` per TP); per-rank
    results in rank order. A GPU cell starts once its estimated memory (``admission_bytes``) fits beside the
    cells other processes run on the same GPU (``gpu_share.admitted``), and this process hands its cached
    blocks back after it."""
    import contextlib

    from latency_specialized.plugins import get_registry

    adapter = get_registry().adapter(cell.adapter)
    gate = (admitted(admission_bytes(adapter, cell), label=cell.id) if cell.device == "cuda"
            else contextlib.nullcontext())
    with gate:
        try:
            if cell.tp == 1:
                return [adapter.verify_cell(cell, comm=None)]
            return pools(cell.tp).run(cell)
        finally:
            if cell.device == "cuda":
                release_cached_memory()
