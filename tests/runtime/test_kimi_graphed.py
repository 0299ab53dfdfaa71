"""Kimi K3 in the generic graph harness (``runtime/harness.py``, ``runtime/layer_harness.py``): the
adapter's bench spec, rank-shaped random weights, the composed program in the graph runner.

CPU: the runner (eager body, padded bucket) reproduces direct ``program.step`` calls exactly and
the trace shows the fast path ran; the layer bench reaches the harness through the adapter's hook.
GPU: one KDA+MoE layer at real TP8 rank shapes (the shapes the GPU kernels serve), CUDA-graph
replay == eager over several teacher-forced steps at batch 1 and 5 (bucket 8), and the trace
records graph replays.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized import hardware
from latency_specialized.comm.base import ExcludedCommunicator
from latency_specialized.ops.plan import build_plan
from latency_specialized.plugins import get_registry
from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
from latency_specialized.runtime.composed import ComposedProgram, shard_weight
from latency_specialized.runtime.gate import StepState
from latency_specialized.runtime.harness import SpecBoundAdapter, exclude_communication, make_runner
from latency_specialized.runtime.layer_harness import LayerBenchHarness
from latency_specialized.runtime.random_weights import random_rank_weights
from latency_specialized.runtime.states import ModelStates
from latency_specialized.trace import Trace

from latency_specialized_models.kimi_k3.composed import composed_model, piece_weights, random_weights
from latency_specialized_models.kimi_k3.spec import full_spec, tiny_spec

ADAPTER = get_registry().adapter("kimi_k3")


def test_bench_spec_has_full_widths_and_rank_weights_are_the_rank_shard_shapes():
    spec = ADAPTER.bench_spec(full_spec(), 8, "kda", 2, vocab=512)
    a, f = spec.layers[0].attention, spec.layers[0].ffn
    assert a.kind == "kda" and a.num_heads == 96 and a.head_dim == 128
    assert f.kind == "moe" and f.expert_intermediate == 3072 and f.num_experts == 896 and f.latent_dim == 3584
    assert spec.num_layers == 2 and spec.hidden_size == 7168
    rank = spec.shard(8).layers[0]
    assert rank.attention.num_heads == 12 and rank.ffn.expert_intermediate == 384
    small = tiny_spec()
    model = composed_model(small)
    w = random_rank_weights(model, 2, device="cpu", seed=1)
    # the same keys and shapes as rank 0's shard of full weights (router and latent down split too)
    full = piece_weights(small, random_weights(small, seed=1))
    decls = model.weight_decls(2)
    for (layer, role, local), d in decls.items():
        want = shard_weight(d, full[layer][role][local], 0, 2)
        got = w[layer][role][local]
        assert got.shape == want.shape and got.dtype == want.dtype, (layer, role, local)
        assert torch.isfinite(got.float()).all() and got.float().abs().sum() > 0, (layer, role, local)
    li = next(l.index for l in small.layers if l.ffn.kind == "moe")
    assert w[li]["ffn"]["router"].shape[0] == small.layers[li].ffn.num_experts // 2
    assert w[li]["ffn"]["router"].dtype == torch.bfloat16  # bf16 router weight, fp32 logits
    with pytest.raises(Exception, match="divisible"):
        ADAPTER.bench_spec(full_spec(), 7, "kda", 1)


def test_layer_bench_reaches_the_generic_harness_through_the_adapter_hook():
    harness = ADAPTER.layer_bench()
    assert isinstance(harness, LayerBenchHarness) and harness.adapter is ADAPTER and callable(harness.build_ours)


def _program(device: str, batch: int, seed: int, rank_shapes: bool = False, *, tp: int = 1, comm=None,
             edit_plan=None):
    """Program + buffers. ``rank_shapes``: one KDA+MoE layer as rank 0 of TP8 with communication
    excluded (the bench's setup: GPU kernels serve its shapes; the tiny spec's widths fall back to
    references, and moe.experts.reference syncs). Else the tiny model at ``tp`` over ``comm``, its plan
    passed through ``edit_plan`` when given."""
    reg = get_registry()
    hw = hardware.probe() if device == "cuda" else hardware.for_arch("cpu")
    if rank_shapes:
        spec = ADAPTER.bench_spec(full_spec(), 8, "kda", 1, vocab=512)
        tp, comm = 8, ExcludedCommunicator(8)
        plan = build_plan(SpecBoundAdapter(ADAPTER, spec), reg.implementations, hw, tp=8, batch=batch, comm=comm)
        w = random_rank_weights(composed_model(spec), 8, device=device, seed=seed)
    else:
        spec = tiny_spec()
        plan = build_plan(ADAPTER, reg.implementations, hw, tp=tp, batch=batch, variant="tiny")
        if edit_plan is not None:
            edit_plan(plan)
        w = piece_weights(spec, random_weights(spec, seed=seed, device=device))
    model = composed_model(spec)
    states = ModelStates.allocate(model, plan.bucket, 64, tp=tp, block_size=4, device=device, shuffle_seed=seed)
    g = torch.Generator().manual_seed(seed)
    for t in states.tensors():
        t.copy_((torch.randn(t.shape, generator=g) * 0.05).to(t.dtype))
    trace = Trace()
    prog = ComposedProgram(model, w, plan, states, trace=trace, comm=comm, weights_sharded=rank_shapes)
    if rank_shapes:
        assert exclude_communication(prog) == 3  # attn, ffn and latent all-reduces (the bench setup)
    buf = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(states.slots[0].blocks),
                                   block_size=4, pad_state=0), device=device)
    slots = states.slots[:batch]
    buf.load([5] * batch, [3 + i for i in range(batch)], [s.row for s in slots], states.block_table(slots, "cpu"))
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
    for a, b in zip(prog_g.state_tensors(), prog_e.state_tensors()):
        torch.testing.assert_close(a[1:].float(), b[1:].float(), rtol=1e-3, atol=1e-3)
    s = trace.summary()
    assert s["fast_steps"] == 6 and s["captures"] >= 1


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_ours_bench_wiring_on_the_cpu_with_a_small_bench_spec(kind, monkeypatch):
    """The layer bench's "ours" (``LayerBenchHarness.build_ours``) over a bench spec of tiny widths on the CPU:
    K-layer and 1-layer composed programs, plans of the bench spec, routing recorded from an eager step,
    the experts handed to stock, the notes. (The GPU bench times the same objects at full widths.)"""
    from latency_specialized import hardware as hw

    from latency_specialized_models.kimi_k3.spec import build_spec

    class Small(type(ADAPTER)):
        def bench_spec(self, full, tp, kind, num_layers, *, vocab=512):
            return build_spec(variant=f"bench-{kind}x{num_layers}", hidden=64, vocab=vocab, num_layers=num_layers,
                              mla_layers=tuple(range(num_layers)) if kind == "mla" else (), kda_heads=8, head_dim=16,
                              mla_heads=8, q_lora=32, kv_lora=16, nope=8, rope=8, v_dim=8, experts=16, top_k=4,
                              shared=2, expert_inter=32, latent=32, dense_layers=(), dense_inter=32, block_size=3,
                              max_context=4096, expert_format="bf16")

    monkeypatch.setattr(hw, "probe", lambda: hw.for_arch("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    ours = Small().layer_bench().build_ours(full_spec(), 1, kind, 2, (1, 3), torch.device("cpu"), say=lambda s: None,
                                            contexts=(8,) if kind == "mla" else (), steps=4)
    assert sorted(ours.built) == [1, 2] and "ComposedProgram x 2 (+1)" in ours.description
    k, one = ours.variants(3, 8 if kind == "mla" else None)
    assert (k.layers, one.layers, k.bucket) == (2, 1, 4)
    k.eager()
    ids = k.routing()
    assert len(ids) == 2 and all(t.shape == (3, 4) and int(t.max()) < 16 for t in ids)
    assert k.b.program.calls[f"{kind}+moe/moe.router"] > 0
    w13, w2 = ours.expert_weights(3)[2]
    assert w13.shape == (16, 64, 32) and w2.shape == (16, 32, 32)
    assert any(n.startswith("ours plan, bucket 1") for n in ours.notes)
    ours.close()


def test_rank_copies_of_a_prefilled_cache_are_the_rank_slices():
    """``shard_states`` (from the pieces' StateDecl splits): a KDA rank keeps its heads of each of q, k, v in
    the conv tail and of the recurrent state; every rank keeps the whole MLA latent cache (copies)."""
    from latency_specialized.runtime.states import shard_states

    spec = tiny_spec()
    model = composed_model(spec)
    full = ModelStates.allocate(model, 2, 16, block_size=4, dtype=torch.float32, shuffle_seed=1)
    for t in full.tensors():
        t.normal_()
    i, j = spec.kda_layers[1], spec.mla_layers[0]
    hd = spec.layers[i].attention.num_heads * spec.layers[i].attention.head_dim
    for tp in (2, 8):
        n = hd // tp
        for rank in (0, tp - 1):
            mine = shard_states(model, full, rank, tp)
            conv = full.layer(i)["conv"]
            want = torch.cat([conv[:, p * hd + rank * n:p * hd + (rank + 1) * n] for p in range(3)], dim=1)
            assert torch.equal(mine.layer(i)["conv"], want)
            assert torch.equal(mine.layer(i)["state"], full.layer(i)["state"].chunk(tp, dim=1)[rank])
            kv = mine.layer(j)["kv"]
            assert torch.equal(kv, full.layer(j)["kv"]) and kv.data_ptr() != full.layer(j)["kv"].data_ptr()
            assert mine.slots == full.slots and mine.tp == tp
