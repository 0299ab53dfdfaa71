"""Kimi K3 spec: every published number (MODELS.md), the tiny variant's coverage, TP sharding, config keys."""

from __future__ import annotations

import json

import pytest

from latency_specialized.config_keys import UnknownConfigKeysWarning
from latency_specialized.errors import CheckpointError, UserError
from latency_specialized.plugins import get_registry

from latency_specialized_models.kimi_k3.config import config_from_spec, spec_from_config
from latency_specialized_models.kimi_k3.spec import KimiK3Spec, full_spec, tiny_spec
from latency_specialized_models.kimi_k3.composed import expected_tensors


def test_full_spec_matches_models_md():
    s = full_spec()
    assert isinstance(s, KimiK3Spec)
    assert (s.hidden_size, s.num_layers, s.vocab_size, s.max_context, s.norm.eps) == (7168, 93, 163840, 1_048_576, 1e-5)
    # 69 KDA + 24 MLA, MLA on 1-indexed 4, 8, ..., 92 and 93
    assert [i + 1 for i in s.mla_layers] == list(range(4, 93, 4)) + [93]
    assert len(s.kda_layers) == 69 and len(s.mla_layers) == 24
    kda = s.layers[0].attention
    assert (kda.kind, kda.num_heads, kda.head_dim, kda.conv_kernel, kda.decay_rank, kda.gate_lower_bound) == \
        ("kda", 96, 128, 4, 128, -5.0)
    mla = s.layers[3].attention
    assert (mla.kind, mla.num_heads, mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
            mla.v_head_dim, mla.use_rope, mla.output_gate, mla.latent_width) == \
        ("mla", 96, 1536, 512, 128, 64, 128, False, "sigmoid", 576)
    assert s.dense_layers == (0,) and s.layers[0].ffn.intermediate == 33792
    moe = s.layers[1].ffn
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.expert_intermediate, moe.latent_dim) == \
        (896, 16, 2, 3072, 3584)
    r = moe.router
    assert (r.score_func, r.bias_corrected, r.renormalize, r.routed_scaling) == ("sigmoid", True, True, 1.0)
    a = moe.activation
    assert (a.kind, a.beta, a.beta_lin) == ("situ_glu", 4.0, 25.0)
    assert s.layers[0].ffn.activation == a
    assert (s.residual.kind, s.residual.block_size, s.residual.max_cached_blocks) == ("attnres", 12, 8)
    assert s.attnres_rows == 9  # 8 stored blocks (embedding + 7 completed) + the partial one
    assert s.latent_moe_norm and s.routed_expert_format == "mxfp4" and not s.tie_word_embeddings
    # KDA state per sequence and layer: 96 * 128 * 128 fp32 = 6 MiB
    assert kda.num_heads * kda.head_dim ** 2 * 4 == 6 * 2**20


def test_full_spec_tensor_shapes_match_published_checkpoint():
    exp = expected_tensors(full_spec())
    shapes = {  # from a public ledger of the published checkpoint (text model names)
        "model.embed_tokens.weight": (163840, 7168), "lm_head.weight": (163840, 7168),
        "model.layers.0.mlp.gate_proj.weight": (33792, 7168), "model.layers.0.mlp.down_proj.weight": (7168, 33792),
        "model.layers.0.self_attention_res_proj.weight": (1, 7168), "model.layers.0.mlp_res_norm.weight": (7168,),
        "model.layers.0.self_attn.b_proj.weight": (96, 7168), "model.layers.0.self_attn.f_a_proj.weight": (128, 7168),
        "model.layers.0.self_attn.f_b_proj.weight": (12288, 128), "model.layers.0.self_attn.g_proj.weight": (12288, 7168),
        "model.layers.0.self_attn.o_proj.weight": (7168, 12288), "model.layers.0.self_attn.dt_bias": (12288,),
        "model.layers.0.self_attn.q_conv1d.weight": (12288, 1, 4), "model.layers.0.self_attn.o_norm.weight": (128,),
        "model.layers.1.block_sparse_moe.gate.weight": (896, 7168),
        "model.layers.1.block_sparse_moe.gate.e_score_correction_bias": (896,),
        "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight": (3584, 7168),
        "model.layers.1.block_sparse_moe.routed_expert_up_proj.weight": (7168, 3584),
        "model.layers.1.block_sparse_moe.routed_expert_norm.weight": (3584,),
        "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight": (6144, 7168),
        "model.layers.1.block_sparse_moe.experts.0.w1.weight": (3072, 3584),
        "model.layers.1.block_sparse_moe.experts.895.w2.weight": (3584, 3072),
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": (576, 7168),
        "model.layers.3.self_attn.kv_b_proj.weight": (24576, 512),
        "model.layers.3.self_attn.q_a_proj.weight": (1536, 7168), "model.layers.3.self_attn.q_b_proj.weight": (18432, 1536),
        "model.layers.92.self_attn.g_proj.weight": (12288, 7168),
        "model.norm.weight": (7168,), "model.output_attn_res_proj.weight": (1, 7168),
    }
    for name, shape in shapes.items():
        assert exp[name][0] == shape, name
    assert exp["model.layers.0.self_attn.A_log"] == ((96,), "float32")   # fp32 in the checkpoint


