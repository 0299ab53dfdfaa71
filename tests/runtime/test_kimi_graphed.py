"""models/kimi_k3/graphed.py: rank-shaped bench spec and weights, the program in the graph runner.

CPU: the runner (eager body, padded bucket) reproduces direct ``program.step`` calls exactly and
the trace shows the fast path ran. GPU: one KDA+MoE layer at real TP8 rank shapes (the shapes the
GPU kernels serve), CUDA-graph replay == eager over several teacher-forced steps at batch 1 and 5
(bucket 8), and the trace records graph replays.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized import hardware
from latency_specialized.ops.plan import build_plan
from latency_specialized.plugins import get_registry
from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
from latency_specialized.runtime.gate import StepState
from latency_specialized.trace import Trace

from latency_specialized.comm.base import ExcludedCommunicator
from latency_specialized_models.kimi_k3.graphed import bench_spec, bench_weights, exclude_communication, make_runner
from latency_specialized_models.kimi_k3.tp import shard_weights
from latency_specialized_models.kimi_k3.program import KimiK3Program
from latency_specialized_models.kimi_k3.spec import full_spec, tiny_spec
from latency_specialized_models.kimi_k3.weights import expected_tensors, random_weights


def test_bench_spec_has_full_widths_and_bench_weights_are_the_rank_shard_shapes():
    spec = bench_spec(full_spec(), 8, "kda", 2, vocab=512)
    a, f = spec.layers[0].attention, spec.layers[0].ffn
    assert a.kind == "kda" and a.num_heads == 96 and a.head_dim == 128
    assert f.kind == "moe" and f.expert_intermediate == 3072 and f.num_experts == 896 and f.latent_dim == 3584
    assert spec.num_layers == 2 and spec.hidden_size == 7168
    rank = spec.shard(8).layers[0]
    assert rank.attention.num_heads == 12 and rank.ffn.expert_intermediate == 384
    small = tiny_spec()
    w = bench_weights(small, torch.device("cpu"), seed=1, tp=2)
    # the same names and shapes as rank 0's shard of full weights (router and latent down split too)
    ref = shard_weights(small, random_weights(small, seed=1), 0, 2)
    assert set(w) == set(ref) == set(expected_tensors(small))
    for name, t in ref.items():
        assert tuple(w[name].shape) == tuple(t.shape), name
        assert torch.isfinite(w[name].float()).all() and w[name].float().abs().sum() > 0, name
    li = next(l.index for l in small.layers if l.ffn.kind == "moe")
    moe = f"model.layers.{li}.block_sparse_moe."
    assert w[moe + "gate.weight"].shape[0] == small.layers[li].ffn.num_experts // 2
    assert w[moe + "gate.weight"].dtype == torch.bfloat16  # bf16 router weight, fp32 logits
    with pytest.raises(Exception, match="divisible"):
        bench_spec(full_spec(), 7, "kda", 1)


def _program(device: str, batch: int, seed: int, rank_shapes: bool = False, *, tp: int = 1, comm=None,
             edit_plan=None):
    """Program + buffers. ``rank_shapes``: one KDA+MoE layer as rank 0 of TP8 with communication
    excluded (the bench's setup: GPU kernels serve its shapes; the tiny spec's widths fall back to
    references, and moe.experts.reference syncs). Else the tiny model at ``tp`` over ``comm``, its plan
    passed through ``edit_plan`` when given."""
    from latency_specialized_models.kimi_k3.cache import KimiK3Cache
    from latency_specialized_models.kimi_k3.graphed import ShapedAdapter

    reg = get_registry()
    hw = hardware.probe() if device == "cuda" else hardware.for_arch("cpu")
    if rank_shapes:
        spec = bench_spec(full_spec(), 8, "kda", 1, vocab=512)
        adapter = ShapedAdapter(reg.adapter("kimi_k3"), spec)
        comm = ExcludedCommunicator(8)
        plan = build_plan(adapter, reg.implementations, hw, tp=8, batch=batch, comm=comm)
        w = bench_weights(spec, torch.device(device), seed=seed, tp=8)
    else:
        spec = tiny_spec()
        plan = build_plan(reg.adapter("kimi_k3"), reg.implementations, hw, tp=tp, batch=batch, variant="tiny")
        if edit_plan is not None:
            edit_plan(plan)
        w = random_weights(spec, seed=seed, device=device)
    cache_spec = spec.shard(8) if rank_shapes else spec.shard(tp) if tp > 1 else spec
    cache = KimiK3Cache.for_sequences(cache_spec, plan.bucket, 64, block_size=4, device=device, shuffle_seed=seed)
    g = torch.Generator().manual_seed(seed)
    for t in cache.tensors():
        t.copy_((torch.randn(t.shape, generator=g) * 0.05).to(t.dtype))
    trace = Trace()
    prog = KimiK3Program(spec, w, plan, cache, trace=trace, comm=comm, weights_sharded=rank_shapes)
    if rank_shapes:
        assert exclude_communication(prog) == 3  # attn, ffn and latent all-reduces (the bench setup)
    buf = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(cache.slots[0].blocks), block_size=4,
                                   pad_state=0), device=device)
    slots = cache.slots[:batch]
    buf.load([5] * batch, [3 + i for i in range(batch)], [s.row for s in slots], cache.block_table(slots, "cpu"))
    return prog, buf, trace


def test_runner_over_kimi_program_equals_direct_steps_cpu():
    prog_a, buf_a, trace = _program("cpu", 3, seed=4)
    prog_b, buf_b, _ = _program("cpu", 3, seed=4)
    runner = make_runner(prog_a, buf_a, use_graphs=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        toks = torch.randint(3, 500, (3,), generator=g)
        r = runner.run(StepState(num_seqs=3), tokens=toks)
        assert r.fast and r.bucket == 4
        # the same step by hand: metadata, program, advance
        buf_b.set_tokens(toks)
        buf_b.metadata(4)
        prog_b.step(buf_b, 4)
        buf_b.advance(4, prog_b.next_tokens[:4])
        assert torch.equal(r.outputs["logits"], prog_b.logits[:3])
    assert trace.summary()["fast_steps"] == 3 and prog_a.steps_run == 3
    assert prog_a.calls["kda+moe/attn.kda"] > 0  # the program's op sites ran, not something else


def test_tp_projections_write_into_the_gather_slots_where_the_implementation_writes_strided_out():
    """TP=2 with the bench's excluded communicator: where the router / latent projections' implementation
    declares ``strided_out``, they write into the communicator's gather buffers and the all-gather copies
    nothing; the logits equal those of the copying path (same stand-ins, same values)."""
    import dataclasses

    from latency_specialized.comm.base import _same_view

    class Spy(ExcludedCommunicator):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.gathered, self.in_place = 0, 0

        def all_gather(self, t, dim=-1):
            self.gathered += 1
            self.in_place += _same_view(t, self.gather_slot(tuple(t.shape), t.dtype, t.device, dim % t.dim())[1])
            return super().all_gather(t, dim)

    def mark_strided_out(plan):  # the CPU references copy; declare the two projections' implementation strided_out
        plan.choices = [dataclasses.replace(c, impl=dataclasses.replace(c.impl, strided_out=True))
                        if c.site.name.endswith(("moe.router_gemm", "moe.latent_down")) else c for c in plan.choices]

    moe_layers = sum(1 for layer in tiny_spec().layers if layer.ffn.kind == "moe")
    logits = {}
    for mark in (False, True):
        comm = Spy(2)
        prog, buf, _ = _program("cpu", 2, seed=3, tp=2, comm=comm, edit_plan=mark_strided_out if mark else None)
        r = make_runner(prog, buf, use_graphs=False).run(StepState(num_seqs=2), tokens=torch.tensor([7, 9]))
        assert comm.gathered >= 2 * moe_layers
        assert comm.in_place == (2 * moe_layers if mark else 0), (mark, comm.in_place)
        logits[mark] = r.outputs["logits"].clone()
    assert torch.equal(logits[True], logits[False])


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 5])
def test_kimi_program_graph_replay_equals_eager(batch):
    prog_g, buf_g, trace = _program("cuda", batch, seed=7, rank_shapes=True)
    prog_e, buf_e, _ = _program("cuda", batch, seed=7, rank_shapes=True)
    runner = make_runner(prog_g, buf_g, preserve_state=True)
    infos = runner.capture()
    assert infos and infos[0].nodes and infos[0].nodes.get("kernel", 0) > 0
    eager = make_runner(prog_e, buf_e, use_graphs=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        toks = torch.randint(3, 500, (batch,), generator=g).cuda()
        prog_g.logits.fill_(float("nan"))
        r = runner.run(StepState(num_seqs=batch), tokens=toks)
        e = eager.run(StepState(num_seqs=batch), tokens=toks)
        assert r.graph and r.fast
        assert not torch.isnan(r.outputs["logits"]).any()
        torch.testing.assert_close(r.outputs["logits"], e.outputs["logits"], rtol=1e-3, atol=1e-3)
        assert torch.equal(r.outputs["next_tokens"], e.outputs["next_tokens"])
    # row 0 of the KDA conv/state tensors is the padding scratch row: padded batch rows all write it
    # at once (last writer wins), so it is excluded; every live row must match
    for a, b in zip(prog_g.cache.tensors(), prog_e.cache.tensors()):
        torch.testing.assert_close(a[1:].float(), b[1:].float(), rtol=1e-3, atol=1e-3)
    s = trace.summary()
    assert s["fast_steps"] == 6 and s["captures"] >= 1
