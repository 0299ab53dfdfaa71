"""Both Kimi K3 decode programs side by side (today's KimiK3Program, the composed program over the pieces).

Module level so that spawned TP ranks can import it (``comm.worlds.run_world``). :func:`compare`
runs both programs from one prefilled cache (each on its own copy: this rank's shard), feeding
both the same teacher-forced tokens through the runtime runner, and reports per step whether the
logits, next tokens and every state tensor are bit-identical (and the largest difference).
"""

from __future__ import annotations

from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _runner(program, plan, cache, device="cpu"):
    from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
    from latency_specialized.runtime.gate import DecodeGate
    from latency_specialized.runtime.graph_runner import CUDAGraphRunner

    buffers = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(cache.slots[0].blocks),
                                       block_size=cache.block_size, pad_state=0), device)
    return buffers, CUDAGraphRunner(program, buffers, use_graphs=False, feed_back_tokens=False,
                                    gate=DecodeGate(max_batch=plan.bucket, buckets=(plan.bucket,)))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def compare(lens: list[int], steps: int, seed: int, dtype: str = "float32", *, comm: Any = None,
            registry: Any = None, excluded_tp: int | None = None) -> dict[str, Any]:
    """Run both programs ``steps`` decode steps over sequences prefilled to ``lens``; see the module docstring.

    ``excluded_tp``: the one-GPU bench's setting instead - rank 0 of a TP group with communication left out
    (an ExcludedCommunicator per program, seeded alike) and weights given as the rank's shard by official
    name (``weights_sharded=True``)."""
    from latency_specialized import hardware
    from latency_specialized.comm.base import ExcludedCommunicator
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime.gate import StepState

    from latency_specialized_models.kimi_k3.composed import composed_program
    from latency_specialized_models.kimi_k3.program import KimiK3Program
    from latency_specialized_models.kimi_k3.reference import KimiK3Reference
    from latency_specialized_models.kimi_k3.spec import tiny_spec
    from latency_specialized_models.kimi_k3.tp import shard_cache, shard_weights
    from latency_specialized_models.kimi_k3.weights import random_weights

    comms = [comm, comm] if excluded_tp is None else [ExcludedCommunicator(excluded_tp) for _ in range(2)]
    tp = comms[0].world_size if comms[0] is not None else 1
    rank = comms[0].rank if comms[0] is not None else 0
    g = torch.Generator().manual_seed(seed)
    spec = tiny_spec()
    w = random_weights(spec, seed=seed, dtype=DTYPES[dtype])
    ref = KimiK3Reference(spec, w)
    B = len(lens)
    cache = ref.new_cache(B, max(lens) + steps, block_size=4, shuffle_seed=seed)
    for b, n in enumerate(lens):
        ref.prefill(cache, cache.slots[b], 0, torch.randint(3, spec.vocab_size, (n,), generator=g))
    reg = get_registry()
    plan = build_plan(reg.adapter("kimi_k3"), registry or reg.implementations, hardware.for_arch("cpu"), tp=tp,
                      batch=B, dtype=dtype, variant="tiny", **({"comm": comms[0]} if comms[0] is not None else {}))
    old_cache, new_cache = shard_cache(spec, cache, rank, tp), shard_cache(spec, cache, rank, tp)
    sharded = excluded_tp is not None
    pw = shard_weights(spec, w, rank, tp) if sharded else w
    old = KimiK3Program(spec, pw, plan, old_cache, comm=comms[0], weights_sharded=sharded)
    new = composed_program(spec, pw, plan, new_cache, comm=comms[1], weights_sharded=sharded)
    runs = []
    for program, c in ((old, old_cache), (new, new_cache)):
        buffers, runner = _runner(program, plan, c)
        buffers.load([0] * B, lens, [s.row for s in c.slots], c.block_table())
        runs.append(runner)
    report: dict[str, Any] = {"steps": [], "old_calls": dict(old.calls), "new_calls": None}
    for _ in range(steps):
        toks = torch.randint(3, spec.vocab_size, (B,), generator=g)
        outs = [r.run(StepState(num_seqs=B), tokens=toks) for r in runs]
        assert all(o.fast for o in outs)
        lo, ln = outs[0].outputs["logits"], outs[1].outputs["logits"]
        states = list(zip(old_cache.tensors(), new_cache.tensors()))
        report["steps"].append({
            "logits_equal": torch.equal(lo, ln), "logits_max_diff": _max_diff(lo, ln),
            "next_equal": torch.equal(outs[0].outputs["next_tokens"], outs[1].outputs["next_tokens"]),
            "states_equal": all(torch.equal(a, b) for a, b in states),
            "states_max_diff": max(_max_diff(a.float(), b.float()) for a, b in states),
            # the composed program's states are the cache's own tensors (updated in place, not copies)
            "same_state_objects": sorted(t.data_ptr() for t in new.state_tensors())
                                  == sorted(t.data_ptr() for t in new_cache.tensors()),
            "logits_finite": bool(torch.isfinite(ln).all()),
        })
    report["old_calls"], report["new_calls"] = dict(old.calls), dict(new.calls)
    report["programs"] = (type(old).__name__, type(new).__name__)
    report["sites"] = [c.site.name for c in plan.choices]
    report["skipped"] = sorted(plan.skipped_sites())
    old.close()
    new.close()
    return report


def tp_body(rank: int, world: int, lens: list[int], steps: int, seed: int, dtype: str) -> dict[str, Any]:
    """One rank of a gloo world (``comm.worlds.run_world``): :func:`compare` over a torch.distributed group."""
    from latency_specialized.comm import TorchDistributedCommunicator

    return compare(lens, steps, seed, dtype, comm=TorchDistributedCommunicator())
