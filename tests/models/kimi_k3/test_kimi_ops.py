"""Kimi K3's building blocks against independent formulations.

* attention.mla (absorbed, paged) == expanded-form attention in float64;
* attention.kda stepped token by token == the *parallel* form of the gated delta rule in float64
  (outputs via a backward vector recurrence over explicit transition matrices, final state via the
  closed-form sum), with the short conv done as one grouped conv1d over the sequence;
* residual.attnres == a per-token loop, and its limiting cases;
* routing: bias moves the selection but not the weights, renormalisation, ties to the lower id,
  the model reference's routing == the moe.router op.

Fresh random inputs every case, outputs NaN-poisoned, tolerances per dtype.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.ops.attention.kda import kda_decode_reference
from latency_specialized.ops.attention.mla import mla_decode_paged, mla_decode_reference
from latency_specialized.ops.attnres import attnres_mix_reference
from latency_specialized.ops.moe import route_reference
from latency_specialized.spec import RouterSpec

from latency_specialized_models.kimi_k3.composed import random_weights
from latency_specialized_models.kimi_k3.reference import KimiK3Reference
from latency_specialized_models.kimi_k3.spec import tiny_spec

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}   # relative to the output's max magnitude


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(got).any(), "output has NaN (an element was not written)"
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert err <= TOL[dtype] * scale, f"max err {err:.3e} > {TOL[dtype]:.0e} x {scale:.3e}"


# ----------------------------------------------------------------------------------------- MLA
def _expanded_mla(q, kv_cache, block_table, seq_lens, w_kv_b, nope, v, gate):
    """Textbook (non-absorbed) MLA in float64: up-project keys and values, then softmax attention."""
    B, H, qk = q.shape
    L = w_kv_b.shape[1]
    w = w_kv_b.double().view(H, nope + v, L)
    out = torch.zeros(B, H * v, dtype=torch.float64)
    bs = kv_cache.shape[1]
    for b in range(B):
        n = int(seq_lens[b])
        if n == 0:
            continue
        ctx = torch.stack([kv_cache[int(block_table[b, j // bs]), j % bs] for j in range(n)]).double()
        c, kpe = ctx[:, :L], ctx[:, L:]
        for h in range(H):
            k = torch.cat([c @ w[h, :nope].t(), kpe], dim=-1)          # [n, nope + R]
            vals = c @ w[h, nope:].t()                                  # [n, v]
            p = torch.softmax(k @ q[b, h].double() * qk ** -0.5, dim=0)
            out[b, h * v:(h + 1) * v] = p @ vals
    if gate is not None:
        out = out * torch.sigmoid(gate.double())
    return out


@pytest.mark.parametrize("impl", [mla_decode_reference, mla_decode_paged])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_absorbed_equals_expanded_over_paged_cache(dtype, impl):
    g = torch.Generator().manual_seed(11)
    H, nope, R, L, v, bs = 4, 8, 8, 16, 8, 4
    lens = [5, 13, 1, 0]                                   # different lengths; the last row is padding
    B, per = len(lens), 4
    blocks = torch.randperm(B * per, generator=g).view(B, per).to(torch.int32)   # shuffled pages
    kv_cache = torch.randn(B * per, bs, L + R, generator=g).to(dtype)
    q = torch.randn(B, H, nope + R, generator=g).to(dtype)
    kv_c = torch.randn(B, L, generator=g).to(dtype)
    k_pe = torch.randn(B, R, generator=g).to(dtype)
    w_kv_b = (torch.randn(H * (nope + v), L, generator=g) / L ** 0.5).to(dtype)
    gate = torch.randn(B, H * v, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    pos = (seq_lens - 1).clamp_min(0).long()
    slots = (blocks.gather(1, (pos // bs).unsqueeze(1)).squeeze(1).long() * bs + pos % bs)
    slots[seq_lens == 0] = -1
    before = kv_cache.clone()
    out = torch.full((B, H * v), float("nan"), dtype=dtype)
    impl(q, kv_c, k_pe, kv_cache, slots, blocks, seq_lens, w_kv_b, qk_nope_head_dim=nope, v_head_dim=v, gate=gate,
         out=out)
    # the new token landed at its slot, nothing else changed (padding wrote nothing)
    flat, flat0 = kv_cache.view(-1, L + R), before.view(-1, L + R)
    live = slots >= 0
    assert torch.equal(flat[slots[live]], torch.cat([kv_c, k_pe], -1)[live])
    mask = torch.ones(flat.shape[0], dtype=torch.bool)
    mask[slots[live]] = False
    assert torch.equal(flat[mask], flat0[mask])
    want = _expanded_mla(q, kv_cache, blocks, seq_lens, w_kv_b, nope, v, gate)
    _close(out, want, dtype)
    assert torch.all(out[-1] == 0)                         # padding row: zeros


def _mla_case(g, lens, per, bs=4, H=4, nope=8, R=8, L=16, v=8):
    B = len(lens)
    blocks = torch.randperm(B * per, generator=g).view(B, per).to(torch.int32)
    kv_cache = torch.randn(B * per, bs, L + R, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    pos = (seq_lens - 1).clamp_min(0).long()
    slots = blocks.gather(1, (pos // bs).unsqueeze(1)).squeeze(1).long() * bs + pos % bs
    slots[seq_lens == 0] = -1
    args = (torch.randn(B, H, nope + R, generator=g), torch.randn(B, L, generator=g), torch.randn(B, R, generator=g),
            kv_cache, slots, blocks, seq_lens, torch.randn(H * (nope + v), L, generator=g) / L ** 0.5)
    return args, dict(qk_nope_head_dim=nope, v_head_dim=v, gate=torch.randn(B, H * v, generator=g))


def test_mla_paged_matches_reference_with_poisoned_tails_and_padding_first():
    """The capturable MLA: NaN in every cache position past a sequence's end and -1 block ids past its
    last block change nothing; padding rows (even before the first live one) write nothing."""
    g = torch.Generator().manual_seed(12)
    (q, kv_c, k_pe, cache, slots, blocks, seq_lens, w), kw = _mla_case(g, [0, 6, 11, 0, 3], per=4)
    flat = cache.view(-1, cache.shape[-1])
    for b, n in enumerate(seq_lens.tolist()):            # poison everything the sequence does not own yet
        for t in range(n - 1, blocks.shape[1] * cache.shape[1]):
            if t >= 0:
                flat[blocks[b, t // cache.shape[1]].long() * cache.shape[1] + t % cache.shape[1]] = float("nan")
    blocks = blocks.clone()
    blocks[1, 2:] = -1                                   # 6 tokens need blocks 0-1 only
    c_ref, c_pag = cache.clone(), cache.clone()
    want = mla_decode_reference(q, kv_c, k_pe, c_ref, slots, blocks, seq_lens, w, **kw)
    got = mla_decode_paged(q, kv_c, k_pe, c_pag, slots, blocks, seq_lens, w, **kw)
    assert not got.isnan().any() and torch.all(got[0] == 0) and torch.all(got[3] == 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(c_pag.isnan(), c_ref.isnan())
    live = ~c_ref.isnan()
    assert torch.equal(c_pag[live], c_ref[live])


def test_mla_paged_has_no_host_sync():
    """On the meta device (no data) every data-dependent host read fails: the reference's does, the
    capturable implementation runs - nothing in it waits for the GPU."""
    g = torch.Generator().manual_seed(13)
    args, kw = _mla_case(g, [4, 0, 9], per=3)
    meta = [a.to("meta") for a in args]
    kw = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    assert mla_decode_paged(*meta, **kw).shape == (3, 4 * 8)
    with pytest.raises(NotImplementedError, match="meta"):   # its seq_lens.tolist()
        mla_decode_reference(*meta, **kw)


# ----------------------------------------------------------------------------------------- KDA
def _kda_parallel(mixed, tail, conv_w, f, A_log, dt_bias, beta_logit, g_out, norm_w, S0, H, lb=-5.0, eps=1e-5):
    """One sequence, float64, parallel form. mixed: [T, 3HD]; tail: [3HD, W-1]; S0: [H, D, D]."""
    T, C = mixed.shape
    D = C // 3 // H
    W = conv_w.shape[1]
    seq = torch.cat([tail.double(), mixed.double().t()], dim=-1).unsqueeze(0)       # [1, C, W-1+T]
    conv = torch.nn.functional.conv1d(seq, conv_w.double().unsqueeze(1), groups=C)[0].t()  # [T, C]
    conv = torch.nn.functional.silu(conv)
    q, k, v = conv.view(T, 3, H, D).unbind(1)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * D ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = lb * torch.sigmoid(torch.exp(A_log.double()).view(1, H, 1) * (f.double() + dt_bias.double()).view(T, H, D))
    beta = torch.sigmoid(beta_logit.double())                                        # [T, H]
    eye = torch.eye(D, dtype=torch.float64)
    # transition A_t = diag(exp g_t) (I - beta_t k_t k_t^T) per head
    A = torch.diag_embed(torch.exp(g)) @ (eye - beta[..., None, None] * k.unsqueeze(-1) * k.unsqueeze(-2))
    o = torch.zeros(T, H, D, dtype=torch.float64)
    for t in range(T):                        # o_t = S0 P(1..t) q_t + sum_s beta_s v_s (k_s . P(s+1..t) q_t)
        u = q[t]
        for s in range(t, -1, -1):
            o[t] += beta[s].unsqueeze(-1) * v[s] * (k[s] * u).sum(-1, keepdim=True)
            u = torch.einsum("hij,hj->hi", A[s], u)
        o[t] += torch.einsum("hvk,hk->hv", S0.double(), u)
    S = S0.double()                           # closed form of the final state
    P = eye.expand(H, D, D)
    S_T = torch.zeros_like(S)
    for s in range(T - 1, -1, -1):
        S_T += beta[s][:, None, None] * v[s].unsqueeze(-1) * (k[s].unsqueeze(-2) @ P)
        P = A[s] @ P
    S_T += S @ P
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm_w.double()
    o = o * torch.sigmoid(g_out.double().view(T, H, D))
    return o.reshape(T, H * D), S_T, seq[0, :, -(W - 1):]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_stepwise_equals_parallel_form(dtype):
    g = torch.Generator().manual_seed(5)
    H, D, W, T, rows = 3, 8, 4, 10, 4
    C = 3 * H * D
    conv_w = torch.randn(C, W, generator=g) / W ** 0.5
    A_log = torch.log(0.5 + 1.5 * torch.rand(H, generator=g))
    dt_bias = -1.0 + 0.5 * torch.randn(H * D, generator=g)
    norm_w = 1 + 0.1 * torch.randn(D, generator=g)
    conv_state = torch.randn(rows, C, W - 1, generator=g).to(dtype)
    state = 0.3 * torch.randn(rows, H, D, D, generator=g)
    seq_rows = torch.tensor([2, 1])                    # two sequences at different state rows
    ins = [dict(mixed=torch.randn(T, C, generator=g).to(dtype), f=torch.randn(T, H * D, generator=g).to(dtype),
                beta=torch.randn(T, H, generator=g).to(dtype), g_out=torch.randn(T, H * D, generator=g).to(dtype))
           for _ in range(2)]
    want = [_kda_parallel(x["mixed"], conv_state[r], conv_w, x["f"], A_log, dt_bias, x["beta"], x["g_out"], norm_w,
                          state[r], H) for x, r in zip(ins, seq_rows.tolist())]
    untouched = [conv_state[[0, 3]].clone(), state[[0, 3]].clone()]
    for t in range(T):
        out = torch.full((2, H * D), float("nan"), dtype=dtype)
        got = kda_decode_reference(torch.stack([x["mixed"][t] for x in ins]), conv_state, conv_w,
                                   torch.stack([x["f"][t] for x in ins]), A_log, dt_bias,
                                   torch.stack([x["beta"][t] for x in ins]), torch.stack([x["g_out"][t] for x in ins]),
                                   norm_w, state, seq_rows, num_heads=H)
        out.copy_(got)
        for b in range(2):
            _close(out[b], want[b][0][t], dtype)
    for b, r in enumerate(seq_rows.tolist()):
        _close(state[r], want[b][1], dtype)
        assert torch.equal(conv_state[r], want[b][2].to(dtype))   # tail = the last W-1 raw inputs
    assert torch.equal(conv_state[[0, 3]], untouched[0]) and torch.equal(state[[0, 3]], untouched[1])


def test_model_reference_kda_equals_op():
    """The model reference's own KDA (separate weights, unfold conv) == the fused op, one layer, fp32."""
    torch.manual_seed(0)
    spec = tiny_spec()
    w = random_weights(spec, seed=3, dtype=torch.float32)
    ref = KimiK3Reference(spec, w)
    cache = ref.new_cache(1, 16)
    a = spec.layers[1].attention
    cache.layer(1)["state"].normal_()
    cache.layer(1)["conv"].normal_()
    cache2 = cache.clone()
    x = torch.randn(1, spec.hidden_size)
    got = ref._kda(cache, 1, a, cache.slots[0], x)
    p = "model.layers.1.self_attn."
    lin = lambda n, t: t @ w[p + n].t()  # noqa: E731
    mixed = torch.cat([lin("q_proj.weight", x), lin("k_proj.weight", x), lin("v_proj.weight", x)], -1)
    conv_w = torch.cat([w[p + f"{n}_conv1d.weight"][:, 0] for n in "qkv"])
    o = kda_decode_reference(mixed, cache2.layer(1)["conv"], conv_w, lin("f_b_proj.weight", lin("f_a_proj.weight", x)),
                             w[p + "A_log"], w[p + "dt_bias"], lin("b_proj.weight", x), lin("g_proj.weight", x),
                             w[p + "o_norm.weight"], cache2.layer(1)["state"], torch.tensor([1]), num_heads=a.num_heads)
    _close(got, lin("o_proj.weight", o), torch.float32)
    _close(cache.layer(1)["state"], cache2.layer(1)["state"], torch.float32)


