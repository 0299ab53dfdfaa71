"""Qwen3-MoE end to end against transformers: a random ``Qwen3MoeForCausalLM`` built and saved by transformers
(fp32) loads through our checkpoint loader; teacher-forced, the composed decode program (token by token, paged
caches, a batch whose sequences have different lengths and join/leave at different steps) and the plain-torch
reference (whole sequences) both give transformers' logits at every position (relative error <= 1e-4)."""

from __future__ import annotations

import warnings

import pytest
import torch

from latency_specialized.config_keys import UnknownConfigKeysWarning

from tests.models.qwen3_moe.helpers import adapter, hf_model, rel, teacher_forced

transformers = pytest.importorskip("transformers")

TOL = 1e-4
BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1, rms_norm_eps=1e-6,
            max_position_embeddings=128, tie_word_embeddings=False)
CONFIGS = {
    # Qwen3-30B-A3B's features at test size: a dense layer (mlp_only_layers), GQA 2:1, renormalised top-k
    "qwen3-30b-like": BASE,
    # the other config branches: decoder_sparse_step 2 (layers 1, 3 MoE), no renormalisation, MQA,
    # head_dim != hidden / heads, tied embeddings, another eps and RoPE base
    "sparse-step-tied-mqa": dict(BASE, num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2,
                                 norm_topk_prob=False, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
                                 rms_norm_eps=1e-5, rope_parameters={"rope_theta": 1e6, "rope_type": "default"}),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def saved(request, tmp_path_factory):
    """(transformers model, its save_pretrained directory, config name)."""
    hf = hf_model(transformers, CONFIGS[request.param])
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d)
    return hf, d, request.param


def _loaded(d):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownConfigKeysWarning)  # transformers' own keys are all known
        return adapter().reference(None, checkpoint=d, dtype="float32")


def test_loader_reads_what_transformers_saved(saved):
    hf, d, name = saved
    ref = _loaded(d)
    spec, cfg = ref.spec, CONFIGS[name]
    kinds = {i: "gqa+dense" if i in cfg["mlp_only_layers"] or (i + 1) % cfg["decoder_sparse_step"] else "gqa+moe"
             for i in range(cfg["num_hidden_layers"])}
    assert {l.index: l.kind for l in spec.layers} == kinds
    assert spec.tie_word_embeddings == cfg["tie_word_embeddings"] and spec.norm.eps == cfg["rms_norm_eps"]
    a = spec.layers[0].attention
    assert (a.num_heads, a.num_kv_heads, a.head_dim) == (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                                         cfg["head_dim"])
    assert a.rope_theta == cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    sd = hf.state_dict()
    for n, t in ref.named.items():   # per-expert names in the file; transformers keeps them fused in memory
        if ".experts." in n:
            layer, e, proj = n.split(".")[2], int(n.split(".")[5]), n.split(".")[6]
            fused = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e].chunk(2)
            want = {"gate_proj": fused[0], "up_proj": fused[1]}.get(proj)
            want = sd[f"model.layers.{layer}.mlp.experts.down_proj"][e] if want is None else want
        else:
            want = sd[n]
        assert torch.equal(t, want), n


def test_reference_equals_transformers(saved):
    hf, d, _ = saved
    ref = _loaded(d)
    g = torch.Generator().manual_seed(3)
    for T in (1, 7, 13):
        ids = torch.randint(0, ref.spec.vocab_size, (T,), generator=g)
        with torch.no_grad():
            want = hf(ids[None]).logits[0]
        cache = ref.new_cache(1, T, block_size=4, shuffle_seed=T)
        assert rel(ref.prefill(cache, cache.slots[0], 0, ids), want) <= TOL
        # in two chunks: the second reads the first's keys and values from the paged cache
        cache = ref.new_cache(1, T, block_size=4, shuffle_seed=T)
        k = T // 2
        got = torch.cat([ref.prefill(cache, cache.slots[0], 0, ids[:k]), ref.prefill(cache, cache.slots[0], k, ids[k:])])
        assert rel(got, want) <= TOL


def test_program_teacher_forced_equals_transformers(saved):
    """Batch 2: sequence 0 (11 tokens) from step 0, sequence 1 (6 tokens) joins at step 3 and leaves at step 8,
    so the two rows sit at different positions and the bucket is padded before and after."""
    hf, d, _ = saved
    ref = _loaded(d)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, ref.spec.vocab_size, (n,), generator=g) for n in (11, 6)]
    got, program = teacher_forced(adapter(), ref.spec, ref.named, seqs, starts=[0, 3])
    assert program.steps_run == 11 and program.calls["gqa+moe/moe.experts"] > 0
    for b, ids in enumerate(seqs):
        with torch.no_grad():
            want = hf(ids[None]).logits[0].double()
        assert got[b].shape == want.shape
        for t in range(len(ids)):
            assert rel(got[b][t], want[t]) <= TOL, f"sequence {b} position {t}"
        assert torch.equal(got[b].argmax(-1), want.argmax(-1))
