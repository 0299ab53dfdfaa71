"""DeepSeek-V4.1-Flash plain-torch reference: chunked prefill == one prefill, batched decode == per-sequence
prefill, and every feature the reference models changes the logits (window, compressed KV, sinks, mHC)."""

from __future__ import annotations

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized_models.deepseek_v41_flash import names as N
from latency_specialized_models.deepseek_v41_flash.reference import DeepseekV41Reference
from latency_specialized_models.deepseek_v41_flash.spec import EngramSpec, tiny_spec

NO_ENGRAM = EngramSpec(layers=(), num_embeddings=(), max_ngram=3, n_heads=2, head_dim=16)


def tiny_no_engram():
    return tiny_spec().model_copy(update={"engram": NO_ENGRAM})


@pytest.fixture(scope="module")
def ref():
    spec = tiny_no_engram()
    return DeepseekV41Reference(spec, N.random_weights(spec, 0, torch.float64))


def ids(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def test_chunked_prefill_equals_one_prefill(ref):
    x = ids(30, 1)     # > window 8, > index_topk 16 compressed rows on the ratio-1 layers: top-k selects
    whole = ref.prefill(ref.new_cache(), 0, 0, x)
    c = ref.new_cache()
    parts = torch.cat([ref.prefill(c, 0, a, x[a:b]) for a, b in ((0, 1), (1, 9), (9, 21), (21, 30))])
    assert whole.isfinite().all() and 0.3 < whole.std() < 3
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)   # the mHC seam reference computes in fp32


def test_decode_batch_of_different_lengths_equals_prefill(ref):
    lens, c = (3, 11, 26), ref.new_cache()
    seqs = [ids(n + 2, 10 + i) for i, n in enumerate(lens)]
    for slot, (n, s) in enumerate(zip(lens, seqs)):
        ref.prefill(c, slot, 0, s[:n])
    steps = [ref.decode(c, [0, 1, 2], [n + k for n in lens], torch.stack([s[n + k] for n, s in zip(lens, seqs)]))
             for k in range(2)]
    for slot, (n, s) in enumerate(zip(lens, seqs)):
        want = ref.prefill(ref.new_cache(), 0, 0, s)[n:]
        torch.testing.assert_close(torch.stack([st[slot] for st in steps]), want, rtol=1e-5, atol=1e-5)   # the mHC seam reference computes in fp32


def test_out_of_order_chunk_refused(ref):
    c = ref.new_cache()
    ref.prefill(c, 0, 0, ids(4, 2))
    with pytest.raises(UserError, match="in order"):
        ref.prefill(c, 0, 5, ids(2, 3))


@pytest.mark.parametrize("tensor", ["layers.3.attn.attn_sink", "layers.2.attn.compressor.wgate.weight",
                                    "layers.6.attn.indexer.wk.weight",
                                    "layers.5.hc_ffn_fn", "layers.9.ffn.shared_experts.w2.weight"])
def test_each_feature_reaches_the_logits(ref, tensor):
    x = ids(30, 4)
    base = ref.prefill(ref.new_cache(), 0, 0, x)
    w = dict(ref.w)
    w[tensor] = w[tensor] + torch.randn_like(w[tensor]) * w[tensor].std().clamp_min(0.1)
    other_ref = DeepseekV41Reference(ref.spec, w)
    other = other_ref.prefill(other_ref.new_cache(), 0, 0, x)
    assert (other - base).abs().max() > 1e-6


def test_tokens_beyond_the_window_reach_only_through_compressed_kv():
    spec = tiny_no_engram()
    w = N.random_weights(spec, 1, torch.float64)
    ref = DeepseekV41Reference(spec, w)
    x = ids(20, 5)
    y = x.clone()
    y[0] = (y[0] + 1) % 512
    a, b = ref.prefill(ref.new_cache(), 0, 0, x), ref.prefill(ref.new_cache(), 0, 0, y)
    assert (a[-1] - b[-1]).abs().max() > 1e-6          # token 0 is 19 back: outside the window of 8


def test_engram_and_yarn_refused():
    from latency_specialized_models.deepseek_v41_flash.spec import full_spec
    with pytest.raises(UserError, match="Engram"):
        DeepseekV41Reference(full_spec(), {})
    yarn = tiny_spec().model_copy(update={"rope": tiny_spec().rope.model_copy(update={"yarn_factor": 2.0})})
    with pytest.raises(UserError, match="YaRN"):
        DeepseekV41Reference(yarn, {})
