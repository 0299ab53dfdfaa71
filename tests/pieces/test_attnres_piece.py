"""Block AttnRes residual piece: every sublayer input and the final hidden state equal Block AttnRes
written out in torch with the sources as a Python list (embedding, completed blocks, partial block).

Fresh random norms / pseudo-queries per case; the sublayers are random functions of their input
(``tanh(x @ W)``) so an input mixed wrongly changes every later value. Run over 7 layers in blocks
of 3 (blocks written at layers 0, 3, 6; the final mix sees the embedding, two completed blocks and
the partial one), at TP=1 and TP=2 (threads: each rank adds its share of every sublayer output and
the all-reduce sites sum them into the partial-block source).
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.pieces.residual.attnres import SOURCES, BlockAttnRes, attnres_rows
from latency_specialized.spec import DenseMLPSpec, KDAAttentionSpec, LayerSpec, ModelSpec, NormSpec, ResidualSpec

from tests.pieces.piece_harness import TOL, ThreadWorld, bind, random_weights, rel, run_residual

H, LAYERS, BLOCK, EPS, M = 32, 7, 3, 1e-5, 3


def _spec() -> ModelSpec:
    layer = lambda i: LayerSpec(index=i, attention=KDAAttentionSpec(num_heads=2, head_dim=8),   # noqa: E731
                                ffn=DenseMLPSpec(intermediate=16))
    return ModelSpec(name="piece-test", variant="tiny", hidden_size=H, vocab_size=64, max_context=64,
                     layers=tuple(layer(i) for i in range(LAYERS)),
                     residual=ResidualSpec(kind="attnres", block_size=BLOCK, max_cached_blocks=3),
                     norm=NormSpec(eps=EPS))


def _mix(sources, norm, query, out_norm):
    v = torch.stack([s.float() for s in sources])                                     # [S, M, H]
    normed = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS) * norm.float()
    p = torch.softmax(normed @ query.float()[0], dim=0)                                 # [S, M]
    mixed = (p.unsqueeze(-1) * v).sum(0)
    if out_norm is not None:
        mixed = mixed * torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + EPS) * out_norm.float()
    return mixed.to(sources[0].dtype)


def _formula(x, wl, wf, sub):
    """(every sublayer input in order, final hidden state)."""
    blocks, partial, inputs = [x], None, []
    for i in range(LAYERS):
        if i % BLOCK == 0 and partial is not None:
            blocks.append(partial)
            partial = None
        for which in ("attn", "ffn"):
            w = wl[i]
            h = _mix(blocks + ([partial] if partial is not None else []), w[f"{which}.norm"], w[f"{which}.query"],
                     w[f"{which}.out_norm"])
            inputs.append(h)
            y = sub(i, which, h)
            partial = y if partial is None else (partial.float() + y.float()).to(x.dtype)
    h = _mix(blocks + [partial], wf["norm"], wf["query"], None)
    hf = h.float()
    return inputs, (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * wf["out_norm"].float()).to(x.dtype)


def _setup(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    spec = _spec()
    piece = BlockAttnRes.for_spec(spec)
    assert (piece.block_size, piece.rows, piece.eps) == (BLOCK, attnres_rows(LAYERS, BLOCK), EPS) == (3, 4, 1e-5)
    wl = [random_weights(piece.weights(spec, 1, "layer"), dtype, g) for _ in range(LAYERS)]
    wf = random_weights(piece.weights(spec, 1, "final"), dtype, g)
    mats = {(i, s): torch.randn(H, H, generator=g) / H ** 0.5 for i in range(LAYERS) for s in ("attn", "ffn")}
    x = torch.randn(M, H, generator=g).to(dtype)
    sub = lambda i, s, h: torch.tanh(h.float() @ mats[(i, s)]).to(dtype)   # noqa: E731
    return spec, piece, wl, wf, x, sub


def _run(spec, piece, wl, wf, x, sub, *, tp=1, rank=0, comm=None, share=1.0):
    inputs, out, ops, _ = run_residual(piece, spec, spec, wl, wf, x, sub, poison=SOURCES, tp=tp, rank=rank,
                                       comm=comm, share=share)
    return inputs, out, ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attnres_piece_equals_block_mixing(dtype):
    spec, piece, wl, wf, x, sub = _setup(dtype, seed=3 + (dtype == torch.bfloat16))
    want_in, want = _formula(x, wl, wf, sub)
    got_in, got, ops = _run(spec, piece, wl, wf, x, sub)
    for j, (g_, w_) in enumerate(zip(got_in, want_in)):
        assert rel(g_, w_) <= TOL[dtype], f"sublayer input {j}"
    assert rel(got, want) <= TOL[dtype]
    assert ops.calls["kind/attn.attnres"] == ops.calls["kind/ffn.attnres"] == LAYERS
    assert ops.calls["kind/attn.allreduce"] == ops.calls["kind/ffn.allreduce"] == LAYERS
    assert ops.calls["final.attnres"] == ops.calls["final_norm"] == 1


def test_attnres_piece_tp2_all_reduce_joins_the_shares():
    """Two ranks each add half of every sublayer output: the all-reduce sites give every rank the TP=1 stream."""
    dtype, tp = torch.float32, 2
    spec, piece, wl, wf, x, sub = _setup(dtype, seed=8)
    _, want, _ = _run(spec, piece, wl, wf, x, sub)
    res = ThreadWorld(tp).run(lambda r, comm: _run(spec, piece, wl, wf, x, sub, tp=tp, rank=r, comm=comm,
                                                   share=(1 + 2 * r) / 4)[1])   # 1/4 + 3/4
    assert torch.equal(res[0], res[1]) and rel(res[0], want) <= TOL[dtype]


def test_attnres_piece_sites_in_call_order():
    """Called as the program calls it (per kind: 'attn', attention sites, 'ffn', FFN sites; then 'final'),
    every join lands after its sublayer's sites: a kind's FFN join comes with the next call."""
    spec, piece = _spec(), BlockAttnRes.for_spec(_spec())

    def fill(b):
        for kind, layers in (("k1", (0, 1)), ("k2", tuple(range(2, LAYERS)))):
            b.prefix, b.layers = kind, layers
            piece.sites(b, spec, "attn")
            b.add("attn.x", "norm", N=H)       # stand-ins for the sublayers' own sites
            piece.sites(b, spec, "ffn")
            b.add("ffn.x", "norm", N=H)
        b.prefix, b.layers = "", ()
        piece.sites(b, spec, "final")

    sites = [c.site for c in bind(fill, dtype=torch.float32, rows=M).plan.choices]
    assert [s.name for s in sites] == [
        "k1/attn.attnres", "k1/attn.x", "k1/attn.allreduce", "k1/ffn.attnres", "k1/ffn.x", "k1/ffn.allreduce",
        "k2/attn.attnres", "k2/attn.x", "k2/attn.allreduce", "k2/ffn.attnres", "k2/ffn.x", "k2/ffn.allreduce",
        "final.attnres", "final_norm"]
    by = {s.name: s for s in sites}
    assert by["k1/ffn.allreduce"].layers == (0, 1) and by["k2/ffn.allreduce"].layers == tuple(range(2, LAYERS))
    assert by["k1/attn.attnres"].ctx.attr("out_norm") is True and by["final.attnres"].ctx.attr("out_norm") is False
    assert by["k1/attn.attnres"].ctx.dim("R") == 4 and by["final.attnres"].layers == ()
    assert by["k2/ffn.allreduce"].ctx.attr("residual") is True and by["k2/ffn.allreduce"].ctx.attr("norm") is False


def test_attnres_piece_weights():
    spec, piece = _spec(), BlockAttnRes.for_spec(_spec())
    assert [d.name for d in piece.weights(spec, 2, "final")] == ["norm", "query", "out_norm"]
    assert all(d.split is None for d in piece.weights(spec, 2, "layer"))   # replicated on every rank
    with pytest.raises(ValueError, match="not Block AttnRes"):
        BlockAttnRes.for_spec(spec.model_copy(update={"residual": ResidualSpec()}))
