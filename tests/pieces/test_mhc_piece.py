"""mHC residual piece: every sublayer input and the final hidden state equal mHC written out here.

The oracle follows vLLM 0.33's mHC model (``kernels/mhc/torch.py``: ``mhc_pre_delayed_torch`` /
``mhc_post_torch``; ``models/deepseek_v41/nvidia/model.py``: the decoder layer and the final
collapse): fp64 loops over streams (not the piece's einsums), Sinkhorn as an explicit alternation,
the same roundings to the activation dtype (streams after a post, the collapsed input, the norm).
Fresh random projections / biases / scales / norms per case; the sublayers are random functions of
their input (``tanh(x @ W)``), so a wrong mapping (transposed comb, undelayed pre, a missing post)
changes every later value. Odd sizes (H = 20, 3 or 4 streams), batch 1 and 3, fp32 and bf16, and
TP = 2 (threads: each rank adds a share of every sublayer output; the all-reduce sites sum them).
"""

from __future__ import annotations

import math

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops import registry as op_registry
from latency_specialized.ops import residual_mhc
from latency_specialized.pieces.residual.mhc import STREAMS, MHCResidual
from latency_specialized.plugins import get_registry
from latency_specialized.spec import DenseMLPSpec, KDAAttentionSpec, LayerSpec, ModelSpec, NormSpec, ResidualSpec

from tests.pieces.piece_harness import TOL, ThreadWorld, bind, rel, run_residual, step_context

H, LAYERS, EPS, HC_EPS = 20, 3, 1e-5, 1e-6


@pytest.fixture
def registry(monkeypatch):
    """The plugin registry plus the residual.mhc family (not yet in FAMILIES / OP_MODULES)."""
    monkeypatch.setitem(op_registry.FAMILIES, "residual.mhc", "mHC seam")
    reg = op_registry.ImplementationRegistry()
    for impl in get_registry().implementations:
        reg.register(impl)
    for impl in residual_mhc.IMPLEMENTATIONS:
        reg.register(impl)
    return reg


def _spec(n: int, iters: int) -> ModelSpec:
    layer = lambda i: LayerSpec(index=i, attention=KDAAttentionSpec(num_heads=2, head_dim=8),   # noqa: E731
                                ffn=DenseMLPSpec(intermediate=16))
    return ModelSpec(name="piece-test", variant="tiny", hidden_size=H, vocab_size=64, max_context=64,
                     layers=tuple(layer(i) for i in range(LAYERS)), norm=NormSpec(eps=EPS),
                     residual=ResidualSpec(kind="mhc", streams=n, sinkhorn_iters=iters))


def _weights(n: int, g: torch.Generator, dtype):
    mw = (2 + n) * n

    def one():
        out = {}
        for s in ("attn", "ffn"):
            out[f"{s}.fn"] = torch.randn(mw, n * H, generator=g) / math.sqrt(n * H)
            out[f"{s}.base"] = 0.5 * torch.randn(mw, generator=g)
            out[f"{s}.scale"] = 0.5 + torch.rand(3, generator=g)
            out[f"{s}.norm"] = (1.0 + 0.1 * torch.randn(H, generator=g)).to(dtype)
        return out

    wl = [one() for _ in range(LAYERS)]
    wf = {"norm": (1.0 + 0.1 * torch.randn(H, generator=g)).to(dtype)}
    return wl, wf


# ---------------------------------------------------------------------------------------------- oracle
def _sig(x):
    return 1.0 / (1.0 + torch.exp(-x))


