"""CPU tests of a decode step's paged-cache slots (``ops.paged_slots``, ``kernels/step_slots_triton.py``).

* the torch references on hand-made tables (the expected slots written out, clamped columns, padding rows, the
  token that closes a compressed group and the ones that do not) and the step's end (``advance``);
* the callers (``DecodeBuffers.metadata``, the sparse MQA piece's ``compressed_slots``) through ``ops.paged_slots``:
  on the CPU the references, with ``STEP_SLOTS_KERNEL`` on too;
* clear errors for what the kernels refuse;
* under the Triton interpreter (``tests/interpret.py``): both kernels against the references on random positions,
  lengths, tables (strided rows, odd widths, positions past the table) and ratios, their outputs poisoned first.

GPU cases (eager and CUDA-graph replays, a DeepSeek-V4.1-Flash cell with the switch on):
``tests/ops/test_step_slots_gpu.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels import step_slots_triton as kernels

from tests.interpret import run_interpreted

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
interpreted = pytest.mark.interpreter_case
"""Needs TRITON_INTERPRET=1 from the process start: collected only there (the driver below runs these)."""

TABLE = torch.tensor([[7, 2, 9], [4, 0, 5], [1, 3, 8]], dtype=torch.int32)


def test_decode_slots_reference_by_hand():
    # block size 4: position 5 is entry 1 of block column 1; 13 is past the 3-column table (clamped to column 2)
    pos = torch.tensor([5, 13, 3], dtype=torch.int64)
    act = torch.tensor([True, True, False])
    slot, seq = kernels.decode_slots_reference(pos, act, TABLE, 4)
    assert slot.tolist() == [2 * 4 + 1, 5 * 4 + 1, -1]
    assert seq.tolist() == [6, 14, 0] and seq.dtype == torch.int32 and slot.dtype == torch.int64


def test_compressed_slots_reference_by_hand():
    # ratio 2, block size 4: a length of 6 closes compressed row 2 (entry 2 of column 0); 7 closes none; 8 closes
    # row 3; 0 is padding
    seq_lens = torch.tensor([6, 7, 8], dtype=torch.int32)
    seq_c, seq_c32, slot_c, no_slot = kernels.compressed_slots_reference(seq_lens, TABLE, 2, 4)
    assert seq_c.tolist() == [3, 3, 4] and seq_c.dtype == torch.int64
    assert seq_c32.tolist() == [3, 3, 4] and seq_c32.dtype == torch.int32
    assert slot_c.tolist() == [7 * 4 + 2, -1, 1 * 4 + 3]
    assert no_slot.tolist() == [-1, -1, -1] and no_slot.dtype == torch.int64
    _, _, padding, _ = kernels.compressed_slots_reference(torch.zeros(3, dtype=torch.int32), TABLE, 2, 4)
    assert padding.tolist() == [-1, -1, -1]


def test_advance_reference_by_hand():
    pos = torch.tensor([5, 13, 3])
    tokens = torch.tensor([10, 11, 12])
    act = torch.tensor([True, False, True])
    kernels.advance_reference(pos, act, tokens, torch.tensor([20, 21, 22], dtype=torch.int32))
    assert pos.tolist() == [6, 13, 4] and tokens.tolist() == [20, 11, 22]
    kernels.advance_reference(pos, act, tokens, None)
    assert pos.tolist() == [7, 13, 5] and tokens.tolist() == [20, 11, 22]


def test_the_callers_run_the_references_on_the_cpu(monkeypatch):
    """``STEP_SLOTS_KERNEL`` routes CUDA tensors only: on the CPU the buffers' metadata and the compressed slots are
    the references' values, with the switch on or off."""
    from latency_specialized.pieces.attention.sparse_mqa import compressed_slots
    from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers

    def refuse(*_a, **_k):
        raise AssertionError("a Triton launch for CPU tensors")

    monkeypatch.setattr(kernels, "decode_slots_triton", refuse)
    monkeypatch.setattr(kernels, "compressed_slots_triton", refuse)
    monkeypatch.setattr(kernels, "advance_triton", refuse)
    for on in (False, True):
        monkeypatch.setattr(kernels, "STEP_SLOTS_KERNEL", on)
        buf = DecodeBuffers(BufferSpec(max_batch=3, block_size=4, max_blocks_per_seq=3), device="cpu")
        buf.positions[:3] = torch.tensor([5, 13, 3])
        buf.active[:3] = torch.tensor([True, True, False])
        buf.block_tables[:3] = TABLE
        buf.metadata(3)
        assert buf.slot_mapping[:3].tolist() == [9, 21, -1] and buf.seq_lens[:3].tolist() == [6, 14, 0]
        buf.advance(3, torch.tensor([4, 5, 6]))
        assert buf.positions[:3].tolist() == [6, 14, 3] and buf.tokens[:3].tolist()[:2] == [4, 5]
        meta = {"seq_lens": torch.tensor([6, 7, 8], dtype=torch.int32), "block_table": TABLE}
        assert compressed_slots(meta, 2, 4)[2].tolist() == [30, -1, 7]


