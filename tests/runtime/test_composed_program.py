"""The generic composed program on a toy model of the simple pieces vs an independent plain-torch decode.

Sequences of different lengths get a random KV history in a paged cache (shuffled blocks; every
unowned slot poisoned with NaN); each step runs the program through the runtime's eager graph runner
(batch padded to its bucket, NaN-poisoned logits) and the test's reference per sequence, teacher-forced
with fresh random tokens. Logits and the KV caches must agree (fp32 tightly, bf16 within its
tolerance), the poisoned slots must stay untouched, and the call counter must show every site ran.
TP=2 runs on two gloo processes.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from latency_specialized import hardware
from latency_specialized.comm.worlds import run_world
from latency_specialized.errors import UserError
from latency_specialized.ops.plan import build_plan
from latency_specialized.ops.registry import Implementation, ImplementationRegistry, always
from latency_specialized.pieces import DenseMLP, GQAAttention, LMHead, PreNormResidual, TokenEmbedding
from latency_specialized.plugins import get_registry
from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
from latency_specialized.runtime.census import KernelCensus
from latency_specialized.runtime.composed import (ComposedModel, ComposedProgram, LayerPieces, rank_shape,
                                                  shard_weight)
from latency_specialized.runtime.gate import DecodeGate, StepState
from latency_specialized.runtime.graph_runner import CUDAGraphRunner
from latency_specialized.runtime.pieces_api import WeightDecl
from latency_specialized.runtime.program import check_program
from latency_specialized.runtime.states import ModelStates
from latency_specialized.trace import Trace

from tests.runtime.composed_toy import (ATTN_A, DENSE, VOCAB, ToyAdapter, ToyReference, composed_world,
                                        random_weights, toy_model, toy_spec)

# max|program - reference| / max|reference| over the logits: measured fp32 <= 7e-7 (summation order only),
# bf16 <= 2.3e-3 (the reference rounds where the program rounds)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
BS = 4


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def cpu_plan(model, batch, dtype, registry=None, adapter=None):
    return build_plan(adapter or ToyAdapter(model), registry or get_registry().implementations,
                      hardware.for_arch("cpu"), tp=1, batch=batch, dtype=NAMES[dtype])


class Setup:
    def __init__(self, dtype, lens, steps, seed, *, registry=None, tied=False):
        g = torch.Generator().manual_seed(seed)
        self.model = model = toy_model(tied=tied)
        self.w = random_weights(model, seed, dtype)
        if tied:
            del self.w[-1]["head"]["weight"]  # the program must read the embedding
        self.ref = ToyReference(model, self.w, dtype)
        self.B, self.dtype, self.gen = len(lens), dtype, g
        self.plan = cpu_plan(model, self.B, dtype, registry)
        need = self.B * -(-(max(lens) + steps) // BS)  # every sequence gets blocks for the longest
        self.states = ModelStates.allocate(model, self.B, max(lens) + steps, block_size=BS, dtype=dtype,
                                           shuffle_seed=seed, num_blocks=need + 3)
        for t in self.states.tensors():
            t.fill_(float("nan"))  # poison: only the histories below and the steps' writes may hold numbers
        self.owned = {}
        for b, (n, slot) in enumerate(zip(lens, self.states.slots)):
            for i in range(len(model.layers)):
                k, v = self.states.layer(i)["k"], self.states.layer(i)["v"]
                hk = torch.randn(n, *k.shape[2:], generator=g).to(dtype)
                hv = torch.randn(n, *v.shape[2:], generator=g).to(dtype)
                for p in range(n):
                    k[slot.blocks[p // BS], p % BS], v[slot.blocks[p // BS], p % BS] = hk[p], hv[p]
                self.ref.history[(i, b)] = ([x.double() for x in hk], [x.double() for x in hv])
        self.trace = Trace()
        self.program = ComposedProgram(model, self.w, self.plan, self.states, trace=self.trace)
        self.buffers = DecodeBuffers(BufferSpec(max_batch=self.plan.bucket, max_blocks_per_seq=len(self.states.slots[0].blocks),
                                                block_size=BS, pad_state=0))
        self.buffers.load([0] * self.B, lens, [s.row for s in self.states.slots], self.states.block_table())
        self.runner = CUDAGraphRunner(self.program, self.buffers, trace=self.trace, use_graphs=False,
                                      feed_back_tokens=False,
                                      gate=DecodeGate(max_batch=self.plan.bucket, buckets=(self.plan.bucket,)))
        self.positions = list(lens)

    def step(self):
        toks = torch.randint(0, VOCAB, (self.B,), generator=self.gen)
        self.program.logits.fill_(float("nan"))
        res = self.runner.run(StepState(num_seqs=self.B), tokens=toks)
        assert res.fast and not res.graph
        want = torch.stack([self.ref.decode(b, int(toks[b]), self.positions[b]) for b in range(self.B)])
        self.positions = [p + 1 for p in self.positions]
        return res.outputs["logits"], res.outputs["next_tokens"], want

    def check_caches(self):
        """Live slots hold the reference's history; every other slot still holds the poison."""
        for i in range(len(self.model.layers)):
            for which, idx in (("k", 0), ("v", 1)):
                cache = self.states.layer(i)[which]
                untouched = torch.ones(cache.shape[:2], dtype=torch.bool)
                for b, slot in enumerate(self.states.slots):
                    hist = torch.stack(self.ref.history[(i, b)][idx])
                    rows = torch.stack([cache[slot.blocks[p // BS], p % BS] for p in range(hist.shape[0])])
                    assert rel(rows, hist) <= TOL[self.dtype], (i, which, b)
                    for p in range(hist.shape[0]):
                        untouched[slot.blocks[p // BS], p % BS] = False
                assert cache[untouched].isnan().all(), f"layer {i} {which}: a slot outside the histories was written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[6], [3, 9, 1]], ids=["b1", "b3-padded"])
def test_program_matches_the_plain_torch_decode(dtype, lens):
    steps = 4
    s = Setup(dtype, lens, steps, seed=len(lens) + (dtype == torch.bfloat16))
    assert (s.plan.bucket > len(lens)) == (len(lens) == 3)        # b3 runs a padded bucket of 4
    for _ in range(steps):
        got, nxt, want = s.step()
        assert got.shape == want.shape == (len(lens), VOCAB)
        assert rel(got, want) <= TOL[dtype]
        assert torch.equal(nxt, got.argmax(-1))
        if dtype == torch.float32:
            assert torch.equal(got.argmax(-1), want.argmax(-1))
    s.check_caches()


def test_calls_and_trace_prove_the_program_ran():
    steps = 3
    s = Setup(torch.float32, [4, 7], steps, seed=5)
    for _ in range(steps):
        s.step()
    summary = s.trace.summary()
    assert summary["fast_steps"] == steps and summary["stock_steps"] == 0
    assert summary["sites"] == len(s.plan.choices) and s.program.steps_run == steps
    skipped = s.plan.skipped_sites()   # on the CPU only the fused QK-norm + RoPE sites (their reference serves)
    assert skipped and all(name.endswith("/attn.qk_prep") for name in skipped), skipped
    called = [c for c in s.plan.choices if c.site.name not in skipped]
    for c in called:  # every called site, once per layer it stands for, every step (attn.norm: layer 0 only)
        assert s.program.calls[c.site.name] == steps * max(len(c.site.layers), 1), c.site.name
    assert set(s.program.calls) == {c.site.name for c in called}   # TP=1: no communication calls
    assert s.trace.impl_calls["attention.gqa.reference"] == 3               # 3 kinds bind the attention site
    check_program(s.program)


def test_program_dispatches_through_the_plan():
    """A higher-priority attention.gqa implementation registered for the plan is what the program calls."""
    base = get_registry().implementations
    calls = Counter()
    ref = base.reference("attention.gqa").fn

    def counting(*a, **k):
        calls["n"] += 1
        return ref(*a, **k)

    reg = ImplementationRegistry()
    for impl in base:
        reg.register(impl)
    reg.register(Implementation("attention.gqa", "attention.gqa.test_counting", counting, always, priority=50))
    s = Setup(torch.float32, [2, 5], 2, seed=9, registry=reg)
    for _ in range(2):
        got, _, want = s.step()
        assert rel(got, want) <= TOL[torch.float32]
    assert calls["n"] == 2 * 4  # 4 attention layers, 2 steps
    assert s.trace.impl_calls["attention.gqa.test_counting"] == 3


def test_tied_head_reads_the_embedding():
    s = Setup(torch.float32, [3], 2, seed=4, tied=True)
    assert s.program.w_head["weight"].data_ptr() == s.w[-1]["embed"]["weight"].data_ptr()
    for _ in range(2):
        got, _, want = s.step()
        assert rel(got, want) <= TOL[torch.float32]


def test_census_counts_every_site_through_the_op_table():
    class Driver:
        capture_id, nodes = 1, 0

        def capturing_graph(self, stream):
            return (self.capture_id, 1)

        def kernel_nodes(self, graph):
            return self.nodes

    drv = Driver()
    s = Setup(torch.float32, [2], 1, seed=2)

    def launch(site, bucket, fn):  # every op "launches" one kernel
        def call(*a, **k):
            drv.nodes += 1
            return fn(*a, **k)
        return call

    s.program.op_table.wrap(launch)
    census = KernelCensus(driver=drv)
    assert census.instrument(s.program) == len(s.plan.choices) and s.program.census is census
    s.step()
    counts = census.kernels(s.plan.bucket)
    assert counts == {c.site.name: max(len(c.site.layers), 1) for c in s.plan.called_choices()}
    assert s.program.calls["lm_head"] == 1  # the call counter sits outside every hook


# ---------------------------------------------------------------------------------------------- build checks
def test_build_errors_name_the_fix():
    model = toy_model()
    w = random_weights(model, 0, torch.float32)
    plan = cpu_plan(model, 2, torch.float32)
    states = ModelStates.allocate(model, 2, 8, block_size=BS, dtype=torch.float32)

    class TwoRanks:
        rank, world_size, name = 0, 2, "fake"

    with pytest.raises(UserError, match="communicator has 2"):
        ComposedProgram(model, w, plan, states, comm=TwoRanks())

    class Other(ToyAdapter):
        name = "other_model"

    with pytest.raises(UserError, match="does not fit"):
        ComposedProgram(model, w, cpu_plan(model, 2, torch.float32, adapter=Other(model)), states)

    class Fewer(ToyAdapter):
        def op_sites(self, *a):
            return [s for s in super().op_sites(*a) if not s.name.endswith("attn.gqa")]

    with pytest.raises(UserError, match="lacks the sites"):
        ComposedProgram(model, w, cpu_plan(model, 2, torch.float32, adapter=Fewer(model)), states)
    missing = {i: {r: dict(d) for r, d in roles.items()} for i, roles in w.items()}
    del missing[2]["attn"]["sinks"]
    with pytest.raises(UserError, match="missing weight layer 2 attn.sinks"):
        ComposedProgram(model, missing, plan, states)
    bad = {i: {r: dict(d) for r, d in roles.items()} for i, roles in w.items()}
    bad[1]["ffn"]["experts.w2"] = bad[1]["ffn"]["experts.w2"][:, :, :-1]
    with pytest.raises(UserError, match=r"layer 1 ffn.experts.w2 has shape"):
        ComposedProgram(model, bad, plan, states)
    extra = {i: {r: dict(d) for r, d in roles.items()} for i, roles in w.items()}
    extra[0]["attn"]["bias"] = torch.zeros(3)
    with pytest.raises(UserError, match="not declared"):
        ComposedProgram(model, extra, plan, states)
    with pytest.raises(UserError, match="rank's shard"):
        ComposedProgram(model, w, plan, ModelStates.allocate(model, 2, 8, tp=2, block_size=BS, dtype=torch.float32))
    with pytest.raises(UserError, match="no plan for bucket 8"):
        ComposedProgram(model, w, plan, states).prepare(8)


def test_model_checks_and_sites():
    spec = toy_spec()
    a = GQAAttention(ATTN_A, qk_norm="weighted")
    layers = [LayerPieces(i, "same", a, DenseMLP(DENSE)) for i in range(4)]
    layers[2] = LayerPieces(2, "same", GQAAttention(ATTN_A, qk_norm="weightless"), DenseMLP(DENSE))
    with pytest.raises(UserError, match="different kinds"):
        ComposedModel(spec, TokenEmbedding(), PreNormResidual(), layers, LMHead())
    with pytest.raises(UserError, match="one LayerPieces per spec layer"):
        ComposedModel(spec, TokenEmbedding(), PreNormResidual(), layers[:2], LMHead())
    with pytest.raises(UserError, match="role"):
        ComposedModel(spec, LMHead(), PreNormResidual(), toy_model().layers, LMHead())
    model = toy_model()
    names = [s.name for s in model.op_sites(spec, __import__("latency_specialized.spec").spec.ParallelSpec(tp=2), 4,
                                            "cpu", "float32")]
    assert names[:3] == ["A+dense/attn.norm", "A+dense/attn.allreduce", "A+dense/attn.qkv_proj"]
    assert names[-1] == "lm_head" and "B+moe/moe.shared" in names and "A+moe/attn.norm" not in names
    assert list(model.kinds) == ["A+dense", "A+moe", "B+moe"] and [l.index for l in model.kinds["A+moe"]] == [1, 3]
    decls = model.weight_decls(2)
    assert decls[(2, "attn", "k_proj")].replicas == 2 and decls[(-1, "residual", "norm")].shape == (64,)
    assert decls[(1, "ffn", "router")].split is None and decls[(2, "ffn", "router")].split == 0


def test_shard_weight_by_parts_and_replicas():
    t = torch.arange(12 * 3).view(12, 3)
    fused = WeightDecl("qkv", (12, 3), split=0, parts=(4, 8))
    r0, r1 = shard_weight(fused, t, 0, 2), shard_weight(fused, t, 1, 2)
    assert torch.equal(r0, torch.cat([t[0:2], t[4:8]])) and torch.equal(r1, torch.cat([t[2:4], t[8:12]]))
    assert rank_shape(fused, 2) == (6, 3)
    kv = WeightDecl("k", (4, 3), split=0, replicas=2)
    got = [shard_weight(kv, t[:4], r, 4) for r in range(4)]
    assert torch.equal(got[0], t[0:2]) and torch.equal(got[1], t[0:2]) and torch.equal(got[2], t[2:4])
    assert torch.equal(got[3], t[2:4]) and rank_shape(kv, 4) == (2, 3)
    cols = WeightDecl("o", (3, 12), split=-1)
    assert torch.equal(shard_weight(cols, t.T, 1, 3), t.T[:, 4:8])
    assert shard_weight(WeightDecl("n", (12, 3)), t, 1, 2) is t
    with pytest.raises(UserError, match="not divisible"):
        shard_weight(WeightDecl("x", (12, 3), split=0), t, 0, 5)
    with pytest.raises(UserError, match="the pieces declare"):
        shard_weight(WeightDecl("x", (12, 4), split=0), t, 0, 2)


# ---------------------------------------------------------------------------------------------- TP=2
def test_tp2_on_two_gloo_processes_matches_the_reference():
    steps = 5
    ranks = run_world(composed_world, 2, 21, [0, 0, 0], steps, timeout=300)
    for r in ranks:
        assert r["rel_err"] <= 1e-5 and r["argmax_equal"]
        assert r["calls"]["lm_head.all_gather"] == steps           # the vocabulary slices, every step
        assert r["calls"]["B+moe/moe.all_gather"] == steps         # the split router of layer 2
        assert "A+moe/moe.all_gather" not in r["calls"]            # the replicated router gathers nothing
        for site, n in r["layers"].items():
            assert r["calls"][site] == steps * max(n, 1), site
        assert r["k_shape"][2:] == [1, 16]                         # MQA: the one KV head on both ranks
        assert r["router_rows"] == [4, 64] and r["kv_rank_rows"] == [(2 * 2 + 2) * 16, 64]
    assert ranks[0]["logits_sum"] == ranks[1]["logits_sum"]         # both ranks hold the same logits
