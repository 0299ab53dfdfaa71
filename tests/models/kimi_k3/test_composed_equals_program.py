"""The composed Kimi K3 (generic ComposedProgram over models/kimi_k3/composed.py) == today's KimiK3Program.

* op sites: the composed model's list equals ``kimi_op_sites`` (names, families, contexts, layers,
  weight bytes, order) for every variant, TP, token count, arch and dtype; plans built from either
  list print the same ``explain`` text;
* the name map: the checkpoint tensors the pieces read are exactly Kimi's expected tensors (names,
  shapes, fp32 storage), and mapping there and back gives the very same tensors;
* decode: both programs from one prefilled cache (shuffled pages), teacher-forced with the same
  random tokens through the runtime runner: logits, greedy tokens and every state tensor are
  bit-identical (``torch.equal``) after every step - fp32 and bf16, batch 1 and 3 (bucket 4: a
  padded row), TP=1 and TP=2 (gloo ranks), and under plans that fuse ``moe.gate_down`` or run the
  q_a norm as its own site, and on rank-shaped weights with communication excluded (the one-GPU
  bench); every site is called equally often by both.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import composed_worlds as cw
from latency_specialized import hardware
from latency_specialized.comm.worlds import run_world
from latency_specialized.ops.plan import build_plan
from latency_specialized.ops.registry import Implementation, ImplementationRegistry, always
from latency_specialized.plugins import get_registry
from latency_specialized.runtime.composed import expected_tensors, named_weights
from latency_specialized.spec import ParallelSpec

from latency_specialized_models.kimi_k3.adapter import KimiK3Adapter
from latency_specialized_models.kimi_k3.composed import composed_model, piece_weights, tensor_name_for
from latency_specialized_models.kimi_k3.sites import kimi_op_sites
from latency_specialized_models.kimi_k3.spec import full_spec, medium_spec, tiny_spec
from latency_specialized_models.kimi_k3.weights import expected_tensors as kimi_expected_tensors
from latency_specialized_models.kimi_k3.weights import random_weights

SPECS = {"tiny": tiny_spec, "medium": medium_spec, "full": full_spec}


# ---------------------------------------------------------------------------------------------- sites
@pytest.mark.parametrize("variant", list(SPECS))
def test_composed_op_sites_equal_kimi_op_sites(variant):
    spec = SPECS[variant]()
    model = composed_model(spec)
    tps = (1, 2, 8) if variant != "full" else (1, 8, 16)
    for tp in tps:
        rank = spec.shard(tp) if tp > 1 else spec
        for tokens in (1, 4, 64):
            for arch, dtype in (("cpu", "float32"), ("sm_90", "bfloat16"), ("sm_100", "bfloat16")):
                want = kimi_op_sites(rank, ParallelSpec(tp=tp), tokens, arch, dtype)
                got = model.op_sites(rank, ParallelSpec(tp=tp), tokens, arch, dtype)
                assert [s.name for s in got] == [s.name for s in want], (tp, tokens, arch)
                assert got == want, (tp, tokens, arch)   # families, contexts, layers, weight bytes


class _ComposedSitesAdapter(KimiK3Adapter):
    """kimi_k3 whose op sites come from the composed model (what the switch-over makes the adapter do)."""

    def op_sites(self, spec, parallel, tokens, arch, dtype):
        return composed_model(self.spec("tiny")).op_sites(spec, parallel, tokens, arch, dtype)


@pytest.mark.parametrize("arch,tp,batch", [("cpu", 1, 3), ("cpu", 2, 1), ("sm_90", 8, 1), ("sm_90", 8, 4),
                                           ("sm_100", 2, 16)])
def test_plans_and_explain_are_the_same(arch, tp, batch):
    reg = get_registry()
    kw = dict(tp=tp, batch=batch, dtype="float32" if arch == "cpu" else "bfloat16", variant="tiny")
    old = build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.for_arch(arch), **kw)
    new = build_plan(_ComposedSitesAdapter(), reg.implementations, hardware.for_arch(arch), **kw)
    assert new.to_text() == old.to_text()
    assert new.to_dict() == old.to_dict()
    assert new.skipped_sites() == old.skipped_sites()


# ---------------------------------------------------------------------------------------------- names
@pytest.mark.parametrize("variant", ["tiny", "medium"])
def test_name_map_reads_exactly_kimis_checkpoint_tensors(variant):
    spec = SPECS[variant]()
    model, names = composed_model(spec), tensor_name_for(spec)
    want = kimi_expected_tensors(spec)
    got = expected_tensors(model, names)
    assert set(got) == set(want)
    for name, (shape, kind) in got.items():
        assert shape == want[name].shape, name
        assert (kind == "float32") == want[name].fp32, name   # fp32 storage as the checkpoint keeps it


def test_name_map_round_trip_keeps_the_tensors():
    spec = tiny_spec()
    w = random_weights(spec, seed=1, dtype=torch.float32)
    pw = piece_weights(spec, w)
    back = named_weights(composed_model(spec), pw, tensor_name_for(spec))
    assert set(back) == set(w)
    assert all(torch.equal(back[n], w[n]) for n in w)
    # non-stacked weights are the same tensor objects (no copies on the way in)
    assert pw[0]["attn"]["q_proj"] is w["model.layers.0.self_attn.q_proj.weight"]
    assert pw[-1]["residual"]["out_norm"] is w["model.norm.weight"]
    e = spec.layers[1].ffn.num_experts
    assert pw[1]["ffn"]["experts.w2"].shape[0] == e
    last = w[f"model.layers.1.block_sparse_moe.experts.{e - 1}.w2.weight"]
    assert torch.equal(pw[1]["ffn"]["experts.w2"][e - 1], last)


# ---------------------------------------------------------------------------------------------- decode
def _assert_identical(report, steps):
    assert report["programs"] == ("KimiK3Program", "ComposedProgram")
    assert len(report["steps"]) == steps
    for i, s in enumerate(report["steps"]):
        assert s["logits_finite"], i
        assert s["logits_equal"] and s["logits_max_diff"] == 0.0, (i, s)
        assert s["next_equal"] and s["states_equal"] and s["states_max_diff"] == 0.0, (i, s)
        assert s["same_state_objects"], i
    old, new = Counter(report["old_calls"]), Counter(report["new_calls"])
    comm = {n for n in new if n.endswith("all_gather")}  # communication calls: counted by the op table only
    assert old == Counter({n: c for n, c in new.items() if n not in comm})   # every site called equally often
    called = {n for n in report["sites"] if n not in report["skipped"]}
    assert {n for n, c in new.items() if c and "/" in n and "all_gather" not in n} <= called
    assert all(new[n] > 0 for n in called)              # the composed program ran every called site


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lens", [[7], [3, 11, 6]], ids=["b1", "b3-padded"])
def test_composed_program_equals_kimi_program(lens, dtype):
    steps = 4
    torch.set_num_threads(1)
    report = cw.compare(lens, steps, seed=len(lens) + (dtype == "bfloat16"), dtype=dtype)
    _assert_identical(report, steps)


def _registry_with(impl: Implementation) -> ImplementationRegistry:
    reg = ImplementationRegistry()
    for i in get_registry().implementations:
        reg.register(i)
    reg.register(impl)
    return reg


def test_composed_program_equals_kimi_program_with_fused_gate_down_and_q_a_norm_site():
    """Plans where a (non-reference) implementation serves moe.gate_down, and where the q_b gemm has no
    norm prologue (the q_a norm runs as its own site): both programs still agree bit for bit."""
    base = get_registry().implementations
    gd = base.reference("moe.gate_down").fn
    gemm = base.reference("gemm").fn
    fused = _registry_with(Implementation("moe.gate_down", "moe.gate_down.test_fused",
                                          lambda *a, **kw: gd(*a, **kw), always, priority=1000, provider="test"))
    plain = _registry_with(Implementation("gemm", "gemm.test_plain", lambda *a, **kw: gemm(*a, **kw), always,
                                          priority=1000, provider="test", strided_rows=True))
    torch.set_num_threads(1)
    r = cw.compare([5, 9], 2, seed=21, registry=fused)
    _assert_identical(r, 2)
    assert any(n.endswith("moe.gate_down") and c for n, c in r["new_calls"].items())
    assert not any(n.endswith(("moe.router_gemm", "moe.latent_down")) and c for n, c in r["new_calls"].items())
    r = cw.compare([5, 9], 2, seed=22, registry=plain)
    _assert_identical(r, 2)
    assert r["new_calls"]["mla+moe/attn.q_a_norm"] > 0


def test_composed_program_equals_kimi_program_on_rank_shaped_weights():
    """The one-GPU bench's setting: rank 0 of TP=2 with communication excluded, weights given as the rank's
    shard by official name (``weights_sharded``): both programs agree bit for bit."""
    torch.set_num_threads(1)
    r = cw.compare([4, 7, 2], 2, seed=31, excluded_tp=2)
    _assert_identical(r, 2)


def test_composed_program_equals_kimi_program_tp2():
    """Two gloo ranks: each rank's composed program equals its KimiK3Program bit for bit (TP-split router
    and latent with one all-gather, the fused latent all-reduce, the rank's hidden slice, the LM-head gather)."""
    steps = 2
    res = run_world(cw.tp_body, 2, [3, 11, 6], steps, 3, "float32", timeout=300)
    for report in res:
        _assert_identical(report, steps)
        assert report["new_calls"]["kda+moe/moe.all_gather"] > 0 and report["new_calls"]["lm_head.all_gather"] == steps


