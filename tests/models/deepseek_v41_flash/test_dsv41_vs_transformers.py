"""DeepSeek-V4.1 reference vs transformers' ``deepseek_v4`` on the subset the two architectures share.

transformers 5.19's ``deepseek_v4`` is DeepSeek-V4 (Flash-Base), the same family: sparse MQA with one 512-style
KV head (K = V), partial interleaved RoPE with the inverse rotation on the output, per-head sinks, sliding window,
grouped low-rank output, mHC with Sinkhorn, sqrtsoftplus router with bias, SwiGLU clamp. It differs from V4.1 in:
compression (CSA ratio 4 / HCA ratio 128, each layer its own compressor; V4.1: ratio 2 / 1 shared from KV-source
layers, indexers shared likewise, candidate blocks), hash-routed first MoE layers, no Engram, a learned final
``hc_head``, and the mHC collapse: V4 collapses a sublayer's input with its own seam's ``pre``, V4.1 (vLLM's
"delayed" form) with the previous seam's. The shared subset: sliding-window-only layers, top-k MoE, and a constant
``pre`` (its rows of ``fn`` zero, the same bias everywhere, summing to 1 over the streams) - then both collapses agree.
Tiny model built and saved by transformers, loaded back, teacher-forced logits in fp32.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
DeepseekV4Config = pytest.importorskip("transformers.models.deepseek_v4").DeepseekV4Config

from latency_specialized_models.deepseek_v41_flash import names as N  # noqa: E402
from latency_specialized_models.deepseek_v41_flash.reference import DeepseekV41Reference  # noqa: E402
from latency_specialized_models.deepseek_v41_flash.spec import (  # noqa: E402
    DraftSpec, EngramSpec, RopeSpec, build_spec)

L, HC, EPS = 3, 4, 1e-6


def our_spec():
    return build_spec(
        variant="tiny", hidden=64, vocab=256, ratios=(0,) * L, heads=16, head_dim=32, rope_dim=8, q_lora=32,
        o_groups=8, o_lora=16, window=8, kv_sources=(), index_sources=(), idx_heads=4, idx_dim=16, idx_topk=16,
        candidate_layer=-1, candidate_blocks=0, candidate_block=0, experts=8, top_k=3, shared=1, expert_inter=32,
        engram=EngramSpec(layers=(), num_embeddings=(), max_ngram=2, n_heads=0, head_dim=0),
        draft=DraftSpec(num_layers=0, block_size=0, num_speculative_tokens=0, num_experts=0, top_k=0,
                        target_layers=()), max_context=4096,
        rope=RopeSpec(theta=10000.0, compress_theta=160000.0, yarn_factor=1.0, original_context=4096),
        norm_eps=EPS, routed_scaling=1.5, swiglu_clamp=10.0, hc_mult=HC, hc_iters=20, hc_eps=EPS)


def hf_config():
    return DeepseekV4Config(
        vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=L, num_attention_heads=16,
        head_dim=32, q_lora_rank=32, partial_rotary_factor=8 / 32, num_experts_per_tok=3, n_routed_experts=8,
        n_shared_experts=1, layer_types=["sliding_attention"] * L, mlp_layer_types=["moe"] * L, sliding_window=8,
        o_groups=8, o_lora_rank=16, hc_mult=HC, hc_sinkhorn_iters=20, hc_eps=EPS, rms_norm_eps=EPS,
        rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                         "compress": {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": 0.25}},
        num_nextn_predict_layers=0, index_n_heads=4, index_head_dim=16, index_topk=16, tie_word_embeddings=False)


ATTN = {"q_a_proj": "wq_a", "q_a_norm": "q_norm", "q_b_proj": "wq_b", "kv_proj": "wkv", "kv_norm": "kv_norm",
        "o_a_proj": "wo_a", "o_b_proj": "wo_b"}


def to_hf(named: dict[str, torch.Tensor], E: int) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": named["embed.weight"], "lm_head.weight": named["head.weight"],
           "model.norm.weight": named["norm.weight"]}
    for i in range(L):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        out[p + "input_layernorm.weight"] = named[q + "attn_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = named[q + "ffn_norm.weight"]
        for sub in ("attn", "ffn"):
            for k in ("fn", "base", "scale"):
                out[f"{p}{sub}_hc.{k}"] = named[f"{q}hc_{sub}_{k}"]
        for hf, ours in ATTN.items():
            out[f"{p}self_attn.{hf}.weight"] = named[f"{q}attn.{ours}.weight"]
        out[p + "self_attn.sinks"] = named[q + "attn.attn_sink"]
        out[p + "mlp.gate.weight"] = named[q + "ffn.gate.weight"]
        out[p + "mlp.gate.e_score_correction_bias"] = named[q + "ffn.gate.bias"]
        ex = [f"{q}ffn.experts.{e}." for e in range(E)]
        out[p + "mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([named[x + "w1.weight"], named[x + "w3.weight"]]) for x in ex])
        out[p + "mlp.experts.down_proj"] = torch.stack([named[x + "w2.weight"] for x in ex])
        for hf, ours in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            out[f"{p}mlp.shared_experts.{hf}.weight"] = named[f"{q}ffn.shared_experts.{ours}.weight"]
    return out


def from_saved(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' ``save_pretrained`` writes DeepSeek's own checkpoint names (its conversion mapping, reversed)
    under a ``model.`` prefix; the kv norm comes out as ``attn.norm`` (vLLM's V4.1 name: ``attn.kv_norm``)."""
    out = {}
    for k, v in saved.items():
        k = k.removeprefix("model.").replace("embed_tokens.", "embed.").replace(".attn.norm.", ".attn.kv_norm.")
        if not k.startswith("hc_head."):
            out[k] = v
    return out


@pytest.mark.parametrize("constant_pre", [True, False])
def test_teacher_forced_logits_match_transformers(tmp_path, constant_pre):
    from safetensors.torch import load_file
    from transformers import DeepseekV4ForCausalLM

    spec = our_spec()
    named = N.random_weights(spec, 3, torch.float32)
    base = math.log(0.25 - EPS) - math.log(0.75 + EPS)          # sigmoid(base) + eps = 1/4 on every stream
    for i in range(L if constant_pre else 0):
        for sub in ("attn", "ffn"):
            named[f"layers.{i}.hc_{sub}_fn"][:HC] = 0.0
            named[f"layers.{i}.hc_{sub}_base"][:HC] = base
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(hf_config()).float().eval()
    state = to_hf(named, 8)
    state.update({"model.hc_head.hc_fn": torch.zeros(HC, HC * 64), "model.hc_head.hc_base": torch.full((HC,), base),
                  "model.hc_head.hc_scale": torch.ones(1)})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    ours = from_saved(saved)
    assert set(ours) == set(N.expected_tensors(spec))               # the official names, nothing else
    ref = DeepseekV41Reference(spec, ours)

    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits[0]
    got = ref.prefill(ref.new_cache(), 0, 0, ids[0])
    assert want.std() > 0.3
    if not constant_pre:   # V4.1's delayed collapse is not V4's: a pre-mix that varies per seam tells them apart
        assert (got - want).abs().max() > 1e-3
        return
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