# ----------------------------------------------------------------------------------------- AttnRes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 3, 5])
def test_attnres_matches_per_token_loop(dtype, n):
    g = torch.Generator().manual_seed(n)
    M, R, N, eps = 3, 6, 32, 1e-5
    src = torch.randn(R, M, N, generator=g).to(dtype)
    src[n:] = float("nan")                                # sources past num_sources must not be read
    nw, qw, ow = (1 + 0.1 * torch.randn(N, generator=g)), torch.randn(N, generator=g) / N ** 0.5, 1 + 0.1 * torch.randn(N, generator=g)
    out = torch.full((M, N), float("nan"), dtype=dtype)
    attnres_mix_reference(src, n, nw, qw, eps, out_norm_weight=ow, out_eps=eps, out=out)
    want = torch.zeros(M, N, dtype=torch.float64)
    for m in range(M):
        vs = [src[s, m].double() for s in range(n)]
        logits = torch.stack([(v / torch.sqrt(v.pow(2).mean() + eps) * nw.double()) @ qw.double() for v in vs])
        p = torch.exp(logits - logits.max())
        mix = sum(pi * v for pi, v in zip(p / p.sum(), vs))
        want[m] = mix / torch.sqrt(mix.pow(2).mean() + eps) * ow.double()
    _close(out, want, dtype)


