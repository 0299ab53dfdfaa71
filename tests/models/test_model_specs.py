"""DeepSeek-V4.1-Flash, Muse Spark and GLM-5.3 adapters: full specs against MODELS.md, tiny specs
cover every feature, shard() per supported TP (and the fix-naming error for a bad one), and a plan
for every op site of every deployment in scope."""

from __future__ import annotations

import math

import pytest

from latency_specialized import hardware
from latency_specialized.cli import main as cli_main
from latency_specialized.errors import UserError
from latency_specialized.ops.plan import build_plan
from latency_specialized.ops.registry import FAMILIES
from latency_specialized.plugins import get_registry
from latency_specialized.spec import (DenseMLPSpec, Deployment, GQAAttentionSpec, MLAAttentionSpec, MoESpec,
                                      ParallelSpec, SparseMQAAttentionSpec)

from latency_specialized_models.deepseek_v41_flash import spec as dsv4
from latency_specialized_models.glm53 import spec as glm
from latency_specialized_models.muse_spark import spec as muse

MODELS = ("deepseek_v41_flash", "muse_spark", "glm53")
CAPABILITIES = {"deepseek_v41_flash": frozenset({"spec", "reference", "program", "checkpoint", "quantized_experts"}),
                "glm53": frozenset({"spec", "reference", "program", "checkpoint", "quantized_experts"}),
                "muse_spark": frozenset({"spec", "reference", "program", "checkpoint", "quantized_experts"})}
SPEC_CLASSES = {"deepseek_v41_flash": dsv4.DeepseekV41Spec, "muse_spark": muse.MuseSparkSpec,
                "glm53": glm.Glm53Spec}
HEAD_COUNT_ERRORS = {"deepseek_v41_flash": "64 query heads", "muse_spark": "128 query heads",
                     "glm53": "64 MLA heads"}


@pytest.fixture(scope="module")
def registry():
    return get_registry()


def adapter(name: str):
    return get_registry().adapter(name)


# ------------------------------------------------------------------------------------------------
# Registration
# ------------------------------------------------------------------------------------------------


def test_adapters_register_through_entry_points(registry):
    failed = {f.name: f.error for f in registry.failures}
    for name in MODELS:
        assert name not in failed, failed[name]
        assert name in registry.adapters and registry.providers[name] == name
        assert registry.adapters[name].capabilities == CAPABILITIES[name]


@pytest.mark.parametrize("arch,name", [("DeepseekV41ForCausalLM", "deepseek_v41_flash"),
                                       ("GlmMoeDsaForCausalLM", "glm53"), ("MuseSparkForConditionalGeneration", "muse_spark"),
                                       ("MuseSpark1xForCausalLM", "muse_spark")])
def test_adapter_found_by_hf_architecture(registry, arch, name):
    assert registry.adapter_for_architecture([arch]).name == name
    assert registry.adapter(arch).name == name


# ------------------------------------------------------------------------------------------------
# Full specs vs MODELS.md
# ------------------------------------------------------------------------------------------------


