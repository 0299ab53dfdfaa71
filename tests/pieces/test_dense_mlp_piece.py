"""Dense MLP piece vs silu(x Wg) * (x Wu) Wd, and its TP split (rank partials add up)."""

from __future__ import annotations

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.pieces import DenseMLP
from latency_specialized.spec import ActivationSpec, DenseMLPSpec, GQAAttentionSpec, LayerSpec, ModelSpec

from tests.pieces.helpers import make_step, piece_sites, random_full, rank_weights

H = 32


def spec_for(f: DenseMLPSpec) -> ModelSpec:
    return ModelSpec(name="mlp_toy", hidden_size=H, vocab_size=16, max_context=64,
                     layers=(LayerSpec(index=0, attention=GQAAttentionSpec(num_heads=2, num_kv_heads=2, head_dim=8),
                                       ffn=f),))


@pytest.mark.parametrize("act", [ActivationSpec(), ActivationSpec(kind="swiglu", clamp=0.5)])
def test_dense_mlp_matches_formula_and_splits_across_ranks(act):
    piece = DenseMLP(DenseMLPSpec(intermediate=48, activation=act))
    spec = spec_for(piece.spec)
    g = torch.Generator().manual_seed(1)
    w = random_full(piece, spec, g)
    x = torch.randn(3, H, generator=g)
    y = piece.forward(make_step(piece_sites(piece, spec, 1, 3), spec, 3), rank_weights(piece, spec, w, 0, 1), {}, x)
    gate, up = (x.double() @ w["gate_proj"].double().T), (x.double() @ w["up_proj"].double().T)
    if act.clamp is not None:
        gate, up = gate.clamp(max=act.clamp), up.clamp(-act.clamp, act.clamp)
    want = (torch.nn.functional.silu(gate) * up) @ w["down_proj"].double().T
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    total = sum(piece.forward(make_step(piece_sites(piece, spec, 2, 3), spec, 3, tp=2, rank=r),
                              rank_weights(piece, spec, w, r, 2), {}, x) for r in range(2))
    torch.testing.assert_close(total.double(), want, rtol=1e-5, atol=1e-5)
    site, = piece_sites(piece, spec, 2, 3)
    assert site.name == "k/mlp" and site.family == "mlp" and site.ctx.dim("N") == 24


def test_dense_mlp_tp_error_names_the_fix():
    piece = DenseMLP(DenseMLPSpec(intermediate=50))
    with pytest.raises(UserError, match="divisible by TP"):
        piece.weights(spec_for(piece.spec), 4)
