"""TP-split MoE routing helpers in one process (the multi-process runs are in test_comm_emulation)."""

from __future__ import annotations

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops import tp_moe
from latency_specialized.ops.moe import route_reference
from latency_specialized.spec import RouterSpec


def test_pack_unpack_moves_bits_exactly_in_rank_order():
    g = torch.Generator().manual_seed(0)
    W, M = 4, 3
    ranks = [(torch.randn(M, 5, generator=g), torch.randn(M, 6, generator=g).to(torch.bfloat16)) for _ in range(W)]
    gathered = torch.cat([tp_moe._pack(list(parts)) for parts in ranks], dim=-1)  # what all_gather(dim=-1) returns
    logits, latent = tp_moe._unpack(gathered, W, [(5, torch.float32), (6, torch.bfloat16)])
    assert torch.equal(logits, torch.cat([r[0] for r in ranks], -1))
    assert torch.equal(latent, torch.cat([r[1] for r in ranks], -1))


def test_world_of_one_equals_replicated():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32, generator=g).to(torch.bfloat16)
    w = torch.randn(16, 32, generator=g).to(torch.bfloat16)
    lat = torch.randn(8, 32, generator=g).to(torch.bfloat16)
    bias = torch.randn(16, generator=g)
    router = RouterSpec(score_func="sqrtsoftplus", routed_scaling=1.5)
    weights, ids, latent = tp_moe.tp_route(x, w, bias, 4, router, latent_shard=lat)
    ref_w, ref_ids = route_reference(tp_moe.router_logits(x, w), bias, 4, router)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)
    assert latent.shape == (4, 8) and latent.dtype == torch.bfloat16


def test_errors_name_the_fix():
    with pytest.raises(UserError, match="not divisible by TP=3"):
        tp_moe.shard_rows(torch.zeros(896, 4), 0, 3, "router")
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(UserError, match="pass the full"):
        tp_moe.tp_route(x, w, torch.zeros(3), 2, RouterSpec(score_func="sigmoid"))


def test_shards_partition_the_rows():
    w = torch.arange(896 * 2).reshape(896, 2)
    parts = [tp_moe.shard_rows(w, r, 8) for r in range(8)]
    assert all(p.shape == (112, 2) for p in parts) and torch.equal(torch.cat(parts), w)


# ------------------------------------------------------------------ bench communicator, gather_parts
def test_excluded_communicator_gathers_rank_slice_into_static_buffer_with_stand_ins():
    from latency_specialized.comm.base import ExcludedCommunicator
    from latency_specialized.ops.tp_moe import gather_parts

    comm = ExcludedCommunicator(4, rank=1, seed=3)
    x = torch.randn(3, 5)
    assert comm.all_reduce(x) is x  # other ranks' partials are left out
    logits, latent = torch.randn(3, 6), torch.randn(3, 8).bfloat16()
    full_l, full_x = gather_parts(comm, [logits, latent])
    assert full_l.shape == (3, 24) and full_l.dtype == torch.float32
    assert full_x.shape == (3, 32) and full_x.dtype == torch.bfloat16
    assert torch.equal(full_l[:, 6:12], logits) and torch.equal(full_x[:, 8:16], latent)
    stand_in = full_l[:, :6].clone()
    assert torch.isfinite(stand_in).all() and stand_in.abs().sum() > 0  # random stand-ins, not zeros
    again, _ = gather_parts(comm, [logits * 2, latent])
    assert again.data_ptr() == full_l.data_ptr()  # static: capturable in a CUDA graph
    assert torch.equal(again[:, 6:12], logits * 2) and torch.equal(again[:, :6], stand_in)
    with pytest.raises(ValueError, match="rank 4 of a world of 4"):
        ExcludedCommunicator(4, rank=4)


def test_gather_parts_packs_mixed_dtypes_bit_exactly_over_one_all_gather():
    from latency_specialized.ops.tp_moe import _pack, gather_parts

    logits = torch.tensor([[-0.0, 1.5, float("inf")], [2.0, -3.0, 0.25]])
    latent = torch.tensor([[3.0, -2.0], [0.5, 7.0]]).bfloat16()
    peer_logits, peer_latent = logits * 10 + 1, latent * 4  # rank 1's slices: distinguishable

    class RankZeroOfTwo:
        name, rank, world_size = "fake", 0, 2
        calls = 0

        def all_gather(self, t, dim=-1):
            RankZeroOfTwo.calls += 1
            return torch.cat([t, _pack([peer_logits, peer_latent])], dim=-1)  # rank order: 0, 1

    full_l, full_x = gather_parts(RankZeroOfTwo(), [logits, latent])
    assert RankZeroOfTwo.calls == 1  # both parts in one collective
    assert torch.equal(full_l.view(torch.int32), torch.cat([logits, peer_logits], -1).view(torch.int32))  # -0.0 kept
    assert torch.equal(full_x, torch.cat([latent, peer_latent], -1))


def test_excluded_communicator_gather_slot_lets_the_producer_write_in_place():
    """A producer writing into gather_slot()'s slice: all_gather of that slice returns the buffer and
    launches no copy (the values are already there); any other tensor is still copied in."""
    from latency_specialized.comm.base import ExcludedCommunicator
    from latency_specialized.ops.tp_moe import gather_parts

    comm = ExcludedCommunicator(4, rank=2, seed=5)
    buf, mine = comm.gather_slot((3, 6), torch.float32, "cpu")
    assert buf.shape == (3, 24) and mine.data_ptr() == buf[:, 12:18].data_ptr() and mine.stride() == (24, 1)
    stand_in = buf[:, :12].clone()
    torch.manual_seed(0)
    torch.mm(torch.randn(3, 4), torch.randn(4, 6), out=mine)   # the producer writes its slice in place
    written = mine.clone()
    full, = gather_parts(comm, [mine])
    assert full.data_ptr() == buf.data_ptr() and torch.equal(full[:, 12:18], written)
    assert torch.equal(full[:, :12], stand_in)
    # the same buffer serves a producer that returns its own tensor (copied in, as before)
    other = torch.randn(3, 6)
    full2, = gather_parts(comm, [other])
    assert full2.data_ptr() == buf.data_ptr() and torch.equal(full2[:, 12:18], other)