def test_deepseek_v41_flash_full_spec_matches_models_md():
    s = dsv4.full_spec()
    assert (s.hidden_size, s.num_layers, s.vocab_size, s.max_context) == (5120, 40, 129280, 1_048_576)
    assert s.layer_kinds() == {"sparse_mqa+moe": tuple(range(40))}  # no dense layers
    for layer in s.layers:
        a = layer.attention
        assert isinstance(a, SparseMQAAttentionSpec)
        assert (a.num_heads, a.head_dim, a.rope_dim, a.q_lora_rank) == (64, 512, 64, 1280)
        assert (a.o_groups, a.o_lora_rank, a.sliding_window) == (8, 1024, 128)
    assert s.compress_ratios() == (0,) * 2 + (2,) * 18 + (1,) * 20
    assert tuple(i for i, r in enumerate(s.compress_ratios()) if r == 0) == (0, 1)  # window-only layers
    # Indexers on 2, 8, 14, 20, 24, 28, 32, 36 (32 heads x 128, top-512); the others reuse the latest.
    idx_layers = tuple(l.index for l in s.layers if l.attention.indexer is not None)
    assert idx_layers == (2, 8, 14, 20, 24, 28, 32, 36) == s.index_source_layers
    for i in idx_layers:
        ix = s.layers[i].attention.indexer
        assert (ix.num_heads, ix.head_dim, ix.topk) == (32, 128, 512)
    assert [s.index_source_for(l) for l in (2, 7, 13, 19, 23, 39)] == [2, 2, 8, 14, 20, 36]
    # Layers 20-39 read the global KV projected from layer 20.
    assert {s.kv_source_for(l) for l in range(20, 40)} == {20}
    assert s.kv_source_for(1) is None
    f = s.layers[0].ffn
    assert isinstance(f, MoESpec)
    assert (f.num_experts, f.top_k, f.num_shared_experts, f.expert_intermediate) == (384, 6, 1, 2304)
    assert f.latent_dim is None
    assert (f.activation.kind, f.activation.clamp) == ("swiglu", 10.0)
    r = f.router
    assert (r.score_func, r.bias_corrected, r.renormalize, r.routed_scaling) == ("sqrtsoftplus", True, True, 1.5)
    assert (s.residual.kind, s.residual.streams, s.residual.sinkhorn_iters) == ("mhc", 4, 20)
    assert s.engram.layers == (1, 14) and s.engram.table_dtype == "fp8_e4m3"
    assert s.engram.table_bytes() == pytest.approx(196e9, rel=0.01)  # MODELS.md: 196B Engram (FP8, 1 B/value)
    assert (s.draft.num_layers, s.draft.block_size, s.draft.num_speculative_tokens) == (3, 5, 5)
    assert (s.rope.yarn_factor, s.rope.original_context) == (16.0, 65536)
    assert s.rope.yarn_factor * s.rope.original_context == s.max_context


def test_muse_spark_full_spec_matches_models_md():
    s = muse.full_spec()
    assert (s.hidden_size, s.num_layers, s.vocab_size) == (8192, 62, 202048)
    full = tuple(i for i in range(62) if i % 4 == 1)
    assert s.full_attention_layers() == full and len(full) == 16
    assert len(s.window_layers()) == 46
    for layer in s.layers:
        a = layer.attention
        assert isinstance(a, GQAAttentionSpec)
        assert (a.num_heads, a.num_kv_heads, a.head_dim, a.qk_norm, a.output_gate) == (128, 16, 64, True, "sigmoid")
        assert a.softmax_scale == 5.4730064863875 / 8   # the config's qk_scale_factor, not MODELS.md's 5.473
        if layer.index in full:  # full attention without RoPE
            assert a.sliding_window is None and a.rope_theta is None
        else:
            assert a.sliding_window == 2048 and a.rope_theta == 5e5
        f = layer.ffn
        assert isinstance(f, MoESpec)  # MoE every layer
        assert (f.num_experts, f.top_k, f.num_shared_experts, f.latent_dim) == (256, 8, 0, 4096)
    r = s.layers[0].ffn.router
    assert (r.score_func, r.bias_corrected, r.renormalize, r.routed_scaling, r.fp32) == ("sigmoid", True, True, 1.0,
                                                                                          True)
    assert r.logit_scale == 2.0**-2.5 and r.renormalize_eps == 1e-15
    assert (s.norm.eps, s.norm.zero_centered) == (1e-5, True)
    assert (s.post_norm.eps, s.post_norm.zero_centered) == (1e-8, True)
    assert s.residual.kind == "gated" and (s.residual_gate.temperature, s.residual_gate.floor) == (0.3, 1e-3)
    assert s.embed_norm and s.attn_output_norm and s.latent_post_norm
    assert (s.logits.softcap, s.logits.scale) == (20.0, 2.0**-2.5)
    assert s.draft.num_speculative_tokens == 7


