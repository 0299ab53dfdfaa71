"""Workspace layout arithmetic (comm/layout.py): areas never overlap and fit the slot."""

from __future__ import annotations

import itertools

import pytest

from latency_specialized.comm import layout as L


@pytest.mark.parametrize("world_size,tokens,row_words", [(2, 1, 32), (4, 7, 36), (8, 64, 3584), (8, 3, 20)])
def test_areas_are_disjoint_and_fit(world_size, tokens, row_words):
    lay = L.SlotLayout(world_size, tokens, row_words)
    cap = L.slot_words(world_size, 64, row_words)
    # one-shot: [src][row] rows of row_words, back to back
    spans = [(lay.oneshot_offset(s, r), lay.oneshot_offset(s, r) + row_words)
             for s, r in itertools.product(range(world_size), range(tokens))]
    assert sorted(spans) == [(i * row_words, (i + 1) * row_words) for i in range(world_size * tokens)]
    assert lay.oneshot_words <= cap
    # two-stage: reduce-scatter rows then the all-gather area, disjoint
    rs_end = lay.rs_offset(world_size - 1, tokens - 1) + lay.chunk_words
    assert rs_end == lay.ag_base
    assert lay.ag_offset(tokens - 1) + row_words == lay.two_stage_words <= cap
    assert cap % L.VEC_WORDS == 0


@pytest.mark.parametrize("vecs,world_size", [(9, 4), (896, 8), (8, 8), (5, 4)])
def test_chunks_cover_every_vector_once(vecs, world_size):
    lay = L.SlotLayout(world_size, 1, vecs * L.VEC_WORDS)
    owned = [v for r in range(world_size) for v in range(*lay.chunk_range(r))]
    assert owned == list(range(vecs))
    assert all(lay.owner(v) == r for r in range(world_size) for v in range(*lay.chunk_range(r)))


def test_sentinel_words_are_negative_zero_lanes():
    import torch

    bf = torch.tensor([L.SENTINEL_WORD["bfloat16"]], dtype=torch.int32).view(torch.bfloat16)
    f32 = torch.tensor([L.SENTINEL_WORD["float32"]], dtype=torch.int32).view(torch.float32)
    for t in (bf, f32):
        assert (t == 0).all() and torch.signbit(t).all()


def test_layout_problems_name_the_fix():
    assert "multiple of 8" in L.layout_problem(60, "bfloat16", 2)
    assert "use bfloat16 or float32" in L.layout_problem(64, "float16", 2)
    assert "fewer than 8 ranks" in L.layout_problem(32, "bfloat16", 8)
    assert L.layout_problem(7168, "bfloat16", 8) is None
