"""The Kimi K3 decode program (the generic ComposedProgram over its pieces) against the model reference,
and proof that the program ran.

Sequences of different lengths are prefilled by the reference into one paged cache (shuffled
blocks); then every decode step runs both the reference (per sequence) and the program (through
the runtime's eager graph runner, batch padded to its bucket), teacher-forced with fresh random
tokens. Logits and every state tensor must agree: fp32 tightly, bf16 within its tolerance.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from latency_specialized import hardware
from latency_specialized.errors import UserError
from latency_specialized.ops.plan import build_plan
from latency_specialized.ops.registry import Implementation, ImplementationRegistry, always
from latency_specialized.plugins import get_registry
from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
from latency_specialized.runtime.gate import DecodeGate, StepState
from latency_specialized.runtime.graph_runner import CUDAGraphRunner
from latency_specialized.testing.matrix import kernel_sites
from latency_specialized.trace import Trace

from latency_specialized.runtime.composed import named_weights

from latency_specialized_models.kimi_k3.adapter import KimiK3Adapter
from latency_specialized_models.kimi_k3.composed import composed_model, piece_weights, random_weights, tensor_name_for
from latency_specialized_models.kimi_k3.reference import KimiK3Reference
from latency_specialized_models.kimi_k3.spec import build_spec, mla_layer_indices, tiny_spec

ADAPTER = KimiK3Adapter()

# max|program - reference| / max|reference| over logits and states; measured over 54 steps of
# batches 1-4: fp32 <= 9.2e-6 (summation order only), bf16 <= 1.2e-2 (mostly 0: same rounding points)
TOL = {torch.float32: 5e-5, torch.bfloat16: 3e-2}
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


class Setup:
    def __init__(self, dtype: torch.dtype, lens: list[int], steps: int, seed: int, registry=None):
        g = torch.Generator().manual_seed(seed)
        self.spec = spec = tiny_spec()
        self.w = random_weights(spec, seed=seed, dtype=dtype)
        self.ref = KimiK3Reference(spec, self.w)
        self.B = len(lens)
        self.cache = self.ref.new_cache(self.B, max(lens) + steps, block_size=4, shuffle_seed=seed)
        for b, n in enumerate(lens):
            self.ref.prefill(self.cache, self.cache.slots[b], 0, torch.randint(3, spec.vocab_size, (n,), generator=g))
        self.pcache = self.cache.clone()
        reg = get_registry()
        self.plan = build_plan(reg.adapter("kimi_k3"), registry or reg.implementations, hardware.for_arch("cpu"),
                               tp=1, batch=self.B, dtype=NAMES[dtype], variant="tiny")
        self.trace = Trace()
        self.program = ADAPTER.program(spec, weights=self.w, plans=self.plan, cache=self.pcache, trace=self.trace)
        bs = BufferSpec(max_batch=self.plan.bucket, max_blocks_per_seq=len(self.cache.slots[0].blocks),
                        block_size=self.cache.block_size, pad_state=0)
        self.buffers = DecodeBuffers(bs)
        self.buffers.load([0] * self.B, lens, [s.row for s in self.cache.slots], self.cache.block_table())
        self.runner = CUDAGraphRunner(self.program, self.buffers, trace=self.trace, use_graphs=False,
                                      feed_back_tokens=False,
                                      gate=DecodeGate(max_batch=self.plan.bucket, buckets=(self.plan.bucket,)))
        self.positions = list(lens)
        self.gen = g

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        toks = torch.randint(3, self.spec.vocab_size, (self.B,), generator=self.gen)
        want = self.ref.decode(self.cache, self.cache.slots, self.positions, toks)
        res = self.runner.run(StepState(num_seqs=self.B), tokens=toks)
        assert res.fast
        self.positions = [p + 1 for p in self.positions]
        return res.outputs["logits"], want


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[7], [3, 11, 6], [5, 2, 9, 14]], ids=["b1", "b3-padded", "b4"])
def test_program_matches_reference(dtype, lens):
    steps = 4
    s = Setup(dtype, lens, steps, seed=len(lens) + (dtype == torch.bfloat16))
    for _ in range(steps):
        got, want = s.step()
        assert got.shape == want.shape == (len(lens), s.spec.vocab_size)
        assert _rel(got, want) <= TOL[dtype]
        if dtype == torch.float32:
            assert torch.equal(got.argmax(-1), want.argmax(-1))
    # every state tensor of every live sequence agrees (padding only touched row 0 / no KV slot)
    rows = [sl.row for sl in s.cache.slots]
    for i in s.spec.kda_layers:
        for name in ("state", "conv"):
            assert _rel(s.pcache.layer(i)[name][rows].float(), s.cache.layer(i)[name][rows].float()) <= TOL[dtype]
    for i in s.spec.mla_layers:
        assert _rel(s.pcache.layer(i)["kv"].float(), s.cache.layer(i)["kv"].float()) <= TOL[dtype]
    # the program's states are the cache's own tensors, updated in place (not copies)
    assert sorted(t.data_ptr() for t in s.program.state_tensors()) == sorted(t.data_ptr() for t in s.pcache.tensors())


def test_trace_proves_the_program_ran():
    steps = 3
    s = Setup(torch.float32, [4, 9], steps, seed=7)
    for _ in range(steps):
        s.step()
    summary = s.trace.summary()
    assert summary["fast_steps"] == steps and summary["stock_steps"] == 0
    assert summary["sites"] == len(s.plan.choices)          # one binding event per site
    assert s.program.steps_run == steps
    # every site was called every step, once per layer it stands for - except the sites the plan says
    # are not called: here moe.gate_down (only its reference serves it: the two gemm sites it fuses run)
    # and the q_a norm (the q_b gemm reference takes it as its prologue)
    skipped = s.plan.skipped_sites()
    assert {n.split("/")[-1] for n in skipped} == {"moe.gate_down", "attn.q_a_norm"}, skipped
    for c in s.plan.choices:
        want = 0 if c.site.name in skipped else steps * max(len(c.site.layers), 1)
        assert s.program.calls[c.site.name] == want, c.site.name
    assert s.trace.impl_calls["attention.kda.reference"] == 2 and s.trace.impl_calls["attention.mla.reference"] == 1


def test_trace_shows_each_site_on_the_implementation_the_rules_give_it():
    """On the CPU the trace binds every site to its plan choice and the program runs exactly the sites the
    plan calls; those on a kernel are the plan rules' ``kernel_sites``: none with the installed registry
    (every called site runs its family's reference), the MLA site once a kernel says it runs on the CPU."""
    calls = Counter()
    base = get_registry().implementations
    mla_ref = base.reference("attention.mla").fn

    def cpu_kernel(*args, **kw):
        calls["mla"] += 1
        return mla_ref(*args, **kw)

    mixed = ImplementationRegistry()
    for impl in base:
        mixed.register(impl)
    mixed.register(Implementation("attention.mla", "attention.mla.test_cpu", cpu_kernel,
                                  lambda ctx: ctx.arch == "cpu" or "cpu only", priority=1, provider="test"))
    for reg, kernels in ((base, {}), (mixed, {"mla+moe/attn.mla": "attention.mla.test_cpu"})):
        s = Setup(torch.float32, [5, 8], 2, seed=11, registry=reg)
        for _ in range(2):
            got, want = s.step()
            assert _rel(got, want) <= TOL[torch.float32]
        assert s.trace.summary()["fast_steps"] == 2
        bound = {e.site: e.impl for e in s.trace.events if e.kind == "site"}
        assert bound == {c.site.name: c.impl.name for c in s.plan.choices}
        ran = {name for name, n in s.program.calls.items() if n}
        assert ran == {c.site.name for c in s.plan.called_choices()}
        on_kernel = {name: bound[name] for name in ran if not reg.get(bound[name]).is_reference}
        assert on_kernel == kernel_sites(s.plan, reg) == kernels
    assert calls["mla"] == 2 * len(s.spec.mla_layers) > 0


def test_program_dispatches_through_the_plan():
    """A higher-priority implementation registered for attention.mla is what the program calls."""
    calls = Counter()
    base = get_registry().implementations
    mla_ref = base.reference("attention.mla").fn

    def spy(*args, **kw):
        calls["mla"] += 1
        return mla_ref(*args, **kw)

    reg = ImplementationRegistry()
    for impl in base:
        reg.register(impl)
    reg.register(Implementation("attention.mla", "attention.mla.spy", spy, always, priority=1000, provider="test"))
    s = Setup(torch.float32, [6, 3], 2, seed=3, registry=reg)
    assert s.plan.choice("mla+moe/attn.mla").impl.name == "attention.mla.spy"
    for _ in range(2):
        got, want = s.step()
        assert _rel(got, want) <= TOL[torch.float32]
    assert calls["mla"] == 2 * len(s.spec.mla_layers)
    assert any(e.impl == "attention.mla.spy" for e in s.trace.events if e.kind == "site")


def test_fused_gate_down_site_replaces_the_router_and_latent_gemms():
    """Where a (non-reference) implementation serves moe.gate_down, the program calls it - one weight
    [W_gate; W_down] - and not the router-gemm / latent-down sites; the step still equals the model."""
    calls = Counter()
    base = get_registry().implementations
    ref = base.reference("moe.gate_down").fn

    def fused(x, weight, n_gate, **kw):
        calls["gate_down"] += 1
        assert weight.shape[0] > n_gate and weight.is_contiguous()
        return ref(x, weight, n_gate, **kw)

    reg = ImplementationRegistry()
    for impl in base:
        reg.register(impl)
    reg.register(Implementation("moe.gate_down", "moe.gate_down.test_fused", fused, always, priority=1000,
                                provider="test"))
    s = Setup(torch.float32, [6, 3], 2, seed=5, registry=reg)
    for _ in range(2):
        got, want = s.step()
        assert _rel(got, want) <= TOL[torch.float32]
    moe_layers = sum(1 for layer in s.spec.layers if hasattr(layer.ffn, "num_experts"))
    assert calls["gate_down"] == 2 * moe_layers > 0
    assert not any(name.endswith(("moe.router_gemm", "moe.latent_down")) for name in s.program.calls)


def test_q_a_norm_site_runs_where_the_q_b_gemm_has_no_norm_prologue():
    """A gemm implementation without ``norm_prologue`` (as the small-M/cuBLAS kernels from batch 3)
    makes the program run the q_a norm site itself; the step still equals the model."""
    base = get_registry().implementations
    ref = base.reference("gemm").fn
    reg = ImplementationRegistry()
    for impl in base:
        reg.register(impl)
    reg.register(Implementation("gemm", "gemm.test_plain", lambda *a, **kw: ref(*a, **kw), always, priority=1000,
                                provider="test", strided_rows=True))
    s = Setup(torch.float32, [5, 8], 2, seed=9, registry=reg)
    for _ in range(2):
        got, want = s.step()
        assert _rel(got, want) <= TOL[torch.float32]
    assert s.program.calls["mla+moe/attn.q_a_norm"] == 2 * len(s.spec.mla_layers) > 0


def test_q_a_norm_site_runs_with_the_norm_prologues_switched_off(monkeypatch):
    """``ops.plan.NORM_PROLOGUES = False`` (an A/B switch): the q_b gemm's implementation has the prologue, yet the
    plan skips no norm site - the program runs the q_a norm before it, and the step still equals the model."""
    from latency_specialized.ops import plan as plan_mod

    monkeypatch.setattr(plan_mod, "NORM_PROLOGUES", False)
    s = Setup(torch.float32, [5, 8], 2, seed=9)
    assert not any(n.endswith("attn.q_a_norm") for n in s.plan.skipped_sites()), s.plan.skipped_sites()
    for _ in range(2):
        got, want = s.step()
        assert _rel(got, want) <= TOL[torch.float32]
    assert s.program.calls["mla+moe/attn.q_a_norm"] == 2 * len(s.spec.mla_layers) > 0


def test_program_refuses_plans_it_cannot_run():
    spec = tiny_spec()
    reg = get_registry()
    w = random_weights(spec, seed=0, dtype=torch.float32)
    cache = KimiK3Reference(spec, w).new_cache(1, 8)
    plan = build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.for_arch("cpu"), tp=2, batch=1,
                      variant="tiny")
    with pytest.raises(UserError, match="communicator has 1 rank"):
        ADAPTER.program(spec, weights=w, plans=plan, cache=cache)
    plan = build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.for_arch("cpu"), tp=1, batch=1,
                      spec_tokens=7, variant="tiny")
    with pytest.raises(UserError, match="speculative"):
        ADAPTER.program(spec, weights=w, plans=plan, cache=cache)