def test_kernel_refusals_name_the_fix():
    strided = TABLE.t()   # column stride 3
    with pytest.raises(UserError, match="unit column stride"):
        kernels.compressed_slots_triton(torch.ones(3, dtype=torch.int32), strided, 2, 4)
    with pytest.raises(UserError, match="ratio 0"):
        kernels.compressed_slots_triton(torch.ones(3, dtype=torch.int32), TABLE, 0, 4)
    many = kernels.MAX_ROWS + 1
    with pytest.raises(UserError, match="MAX_ROWS"):
        kernels.decode_slots_triton(torch.zeros(many, dtype=torch.int64), torch.zeros(many, dtype=torch.bool),
                                    torch.zeros(many, 2, dtype=torch.int32), 4, torch.empty(many, dtype=torch.int64),
                                    torch.empty(many, dtype=torch.int32))


@pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (the sm_90 build)")
def test_hopper_builds():
    """Both kernels compile for sm_90 at a batch-1 step, a 512-row verification step and a strided table (the
    launches recorded, not run). Needs a process that is not interpreting."""
    import os

    from tests.triton_offline import compile_for_hopper, recorded_launches

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("compiles only where triton was imported without the interpreter")
    with recorded_launches() as launches:
        for rows in (1, 512):
            table = torch.zeros(rows, 70, dtype=torch.int32)[:, :64]
            kernels.decode_slots_triton(torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.bool),
                                        table, 64, torch.empty(rows, dtype=torch.int64),
                                        torch.empty(rows, dtype=torch.int32))
            kernels.compressed_slots_triton(torch.zeros(rows, dtype=torch.int32), table, 4, 64)
            for nxt in (None, torch.zeros(rows, dtype=torch.int64)):
                kernels.advance_triton(torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.bool),
                                       torch.zeros(rows, dtype=torch.int64), nxt)
        ins, outs = _verify_case(torch.Generator().manual_seed(0), 64, 7, 2048, 64)
        kernels.verify_rows_triton(*ins, 64, outs())
    assert len(launches) == 9
    assert compile_for_hopper(launches) == {}


@pytest.mark.interpreter_driver
@pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (its interpreter runs the kernels on the CPU)")
def test_kernel_cases_under_the_interpreter():
    run_interpreted(__file__, min_passed=34)


def _table(g: torch.Generator, rows: int, width: int, strided: bool) -> torch.Tensor:
    full = torch.randint(0, 1000, (rows, width + 3 if strided else width), generator=g, dtype=torch.int32)
    return full[:, :width] if strided else full


@interpreted
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 512])
@pytest.mark.parametrize("block_size,width,strided", [(64, 5, False), (16, 7, True), (1, 33, False)])
def test_decode_slots_kernel_equals_the_reference(rows, block_size, width, strided):
    g = torch.Generator().manual_seed(rows * 100 + block_size)
    table = _table(g, rows, width, strided)
    pos = torch.randint(0, block_size * width + 2 * block_size, (rows,), generator=g)   # some past the table
    act = torch.rand(rows, generator=g) < 0.8
    slot = torch.full((rows,), 12345, dtype=torch.int64)
    seq = torch.full((rows,), 12345, dtype=torch.int32)
    kernels.decode_slots_triton(pos, act, table, block_size, slot, seq)
    want_slot, want_seq = kernels.decode_slots_reference(pos, act, table, block_size)
    assert torch.equal(slot, want_slot) and torch.equal(seq, want_seq)


