"""Static decode buffers: padding, in-graph metadata and advance, as CPU tensor ops."""

from __future__ import annotations

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers


def _random_load(buf: DecodeBuffers, n: int, gen: torch.Generator):
    spec = buf.spec
    cap = spec.max_blocks_per_seq * spec.block_size
    tokens = torch.randint(0, 1000, (n,), generator=gen)
    positions = torch.randint(0, cap - 8, (n,), generator=gen)
    rows = torch.randperm(spec.max_batch * 2, generator=gen)[:n] + 1  # row 0 is pad_state
    bt = torch.randint(0, 500, (n, spec.max_blocks_per_seq), generator=gen, dtype=torch.int32)
    buf.load(tokens, positions, rows, bt)
    return tokens, positions, rows, bt


@pytest.mark.parametrize("n", [1, 3, 8, 17])
def test_load_pads_and_metadata_matches_host_math(n):
    gen = torch.Generator().manual_seed(n)
    spec = BufferSpec(max_batch=24, max_blocks_per_seq=6, block_size=16, pad_state=0)
    buf = DecodeBuffers(spec)
    tokens, positions, rows, bt = _random_load(buf, n, gen)
    assert buf.num_active == n
    assert torch.equal(buf.tokens[:n], tokens) and torch.equal(buf.positions[:n], positions)
    assert bool(buf.active[:n].all()) and not bool(buf.active[n:].any())
    assert bool((buf.state_indices[n:] == 0).all())
    for i in range(n):
        p = int(positions[i])
        assert int(buf.slot_mapping[i]) == int(bt[i, p // 16]) * 16 + p % 16
        assert int(buf.seq_lens[i]) == p + 1
    assert bool((buf.slot_mapping[n:] == -1).all()) and bool((buf.seq_lens[n:] == 0).all())


def test_advance_moves_only_live_rows_and_feeds_tokens():
    gen = torch.Generator().manual_seed(1)
    spec = BufferSpec(max_batch=16, max_blocks_per_seq=4, block_size=8, pad_state=0)
    buf = DecodeBuffers(spec)
    tokens, positions, rows, bt = _random_load(buf, 5, gen)
    bucket = 8
    nxt = torch.randint(0, 1000, (bucket,), generator=gen)
    pad_tokens_before = buf.tokens[5:bucket].clone()
    buf.advance(bucket, nxt)
    buf.metadata(bucket)
    assert torch.equal(buf.positions[:5], positions + 1)
    assert bool((buf.positions[5:] == 0).all())
    assert torch.equal(buf.tokens[:5], nxt[:5])
    assert torch.equal(buf.tokens[5:bucket], pad_tokens_before)
    for i in range(5):
        p = int(positions[i]) + 1
        assert int(buf.slot_mapping[i]) == int(bt[i, p // 8]) * 8 + p % 8
    assert bool((buf.slot_mapping[5:bucket] == -1).all())


def test_block_appended_between_steps_is_used_next_step():
    spec = BufferSpec(max_batch=4, max_blocks_per_seq=3, block_size=4, pad_state=0)
    buf = DecodeBuffers(spec)
    buf.load([7], [3], [1], torch.tensor([[11]], dtype=torch.int32))
    buf.metadata(1)
    assert int(buf.slot_mapping[0]) == 11 * 4 + 3
    buf.advance(1)
    assert buf.needs_block([4]) == [0]
    buf.set_block(0, 1, 29)  # host appends the next block
    buf.metadata(1)
    assert int(buf.slot_mapping[0]) == 29 * 4 + 0 and int(buf.seq_lens[0]) == 5


def test_load_errors_name_the_fix():
    buf = DecodeBuffers(BufferSpec(max_batch=4, max_blocks_per_seq=2, block_size=4, pad_state=0))
    with pytest.raises(UserError, match="reserved for padding"):
        buf.load([1], [0], [0])
    with pytest.raises(UserError, match="exceeds the static buffers"):
        buf.load([1] * 5, [0] * 5, [1, 2, 3, 4, 5])
    with pytest.raises(UserError, match="capacity"):
        buf.load([1], [8], [1])
    with pytest.raises(UserError, match="one value per sequence"):
        buf.load([1, 2], [0], [1, 2])
    buf.load([1, 2], [0, 1], [1, 2])
    with pytest.raises(UserError, match="2 live sequences"):
        buf.set_tokens(torch.tensor([1, 2, 3]))