def test_tiny_covers_every_feature():
    t = tiny_spec()
    assert set(t.layer_kinds()) == {"kda+dense", "kda+moe", "mla+moe"}
    assert t.mla_layers == (3, 6)                         # "every 4th (1-indexed) and the last" rule
    assert t.num_layers % t.attnres_block != 0             # a partial block at the end, as in the full model
    assert t.num_layers // t.attnres_block >= 2            # at least two completed blocks
    moe = t.layers[1].ffn
    assert moe.latent_dim and moe.num_shared_experts == 2 and moe.top_k < moe.num_experts
    assert t.layers[0].ffn.kind == "dense" and t.latent_moe_norm
    assert t.layers[3].attention.output_gate == "sigmoid" and not t.layers[3].attention.use_rope


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_full_shard_shapes(tp):
    s = full_spec().shard(tp)
    assert s.tp == tp and isinstance(s, KimiK3Spec)
    assert s.layers[0].attention.num_heads == 96 // tp
    assert s.layers[3].attention.num_heads == 96 // tp
    assert s.layers[1].ffn.expert_intermediate == 3072 // tp
    assert s.layers[0].ffn.intermediate == 33792 // tp
    assert s.layers[1].ffn.latent_dim == 3584 and s.hidden_size == 7168  # replicated widths


@pytest.mark.parametrize("tp,why", [(0, "positive"), (5, "96 KDA heads divisible"), (3, "hidden size 7168 divisible"),
                                    (6, "hidden size 7168 divisible"), (32, "shards for TP 1, 2, 4, 8, 16")])
def test_unsupported_tp_names_the_fix(tp, why):
    with pytest.raises(UserError, match=f"TP={tp} .*{why}"):
        full_spec().shard(tp)


def test_tiny_tp16_error_names_heads():
    with pytest.raises(UserError, match="heads divisible by TP"):
        tiny_spec().shard(16)


def test_plan_explains_tp8_for_h200():
    from latency_specialized import hardware
    from latency_specialized.ops.plan import build_plan

    reg = get_registry()
    plan = build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.for_arch("sm_90"), tp=8, batch=4)
    names = [c.site.name for c in plan.choices]
    assert plan.counts()["unserved"] == 0
    assert "kda+moe/attn.attnres" in names and "final.attnres" in names and "mla+moe/attn.mla" in names
    in_proj = plan.choice("kda+moe/attn.in_proj").site.ctx
    # q, k, v, g of 12 local heads + f_a + beta = 6284 rows, zero-padded to 16 (as vLLM pads it)
    assert in_proj.dim("N") == 6288 and (4 * 12 * 128 + 128 + 12) == 6284
    router = plan.choice("kda+moe/moe.router_gemm").site.ctx
    assert router.dim("N") == 896 // 8 and router.attr("out_dtype") == "float32"  # split across ranks, fp32 logits
    assert plan.choice("kda+moe/moe.latent_down").site.ctx.dim("N") == 3584 // 8


@pytest.mark.parametrize("layout", ["kimi_k3", "kimi_linear"])
@pytest.mark.parametrize("make", [full_spec, tiny_spec])
def test_config_round_trip(layout, make):
    spec = make()
    cfg = json.loads(json.dumps(config_from_spec(spec, layout=layout)))
    back, extras = spec_from_config(cfg)
    assert back == spec and extras["layout"] == layout


def test_config_errors_name_the_key():
    cfg = config_from_spec(tiny_spec())
    bad = json.loads(json.dumps(cfg))
    bad["text_config"]["mystery_knob"] = 3
    with pytest.warns(UnknownConfigKeysWarning, match=r"text_config\.mystery_knob"):
        assert spec_from_config(bad)[0] == tiny_spec()  # ignored and named once, not an error
    bad = json.loads(json.dumps(cfg))
    bad["text_config"]["mla_use_nope"] = False
    with pytest.raises(CheckpointError, match="mla_use_nope"):
        spec_from_config(bad)
    bad = json.loads(json.dumps(cfg))
    del bad["text_config"]["kv_lora_rank"]
    with pytest.raises(CheckpointError, match="kv_lora_rank is missing"):
        spec_from_config(bad)
    bad = json.loads(json.dumps(cfg))
    bad["text_config"]["linear_attn_config"]["kda_layers"] = [1, 2]
    with pytest.raises(CheckpointError, match="kda_layers/full_attn_layers"):
        spec_from_config(bad)
    with pytest.raises(CheckpointError, match="model_type"):
        spec_from_config({"model_type": "llama"})
