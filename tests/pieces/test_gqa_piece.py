"""GQA piece vs a plain-torch formula: projections, per-head QK norm, RoPE, paged KV write + attention
(window, sinks), output gate, o_proj; TP partial sums; declarations."""

from __future__ import annotations

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.pieces import GQAAttention
from latency_specialized.spec import DenseMLPSpec, GQAAttentionSpec, LayerSpec, ModelSpec, NormSpec

from tests.pieces.helpers import make_step, piece_sites, random_full, rank_weights
from tests.runtime.composed_toy import ToyReference

H, BS, EPS = 32, 4, 1e-6
QWEN = GQAAttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e6, qk_norm=True)
WINDOWED = GQAAttentionSpec(num_heads=4, num_kv_heads=1, head_dim=8, rope_theta=100.0, qk_norm=True, sliding_window=3,
                            softmax_scale=0.3, output_gate="sigmoid")
CASES = {
    "qwen3": GQAAttention(QWEN, qk_norm="weighted"),
    "window-sinks-gate": GQAAttention(WINDOWED, qk_norm="weightless", rope_style="interleaved", rotary_dim=4, sinks=True),
    "nope-plain": GQAAttention(GQAAttentionSpec(num_heads=4, num_kv_heads=4, head_dim=8)),
    # Muse Spark's attention: weightless QK norm, NeoX RoPE, window, per-head output norm before the gate
    "muse-out-norm": GQAAttention(WINDOWED, qk_norm="weightless", out_norm=True),
}


def spec_for(a: GQAAttentionSpec) -> ModelSpec:
    return ModelSpec(name="gqa_toy", hidden_size=H, vocab_size=16, max_context=64, norm=NormSpec(eps=EPS),
                     layers=(LayerSpec(index=0, attention=a, ffn=DenseMLPSpec(intermediate=16)),))


def rms(x, w):
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS)
    return y * w if w is not None else y


def expected(piece: GQAAttention, w: dict, x: torch.Tensor, hist_k: list, hist_v: list, pos: int):
    """One sequence: (output [H], new k [KV, D], new v [KV, D]) in float64 from the full weights."""
    a = piece.spec
    Hq, KV, D = a.num_heads, a.num_kv_heads, a.head_dim
    x = x.double()
    q = (x @ w["q_proj"].double().T).view(Hq, D)
    k = (x @ w["k_proj"].double().T).view(KV, D)
    v = (x @ w["v_proj"].double().T).view(KV, D)
    if piece.qk_norm == "weighted":
        q, k = rms(q, w["q_norm"].double()), rms(k, w["k_norm"].double())
    elif piece.qk_norm == "weightless":
        q, k = rms(q, None), rms(k, None)
    if a.rope_theta is not None:
        rot = piece.rotary_dim or D
        inter = piece.rope_style == "interleaved"
        q, k = ToyReference.rope(q, pos, a.rope_theta, rot, inter), ToyReference.rope(k, pos, a.rope_theta, rot, inter)
    K = torch.cat([torch.stack(hist_k).double(), k[None]]) if hist_k else k[None]
    V = torch.cat([torch.stack(hist_v).double(), v[None]]) if hist_v else v[None]
    if a.sliding_window:
        K, V = K[-a.sliding_window:], V[-a.sliding_window:]
    scale = a.softmax_scale or D ** -0.5
    o = torch.zeros(Hq, D, dtype=torch.float64)
    for h in range(Hq):
        kv = h * KV // Hq
        logits = (K[:, kv] @ q[h]) * scale
        extra = [w["sinks"][h].double()] if piece.sinks else []
        p = torch.softmax(torch.cat([logits, torch.stack(extra)]) if extra else logits, 0)[: logits.shape[0]]
        o[h] = p @ V[:, kv]
    if piece.out_norm:
        o = rms(o, None)
    o = o.reshape(-1)
    if a.output_gate == "sigmoid":
        o = o * torch.sigmoid(x @ w["g_proj"].double().T)
    return o @ w["o_proj"].double().T, k, v


