"""Op registry, selection with refusal reasons, plan building, batch buckets."""

from __future__ import annotations

import pytest
import torch

from latency_specialized import hardware
from latency_specialized.errors import PluginError, UserError
from latency_specialized.ops.plan import BATCH_BUCKETS, build_plan, bucket_for
from latency_specialized.ops.registry import (FAMILIES, Implementation, ImplementationRegistry, always,
                                              make_context)
from latency_specialized.plugins import get_registry


def _ctx(**kw):
    base = dict(arch="sm_90", dtype="bfloat16", tokens=2, dims={"N": 4096, "K": 7168})
    base.update(kw)
    return make_context("gemm", **base)


def _registry_with(*impls):
    reg = ImplementationRegistry()
    for i in impls:
        reg.register(i)
    return reg


def _fn(*a, **k):
    return None


def test_select_prefers_priority_and_records_refusals():
    fast = Implementation("gemm", "gemm.fast", _fn, lambda c: True if c.tokens <= 2 else f"M={c.tokens} > 2", priority=10)
    mid = Implementation("gemm", "gemm.mid", _fn, lambda c: "needs sm_100" if c.arch != "sm_100" else True, priority=5)
    ref = Implementation("gemm", "gemm.ref", _fn, always, priority=-100, is_reference=True)
    reg = _registry_with(ref, mid, fast)
    impl, refusals = reg.select(_ctx(tokens=2))
    assert impl.name == "gemm.fast" and refusals == []
    impl, refusals = reg.select(_ctx(tokens=8))
    assert impl.name == "gemm.ref"
    assert refusals == [("gemm.fast", "M=8 > 2"), ("gemm.mid", "needs sm_100")]
    impl, refusals = reg.select(_ctx(tokens=8), only="gemm.fast")
    assert impl is None and refusals == [("gemm.fast", "M=8 > 2")]
    impl, _ = reg.select(_ctx(tokens=8), allow_reference=False)
    assert impl is None


def test_buggy_supports_is_reported_not_raised():
    def boom(ctx):
        raise RuntimeError("bad table")

    reg = _registry_with(Implementation("gemm", "gemm.buggy", _fn, boom, priority=1),
                         Implementation("gemm", "gemm.ref", _fn, always, priority=-100, is_reference=True))
    impl, refusals = reg.select(_ctx())
    assert impl.name == "gemm.ref"
    assert refusals == [("gemm.buggy", "supports() raised RuntimeError: bad table")]


def test_registration_errors_name_the_fix():
    reg = ImplementationRegistry()
    with pytest.raises(PluginError, match="unknown family 'gemv'"):
        reg.register(Implementation("gemv", "x", _fn, always))
    reg.register(Implementation("gemm", "gemm.a", _fn, always))
    reg.register(Implementation("gemm", "gemm.a", _fn, always))  # same fn: idempotent
    with pytest.raises(PluginError, match="already registered"):
        reg.register(Implementation("gemm", "gemm.a", lambda: None, always))


def test_context_dims_and_attrs():
    ctx = make_context("moe.router", arch="cpu", dtype="float32", tokens=4, dims={"topk": 8, "E": 64},
                       attrs={"score_func": "sigmoid"})
    assert ctx.dim("E") == 64 and ctx.attr("score_func") == "sigmoid" and ctx.attr("missing", 3) == 3
    assert ctx == make_context("moe.router", arch="cpu", dtype="float32", tokens=4, dims={"E": 64, "topk": 8},
                               attrs={"score_func": "sigmoid"})
    with pytest.raises(KeyError):
        ctx.dim("N")


def test_every_family_has_a_reference_registered():
    impls = get_registry().implementations
    for family in FAMILIES:
        assert impls.reference(family).is_reference, family


@pytest.mark.parametrize("batch,bucket", [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 24), (33, 40), (64, 64)])
def test_bucket_for(batch, bucket):
    assert bucket_for(batch) == bucket
    assert bucket in BATCH_BUCKETS


def test_bucket_for_rejects_out_of_scope():
    with pytest.raises(UserError, match="batch 65 beyond the scope: use 1..64"):
        bucket_for(65)
    with pytest.raises(UserError, match="batch 0 is not valid"):
        bucket_for(0)
    assert bucket_for(20, max_batch=20) == 20  # a scope limit between buckets still gets a bucket


def test_plan_for_kimi_tp8_covers_every_site_with_reasons():
    reg = get_registry()
    plan = build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.for_arch("sm_90"), tp=8, batch=4)
    assert plan.bucket == 4 and plan.tokens == 4 and plan.in_scope
    counts = plan.counts()
    assert counts["unserved"] == 0 and counts["sites"] == len(plan.choices) > 20
    families = {c.site.family for c in plan.choices}
    assert {"gemm", "norm", "allreduce", "moe.router", "moe.experts", "attention.kda", "attention.mla"} <= families
    text = plan.to_text()
    assert "kda+moe/attn.o_proj" in text and "TP=8" in text
    d = plan.to_dict()
    assert all(s["impl"] for s in d["sites"])