# ---------------------------------------------------------------------------------------------- beyond today's program
def _plain_moe_spec():
    """tiny_spec without the latent width: the plain MoE (KimiK3Program refuses it; the reference runs it)."""
    from latency_specialized_models.kimi_k3.spec import build_spec, mla_layer_indices

    return build_spec(variant="tiny", hidden=64, vocab=512, num_layers=7, mla_layers=mla_layer_indices(7, 4),
                      kda_heads=8, head_dim=16, mla_heads=8, q_lora=32, kv_lora=16, nope=8, rope=8, v_dim=8,
                      experts=16, top_k=4, shared=2, expert_inter=32, latent=None, dense_inter=64, block_size=3,
                      max_context=4096, expert_format="bf16")


class _PlainMoEAdapter(KimiK3Adapter):
    def spec(self, variant="full"):
        return _plain_moe_spec()

    def op_sites(self, spec, parallel, tokens, arch, dtype):
        return composed_model(_plain_moe_spec()).op_sites(spec, parallel, tokens, arch, dtype)


def test_composed_plain_moe_config_matches_the_reference():
    """A config without routed_expert_hidden_size composes with the plain MoE piece; its decode steps
    match the Kimi reference (fp32, the bound of test_kimi_program.py): the composition is not tied to
    the latent MoE."""
    from latency_specialized.runtime.gate import StepState

    from latency_specialized_models.kimi_k3.composed import composed_program
    from latency_specialized_models.kimi_k3.reference import KimiK3Reference

    torch.set_num_threads(1)
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
    program = composed_program(spec, w, plan, pcache)
    buffers, runner = cw._runner(program, plan, pcache)
    buffers.load([0] * len(lens), lens, [s.row for s in pcache.slots], pcache.block_table())
    positions = list(lens)
    for _ in range(steps):
        toks = torch.randint(3, spec.vocab_size, (len(lens),), generator=g)
        want = ref.decode(cache, cache.slots, positions, toks)
        got = runner.run(StepState(num_seqs=len(lens)), tokens=toks).outputs["logits"]
        positions = [p + 1 for p in positions]
        assert ((got.double() - want.double()).abs().max() / want.double().abs().max()).item() <= 5e-5
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert program.calls["kda+moe/moe.router_gemm"] == steps * len(spec.kda_layers[1:])

