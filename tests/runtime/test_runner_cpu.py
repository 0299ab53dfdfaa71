"""Graph runner on the CPU (eager body over padded buckets): multi-step results == unpadded loop,
trace records fast and stock steps, out-of-scope steps take the fallback."""

from __future__ import annotations

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
from latency_specialized.runtime.gate import DecodeGate, StepState
from latency_specialized.runtime.graph_runner import CUDAGraphRunner
from latency_specialized.runtime.program import FunctionProgram, check_program

from tests.runtime.toy import ToyProgram, reference_steps

BS = 4


def _setup(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    prog = ToyProgram(max_batch=16, state_rows=40, kv_slots=1000, seed=seed)
    buf = DecodeBuffers(BufferSpec(max_batch=16, max_blocks_per_seq=8, block_size=BS, pad_state=0))
    tokens = torch.randint(0, 64, (n,), generator=gen).tolist()
    positions = torch.randint(0, 10, (n,), generator=gen).tolist()
    rows = (torch.randperm(39, generator=gen)[:n] + 1).tolist()
    # distinct blocks per sequence so KV writes never collide
    bt = (torch.arange(n * 8).view(n, 8) + 1).tolist()
    buf.load(tokens, positions, rows, torch.tensor(bt, dtype=torch.int32))
    return prog, buf, tokens, positions, rows, bt


@pytest.mark.parametrize("n", [1, 3, 5, 16])
def test_runner_eager_matches_unpadded_reference(n):
    prog, buf, tokens, positions, rows, bt = _setup(n, seed=n)
    ref_logits, ref_state, ref_kv, ref_toks, ref_pos = reference_steps(prog, tokens, positions, rows, bt, BS, 6)
    pad_state_before = prog.state[0].clone()
    runner = CUDAGraphRunner(prog, buf, use_graphs=False)
    for s in range(6):
        res = runner.run(StepState(num_seqs=n))
        assert res.fast and not res.graph and res.bucket >= n
        torch.testing.assert_close(res.outputs["logits"], ref_logits[s], rtol=1e-5, atol=1e-5)
    live = torch.tensor(rows)
    torch.testing.assert_close(prog.state[live], ref_state[live], rtol=1e-5, atol=1e-5)
    assert torch.equal(buf.tokens[:n], torch.tensor(ref_toks)) and torch.equal(buf.positions[:n], torch.tensor(ref_pos))
    others = torch.ones(prog.state.shape[0], dtype=torch.bool)
    others[live] = False
    others[0] = False  # the padding row may change
    torch.testing.assert_close(prog.state[others], ref_state[others])  # untouched rows stayed untouched
    torch.testing.assert_close(prog.kv[:-1], ref_kv[:-1], rtol=1e-5, atol=1e-5)  # padding wrote only the scratch slot
    if runner.gate.decide(StepState(num_seqs=n)).bucket == n:
        torch.testing.assert_close(prog.state[0], pad_state_before)  # no padding rows: pad row untouched
    assert runner.trace.summary()["fast_steps"] == 6
    assert prog.prepared  # the prepare hook ran before the first body


def test_out_of_scope_steps_take_the_fallback_and_the_trace_says_why():
    prog, buf, *_ = _setup(3, seed=7)
    calls = []
    runner = CUDAGraphRunner(prog, buf, use_graphs=False, gate=DecodeGate(max_batch=16),
                             fallback=lambda st: calls.append(st) or "stock-out")
    r = runner.run(StepState(num_seqs=3, num_prefill_tokens=12))
    assert not r.fast and r.outputs == "stock-out" and "prefill" in r.reason
    r = runner.run(StepState(num_seqs=40))
    assert not r.fast and "beyond the fast path" in r.reason
    r = runner.run(StepState(num_seqs=2))  # buffers hold 3 live rows
    assert not r.fast and "buffers.load" in r.reason
    assert len(calls) == 3
    s = runner.trace.summary()
    assert s["stock_steps"] == 3 and s["fast_steps"] == 0
    assert any("prefill" in k for k in s["stock_reasons"])


def test_no_fallback_raises_user_error():
    prog, buf, *_ = _setup(2, seed=3)
    runner = CUDAGraphRunner(prog, buf, use_graphs=False)
    with pytest.raises(UserError, match="fallback"):
        runner.run(StepState(num_seqs=70))


def test_steps_stop_at_the_block_table_capacity():
    """The step advances positions itself (in the graph); the host counts steps and refuses the one
    whose position would index past the block table, naming the fix - never a silent clamp."""
    prog, buf, tokens, positions, rows, bt = _setup(2, seed=5)
    cap = buf.capacity                                   # 8 blocks of 4
    buf.load(tokens, [cap - 3, 1], rows, torch.tensor(bt, dtype=torch.int32))
    calls = []
    runner = CUDAGraphRunner(prog, buf, use_graphs=False, fallback=lambda st: calls.append(st) or "stock")
    for _ in range(3):                                   # positions cap-3, cap-2, cap-1: the last one fits
        assert runner.run(StepState(num_seqs=2)).fast
    assert int(buf.positions[0]) == cap and buf.host_max_position == cap  # host count == device positions
    r = runner.run(StepState(num_seqs=2))
    assert not r.fast and r.outputs == "stock" and "capacity" in r.reason and "max_blocks_per_seq" in r.reason
    buf.load(tokens, [0, 1], rows, torch.tensor(bt, dtype=torch.int32))  # a new batch: fast again
    assert runner.run(StepState(num_seqs=2)).fast
    bare = CUDAGraphRunner(prog, buf, use_graphs=False)
    buf.load(tokens, [cap - 1, 0], rows, torch.tensor(bt, dtype=torch.int32))
    assert bare.run(StepState(num_seqs=2)).fast
    with pytest.raises(UserError, match="capacity"):
        bare.run(StepState(num_seqs=2))


def test_capture_without_cuda_is_a_user_error():
    prog, buf, *_ = _setup(2, seed=4)
    runner = CUDAGraphRunner(prog, buf, use_graphs=False)
    with pytest.raises(UserError, match="CUDA graphs"):
        runner.capture()


def test_function_program_and_protocol_check():
    out = torch.full((4, 2), float("nan"))
    prog = FunctionProgram(lambda b, n: out[:n].copy_(b.positions[:n, None].float().expand(n, 2)),
                           {"y": out}, max_batch=4)
    check_program(prog)
    with pytest.raises(TypeError, match="missing"):
        check_program(object())
    buf = DecodeBuffers(BufferSpec(max_batch=4, max_blocks_per_seq=2, block_size=8, pad_state=0))
    buf.load([1, 2, 3], [4, 5, 6], [1, 2, 3])
    runner = CUDAGraphRunner(prog, buf, use_graphs=False, feed_back_tokens=False)
    r = runner.run(StepState(num_seqs=3))
    assert r.bucket == 4 and torch.equal(r.outputs["y"][:, 0], torch.tensor([4.0, 5.0, 6.0]))
    r = runner.run(StepState(num_seqs=3))
    assert torch.equal(r.outputs["y"][:, 0], torch.tensor([5.0, 6.0, 7.0]))  # advanced inside the step
    assert prog.prepared == [4]
