"""GPU tests of the one-kernel AttnRes mix and the 3-kernel fused gated MLP.

Fresh random inputs, NaN-poisoned outputs (checked fully written), comparison with the plain-torch
family references at per-dtype tolerances, CUDA-graph replay == eager. Run on the H200:
``pytest -m gpu tests/ops/test_attnres_mlp_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.ops.mlp import mlp_reference
from latency_specialized.spec import ActivationSpec
from latency_specialized.ops.attnres import attnres_mix_reference

from gpu_helpers import graph_replay as _graph_replay, seeded_generator as _gen

pytestmark = pytest.mark.gpu

DEV = "cuda"
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
       torch.float16: dict(rtol=1e-2, atol=1e-2)}




ATTNRES_CASES = [  # (R rows of the buffer, M used of max_m, N, sources, out_norm, dtype)
    (2, 1, 4, 7168, 2, True, torch.bfloat16),
    (9, 4, 64, 7168, 9, True, torch.bfloat16),
    (9, 64, 64, 7168, 5, False, torch.bfloat16),
    (9, 33, 64, 7168, 1, True, torch.bfloat16),
    (4, 3, 8, 256, 3, True, torch.float32),
    (4, 16, 16, 1024, 4, False, torch.float16),
]


@pytest.mark.parametrize("cluster", [1, 2, 4, 8])
@pytest.mark.parametrize("rows,m,max_m,n,s,out_norm,dtype", ATTNRES_CASES)
def test_attnres_matches_reference(rows, m, max_m, n, s, out_norm, dtype, cluster):
    from latency_specialized.kernels.attnres import AttnResConfig, attnres_cute, fits

    assert fits(n, torch.empty(0, dtype=dtype).element_size(), cluster)  # every case splits evenly
    cfg = AttnResConfig(cluster=cluster)

    g = _gen(f"attnres{rows}{m}{n}{s}{out_norm}{dtype}")
    buf = torch.randn(rows, max_m, n, device=DEV, dtype=torch.float32, generator=g)
    buf = (buf * torch.rand(rows, 1, 1, device=DEV, generator=g) * 4).to(dtype)  # sources of unequal scale
    src = buf[:, :m]                                               # the program's [:, :b] view
    nw = (1 + 0.1 * torch.randn(n, device=DEV, generator=g)).to(dtype)
    q = (torch.randn(n, device=DEV, generator=g) * n ** -0.5).to(dtype)
    ow = (1 + 0.1 * torch.randn(n, device=DEV, generator=g)).to(dtype) if out_norm else None
    ref = attnres_mix_reference(src, s, nw, q, 1e-6, out_norm_weight=ow, out_eps=1e-5)
    out = torch.full((m, n), float("nan"), device=DEV, dtype=dtype)
    attnres_cute(src, s, nw, q, 1e-6, out_norm_weight=ow, out_eps=1e-5, out=out, config=cfg)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    eager = out.clone()
    out.fill_(float("nan"))
    _graph_replay(lambda: attnres_cute(src, s, nw, q, 1e-6, out_norm_weight=ow, out_eps=1e-5, out=out, config=cfg))
    assert torch.equal(out, eager)


def _mlp_inner(m: int, k: int, inter: int, n: int | None = None) -> dict:
    """The gemms the planner gives ``mlp.cutedsl_fused`` for (M, K, I) on sm_90 (what a plan binds)."""
    from latency_specialized.ops.registry import make_context
    from latency_specialized.plugins import get_registry

    reg = get_registry().implementations
    ctx = make_context("mlp", arch="sm_90", dtype="bfloat16", tokens=m, dims={"N": inter, "K": k})
    inner = {role: chosen for role, _, chosen, _ in reg.inner_choices(reg.get("mlp.cutedsl_fused"), ctx)}
    if n is not None and n != k:  # the family allows an output width other than the hidden size (no site has one)
        down = make_context("gemm", arch="sm_90", dtype="bfloat16", tokens=m, dims={"N": n, "K": inter},
                            attrs={"residual": False})
        inner["down"] = reg.select(down, allow_reference=False)[0]
    return inner


MLP_CASES = [  # (M, K, I, N, activation)
    (1, 7168, 768, 7168, ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)),
    # M=2: the Kimi TP8 shared expert's shape at batch 2 (small-M gate/up + activation kernel)
    (2, 7168, 768, 7168, ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)),
    (4, 7168, 768, 7168, ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)),
    (64, 7168, 768, 7168, ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)),
    (8, 1024, 512, 1024, ActivationSpec(kind="swiglu", clamp=10.0)),
    (2, 1024, 256, 2048, ActivationSpec()),
]


@pytest.mark.parametrize("m,k,inter,n,act", MLP_CASES)
def test_fused_mlp_matches_reference(m, k, inter, n, act):
    from latency_specialized.kernels.mlp_fused import mlp_fused

    g = _gen(f"mlp{m}{k}{inter}{n}{act.kind}")
    x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
    wgu = (torch.randn(2 * inter, k, device=DEV, generator=g) * k ** -0.5 * 3).to(torch.bfloat16)
    wd = (torch.randn(n, inter, device=DEV, generator=g) * inter ** -0.5).to(torch.bfloat16)
    ref = mlp_reference(x, wgu, wd, act)
    out = torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    inner = _mlp_inner(m, k, inter, n)
    mlp_fused(x, wgu, wd, act, out=out, inner=inner)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    # bf16 at two roundings (gate/up output, intermediate) whose 1-ulp flips the down GEMM sums up
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    eager = out.clone()
    out.fill_(float("nan"))
    _graph_replay(lambda: mlp_fused(x, wgu, wd, act, out=out, inner=inner))
    assert torch.equal(out, eager)


GLU_CASES = [  # (M, K, I, activation, config kwargs)
    (1, 7168, 256, ActivationSpec(kind="situ_glu", beta=4, beta_lin=25), {}),
    (2, 7168, 256, ActivationSpec(kind="situ_glu", beta=4, beta_lin=25), {"lookahead": 1}),
    (4, 448, 40, ActivationSpec(kind="swiglu", clamp=10.0), {"rows_per_warp": 2}),
    (3, 1032, 200, ActivationSpec(), {"batch": 4, "lookahead": 2}),
]


@pytest.mark.parametrize("m,k,inter,act,cfg", GLU_CASES)
def test_glu_gemv_equals_gemv_then_activation_kernel(m, k, inter, act, cfg):
    """gate/up + activation in the GEMV epilogue: bit-identical to the GEMV followed by the activation
    kernel (same per-row sum order, same bf16 rounding, same device activation), and graph-safe."""
    from latency_specialized.kernels.gemm_gemv import GemvConfig, gemm_gemv, gemv_glu
    from latency_specialized.kernels.mlp_fused import _act_variant, gated_activation_cute
    from latency_specialized.ops.activation import gated_activation

    g = _gen(f"glu{m}{k}{inter}{act.kind}")
    x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(2 * inter, k, device=DEV, generator=g) * k ** -0.5 * 3).to(torch.bfloat16)
    gu = gemm_gemv(x, w, config=GemvConfig(rows_per_warp=1, **{k_: v for k_, v in cfg.items() if k_ != "rows_per_warp"}))
    unfused = gated_activation_cute(gu, act)
    out = torch.full((m, inter), float("nan"), device=DEV, dtype=torch.bfloat16)
    gemv_glu(x, w, _act_variant(inter, x.dtype, act), out=out, config=GemvConfig(**cfg))
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert torch.equal(out, unfused), (out.float() - unfused.float()).abs().max()
    ref = gated_activation((x.float() @ w[:inter].float().t()).to(torch.bfloat16),
                           (x.float() @ w[inter:].float().t()).to(torch.bfloat16), act).to(torch.bfloat16)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    eager = out.clone()
    out.fill_(float("nan"))
    _graph_replay(lambda: gemv_glu(x, w, _act_variant(inter, x.dtype, act), out=out, config=GemvConfig(**cfg)))
    assert torch.equal(out, eager)


def test_gated_activation_matches_reference():
    from latency_specialized.kernels.mlp_fused import gated_activation_cute
    from latency_specialized.ops.activation import gated_activation

    act = ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)
    g = _gen("act")
    gu = (torch.randn(5, 2 * 768, device=DEV, generator=g) * 6).to(torch.bfloat16)
    ref = gated_activation(gu[:, :768], gu[:, 768:], act).to(torch.bfloat16)
    out = torch.full((5, 768), float("nan"), device=DEV, dtype=torch.bfloat16)
    gated_activation_cute(gu, act, out=out)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("m", [2, 4])
def test_fused_mlp_preferred_glu_matches_reference(m, monkeypatch):
    """``GLU_PREFERRED_MAX_M``: the GEMV + GLU epilogue serves gate/up where the table picks another gemm
    (Kimi TP8 shared expert at M = 2-4: the small-M kernel): same contract, one kernel fewer."""
    from latency_specialized.kernels import mlp_fused as F

    act = ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)
    monkeypatch.setattr(F, "GLU_PREFERRED_MAX_M", 4)
    inner = _mlp_inner(m, 7168, 768)
    assert F.glu_fused(inner["gate_up"].name, "bfloat16", m, 7168)
    g = _gen(f"mlpglu{m}")
    x = torch.randn(m, 7168, device=DEV, generator=g).to(torch.bfloat16)
    wgu = (torch.randn(2 * 768, 7168, device=DEV, generator=g) * 7168 ** -0.5 * 3).to(torch.bfloat16)
    wd = (torch.randn(7168, 768, device=DEV, generator=g) * 768 ** -0.5).to(torch.bfloat16)
    ref = mlp_reference(x, wgu, wd, act)
    out = torch.full((m, 7168), float("nan"), device=DEV, dtype=torch.bfloat16)
    F.mlp_fused(x, wgu, wd, act, out=out, inner=inner)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    eager = out.clone()
    out.fill_(float("nan"))
    _graph_replay(lambda: F.mlp_fused(x, wgu, wd, act, out=out, inner=inner))
    assert torch.equal(out, eager)
