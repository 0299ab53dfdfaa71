"""Pre-norm residual vs h = h + f(norm(h)) over two layers; the FFN all-reduce carries the next layer's
input norm (or the final norm); TP sums partials; each all-reduce gets its site's communicator."""

from __future__ import annotations

import torch

from latency_specialized.comm.base import LocalCommunicator
from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.pieces import PreNormResidual
from latency_specialized.spec import DenseMLPSpec, GQAAttentionSpec, LayerSpec, ModelSpec, NormSpec

from tests.pieces.helpers import make_step
from tests.pieces.piece_harness import ThreadComm, ThreadWorld

H, EPS = 32, 1e-5


def spec_for(zero_centered: bool = False) -> ModelSpec:
    layer = lambda i: LayerSpec(index=i, attention=GQAAttentionSpec(num_heads=2, num_kv_heads=2, head_dim=8),  # noqa: E731
                                ffn=DenseMLPSpec(intermediate=16))
    return ModelSpec(name="res_toy", hidden_size=H, vocab_size=16, max_context=64, layers=(layer(0), layer(1)),
                     norm=NormSpec(eps=EPS, zero_centered=zero_centered))


def all_sites(piece, spec, tp=1):
    b = SiteBuilder("cpu", "float32", 3, tp)
    for kind, layers in (("first", (0,)), ("rest", (1,))):
        b.prefix, b.layers = kind, layers
        piece.sites(b, spec, "attn")
        piece.sites(b, spec, "ffn")
    b.prefix, b.layers = "", ()
    piece.sites(b, spec, "final")
    return b.sites


def rms(x, w, zc):
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS)
    return y * ((1 + w) if zc else w)


def run_two_layers(piece, spec, x, w, ys, *, tp=1, rank=0, comm=None, site_comms=None):
    """Drive the residual through two layers with the given sublayer outputs; returns (inputs seen, final)."""
    step = make_step(all_sites(piece, spec, tp), spec, x.shape[0], tp=tp, rank=rank, comm=comm)
    step.scratch = piece.buffers(spec, 8, x.dtype, x.device)
    if site_comms is not None:
        step.site_comm = site_comms.__getitem__
    called = []
    for name, fn in list(step.ops.items()):
        step.ops[name] = (lambda *a, _n=name, _f=fn, **k: called.append((_n, k.get("comm"))) or _f(*a, **k))
    seen = []
    rs = piece.start(step, x)
    for layer, kind in ((0, "first"), (1, "rest")):
        step.prefix, step.layer = kind, layer
        for which in ("attn", "ffn"):
            seen.append(piece.before(step, rs, w[layer], which))
            piece.after(step, rs, w[layer], which, ys[(layer, which)])
    step.prefix, step.layer = "", -1
    return seen, piece.finish(step, rs, w["final"]), called


def make(seed, zc=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, H, generator=g)
    w = {i: {"input_norm": 1 + 0.2 * torch.randn(H, generator=g), "post_norm": 1 + 0.2 * torch.randn(H, generator=g)}
         for i in (0, 1)}
    w["final"] = {"norm": 1 + 0.2 * torch.randn(H, generator=g)}
    ys = {(i, s): torch.randn(3, H, generator=g) for i in (0, 1) for s in ("attn", "ffn")}
    return x, w, ys


def test_prenorm_chain_equals_the_formula_and_calls_the_sites_in_order():
    for zc in (False, True):
        spec, piece = spec_for(zc), PreNormResidual()
        x, w, ys = make(1, zc)
        seen, final, called = run_two_layers(piece, spec, x, w, ys)
        h, want = x.double(), []
        for layer in (0, 1):
            want.append(rms(h, w[layer]["input_norm"].double(), zc))
            h = h + ys[(layer, "attn")].double()
            want.append(rms(h, w[layer]["post_norm"].double(), zc))
            h = h + ys[(layer, "ffn")].double()
        for got, exp in zip(seen, want):
            torch.testing.assert_close(got.double(), exp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final.double(), rms(h, w["final"]["norm"].double(), zc), rtol=1e-5, atol=1e-5)
        assert [n for n, _ in called] == ["first/attn.norm", "first/attn.allreduce", "first/ffn.allreduce",
                                          "rest/attn.allreduce", "rest/ffn.allreduce"]


def test_sites_first_norm_only_for_the_first_layer_and_no_final_site():
    sites = {s.name: s for s in all_sites(PreNormResidual(), spec_for())}
    assert list(sites) == ["first/attn.norm", "first/attn.allreduce", "first/ffn.allreduce", "rest/attn.allreduce",
                           "rest/ffn.allreduce"]
    assert sites["first/attn.norm"].layers == (0,) and sites["first/attn.allreduce"].ctx.attr("norm") is True
    decls = PreNormResidual().weights(spec_for(), 2, "layer")
    assert [(d.name, d.shape, d.split) for d in decls] == [("input_norm", (H,), None), ("post_norm", (H,), None)]
    assert [d.name for d in PreNormResidual().weights(spec_for(), 2, "final")] == ["norm"]


def test_tp_partials_are_summed_and_each_site_gets_its_communicator():
    spec, piece = spec_for(), PreNormResidual()
    x, w, ys = make(5)
    world = ThreadWorld(2)
    g = torch.Generator().manual_seed(9)
    other = {k: torch.randn(3, H, generator=g) for k in ys}          # rank 1's partials

    def rank(r, comm):
        marks = {s.name: comm for s in all_sites(piece, spec, 2)}
        return run_two_layers(piece, spec, x, w, ys if r == 0 else other, tp=2, rank=r, comm=LocalCommunicator(),
                              site_comms=marks)

    (seen0, final0, called0), (seen1, final1, _) = world.run(rank)
    summed = {k: ys[k] + other[k] for k in ys}
    want_seen, want_final, _ = run_two_layers(piece, spec, x, w, summed)
    torch.testing.assert_close(final0, want_final, rtol=1e-5, atol=1e-5)
    assert torch.equal(final0, final1) and all(torch.equal(a, b) for a, b in zip(seen0, seen1))
    # every all-reduce ran on the communicator its site was bound to (not the step's LocalCommunicator)
    assert all(isinstance(c, ThreadComm) for n, c in called0 if n.endswith("allreduce"))
