"""The composed program in CUDA graphs (H200): captured and replayed steps equal eager steps bit for bit
and the plain-torch reference within bf16 tolerance - the program itself makes no host sync (GQA served
by the sync-free attention.gqa.torch_paged, every other site by sync-free implementations)."""

from __future__ import annotations

import pytest
import torch

from latency_specialized import hardware
from latency_specialized.ops.plan import build_plan
from latency_specialized.pieces import DenseMLP, GQAAttention, LMHead, PreNormResidual, TokenEmbedding
from latency_specialized.plugins import get_registry
from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
from latency_specialized.runtime.composed import ComposedModel, ComposedProgram, LayerPieces
from latency_specialized.runtime.gate import DecodeGate, StepState
from latency_specialized.runtime.graph_runner import CUDAGraphRunner
from latency_specialized.runtime.states import ModelStates
from latency_specialized.spec import LayerSpec, ModelSpec, NormSpec

from tests.runtime.composed_toy import ATTN_A, ATTN_B, DENSE, EPS, HIDDEN, VOCAB, ToyAdapter, ToyReference, \
    random_weights


def dense_model() -> ComposedModel:
    spec = ModelSpec(name="toy_composed", variant="tiny", hidden_size=HIDDEN, vocab_size=VOCAB, max_context=256,
                     norm=NormSpec(eps=EPS), layers=tuple(LayerSpec(index=i, attention=a, ffn=DENSE)
                                                          for i, a in enumerate((ATTN_A, ATTN_B, ATTN_A))))
    a = GQAAttention(ATTN_A, qk_norm="weighted")
    b = GQAAttention(ATTN_B, qk_norm="weightless", rope_style="interleaved", rotary_dim=8, sinks=True)
    layers = [LayerPieces(0, "A+dense", a, DenseMLP(DENSE)), LayerPieces(1, "B+dense", b, DenseMLP(DENSE)),
              LayerPieces(2, "A+dense", a, DenseMLP(DENSE))]
    return ComposedModel(spec, TokenEmbedding(), PreNormResidual(), layers, LMHead())


@pytest.mark.gpu
def test_graph_replay_equals_eager_and_the_reference():
    dev = torch.device("cuda")
    model = dense_model()
    cpu_w = random_weights(model, 3, torch.bfloat16)
    w = {i: {r: {n: t.to(dev) for n, t in d.items()} for r, d in roles.items()} for i, roles in cpu_w.items()}
    n, steps, bs = 3, 6, 4
    plan = build_plan(ToyAdapter(model), get_registry().implementations, hardware.for_arch("sm_90"), batch=n,
                      dtype="bfloat16")
    assert plan.choice("A+dense/attn.gqa").impl.name == "attention.gqa.triton_splitkv"
    states = ModelStates.allocate(model, n, 16, block_size=bs, dtype=torch.bfloat16, device=dev, shuffle_seed=1)
    runs = {}
    for graphs in (True, False):
        prog = ComposedProgram(model, w, plan, states.clone())
        bufs = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(states.slots[0].blocks),
                                        block_size=bs), device=dev)
        bufs.load([0] * n, [0] * n, [s.row for s in states.slots], states.block_table(device="cpu"))
        runner = CUDAGraphRunner(prog, bufs, use_graphs=graphs, feed_back_tokens=False,
                                 gate=DecodeGate(max_batch=plan.bucket, buckets=(plan.bucket,)))
        if graphs:
            runner.capture([plan.bucket])
            assert runner.captures[plan.bucket].nodes is None or runner.captures[plan.bucket].nodes.get("kernel", 0) > 0
        g = torch.Generator().manual_seed(5)
        out = []
        for _ in range(steps):
            toks = torch.randint(0, VOCAB, (n,), generator=g)
            res = runner.run(StepState(num_seqs=n), tokens=toks.to(dev))
            assert res.fast and res.graph == graphs
            out.append((toks, res.outputs["logits"].cpu().clone()))
        runs[graphs] = out
    ref = ToyReference(model, cpu_w, torch.bfloat16)
    for t, ((toks, got), (_, eager)) in enumerate(zip(runs[True], runs[False])):
        assert torch.equal(got, eager), f"step {t}: replay != eager"
        want = torch.stack([ref.decode(b, int(toks[b]), t) for b in range(n)])
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err <= 2e-2, f"step {t}: {err:.3g}"
