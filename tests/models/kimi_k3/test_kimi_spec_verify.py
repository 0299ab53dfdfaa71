"""Kimi K3 verification steps (speculative decoding, issue 25) through the composed program.

A verification step feeds each request 1 + k tokens (KDA: ``attention.kda_verify`` and its rollback
tape; MLA: every row its own request over the paged cache; the MoE and the rest: M = B x (1 + k) rows).
Checked on the tiny model in fp32, prompts of different lengths in one shuffled paged cache:

* the logits of every row equal those of k + 1 single-token steps of the plain program and of the
  reference decode;
* after accepting j tokens per request (different j, 0 and k among them), the next verification step
  equals a run that only ever saw the accepted prefix, and the rejected drafts leave no bit behind;
* the trace shows the verification sites bound and run on the fast path, ``attn.kda`` not called.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized import hardware
from latency_specialized.errors import UserError
from latency_specialized.ops.plan import build_plan
from latency_specialized.pieces.attention.kda import KDAAttention
from latency_specialized.plugins import get_registry
from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
from latency_specialized.runtime.gate import DecodeGate, StepState
from latency_specialized.runtime.graph_runner import CUDAGraphRunner
from latency_specialized.runtime.harness import SpecBoundAdapter
from latency_specialized.trace import Trace

from latency_specialized_models.kimi_k3.adapter import KimiK3Adapter
from latency_specialized_models.kimi_k3.composed import random_weights
from latency_specialized_models.kimi_k3.reference import KimiK3Reference
from latency_specialized_models.kimi_k3.spec import medium_spec, tiny_spec

ADAPTER = KimiK3Adapter()
MAX_K = 7
"""The spec's tapes hold 1 + 7 tokens, so k = 3 steps use part of them."""
TOL = 5e-5
"""fp32, max|a - b| / max|b|: matmuls over M rows vs B rows sum in another order (test_kimi_program's bound)."""


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


class World:
    """One prefilled cache; programs over clones of it."""

    def __init__(self, lens: list[int], seed: int, device: str = "cpu", extra: int = 24, medium: bool = False,
                 dtype: torch.dtype = torch.float32):
        self.device, self.dtype = device, dtype
        # the medium spec on a GPU: widths every kernel serves, so no site falls back to a syncing reference
        self.spec = (medium_spec() if medium else tiny_spec()).with_spec_tokens(MAX_K)
        self.w = random_weights(self.spec, seed=seed, dtype=dtype, device=device)
        self.ref = KimiK3Reference(self.spec, self.w)
        self.lens, self.B = list(lens), len(lens)
        self.gen = torch.Generator().manual_seed(seed)
        self.cache = self.ref.new_cache(self.B, max(lens) + extra, block_size=4, shuffle_seed=seed)
        for b, n in enumerate(lens):
            self.ref.prefill(self.cache, self.cache.slots[b], 0, self.tokens(n))
        self.prefilled = self.cache.clone()
        self.rows = [s.row for s in self.cache.slots]
        self.hw = hardware.probe() if device == "cuda" else hardware.for_arch("cpu")

    def tokens(self, *shape: int) -> torch.Tensor:
        return torch.randint(3, self.spec.vocab_size, shape, generator=self.gen).to(self.device)

    def plan(self, batch: int, k: int):
        reg = get_registry()
        return build_plan(SpecBoundAdapter(ADAPTER, self.spec), reg.implementations, self.hw, tp=1, batch=batch,
                          dtype=str(self.dtype).removeprefix("torch."), spec_tokens=k, variant="tiny")

    def verifier(self, k: int, trace: Trace | None = None) -> "Verifier":
        return Verifier(self, k, trace)

    def single(self, batch: int) -> tuple:
        """A plain (k = 0) program over a clone of the prefilled cache, and its buffers."""
        plan = self.plan(batch, 0)
        cache = self.prefilled.clone()
        prog = ADAPTER.program(self.spec, weights=self.w, plans=plan, cache=cache)
        buf = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(cache.slots[0].blocks),
                                       block_size=4), self.device)
        return prog, buf, cache, plan.bucket


