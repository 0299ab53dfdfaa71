"""GLM-5.3 against transformers' ``GlmMoeDsaForCausalLM`` (the venv's transformers ships it; never skipped).

A tiny random model - 6 layers: 2 dense + 4 MoE (8 experts top-2, 1 shared), MLA with q_lora, the DSA
indexer on layers {0, 1, 3, 5} and IndexShare reuse on {2, 4} (``index_topk_freq`` 2 / offset 2), top-6 of up
to 24 tokens so the selection bites, RoPE base 500 (not transformers' default), every gain / bias random -
is saved by transformers (fp32) and loaded by ``names.load``; ``Glm53Reference.prefill`` in two chunks (10 +
14 tokens, shuffled pages of 4) must give transformers' teacher-forced logits (max|ours - theirs| /
max|theirs| <= 1e-4; measured 8e-7). The op families' references (indexer, sparse MLA) then read the caches
the reference wrote and give its selection and transformers' attention output (the layout the piece reads)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from latency_specialized.config_keys import UnknownConfigKeysWarning
from latency_specialized.ops.attention.sparse_mla import indexer_topk_reference, sparse_mla_decode_reference
from latency_specialized.ops.rope import apply_rope, rope_inv_freq
from latency_specialized_models.glm53 import names
from latency_specialized_models.glm53.reference import Glm53Reference, rms
from latency_specialized_models.glm53.spec import tiny_spec

transformers = pytest.importorskip("transformers")   # a dependency of the venv: present, never skipped there

TOL = 1e-4
CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=6,
           first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
           n_shared_experts=1, index_topk=6, index_head_dim=16, index_n_heads=16, index_topk_freq=2,
           index_skip_topk_offset=2, max_position_embeddings=64, rms_norm_eps=1e-5,
           rope_parameters={"rope_type": "default", "rope_theta": 500.0})
IDS = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(7))


def rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.double() - theirs.double()).abs().max() / theirs.double().abs().max()).item()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(transformers model, its save_pretrained directory): gains 1 + 0.2 N, biases 0.1 N, projections
    N(0, 1/fan-in), embedding N(0, 1) (transformers' 0.02 init would make every logit ~0)."""
    torch.manual_seed(0)
    hf = transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(**CFG, attn_implementation="eager")).eval()
    g = torch.Generator().manual_seed(1)
    sd = {}
    for n, t in hf.state_dict().items():
        x = torch.randn(t.shape, generator=g)
        sd[n] = 0.1 * x if n.endswith("bias") else 1 + 0.2 * x if "norm" in n else x if "embed" in n \
            else x / math.sqrt(t.shape[-1])
    hf.load_state_dict(sd)
    d = tmp_path_factory.mktemp("glm53_tf")
    hf.save_pretrained(d)
    return hf, d


@pytest.fixture(scope="module")
def ref(saved):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownConfigKeysWarning)   # every key transformers writes is known
        spec, named, _ = names.load(saved[1], torch.float32)
    return Glm53Reference(spec, named)


@pytest.fixture(scope="module")
def want(saved):
    with torch.no_grad():
        return saved[0](IDS[None]).logits[0]


def test_spec_from_what_transformers_saved(ref):
    s = ref.spec
    assert s.indexer_layers() == (0, 1, 3, 5) and s.shared_indexer_layers() == (2, 4) and s.dense_layers() == (0, 1)
    a = s.layers[0].attention
    assert (a.rope_theta, s.max_context, a.indexer.topk, a.indexer.num_heads, s.mtp.num_layers) == (500.0, 64, 6, 16, 0)


def test_prefill_in_two_chunks_equals_transformers(ref, want):
    cache = ref.new_cache(1, 24, block_size=4, shuffle_seed=3)
    slot = cache.slots[0]
    got = torch.cat([ref.prefill(cache, slot, 0, IDS[:10]), ref.prefill(cache, slot, 10, IDS[10:])])
    assert rel(got, want) <= TOL
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_sparsity_bites(ref, want):
    """With every token selected (top-64) the logits move well past the tolerance: the top-6 selection matters."""
    def wide(layer):
        ix = layer.attention.indexer.model_copy(update={"topk": 64})
        return layer.model_copy(update={"attention": layer.attention.model_copy(update={"indexer": ix})})
    dense = Glm53Reference(ref.spec.model_copy(update={"layers": tuple(map(wide, ref.spec.layers))}), ref.named)
    cache = dense.new_cache(1, 24, block_size=4)
    assert rel(dense.prefill(cache, cache.slots[0], 0, IDS), want) > 100 * TOL


