"""A decode step's paged-cache slots on the GPU (``kernels/step_slots_triton.py``): both kernels equal their torch
references exactly (integers) on fresh random positions, lengths and tables, outputs poisoned first, and the step's
end (``advance``) and a verification step's rows (``verify_rows``) equal their references; captured in a
CUDA graph, a replay after the inputs change in place equals the references on the new inputs; whole programs with
``STEP_SLOTS_KERNEL`` on (DeepSeek-V4.1-Flash: both kernels, compressed layers; Kimi K3: the step's slots) equal
their references as the matrix's cells do. Run on the H200: ``pytest -m gpu tests/ops/test_step_slots_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.kernels import step_slots_triton as kernels
from latency_specialized.plugins import get_registry
from latency_specialized.testing.matrix import Cell

from gpu_helpers import graph_replay, seeded_generator

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _inputs(seed: str, rows: int, block_size: int, width: int, ratio: int = 1):
    g = seeded_generator(seed)
    table = torch.randint(0, 100_000, (rows, width + 5), generator=g, device=DEV, dtype=torch.int32)[:, :width]
    pos = torch.randint(0, block_size * width + block_size, (rows,), generator=g, device=DEV)
    act = torch.rand(rows, generator=g, device=DEV) < 0.8
    seq = torch.randint(0, block_size * width * ratio, (rows,), generator=g, device=DEV, dtype=torch.int32)
    seq[1::3] = (seq[1::3] // ratio) * ratio
    seq[::7] = 0
    return table, pos, act, seq


@pytest.mark.parametrize("rows", [1, 8, 64, 512])
def test_decode_slots_kernel_equals_the_reference(rows):
    table, pos, act, _ = _inputs(f"d{rows}", rows, 64, 2048)
    slot = torch.full((rows,), 777, dtype=torch.int64, device=DEV)
    seq = torch.full((rows,), 777, dtype=torch.int32, device=DEV)
    kernels.decode_slots_triton(pos, act, table, 64, slot, seq)
    want_slot, want_seq = kernels.decode_slots_reference(pos, act, table, 64)
    assert torch.equal(slot, want_slot) and torch.equal(seq, want_seq)


@pytest.mark.parametrize("ratio", [2, 4, 128])
@pytest.mark.parametrize("rows", [1, 8, 64, 512])
def test_compressed_slots_kernel_equals_the_reference(rows, ratio):
    table, _, _, seq = _inputs(f"c{rows}-{ratio}", rows, 64, 2048, ratio)
    got = kernels.compressed_slots_triton(seq, table, ratio, 64)
    want = kernels.compressed_slots_reference(seq, table, ratio, 64)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("rows", [1, 64, 512])
def test_advance_kernel_equals_the_reference(rows):
    g = seeded_generator(f"a{rows}")
    pos = torch.randint(0, 100_000, (rows,), generator=g, device=DEV)
    tokens = torch.randint(0, 150_000, (rows,), generator=g, device=DEV)
    act = torch.rand(rows, generator=g, device=DEV) < 0.7
    for nxt in (None, torch.randint(0, 150_000, (rows,), generator=g, device=DEV, dtype=torch.int32)):
        want_pos, want_tokens = pos.clone(), tokens.clone()
        kernels.advance_reference(want_pos, act, want_tokens, nxt)
        kernels.advance_triton(pos, act, tokens, nxt)
        assert torch.equal(pos, want_pos) and torch.equal(tokens, want_tokens)


@pytest.mark.parametrize("B,k", [(1, 7), (8, 3), (64, 7)])
def test_verify_rows_kernel_equals_the_reference(B, k):
    g = seeded_generator(f"v{B}-{k}")
    W, bs, M = 2048, 64, B * (1 + k)
    ins = (torch.randint(0, 150_000, (B,), generator=g, device=DEV),
           torch.randint(0, 150_000, (B, k), generator=g, device=DEV),
           torch.randint(0, bs * W, (B,), generator=g, device=DEV), torch.rand(B, generator=g, device=DEV) < 0.75,
           torch.randint(0, 100_000, (B, W + 3), generator=g, device=DEV, dtype=torch.int32)[:, :W],
           torch.randint(0, 100, (B,), generator=g, device=DEV, dtype=torch.int32))

    def outs():
        i64, i32 = dict(dtype=torch.int64, device=DEV), dict(dtype=torch.int32, device=DEV)
        return {"tokens": torch.full((M,), 7, **i64), "positions": torch.full((M,), 7, **i64),
                "slots": torch.full((M,), 7, **i64), "seq_lens": torch.full((M,), 7, **i32),
                "block_table": torch.full((M, W), 7, **i32), "row_states": torch.full((M,), 7, **i32)}
    got, want = outs(), outs()
    kernels.verify_rows_triton(*ins, bs, got)
    kernels.verify_rows_reference(*ins, bs, want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_graph_replays_follow_the_inputs():
    rows, bs, width, ratio = 64, 64, 512, 4
    table, pos, act, seq = _inputs("g0", rows, bs, width, ratio)
    slot = torch.empty(rows, dtype=torch.int64, device=DEV)
    lens = torch.empty(rows, dtype=torch.int32, device=DEV)
    tokens = torch.zeros(rows, dtype=torch.int64, device=DEV)
    sampled = torch.zeros(rows, dtype=torch.int64, device=DEV)
    outs: list[tuple[torch.Tensor, ...]] = []

    def step():   # a step's slots, a compressed layer's, then the step's end (positions move, tokens fed back)
        kernels.decode_slots_triton(pos, act, table, bs, slot, lens)
        outs[:] = [kernels.compressed_slots_triton(seq, table, ratio, bs)]
        kernels.advance_triton(pos, act, tokens, sampled)

    g = graph_replay(step)
    for i in range(1, 4):
        new_table, new_pos, new_act, new_seq = _inputs(f"g{i}", rows, bs, width, ratio)
        table.copy_(new_table)
        pos.copy_(new_pos)
        act.copy_(new_act)
        seq.copy_(new_seq)
        sampled.random_(0, 150_000)
        slot.fill_(777)
        for t in outs[0]:
            t.fill_(777)
        want_slot, want_lens = kernels.decode_slots_reference(pos, act, table, bs)
        want_pos, want_tokens = pos.clone(), tokens.clone()
        kernels.advance_reference(want_pos, act, want_tokens, sampled)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(slot, want_slot) and torch.equal(lens, want_lens)
        assert torch.equal(pos, want_pos) and torch.equal(tokens, want_tokens)
        for a, b in zip(outs[0], kernels.compressed_slots_reference(seq, table, ratio, bs)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("model", ["deepseek_v41_flash", "kimi_k3"])
@pytest.mark.parametrize("batch,spec", [(1, 0), (8, 0), (4, 3)], ids=["b1", "b8", "b4-s3"])
def test_cells_with_the_slot_kernels_on(monkeypatch, model, batch, spec):
    monkeypatch.setattr(kernels, "STEP_SLOTS_KERNEL", True)
    res = get_registry().adapter(model).verify_cell(Cell(model, batch, 1, 40, spec, "cuda"), comm=None)
    assert res.steps > 0 and res.fast_steps == res.steps and res.stock_steps == 0
    assert res.max_abs_err <= res.tolerance, f"max |program - reference| = {res.max_abs_err} > {res.tolerance}"
    assert res.top1_agreement >= 0.99
