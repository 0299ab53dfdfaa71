"""Gated norm-preserving residual piece: every sublayer input and the final hidden state equal the
gated residual written out here (the sandwich piece's test reuses this oracle with post norms).

The oracle follows vLLM 0.33's Muse Spark (``models/muse_spark/common/layers.py``:
``MuseSpark1xNormPreservingResidualConnection`` - ``beta = sigmoid(w / T)``, ``alpha =
sqrt(max(1 - beta^2, eps))`` -, ``MuseSpark1xRMSNorm`` / ``...WithInputScale``; the fused boundary of
``common/ops/fused_rmsnorm.py``: post-norm, blend and next pre-norm in fp32, the stream stored in its
dtype): fp64 math, written per step, with the stream's and the inputs' roundings. Fresh random gains
and gate logits per case (some large enough to hit the ``alpha`` floor); the sublayers are random
functions of their input. Odd width (H = 28), batch 1 and 3, fp32 and bf16, an fp32 stream, a scalar
gate, TP = 2 (threads).
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops import registry as op_registry
from latency_specialized.ops import residual_gated
from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.pieces.residual.gated import STREAM, GatedResidual, NormPreservingGate
from latency_specialized.plugins import get_registry
from latency_specialized.spec import DenseMLPSpec, KDAAttentionSpec, LayerSpec, ModelSpec, NormSpec, ResidualSpec

from tests.pieces.piece_harness import TOL, ThreadWorld, random_weights, rel, run_residual

H, LAYERS, EPS = 28, 3, 1e-5


def gated_registry(monkeypatch) -> op_registry.ImplementationRegistry:
    """The plugin registry plus the residual.gated family (not yet in FAMILIES / OP_MODULES)."""
    monkeypatch.setitem(op_registry.FAMILIES, "residual.gated", "gated residual join")
    reg = op_registry.ImplementationRegistry()
    for impl in get_registry().implementations:
        reg.register(impl)
    for impl in residual_gated.IMPLEMENTATIONS:
        reg.register(impl)
    return reg


@pytest.fixture
def registry(monkeypatch):
    return gated_registry(monkeypatch)


def spec_for(kind: str = "gated") -> ModelSpec:
    layer = lambda i: LayerSpec(index=i, attention=KDAAttentionSpec(num_heads=2, head_dim=8),   # noqa: E731
                                ffn=DenseMLPSpec(intermediate=16))
    return ModelSpec(name="piece-test", variant="tiny", hidden_size=H, vocab_size=64, max_context=64,
                     layers=tuple(layer(i) for i in range(LAYERS)), norm=NormSpec(eps=EPS),
                     residual=ResidualSpec(kind=kind))


# ---------------------------------------------------------------------------------------------- oracle
def _rms(x, eps):
    return x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + eps)


def _gain(w, zc):
    return 1.0 + w.double() if zc else w.double()


def oracle(x, wl, wf, sub, *, gate=None, zc=False, final_zc=None, stream_dtype=None, post=("none", "none"),
           post_eps=1e-6, post_zc=None):
    """(every sublayer input, final hidden state) of the residual the options describe (fp64)."""
    act = x.dtype
    sdt = stream_dtype or act
    final_zc = zc if final_zc is None else final_zc
    post_zc = zc if post_zc is None else post_zc
    s = x.to(sdt)

    def pre_norm(w, z):
        return (_rms(s.double(), EPS) * _gain(w, z)).to(act)

    def join(y, kind, pw, g):
        yd = y.double()
        if kind == "weightless":
            b = _rms(yd, post_eps)
        elif kind == "weighted":
            b = _rms(yd, post_eps) * _gain(pw, post_zc)
        elif kind == "input_scaled":
            b = _rms(yd * _gain(pw, post_zc), post_eps)
        else:
            b = yd
        if g is None:
            return (s.double() + b).to(sdt)
        beta = 1.0 / (1.0 + torch.exp(-g.double() / gate.temperature))
        alpha = torch.sqrt(torch.clamp(1.0 - beta ** 2, min=gate.eps))
        return (alpha * s.double() + beta * b).to(sdt)

    inputs = []
    h = pre_norm(wl[0]["attn.pre_norm"], zc)
    for i in range(LAYERS):
        w = wl[i]
        for j, which in enumerate(("attn", "ffn")):
            inputs.append(h)
            y = sub(i, which, h)
            s = join(y, post[j], w.get(f"{which}.post_norm"), w.get(f"{which}.gate") if gate else None)
            if which == "attn":
                h = pre_norm(w["ffn.pre_norm"], zc)
            elif i + 1 < LAYERS:
                h = pre_norm(wl[i + 1]["attn.pre_norm"], zc)
            else:
                h = pre_norm(wf["norm"], final_zc)
    return inputs, h


# ---------------------------------------------------------------------------------------------- piece run
def make_case(piece, spec, dtype, M, seed):
    g = torch.Generator().manual_seed(seed)
    special = {n: (lambda shape, gen: 1.5 * torch.randn(shape, generator=gen)) for n in ("attn.gate", "ffn.gate")}
    wl = [random_weights(piece.weights(spec, 1, "layer"), dtype, g, special) for _ in range(LAYERS)]
    wf = random_weights(piece.weights(spec, 1, "final"), dtype, g)
    mats = {(i, s): torch.randn(H, H, generator=g) / H ** 0.5 for i in range(LAYERS) for s in ("attn", "ffn")}
    x = torch.randn(M, H, generator=g).to(dtype)
    sub = lambda i, s, h: (3.0 * torch.tanh(h.float() @ mats[(i, s)])).to(dtype)   # noqa: E731
    return wl, wf, x, sub


def run(spec, piece, wl, wf, x, sub, registry, *, tp=1, rank=0, comm=None, share=1.0):
    return run_residual(piece, spec, spec.shard(tp) if tp > 1 else spec, wl, wf, x, sub, poison=STREAM,
                        registry=registry, tp=tp, rank=rank, comm=comm, share=share)


def check(got_in, got, want_in, want, dtype):
    for j, (g_, w_) in enumerate(zip(got_in, want_in)):
        assert g_.dtype == dtype and rel(g_, w_) <= TOL[dtype], f"sublayer input {j}: {rel(g_, w_)}"
    assert got.dtype == dtype and rel(got, want) <= TOL[dtype], rel(got, want)


CASES = {
    "per-channel": dict(gate=NormPreservingGate()),
    "per-channel-zc-fp32-stream": dict(gate=NormPreservingGate(temperature=0.5), zero_centered=True,
                                       final_zero_centered=False, stream_dtype="float32"),
    "scalar-gate": dict(gate=NormPreservingGate(channel_wise=False, eps=1e-2)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_gated_piece_equals_the_formula(case, M, dtype, registry):
    spec = spec_for()
    piece = GatedResidual.for_spec(spec, **CASES[case])
    wl, wf, x, sub = make_case(piece, spec, dtype, M, seed=len(case) + M + (dtype == torch.bfloat16))
    opts = CASES[case]
    sdt = torch.float32 if opts.get("stream_dtype") == "float32" else None
    want_in, want = oracle(x, wl, wf, sub, gate=opts["gate"], zc=opts.get("zero_centered", False),
                           final_zc=opts.get("final_zero_centered"), stream_dtype=sdt)
    got_in, got, ops, rs = run(spec, piece, wl, wf, x, sub, registry)
    check(got_in, got, want_in, want, dtype)
    assert rs.stream.dtype == (sdt or dtype)
    assert ops.calls["kind/attn.norm"] == 1          # the first layer's input norm only
    assert ops.calls["kind/attn.join"] == ops.calls["kind/ffn.join"] == LAYERS


def test_gate_coefficients_preserve_the_norm_and_floor_alpha():
    w = torch.tensor([-3.0, -0.4, 0.0, 0.7, 2.5, 6.0])
    alpha, beta = residual_gated.norm_preserving_coefficients(w, 0.3, 1e-3)
    assert torch.allclose(beta, torch.sigmoid(w / 0.3))
    free = alpha ** 2 > 1e-3 + 1e-9
    assert torch.allclose((alpha ** 2 + beta ** 2)[free], torch.ones(int(free.sum())), atol=1e-6)
    assert bool((~free[-2:]).all()) and torch.allclose(alpha[-2:], torch.full((2,), 1e-3 ** 0.5))


def test_gated_piece_tp2_all_reduce_joins_the_shares(registry):
    """The gate acts on the summed output: two ranks' shares, all-reduced first, give the TP=1 stream."""
    dtype, tp = torch.float32, 2
    spec = spec_for()
    piece = GatedResidual.for_spec(spec)
    wl, wf, x, sub = make_case(piece, spec, dtype, 3, seed=4)
    _, want, _, _ = run(spec, piece, wl, wf, x, sub, registry)
    res = ThreadWorld(tp).run(lambda r, comm: run(spec, piece, wl, wf, x, sub, registry, tp=tp, rank=r, comm=comm,
                                                  share=(1 + 2 * r) / 4))
    (_, h0, ops0, _), (_, h1, _, _) = res
    assert torch.equal(h0, h1) and rel(h0, want) <= TOL[dtype]
    assert ops0.calls["kind/attn.allreduce"] == ops0.calls["kind/ffn.allreduce"] == LAYERS