class Verifier:
    """A verification program of ``k`` drafts in the runner (eager on the CPU), fed per step by the host."""

    def __init__(self, world: World, k: int, trace: Trace | None):
        self.world, self.k = world, k
        self.plan = world.plan(world.B, k)
        self.cache = world.prefilled.clone()
        self.trace = trace if trace is not None else Trace()
        self.program = ADAPTER.program(world.spec, weights=world.w, plans=self.plan, cache=self.cache,
                                       trace=self.trace)
        self.buffers = DecodeBuffers(BufferSpec(max_batch=self.plan.bucket, spec_tokens=k, block_size=4,
                                                max_blocks_per_seq=len(self.cache.slots[0].blocks)), world.device)
        self.runner = CUDAGraphRunner(self.program, self.buffers, trace=self.trace, feed_back_tokens=False,
                                      use_graphs=world.device == "cuda",
                                      gate=DecodeGate(max_batch=self.plan.bucket, buckets=(self.plan.bucket,),
                                                      spec_tokens=(k,)))

    def load(self, toks: torch.Tensor, positions: list[int], accepted: list[int] | None = None) -> None:
        w = self.world
        self.buffers.load(toks[:, 0], positions, w.rows, w.cache.block_table())
        self.buffers.set_drafts(toks[:, 1:])
        if accepted is not None:
            self.buffers.set_accepted(accepted)

    def step(self, toks: torch.Tensor, positions: list[int], accepted: list[int] | None = None) -> torch.Tensor:
        """Logits ``[B, 1 + k, vocab]`` of one verification step (a copy)."""
        self.load(toks, positions, accepted)
        res = self.runner.run(StepState(num_seqs=self.world.B, spec_tokens=self.k))
        assert res.fast
        return res.outputs["logits"].clone()


def _single_steps(world: World, toks: torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, object]:
    """Logits [B, T, vocab] of T single-token steps of the plain program (all requests together), its cache."""
    prog, buf, cache, bucket = world.single(world.B)
    out = []
    for t in range(toks.shape[1]):
        buf.load(toks[:, t], [p + t for p in positions], world.rows, cache.block_table())
        buf.metadata(bucket)
        prog.step(buf, bucket)
        out.append(prog.logits[:world.B].clone())
    return torch.stack(out, 1), cache


def _reference_steps(world: World, toks: torch.Tensor, positions: list[int]) -> torch.Tensor:
    cache = world.prefilled.clone()
    return torch.stack([world.ref.decode(cache, cache.slots, [p + t for p in positions], toks[:, t])
                        for t in range(toks.shape[1])], 1)


@pytest.mark.parametrize("k", [3, 7])
@pytest.mark.parametrize("lens", [[7], [5, 11, 3]], ids=["b1", "b3-padded"])
def test_verification_step_equals_k_plus_1_single_steps(k, lens):
    world = World(lens, seed=len(lens) + k)
    v = world.verifier(k)
    toks = world.tokens(world.B, 1 + k)
    got = v.step(toks, world.lens)
    assert got.shape == (world.B, 1 + k, world.spec.vocab_size)
    single, s_cache = _single_steps(world, toks, world.lens)
    ref = _reference_steps(world, toks, world.lens)
    assert _rel(got, single) <= TOL and _rel(got, ref) <= TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # the live KDA states are untouched by a verification step (the tape holds the step) ...
    for i in world.spec.kda_layers:
        for name in ("state", "conv"):
            assert torch.equal(v.cache.layer(i)[name], world.prefilled.layer(i)[name])
    # ... and every row's latent went into its own slot, as the single steps wrote them
    for i in world.spec.mla_layers:
        assert not torch.equal(v.cache.layer(i)["kv"], world.prefilled.layer(i)["kv"])
        assert _rel(v.cache.layer(i)["kv"], s_cache.layer(i)["kv"]) <= TOL


