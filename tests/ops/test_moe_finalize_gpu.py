"""GPU tests of per-route routed experts and ``moe.finalize`` at Muse Spark's TP8 rank shapes.

Muse Spark's latent MoE: E 256 experts, top-8, latent width 4096 (the experts' K and N), expert width
4096 / TP8 = 512 per rank, bf16; the per-route post-norm ("input-scaled": gain before the norm,
zero-centred, eps 1e-8) then the fp32 weighted sum over the 8 routes.

Every case: fresh random inputs, outputs poisoned with NaN and checked to be fully written, compared
with the plain-torch reference at bf16 tolerances; CUDA-graph replay must equal eager bit for bit.
Run on the H200: ``pytest -m gpu tests/ops/test_moe_finalize_gpu.py`` (the CuTe DSL cases need
nvidia-cutlass-dsl: CUTEDSL.md, "On the H200 test machine").
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.ops.moe import experts_reference, finalize_reference
from latency_specialized.spec import ActivationSpec

from gpu_helpers import graph_replay as _graph_replay, random_experts, seeded_generator as _gen

pytestmark = pytest.mark.gpu

DEV = "cuda"
E, TOP_K, LATENT, WIDTH = 256, 8, 4096, 512
"""Muse Spark TP8 rank: experts, routes per token, latent width (K and N of the experts), expert width."""
EPS = 1e-8
SWIGLU = ActivationSpec(kind="swiglu")
SITU = ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)
TOKENS = (1, 4, 8, 64)
MUSE = dict(gain_before_norm=True, zero_centered=True)
MODES = {"muse_input_scaled": MUSE, "gain_after": dict(gain_before_norm=False, zero_centered=False),
         "weightless": None}


def _impl(name: str):
    from latency_specialized.plugins import get_registry

    return get_registry().implementations.get(name)


@pytest.fixture(scope="module")
def muse_experts():
    """One rank's expert weights (3.2 GB bf16), shared by the module's cases."""
    g = _gen("muse-tp8-experts")
    return random_experts(E, 2 * WIDTH, LATENT, g), random_experts(E, LATENT, WIDTH, g)


def _routing(M, g, *, same_for_all=False):
    logits = torch.randn(1 if same_for_all else M, E, generator=g, device=DEV)
    ids = logits.topk(TOP_K, dim=-1).indices.expand(M, TOP_K).contiguous()
    w = torch.rand(M, TOP_K, generator=g, device=DEV) + 0.05
    return w / w.sum(-1, keepdim=True), ids


def _routes(M, g, N=LATENT):
    """Per-route rows of very different scales (the norm removes them), gain bf16 near 0 (zero-centred)."""
    scale = torch.exp(torch.randn(M, TOP_K, 1, generator=g, device=DEV))
    y = (torch.randn(M, TOP_K, N, generator=g, device=DEV) * scale).bfloat16()
    w, _ = _routing(M, g)
    gain = (0.2 * torch.randn(N, generator=g, device=DEV)).bfloat16()
    return y, w, gain


def _close(got, want):
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * scale)


# ------------------------------------------------------------------------------------------ finalize
@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
@pytest.mark.parametrize("M", [1, 2, 8, 64])
def test_finalize_triton_matches_reference(M, mode):
    from latency_specialized.kernels.moe_finalize_triton import finalize_triton

    g = _gen(f"finalize-{M}-{mode}")
    y, w, gain = _routes(M, g)
    kw = MODES[mode] or {}
    gn = gain if MODES[mode] is not None else None
    ref = finalize_reference(y, w, gn, EPS, **kw)
    out = torch.full((M, LATENT), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert finalize_triton(y, w, gn, EPS, out=out, **kw) is out
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "finalize left outputs unwritten"
    _close(out, ref)
    assert torch.equal(finalize_triton(y, w, gn, EPS, **kw), out)  # deterministic


@pytest.mark.parametrize("M", [1, 8, 64])
def test_finalize_triton_graph_replay_equals_eager(M):
    from latency_specialized.kernels.moe_finalize_triton import finalize_triton

    g = _gen(f"finalize-graph-{M}")
    y, w, gain = _routes(M, g)
    eager = finalize_triton(y, w, gain, EPS, **MUSE)
    out = torch.full_like(eager, float("nan"))
    graph = _graph_replay(lambda: finalize_triton(y, w, gain, EPS, out=out, **MUSE))
    assert torch.equal(out, eager)
    # new rows and weights written into the static inputs are picked up by the replay
    y2, w2, _ = _routes(M, g)
    y.copy_(y2)
    w.copy_(w2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, finalize_triton(y, w, gain, EPS, **MUSE)) and not torch.equal(out, eager)


def test_finalize_triton_strided_rows_and_out():
    from latency_specialized.kernels.moe_finalize_triton import finalize_triton

    M = 8
    g = _gen("finalize-strided")
    y, w, gain = _routes(M, g)
    big = torch.full((M, TOP_K + 1, LATENT + 64), float("nan"), dtype=torch.bfloat16, device=DEV)
    big[:, 1:, 64:] = y
    wide = torch.full((M, LATENT + 128), float("nan"), dtype=torch.bfloat16, device=DEV)
    out = wide[:, 64:64 + LATENT]
    finalize_triton(big[:, 1:, 64:], w, gain, EPS, out=out, **MUSE)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any() and wide[:, :64].isnan().all() and wide[:, 64 + LATENT:].isnan().all()
    assert torch.equal(out, finalize_triton(y, w, gain, EPS, **MUSE))


# ------------------------------------------------------------------------------- experts, per route
EXPERT_IMPLS = [
    # (implementation, activation): Muse's SwiGLU and Kimi's SiTU-GLU on every implementation
    ("moe.experts.cutedsl", SWIGLU),
    ("moe.experts.cutedsl", SITU),
    ("moe.experts.triton_fused", SITU),
    ("moe.experts.triton_fused", SWIGLU),
]


def test_every_fast_experts_implementation_is_covered():
    from latency_specialized.plugins import get_registry

    from latency_specialized.kernels.moe_experts_fp8_triton import NAME as FP8, NAME_A8 as FP8_A8
    from latency_specialized.kernels.moe_experts_mma import NAME as MMA, NAME_FP8 as MMA_FP8
    from latency_specialized.kernels.moe_experts_q4_triton import NAME_GEMV, NAME_GROUPED

    # the 4-bit and FP8 experts take quantized weights: their per-route mode is tested in
    # test_moe_experts_q4_gpu.py / test_moe_experts_fp8_gpu.py / test_moe_experts_mma_gpu.py
    fast = {i.name for i in get_registry().implementations.family("moe.experts") if not i.is_reference}
    assert fast - {NAME_GEMV, NAME_GROUPED, FP8, FP8_A8, MMA, MMA_FP8} <= {name for name, _ in EXPERT_IMPLS}, fast


@pytest.mark.parametrize("M", TOKENS)
@pytest.mark.parametrize("name,act", EXPERT_IMPLS, ids=[f"{n.rsplit('.', 1)[1]}-{a.kind}" for n, a in EXPERT_IMPLS])
def test_experts_per_route_match_reference(muse_experts, name, act, M):
    w13, w2 = muse_experts
    fn = _impl(name).fn
    g = _gen(f"per-route-{name}-{act.kind}-{M}")
    x = torch.randn(M, LATENT, generator=g, device=DEV).bfloat16()
    w, ids = _routing(M, g)
    ref = experts_reference(x, w, ids, w13, w2, act, per_route=True)
    out = torch.full((M, TOP_K, LATENT), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert fn(x, w, ids, w13, w2, act, per_route=True, out=out) is out
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), f"{name} per_route left rows unwritten"
    _close(out, ref)
    # weights are ignored; the same call is deterministic
    assert torch.equal(fn(x, torch.full_like(w, float("nan")), ids, w13, w2, act, per_route=True), out)
    # weighting and summing the rows gives the implementation's own combined result (bf16 sum order)
    combined = fn(x, w, ids, w13, w2, act)
    _close((out.float() * w.unsqueeze(-1)).sum(1), combined)


@pytest.mark.parametrize("name,act", EXPERT_IMPLS[:1] + EXPERT_IMPLS[2:], ids=["cutedsl", "triton_fused-situ", "triton_fused-swiglu"])
def test_experts_per_route_all_tokens_same_experts_and_strided_out(muse_experts, name, act):
    """Every token routed to the same 8 experts (one leader per expert, 8 members), into a [M, 8, N]
    slice of a wider buffer (row stride N + 64): only the slice is written."""
    w13, w2 = muse_experts
    M = 8
    g = _gen(f"per-route-same-{name}")
    x = torch.randn(M, LATENT, generator=g, device=DEV).bfloat16()
    w, ids = _routing(M, g, same_for_all=True)
    ref = experts_reference(x, w, ids, w13, w2, act, per_route=True)
    wide = torch.full((M, TOP_K, LATENT + 64), float("nan"), dtype=torch.bfloat16, device=DEV)
    out = wide[:, :, 32:32 + LATENT]
    _impl(name).fn(x, w, ids, w13, w2, act, per_route=True, out=out)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any() and wide[:, :, :32].isnan().all() and wide[:, :, 32 + LATENT:].isnan().all()
    _close(out, ref)


@pytest.mark.parametrize("M", [1, 8])
def test_cutedsl_per_route_then_finalize_in_a_graph(muse_experts, M):
    """The Muse chain at TP = 1 (no all-reduce between): per-route experts + finalize captured in one
    graph equal eager bit for bit, and the reference chain at bf16 tolerance; new routing is picked up."""
    from latency_specialized.kernels.moe_experts import experts
    from latency_specialized.kernels.moe_finalize_triton import finalize_triton

    w13, w2 = muse_experts
    g = _gen(f"chain-{M}")
    x = torch.randn(M, LATENT, generator=g, device=DEV).bfloat16()
    w, ids = _routing(M, g)
    gain = (0.2 * torch.randn(LATENT, generator=g, device=DEV)).bfloat16()
    rows = torch.full((M, TOP_K, LATENT), float("nan"), dtype=torch.bfloat16, device=DEV)
    out = torch.full((M, LATENT), float("nan"), dtype=torch.bfloat16, device=DEV)
    ws: dict = {}

    def step():
        experts(x, w, ids, w13, w2, SWIGLU, per_route=True, out=rows, workspace=ws)
        finalize_triton(rows, w, gain, EPS, out=out, **MUSE)

    step()
    torch.cuda.synchronize()
    eager = out.clone()
    ref = finalize_reference(experts_reference(x, w, ids, w13, w2, SWIGLU, per_route=True), w, gain, EPS, **MUSE)
    _close(eager, ref)
    out.fill_(float("nan"))
    graph = _graph_replay(step)
    assert torch.equal(out, eager)
    new_w, new_ids = _routing(M, g)
    w.copy_(new_w)
    ids.copy_(new_ids)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    step()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out) and not torch.equal(replayed, eager)
