"""Sparse MQA ops (``ops/attention/sparse_mqa.py``) against plain references, fresh random inputs and odd shapes:
the ``attention.sparse_mqa`` reference against a per-row loop written from the contract (ring write first, ring
slots < seq_len, selected complete rows through the block table, sinks in the denominator, inverse RoPE); the
sync-free ``attention.sparse`` implementation vs ``sparse_decode_reference`` (sinks, -1 slots, rows with nothing
selected), slot writes / gathers through shuffled block tables (-1: no write), softmax-gated pooling, the RoPE
helpers (inverse rotation, rope-leading layout), the piece's sites and refusals."""

from __future__ import annotations

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.attention.sparse import sparse_decode_reference
from latency_specialized.ops.attention.sparse_mqa import (gather_slots, pool_softmax, slot_of, sparse_decode_masked,
                                                          sparse_mqa_compress_reference, sparse_mqa_decode_reference,
                                                          write_slots)
from latency_specialized.pieces.attention.rope import rope_inv_freq
from latency_specialized.pieces.attention.sparse_mqa import SparseMQAAttention, rope_leading, rope_tail
from latency_specialized.pieces.standard import MissingPiece, standard_attention
from latency_specialized.spec import IndexerSpec, SparseMQAAttentionSpec


@pytest.mark.parametrize("seed,B,H,T,D,k,sinks", [(0, 3, 5, 11, 24, 7, True), (1, 1, 2, 5, 9, 5, False),
                                                  (2, 6, 7, 19, 40, 13, True)])
def test_masked_sparse_attention_equals_the_reference(seed, B, H, T, D, k, sinks):
    g = torch.Generator().manual_seed(seed)
    q, kv = torch.randn(B, H, D, generator=g), torch.randn(B, T, D, generator=g)
    idx = torch.stack([torch.randperm(T, generator=g)[:k] for _ in range(B)])
    idx = torch.where(torch.rand(B, k, generator=g) < 0.3, -1, idx)
    idx[0] = -1                                                  # a row with nothing selected (padding)
    s = torch.randn(H, generator=g) if sinks else None
    want = sparse_decode_reference(q, kv, idx, scale=D ** -0.5, v_dim=D - 3, sinks=s)
    got = torch.full_like(want, float("nan"))
    got.copy_(sparse_decode_masked(q, kv, idx, scale=D ** -0.5, v_dim=D - 3, sinks=s))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got[0].abs().max() == 0


def test_slot_writes_and_gathers_through_a_shuffled_block_table():
    g = torch.Generator().manual_seed(3)
    blocks, bs, D, B = 13, 3, 5, 4
    cache = torch.full((blocks, bs, D), float("nan"))
    bt = torch.randperm(blocks, generator=g)[:B * 3].view(B, 3).int()
    index = torch.tensor([0, 4, 8, 2])
    live = torch.tensor([True, False, True, True])
    slots = slot_of(bt, index, bs, live)
    assert slots[1] == -1 and slots[2] == bt[2, 2] * bs + 2
    vals = torch.randn(B, D, generator=g)
    write_slots(cache, vals, slots)
    got = gather_slots(cache, bt, index.view(B, 1))[:, 0]
    torch.testing.assert_close(got[live], vals[live])
    assert int(cache.isnan().all(-1).sum()) == blocks * bs - 3      # the -1 row wrote nothing
    write_slots(cache, vals, torch.full((B,), -1))                  # no live row: nothing changes
    assert int(cache.isnan().all(-1).sum()) == blocks * bs - 3


@pytest.mark.parametrize("r", [2, 3])
def test_softmax_gated_pooling(r):
    g = torch.Generator().manual_seed(r)
    v, gate = torch.randn(5, r, 7, generator=g), torch.randn(5, r, 7, generator=g) * 3
    w = gate.exp() / gate.exp().sum(1, keepdim=True)
    torch.testing.assert_close(pool_softmax(v, gate), (w * v).sum(1))