@pytest.mark.parametrize("dtype", [torch.float32])
def test_reference_prefill_then_decode_equals_one_prefill(dtype):
    """Chunked prefill (expanded MLA) + absorbed decode steps == one prefill of the whole sequence."""
    spec = tiny_spec()
    w = random_weights(spec, seed=21, dtype=dtype)
    ref = KimiK3Reference(spec, w)
    ids = torch.randint(3, spec.vocab_size, (13,), generator=torch.Generator().manual_seed(21))
    c1 = ref.new_cache(1, 16, block_size=4, shuffle_seed=1)
    full = ref.prefill(c1, c1.slots[0], 0, ids)
    c2 = ref.new_cache(1, 16, block_size=4, shuffle_seed=2)
    part = [ref.prefill(c2, c2.slots[0], 0, ids[:6]), ref.prefill(c2, c2.slots[0], 6, ids[6:10])]
    part += [ref.decode(c2, c2.slots, [j], ids[j:j + 1]) for j in range(10, 13)]
    assert _rel(torch.cat(part), full) <= 1e-5
    for i in spec.kda_layers:
        assert _rel(c2.layer(i)["state"], c1.layer(i)["state"]) <= 1e-5


def test_reference_batched_decode_equals_each_sequence_alone():
    """decode() runs all sequences at once (KDA per state row, MLA per sequence); it equals decoding
    each sequence on its own, logits and caches, for sequences of different lengths."""
    spec = tiny_spec()
    w = random_weights(spec, seed=5, dtype=torch.float32)
    ref = KimiK3Reference(spec, w)
    g = torch.Generator().manual_seed(5)
    lens = [5, 9, 3]
    caches = [ref.new_cache(3, 16, block_size=4, shuffle_seed=3) for _ in range(2)]
    for c in caches:
        g.manual_seed(5)
        for slot, n in zip(c.slots, lens):
            ref.prefill(c, slot, 0, torch.randint(3, spec.vocab_size, (n,), generator=g))
    together, alone = caches
    for step in range(3):
        toks = torch.randint(3, spec.vocab_size, (3,), generator=g)
        pos = [n + step for n in lens]
        got = ref.decode(together, together.slots, pos, toks)
        want = torch.cat([ref.decode(alone, [alone.slots[b]], [pos[b]], toks[b:b + 1]) for b in range(3)])
        # fp32: matmuls of 3 rows vs 1 row may sum in another order (measured 1.9e-6)
        assert got.shape == (3, spec.vocab_size) and _rel(got, want) <= 1e-5
    for a, b in zip(together.tensors(), alone.tensors()):
        assert _rel(a.double(), b.double()) <= 1e-5
    with pytest.raises(UserError, match="twice"):
        ref.decode(together, [together.slots[0], together.slots[0]], [8, 8], toks[:2])