def test_glm53_full_spec_matches_models_md():
    s = glm.full_spec()
    assert (s.hidden_size, s.num_layers, s.vocab_size, s.max_context) == (6144, 78, 154880, 1_048_576)
    assert s.layer_kinds() == {"mla+dense": (0, 1, 2), "mla+moe": tuple(range(3, 78))}
    for layer in s.layers:
        a = layer.attention
        assert isinstance(a, MLAAttentionSpec)
        assert (a.num_heads, a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim,
                a.v_head_dim) == (64, 2048, 512, 192, 64, 256)
        assert a.use_rope and a.rope_interleaved and a.rope_theta == 8e6
        assert (a.indexer.num_heads, a.indexer.head_dim, a.indexer.topk) == (32, 128, 2048)
    # IndexShare: full indexers on {0, 1, 2, 6, 10, ..., 74}, the other 57 reuse.
    assert s.indexer_layers() == (0, 1, 2) + tuple(range(6, 75, 4))
    assert len(s.indexer_layers()) == 21 and len(s.shared_indexer_layers()) == 57
    dense = s.layers[0].ffn
    assert isinstance(dense, DenseMLPSpec) and dense.intermediate == 12288 and s.dense_layers() == (0, 1, 2)
    f = s.layers[3].ffn
    assert (f.num_experts, f.top_k, f.num_shared_experts, f.expert_intermediate) == (256, 8, 1, 2048)
    r = f.router
    assert (r.score_func, r.bias_corrected, r.renormalize, r.routed_scaling, r.fp32) == ("sigmoid", True, True, 2.5,
                                                                                          True)
    assert s.residual.kind == "pre_norm"
    assert (s.mtp.num_layers, s.mtp.num_speculative_tokens) == (1, 5)


# ------------------------------------------------------------------------------------------------
# Tiny specs
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_tiny_covers_every_layer_kind_and_is_small(name):
    a = adapter(name)
    full, tiny = a.spec("full"), a.spec("tiny")
    assert tiny.variant == "tiny" and type(tiny) is type(full)
    assert set(tiny.layer_kinds()) == set(full.layer_kinds())
    assert tiny.vocab_size <= 1024 and tiny.hidden_size <= 128 and tiny.num_layers <= 12
    assert tiny.residual == full.residual and tiny.norm == full.norm
    # Same routing and activation as the full model, only smaller.
    moe_full = next(l.ffn for l in full.layers if l.ffn.kind == "moe")
    moe_tiny = next(l.ffn for l in tiny.layers if l.ffn.kind == "moe")
    assert moe_tiny.router == moe_full.router and moe_tiny.activation == moe_full.activation
    assert (moe_tiny.latent_dim is None) == (moe_full.latent_dim is None)
    assert (moe_tiny.num_shared_experts == 0) == (moe_full.num_shared_experts == 0)


def test_tiny_deepseek_v41_has_every_feature():
    s = dsv4.tiny_spec()
    assert set(s.compress_ratios()) == {0, 1, 2}
    # Some compressed layers reuse another layer's KV and top-k, as in the full model.
    compressed = [l for l in range(s.num_layers) if s.compress_ratios()[l] > 0]
    assert any(s.kv_source_for(l) != l for l in compressed)
    assert any(s.index_source_for(l) != l for l in compressed)
    assert any(l not in s.kv_source_layers for l in s.index_source_layers)  # indexer that borrows keys
    assert s.candidate_source_layer in s.index_source_layers
    assert s.engram.layers == () and s.residual.streams == 4   # the reference and the program refuse Engram
    assert {s.layers[l].attention.compress_ratio for l in s.kv_source_layers} == {1, 2}


def test_tiny_muse_and_glm_have_every_feature():
    m = muse.tiny_spec()
    assert m.full_attention_layers() == (3, 7) and len(m.window_layers()) == 6   # counted from the last layer
    g = glm.tiny_spec()
    assert g.dense_layers() == (0, 1, 2)
    assert g.indexer_layers() == (0, 1, 2, 6) and g.shared_indexer_layers() == (3, 4, 5, 7)


@pytest.mark.parametrize("name", MODELS)
def test_specs_round_trip_through_json(name):
    cls = SPEC_CLASSES[name]
    for variant in ("full", "tiny"):
        s = adapter(name).spec(variant)
        assert cls.model_validate_json(s.model_dump_json()) == s


def test_spec_validators_reject_inconsistent_topology():
    s = glm.tiny_spec()
    with pytest.raises(ValueError, match="IndexShare"):
        glm.Glm53Spec.model_validate({**s.model_dump(), "index_share": {"freq": 2, "skip_offset": 3,
                                                                        "mtp_reuse": True}})
    d = dsv4.tiny_spec()
    with pytest.raises(ValueError, match="indexer present"):
        dsv4.DeepseekV41Spec.model_validate({**d.model_dump(), "index_source_layers": (2, 4)})
    with pytest.raises(ValueError, match="no KV/index source"):
        dsv4.DeepseekV41Spec.model_validate({**d.model_dump(), "kv_source_layers": (4, 6)})


