"""Lamport one-shot / two-stage protocols emulated in torch by W CPU processes (gloo, /dev/shm),
and TP-split MoE routing across the same processes.

The emulation follows the kernels' protocol word for word (layout, slot rotation, sentinel,
-0.0 rewrite, dirty-extent clearing, rank-order sums). One world per size runs every check
(``comm_worlds.all_checks``), processes start from a fork server with torch preloaded (one
world also runs under plain spawn).
"""

from __future__ import annotations

import functools

import pytest

from latency_specialized.comm.worlds import WorldError, run_world

import comm_worlds as cw

WORLD_SIZES = (2, 4, 8)
PRELOAD = ("latency_specialized.ops.allreduce", "latency_specialized.ops.tp_moe")
"""Op modules the world bodies use: imported once by the fork server (comm's own list names none)."""


@functools.cache
def world(world_size: int) -> list[dict]:
    return run_world(cw.all_checks, world_size, 17 + world_size, timeout=240, preload=PRELOAD)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_emulated_protocol_matches_reference(world_size):
    for (dtype, n), _ in world(world_size)[0]["emulation"].items():
        calls = dict(((d, nn), c) for d, nn, c in cw.EMULATION_CASES[world_size])[(dtype, n)]
        algos = set()
        for rank, per_rank in enumerate(world(world_size)):
            r = per_rank["emulation"][(dtype, n)]
            # every call was compared with the torch.distributed reference inside the rank
            assert r["checked"] == calls and r["calls"] == calls, (rank, dtype, n, r)
            assert r["identical"], f"rank {rank} {dtype} N={n}: outputs differ between ranks"
            assert r["clean"], f"rank {rank} {dtype} N={n}: the slot after next held data between calls"
            algos |= r["algos"]
        assert algos == {"one_shot", "two_stage"}, f"{dtype} N={n}: the call plan missed an algorithm"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_missing_peer_times_out_instead_of_hanging(world_size):
    got = [r["missing_peer"] for r in world(world_size)]
    assert got == ["timeout"] * (world_size - 1) + ["skipped"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tp_split_routing_equals_replicated(world_size):
    for case in cw.TP_MOE_CASES:
        M, E, K, L, top_k = case
        for rank, per_rank in enumerate(world(world_size)):
            r = per_rank["tp_moe"][case]
            assert r["ids_equal"], f"rank {rank} {case}: selection differs from the replicated router"
            assert r["weights_err"] < 1e-6, (rank, case, r)
            assert r["latent_equal"], (rank, case, r["latent_err"])
            assert r["ids_same_on_ranks"] and r["latent_same_on_ranks"]
            # no duplicated weight loads: each rank holds exactly its 1/W of both projections
            assert r["router_rows_loaded"] == E // world_size and r["latent_rows_loaded"] == L // world_size


def test_spawn_start_method_works():
    # the default start method is forkserver (torch preloaded); plain spawn must work the same way
    results = run_world(cw.emulation_world, 2, "bfloat16", 64, 4, 3, timeout=120, start_method="spawn")
    assert all(r["checked"] == 4 and r["identical"] and r["clean"] for r in results)


def test_failing_rank_fails_the_world():
    with pytest.raises(WorldError, match="rank 0 raised"):
        run_world(_raise_on_rank0, 2, timeout=60, preload=PRELOAD)


def _raise_on_rank0(rank, world_size):
    if rank == 0:
        raise ValueError("boom")
    return rank