def test_rope_tail_inverts_and_rope_leading_moves_the_tail_first():
    g = torch.Generator().manual_seed(4)
    x, pos, inv = torch.randn(3, 2, 12, generator=g), torch.tensor([0, 5, 77]), rope_inv_freq(1e4, 6)
    y = rope_tail(x, pos, inv)
    assert torch.equal(y[..., :6], x[..., :6]) and not torch.allclose(y[..., 6:], x[..., 6:])
    torch.testing.assert_close(rope_tail(y, pos, inv, sign=-1.0), x, rtol=1e-5, atol=1e-5)
    assert torch.equal(rope_leading(x, 6)[..., :6], x[..., 6:])


def _spec(ratio: int, indexer: bool = False) -> SparseMQAAttentionSpec:
    ix = IndexerSpec(num_heads=2, head_dim=8, topk=4) if indexer else None
    return SparseMQAAttentionSpec(num_heads=4, head_dim=16, rope_dim=4, q_lora_rank=8, o_groups=2, o_lora_rank=4,
                                  sliding_window=4, compress_ratio=ratio, indexer=ix)


def test_piece_refuses_inconsistent_options():
    with pytest.raises(UserError, match="window-only"):
        SparseMQAAttention(_spec(0), kv_source=True)
    with pytest.raises(UserError, match="topk >= 1"):
        SparseMQAAttention(_spec(2))
    with pytest.raises(UserError, match="indexer's topk"):
        SparseMQAAttention(_spec(1, indexer=True), topk=3)
    p = SparseMQAAttention(_spec(2, indexer=True), topk=4, kv_source=True)
    assert p.index_keys and {d.name for d in p.states(None, 1)} == {"window", "compressed", "pending", "index_k"}


def test_standard_pieces_serve_window_only_layers_and_name_the_fix_for_compressed_ones():
    from latency_specialized_models.deepseek_v41_flash.spec import tiny_spec
    s = tiny_spec()
    assert isinstance(standard_attention(s, s.layers[0]), SparseMQAAttention)
    with pytest.raises(MissingPiece, match="KV sources, top-k and RoPE base"):
        standard_attention(s, s.layers[2])


# --------------------------------------------------------------------------------------------- attention.sparse_mqa
def _rot(x: torch.Tensor, p: float, inv: torch.Tensor) -> torch.Tensor:
    """Interleaved rotation of the last 2 len(inv) channels of ``x [..., D]`` at position ``p`` (fp64 angles)."""
    r, y = 2 * inv.shape[0], x.clone()
    ang = p * inv.double()
    c, s = ang.cos(), ang.sin()
    a, b = x[..., -r::2].double(), x[..., -r + 1::2].double()
    y[..., -r::2], y[..., -r + 1::2] = (a * c - b * s).to(x.dtype), (a * s + b * c).to(x.dtype)
    return y