@pytest.mark.parametrize("k", [3, 7])
@pytest.mark.parametrize("lens", [[7], [5, 11, 3]], ids=["b1", "b3-padded"])
def test_accepting_a_prefix_equals_a_run_that_only_saw_it(k, lens):
    """Step 1 verifies k drafts; request b accepts j_b of them; step 2 (which applies the accept first)
    feeds the token after the prefix and new drafts at position p_b + j_b + 1. Its logits equal those of
    single steps of each request over the accepted prefix only, then step 2's tokens."""
    world = World(lens, seed=10 + len(lens) + k)
    B = world.B
    accepted = [0, k, 1] if B == 3 else [k]  # j = 0 (only the last accepted token) and j = k (every draft)
    v = world.verifier(k)
    toks1 = world.tokens(B, 1 + k)
    v.step(toks1, world.lens)
    toks2 = world.tokens(B, 1 + k)
    pos2 = [p + j + 1 for p, j in zip(world.lens, accepted)]
    got = v.step(toks2, pos2, accepted)
    # a batch-1 plain program per request: the prefix toks1[b, :j+1], then step 2's tokens
    for b in range(B):
        prog, buf, cache, bucket = world.single(1)
        slot = cache.slots[b]
        seq = torch.cat([toks1[b, :accepted[b] + 1], toks2[b]])
        out = []
        for t, tok in enumerate(seq):
            buf.load(tok.view(1), [world.lens[b] + t], [slot.row], cache.block_table([slot]))
            buf.metadata(bucket)
            prog.step(buf, bucket)
            out.append(prog.logits[0].clone())
            if t == accepted[b]:  # the state of the accepted prefix: where the accept moved the live state
                prefix = {i: {n: cache.layer(i)[n][slot.row].clone() for n in ("state", "conv")}
                          for i in world.spec.kda_layers}
        want = torch.stack(out[accepted[b] + 1:])
        assert _rel(got[b], want) <= TOL, b
        assert torch.equal(got[b].argmax(-1), want.argmax(-1))
        for i, by in prefix.items():
            for n, t in by.items():
                assert _rel(v.cache.layer(i)[n][slot.row], t) <= TOL, (b, i, n)


def test_rejected_drafts_leave_no_bit_behind():
    """Two runs whose step-1 drafts agree on each request's accepted prefix and differ after it. The rejected
    rows reach the accepted state only through rounding of the layers that mix rows (the MoE reference
    batches the tokens routed to an expert, so an expert's gemm has another M): the KDA layer before any MoE
    (layer 0) keeps the same bits after the accept, later layers and step 2's logits agree to fp32 rounding."""
    k, lens = 3, [6, 9, 4]
    world = World(lens, seed=31)
    B, accepted = 3, [0, 3, 1]
    toks1 = world.tokens(B, 1 + k)
    other = toks1.clone()
    for b, j in enumerate(accepted):
        other[b, j + 1:] = world.tokens(k - j)
    assert not torch.equal(other, toks1)
    toks2 = world.tokens(B, 1 + k)
    pos2 = [p + j + 1 for p, j in zip(lens, accepted)]
    runs = []
    for first in (toks1, other):
        v = world.verifier(k)
        v.step(first, lens)
        runs.append((v, v.step(toks2, pos2, accepted)))
    (a, la), (b, lb) = runs
    assert _rel(la, lb) <= TOL
    first_kda = world.spec.kda_layers[0]
    assert all(layer.ffn.kind == "dense" for layer in world.spec.layers[:first_kda + 1])
    for i in world.spec.kda_layers:
        for n in ("state", "conv"):
            x, y = a.cache.layer(i)[n][world.rows], b.cache.layer(i)[n][world.rows]
            assert torch.equal(x, y) if i == first_kda else _rel(x, y) <= TOL, (i, n)