def test_plan_on_cpu_uses_references_and_says_why():
    reg = get_registry()
    plan = build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.for_arch("cpu"), tp=1, batch=1,
                      dtype="float32", variant="tiny")
    gemm = [c for c in plan.choices if c.site.family == "gemm"][0]
    assert gemm.impl.is_reference
    assert ("gemm.cublas", "CPU: the reference serves (same math, fp32 accumulate)") in gemm.refusals


def test_plan_force_picks_an_implementation():
    reg = get_registry()
    plan = build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.for_arch("sm_90"), tp=8, batch=1,
                      force={"gemm": "gemm.reference"})
    assert all(c.impl.name == "gemm.reference" for c in plan.choices if c.site.family == "gemm")


def test_plan_keeps_scope_problems_and_rejects_bad_tp():
    reg = get_registry()
    a = reg.adapter("kimi_k3")
    plan = build_plan(a, reg.implementations, hardware.for_arch("sm_80"), tp=8, batch=1, dtype="float16")
    assert not plan.in_scope
    assert any("arch sm_80" in p for p in plan.scope_problems)
    assert any("dtype float16" in p for p in plan.scope_problems)
    with pytest.raises(UserError, match="TP=5 not supported: kimi_k3 needs 96 KDA heads divisible by TP"):
        build_plan(a, reg.implementations, hardware.for_arch("sm_90"), tp=5, batch=1)


def test_hardware_for_arch_and_probe():
    assert hardware.for_arch("sm90a").arch == "sm_90"
    assert hardware.for_arch("SM_100f").arch == "sm_100"
    with pytest.raises(UserError, match="unknown arch 'sm_42'"):
        hardware.for_arch("sm_42")
    hw = hardware.probe()
    assert hw.arch == ("cpu" if not torch.cuda.is_available() else hw.arch)
    assert hw.probed == torch.cuda.is_available()


# ------------------------------------------------------------------------------------------------
# The plan's context; the default op sites (the standard pieces of the spec)
# ------------------------------------------------------------------------------------------------


def _readme_adapter():
    """The README's third-party adapter: GQA + MoE from the spec only (no op_sites of its own)."""
    from latency_specialized.adapter import ModelAdapter
    from latency_specialized.spec import DecodeScope, GQAAttentionSpec, LayerSpec, ModelSpec, MoESpec, RouterSpec

    class MyModel(ModelAdapter):
        name = "my_model"

        def spec(self, variant="full"):
            attn = GQAAttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128)
            moe = MoESpec(num_experts=64, top_k=8, num_shared_experts=1, expert_intermediate=1408,
                          router=RouterSpec(score_func="softmax", bias_corrected=False))
            return ModelSpec(name=self.name, hidden_size=4096, vocab_size=151936, max_context=131072,
                             layers=tuple(LayerSpec(index=i, attention=attn, ffn=moe) for i in range(48)))

        def scope(self):
            return DecodeScope(archs=("sm_90", "sm_100"), tp_sizes=(1, 2, 4, 8), max_batch=64)

    return MyModel()


def test_plan_context_reaches_the_attention_sites():
    reg = get_registry()
    a = reg.adapter("kimi_k3")
    plan = build_plan(a, reg.implementations, hardware.for_arch("sm_90"), tp=8, batch=4, context=4096)
    assert plan.context == 4096 and plan.to_dict()["context"] == 4096
    assert "context: up to 4096 tokens per sequence" in plan.to_text()
    for c in plan.choices:
        assert c.site.ctx.attr("context") == (4096 if c.site.family.startswith("attention.") else None), c.site.name
    none = build_plan(a, reg.implementations, hardware.for_arch("sm_90"), tp=8, batch=4)
    assert none.context is None and all(c.site.ctx.attr("context") is None for c in none.choices)
    assert "context: not given" in none.to_text()
    assert [c.site.name for c in none.choices] == [c.site.name for c in plan.choices]
    with pytest.raises(UserError, match="context 0 is not valid"):
        build_plan(a, reg.implementations, hardware.for_arch("sm_90"), tp=8, batch=4, context=0)


def test_adapter_whose_op_sites_take_no_context_still_plans_one():
    """An adapter written before ``op_sites(..., context=)``: the planner gives its attention sites the context
    by the rule SiteBuilder applies."""
    reg = get_registry()
    base = _readme_adapter()

    class OldSignature(type(base)):
        def op_sites(self, spec, parallel, tokens, arch, dtype):
            return super().op_sites(spec, parallel, tokens, arch, dtype)

    new = build_plan(base, reg.implementations, hardware.for_arch("sm_90"), tp=2, batch=2, context=1000)
    old = build_plan(OldSignature(), reg.implementations, hardware.for_arch("sm_90"), tp=2, batch=2, context=1000)
    assert [c.site for c in old.choices] == [c.site for c in new.choices]
    assert new.choice("gqa+moe/attn.gqa").site.ctx.attr("context") == 1000