def _loop_oracle(q, kv, pos, rows, seq, window, cache, bt, sel, sinks, inv, *, scale, ratio, eps, kv_w=None):
    """The contract row by row, in fp64 from fp32 inputs (no shared code with the reference)."""
    M, H, D = q.shape
    W = window.shape[1]
    for m in range(M):
        k = kv[m]
        if kv_w is not None:   # kv_norm (eps 1e-6), rounded to kv's dtype as the norm op rounds
            kd = k.double()
            k = (kd * torch.rsqrt(kd.pow(2).mean() + 1e-6) * kv_w.double()).to(kv.dtype)
        window[int(rows[m]), int(pos[m]) % W] = _rot(k, float(pos[m]), inv)
    out = torch.zeros(M, H, D, dtype=torch.float64)
    for m in range(M):
        n = int(seq[m])
        keys = [window[int(rows[m]), i].double() for i in range(min(n, W))]
        if sel is not None:
            bs = cache.shape[1]
            for j in sel[m].tolist():
                if 0 <= j < n // ratio:
                    keys.append(cache[int(bt[m, j // bs]), j % bs].double())
        if not keys:
            continue
        k = torch.stack(keys)
        qm = q[m].double()
        if eps is not None:
            qm = qm * torch.rsqrt(qm.pow(2).mean(-1, keepdim=True) + eps)
        qm = _rot(qm, float(pos[m]), inv)
        s = qm @ k.t() * scale
        mx = s.max(-1, keepdim=True).values
        if sinks is not None:
            mx = torch.maximum(mx, sinks.double()[:, None])
        e = (s - mx).exp()
        den = e.sum(-1) + ((sinks.double() - mx[:, 0]).exp() if sinks is not None else 0)
        out[m] = _rot((e @ k) / den[:, None], -float(pos[m]), inv)
    return out


@pytest.mark.parametrize("kv_norm", [False, True], ids=["kv_normed", "kv_raw"])
@pytest.mark.parametrize("seed,lens,H,D,R,W,K,ratio,bs,sinks,eps", [
    (0, [5, 0, 23, 9], 3, 16, 4, 8, 6, 2, 3, True, 1e-6),      # partly filled, padding, wrapped
    (1, [1], 2, 8, 8, 4, 3, 1, 2, False, None),                 # all channels rotated, pre-normed q, no sinks
    (2, [40, 7, 0], 4, 24, 6, 16, 0, 1, 4, True, 1e-6),         # window only (K = 0)
    (3, [64, 65, 3, 12, 30], 5, 32, 8, 8, 20, 4, 5, True, 1e-5)])
def test_sparse_mqa_reference_equals_a_loop_over_the_contract(seed, lens, H, D, R, W, K, ratio, bs, sinks, eps,
                                                              kv_norm):
    g = torch.Generator().manual_seed(seed)
    M = len(lens)
    seq = torch.tensor(lens, dtype=torch.int32)
    pos = (seq.long() - 1).clamp(min=0)
    rows = torch.randperm(M + 2, generator=g)[:M].to(torch.int32)
    window = torch.randn(M + 2, W, D, generator=g)
    q, kv = 2 * torch.randn(M, H, D, generator=g) + 0.3, torch.randn(M, D, generator=g)
    sk = torch.randn(H, generator=g) if sinks else None
    inv = rope_inv_freq(1e4, R)
    cache = bt = sel = None
    if K:
        per = max(lens) // ratio // bs + 2
        cache = torch.randn(M * per + 2, bs, D, generator=g)
        bt = torch.randperm(M * per + 2, generator=g)[:M * per].view(M, per).int()
        sel = torch.randint(-1, max(lens) // ratio + 3, (M, K), generator=g, dtype=torch.int32)
    kv_w = None
    if kv_norm:   # a raw row off unit RMS and a gain: the op norms it
        kv, kv_w = 3 * torch.randn(M, D, generator=g) - 0.5, 1 + 0.3 * torch.randn(D, generator=g)
    w_ref, w_loop = window.clone(), window.clone()
    out = torch.full((M, H, D), float("nan"))
    got = sparse_mqa_decode_reference(q, kv, pos, rows, seq, w_ref, cache, bt, sel, sk, inv, scale=D ** -0.5,
                                      compress_ratio=ratio, q_norm_eps=eps, kv_norm_weight=kv_w, out=out)
    want = _loop_oracle(q, kv, pos, rows, seq, w_loop, cache, bt, sel, sk, inv, scale=D ** -0.5, ratio=ratio, eps=eps,
                        kv_w=kv_w)
    assert got is out
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w_ref, w_loop, rtol=1e-6, atol=1e-6)
    assert got[seq == 0].abs().max() == 0 if (seq == 0).any() else True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_norm_in_the_op_equals_the_separate_norm_site(dtype):
    """``kv_norm_weight`` on the op gives bit for bit what the removed ``attn.kv_norm`` site and the op on the
    normed row gave (the norm family's reference rounding), ring included; from a strided kv slice too."""
    from latency_specialized.ops.norm import rmsnorm_reference

    g = torch.Generator().manual_seed(40)
    M, H, D, W = 3, 4, 32, 8
    seq = torch.tensor([3, 12, 0], dtype=torch.int32)
    pos, rows = (seq.long() - 1).clamp(min=0), torch.tensor([2, 0, 1], dtype=torch.int32)
    wide = (3 * torch.randn(M, D + 40, generator=g)).to(dtype)
    kv = wide[:, 16:16 + D]                                          # a column slice of the fused projection
    q = torch.randn(M, H, D, generator=g).to(dtype)
    w_kv, window = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype), torch.randn(3, W, D, generator=g).to(dtype)
    inv, sk = rope_inv_freq(1e4, 8), torch.randn(H, generator=g)
    w1, w2 = window.clone(), window.clone()
    kw = dict(scale=D ** -0.5, q_norm_eps=1e-6)
    fused = sparse_mqa_decode_reference(q, kv, pos, rows, seq, w1, None, None, None, sk, inv, kv_norm_weight=w_kv,
                                        kv_norm_eps=1e-6, **kw)
    apart = sparse_mqa_decode_reference(q, rmsnorm_reference(kv.contiguous(), w_kv, 1e-6), pos, rows, seq, w2, None,
                                        None, None, sk, inv, **kw)
    assert torch.equal(fused, apart) and torch.equal(w1, w2)
    with pytest.raises(UserError, match="kv_norm_weight"):
        sparse_mqa_decode_reference(q, kv, pos, rows, seq, w1, None, None, None, sk, inv, kv_norm_weight=w_kv[:-1],
                                    **kw)


def test_sparse_mqa_reference_refuses_mismatched_arguments():
    q, kv = torch.randn(2, 3, 16), torch.randn(2, 16)
    ints = torch.zeros(2, dtype=torch.int32)
    window, inv = torch.randn(3, 4, 16), rope_inv_freq(1e4, 4)
    with pytest.raises(UserError, match="together"):
        sparse_mqa_decode_reference(q, kv, ints, ints, ints, window, None, None, torch.zeros(2, 3, dtype=torch.int32),
                                    None, inv, scale=0.25)
    with pytest.raises(UserError, match="sinks"):
        sparse_mqa_decode_reference(q, kv, ints, ints, ints, window, None, None, None, torch.zeros(4), inv, scale=0.25)
    with pytest.raises(UserError, match="kv has shape"):
        sparse_mqa_decode_reference(q, kv[:, :8], ints, ints, ints, window, None, None, None, None, inv, scale=0.25)


def test_piece_declares_one_sparse_mqa_site_and_no_head_norm():
    """The piece's attention site is the fused family (head norm, kv norm, RoPE, ring write and inverse RoPE inside
    it): no ``attn.q_head_norm`` / ``attn.kv_norm`` site left; window-only and compressed roles as
    ``attention_role()`` names them. Every projection of h is one ``attn.in_proj`` gemm (N the sum of
    ``[q_a | kv | compressor | indexer weights]``), the indexer's q_proj rows join q_b's, whose norm_site is the
    q norm."""
    from latency_specialized.ops.sites import SiteBuilder
    from latency_specialized_models.deepseek_v41_flash.spec import tiny_spec

    for ratio, topk, role, src in ((0, 0, "attn.sparse_mqa.window", False), (2, 4, "attn.sparse_mqa.c2", True),
                                   (1, 4, "attn.sparse_mqa.c1", True), (2, 4, "attn.sparse_mqa.c2", False)):
        p = SparseMQAAttention(_spec(ratio, indexer=ratio > 0), topk=topk, kv_source=src)
        b = SiteBuilder("sm_90", "bfloat16", 4, 1)
        p.sites(b, tiny_spec())
        by_role = {s.name: s for s in b.sites}
        assert p.attention_role() == role and by_role[role].family == "attention.sparse_mqa"
        assert not {"attn.q_head_norm", "attn.compressor_norm", "attn.kv_norm", "attn.q_a_proj", "attn.kv_proj",
                    f"attn.compressor.c{ratio}", "attn.indexer.q_proj", "attn.indexer.weights_proj"} & set(by_role)
        n_in = 8 + 16 + ((32 if ratio > 1 else 16) if src else 0) + (2 if ratio else 0)
        assert by_role["attn.in_proj"].ctx.dim("N") == n_in and by_role["attn.in_proj"].ctx.dim("K") == tiny_spec(
        ).hidden_size
        qb = by_role["attn.q_b_proj"].ctx
        assert qb.attr("norm_site") == "attn.q_norm" and qb.dim("N") == 4 * 16 + (2 * 8 if ratio else 0)
        if src:
            assert by_role["attn.compressor"].family == "attention.sparse_mqa_compress"
        ctx = by_role[role].ctx
        assert (ctx.dim("heads"), ctx.dim("head_dim"), ctx.dim("rope"), ctx.dim("topk")) == (4, 16, 4, topk)
        assert ctx.attr("sinks") is True and ctx.attr("q_norm") is True and ctx.attr("kv_norm") is True


def test_arrange_concatenates_the_input_projections_in_site_order():
    """``in_proj`` rows are ``[q_a | kv | compressor kv | gate | indexer weights]`` of the checkpoint tensors (whose
    names stay), ``q_b_proj`` is ``[q_b | indexer q_proj (rope-leading)]``; the fused tensors are not kept twice."""
    from latency_specialized_models.deepseek_v41_flash.spec import tiny_spec

    spec = tiny_spec()
    p = SparseMQAAttention(_spec(2, indexer=True), topk=4, kv_source=True)
    g = torch.Generator().manual_seed(41)
    w = {d.name: torch.randn(*d.shape, generator=g) for d in p.weights(spec, 1)}
    out = p.arrange(w, spec)
    want = torch.cat([w["q_a_proj"], w["kv_proj"], w["compressor.kv"], w["compressor.gate"],
                      w["indexer.weights_proj"]])
    assert torch.equal(out["in_proj"], want)
    iq = rope_leading(w["indexer.q_proj"].view(2, 8, -1), 4, dim=1).reshape(16, -1)
    assert torch.equal(out["q_b_proj"], torch.cat([w["q_b_proj"], iq]))
    assert not {"q_a_proj", "kv_proj", "compressor.kv", "compressor.gate", "compressor", "indexer.q_proj",
                "indexer.weights_proj"} & set(out)


@pytest.mark.parametrize("ratio", [1, 2, 3])
def test_compressor_reference_equals_a_loop_over_the_contract(ratio):
    g = torch.Generator().manual_seed(20 + ratio)
    M, D, R, bs = 4, 12, 4, 3
    rows, pos = torch.tensor([2, 0, 3, 1], dtype=torch.int32), torch.tensor([5, 0, 8, 11])
    c = torch.randn(M, 2 * D if ratio > 1 else D, generator=g)
    pending = torch.randn(4, ratio, 2 * D, generator=g) if ratio > 1 else None
    w, inv = 1 + 0.1 * torch.randn(D, generator=g), rope_inv_freq(1e4, R)
    cache = torch.randn(6, bs, D, generator=g)
    slots = torch.tensor([4, -1, 11, 0])
    p_ref = None if pending is None else pending.clone()
    c_ref = cache.clone()
    lat = sparse_mqa_compress_reference(c, p_ref, rows, pos, w, inv, c_ref, slots, eps=1e-6, ratio=ratio)
    for m in range(M):
        if ratio > 1:
            grp = pending[int(rows[m])].clone()
            grp[int(pos[m]) % ratio] = c[m]
            x = (torch.softmax(grp[:, D:].double(), 0) * grp[:, :D].double()).sum(0)
            assert torch.equal(p_ref[int(rows[m]), int(pos[m]) % ratio], c[m])
        else:
            x = c[m].double()
        want = x * torch.rsqrt(x.pow(2).mean() + 1e-6) * w.double()
        torch.testing.assert_close(lat[m].double(), want, rtol=1e-5, atol=1e-6)
        if slots[m] >= 0:
            torch.testing.assert_close(c_ref.view(-1, D)[int(slots[m])].double(), _rot(want, float(pos[m]), inv),
                                       rtol=1e-5, atol=1e-6)
    untouched = torch.ones(6 * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(c_ref.view(-1, D)[untouched], cache.view(-1, D)[untouched])


# ------------------------------------------------------------------ verification steps (rings longer than the window)
def _verify_rows(seed, *, S, k, D=32, R=8, n0=45, requests=2):
    """A verification call: ``requests`` requests of 1 + k rows (request-major) on distinct state rows of a ring of
    ``S + k`` rows (history written as a plain decode would have: position p at p % ring), positions
    ``n0 - 1 + b .. + k`` (past the ring: wrapped)."""
    g = torch.Generator().manual_seed(seed)
    T, W = 1 + k, S + k
    M = requests * T
    state_rows = torch.arange(1, requests + 1)
    rows = state_rows.repeat_interleave(T).to(torch.int32)
    pos = torch.cat([torch.arange(n0 - 1 + b, n0 - 1 + b + T) for b in range(requests)])
    return dict(q=torch.randn(M, 4, D, generator=g), kv=torch.randn(M, D, generator=g), pos=pos, rows=rows,
                seq=(pos + 1).to(torch.int32), window=torch.randn(requests + 1, W, D, generator=g),
                sinks=torch.randn(4, generator=g), inv=rope_inv_freq(1e4, R), T=T, S=S)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_a_verification_call_equals_its_rows_one_step_at_a_time(k):
    """``attention.sparse_mqa`` over a ring of window + k rows with ``sliding_window`` = the window: one call of a
    request's 1 + k rows (row t at position p + t) equals 1 + k single-row calls in order - row t sees the last
    ``window`` positions up to its own, none of the later rows' new entries, and what earlier rows wrote."""
    c = _verify_rows(40 + k, S=6, k=k)
    kw = dict(scale=0.3, q_norm_eps=1e-6, sliding_window=c["S"])
    ring = c["window"].clone()
    got = sparse_mqa_decode_reference(c["q"], c["kv"], c["pos"], c["rows"], c["seq"], ring, None, None, None,
                                      c["sinks"], c["inv"], cross_row_reads=True, **kw)
    one = c["window"].clone()
    for m in range(c["q"].shape[0]):   # request-major rows; requests on different state rows: order within each
        want = sparse_mqa_decode_reference(c["q"][m:m + 1], c["kv"][m:m + 1], c["pos"][m:m + 1], c["rows"][m:m + 1],
                                           c["seq"][m:m + 1], one, None, None, None, c["sinks"], c["inv"], **kw)
        torch.testing.assert_close(got[m:m + 1], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(ring, one)
    # the window, not the ring, bounds what a row sees: the whole ring visible differs (a wrong k-old entry)
    wide = sparse_mqa_decode_reference(c["q"], c["kv"], c["pos"], c["rows"], c["seq"], c["window"].clone(), None,
                                       None, None, c["sinks"], c["inv"], scale=0.3, q_norm_eps=1e-6)
    assert not torch.allclose(wide, got, rtol=1e-3, atol=1e-3)
    with pytest.raises(UserError, match="sliding_window 30 must be in"):
        sparse_mqa_decode_reference(c["q"], c["kv"], c["pos"], c["rows"], c["seq"], c["window"].clone(), None, None,
                                    None, c["sinks"], c["inv"], scale=0.3, sliding_window=30)


@pytest.mark.parametrize("ratio,k", [(2, 3), (2, 7), (4, 3)])
def test_a_verification_compressor_call_equals_its_rows_one_step_at_a_time(ratio, k):
    """``attention.sparse_mqa_compress`` over a pending ring of ratio + k rows: one call of 1 + k consecutive
    tokens of a request equals the tokens one call each, in order - a token closing its group pools the rows
    earlier tokens of the same call wrote (and the cache gets the same rows at the same slots)."""
    g = torch.Generator().manual_seed(70 + 10 * ratio + k)
    D, R, T = 32, 8, 1 + k
    pos = torch.arange(21, 21 + T)
    rows = torch.full((T,), 1, dtype=torch.int32)
    c = torch.randn(T, 2 * D, generator=g)
    pending = torch.randn(3, ratio + k, 2 * D, generator=g)
    cache = torch.randn(6, 4, D, generator=g)
    done = (pos + 1) % ratio == 0
    slots = torch.where(done, torch.randperm(24, generator=g)[:T], -1)
    assert done.sum() >= 1 and not done.all()
    args = (torch.ones(D), rope_inv_freq(1e4, R))
    p1, c1 = pending.clone(), cache.clone()
    got = sparse_mqa_compress_reference(c, p1, rows, pos, *args, c1, slots, eps=1e-6, ratio=ratio,
                                        cross_row_reads=True)
    p2, c2 = pending.clone(), cache.clone()
    for t in range(T):
        want = sparse_mqa_compress_reference(c[t:t + 1], p2, rows[t:t + 1], pos[t:t + 1], *args, c2, slots[t:t + 1],
                                             eps=1e-6, ratio=ratio)
        if done[t]:   # only a token that closes its group uses its pool
            torch.testing.assert_close(got[t:t + 1], want, rtol=0, atol=0)
    assert torch.equal(p1, p2) and torch.equal(c1, c2)
    with pytest.raises(UserError, match="needs a ring"):
        sparse_mqa_compress_reference(c, pending[:, :1].contiguous(), rows, pos, *args, cache.clone(), slots,
                                      eps=1e-6, ratio=ratio)
