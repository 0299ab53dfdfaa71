"""One cell of the cross-model test matrix for Kimi K3: program vs reference on this rank.

The tiny model (fp32, fixed seed) prefills four prototype sequences of different lengths around
the cell's context with the reference (memoised per process: gloo workers serve many cells);
a batch of B sequences copies their states (sequence b from prototype b % 4) into a cache with
shuffled pages. Then ``STEPS`` decode steps run the program (this rank's shard, through the runtime
runner; TP ranks all-reduce over ``comm``) and the reference (whole model, per sequence; each rank
checks every TP-th sequence), both fed the program's greedy tokens.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from latency_specialized.errors import UserError

STEPS = 2
PROTOTYPES = 4
REL_TOL = 5e-5
"""fp32 bound on max|program - reference| relative to max|reference logits| (measured <= 1e-5)."""


@functools.lru_cache(maxsize=4)
def _prototypes(context: int, device: str, seed: int = 1234):
    """(reference, cache, lengths): PROTOTYPES sequences of lengths context, context-1, context-3, ... prefilled."""
    from latency_specialized_models.kimi_k3.reference import KimiK3Reference
    from latency_specialized_models.kimi_k3.spec import tiny_spec
    from latency_specialized_models.kimi_k3.weights import random_weights

    spec = tiny_spec()
    ref = KimiK3Reference(spec, random_weights(spec, seed=seed, dtype=torch.float32, device=device))
    lens = [max(1, context - k * (k + 1) // 2) for k in range(PROTOTYPES)]
    cache = ref.new_cache(PROTOTYPES, context, block_size=4)
    g = torch.Generator().manual_seed(seed + context)
    for slot, n in zip(cache.slots, lens):
        ref.prefill(cache, slot, 0, torch.randint(3, spec.vocab_size, (n,), generator=g))
    return ref, cache, lens


def _batch_cache(ref: Any, proto: Any, lens: list[int], batch: int, max_len: int, seed: int):
    cache = ref.new_cache(batch, max_len, block_size=proto.block_size, shuffle_seed=seed)
    bs = proto.block_size
    for b, slot in enumerate(cache.slots):
        p = proto.slots[b % PROTOTYPES]
        for i in cache.conv:
            cache.conv[i][slot.row] = proto.conv[i][p.row]
            cache.state[i][slot.row] = proto.state[i][p.row]
        for i in cache.kv:
            for k in range(-(-lens[b % PROTOTYPES] // bs)):
                cache.kv[i][slot.blocks[k]] = proto.kv[i][p.blocks[k]]
    return cache


def verify_cell(adapter: Any, cell: Any, comm: Any = None) -> Any:
    """Run ``cell`` (a testing.matrix.Cell) on this rank; returns a testing.matrix.CellResult.

    On the CPU torch runs single-threaded for the call (restored after): the tiny model's ops are
    far too small to gain from threads, and oversubscribed threads slow them down ~50x.
    """
    threads = torch.get_num_threads()
    if cell.device != "cuda":
        torch.set_num_threads(1)
    try:
        return _verify(adapter, cell, comm)
    finally:
        torch.set_num_threads(threads)


def _verify(adapter: Any, cell: Any, comm: Any) -> Any:
    from latency_specialized import hardware
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
    from latency_specialized.runtime.gate import DecodeGate, StepState
    from latency_specialized.runtime.graph_runner import CUDAGraphRunner
    from latency_specialized.testing.matrix import CellResult
    from latency_specialized.trace import Trace

    from latency_specialized_models.kimi_k3.program import KimiK3Program
    from latency_specialized_models.kimi_k3.tp import shard_cache

    if cell.spec_tokens:
        raise UserError(f"{cell.id}: the Kimi K3 program does not verify speculative tokens yet (spec_tokens=0)")
    world = comm.world_size if comm is not None else 1
    if world != cell.tp:
        raise UserError(f"{cell.id}: needs {cell.tp} ranks, got a communicator of {world}")
    rank = comm.rank if comm is not None else 0
    device = "cuda" if cell.device == "cuda" else "cpu"
    ref, proto, lens = _prototypes(cell.context, device)
    spec = ref.spec
    B = cell.batch
    cache = _batch_cache(ref, proto, lens, B, cell.context + STEPS, seed=B)
    positions = [lens[b % PROTOTYPES] for b in range(B)]
    reg = get_registry()
    hw = hardware.probe() if device == "cuda" else hardware.for_arch("cpu")
    plan = build_plan(adapter, reg.implementations, hw, tp=cell.tp, batch=B, dtype="float32", variant="tiny")
    trace = Trace()
    program = KimiK3Program(spec, ref.w, plan, shard_cache(spec, cache, rank, cell.tp), trace=trace, comm=comm)
    buffers = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(cache.slots[0].blocks),
                                       block_size=cache.block_size, pad_state=0), device)
    toks = torch.randint(3, spec.vocab_size, (B,), generator=torch.Generator().manual_seed(B)).to(device)
    buffers.load(toks, positions, [s.row for s in cache.slots], cache.block_table(device="cpu"))
    runner = CUDAGraphRunner(program, buffers, trace=trace, use_graphs=False, feed_back_tokens=False,
                             gate=DecodeGate(max_batch=plan.bucket, buckets=(plan.bucket,)))
    # The reference work is split over the ranks (rank r checks sequences r, r + TP, ...); the
    # statistics are then combined, so every rank reports the whole batch.
    mine = [b for b in range(B) if b % world == rank]
    err, scale, agree, digest = 0.0, 0.0, 0, 0.0
    for _ in range(STEPS):
        got = runner.run(StepState(num_seqs=B), tokens=toks).outputs["logits"]
        if mine:
            want = ref.decode(cache, [cache.slots[b] for b in mine], [positions[b] for b in mine], toks[mine])
            err = max(err, (got[mine].double() - want.double()).abs().max().item())
            scale = max(scale, want.abs().max().item())
            agree += int((got[mine].argmax(-1) == want.argmax(-1)).sum())
        digest += float(got.double().sum())
        toks = got.argmax(-1)   # the program's greedy tokens (identical on every rank) feed both next step
        positions = [p + 1 for p in positions]
    if world > 1:
        stats = comm.all_gather(torch.tensor([[err, scale]], dtype=torch.float64), dim=0)
        err, scale = stats[:, 0].max().item(), stats[:, 1].max().item()
        agree = int(comm.all_reduce(torch.tensor([float(agree)], dtype=torch.float64)).item())
    program.close()  # the symmetric-memory workspaces it built (collective; the pool's ranks serve many cells)
    s = trace.summary()
    return CellResult(max_abs_err=err, tolerance=REL_TOL * scale, top1_agreement=agree / (STEPS * B),
                      fast_steps=s["fast_steps"], stock_steps=s["stock_steps"], steps=STEPS,
                      impls={c.site.name: c.impl.name for c in plan.choices if c.impl is not None},
                      logits_digest=digest)
