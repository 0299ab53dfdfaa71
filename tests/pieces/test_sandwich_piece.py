"""Sandwich-norm residual piece: sublayer inputs and the final hidden state equal the sandwich written
out in fp64 (the oracle of ``test_gated_residual_piece.py``, with post norms), for Muse Spark's
configuration (vLLM 0.33 ``models/muse_spark/nvidia/model.py``: zero-centred pre norms, weightless
attention post-norm, FFN post-norm scaling by ``1 + w`` *before* normalising, post eps 1e-8, gated
joins, fp32 stream, final norm gain ``w``), a Gemma-style sandwich with plain adds, and a mixed one.
Fresh random weights per case; batch 1 and 3; fp32 and bf16; odd width (H = 28); TP = 2.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.pieces.residual.gated import NormPreservingGate
from latency_specialized.pieces.residual.sandwich import SandwichResidual

from tests.pieces.piece_harness import TOL, ThreadWorld, rel
from tests.pieces.test_gated_residual_piece import (EPS, LAYERS, check, gated_registry, make_case, oracle, run,
                                                    spec_for)


@pytest.fixture
def registry(monkeypatch):
    return gated_registry(monkeypatch)


MUSE = dict(gate=NormPreservingGate(temperature=0.3), zero_centered=True, final_zero_centered=False,
            post_attn="weightless", post_ffn="input_scaled", post_eps=1e-8, stream_dtype="float32")
CASES = {
    "muse-like": ("gated", MUSE),
    "plain-weighted": ("pre_norm", dict(post_attn="weighted", post_ffn="weighted")),
    "mixed": ("gated", dict(gate=NormPreservingGate(), post_attn="input_scaled", post_ffn="none",
                            post_zero_centered=True, post_eps=1e-6)),
}


def _want(x, wl, wf, sub, opts, **override):
    o = {**opts, **override}
    return oracle(x, wl, wf, sub, gate=o.get("gate"), zc=o.get("zero_centered", False),
                  final_zc=o.get("final_zero_centered"),
                  stream_dtype=torch.float32 if o.get("stream_dtype") == "float32" else None,
                  post=(o.get("post_attn", "weighted"), o.get("post_ffn", "weighted")),
                  post_eps=o.get("post_eps", 1e-6), post_zc=o.get("post_zero_centered"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_sandwich_piece_equals_the_formula(case, M, dtype, registry):
    kind, opts = CASES[case]
    spec = spec_for(kind)
    piece = SandwichResidual.for_spec(spec, **opts)
    assert piece.eps == EPS
    wl, wf, x, sub = make_case(piece, spec, dtype, M, seed=3 * len(case) + M + (dtype == torch.bfloat16))
    want_in, want = _want(x, wl, wf, sub, opts)
    got_in, got, ops, _ = run(spec, piece, wl, wf, x, sub, registry)
    check(got_in, got, want_in, want, dtype)
    assert ops.calls["kind/attn.join"] == ops.calls["kind/ffn.join"] == LAYERS


def test_sandwich_options_change_the_result(registry):
    """The test data tells the post-norm kinds, the gate and the final gain apart (else the test above
    could not catch a swapped option)."""
    spec = spec_for("gated")
    piece = SandwichResidual.for_spec(spec, **MUSE)
    wl, wf, x, sub = make_case(piece, spec, torch.float32, 3, seed=9)
    _, want = _want(x, wl, wf, sub, MUSE)
    _, got, _, _ = run(spec, piece, wl, wf, x, sub, registry)
    assert rel(got, want) <= TOL[torch.float32]
    for override in (dict(post_ffn="weighted"), dict(post_attn="none"), dict(final_zero_centered=True),
                     dict(gate=None), dict(post_eps=1e-2)):
        _, other = _want(x, wl, wf, sub, MUSE, **override)
        assert rel(other, want) > 100 * TOL[torch.float32], override


def test_sandwich_piece_tp2_all_reduce_joins_the_shares(registry):
    dtype, tp = torch.float32, 2
    spec = spec_for("gated")
    piece = SandwichResidual.for_spec(spec, **MUSE)
    wl, wf, x, sub = make_case(piece, spec, dtype, 3, seed=6)
    _, want, _, _ = run(spec, piece, wl, wf, x, sub, registry)
    res = ThreadWorld(tp).run(lambda r, comm: run(spec, piece, wl, wf, x, sub, registry, tp=tp, rank=r, comm=comm,
                                                  share=(1 + 2 * r) / 4))
    (_, h0, _, _), (_, h1, _, _) = res
    assert torch.equal(h0, h1) and rel(h0, want) <= TOL[dtype]


def test_sandwich_piece_declarations():
    spec = spec_for("gated")
    muse = SandwichResidual.for_spec(spec, **MUSE)
    names = [d.name for d in muse.weights(spec, 1, "layer")]
    assert names == ["attn.pre_norm", "ffn.pre_norm", "attn.gate", "ffn.gate", "ffn.post_norm"]  # weightless attn
    plain = SandwichResidual(post_attn="weighted", post_ffn="none")
    assert [d.name for d in plain.weights(spec, 1, "layer")] == ["attn.pre_norm", "ffn.pre_norm", "attn.post_norm"]
    b = SiteBuilder("cpu", "bfloat16", 3, 1)
    b.prefix, b.layers = "k", (0, 1, 2)
    muse.sites(b, spec, "ffn")
    by = {s.name: s for s in b.sites}
    assert by["k/attn.join"].ctx.attr("post") == "weightless" and by["k/ffn.join"].ctx.attr("post") == "input_scaled"
    assert by["k/ffn.join"].ctx.attr("stream") == "float32"
    with pytest.raises(UserError, match="post norm"):
        SandwichResidual(post_attn="rms")   # type: ignore[arg-type]
    with pytest.raises(UserError, match="kind 'gated'"):
        SandwichResidual.for_spec(spec)     # a 'gated' spec without a gate