def _oracle_seam(R, fn_w, pre, pending, norm_w, n, iters):
    """(new streams, input x, next pre, post, comb): one seam, fp64 loops, the model's roundings."""
    M, dt = R.shape[0], R.dtype
    if pending is not None:
        y, post, comb = pending
        Rn = torch.empty(M, n, H, dtype=torch.float64)
        for j in range(n):
            acc = post[:, j:j + 1] * y.double()
            for i in range(n):
                acc = acc + comb[:, i, j].unsqueeze(-1) * R[:, i].double()
            Rn[:, j] = acc
        R = Rn.to(dt)
    nxt = None
    if fn_w is not None:
        fn, base, scale = (fn_w[k].double() for k in ("fn", "base", "scale"))
        flat = R.reshape(M, n * H).double()
        mix = (flat @ fn.t()) / torch.sqrt((flat ** 2).mean(-1, keepdim=True) + EPS)
        new_pre = _sig(mix[:, :n] * scale[0] + base[:n]) + HC_EPS
        new_post = 2.0 * _sig(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
        logits = (mix[:, 2 * n:] * scale[2] + base[2 * n:]).reshape(M, n, n)
        P = torch.exp(logits - logits.amax(-1, keepdim=True))
        P = P / P.sum(-1, keepdim=True) + HC_EPS
        for it in range(iters):
            if it:
                P = P / (P.sum(-1, keepdim=True) + HC_EPS)   # rows
            P = P / (P.sum(-2, keepdim=True) + HC_EPS)       # columns
        nxt = (new_pre, new_post, P)
    if pre is None:
        h = R[:, 0]
    else:
        h = sum(pre[:, i:i + 1] * R[:, i].double() for i in range(n)).to(dt)
    hd = h.double()
    x = (hd / torch.sqrt((hd ** 2).mean(-1, keepdim=True) + EPS) * norm_w.double()).to(dt)
    return R, x, nxt


def _formula(x, wl, wf, sub, n, iters):
    R = x.unsqueeze(1).repeat(1, n, 1)
    pre, pending, inputs = None, None, []
    for i in range(LAYERS):
        for which in ("attn", "ffn"):
            w = {k: wl[i][f"{which}.{k}"] for k in ("fn", "base", "scale")}
            R, h, (new_pre, post, comb) = _oracle_seam(R, w, pre, pending, wl[i][f"{which}.norm"], n, iters)
            pre = new_pre
            inputs.append(h)
            pending = (sub(i, which, h), post, comb)
    _, h, _ = _oracle_seam(R, None, pre, pending, wf["norm"], n, iters)
    return inputs, h


# ---------------------------------------------------------------------------------------------- piece run
def _run(spec, piece, wl, wf, x, sub, registry, *, tp=1, rank=0, comm=None, share=1.0):
    inputs, out, ops, _ = run_residual(piece, spec, spec.shard(tp) if tp > 1 else spec, wl, wf, x, sub,
                                       poison=STREAMS, registry=registry, tp=tp, rank=rank, comm=comm, share=share)
    return inputs, out, ops


def _setup(n, iters, dtype, M, seed):
    g = torch.Generator().manual_seed(seed)
    spec = _spec(n, iters)
    piece = MHCResidual.for_spec(spec, hc_eps=HC_EPS)
    assert (piece.streams, piece.sinkhorn_iters, piece.eps, piece.hc_eps) == (n, iters, EPS, HC_EPS)
    wl, wf = _weights(n, g, dtype)
    mats = {(i, s): torch.randn(H, H, generator=g) / H ** 0.5 for i in range(LAYERS) for s in ("attn", "ffn")}
    x = torch.randn(M, H, generator=g).to(dtype)
    sub = lambda i, s, h: torch.tanh(2.0 * h.float() @ mats[(i, s)]).to(dtype)   # noqa: E731
    return spec, piece, wl, wf, x, sub


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("n,iters", [(4, 20), (3, 3)])
def test_mhc_piece_equals_the_formula(n, iters, M, dtype, registry):
    spec, piece, wl, wf, x, sub = _setup(n, iters, dtype, M, seed=11 * n + M + (dtype == torch.bfloat16))
    want_in, want = _formula(x, wl, wf, sub, n, iters)
    got_in, got, ops = _run(spec, piece, wl, wf, x, sub, registry)
    for j, (g_, w_) in enumerate(zip(got_in, want_in)):
        assert g_.dtype == dtype and rel(g_, w_) <= TOL[dtype], f"sublayer input {j}"
    assert got.dtype == dtype and rel(got, want) <= TOL[dtype]
    assert ops.calls["kind/attn.mhc"] == ops.calls["kind/ffn.mhc"] == LAYERS and ops.calls["final.mhc"] == 1
    assert not any("allreduce" in s for s in ops.calls)   # one rank: nothing to sum


def test_mhc_piece_first_input_is_the_normed_embedding(registry):
    """At the first seam every stream holds the embedding and the carried pre-mapping selects stream 0."""
    spec, piece, wl, wf, x, sub = _setup(4, 20, torch.float32, 3, seed=5)
    got_in, _, _ = _run(spec, piece, wl, wf, x, sub, registry)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * wl[0]["attn.norm"]
    assert rel(got_in[0], want) <= TOL[torch.float32]


def test_mhc_seam_mixing_matrix_is_doubly_stochastic():
    """The seam's comb: columns sum to 1 (the last normalisation), rows nearly so, all positive."""
    g = torch.Generator().manual_seed(2)
    n, M = 4, 3
    streams = torch.randn(M, n, H, generator=g)
    wl, _ = _weights(n, g, torch.float32)
    w = wl[0]
    x, pre, post, comb = residual_mhc.mhc_seam_reference(streams, w["attn.fn"], w["attn.scale"], w["attn.base"],
                                                         w["attn.norm"], EPS, rms_eps=EPS, hc_eps=HC_EPS,
                                                         sinkhorn_iters=20)
    assert comb.shape == (M, n, n) and bool((comb > 0).all())
    assert torch.allclose(comb.sum(-2), torch.ones(M, n), atol=1e-5)
    assert torch.allclose(comb.sum(-1), torch.ones(M, n), atol=1e-3)
    assert bool(((post > 0) & (post < 2)).all()) and bool(((pre > HC_EPS) & (pre < 1 + HC_EPS)).all())
    assert torch.equal(x, residual_mhc.rmsnorm_reference(streams[:, 0], w["attn.norm"], EPS))   # no carried pre


def test_mhc_piece_tp2_all_reduce_joins_the_shares(registry):
    """Two ranks each add a share of every sublayer output: both get the TP=1 result, through the sites."""
    dtype, tp = torch.float32, 2
    spec, piece, wl, wf, x, sub = _setup(4, 20, dtype, 3, seed=8)
    _, want, _ = _run(spec, piece, wl, wf, x, sub, registry)
    res = ThreadWorld(tp).run(lambda r, comm: _run(spec, piece, wl, wf, x, sub, registry, tp=tp, rank=r, comm=comm,
                                                   share=(1 + 2 * r) / 4))   # 1/4 + 3/4
    (_, h0, ops0), (_, h1, _) = res
    assert torch.equal(h0, h1) and rel(h0, want) <= TOL[dtype]
    assert ops0.calls["kind/attn.allreduce"] == ops0.calls["kind/ffn.allreduce"] == LAYERS


def test_mhc_piece_sites_and_declarations():
    spec = _spec(4, 20)
    piece = MHCResidual.for_spec(spec)
    for tp, want in ((1, ["k/attn.mhc", "k/ffn.mhc", "final.mhc"]),
                     (2, ["k/attn.mhc", "k/attn.allreduce", "k/ffn.mhc", "k/ffn.allreduce", "final.mhc"])):
        from latency_specialized.ops.sites import SiteBuilder

        b = SiteBuilder("cpu", "bfloat16", 3, tp)
        b.prefix, b.layers = "k", (0, 1, 2)
        rank_spec = spec.shard(tp) if tp > 1 else spec
        piece.sites(b, rank_spec, "attn")
        piece.sites(b, rank_spec, "ffn")
        b.prefix, b.layers = "", ()
        piece.sites(b, rank_spec, "final")
        assert [s.name for s in b.sites] == want
        by = {s.name: s for s in b.sites}
        assert by["k/attn.mhc"].family == "residual.mhc" and by["k/attn.mhc"].ctx.dim("streams") == 4
        assert by["k/attn.mhc"].weight_bytes == 24 * 4 * H * 4 + H * 2
        if tp > 1:
            assert by["k/ffn.allreduce"].ctx.attr("residual") is False
    decls = {d.name: d for d in piece.weights(spec, 2, "layer")}
    assert decls["attn.fn"].shape == (24, 4 * H) and decls["attn.fn"].dtype == "float32"
    assert decls["ffn.base"].shape == (24,) and decls["ffn.scale"].shape == (3,)
    assert all(d.split is None for d in decls.values())
    assert [d.name for d in piece.weights(spec, 1, "final")] == ["norm"]
    with pytest.raises(UserError, match="not mHC"):
        MHCResidual.for_spec(spec.model_copy(update={"residual": ResidualSpec()}))


def test_mhc_piece_refuses_a_seam_without_an_output(registry):
    spec, piece, wl, wf, x, sub = _setup(3, 4, torch.float32, 1, seed=1)
    ops = bind(lambda b: (piece.sites(b, spec, "attn"), piece.sites(b, spec, "ffn")), dtype=x.dtype, rows=1,
               registry=registry)
    step = step_context(ops, spec, rows=1, scratch=piece.buffers(spec, 1, x.dtype, x.device))
    rs = piece.start(step, x)
    piece.before(step, rs, wl[0], "attn")
    with pytest.raises(UserError, match="no sublayer output"):
        piece.before(step, rs, wl[0], "ffn")