def test_name_map_round_trip_keeps_the_tensors():
    """Official names -> piece weights -> official names: the very same tensors (no copies on the way in)."""
    spec = tiny_spec()
    w = random_weights(spec, seed=1, dtype=torch.float32)
    pw = piece_weights(spec, w)
    back = named_weights(composed_model(spec), pw, tensor_name_for(spec))
    assert set(back) == set(w)
    assert all(torch.equal(back[n], w[n]) for n in w)
    assert pw[0]["attn"]["q_proj"] is w["model.layers.0.self_attn.q_proj.weight"]
    assert pw[-1]["residual"]["out_norm"] is w["model.norm.weight"]
    e = spec.layers[1].ffn.num_experts
    assert pw[1]["ffn"]["experts.w2"].shape[0] == e
    assert torch.equal(pw[1]["ffn"]["experts.w2"][e - 1], w[f"model.layers.1.block_sparse_moe.experts.{e - 1}.w2.weight"])


def test_op_sites_of_a_rank_spec_are_those_of_its_full_spec():
    """The plan hands op_sites the rank's spec (the bench a rank-shaped one): the pieces come from its full spec."""
    from latency_specialized.runtime.harness import SpecBoundAdapter
    from latency_specialized.spec import ParallelSpec

    spec = tiny_spec()
    bench = SpecBoundAdapter(ADAPTER, ADAPTER.bench_spec(ADAPTER.spec("full"), 8, "kda", 1))
    for tp in (2, 8):
        p = ParallelSpec(tp=tp)
        assert ADAPTER.op_sites(spec.shard(tp), p, 4, "sm_90", "bfloat16") == ADAPTER.op_sites(spec, p, 4, "sm_90",
                                                                                                "bfloat16")
        full = bench.spec()
        assert bench.op_sites(full.shard(tp), p, 1, "sm_90", "bfloat16") == bench.op_sites(full, p, 1, "sm_90",
                                                                                            "bfloat16")