def paged_setup(piece: GQAAttention, lens: list[int], g: torch.Generator, tp: int = 1):
    """Full-head caches (NaN outside the histories), histories, and the step's metadata (+1 padding row)."""
    a = piece.spec
    n_blocks = sum(-(-(n + 1) // BS) for n in lens) + 2          # + 2 blocks nobody owns
    order = torch.randperm(n_blocks, generator=g).tolist()
    kc = torch.full((n_blocks, BS, a.num_kv_heads, a.head_dim), float("nan"))
    vc = kc.clone()
    tables, hist = [], []
    at = 0
    for n in lens:
        nb = -(-(n + 1) // BS)
        blocks, at = order[at:at + nb], at + nb
        tables.append(blocks + [0] * (4 - nb))
        hk = [torch.randn(a.num_kv_heads, a.head_dim, generator=g) for _ in range(n)]
        hv = [torch.randn(a.num_kv_heads, a.head_dim, generator=g) for _ in range(n)]
        for p in range(n):
            kc[blocks[p // BS], p % BS], vc[blocks[p // BS], p % BS] = hk[p], hv[p]
        hist.append((hk, hv))
    tables.append([0] * 4)                                          # padding row
    slots = [tables[b][n // BS] * BS + n % BS for b, n in enumerate(lens)] + [-1]
    meta = {"positions": torch.tensor(lens + [0]), "slots": torch.tensor(slots),
            "seq_lens": torch.tensor([n + 1 for n in lens] + [0], dtype=torch.int32),
            "block_table": torch.tensor(tables, dtype=torch.int32)}
    return kc, vc, hist, meta


@pytest.mark.parametrize("case", list(CASES))
def test_gqa_piece_matches_the_formula_and_writes_the_cache(case):
    piece = CASES[case]
    spec = spec_for(piece.spec)
    g = torch.Generator().manual_seed(len(case))
    w = random_full(piece, spec, g)
    lens = [5, 0, 9]
    kc, vc, hist, meta = paged_setup(piece, lens, g)
    untouched = kc.isnan().clone()
    x = torch.randn(len(lens) + 1, H, generator=g)
    M = x.shape[0]
    step = make_step(piece_sites(piece, spec, 1, M), spec, M, meta=meta)
    y = piece.forward(step, rank_weights(piece, spec, w, 0, 1), {"k": kc, "v": vc}, x)
    assert y.shape == (M, H) and not torch.isnan(y).any()
    assert torch.equal(y[-1], torch.zeros(H))                      # the padding row attends nothing
    for b, n in enumerate(lens):
        want, k_new, v_new = expected(piece, w, x[b], *hist[b], n)
        torch.testing.assert_close(y[b].double(), want, rtol=1e-5, atol=1e-5)
        blk, off = int(meta["block_table"][b, n // BS]), n % BS
        torch.testing.assert_close(kc[blk, off].double(), k_new, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vc[blk, off].double(), v_new, rtol=1e-5, atol=1e-5)
        untouched[blk, off] = False
    assert kc[untouched].isnan().all() and vc[untouched].isnan().all()   # nothing else written (padding: none)
    names = {s.name for s in step.ops.sites.values()}
    assert ("k/attn.q_norm" in names) == (piece.norm_kind != "none")


@pytest.mark.parametrize("case", ["qwen3", "window-sinks-gate"])
def test_rank_partials_sum_to_the_full_output(case):
    """TP=2: query heads split, KV heads split (qwen3) or replicated (MQA); the o_proj partials add up."""
    piece, tp = CASES[case], 2
    spec = spec_for(piece.spec)
    g = torch.Generator().manual_seed(7)
    w = random_full(piece, spec, g)
    kc, vc, hist, meta = paged_setup(piece, [6, 2], g)
    kc, vc = torch.nan_to_num(kc), torch.nan_to_num(vc)
    x = torch.randn(3, H, generator=g)
    full_k, full_v = kc.clone(), vc.clone()
    full = piece.forward(make_step(piece_sites(piece, spec, 1, 3), spec, 3, meta=meta),
                         rank_weights(piece, spec, w, 0, 1), {"k": full_k, "v": full_v}, x)
    total = torch.zeros_like(full)
    kv = piece.spec.num_kv_heads
    for rank in range(tp):
        lo = rank * kv // tp if kv >= tp else 0
        hi = lo + max(kv // tp, 1)
        rk, rv = kc[:, :, lo:hi].clone(), vc[:, :, lo:hi].clone()
        step = make_step(piece_sites(piece, spec, tp, 3), spec, 3, tp=tp, rank=rank, meta=meta)
        total += piece.forward(step, rank_weights(piece, spec, w, rank, tp), {"k": rk, "v": rv}, x)
        torch.testing.assert_close(rk, full_k[:, :, lo:hi], rtol=1e-5, atol=1e-5)   # the rank's KV heads
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-5)


def test_declarations_sites_states_and_errors():
    piece = CASES["window-sinks-gate"]
    spec = spec_for(piece.spec)
    decls = {d.name: d for d in piece.weights(spec, 2)}
    assert decls["k_proj"].replicas == 2 and decls["k_proj"].split == 0 and decls["q_proj"].replicas == 1
    assert decls["sinks"].dtype == "float32" and decls["sinks"].split == 0 and "q_norm" not in decls
    assert decls["o_proj"].split == 1 and decls["g_proj"].shape == (32, H)
    states = piece.states(spec, 2)
    assert [(s.name, s.kind, s.shape) for s in states] == [("k", "paged", (1, 8)), ("v", "paged", (1, 8))]
    sites = {s.name: s for s in piece_sites(piece, spec, 2, 3)}
    assert list(sites) == ["k/attn.qkv_proj", "k/attn.qk_prep", "k/attn.q_norm", "k/attn.k_norm", "k/attn.gqa",
                           "k/attn.o_proj"]
    assert sites["k/attn.qk_prep"].ctx.attr("fuses") == "attn.q_norm,attn.k_norm"   # the fused form of the three
    assert sites["k/attn.qkv_proj"].ctx.dim("N") == (2 * 2 + 2 * 1) * 8       # q | k | v | gate of 2 heads, 1 KV head
    assert sites["k/attn.q_norm"].ctx.tokens == 3 * 2 and sites["k/attn.gqa"].ctx.dim("window") == 3
    with pytest.raises(UserError, match="qk_norm='weighted'"):
        GQAAttention(QWEN)
    with pytest.raises(UserError, match="multiple"):
        GQAAttention(GQAAttentionSpec(num_heads=6, num_kv_heads=2, head_dim=8)).weights(spec, 3)
    with pytest.raises(UserError, match="rotary_dim"):
        GQAAttention(WINDOWED, qk_norm="none", rotary_dim=5)
