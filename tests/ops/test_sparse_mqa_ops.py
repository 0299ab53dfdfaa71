"""Sparse MQA glue ops (``ops/attention/sparse_mqa.py``) against plain references, fresh random inputs and odd
shapes: the sync-free ``attention.sparse`` implementation vs ``sparse_decode_reference`` (sinks, -1 slots, rows with
nothing selected), slot writes / gathers through shuffled block tables (-1: no write), softmax-gated pooling, and
the piece's RoPE helpers (inverse rotation, rope-leading layout) and refusals."""

from __future__ import annotations

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.attention.sparse import sparse_decode_reference
from latency_specialized.ops.attention.sparse_mqa import (gather_slots, pool_softmax, slot_of, sparse_decode_masked,
                                                          write_slots)
from latency_specialized.pieces.attention.rope import rope_inv_freq
from latency_specialized.pieces.attention.sparse_mqa import SparseMQAAttention, rope_leading, rope_tail
from latency_specialized.pieces.standard import MissingPiece, standard_attention
from latency_specialized.spec import IndexerSpec, SparseMQAAttentionSpec


@pytest.mark.parametrize("seed,B,H,T,D,k,sinks", [(0, 3, 5, 11, 24, 7, True), (1, 1, 2, 5, 9, 5, False),
                                                  (2, 6, 7, 19, 40, 13, True)])
def test_masked_sparse_attention_equals_the_reference(seed, B, H, T, D, k, sinks):
    g = torch.Generator().manual_seed(seed)
    q, kv = torch.randn(B, H, D, generator=g), torch.randn(B, T, D, generator=g)
    idx = torch.stack([torch.randperm(T, generator=g)[:k] for _ in range(B)])
    idx = torch.where(torch.rand(B, k, generator=g) < 0.3, -1, idx)
    idx[0] = -1                                                  # a row with nothing selected (padding)
    s = torch.randn(H, generator=g) if sinks else None
    want = sparse_decode_reference(q, kv, idx, scale=D ** -0.5, v_dim=D - 3, sinks=s)
    got = torch.full_like(want, float("nan"))
    got.copy_(sparse_decode_masked(q, kv, idx, scale=D ** -0.5, v_dim=D - 3, sinks=s))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got[0].abs().max() == 0


def test_slot_writes_and_gathers_through_a_shuffled_block_table():
    g = torch.Generator().manual_seed(3)
    blocks, bs, D, B = 13, 3, 5, 4
    cache = torch.full((blocks, bs, D), float("nan"))
    bt = torch.randperm(blocks, generator=g)[:B * 3].view(B, 3).int()
    index = torch.tensor([0, 4, 8, 2])
    live = torch.tensor([True, False, True, True])
    slots = slot_of(bt, index, bs, live)
    assert slots[1] == -1 and slots[2] == bt[2, 2] * bs + 2
    vals = torch.randn(B, D, generator=g)
    write_slots(cache, vals, slots)
    got = gather_slots(cache, bt, index.view(B, 1))[:, 0]
    torch.testing.assert_close(got[live], vals[live])
    assert int(cache.isnan().all(-1).sum()) == blocks * bs - 3      # the -1 row wrote nothing
    write_slots(cache, vals, torch.full((B,), -1))                  # no live row: nothing changes
    assert int(cache.isnan().all(-1).sum()) == blocks * bs - 3


@pytest.mark.parametrize("r", [2, 3])
def test_softmax_gated_pooling(r):
    g = torch.Generator().manual_seed(r)
    v, gate = torch.randn(5, r, 7, generator=g), torch.randn(5, r, 7, generator=g) * 3
    w = gate.exp() / gate.exp().sum(1, keepdim=True)
    torch.testing.assert_close(pool_softmax(v, gate), (w * v).sum(1))


def test_rope_tail_inverts_and_rope_leading_moves_the_tail_first():
    g = torch.Generator().manual_seed(4)
    x, pos, inv = torch.randn(3, 2, 12, generator=g), torch.tensor([0, 5, 77]), rope_inv_freq(1e4, 6)
    y = rope_tail(x, pos, inv)
    assert torch.equal(y[..., :6], x[..., :6]) and not torch.allclose(y[..., 6:], x[..., 6:])
    torch.testing.assert_close(rope_tail(y, pos, inv, sign=-1.0), x, rtol=1e-5, atol=1e-5)
    assert torch.equal(rope_leading(x, 6)[..., :6], x[..., 6:])


def _spec(ratio: int, indexer: bool = False) -> SparseMQAAttentionSpec:
    ix = IndexerSpec(num_heads=2, head_dim=8, topk=4) if indexer else None
    return SparseMQAAttentionSpec(num_heads=4, head_dim=16, rope_dim=4, q_lora_rank=8, o_groups=2, o_lora_rank=4,
                                  sliding_window=4, compress_ratio=ratio, indexer=ix)


def test_piece_refuses_inconsistent_options():
    with pytest.raises(UserError, match="window-only"):
        SparseMQAAttention(_spec(0), kv_source=True)
    with pytest.raises(UserError, match="topk >= 1"):
        SparseMQAAttention(_spec(2))
    with pytest.raises(UserError, match="indexer's topk"):
        SparseMQAAttention(_spec(1, indexer=True), topk=3)
    p = SparseMQAAttention(_spec(2, indexer=True), topk=4, kv_source=True)
    assert p.index_keys and {d.name for d in p.states(None, 1)} == {"window", "compressed", "pending", "index_k"}


def test_standard_pieces_serve_window_only_layers_and_name_the_fix_for_compressed_ones():
    from latency_specialized_models.deepseek_v41_flash.spec import tiny_spec
    s = tiny_spec()
    assert isinstance(standard_attention(s, s.layers[0]), SparseMQAAttention)
    with pytest.raises(MissingPiece, match="KV sources, top-k and RoPE base"):
        standard_attention(s, s.layers[2])