def test_attnres_limits():
    g = torch.Generator().manual_seed(0)
    src = torch.randn(4, 2, 16, generator=g)             # [sources, tokens, hidden]
    nw = torch.ones(16)
    # one source: the mix is the source itself
    assert torch.allclose(attnres_mix_reference(src, 1, nw, torch.randn(16, generator=g), 1e-5), src[0])
    # zero query: uniform softmax, the mix is the mean of the sources
    assert torch.allclose(attnres_mix_reference(src, 4, nw, torch.zeros(16), 1e-5), src.mean(0), atol=1e-6)
    # a query aligned with one (normed) source dominates as it grows
    q = 50 * src[2, 0] / src[2, 0].norm()
    out = attnres_mix_reference(src[:, :1], 4, nw, q, 1e-5)
    assert torch.allclose(out, src[2, :1], atol=1e-3)


# ----------------------------------------------------------------------------------------- routing
ROUTER = RouterSpec(score_func="sigmoid", bias_corrected=True, renormalize=True, routed_scaling=1.0)


def _ref_route(logits, bias, k, router=ROUTER):
    spec = tiny_spec()
    moe = spec.layers[1].ffn.model_copy(update={"top_k": k, "num_experts": logits.shape[-1], "router": router})
    ref = KimiK3Reference.__new__(KimiK3Reference)
    ids, w = ref._route(logits.unsqueeze(0), bias, moe)
    return ids[0].tolist(), w[0]