def _plain_moe_spec():
    """tiny_spec without the latent width: the plain MoE piece (RoutedMoE)."""
    return build_spec(variant="tiny", hidden=64, vocab=512, num_layers=7, mla_layers=mla_layer_indices(7, 4),
                      kda_heads=8, head_dim=16, mla_heads=8, q_lora=32, kv_lora=16, nope=8, rope=8, v_dim=8,
                      experts=16, top_k=4, shared=2, expert_inter=32, latent=None, dense_inter=64, block_size=3,
                      max_context=4096, expert_format="bf16")


class _PlainMoEAdapter(KimiK3Adapter):
    def spec(self, variant="full"):
        return _plain_moe_spec()


def test_plain_moe_config_matches_the_reference():
    """A config without routed_expert_hidden_size composes with the plain MoE piece; its decode steps
    match the Kimi reference (fp32, this file's bound): the composition is not tied to the latent MoE."""
    spec = _plain_moe_spec()
    assert any(type(lp.ffn).__name__ == "RoutedMoE" for lp in composed_model(spec).layers)
    g = torch.Generator().manual_seed(5)
    w = random_weights(spec, seed=5, dtype=torch.float32)
    ref = KimiK3Reference(spec, w)
    lens, steps = [4, 9], 3
    cache = ref.new_cache(len(lens), max(lens) + steps, block_size=4, shuffle_seed=5)
    for b, n in enumerate(lens):
        ref.prefill(cache, cache.slots[b], 0, torch.randint(3, spec.vocab_size, (n,), generator=g))
    reg = get_registry()
    plan = build_plan(_PlainMoEAdapter(), reg.implementations, hardware.for_arch("cpu"), tp=1, batch=len(lens),
                      dtype="float32", variant="tiny")
    pcache = cache.clone()
    program = ADAPTER.program(spec, weights=w, plans=plan, cache=pcache)
    buffers = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(cache.slots[0].blocks),
                                       block_size=4, pad_state=0))
    buffers.load([0] * len(lens), lens, [s.row for s in pcache.slots], pcache.block_table())
    runner = CUDAGraphRunner(program, buffers, use_graphs=False, feed_back_tokens=False,
                             gate=DecodeGate(max_batch=plan.bucket, buckets=(plan.bucket,)))
    positions = list(lens)
    for _ in range(steps):
        toks = torch.randint(3, spec.vocab_size, (len(lens),), generator=g)
        want = ref.decode(cache, cache.slots, positions, toks)
        got = runner.run(StepState(num_seqs=len(lens)), tokens=toks).outputs["logits"]
        positions = [p + 1 for p in positions]
        assert _rel(got, want) <= TOL[torch.float32] and torch.equal(got.argmax(-1), want.argmax(-1))
    assert program.calls["kda+moe/moe.router_gemm"] == steps * len(spec.kda_layers[1:])
