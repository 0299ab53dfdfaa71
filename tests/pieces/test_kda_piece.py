"""KDA attention piece: its forward on the op references equals the gated delta rule written out in torch.

Fresh random weights (checkpoint level, from the piece's own declarations) and states per case;
sequences sit in scattered state rows. The formula below is written from the architecture (one
token per sequence: conv + SiLU, L2 norms, decay, delta rule, gated RMSNorm, o_proj), rounding to
the activation dtype where a serving stack rounds - not from the op family's code.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.pieces.attention.kda import KDAAttention, in_proj_rows
from latency_specialized.spec import DenseMLPSpec, KDAAttentionSpec, LayerSpec, ModelSpec

from tests.pieces.piece_harness import TOL, ThreadWorld, bind, random_weights, rel, shard, step_context

HIDDEN = 48


def _spec(a: KDAAttentionSpec) -> ModelSpec:
    return ModelSpec(name="piece-test", variant="tiny", hidden_size=HIDDEN, vocab_size=64, max_context=64,
                     layers=(LayerSpec(index=0, attention=a, ffn=DenseMLPSpec(intermediate=32)),))


ATTN = KDAAttentionSpec(num_heads=4, head_dim=8, conv_kernel=4, decay_rank=8, gate_lower_bound=-5.0)
SPECIAL = {
    "A_log": lambda shape, g: torch.log(0.5 + 1.5 * torch.rand(shape, generator=g)),
    "dt_bias": lambda shape, g: -2.0 + 0.5 * torch.randn(shape, generator=g),
    "q_conv": lambda shape, g: torch.randn(shape, generator=g) / shape[-1] ** 0.5,
    "k_conv": lambda shape, g: torch.randn(shape, generator=g) / shape[-1] ** 0.5,
    "v_conv": lambda shape, g: torch.randn(shape, generator=g) / shape[-1] ** 0.5,
}


def _formula(h, w, conv_state, S, a: KDAAttentionSpec, eps: float):
    """One KDA decode token per row of ``h``; returns (out, new conv state, new recurrent state)."""
    dt = h.dtype
    lin = lambda x, name: (x.float() @ w[name].float().t()).to(dt)   # noqa: E731 - one rounding per projection
    B, H, D, W = h.shape[0], a.num_heads, a.head_dim, a.conv_kernel
    x = torch.cat([lin(h, "q_proj"), lin(h, "k_proj"), lin(h, "v_proj")], dim=-1)          # [B, 3HD]
    window = torch.cat([conv_state.float(), x.float().unsqueeze(-1)], dim=-1)              # [B, 3HD, W]
    taps = torch.cat([w[f"{n}_conv"][:, 0].float() for n in ("q", "k", "v")])              # [3HD, W]
    conv = torch.nn.functional.silu((window * taps).sum(-1)).to(dt).float()
    new_conv = window[..., 1:].to(conv_state.dtype)
    q, k, v = conv.view(B, 3, H, D).unbind(1)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * D ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    f = lin(lin(h, "f_a_proj"), "f_b_proj").float().view(B, H, D)
    A = torch.exp(w["A_log"].float()).view(H, 1)
    g = a.gate_lower_bound * torch.sigmoid(A * (f + w["dt_bias"].float().view(H, D)))
    beta = torch.sigmoid(lin(h, "b_proj").float())                                          # [B, H]
    S = S.float() * torch.exp(g).unsqueeze(-2)                                              # decay along keys
    v_new = beta.unsqueeze(-1) * (v - torch.einsum("bhvk,bhk->bhv", S, k))
    S = S + v_new.unsqueeze(-1) * k.unsqueeze(-2)
    o = torch.einsum("bhvk,bhk->bhv", S, q)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * w["o_norm"].float()
    o = (o * torch.sigmoid(lin(h, "g_proj").float().view(B, H, D))).reshape(B, H * D).to(dt)
    return lin(o, "o_proj"), new_conv, S


def _case(dtype, seed, a=ATTN, B=3):
    g = torch.Generator().manual_seed(seed)
    piece = KDAAttention(a, norm_eps=1e-5)
    spec = _spec(a)
    w = random_weights(piece.weights(spec, 1), dtype, g, SPECIAL)
    rows = torch.tensor([3, 1, 5][:B], dtype=torch.int32)
    hd = a.num_heads * a.head_dim
    conv = torch.randn(6, 3 * hd, a.conv_kernel - 1, generator=g).to(dtype)
    state = 0.3 * torch.randn(6, a.num_heads, a.head_dim, a.head_dim, generator=g)
    h = torch.randn(B, HIDDEN, generator=g).to(dtype)
    return piece, spec, w, rows, conv, state, h


def _run(piece, spec, w_rank, conv, state, rows, h, *, tp=1, rank=0, comm=None):
    ops = bind(lambda b: piece.sites(b, spec.shard(tp) if tp > 1 else spec), dtype=h.dtype, rows=h.shape[0], tp=tp)
    step = step_context(ops, spec, rows=h.shape[0], meta={"rows": rows}, tp=tp, rank=rank, comm=comm)
    out = piece.forward(step, piece.arrange(w_rank, step.rank_spec), {"conv": conv, "state": state}, h)
    return out, ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_piece_equals_the_gated_delta_rule(dtype):
    piece, spec, w, rows, conv, state, h = _case(dtype, seed=11 + (dtype == torch.bfloat16))
    want, want_conv, want_state = _formula(h, w, conv[rows.long()], state[rows.long()], piece.spec, 1e-5)
    conv0, state0 = conv.clone(), state.clone()
    got, ops = _run(piece, spec, w, conv, state, rows, h)
    assert got.dtype == dtype and rel(got, want) <= TOL[dtype]
    assert rel(conv[rows.long()].float(), want_conv.float()) <= TOL[dtype]
    assert rel(state[rows.long()], want_state) <= TOL[dtype]
    others = [r for r in range(6) if r not in rows.tolist()]      # rows of other sequences are untouched
    assert torch.equal(conv[others], conv0[others]) and torch.equal(state[others], state0[others])
    assert dict(ops.calls) == {"kind/attn.in_proj": 1, "kind/attn.kda": 1, "kind/attn.o_proj": 1}


def test_kda_piece_declarations():
    piece, spec = KDAAttention(ATTN), _spec(ATTN)
    hd = ATTN.num_heads * ATTN.head_dim
    decls = {d.name: d for d in piece.weights(spec, 2)}
    assert decls["o_proj"].split == 1 and decls["f_a_proj"].split is None and decls["q_proj"].split == 0
    assert {n for n, d in decls.items() if d.dtype == "float32"} == {"q_conv", "k_conv", "v_conv", "A_log", "dt_bias",
                                                                       "o_norm"}
    st = {s.name: s for s in piece.states(spec, 2)}
    assert st["conv"].kind == st["state"].kind == "rows"
    assert st["conv"].shape == (3 * hd // 2, ATTN.conv_kernel - 1)
    assert st["state"].shape == (ATTN.num_heads // 2, ATTN.head_dim, ATTN.head_dim) and st["state"].dtype == "float32"
    g = torch.Generator().manual_seed(0)
    w = random_weights(piece.weights(spec, 1), torch.float32, g, SPECIAL)
    arranged = piece.arrange(w, spec)
    rows = 4 * hd + ATTN.decay_rank + ATTN.num_heads
    assert arranged["in_proj"].shape[0] == in_proj_rows(ATTN) == rows + (-rows % 16) > rows
    assert torch.equal(arranged["in_proj"][rows:], torch.zeros_like(arranged["in_proj"][rows:]))  # padding rows


def test_kda_piece_tp2_ranks_sum_to_the_whole():
    """Each rank's shard (by the declarations) gives a partial sum; the ranks' sum is the TP=1 output and
    their state shards (heads) are the TP=1 states."""
    dtype, tp = torch.float32, 2
    piece, spec, w, rows, conv, state, h = _case(dtype, seed=5)
    hd = ATTN.num_heads * ATTN.head_dim
    full_conv, full_state = conv.clone(), state.clone()
    want, _ = _run(piece, spec, w, full_conv, full_state, rows, h)
    decls = piece.weights(spec, tp)

    def rank_body(r, comm):
        wr = {d.name: shard(d, w[d.name], r, tp) for d in decls}
        # the rank's state shard: its heads; conv channels of q, k and v each split on their own
        c = torch.cat([x.chunk(tp, dim=1)[r] for x in conv.split(hd, dim=1)], dim=1).contiguous()
        s = state.chunk(tp, dim=1)[r].contiguous()
        out, _ = _run(piece, spec, wr, c, s, rows, h, tp=tp, rank=r, comm=comm)
        return out, c, s

    res = ThreadWorld(tp).run(rank_body)
    assert rel(res[0][0] + res[1][0], want) <= TOL[dtype]
    assert rel(torch.cat([res[0][2], res[1][2]], dim=1)[rows.long()], full_state[rows.long()]) <= TOL[dtype]
    convs = [x.split(hd // tp, dim=1) for x in (res[0][1], res[1][1])]   # per rank: its q, k, v channel slices
    got_conv = torch.cat([torch.cat([convs[0][j], convs[1][j]], dim=1) for j in range(3)], dim=1)
    assert rel(got_conv[rows.long()], full_conv[rows.long()]) <= TOL[dtype]