def test_default_op_sites_are_the_standard_pieces():
    from latency_specialized.pieces.standard import compose_standard
    from latency_specialized.spec import ParallelSpec

    a = _readme_adapter()
    full = a.spec()
    for tp in (1, 8):
        rank = full.shard(tp)
        got = a.op_sites(rank, ParallelSpec(tp=tp), 4, "sm_90", "bfloat16", context=100)
        assert got == compose_standard(full).op_sites(rank, ParallelSpec(tp=tp), 4, "sm_90", "bfloat16", context=100)
    names = [s.name for s in got]
    assert names == ["gqa+moe/attn.norm", "gqa+moe/attn.allreduce", "gqa+moe/attn.qkv_proj", "gqa+moe/attn.gqa",
                     "gqa+moe/attn.o_proj", "gqa+moe/ffn.allreduce", "gqa+moe/moe.router_gemm", "gqa+moe/moe.router",
                     "gqa+moe/moe.experts", "gqa+moe/moe.shared", "lm_head"]
    by = {s.name: s for s in got}
    assert by["gqa+moe/moe.router_gemm"].ctx.dim("N") == 64 // 8  # the router split across ranks
    assert by["gqa+moe/attn.gqa"].ctx.attr("context") == 100
    reg = get_registry()
    plan = build_plan(a, reg.implementations, hardware.for_arch("sm_90"), tp=8, batch=4)
    assert plan.in_scope and plan.counts()["unserved"] == 0


def test_a_block_without_a_piece_names_what_is_missing():
    from latency_specialized.pieces.standard import MissingPiece, compose_standard
    from latency_specialized.spec import ResidualSpec, SparseMQAAttentionSpec

    from latency_specialized.pieces.attention.sparse_mqa import SparseMQAAttention

    full = _readme_adapter().spec()
    # window-only sparse MQA has a standard piece; compressed KV needs the model's sources: MissingPiece
    mqa = SparseMQAAttentionSpec(num_heads=8, head_dim=64, rope_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                                 sliding_window=16, compress_ratio=0)
    window = tuple(l.model_copy(update={"attention": mqa}) if l.index < 2 else l for l in full.layers)
    model = compose_standard(full.model_copy(update={"layers": window}))
    assert isinstance(model.layers[0].attention, SparseMQAAttention)
    compressed = tuple(l.model_copy(update={"attention": mqa.model_copy(update={"compress_ratio": 2})})
                       if l.index < 2 else l for l in full.layers)
    with pytest.raises(MissingPiece, match=r"sparse MQA with compressed KV \(layers 0..1 \(2\)\)"):
        compose_standard(full.model_copy(update={"layers": compressed}))
    assert issubclass(MissingPiece, UserError)
    from latency_specialized.pieces.residual.gated import GatedResidual

    gated = compose_standard(full.model_copy(update={"residual": ResidualSpec(kind="gated")}))
    assert isinstance(gated.residual, GatedResidual)  # a residual kind with a piece gets it


def test_scope_flags_a_context_beyond_the_spec():
    from latency_specialized.spec import DecodeScope, Deployment

    scope = DecodeScope(archs=("sm_90",), tp_sizes=(1,))
    assert scope.problems(Deployment(arch="sm_90", context=4096), "m", max_context=4096) == []
    assert scope.problems(Deployment(arch="sm_90", context=4097), "m", max_context=4096) == [
        "context 4097 beyond m's longest context 4096 (use a context of at most 4096 tokens)"]
    assert scope.problems(Deployment(arch="sm_90", context=10**9), "m") == []  # no spec given: nothing to check
    assert "use a context of at most 131072 tokens" in " ".join(
        _readme_adapter().check(Deployment(arch="sm_90", context=131073)))


def test_a_site_of_an_unknown_family_is_refused_by_name():
    from latency_specialized.ops.registry import make_context
    from latency_specialized.ops.sites import OpSite

    reg = get_registry()
    base = _readme_adapter()

    class Unknown(type(base)):
        def op_sites(self, spec, parallel, tokens, arch, dtype, *, context=None):
            ctx = make_context("residual.future", arch=arch, dtype=dtype, tokens=tokens)
            return [*super().op_sites(spec, parallel, tokens, arch, dtype, context=context), OpSite("future", ctx)]

    with pytest.raises(UserError, match="op site future calls the op family 'residual.future', which the op registry "
                                        "does not know"):
        build_plan(Unknown(), reg.implementations, hardware.for_arch("sm_90"), tp=1, batch=1)