def test_gated_piece_sites_and_declarations():
    spec = spec_for()
    piece = GatedResidual.for_spec(spec)
    for tp, group, want in ((1, (0, 1, 2), ["k/attn.norm", "k/attn.join", "k/ffn.join"]),
                            (1, (1, 2), ["k/attn.join", "k/ffn.join"]),        # a kind without the first layer
                            (2, (0, 1, 2), ["k/attn.norm", "k/attn.allreduce", "k/attn.join", "k/ffn.allreduce",
                                            "k/ffn.join"])):
        b = SiteBuilder("cpu", "bfloat16", 3, tp)
        b.prefix, b.layers = "k", group
        rank_spec = spec.shard(tp) if tp > 1 else spec
        piece.sites(b, rank_spec, "attn")
        piece.sites(b, rank_spec, "ffn")
        b.prefix, b.layers = "", ()
        piece.sites(b, rank_spec, "final")
        assert [s.name for s in b.sites] == want
        by = {s.name: s for s in b.sites}
        assert by["k/ffn.join"].family == "residual.gated" and by["k/ffn.join"].ctx.attr("gate") is True
        if "k/attn.norm" in by:
            assert by["k/attn.norm"].layers == (0,) and by["k/attn.norm"].ctx.attr("join") is False
    decls = {d.name: d for d in piece.weights(spec, 2, "layer")}
    assert set(decls) == {"attn.pre_norm", "ffn.pre_norm", "attn.gate", "ffn.gate"}
    assert decls["attn.gate"].shape == (H,) and decls["attn.gate"].dtype == "float32"
    assert GatedResidual(gate=NormPreservingGate(channel_wise=False)).weights(spec, 1, "layer")[2].shape == (1,)
    with pytest.raises(UserError, match="gated joins go with kind 'gated'"):
        GatedResidual.for_spec(spec_for("pre_norm"))
    with pytest.raises(UserError, match="temperature"):
        NormPreservingGate(temperature=0.0)


def test_gated_join_op_without_output_only_normalises():
    g = torch.Generator().manual_seed(0)
    stream, w = torch.randn(3, H, generator=g), torch.randn(H, generator=g)
    before = stream.clone()
    x, s = residual_gated.gated_join_reference(None, stream, w, EPS, zero_centered=True, out_dtype=torch.bfloat16)
    assert torch.equal(s, before) and x.dtype == torch.bfloat16
    assert rel(x, (_rms(before.double(), EPS) * (1 + w.double())).to(torch.bfloat16)) <= TOL[torch.bfloat16]
    with pytest.raises(UserError, match="post norm"):
        residual_gated.gated_join_reference(stream, stream.clone(), w, EPS, post="bogus")