# ------------------------------------------------------------------------------------------------
# Sharding
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_shard_for_every_supported_tp(name):
    a = adapter(name)
    for tp in a.scope().tp_sizes:
        rank = a.spec("full").shard(tp)
        assert rank.tp == tp and type(rank) is type(a.spec("full"))
        assert a.check(Deployment(arch="sm_90", tp=tp, batch=8)) == []
    for tp in (1, 2, 4, 8):  # tiny specs are made to split by TP 1..8
        assert a.spec("tiny").shard(tp).tp == tp


def test_shard_per_rank_shapes():
    d = dsv4.full_spec().shard(8)
    a = d.layers[0].attention
    assert (a.num_heads, a.o_groups, d.layers[0].ffn.expert_intermediate) == (8, 1, 288)
    assert d.engram == dsv4.full_spec().engram  # extras survive sharding
    m = muse.full_spec().shard(16)
    a = m.layers[0].attention
    assert (a.num_heads, a.num_kv_heads, m.layers[0].ffn.expert_intermediate) == (8, 1, 256)
    g = glm.full_spec().shard(8)
    assert (g.layers[0].attention.num_heads, g.layers[0].ffn.intermediate, g.layers[5].ffn.expert_intermediate) == (
        8, 1536, 256)


@pytest.mark.parametrize("name", MODELS)
def test_bad_tp_raises_user_error_naming_the_fix(name):
    a = adapter(name)
    with pytest.raises(UserError, match=rf"TP=3 not supported: {name} needs {HEAD_COUNT_ERRORS[name]} divisible by TP"):
        a.spec("full").shard(3)
    problems = a.check(Deployment(arch="sm_90", tp=3, batch=8))
    assert any("TP=3 not supported (use one of" in p for p in problems)
    assert any(HEAD_COUNT_ERRORS[name] in p for p in problems)


def test_deepseek_tp16_refused_for_its_output_groups():
    # 64 heads would split by 16, but a rank must hold whole output groups (8 of them).
    with pytest.raises(UserError, match="TP=16 not supported: deepseek_v41_flash needs 8 output groups divisible"):
        dsv4.full_spec().shard(16)
    assert 16 not in adapter("deepseek_v41_flash").scope().tp_sizes


# ------------------------------------------------------------------------------------------------
# Plans
# ------------------------------------------------------------------------------------------------


def _plan(registry, name, *, tp, batch, spec_tokens=0, variant="full"):
    return build_plan(adapter(name), registry.implementations, hardware.for_arch("sm_90"), tp=tp, batch=batch,
                      spec_tokens=spec_tokens, variant=variant)


@pytest.mark.parametrize("name", MODELS)
def test_plan_covers_every_op_site_in_scope(registry, name):
    a = adapter(name)
    scope = a.scope()
    for tp in scope.tp_sizes:
        for batch, spec_tokens in ((1, 0), (64, 0), (4, max(scope.spec_tokens))):
            plan = _plan(registry, name, tp=tp, batch=batch, spec_tokens=spec_tokens)
            assert plan.in_scope, plan.scope_problems
            rank = a.spec("full").shard(tp)
            sites = a.op_sites(rank, ParallelSpec(tp=tp), plan.tokens, "sm_90", "bfloat16")
            names = [c.site.name for c in plan.choices]
            assert names == [s.name for s in sites] and len(set(names)) == len(names)
            covered = set()
            for c in plan.choices:
                assert c.site.family in FAMILIES
                assert plan.tokens == batch * (1 + spec_tokens)  # batches are buckets here
                # a per-head norm's rows: every token's heads (one KV head at TP 16); a per-route all-reduce's:
                # every token's routes
                if c.site.ctx.attr("per_head") or c.site.name.endswith("/moe.route_allreduce"):
                    assert c.site.ctx.tokens % plan.tokens == 0
                else:
                    assert c.site.ctx.tokens == plan.tokens
                # Served, or the family has no implementation at all yet (refusals explain the rest).
                assert c.impl is not None or not registry.implementations.family(c.site.family), c.site.name
                covered |= set(c.site.layers)
            assert covered == set(range(rank.num_layers))


def _layers_of(plan, suffix):
    return {l for c in plan.choices if c.site.name.endswith(suffix) for l in c.site.layers}