def test_trace_shows_the_verification_sites_on_the_fast_path():
    k, steps = 3, 2
    world = World([4, 9], seed=5)
    trace = Trace()
    v = world.verifier(k, trace)
    pos = list(world.lens)
    for s in range(steps):
        v.step(world.tokens(world.B, 1 + k), pos, None if s == 0 else [1, 2])
        pos = [p + 2 + b for b, p in enumerate(pos)]
    summary = trace.summary()
    assert summary["fast_steps"] == steps and summary["stock_steps"] == 0
    bound = {e.site: e.impl for e in trace.events if e.kind == "site"}
    kinds = {lp.kind for lp in v.program.model.layers if isinstance(lp.attention, KDAAttention)}
    assert kinds == {"kda+dense", "kda+moe"}
    for kind in kinds:
        assert bound[f"{kind}/attn.kda_verify"] == "attention.kda_verify.reference"
        assert bound[f"{kind}/attn.kda_accept"] == "attention.kda_accept.reference"
    n_kda = len(world.spec.kda_layers)
    calls = v.program.calls
    assert sum(calls[f"{kind}/attn.kda_verify"] for kind in kinds) == steps * n_kda
    assert sum(calls[f"{kind}/attn.kda_accept"] for kind in kinds) == steps * n_kda
    assert sum(calls.get(f"{kind}/attn.kda", 0) for kind in kinds) == 0
    assert calls["mla+moe/attn.mla"] == steps * len(world.spec.mla_layers)
    # every site the plan calls ran, at M = B x (1 + k) rows - but attn.kda, which the verification site
    # replaces (the plan cannot tell: op_sites is not told k, NOTES_verify.md)
    assert v.plan.tokens == v.plan.bucket * (1 + k)
    plain = {f"{kind}/attn.kda" for kind in kinds}
    assert {n for n, c in calls.items() if c} == {c.site.name for c in v.plan.called_choices()} - plain


def test_a_plain_spec_refuses_verification_plans_naming_the_kda_piece():
    spec = tiny_spec()
    w = random_weights(spec, seed=0, dtype=torch.float32)
    cache = KimiK3Reference(spec, w).new_cache(1, 16)
    reg = get_registry()
    plan = build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.for_arch("cpu"), batch=1,
                      spec_tokens=3, variant="tiny")
    with pytest.raises(UserError, match="KDAAttention piece .* speculative tokens: build it with spec_tokens >= 3"):
        ADAPTER.program(spec, weights=w, plans=plan, cache=cache)
    # tapes for 3 tokens do not serve 7
    spec3 = spec.with_spec_tokens(3)
    plan7 = build_plan(SpecBoundAdapter(ADAPTER, spec3), reg.implementations, hardware.for_arch("cpu"), batch=1,
                       spec_tokens=7, variant="tiny")
    with pytest.raises(UserError, match="verifies 3 speculative tokens"):
        ADAPTER.program(spec3, weights=w, plans=plan7, cache=KimiK3Reference(spec3, w).new_cache(1, 16))


def test_scope_declares_the_verified_token_counts():
    assert ADAPTER.scope().spec_tokens == (0, 3, 7)


@pytest.mark.gpu
@pytest.mark.parametrize("k,lens", [(3, [7]), (7, [5, 11, 3])], ids=["k3-b1", "k7-b3"])
def test_verification_graph_replay_equals_eager(k, lens):
    """CUDA-graph replay of verification steps (accept of the previous step's prefix included) == eager,
    logits and states, over three steps with different accepted counts."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    world = World(lens, seed=40 + k, device="cuda", medium=True, dtype=torch.bfloat16)
    g, e = world.verifier(k), world.verifier(k)
    e.runner = CUDAGraphRunner(e.program, e.buffers, trace=e.trace, feed_back_tokens=False, use_graphs=False,
                               gate=g.runner.gate)
    infos = g.runner.capture()
    assert infos and infos[0].nodes and infos[0].nodes.get("kernel", 0) > 0
    pos, acc = list(world.lens), None
    for s in range(3):
        toks = world.tokens(world.B, 1 + k)
        g.program.logits.fill_(float("nan"))
        lg, le = g.step(toks, pos, acc), e.step(toks, pos, acc)
        assert not torch.isnan(lg).any()
        torch.testing.assert_close(lg, le, rtol=2e-2, atol=2e-2)  # the same kernels; bf16 split reductions
        acc = [(s + b) % (k + 1) for b in range(world.B)]
        pos = [p + j + 1 for p, j in zip(pos, acc)]
    for a, b in zip(g.program.state_tensors(), e.program.state_tensors()):
        torch.testing.assert_close(a[1:].float(), b[1:].float(), rtol=2e-2, atol=2e-2)
    assert g.trace.summary()["captures"] >= 1
