"""Dense projections kept in a stored format (``ModelSpec.linear_format``): which sites carry ``weight_format``, what
the pieces declare (``WeightDecl.stored``), what the program binds (kept weights as stored, the others dequantised),
TP cuts on block boundaries, and the MLP's inner gemms asked for the same format."""

from __future__ import annotations

import pytest
import torch

from latency_specialized import quant
from latency_specialized.contract import make_context
from latency_specialized.errors import UserError
from latency_specialized.kernels.mlp_fused import inner_sites
from latency_specialized.ops.sites import stored_bytes_per_value
from latency_specialized.pieces import DenseMLP
from latency_specialized.plugins import get_registry
from latency_specialized.runtime.composed import _as_declared
from latency_specialized.runtime.pieces_api import WeightDecl, split_plain
from latency_specialized.spec import DenseMLPSpec, LinearFormat

from tests.pieces.helpers import make_step, piece_sites, random_full, rank_weights
from tests.pieces.test_dense_mlp_piece import spec_for

FP8 = LinearFormat(format="fp8-block-128", plain=("indexer.weights_proj",))


def test_a_site_keeps_the_format_only_where_every_part_is_stored_so():
    assert FP8.kept("q_b_proj", "indexer.q_proj") == "fp8-block-128"
    assert FP8.kept("q_a_proj", "kv_a_proj", "indexer.k_proj", "indexer.weights_proj") is None
    spec = spec_for(DenseMLPSpec(intermediate=48))
    assert spec.kept_linear("gate_proj") is None                       # no linear_format: the activation dtype
    kept = spec.with_linear_format(FP8)
    assert kept.kept_linear("gate_proj", "up_proj") == "fp8-block-128"
    assert kept.shard(2).linear_format == FP8 and kept.with_linear_format(None).linear_format is None


def test_fused_projections_split_off_a_plain_tail():
    spec = spec_for(DenseMLPSpec(intermediate=48)).with_linear_format(FP8)
    parts = ("q_a_proj", "kv_a_proj", "indexer.k_proj", "indexer.weights_proj")
    assert split_plain(parts, spec) == (parts[:3], ("indexer.weights_proj",))
    assert split_plain(parts[:3], spec) == (parts[:3], ())                      # nothing plain
    assert split_plain(("indexer.weights_proj",), spec) == (("indexer.weights_proj",), ())   # nothing stored
    mixed = ("q_a_proj", "indexer.weights_proj", "kv_a_proj")                   # plain not at the end: one site
    assert split_plain(mixed, spec) == (mixed, ()) and spec.kept_linear(*mixed) is None
    assert split_plain(parts, spec.with_linear_format(None)) == (parts, ())


@pytest.mark.parametrize("tp", [1, 2])
def test_dense_mlp_takes_fp8_weights_as_stored(tp):
    """I = 256: a rank's down-projection columns (128) stay whole scale blocks at TP=2; the piece's output over the
    stored weights equals the one over their dequantised values, rank partials summed."""
    piece = DenseMLP(DenseMLPSpec(intermediate=256))
    spec = spec_for(piece.spec).with_linear_format(FP8)
    site, = piece_sites(piece, spec, tp, 3)
    assert site.ctx.attr("weight_format") == "fp8-block-128"
    assert site.weight_bytes == int(3 * 32 * 256 // tp * stored_bytes_per_value("fp8-block-128"))
    assert all(d.stored == "fp8-block-128" for d in piece.weights(spec, tp))
    g = torch.Generator().manual_seed(3)
    full = random_full(piece, spec, g)
    stored = {n: quant.quantize_weight(n + ".weight", t, "fp8-block-128") for n, t in full.items()}
    plain = {n: q.dequantize() for n, q in stored.items()}
    x = torch.randn(3, 32, generator=g)

    def run(w):
        return sum(piece.forward(make_step(piece_sites(piece, spec, tp, 3), spec, 3, tp=tp, rank=r),
                                 rank_weights(piece, spec, w, r, tp), {}, x) for r in range(tp))

    bound = rank_weights(piece, spec, stored, 0, tp)
    assert isinstance(bound["gate_up"], quant.QuantizedWeight) and isinstance(bound["down"], quant.QuantizedWeight)
    torch.testing.assert_close(run(stored), run(plain), rtol=1e-6, atol=1e-6)


def test_weights_bind_as_their_piece_declares():
    w = torch.randn(256, 64)
    q = quant.quantize_weight("x.weight", w, "fp8-block-128")
    plain = _as_declared(q, WeightDecl("x", (256, 64)), "layer 0 attn.x")
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, q.dequantize())
    assert _as_declared(q, WeightDecl("x", (256, 64), stored="fp8-block-128"), "x") is q
    mx = quant.quantize_weight("x.weight", w, "mxfp4")
    with pytest.raises(UserError, match="stored as mxfp4, its piece takes fp8-block-128"):
        _as_declared(mx, WeightDecl("x", (256, 64), stored="fp8-block-128"), "layer 0 attn.x")


def test_glm53_full_splits_at_every_tp_its_tiny_model_at_one():
    glm = get_registry().adapter("glm53")
    full = glm.spec("full").with_expert_format("fp8-block-128").with_linear_format(glm.native_linears)
    for tp in glm.scope().tp_sizes:
        assert glm.composed_model(full).stored_split_problems(tp) == [], tp
    tiny = glm.spec("tiny").with_linear_format(glm.native_linears)
    assert glm.composed_model(tiny).stored_split_problems(1) == []
    problems = glm.composed_model(tiny).stored_split_problems(2)
    assert problems and all("scale blocks" in p for p in problems)


def test_the_fused_mlp_asks_its_inner_gemms_for_the_stored_format():
    ctx = make_context("mlp", arch="sm_90", dtype="bfloat16", tokens=4, dims={"N": 2048, "K": 6144},
                       attrs={"activation": "swiglu", "weight_format": "fp8-block-128"})
    inner = dict(inner_sites(ctx))
    assert {c.attr("weight_format") for c in inner.values()} == {"fp8-block-128"}
    reg = get_registry().implementations
    for c in inner.values():  # the bf16 gemms refuse, a block-FP8 gemm serves (as the plan will bind it)
        impl, _ = reg.select(c, allow_reference=False)
        assert impl is not None and impl.name.startswith("gemm.fp8_"), impl
