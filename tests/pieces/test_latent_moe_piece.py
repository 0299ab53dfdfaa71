"""Latent MoE piece: its forward on the op references equals the latent MoE written out in torch.

Fresh random weights per case (checkpoint level, from the piece's declarations). The formula: fp32
router logits, sigmoid scores, top-k of score + bias, renormalised weights; latent down-projection;
every selected expert (gate/up, activation, down) weighted in fp32; the latent RMSNorm after the
experts; up-projection plus the shared experts, rounded once. Variants: with / without shared
experts, the optional pre-expert latent norm, no output norm, the fused ``moe.gate_down`` site, and
TP=2 (threads: router and latent split across ranks, one all-gather, the experts' all-reduce): the
ranks' partial sums add up to the whole.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.registry import Implementation, ImplementationRegistry, always
from latency_specialized.pieces.ffn.latent_moe import ROUTER_SIDE_MIN_BATCH, SHARED_FORK_LATE_MAX_BATCH, LatentMoE
from latency_specialized.plugins import get_registry
from latency_specialized.spec import ActivationSpec, KDAAttentionSpec, LayerSpec, ModelSpec, MoESpec, RouterSpec

from tests.pieces.piece_harness import TOL, ThreadWorld, bind, random_weights, rel, shard, step_context

HIDDEN, EPS = 48, 1e-5
SITU = ActivationSpec(kind="situ_glu", beta=4.0, beta_lin=25.0)


def _moe(shared=2, act=SITU) -> MoESpec:
    return MoESpec(num_experts=16, top_k=4, num_shared_experts=shared, expert_intermediate=16, latent_dim=32,
                   activation=act, router=RouterSpec(score_func="sigmoid", bias_corrected=True, renormalize=True))


def _spec(f: MoESpec) -> ModelSpec:
    return ModelSpec(name="piece-test", variant="tiny", hidden_size=HIDDEN, vocab_size=64, max_context=64,
                     layers=(LayerSpec(index=0, attention=KDAAttentionSpec(num_heads=2, head_dim=8), ffn=f),))


def _act(g, u, act: ActivationSpec):
    g, u = g.float(), u.float()
    if act.kind == "situ_glu":
        b, bl = act.beta, act.beta_lin
        return b * torch.tanh(g / b) * torch.sigmoid(g) * bl * torch.tanh(u / bl)
    return torch.nn.functional.silu(g) * u


def _rms(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def _formula(h, w, f: MoESpec, *, input_norm=False, output_norm=True):
    dt = h.dtype
    lin = lambda x, W: (x.float() @ W.float().t()).to(dt)   # noqa: E731 - one rounding per projection
    glu = lambda x, g, u, d: lin(_act(lin(x, g), lin(x, u), f.activation).to(dt), d)   # noqa: E731
    scores = torch.sigmoid(h.float() @ w["router"].float().t())                       # fp32 logits
    ids = torch.topk(scores + w["router_bias"].float(), f.top_k, dim=-1).indices
    wts = scores.gather(-1, ids)
    wts = wts / wts.sum(-1, keepdim=True)
    xl = lin(h, w["latent_down"])
    if input_norm:
        xl = _rms(xl, w["latent_in_norm"])
    y = torch.zeros(h.shape[0], xl.shape[-1])
    for m in range(h.shape[0]):
        for j in range(f.top_k):
            e = int(ids[m, j])
            y[m] += wts[m, j] * glu(xl[m:m + 1], w["experts.w1"][e], w["experts.w3"][e], w["experts.w2"][e])[0].float()
    y = y.to(dt)
    if output_norm:
        y = _rms(y, w["latent_norm"])
    out = y.float() @ w["latent_up"].float().t()
    if f.num_shared_experts:
        out = out + glu(h, w["shared.gate_proj"], w["shared.up_proj"], w["shared.down_proj"]).float()
    return out.to(dt)


def _case(f, dtype, seed, piece_kw=None, B=3):
    g = torch.Generator().manual_seed(seed)
    piece, spec = LatentMoE(f, norm_eps=EPS, **(piece_kw or {})), _spec(f)
    w = random_weights(piece.weights(spec, 1), dtype, g,
                       {"router_bias": lambda s, g: 0.1 * torch.randn(s, generator=g)})
    h = torch.randn(B, HIDDEN, generator=g).to(dtype)
    return piece, spec, w, h


def _run(piece, spec, w_rank, h, *, tp=1, rank=0, comm=None, registry=None):
    ops = bind(lambda b: piece.sites(b, spec.shard(tp) if tp > 1 else spec), dtype=h.dtype, rows=h.shape[0], tp=tp,
               registry=registry)
    scratch = piece.buffers(spec, h.shape[0], h.dtype, h.device)
    step = step_context(ops, spec, rows=h.shape[0], tp=tp, rank=rank, comm=comm, scratch=scratch)
    return piece.forward(step, piece.arrange(w_rank, step.rank_spec), {}, h), ops


VARIANTS = {
    "shared": ({}, {}),
    "no-shared": ({"shared": 0}, {}),
    "swiglu-input-norm": ({"act": ActivationSpec(kind="swiglu")}, {"input_norm": True}),
    "no-output-norm": ({}, {"output_norm": False}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_latent_moe_piece_equals_the_formula(variant, dtype):
    spec_kw, piece_kw = VARIANTS[variant]
    f = _moe(**spec_kw)
    piece, spec, w, h = _case(f, dtype, seed=len(variant) + 7 * (dtype == torch.bfloat16), piece_kw=piece_kw)
    want = _formula(h, w, f, **piece_kw)
    got, ops = _run(piece, spec, w, h)
    assert got.dtype == dtype and rel(got, want) <= TOL[dtype]
    # the unfused path at M=3 on the CPU: router gemm + latent down run, the gate_down reference is skipped
    assert ops.calls["kind/moe.router_gemm"] == ops.calls["kind/moe.latent_down"] == 1
    assert ops.calls["kind/moe.gate_down"] == 0 and "kind/moe.gate_down" in ops.skipped
    assert ops.calls["kind/moe.latent_allreduce"] == ops.calls["kind/moe.experts"] == 1
    assert ops.calls["kind/moe.shared"] == (1 if f.num_shared_experts else 0)
    assert ops.calls["kind/moe.latent_norm"] == (1 if piece_kw.get("input_norm") else 0)


def test_latent_moe_piece_fused_gate_down_site():
    """Where a non-reference implementation serves moe.gate_down it is called with one [W_gate; W_down]
    weight instead of the two gemm sites; the result is the same."""
    base = get_registry().implementations
    ref = base.reference("moe.gate_down").fn
    seen = []

    def fused(x, weight, n_gate, **kw):
        seen.append((weight.shape, n_gate, weight.is_contiguous()))
        return ref(x, weight, n_gate, **kw)

    reg = ImplementationRegistry()
    for impl in base:
        reg.register(impl)
    reg.register(Implementation("moe.gate_down", "moe.gate_down.test_fused", fused, always, priority=1000,
                                provider="test"))
    f = _moe()
    piece, spec, w, h = _case(f, torch.float32, seed=4)
    got, ops = _run(piece, spec, w, h, registry=reg)
    assert rel(got, _formula(h, w, f)) <= TOL[torch.float32]
    assert seen == [((f.num_experts + f.latent_dim, HIDDEN), f.num_experts, True)]
    assert ops.calls["kind/moe.router_gemm"] == ops.calls["kind/moe.latent_down"] == 0


def test_latent_moe_piece_tp2_ranks_sum_to_the_whole():
    """Each rank: its router experts and latent channels (one all-gather), its slice of every expert, the
    experts' all-reduce, its hidden slice of the up-projection: the partial sums add up to the TP=1 output."""
    f, dtype, tp = _moe(), torch.float32, 2
    piece, spec, w, h = _case(f, dtype, seed=9, B=4)
    want = _formula(h, w, f)
    decls = piece.weights(spec, tp)

    def rank_body(r, comm):
        out, ops = _run(piece, spec, {d.name: shard(d, w[d.name], r, tp) for d in decls}, h, tp=tp, rank=r, comm=comm)
        return out, ops.calls

    (o0, c0), (o1, c1) = ThreadWorld(tp).run(rank_body)
    assert rel(o0 + o1, want) <= TOL[dtype]
    assert c0["kind/moe.all_gather"] == c1["kind/moe.all_gather"] == 1   # one gather joins router logits + latent


def test_latent_moe_piece_declarations_and_defaults():
    f = _moe()
    piece, spec = LatentMoE(f), _spec(f)
    assert (piece.shared_fork_late_max_batch, piece.router_side_min_batch) == (SHARED_FORK_LATE_MAX_BATCH,
                                                                               ROUTER_SIDE_MIN_BATCH) == (1, 2)
    d = {x.name: x for x in piece.weights(spec, 2)}
    assert {n: x.split for n, x in d.items()} == {
        "router": 0, "router_bias": None, "latent_down": 0, "latent_norm": None, "latent_up": 0,
        "experts.w1": 1, "experts.w3": 1, "experts.w2": 2, "shared.gate_proj": 0, "shared.up_proj": 0,
        "shared.down_proj": 1}
    assert d["router_bias"].dtype == "float32" and piece.states(spec, 2) == []
    with pytest.raises(UserError, match="latent_dim"):
        LatentMoE(f.model_copy(update={"latent_dim": None}))
    with pytest.raises(UserError, match="TP=3"):
        piece.weights(spec, 3)
