"""Routed MoE piece vs a plain-torch formula (Qwen3 softmax router; sigmoid + bias + scaling + shared expert),
and its TP split: replicated or split router (+ one all-gather), rank partials adding up."""

from __future__ import annotations

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.pieces import RoutedMoE
from latency_specialized.spec import GQAAttentionSpec, LayerSpec, ModelSpec, MoESpec, RouterSpec

from tests.pieces.helpers import make_step, piece_sites, random_full, rank_weights
from tests.pieces.piece_harness import ThreadWorld

H = 32
QWEN = MoESpec(num_experts=8, top_k=2, num_shared_experts=0, expert_intermediate=16,
               router=RouterSpec(score_func="softmax", bias_corrected=False, renormalize=True, fp32=False))
SIGMOID = MoESpec(num_experts=8, top_k=3, num_shared_experts=2, expert_intermediate=16,
                  router=RouterSpec(score_func="sigmoid", bias_corrected=True, renormalize=True, routed_scaling=2.5))
CASES = {"qwen3": RoutedMoE(QWEN, router_split=False), "qwen3-split": RoutedMoE(QWEN),
         "sigmoid-bias-shared": RoutedMoE(SIGMOID)}


def spec_for(f: MoESpec) -> ModelSpec:
    return ModelSpec(name="moe_toy", hidden_size=H, vocab_size=16, max_context=64,
                     layers=(LayerSpec(index=0, attention=GQAAttentionSpec(num_heads=2, num_kv_heads=2, head_dim=8),
                                       ffn=f),))


def expected(piece: RoutedMoE, w: dict, x: torch.Tensor) -> torch.Tensor:
    f = piece.spec
    d = {k: v.double() for k, v in w.items()}
    x = x.double()

    def mlp(gate, up, down, xi):
        return (torch.nn.functional.silu(xi @ gate.T) * (xi @ up.T)) @ down.T

    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for m in range(x.shape[0]):
        logits = d["router"] @ x[m]
        scores = torch.softmax(logits, 0) if f.router.score_func == "softmax" else torch.sigmoid(logits)
        ids = torch.topk(scores + d["router_bias"] if f.router.bias_corrected else scores, f.top_k).indices
        wts = scores[ids] / scores[ids].sum() * f.router.routed_scaling
        for wt, e in zip(wts, ids.tolist()):
            out[m] += wt * mlp(d["experts.w1"][e], d["experts.w3"][e], d["experts.w2"][e], x[m])
        if f.num_shared_experts:
            out[m] += mlp(d["shared.gate_proj"], d["shared.up_proj"], d["shared.down_proj"], x[m])
    return out


def weights(piece, spec, seed):
    g = torch.Generator().manual_seed(seed)
    w = random_full(piece, spec, g)
    w["router"] = w["router"] * 4  # well-separated scores: the top-k is not decided by rounding
    return w, torch.randn(5, H, generator=g)


@pytest.mark.parametrize("case", list(CASES))
def test_moe_piece_matches_the_formula(case):
    piece = CASES[case]
    spec = spec_for(piece.spec)
    w, x = weights(piece, spec, 3)
    step = make_step(piece_sites(piece, spec, 1, 5), spec, 5)
    y = piece.forward(step, rank_weights(piece, spec, w, 0, 1), {}, x)
    torch.testing.assert_close(y.double(), expected(piece, w, x), rtol=1e-5, atol=1e-5)
    assert step.ops.communicated == []  # one rank: no gather


@pytest.mark.parametrize("case", list(CASES))
def test_rank_partials_add_up_with_one_router_gather(case):
    piece, tp = CASES[case], 2
    spec = spec_for(piece.spec)
    w, x = weights(piece, spec, 11)
    world = ThreadWorld(tp)

    def rank(r: int, comm):
        step = make_step(piece_sites(piece, spec, tp, 5), spec, 5, tp=tp, rank=r, comm=comm)
        rw = rank_weights(piece, spec, w, r, tp)
        return piece.forward(step, rw, {}, x), step.ops.communicated, rw["router"].shape[0]

    outs = world.run(rank)
    torch.testing.assert_close(sum(o for o, _, _ in outs).double(), expected(piece, w, x), rtol=1e-5, atol=1e-5)
    split = piece.router_split
    assert all(c == (["k/moe.all_gather"] if split else []) for _, c, _ in outs)
    assert all(rows == (4 if split else 8) for _, _, rows in outs)   # the rank scores its experts only


def test_sites_and_declarations():
    piece = CASES["sigmoid-bias-shared"]
    spec = spec_for(piece.spec)
    sites = {s.name: s for s in piece_sites(piece, spec, 2, 5)}
    assert list(sites) == ["k/moe.router_gemm", "k/moe.router", "k/moe.experts", "k/moe.shared"]
    assert sites["k/moe.router_gemm"].ctx.dim("N") == 4 and sites["k/moe.router_gemm"].ctx.attr("out_dtype") == "float32"
    assert sites["k/moe.experts"].ctx.dim("N") == 8 and sites["k/moe.shared"].ctx.attr("side_stream") is True
    assert sites["k/moe.shared"].ctx.dim("N") == 2 * 8
    decls = {d.name: d for d in piece.weights(spec, 2)}
    assert decls["experts.w1"].shape == (8, 16, H) and decls["experts.w1"].split == 1
    assert decls["experts.w2"].split == 2 and decls["router_bias"].dtype == "float32" and decls["router_bias"].split is None
    qsites = {s.name: s for s in piece_sites(CASES["qwen3"], spec_for(QWEN), 2, 5)}
    assert qsites["k/moe.router_gemm"].ctx.dim("N") == 8 and qsites["k/moe.router_gemm"].ctx.attr("out_dtype") is None
    with pytest.raises(UserError, match="router_split=False"):
        RoutedMoE(MoESpec(num_experts=6, top_k=2, num_shared_experts=0, expert_intermediate=16,
                          router=RouterSpec(score_func="softmax"))).weights(spec, 4)
    with pytest.raises(UserError, match="latent"):
        RoutedMoE(QWEN.model_copy(update={"latent_dim": 16}))