def test_ops_read_the_reference_caches(ref, saved):
    """Layer 0 at the last position, through the op families' references over the caches ``prefill`` wrote:
    ``attention.indexer`` rewrites the same key there (LayerNorm, in-place interleaved RoPE) and selects the
    reference's tokens; ``attention.sparse_mla`` rewrites the same latent and gives transformers' attention
    output (the input of its ``o_proj``)."""
    seen = []
    hook = saved[0].model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        saved[0](IDS[None])
    hook.remove()
    cache = ref.new_cache(1, 24, block_size=4, shuffle_seed=5)
    slot, n, bs = cache.slots[0], 24, cache.block_size
    ref.prefill(cache, slot, 0, IDS)
    W, s = ref.W, ref.spec
    a, p = s.layers[0].attention, "model.layers.0."
    x = rms(W("model.embed_tokens.weight")[IDS], W(p + "input_layernorm.weight"), s.norm.eps)
    q_c = rms(x @ W(p + "self_attn.q_a_proj.weight").T, W(p + "self_attn.q_a_layernorm.weight"), s.latent_norm_eps)
    kc, kv = cache.layer(0)["indexer_k"], cache.layer(0)["kv"]
    before, kv_before = kc.clone(), kv.clone()
    at = torch.arange(n)
    flat = torch.tensor(slot.blocks)[at // bs] * bs + at % bs
    mask = ref.indexer(p + "self_attn.indexer.", x, q_c, at, before.flatten(0, 1), flat, 0, at[:, None] >= at)[-1]
    ix, ip, inv = a.indexer, p + "self_attn.indexer.", rope_inv_freq(a.rope_theta, a.qk_rope_head_dim)
    meta = dict(slot_mapping=flat[-1:], block_table=torch.tensor([slot.blocks]), seq_lens=torch.tensor([n]))
    top = indexer_topk_reference(
        (q_c[-1:] @ W(ip + "wq_b.weight").T).view(1, ix.num_heads, ix.head_dim), x[-1:] @ W(ip + "wk.weight").T,
        x[-1:] @ W(ip + "weights_proj.weight").T, kc, **meta, topk=ix.topk, positions=at[-1:], rope_inv_freq=inv,
        rope_interleaved=True, k_norm_weight=W(ip + "k_norm.weight"), k_norm_bias=W(ip + "k_norm.bias"))
    assert torch.allclose(kc, before, atol=1e-6)
    assert sorted(top[0].tolist()) == mask.nonzero().flatten().tolist()
    nope, L = a.qk_nope_head_dim, a.kv_lora_rank
    q = (q_c[-1:] @ W(p + "self_attn.q_b_proj.weight").T).view(1, a.num_heads, -1)
    q = torch.cat([q[..., :nope], apply_rope(q[..., nope:], at[-1:], inv, "interleaved")], -1)
    ckv = x[-1:] @ W(p + "self_attn.kv_a_proj_with_mqa.weight").T
    k_pe = apply_rope(ckv[:, None, L:], at[-1:], inv, "interleaved")[:, 0]
    o = sparse_mla_decode_reference(q, ckv[:, :L], k_pe, kv, **meta, w_kv_b=W(p + "self_attn.kv_b_proj.weight"),
                                    topk_indices=top, qk_nope_head_dim=nope, v_head_dim=a.v_head_dim,
                                    kv_norm_weight=W(p + "self_attn.kv_a_layernorm.weight"),
                                    kv_norm_eps=s.latent_norm_eps)
    assert torch.allclose(kv, kv_before, atol=1e-6)
    assert rel(o, seen[0][0, -1:]) <= TOL


def test_tiny_spec_prefill_then_decode_equals_one_prefill():
    """The adapter's tiny spec (IndexShare layers, MTP declared, top-16 of 30 tokens) on random weights: one
    prefill == a prefill of 12 then token-by-token decode over shuffled pages."""
    spec = tiny_spec()
    r = Glm53Reference(spec.shard(2), names.random_weights(spec, seed=1, dtype=torch.float32))
    ids = torch.randint(0, spec.vocab_size, (30,), generator=torch.Generator().manual_seed(2))
    c1, c2 = r.new_cache(1, 30, block_size=4), r.new_cache(2, 30, block_size=4, shuffle_seed=9)
    want = r.prefill(c1, c1.slots[0], 0, ids)
    got = [r.prefill(c2, c2.slots[1], 0, ids[:12])]
    got += [r.decode(c2, [c2.slots[1]], [t], ids[t:t + 1]) for t in range(12, 30)]
    assert rel(torch.cat(got), want) <= 1e-5
