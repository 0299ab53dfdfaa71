"""Sparse MLA piece: indexer top-k + absorbed MLA over the selection equal DSA written out here.

The oracle follows vLLM 0.33's DSA (``models/deepseek_v32/attention.py``: the indexer's ``wq_b`` on
the normed query latent, ``wk`` / ``weights_proj`` on h, the key's fp32 LayerNorm then RoPE of the
leading ``qk_rope_head_dim`` channels (``common/kernels.py``), logits ``sum_h w_h relu(q_h . k_t)``
scaled by ``d^-0.5 h^-0.5``, top-k over the cached tokens, sparse MLA over them): per sequence, fp64,
RoPE by complex multiplication (interleaved) / rotate-half (NeoX), the attention in the *expanded*
form (keys and values up-projected from the cached latents). Fresh random weights and paged caches
(shuffled blocks, random earlier tokens) per case; a context shorter than top-k (padding -1); batch 1
and 3; fp32 and bf16; odd sizes; full and reuse layers; TP = 2.

Top-k ties (equal logits) make more than one selection right: the selection is checked by its logit
values against the oracle's top-k values, and the attention against the oracle over that selection.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from latency_specialized.errors import UserError
from latency_specialized.ops import registry as op_registry
from latency_specialized.ops.attention import sparse_mla as sparse_ops
from latency_specialized.ops.registry import Implementation, always
from latency_specialized.pieces.attention.mla import MLAAttention
from latency_specialized.pieces.attention.sparse_mla import TOPK, IndexerOptions, SparseMLAAttention, runs_own_indexer
from latency_specialized.plugins import get_registry
from latency_specialized.spec import DenseMLPSpec, IndexerSpec, LayerSpec, MLAAttentionSpec, ModelSpec

from tests.pieces.piece_harness import TOL, ThreadWorld, bind, random_weights, rel, shard, site_list, step_context

HIDDEN, BLOCK, EPS, PER_SEQ = 40, 4, 1e-5, 4
HI, DI, K = 3, 12, 5


def _registry(monkeypatch, plain_gemm: bool = False) -> op_registry.ImplementationRegistry:
    """The plugin registry plus the indexer / sparse MLA families (not yet in FAMILIES / OP_MODULES);
    ``plain_gemm``: a top-priority gemm without a norm prologue (the q_a norm site then runs)."""
    monkeypatch.setitem(op_registry.FAMILIES, "attention.indexer", "DSA indexer top-k")
    monkeypatch.setitem(op_registry.FAMILIES, "attention.sparse_mla", "absorbed MLA over top-k")
    base = get_registry().implementations
    reg = op_registry.ImplementationRegistry()
    for impl in base:
        reg.register(impl)
    for impl in sparse_ops.IMPLEMENTATIONS:
        reg.register(impl)
    if plain_gemm:
        ref = base.reference("gemm").fn
        reg.register(Implementation("gemm", "gemm.test_plain", lambda *a, **kw: ref(*a, **kw), always, priority=1000,
                                    provider="test", strided_rows=True))
    return reg


@pytest.fixture
def registry(monkeypatch):
    return _registry(monkeypatch)


def _attn(gate=False, interleaved=True, heads=4) -> MLAAttentionSpec:
    return MLAAttentionSpec(num_heads=heads, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                            v_head_dim=6, use_rope=True, rope_theta=1e4, rope_interleaved=interleaved,
                            output_gate="sigmoid" if gate else "none",
                            indexer=IndexerSpec(num_heads=HI, head_dim=DI, topk=K, full_layers=(0, 2)))


def _spec(a: MLAAttentionSpec) -> ModelSpec:
    return ModelSpec(name="piece-test", variant="tiny", hidden_size=HIDDEN, vocab_size=64, max_context=64,
                     layers=tuple(LayerSpec(index=i, attention=a, ffn=DenseMLPSpec(intermediate=32)) for i in range(3)))


# ---------------------------------------------------------------------------------------------- oracle
def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float, interleaved: bool) -> torch.Tensor:
    """x [B, ..., R] rotated by pos [B] in fp64."""
    R = x.shape[-1]
    freq = theta ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    ang = pos.double().view(-1, *([1] * (x.dim() - 1))) * freq
    xd = x.double()
    if interleaved:
        z = torch.view_as_complex(xd.reshape(*x.shape[:-1], R // 2, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)).flatten(-2)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    return xd * cos + torch.cat([-xd[..., R // 2:], xd[..., :R // 2]], dim=-1) * sin


def _rms(x, w):
    xf = x.double()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.double()).to(x.dtype)


def _lin(x, w):
    return (x.float() @ w.float().t()).to(x.dtype)


def _ctx_rows(cache, block_table, b, n):
    pos = torch.arange(n)
    return cache[block_table[b, pos // BLOCK].long(), pos % BLOCK]


def _indexer_oracle(h, w, a, kcache, block_table, positions, rope_interleaved):
    """(logits per sequence [n] fp64, new key rows [B, D] in the cache dtype)."""
    R = a.qk_rope_head_dim
    q_c = _rms(_lin(h, w["q_a_proj"]), w["q_a_norm"])
    iq = _lin(q_c, w["indexer.q_proj"]).view(-1, HI, DI).double()
    ik = F.layer_norm(_lin(h, w["indexer.k_proj"]).double(), (DI,), w["indexer.k_norm"].double(),
                      w["indexer.k_norm_bias"].double(), 1e-6)
    iw = _lin(h, w["indexer.weights_proj"]).double()
    iq = torch.cat([_rope(iq[..., :R], positions, a.rope_theta, rope_interleaved), iq[..., R:]], -1)
    ik = torch.cat([_rope(ik[:, :R], positions, a.rope_theta, rope_interleaved), ik[:, R:]], -1)
    new_k = ik.to(kcache.dtype)
    logits = []
    for b in range(h.shape[0]):
        n = int(positions[b]) + 1
        keys = _ctx_rows(kcache, block_table, b, n).double()
        keys[-1] = new_k[b].double()
        s = torch.zeros(n, dtype=torch.float64)
        for hh in range(HI):
            s = s + iw[b, hh] * (keys @ iq[b, hh]).clamp(min=0)
        logits.append(s * DI ** -0.5 * HI ** -0.5)
    return logits, new_k


def _mla_oracle(h, w, a, cache, block_table, positions, selection):
    """Expanded-form MLA of the new tokens over ``selection[b]`` (positions); (out, new latent rows)."""
    H, nope, R, L, V = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank, a.v_head_dim
    q = _lin(_rms(_lin(h, w["q_a_proj"]), w["q_a_norm"]), w["q_b_proj"]).view(-1, H, nope + R)
    kv = _lin(h, w["kv_a_proj"])
    c, k_pe = _rms(kv[:, :L], w["kv_a_norm"]), kv[:, L:]
    q = torch.cat([q[..., :nope].double(), _rope(q[..., nope:], positions, a.rope_theta, a.rope_interleaved)], -1)
    k_pe = _rope(k_pe, positions, a.rope_theta, a.rope_interleaved).to(h.dtype)
    new = torch.cat([c, k_pe], -1)
    wkv = w["kv_b_proj"].double().view(H, nope + V, L)
    outs = []
    for b in range(h.shape[0]):
        n = int(positions[b]) + 1
        ctx = _ctx_rows(cache, block_table, b, n).double()
        ctx[-1] = new[b].double()
        ctx = ctx[torch.tensor(sorted(selection[b]), dtype=torch.long)]
        keys = torch.einsum("tl,hnl->thn", ctx[:, :L], wkv[:, :nope])
        vals = torch.einsum("tl,hvl->thv", ctx[:, :L], wkv[:, nope:])
        s = (torch.einsum("hn,thn->ht", q[b, :, :nope], keys) + torch.einsum("hr,tr->ht", q[b, :, nope:], ctx[:, L:]))
        outs.append(torch.einsum("ht,thv->hv", torch.softmax(s * (nope + R) ** -0.5, -1), vals).reshape(H * V))
    o = torch.stack(outs)
    if a.output_gate == "sigmoid":
        o = o * torch.sigmoid(_lin(h, w["g_proj"]).double())
    return _lin(o.to(h.dtype), w["o_proj"]), new


def _check_selection(sel_row: torch.Tensor, logits: torch.Tensor, dtype) -> list[int]:
    """The selected positions (asserting they are a top-K set of ``logits``, -1 padding after a short context)."""
    n = logits.shape[0]
    chosen = [int(i) for i in sel_row if int(i) >= 0]
    assert len(chosen) == min(K, n) and len(set(chosen)) == len(chosen) and all(0 <= i < n for i in chosen)
    assert int((sel_row < 0).sum()) == K - min(K, n)
    want = torch.sort(logits, descending=True).values[:min(K, n)]
    got = torch.sort(logits[torch.tensor(chosen)], descending=True).values
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got, want, atol=tol * float(logits.abs().max()) + 1e-12), (got, want)
    return chosen


# ---------------------------------------------------------------------------------------------- cases
def _case(a, dtype, seed, B=3):
    g = torch.Generator().manual_seed(seed)
    spec = _spec(a)
    # the indexer's RoPE layout is its own: the other one than the MLA rope's
    full = SparseMLAAttention(a, norm_eps=EPS,
                              indexer=IndexerOptions(full=True, rope_interleaved=not a.rope_interleaved))
    reuse = SparseMLAAttention(a, norm_eps=EPS, indexer=IndexerOptions(full=False))
    special = {"indexer.k_norm_bias": lambda shape, gen: 0.3 * torch.randn(shape, generator=gen)}
    w0 = random_weights(full.weights(spec, 1), dtype, g, special)
    w1 = random_weights(reuse.weights(spec, 1), dtype, g)
    block_table = torch.randperm(B * PER_SEQ, generator=g).view(B, PER_SEQ).to(torch.int32)
    positions = torch.tensor([13, 2, 9][:B])
    caches = {"kv0": (0.5 * torch.randn(B * PER_SEQ, BLOCK, a.latent_width, generator=g)).to(dtype),
              "ik0": torch.randn(B * PER_SEQ, BLOCK, DI, generator=g).to(dtype),
              "kv1": (0.5 * torch.randn(B * PER_SEQ, BLOCK, a.latent_width, generator=g)).to(dtype)}
    h = torch.randn(B, HIDDEN, generator=g).to(dtype)
    slots = block_table.gather(1, (positions // BLOCK).view(-1, 1).int()).view(-1).long() * BLOCK + positions % BLOCK
    meta = {"positions": positions, "slots": slots, "seq_lens": (positions + 1).to(torch.int32),
            "block_table": block_table}
    return spec, full, reuse, w0, w1, caches, meta, h


def _run(piece, spec, w_rank, states, meta, h, scratch, registry, *, layer, tp=1, rank=0, comm=None):
    rank_spec = spec.shard(tp) if tp > 1 else spec
    ops = bind(lambda b: piece.sites(b, rank_spec), dtype=h.dtype, rows=h.shape[0], tp=tp, registry=registry)
    step = step_context(ops, spec, rows=h.shape[0], meta=meta, tp=tp, rank=rank, comm=comm, layer=layer,
                        scratch=scratch)
    return piece.forward(step, piece.arrange(w_rank, step.rank_spec), states, h), ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("gate,q_a_norm", [(False, "prologue"), (True, "site")])
def test_sparse_mla_full_then_reuse_layer_equal_dsa(gate, q_a_norm, B, dtype, monkeypatch):
    registry = _registry(monkeypatch, plain_gemm=q_a_norm == "site")
    a = _attn(gate=gate)
    spec, full, reuse, w0, w1, caches, meta, h = _case(a, dtype, seed=7 + B + gate + (dtype == torch.bfloat16), B=B)
    orig = {k: v.clone() for k, v in caches.items()}
    scratch = full.buffers(spec, B + 2, dtype, h.device)
    scratch[TOPK].fill_(123456)                      # the full layer must overwrite what the layers read
    got0, ops0 = _run(full, spec, w0, {"kv": caches["kv0"], "indexer_k": caches["ik0"]}, meta, h, scratch, registry,
                      layer=0)
    # the selection: a top-K set of the oracle's logits (-1 after a short context)
    logits, new_k = _indexer_oracle(h, w0, a, orig["ik0"], meta["block_table"], meta["positions"],
                                    full.options.rope_interleaved)
    sel = [_check_selection(scratch[TOPK][b], logits[b], dtype) for b in range(B)]
    assert bool((scratch[TOPK][B:] == 123456).all())   # rows past the step untouched
    want0, row0 = _mla_oracle(h, w0, a, orig["kv0"], meta["block_table"], meta["positions"], sel)
    assert rel(got0, want0) <= TOL[dtype]
    L_R = a.latent_width
    assert rel(caches["kv0"].view(-1, L_R)[meta["slots"]].float(), row0.float()) <= TOL[dtype]
    assert rel(caches["ik0"].view(-1, DI)[meta["slots"]].float(), new_k.float()) <= TOL[dtype]
    touched = torch.zeros(B * PER_SEQ * BLOCK, dtype=torch.bool)
    touched[meta["slots"]] = True
    assert torch.equal(caches["ik0"].view(-1, DI)[~touched], orig["ik0"].view(-1, DI)[~touched])
    assert ops0.calls["kind/attn.indexer"] == 1 and ops0.calls["kind/attn.sparse_mla"] == 1
    assert ops0.calls["kind/attn.q_a_norm"] == (1 if q_a_norm == "site" else 0)
    # a reuse layer attends over the same selection, with its own weights and cache, and no indexer
    got1, ops1 = _run(reuse, spec, w1, {"kv": caches["kv1"]}, meta, h, scratch, registry, layer=1)
    want1, _ = _mla_oracle(h, w1, a, orig["kv1"], meta["block_table"], meta["positions"], sel)
    assert rel(got1, want1) <= TOL[dtype]
    assert "kind/attn.indexer" not in ops1.calls and ops1.calls["kind/attn.sparse_mla"] == 1


def test_sparse_mla_short_context_equals_dense_mla(registry):
    """Every context no longer than top-k: the sparse piece attends over all of it, as the dense MLA piece does."""
    a, dtype = _attn(gate=True, interleaved=False), torch.float32
    spec, full, _, w0, _, caches, meta, h = _case(a, dtype, seed=21)
    meta = {**meta, "positions": torch.tensor([3, 0, 4]), "seq_lens": torch.tensor([4, 1, 5], dtype=torch.int32)}
    meta["slots"] = (meta["block_table"].gather(1, (meta["positions"] // BLOCK).view(-1, 1).int()).view(-1).long()
                     * BLOCK + meta["positions"] % BLOCK)
    dense = MLAAttention(a.model_copy(update={"indexer": None}), norm_eps=EPS)
    kv_dense = caches["kv0"].clone()
    want, _ = _run(dense, spec, {k: v for k, v in w0.items() if not k.startswith("indexer.")}, {"kv": kv_dense}, meta,
                   h, {}, registry, layer=0)
    scratch = full.buffers(spec, 3, dtype, h.device)
    got, _ = _run(full, spec, w0, {"kv": caches["kv0"], "indexer_k": caches["ik0"]}, meta, h, scratch, registry,
                  layer=0)
    assert rel(got, want) <= TOL[dtype] and torch.equal(caches["kv0"], kv_dense)
    for b, n in enumerate((4, 1, 5)):
        assert sorted(int(i) for i in scratch[TOPK][b] if i >= 0) == list(range(n))


def test_sparse_mla_tp2_ranks_sum_to_the_whole(registry):
    """Each rank's heads give a partial sum; every rank runs the whole (replicated) indexer."""
    a, dtype, tp = _attn(gate=True), torch.float32, 2
    spec, full, _, w0, _, caches, meta, h = _case(a, dtype, seed=3)
    c1 = {k: v.clone() for k, v in caches.items()}
    scratch = full.buffers(spec, 3, dtype, h.device)
    want, _ = _run(full, spec, w0, {"kv": c1["kv0"], "indexer_k": c1["ik0"]}, meta, h, scratch, registry, layer=0)
    decls = full.weights(spec, tp)

    def rank_body(r, comm):
        c = {k: v.clone() for k, v in caches.items()}
        sc = full.buffers(spec, 3, dtype, h.device)
        out, _ = _run(full, spec, {d.name: shard(d, w0[d.name], r, tp) for d in decls},
                      {"kv": c["kv0"], "indexer_k": c["ik0"]}, meta, h, sc, registry, layer=0, tp=tp, rank=r,
                      comm=comm)
        return out, sc[TOPK], c["ik0"]

    (o0, t0, k0), (o1, t1, k1) = ThreadWorld(tp).run(rank_body)
    assert rel(o0 + o1, want) <= TOL[dtype]
    assert torch.equal(t0, t1) and torch.equal(t0, scratch[TOPK]) and torch.equal(k0, k1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_mla_op_reference_equals_masked(dtype):
    """The host-syncing reference (through attention.sparse's reference) and the masked implementation agree,
    with -1 slots, stale positions (>= seq_len) and a padding row."""
    g = torch.Generator().manual_seed(5)
    B, H, L, R, nope, V, blocks = 4, 3, 16, 8, 8, 6, 12
    q = torch.randn(B, H, nope + R, generator=g).to(dtype)
    kv_c, k_pe = torch.randn(B, L, generator=g).to(dtype), torch.randn(B, R, generator=g).to(dtype)
    cache = torch.randn(blocks, BLOCK, L + R, generator=g).to(dtype)
    block_table = torch.randperm(blocks, generator=g).view(B, 3).to(torch.int32)
    seq_lens = torch.tensor([9, 3, 12, 0], dtype=torch.int32)
    slots = torch.tensor([block_table[0, 2] * BLOCK, block_table[1, 0] * BLOCK + 2, block_table[2, 2] * BLOCK + 3, -1])
    topk = torch.tensor([[8, 0, 5, -1, 2], [2, 1, -1, -1, 0], [11, 3, 7, 14, 6], [0, 1, 2, 3, 4]], dtype=torch.int32)
    w_kv_b = torch.randn(H * (nope + V), L, generator=g).to(dtype) / 4
    gate = torch.randn(B, H * V, generator=g).to(dtype)
    kv_norm = (1 + 0.1 * torch.randn(L, generator=g)).to(dtype)
    kw = dict(qk_nope_head_dim=nope, v_head_dim=V, gate=gate, kv_norm_weight=kv_norm)
    c1, c2 = cache.clone(), cache.clone()
    ref = sparse_ops.sparse_mla_decode_reference(q, kv_c, k_pe, c1, slots, block_table, seq_lens, w_kv_b, topk, **kw)
    msk = sparse_ops.sparse_mla_decode_masked(q, kv_c, k_pe, c2, slots, block_table, seq_lens, w_kv_b, topk, **kw)
    assert torch.equal(c1, c2) and rel(msk, ref) <= TOL[dtype]
    assert torch.equal(ref[3], torch.zeros_like(ref[3])) and torch.equal(msk[3], torch.zeros_like(msk[3]))
    # position 14 of sequence 2 is past its length: dropping it changes nothing
    topk2 = topk.clone()
    topk2[2, 3] = -1
    again = sparse_ops.sparse_mla_decode_masked(q, kv_c, k_pe, cache.clone(), slots, block_table, seq_lens, w_kv_b,
                                                topk2, **kw)
    assert torch.equal(again, msk)


def test_indexer_op_pads_and_keeps_a_static_width():
    """Block tables shorter than top-k and padding rows: [B, K] with -1 beyond the context, written to ``out``."""
    g = torch.Generator().manual_seed(1)
    B, blocks = 2, 4
    q, k, wts = torch.randn(B, HI, DI, generator=g), torch.randn(B, DI, generator=g), torch.randn(B, HI, generator=g)
    cache = torch.randn(blocks, BLOCK, DI, generator=g)
    block_table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([6, 0], dtype=torch.int32)
    out = torch.full((B, 11), 99, dtype=torch.int32)
    before = cache.clone()
    got = sparse_ops.indexer_topk_reference(q, k, wts, cache, torch.tensor([1, -1]), block_table, seq_lens, topk=11,
                                            out=out)
    assert got is out and out.shape == (B, 11)
    assert sorted(int(i) for i in out[0] if i >= 0) == list(range(6)) and int((out[0] < 0).sum()) == 5
    assert bool((out[1] == -1).all())
    assert torch.equal(cache.view(-1, DI)[1], k[0]) and torch.equal(cache.view(-1, DI)[2:], before.view(-1, DI)[2:])


def test_sparse_mla_declarations_and_refusals():
    a = _attn(gate=True)
    spec = _spec(a)
    full, reuse = SparseMLAAttention(a), SparseMLAAttention(a, indexer=IndexerOptions(full=False))
    fd = {d.name: d for d in full.weights(spec, 2)}
    rd = {d.name: d for d in reuse.weights(spec, 2)}
    assert set(fd) - set(rd) == {"indexer.q_proj", "indexer.k_proj", "indexer.weights_proj", "indexer.k_norm",
                                 "indexer.k_norm_bias"}
    assert all(fd[n].split is None for n in fd if n.startswith("indexer."))
    assert fd["indexer.k_norm"].dtype == "float32" and fd["indexer.q_proj"].shape == (HI * DI, 12)
    assert [s.name for s in full.states(spec, 2)] == ["kv", "indexer_k"] and full.states(spec, 2)[1].shape == (DI,)
    assert [s.name for s in reuse.states(spec, 2)] == ["kv"]
    def sites(p):
        return {s.name: s for s in site_list(lambda b: p.sites(b, spec.shard(2)), dtype=torch.bfloat16, rows=3, tp=2)}

    def names(p):
        return list(sites(p))

    fs = sites(full)   # the indexer's h projections ride on qkv_a, its queries on q_b (rank heads: 2)
    assert fs["kind/attn.qkv_a_proj"].ctx.dim("N") == 12 + 16 + 8 + 2 * 6 + DI + HI
    assert fs["kind/attn.q_b_proj"].ctx.dim("N") == 2 * 16 + HI * DI
    assert sites(reuse)["kind/attn.q_b_proj"].ctx.dim("N") == 2 * 16
    assert fs["kind/attn.indexer"].ctx.dim("topk") == K and fs["kind/attn.indexer"].family == "attention.indexer"
    assert names(full) == ["kind/attn.qkv_a_proj", "kind/attn.q_a_norm", "kind/attn.q_b_proj", "kind/attn.indexer",
                           "kind/attn.sparse_mla", "kind/attn.o_proj"]
    assert "kind/attn.indexer" not in names(reuse) and "kind/attn.sparse_mla" in names(reuse)
    assert full.buffers(spec, 4, torch.bfloat16, torch.device("cpu"))[TOPK].shape == (4, K)
    assert [runs_own_indexer(a.indexer, i) for i in range(4)] == [True, False, True, False]
    assert runs_own_indexer(IndexerSpec(num_heads=1, head_dim=8, topk=2), 5)       # empty: every layer runs its own
    with pytest.raises(UserError, match="needs MLAAttentionSpec.indexer"):
        SparseMLAAttention(a.model_copy(update={"indexer": None}))
    with pytest.raises(UserError, match="q_lora_rank"):
        SparseMLAAttention(a.model_copy(update={"q_lora_rank": None}))
    with pytest.raises(UserError, match="IndexerOptions"):
        SparseMLAAttention(a, indexer={"full": True})


def test_sparse_mla_refuses_a_layer_of_the_other_kind(registry):
    a, dtype = _attn(), torch.float32
    spec, full, reuse, w0, w1, caches, meta, h = _case(a, dtype, seed=2)
    scratch = full.buffers(spec, 3, dtype, h.device)
    with pytest.raises(UserError, match="does not run its own indexer"):
        _run(full, spec, w0, {"kv": caches["kv0"], "indexer_k": caches["ik0"]}, meta, h, scratch, registry, layer=1)
    with pytest.raises(UserError, match="runs its own indexer"):
        _run(reuse, spec, w1, {"kv": caches["kv1"]}, meta, h, scratch, registry, layer=2)
    with pytest.raises(UserError, match="no scratch buffer"):
        _run(reuse, spec, w1, {"kv": caches["kv1"]}, meta, h, {}, registry, layer=1)
