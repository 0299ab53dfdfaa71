"""Per-rank bodies of the multi-process comm tests (module level: spawned processes import them).

Each body runs inside ``latency_specialized.comm.worlds.run_world`` (gloo group initialised) and
returns plain data that the test asserts on in the parent. Inputs are fresh random values with
injected -0.0 and subnormals; residual and weight are identical on every rank (seeded alike),
partials differ per rank.
"""

from __future__ import annotations

import random
import time

import torch

from latency_specialized.comm import layout as L

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
TOL = {"bfloat16": dict(rtol=1.6e-2, atol=1e-2), "float32": dict(rtol=1e-5, atol=1e-5)}


def spiky(shape, dtype: torch.dtype, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """Random normal values with -0.0, +0.0, and +/- subnormals sprinkled in (about 3% each)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    u = torch.rand(shape, generator=gen)
    tiny = 1e-39 if dtype == torch.bfloat16 else 1e-41  # subnormal in both bf16 and fp32
    x = torch.where(u < 0.03, torch.full_like(x, -0.0), x)
    x = torch.where((u >= 0.03) & (u < 0.06), torch.full_like(x, tiny), x)
    x = torch.where((u >= 0.06) & (u < 0.09), torch.full_like(x, -tiny), x)
    return x.to(dtype).to(device)


def make_call(seed: int, rank: int, M: int, N: int, dtype: torch.dtype, device="cpu"):
    """(partial for this rank, residual, weight) of one call; residual/weight equal on all ranks."""
    shared = torch.Generator().manual_seed(seed)
    mine = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    residual = spiky((M, N), dtype, shared, device)
    weight = (1.0 + 0.1 * torch.randn(N, generator=shared)).to(dtype).to(device)
    partial = spiky((M, N), dtype, mine, device)
    return partial, residual, weight


def check_close(got: torch.Tensor, want: torch.Tensor, dtype: str, what: str) -> float:
    """assert |got - want| <= atol + rtol |want| elementwise (no NaN); returns the max abs error.

    (Not torch.testing.assert_close: it imports torch.distributed.tensor lazily, ~4 s per process.)
    """
    tol = TOL[dtype]
    g, w = got.float(), want.float()
    assert g.shape == w.shape, f"{what}: shape {tuple(g.shape)} != {tuple(w.shape)}"
    assert not torch.isnan(g).any(), f"{what}: NaN in the result"
    err = (g - w).abs()
    bad = err > tol["atol"] + tol["rtol"] * w.abs()
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, max error {err.max().item():.3g}"
    return err.max().item()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def same_on_all_ranks(t: torch.Tensor) -> bool:
    """True when ``t`` has the same bits on every rank (gathered over the gloo group)."""
    import torch.distributed as dist

    b = bits(t.cpu()).to(torch.int32)  # gloo has no int16
    parts = [torch.empty_like(b) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, b)
    return all(torch.equal(parts[0], p) for p in parts)


def next_slot_clean(comm) -> bool:
    """Protocol invariant between calls: the slot of the call after next is entirely sentinel.

    (It was cleared by the call just finished, and no peer may store into it before this rank
    has started the next call.)
    """
    call = int(comm.flags[L.FLAG_CALL])
    slot = (call + 1) % L.SLOTS
    area = comm.buffer[slot * comm.slot_words:(slot + 1) * comm.slot_words]
    return bool((area == L.SENTINEL_WORD[comm.dtype]).all())


def emulation_world(rank: int, world_size: int, dtype: str, n: int, calls: int, seed: int) -> dict:
    """Random sequence of emulated one-shot / two-stage calls vs the torch.distributed reference."""
    from latency_specialized.comm import emulation
    from latency_specialized.comm.base import TorchDistributedCommunicator
    from latency_specialized.comm.symmetric import SymmetricMemoryCommunicator
    from latency_specialized.ops.allreduce import allreduce_residual_rmsnorm_reference as reference

    max_tokens = 8
    comm = SymmetricMemoryCommunicator(None, hidden=n, dtype=dtype, max_tokens=max_tokens, device="cpu")
    ref_comm = TorchDistributedCommunicator()
    plan = random.Random(seed)  # same on every rank: same algorithm and M sequence
    jitter = random.Random(seed * 7 + rank)  # per rank: ranks drift apart in time
    out = {"checked": 0, "max_err_h": 0.0, "max_err_y": 0.0, "identical": True, "clean": True, "algos": set(),
           "zero_centered": 0, "no_norm": 0}
    torch_dtype = DTYPES[dtype]
    for i in range(calls):
        M = plan.randint(1, max_tokens)
        algo = plan.choice(["one_shot", "two_stage"])
        zc = plan.random() < 0.2
        with_norm = plan.random() > 0.1
        partial, residual, weight = make_call(seed * 100 + i, rank, M, n, torch_dtype)
        w = weight if with_norm else None
        if jitter.random() < 0.3:
            time.sleep(jitter.random() * 0.01)
        fn = emulation.lamport_one_shot if algo == "one_shot" else emulation.two_stage
        y, h = fn(partial, residual, w, 1e-5, comm=comm, zero_centered=zc, timeout=60.0)
        y_ref, h_ref = reference(partial, residual, w, 1e-5, comm=ref_comm, zero_centered=zc)
        err = check_close(h, h_ref, dtype, f"call {i} {algo} M={M} residual_out")
        out["max_err_h"] = max(out["max_err_h"], err)
        if with_norm:
            err = check_close(y, y_ref, dtype, f"call {i} {algo} M={M} normed")
            out["max_err_y"] = max(out["max_err_y"], err)
            out["identical"] &= same_on_all_ranks(y)
        else:
            out["no_norm"] += 1
        out["zero_centered"] += zc
        out["identical"] &= same_on_all_ranks(h)
        out["clean"] &= next_slot_clean(comm)
        out["algos"].add(algo)
        out["checked"] += 1
    out["calls"] = int(comm.flags[L.FLAG_CALL])
    comm.destroy()
    return out


def missing_peer_world(rank: int, world_size: int) -> str:
    """The last rank never joins the call: every other rank must time out (LamportTimeout), not hang."""
    from latency_specialized.comm import emulation
    from latency_specialized.comm.symmetric import SymmetricMemoryCommunicator

    comm = SymmetricMemoryCommunicator(None, hidden=64, dtype="bfloat16", max_tokens=2, device="cpu")
    partial, residual, weight = make_call(5, rank, 2, 64, torch.bfloat16)
    result = "skipped"
    if rank != world_size - 1:
        try:
            emulation.lamport_one_shot(partial, residual, weight, 1e-5, comm=comm, timeout=1.5)
            result = "returned"
        except emulation.LamportTimeout:
            result = "timeout"
    comm.destroy()
    return result


EMULATION_CASES = {
    2: [("bfloat16", 64, 60), ("float32", 48, 30)],
    4: [("bfloat16", 72, 40), ("float32", 48, 20)],  # 9 bf16 vectors over 4 ranks: uneven chunks, one empty
    8: [("bfloat16", 64, 24), ("float32", 32, 12)],  # fp32 N=32: 8 vectors, one per rank
}
TP_MOE_CASES = [(1, 64, 96, 32, 6), (5, 64, 96, 32, 6), (64, 128, 64, 64, 8)]  # (M, E, K, L, top_k)


def all_checks(rank: int, world_size: int, seed: int) -> dict:
    """Everything the CPU comm tests assert, in one world per size (spawning costs ~3 s per process)."""
    out = {"emulation": {}, "tp_moe": {}}
    for dtype, n, calls in EMULATION_CASES[world_size]:
        out["emulation"][(dtype, n)] = emulation_world(rank, world_size, dtype, n, calls, seed + n)
    for case in TP_MOE_CASES:
        out["tp_moe"][case] = tp_moe_world(rank, world_size, *case, seed=seed + case[0])
    out["missing_peer"] = missing_peer_world(rank, world_size)
    return out


def tp_moe_world(rank: int, world_size: int, M: int, E: int, K: int, L_: int, top_k: int, seed: int) -> dict:
    """TP-split routing + latent projection vs the replicated computation on every rank."""
    from latency_specialized.comm.base import TorchDistributedCommunicator
    from latency_specialized.ops.gemm import gemm_reference
    from latency_specialized.ops.moe import route_reference
    from latency_specialized.ops.tp_moe import router_logits, shard_rows, tp_route
    from latency_specialized.spec import RouterSpec

    g = torch.Generator().manual_seed(seed)  # the same full weights and inputs on every rank
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w_router = (torch.randn(E, K, generator=g) * K ** -0.5).to(torch.bfloat16)
    bias = torch.randn(E, generator=g) * 0.1
    w_latent = (torch.randn(L_, K, generator=g) * K ** -0.5).to(torch.bfloat16)
    router = RouterSpec(score_func="sigmoid", bias_corrected=True, renormalize=True, routed_scaling=2.5)
    comm = TorchDistributedCommunicator()
    weights, ids, latent = tp_route(x, shard_rows(w_router, rank, world_size), bias, top_k, router, comm=comm,
                                    latent_shard=shard_rows(w_latent, rank, world_size))
    ref_w, ref_ids = route_reference(router_logits(x, w_router, True), bias, top_k, router)
    ref_latent = gemm_reference(x, w_latent)
    return {
        "ids_equal": bool(torch.equal(ids, ref_ids)),
        "weights_err": (weights - ref_w).abs().max().item(),
        "latent_equal": bool(torch.equal(latent, ref_latent)),
        "latent_err": (latent.float() - ref_latent.float()).abs().max().item(),
        "ids_same_on_ranks": same_on_all_ranks(ids.to(torch.int32)),
        "latent_same_on_ranks": same_on_all_ranks(latent),
        "router_rows_loaded": shard_rows(w_router, rank, world_size).shape[0],
        "latent_rows_loaded": shard_rows(w_latent, rank, world_size).shape[0],
    }