@interpreted
@pytest.mark.parametrize("ratio", [1, 2, 4, 128])
@pytest.mark.parametrize("rows,block_size,width,strided", [(1, 64, 3, False), (37, 16, 9, True)])
def test_compressed_slots_kernel_equals_the_reference(ratio, rows, block_size, width, strided):
    g = torch.Generator().manual_seed(ratio * 10 + rows)
    table = _table(g, rows, width, strided)
    seq_lens = torch.randint(0, ratio * block_size * width, (rows,), generator=g, dtype=torch.int32)
    seq_lens[::5] = 0                                 # padding rows
    seq_lens[1::5] = (seq_lens[1::5] // ratio) * ratio   # rows whose token closes a group
    got = kernels.compressed_slots_triton(seq_lens, table, ratio, block_size)
    want = kernels.compressed_slots_reference(seq_lens, table, ratio, block_size)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if ratio > 1 and rows > 1:
        assert (got[2] >= 0).any() and (got[2] < 0).any()   # both kinds of row in the case


@interpreted
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("next_dtype", [None, torch.int32, torch.int64], ids=["none", "i32", "i64"])
def test_advance_kernel_equals_the_reference(rows, next_dtype):
    g = torch.Generator().manual_seed(rows)
    pos = torch.randint(0, 10_000, (rows,), generator=g)
    tokens = torch.randint(0, 50_000, (rows,), generator=g)
    act = torch.rand(rows, generator=g) < 0.7
    nxt = None if next_dtype is None else torch.randint(0, 50_000, (2 * rows,), generator=g).to(next_dtype)[::2]
    want_pos, want_tokens = pos.clone(), tokens.clone()
    kernels.advance_reference(want_pos, act, want_tokens, nxt)
    kernels.advance_triton(pos, act, tokens, nxt)     # a strided next_tokens (every other sample) too
    assert torch.equal(pos, want_pos) and torch.equal(tokens, want_tokens)


def _verify_case(g: torch.Generator, B: int, k: int, W: int, block_size: int):
    table = torch.randint(0, 1000, (B, W + 2), generator=g, dtype=torch.int32)[:, :W]      # strided rows
    ins = (torch.randint(0, 50_000, (B,), generator=g), torch.randint(0, 50_000, (B, k), generator=g),
           torch.randint(0, block_size * W + block_size, (B,), generator=g), torch.rand(B, generator=g) < 0.75,
           table, torch.randint(0, 100, (B,), generator=g, dtype=torch.int32))
    M = B * (1 + k)

    def outs():   # poisoned
        return {"tokens": torch.full((M,), 7, dtype=torch.int64), "positions": torch.full((M,), 7, dtype=torch.int64),
                "slots": torch.full((M,), 7, dtype=torch.int64), "seq_lens": torch.full((M,), 7, dtype=torch.int32),
                "block_table": torch.full((M, W), 7, dtype=torch.int32),
                "row_states": torch.full((M,), 7, dtype=torch.int32)}
    return ins, outs


@interpreted
@pytest.mark.parametrize("B,k,W,block_size", [(1, 1, 3, 16), (3, 3, 37, 64), (8, 7, 1100, 16)])
def test_verify_rows_kernel_equals_the_reference(B, k, W, block_size):
    """A verification step's rows (the block-table rows copied in chunks: 1,100 columns take two)."""
    ins, outs = _verify_case(torch.Generator().manual_seed(B * 10 + k), B, k, W, block_size)
    got, want = outs(), outs()
    kernels.verify_rows_triton(*ins, block_size, got)
    kernels.verify_rows_reference(*ins, block_size, want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    if B > 1:   # both kinds of request in the case
        assert (want["slots"] == -1).any() and (want["slots"] >= 0).any()


@interpreted
@pytest.mark.parametrize("batch,spec", [(3, 0), (2, 3)], ids=["b3", "b2-s3"])
def test_a_program_with_the_kernels_serving_its_slots(monkeypatch, batch, spec):
    """The callers' wiring with the kernels' outputs (dtypes, shapes, the once-per-step sharing): a DeepSeek-V4.1-Flash
    tiny cell (compressed layers of two ratios, plain and verification steps) equals its reference with the kernels
    serving every step (here run by the interpreter on CPU tensors; on the GPU, ``test_step_slots_gpu.py``)."""
    from latency_specialized.plugins import get_registry
    from latency_specialized.testing.matrix import Cell

    calls = {"decode": 0, "compressed": 0, "verify": 0, "advance": 0}
    names = {"decode": "decode_slots_triton", "compressed": "compressed_slots_triton", "verify": "verify_rows_triton",
             "advance": "advance_triton"}

    def counted(name, fn):
        def run(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return run

    monkeypatch.setattr(kernels, "use_kernel", lambda t: True)
    for name, attr in names.items():
        monkeypatch.setattr(kernels, attr, counted(name, getattr(kernels, attr)))
    cell = Cell("deepseek_v41_flash", batch, 1, 40, spec, "cpu")
    res = get_registry().adapter("deepseek_v41_flash").verify_cell(cell, comm=None)
    assert res.steps > 0 and res.fast_steps == res.steps
    assert res.max_abs_err <= res.tolerance, f"max |program - reference| = {res.max_abs_err} > {res.tolerance}"
    assert calls["decode"] > 0 and calls["compressed"] > 0 and (calls["verify"] > 0) == (spec > 0), calls
