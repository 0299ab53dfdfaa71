"""One cell of the cross-model test matrix, for any adapter with a reference and a composed program.

The tiny model (fp32, fixed seed: ``adapter.reference(tiny, seed=...)``) prefills ``PROTOTYPES``
sequences of different lengths around the cell's context with the reference (memoised per process:
gloo workers serve many cells); a batch of B sequences copies their states (sequence b from
prototype b % PROTOTYPES) into states with shuffled pages. Then ``STEPS`` decode steps run the
program (``adapter.program`` over this rank's shard of those states, ``runtime.states.shard_states``,
through the runtime runner; TP ranks all-reduce over ``comm``) and the reference (whole model; each
rank checks every TP-th sequence), both fed the program's greedy tokens.

A cell with ``k > 0`` speculative tokens runs ``STEPS`` verification steps instead: every request feeds
its token and ``k`` random drafts, the reference decodes them one by one; request ``b`` then accepts
``j = (b + step) % (k + 1)`` drafts (0 and k among them), the reference rolls back to its state after that
prefix (a copy of the snapshot after token ``j``), and the next step starts from the program's greedy
token after the prefix at position ``p + j + 1``, applying the accept first. The program runs on a spec
built for ``k`` (``testing.matrix.cell_spec``) over the prefilled states plus zero tapes.

A long-context cell (``testing.matrix.LONG_CONTEXTS``) prefills nothing: its B sequences get synthetic
histories of ``context - k (k + 1) / 2`` tokens (``k = b % 4``; ``testing.history.long_states``) in states allocated for the context (pages of 4 tokens: ~ctx / 4 page-table
entries per sequence), and the decode / verification steps above run from there.

What the adapter provides: ``spec('tiny')``, ``reference(spec, seed=, dtype=, device=, tokenizer=)``
(``new_cache(num_seqs, max_len, block_size=, shuffle_seed=)`` -> ``ModelStates``, ``prefill``,
``decode``), ``composed_model(spec)`` and ``program(spec, plans=, cache=, reference=, trace=, comm=)``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from latency_specialized.errors import UserError

STEPS = 2
PROTOTYPES = 4
REL_TOL = 5e-5
"""fp32 bound on max|program - reference| relative to max|reference logits| (measured <= 1e-5 on the tiny
models: summation order only)."""
LONG_TOL_CONTEXT = 8192
"""Long-context cells scale the bound by sqrt(context / this) (x2 at 32K, x4 at 128K): the fp32 rounding of a
softmax sum over N keys grows like sqrt(N) with the summation order, which differs between program and reference
(measured on a 2-core CPU: 7.3e-5 relative at 128K for Muse Spark's full-attention layer, over the flat 5e-5)."""
SEED = 1234


def quant_kwargs(experts: str | None, linears: str | None) -> dict[str, str]:
    """The reference's keywords keeping routed experts / dense projections in a stored format (none: bf16)."""
    return {**({"expert_format": experts} if experts else {}), **({"linear_format": linears} if linears else {})}


@functools.lru_cache(maxsize=4)
def prototypes(adapter: Any, context: int, device: str, seed: int = SEED,
               experts: str | None = None, linears: str | None = None) -> tuple[Any, Any, list[int]]:
    """(reference, states, lengths): PROTOTYPES sequences of lengths context, context-1, context-3, ... prefilled.
    ``experts`` / ``linears``: the routed experts / dense projections kept quantized in that format (the reference
    computes with their values)."""
    spec = adapter.spec("tiny")
    quant = quant_kwargs(experts, linears)
    ref = adapter.reference(spec, seed=seed, dtype="float32", device=device, tokenizer=False, **quant)
    lens = [max(1, context - k * (k + 1) // 2) for k in range(PROTOTYPES)]
    states = ref.new_cache(PROTOTYPES, context, block_size=4)
    g = torch.Generator().manual_seed(seed + context)
    for slot, n in zip(states.slots, lens):
        ref.prefill(states, slot, 0, torch.randint(3, spec.vocab_size, (n,), generator=g))
    return ref, states, lens


@functools.lru_cache(maxsize=2)
def long_reference(adapter: Any, device: str, experts: str | None = None, seed: int = SEED,
                   linears: str | None = None) -> Any:
    """The reference of the long-context cells: the tiny model (same weights as ``prototypes``') whose spec holds
    the longest long context (``testing.matrix.context_spec``)."""
    from latency_specialized.testing.matrix import LONG_CONTEXTS, context_spec

    quant = quant_kwargs(experts, linears)
    return adapter.reference(context_spec(adapter.spec("tiny"), max(LONG_CONTEXTS)), seed=seed, dtype="float32",
                             device=device, tokenizer=False, **quant)


def batch_states(ref: Any, proto: Any, lens: list[int], batch: int, max_len: int, seed: int) -> Any:
    """States of ``batch`` sequences (shuffled pages), sequence b a copy of prototype b % PROTOTYPES."""
    states = ref.new_cache(batch, max_len, block_size=proto.block_size, shuffle_seed=seed)
    for b, slot in enumerate(states.slots):
        states.copy_sequence(slot, proto, proto.slots[b % PROTOTYPES], lens[b % PROTOTYPES])
    return states


def decisive_agreement(got: torch.Tensor, want: torch.Tensor, rel_tol: float) -> tuple[int, int, int]:
    """(raw, agreeing, decisive) over the positions of ``got`` / ``want`` [..., vocab]: how many argmaxes agree,
    how many positions are decisive - the reference's top-1 leads its runner-up by more than twice the bound
    (``rel_tol`` x max|want|), so no error within the bound can flip them - and on how many of those the argmaxes
    agree. A flip elsewhere is a near tie, not a wrong program."""
    top2 = want.double().topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > 2 * rel_tol * want.abs().max().item()
    same = got.argmax(-1) == want.argmax(-1)
    return int(same.sum()), int((same & decisive).sum()), int(decisive.sum())


def verify_cell(adapter: Any, cell: Any, comm: Any = None, *, rel_tol: float = REL_TOL) -> Any:
    """Run ``cell`` (a testing.matrix.Cell) on this rank; returns a testing.matrix.CellResult.

    On the CPU torch runs single-threaded for the call (restored after): the tiny models' ops are
    far too small to gain from threads, and oversubscribed threads slow them down ~50x.
    """
    threads = torch.get_num_threads()
    if cell.device != "cuda":
        torch.set_num_threads(1)
    try:
        return _verify(adapter, cell, comm, rel_tol)
    finally:
        torch.set_num_threads(threads)


def _verify(adapter: Any, cell: Any, comm: Any, rel_tol: float) -> Any:
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
    from latency_specialized.runtime.gate import DecodeGate, StepState
    from latency_specialized.runtime.graph_runner import CUDAGraphRunner
    from latency_specialized.runtime.states import shard_states
    from latency_specialized.testing.history import long_states
    from latency_specialized.testing.matrix import LONG_CONTEXTS, cell_plan, cell_spec
    from latency_specialized.trace import Trace

    world = comm.world_size if comm is not None else 1
    if world != cell.tp:
        raise UserError(f"{cell.id}: needs {cell.tp} ranks, got a communicator of {world}")
    rank = comm.rank if comm is not None else 0
    device = "cuda" if cell.device == "cuda" else "cpu"
    experts = getattr(cell, "experts", None)
    if experts is not None and "quantized_experts" not in adapter.capabilities:
        raise UserError(f"{cell.id}: {adapter.name} cannot keep its routed experts as {experts}")
    linears = getattr(cell, "linears", None)
    if linears is not None and getattr(adapter, "native_linears", None) is None:
        raise UserError(f"{cell.id}: {adapter.name} cannot keep its dense projections as {linears}")
    B, k = cell.batch, cell.spec_tokens
    if cell.context in LONG_CONTEXTS:   # a synthetic history (testing.history), not a prefill
        rel_tol *= max(1.0, cell.context / LONG_TOL_CONTEXT) ** 0.5
        ref = long_reference(adapter, device, experts, linears=linears)
        states, positions = long_states(ref, cell.context, B, cell.context + STEPS * (1 + k), seed=B)
    else:
        ref, proto, lens = prototypes(adapter, cell.context, device, experts=experts, linears=linears)
        states = batch_states(ref, proto, lens, B, cell.context + STEPS * (1 + k), seed=B)
        positions = [lens[b % PROTOTYPES] for b in range(B)]
    spec = ref.spec
    plan = cell_plan(adapter, get_registry().implementations, cell)
    trace = Trace()
    rank_states = shard_states(adapter.composed_model(spec), states, rank, cell.tp)
    if k:  # the spec built for k: its extra per-row states (rollback tapes) start at zero
        spec_k = cell_spec(adapter, cell)
        rank_states = rank_states.extended(adapter.composed_model(spec_k), torch.float32)
    program = adapter.program(spec_k if k else spec, plans=plan, cache=rank_states, reference=ref, trace=trace,
                              comm=comm)
    buffers = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(states.slots[0].blocks),
                                       block_size=states.block_size, pad_state=0, spec_tokens=k), device)
    toks = torch.randint(3, spec.vocab_size, (B,), generator=torch.Generator().manual_seed(B)).to(device)
    buffers.load(toks, positions, [s.row for s in states.slots], states.block_table(device="cpu"))
    runner = CUDAGraphRunner(program, buffers, trace=trace, use_graphs=False, feed_back_tokens=False,
                             gate=DecodeGate(max_batch=plan.bucket, buckets=(plan.bucket,), spec_tokens=(k,)))
    if k:
        return _verify_spec(cell, ref, states, positions, toks, buffers, runner, program, plan, trace, comm,
                            rel_tol)
    # The reference work is split over the ranks (rank r checks sequences r, r + TP, ...); the
    # statistics are then combined, so every rank reports the whole batch.
    mine = [b for b in range(B) if b % world == rank]
    err, scale, counts, digest = 0.0, 0.0, [0, 0, 0], 0.0
    for _ in range(STEPS):
        got = runner.run(StepState(num_seqs=B), tokens=toks).outputs["logits"]
        if mine:
            want = ref.decode(states, [states.slots[b] for b in mine], [positions[b] for b in mine], toks[mine])
            err = max(err, (got[mine].double() - want.double()).abs().max().item())
            scale = max(scale, want.abs().max().item())
            counts = [c + n for c, n in zip(counts, decisive_agreement(got[mine], want, rel_tol))]
        digest += float(got.double().sum())
        toks = got.argmax(-1)   # the program's greedy tokens (identical on every rank) feed both next step
        positions = [p + 1 for p in positions]
    err, scale, counts = _combine(comm, err, scale, counts)
    program.close()  # the symmetric-memory workspaces it built (collective; the pool's ranks serve many cells)
    return _result(err, scale, counts, STEPS * B, rel_tol, trace, plan, digest)


def _combine(comm: Any, err: float, scale: float, counts: list[int]) -> tuple[float, float, list[int]]:
    """The ranks' statistics over the whole batch (each rank checked its own sequences)."""
    if comm is None or comm.world_size == 1:
        return err, scale, counts
    stats = comm.all_gather(torch.tensor([[err, scale]], dtype=torch.float64), dim=0)
    total = comm.all_reduce(torch.tensor([float(c) for c in counts], dtype=torch.float64))
    return stats[:, 0].max().item(), stats[:, 1].max().item(), [int(c) for c in total.tolist()]


def _result(err: float, scale: float, counts: list[int], positions: int, rel_tol: float, trace: Any, plan: Any,
            digest: float) -> Any:
    from latency_specialized.testing.matrix import CellResult

    raw, agree, decisive = counts
    s = trace.summary()
    return CellResult(max_abs_err=err, tolerance=rel_tol * scale,
                      top1_agreement=agree / decisive if decisive else 0.0, decisive=decisive / positions,
                      top1_raw=raw / positions, fast_steps=s["fast_steps"], stock_steps=s["stock_steps"],
                      steps=STEPS, impls={c.site.name: c.impl.name for c in plan.choices if c.impl is not None},
                      logits_digest=digest)


def _verify_spec(cell: Any, ref: Any, states: Any, positions: list[int], toks: torch.Tensor, buffers: Any,
                 runner: Any, program: Any, plan: Any, trace: Any, comm: Any, rel_tol: float) -> Any:
    """``STEPS`` verification steps of ``cell.spec_tokens`` drafts (the module docstring)."""
    from latency_specialized.runtime.gate import StepState

    B, k = cell.batch, cell.spec_tokens
    T = 1 + k
    world = comm.world_size if comm is not None else 1
    rank = comm.rank if comm is not None else 0
    mine = [b for b in range(B) if b % world == rank]
    rows = [s.row for s in states.slots]
    g = torch.Generator().manual_seed(B + 7 * k)
    err, scale, counts, digest = 0.0, 0.0, [0, 0, 0], 0.0
    accepted: list[int] | None = None
    for step in range(STEPS):
        drafts = torch.randint(3, ref.spec.vocab_size, (B, k), generator=g).to(toks.device)
        buffers.load(toks, positions, rows, states.block_table(device="cpu"))
        buffers.set_drafts(drafts)
        if accepted is not None:
            buffers.set_accepted(accepted)
        got = runner.run(StepState(num_seqs=B, spec_tokens=k)).outputs["logits"]     # [B, T, vocab]
        accepted = [(b + step) % T for b in range(B)]
        if mine:
            seq = torch.cat([toks.view(B, 1), drafts], 1)
            slots = [states.slots[b] for b in mine]
            snaps, want = [], []
            for t in range(T):
                want.append(ref.decode(states, slots, [positions[b] + t for b in mine], seq[mine, t]))
                snaps.append(states.clone(paged=False))   # later KV slots are written again before any read
            want_t = torch.stack(want, 1)
            err = max(err, (got[mine].double() - want_t.double()).abs().max().item())
            scale = max(scale, want_t.abs().max().item())
            counts = [c + n for c, n in zip(counts, decisive_agreement(got[mine], want_t, rel_tol))]
            for b in mine:  # the reference back at the accepted prefix (its per-row states and history)
                states.copy_sequence(states.slots[b], snaps[accepted[b]], states.slots[b],
                                     positions[b] + accepted[b] + 1, paged=False)
        digest += float(got.double().sum())
        # the program's greedy token after each accepted prefix (identical on every rank) feeds the next step
        toks = got[torch.arange(B), torch.tensor(accepted)].argmax(-1)
        positions = [p + j + 1 for p, j in zip(positions, accepted)]
    err, scale, counts = _combine(comm, err, scale, counts)
    program.close()
    return _result(err, scale, counts, STEPS * B * T, rel_tol, trace, plan, digest)


__all__ = ["verify_cell", "decisive_agreement", "prototypes", "long_reference", "batch_states", "STEPS", "PROTOTYPES", "REL_TOL"]