def test_routing_bias_changes_selection_not_weights():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, generator=g)
    bias = torch.zeros(16)
    ids0, w0 = _ref_route(logits, bias, 4)
    low = int(torch.argsort(logits)[0])                 # the least likely expert ...
    bias[low] = 100.0                                    # ... is forced in by the bias
    ids1, w1 = _ref_route(logits, bias, 4)
    assert low in ids1 and low not in ids0
    # weights come from the unbiased sigmoid of the selected experts, renormalised
    s = torch.sigmoid(logits)
    assert torch.allclose(w1, s[ids1] / s[ids1].sum())
    for ids, w in ((ids0, w0), (ids1, w1)):
        assert torch.allclose(w.sum(), torch.tensor(1.0))


def test_routing_scaling_and_no_renormalise():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(16, generator=g)
    r = RouterSpec(score_func="sigmoid", bias_corrected=True, renormalize=False, routed_scaling=2.5)
    ids, w = _ref_route(logits, torch.zeros(16), 4, r)
    assert torch.allclose(w, 2.5 * torch.sigmoid(logits)[ids])


def test_routing_ties_go_to_the_lower_id():
    logits = torch.zeros(16)
    logits[[3, 9, 12]] = 1.0                              # three-way tie at the top, then a 13-way tie
    ids, _ = _ref_route(logits, torch.zeros(16), 5)
    assert ids == [3, 9, 12, 0, 1]
    w_op, ids_op = route_reference(logits.unsqueeze(0), torch.zeros(16), 5, ROUTER)
    assert ids_op[0].tolist() == ids


def test_reference_routing_equals_op():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(32, 16, generator=g)
    bias = 0.3 * torch.randn(16, generator=g)
    w_op, ids_op = route_reference(logits, bias, 4, ROUTER)
    for m in range(32):
        ids, w = _ref_route(logits[m], bias, 4)
        assert ids_op[m].tolist() == ids
        assert torch.allclose(w_op[m], w.float(), atol=1e-7)