def test_deepseek_plan_places_model_specific_work(registry):
    s = dsv4.full_spec()
    plan = _plan(registry, "deepseek_v41_flash", tp=8, batch=4)
    assert _layers_of(plan, "/attn.indexer") == set(s.index_source_layers)
    assert _layers_of(plan, "/attn.in_proj") == set(range(s.num_layers))  # q_a | kv | compressor | weights_proj
    assert _layers_of(plan, "/attn.indexer.k_proj") == {2, 8, 14, 20}
    assert _layers_of(plan, "/attn.compressor") == {2, 8, 14, 20}
    assert _layers_of(plan, "/engram.prefetch") == _layers_of(plan, "/engram.wkv") == {1, 14}
    assert _layers_of(plan, "/attn.sparse_mqa.window") == {0, 1}
    assert _layers_of(plan, "/attn.sparse_mqa.c2") == set(range(2, 20))
    assert _layers_of(plan, "/attn.sparse_mqa.c1") == set(range(20, 40))
    # Layer kinds by what a layer owns (the sparse MQA piece: window-only, KV source, indexer, reuse).
    assert _layers_of(plan, "sparse_mqa.c1.idx+moe/attn.indexer") == {24, 28, 32, 36}
    assert _layers_of(plan, "sparse_mqa.c2+moe/attn.sparse_mqa.c2") == set(range(3, 20)) - {8, 14}
    # The mHC residual piece: a seam (residual.mhc: mixing coefficients from the 4 x 5120 streams, Sinkhorn,
    # collapse, input norm) in front of every sublayer and at the end; plain all-reduce sites at TP > 1.
    for site in ("/attn.mhc", "/ffn.mhc"):
        assert _layers_of(plan, site) == set(range(40))
        mhc = plan.choice("sparse_mqa.c1+moe" + site)
        assert mhc.site.family == "residual.mhc"
        assert (mhc.site.ctx.dim("N"), mhc.site.ctx.dim("streams"), mhc.site.ctx.dim("iters")) == (5120, 4, 20)
        assert mhc.site.weight_bytes == 24 * 4 * 5120 * 4 + 5120 * 2  # the fp32 projection + the norm
    assert plan.choice("final.mhc").site.ctx.attr("mix") is False
    for site in ("sparse_mqa.c1+moe/attn.allreduce", "sparse_mqa.c1+moe/ffn.allreduce"):
        ctx = plan.choice(site).site.ctx
        assert (ctx.attr("residual"), ctx.attr("norm")) == (False, False)
    names = [c.site.name for c in plan.choices]
    assert names.index("sparse_mqa.window+moe/engram.wkv") < names.index("sparse_mqa.window+moe/attn.mhc")
    assert not any(n.endswith(("mhc_gemm", "attn.norm")) or n == "final_norm" for n in names)
    att = plan.choice("sparse_mqa.c1+moe/attn.sparse_mqa.c1").site.ctx
    assert (att.dim("heads"), att.dim("head_dim"), att.dim("topk"), att.dim("window")) == (8, 512, 512, 128)
    assert att.attr("sinks") is True and plan.choice("sparse_mqa.c1+moe/moe.experts").site.ctx.attr("clamp") == 10.0
    ix = plan.choice("sparse_mqa.c1.src.idx+moe/attn.indexer").site.ctx
    assert (ix.dim("heads"), ix.dim("head_dim"), ix.dim("topk"), ix.attr("k_norm")) == (32, 128, 512, "rms")
    o_a = plan.choice("sparse_mqa.c1+moe/attn.o_a_proj").site.ctx  # one group per rank at TP 8: 8 heads x 512
    assert (o_a.attr("groups"), o_a.dim("K"), o_a.dim("N")) == (1, 4096, 1024)
    # The routed-MoE piece: the router split across ranks (E / tp rows), fp32 logits, non-default routing.
    router = plan.choice("sparse_mqa.c1+moe/moe.router_gemm").site.ctx
    assert (router.dim("N"), router.attr("out_dtype")) == (384 // 8, "float32")
    assert plan.choice("sparse_mqa.c1+moe/moe.router").site.ctx.attr("routed_scaling") == 1.5


def test_muse_plan_places_model_specific_work(registry):
    s = muse.full_spec()
    plan = _plan(registry, "muse_spark", tp=8, batch=4)
    # Two layer kinds (GQA pieces of two specs): sliding-window RoPE layers and full NoPE layers.
    assert _layers_of(plan, "gqa.full+moe/attn.gqa") == set(s.full_attention_layers())
    assert _layers_of(plan, "gqa.window+moe/attn.gqa") == set(s.window_layers())
    assert plan.choice("gqa.window+moe/attn.gqa").site.ctx.dim("window") == 2048
    assert plan.choice("gqa.full+moe/attn.gqa").site.ctx.dim("window") == 0
    w = "gqa.window+moe"
    # GQA piece: the sigmoid gate's rows ride in qkv_proj ((2 x 16 heads + 2 x 2 KV heads) x 64 per rank),
    # weightless per-head QK norms (rows = tokens x heads); Muse's output norm (gated form) before o_proj.
    assert plan.choice(f"{w}/attn.qkv_proj").site.ctx.dim("N") == (2 * 16 + 2 * 2) * 64
    q_norm = plan.choice(f"{w}/attn.q_norm").site.ctx
    assert (q_norm.tokens, q_norm.dim("N"), q_norm.attr("weight")) == (4 * 16, 64, False)
    names = [c.site.name for c in plan.choices]
    assert names.index(f"{w}/attn.out_norm") == names.index(f"{w}/attn.gqa") + 1
    assert plan.choice(f"{w}/attn.out_norm").site.ctx.attr("gate") is True
    assert plan.choice("embed_norm").site.layers == () and plan.choice("embed_norm").site.ctx.attr("weight") is False
    # The sandwich-normed gated residual: every join one residual.gated site (post-norm, gate, next norm),
    # layer 0's input norm, the partial sums plain all-reduce sites; no final_norm site (the last ffn.join).
    joins = {site: plan.choice(f"{w}/{site}").site.ctx for site in ("attn.join", "ffn.join")}
    assert all(c.family == "residual.gated" and c.attr("gate") and c.attr("stream") == "float32"
               for c in joins.values())
    assert (joins["attn.join"].attr("post"), joins["ffn.join"].attr("post")) == ("weightless", "input_scaled")
    assert plan.choice(f"{w}/attn.norm").site.layers == (0,) and "gqa.full+moe/attn.norm" not in names
    assert plan.choice(f"{w}/attn.allreduce").site.ctx.attr("residual") is False and "final_norm" not in names
    # The latent MoE piece's sites: router (fp32 logits, E/tp rows) and latent down-projection (Ld/tp) or
    # both in moe.gate_down; the pre-expert norm (input_norm); the experts with the per-expert post-norm;
    # the experts' all-reduce (no latent norm after it); the up-projection of the rank's hidden slice.
    router = plan.choice(f"{w}/moe.router_gemm").site.ctx
    assert (router.dim("N"), router.dim("K"), router.attr("out_dtype")) == (256 // 8, 8192, "float32")
    assert plan.choice(f"{w}/moe.latent_down").site.ctx.dim("N") == 4096 // 8
    assert plan.choice(f"{w}/moe.gate_down").site.ctx.dim("N") == 256 // 8 + 4096 // 8
    assert plan.choice(f"{w}/moe.latent_norm").site.ctx.dim("N") == 4096
    # the per-expert post-norm: per-route expert rows, summed over ranks per route, normed + weighted + combined
    assert plan.choice(f"{w}/moe.experts").site.ctx.attr("per_route") is True
    assert plan.choice(f"{w}/moe.route_allreduce").site.ctx.tokens == 4 * 8
    assert plan.choice(f"{w}/moe.finalize").site.ctx.attr("norm") == "input_scaled"
    assert f"{w}/moe.latent_allreduce" not in names
    up = plan.choice(f"{w}/moe.latent_up").site.ctx
    assert (up.dim("N"), up.dim("K")) == (8192 // 8, 4096)
    assert not any(n.endswith("moe.latent_post_norm") for n in names)
    assert plan.choice(f"{w}/moe.router").site.ctx.attr("logit_scale") == 2.0**-2.5
    head = adapter("muse_spark").composed_model(s).head   # the soft cap is the head piece's glue, not a gemm attr
    assert (head.softcap, head.logit_scale) == (20.0, 0.1767766952966369)


def test_glm_plan_runs_the_indexer_on_21_layers_only(registry):
    s = glm.full_spec()
    plan = _plan(registry, "glm53", tp=8, batch=4)
    # The sparse MLA piece: layers that run their own indexer and layers that reuse its top-k are kinds of
    # their own; the indexer's projections ride in the fused latent / query projections of its layers.
    assert _layers_of(plan, "/attn.indexer") == set(s.indexer_layers())
    assert _layers_of(plan, "mla.reuse+moe/attn.sparse_mla") == set(s.shared_indexer_layers())
    assert _layers_of(plan, "/attn.sparse_mla") == set(range(78))
    assert not any(c.site.name.endswith(("attn.mla", "attn.indexer.q_proj", "attn.kv_a_norm")) for c in plan.choices)
    full, reuse = (plan.choice(f"{k}/attn.qkv_a_proj").site.ctx.dim("N") for k in ("mla+moe", "mla.reuse+moe"))
    assert (reuse, full) == (2048 + 512 + 64, 2048 + 512 + 64 + 128 + 32)   # + indexer key and head weights
    assert plan.choice("mla+moe/attn.q_b_proj").site.ctx.dim("N") == 8 * 256 + 32 * 128  # + indexer queries
    assert plan.choice("mla+moe/attn.sparse_mla").site.ctx.dim("topk") == 2048
    assert plan.choice("mla+moe/attn.indexer").site.ctx.attr("rope_interleaved") is True
    assert plan.choice("mla+moe/moe.router").site.ctx.attr("routed_scaling") == 2.5
    # The MLA piece's sites: the kv_a norm is part of the attention op (no site), q_b names its norm site; the
    # pre-norm piece: one input norm (layer 0), the final norm inside the last ffn.allreduce.
    names = {c.site.name for c in plan.choices}
    assert "final_norm" not in names and plan.choice("mla+dense/attn.norm").site.layers == (0,)
    assert plan.choice("mla+moe/attn.q_b_proj").site.ctx.attr("norm_site") == "attn.q_a_norm"
    assert plan.choice("mla+moe/moe.router_gemm").site.ctx.attr("out_dtype") == "float32"


@pytest.mark.parametrize("name", MODELS)
def test_explain_cli_prints_the_plan(capsys, name):
    assert cli_main(["explain", "--model", name, "--tp", "8", "--batch", "4", "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"plan: {name} (full) on sm_90")
    assert cli_main(["explain", "--model", name, "--tp", "3", "--arch", "sm_90"]) == 2
    assert "divisible by TP" in capsys.readouterr().err


@pytest.mark.parametrize("name", MODELS)
def test_context_reaches_the_attention_sites_and_is_checked_against_max_context(registry, name, capsys):
    a = adapter(name)
    plan = build_plan(a, registry.implementations, hardware.for_arch("sm_90"), tp=8, batch=4, context=32768)
    assert plan.context == 32768 and plan.in_scope
    attention = [c for c in plan.choices if c.site.family.startswith("attention.")]
    assert attention and all(c.site.ctx.attr("context") == 32768 for c in attention)
    assert all(c.site.ctx.attr("context") is None for c in plan.choices if not c.site.family.startswith("attention."))
    beyond = a.spec("full").max_context + 1
    fix = f"use a context of at most {a.spec('full').max_context} tokens"
    assert any(fix in p for p in a.check(Deployment(arch="sm_90", tp=8, batch=4, context=beyond)))
    plan = build_plan(a, registry.implementations, hardware.for_arch("sm_90"), tp=8, batch=4, context=beyond)
    assert not plan.in_scope and any(fix in p for p in plan.scope_problems)
    assert cli_main(["explain", "--model", name, "--tp", "8", "--batch", "4", "--arch", "sm_90", "--context",
                     "32768"]) == 0
    assert "context: up to 32768 tokens per sequence" in capsys.readouterr().out
    assert cli_main(["explain", "--model", name, "--tp", "8", "--arch", "sm_90", "--context", str(beyond)]) == 2
    assert fix in capsys.readouterr().err


@pytest.mark.parametrize("name", MODELS)
def test_tiny_plan_on_cpu(registry, name):
    plan = build_plan(adapter(name), registry.implementations, hardware.for_arch("cpu"), tp=2, batch=2,
                      dtype="float32", variant="tiny")
    assert plan.in_scope and plan.counts()["sites"] == len(plan.choices) > 0
