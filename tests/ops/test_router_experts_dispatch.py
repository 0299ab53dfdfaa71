"""CPU checks of the decode dispatch changes: fp32 router logits from bf16 weights, the all-reduce
writing the residual in place, and which routed-experts implementation a plan picks per bucket."""

from __future__ import annotations

import torch

from latency_specialized import hardware
from latency_specialized.ops.allreduce import allreduce_residual_rmsnorm_reference
from latency_specialized.ops.gemm import gemm_reference, gemm_torch
from latency_specialized.ops.plan import build_plan
from latency_specialized.ops.registry import OpContext
from latency_specialized.plugins import get_registry


def test_gemm_out_dtype_gives_fp32_logits_without_rounding_to_bf16():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).bfloat16()
    w = torch.randn(10, 64, generator=g).bfloat16()
    exact = x.double() @ w.double().t()
    for fn in (gemm_reference, gemm_torch):
        y = fn(x, w, out_dtype=torch.float32)
        assert y.dtype == torch.float32
        assert (y.double() - exact).abs().max() < 1e-4  # fp32 accuracy
        assert (fn(x, w).double() - exact).abs().max() > 1e-3  # the bf16 result is visibly coarser
    out = torch.full((3, 10), float("nan"))
    assert gemm_reference(x, w, out=out, out_dtype=torch.float32) is out and not out.isnan().any()


def test_allreduce_reference_out_may_alias_the_residual():
    g = torch.Generator().manual_seed(1)
    partial, residual = torch.randn(2, 16, generator=g).bfloat16(), torch.randn(2, 16, generator=g).bfloat16()
    weight = torch.ones(16).bfloat16()
    ref_y, ref_h = allreduce_residual_rmsnorm_reference(partial, residual.clone(), weight, 1e-6)
    y, h = allreduce_residual_rmsnorm_reference(partial, residual, weight, 1e-6, out=(None, residual))
    assert h is residual and torch.equal(residual, ref_h) and torch.equal(y, ref_y)
    none, h2 = allreduce_residual_rmsnorm_reference(partial, ref_h.clone(), None, 1e-6, out=(None, ref_h))
    assert none is None and h2 is ref_h


def _kimi_choices(batch: int, tp: int = 8) -> dict[str, str]:
    reg = get_registry()
    plan = build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.for_arch("sm_90"), tp=tp, batch=batch)
    return {c.site.name: (c.impl.name if c.impl else None) for c in plan.choices}, plan


def test_kimi_router_gemm_site_is_split_and_fp32_out_goes_to_the_measured_winner():
    from latency_specialized.kernels.compile_cache import cute_available

    choices, plan = _kimi_choices(1)
    site = next(c for c in plan.choices if c.site.name == "kda+moe/moe.router_gemm")
    assert site.site.ctx.dim("N") == 896 // 8 and site.site.ctx.attr("out_dtype") == "float32"
    if cute_available() is True:
        from latency_specialized.kernels import gemm_small_m, gemm_splitk

        assert site.impl.name == "gemm.cutedsl_gemv"  # the measured winner at M=1, storing fp32
        for kernel in (gemm_small_m, gemm_splitk):  # they store fp32 too, but lose at M=1
            assert "faster" in kernel._supports(site.site.ctx)
        # batch 4: the split-K kernel is the measured winner and stores the fp32 logits (one kernel;
        # cuBLAS's fp32-output path is a split-K GEMM + a reduction kernel there)
        site4 = next(c for c in _kimi_choices(4)[1].choices if c.site.name == "kda+moe/moe.router_gemm")
        assert site4.impl.name == "gemm.cutedsl_splitk"
    else:
        assert site.impl.name == "gemm.cublas"
    down = next(c for c in plan.choices if c.site.name == "kda+moe/moe.latent_down")
    assert down.site.ctx.dim("N") == 3584 // 8


def test_multi_token_experts_go_to_triton_only_when_it_can_run():
    from latency_specialized.kernels.moe_experts_triton import MIN_TOKENS, _supports

    def ctx(tokens: int, act: str = "situ_glu", arch: str = "sm_90", width: int = 384) -> OpContext:
        return OpContext(family="moe.experts", arch=arch, dtype="bfloat16", tokens=tokens, world_size=1,
                         dims=(("E", 896), ("K", 3584), ("N", width), ("topk", 16)), attrs=(("activation", act),))

    import importlib.util

    have_triton = importlib.util.find_spec("triton") is not None
    r = _supports(ctx(MIN_TOKENS))
    assert (r is True) if have_triton else ("triton" in r)
    if have_triton:
        assert "faster below" in _supports(ctx(MIN_TOKENS - 1))
        assert "faster at every measured batch" in _supports(ctx(64, width=192))  # TP16 Kimi K3
        assert _supports(ctx(64, act="swiglu")) is True    # Muse Spark's SwiGLU experts
        assert "SiTU-GLU or SwiGLU only" in _supports(ctx(64, act="gelu"))
        assert "sm_80+" in _supports(ctx(64, arch="cpu"))


def test_verification_rows_choose_experts_by_rows():
    """Every site of a verification plan knows k (``OpContext.spec_tokens`` / ``requests``), and the routed experts
    still choose on rows: 8 rows of one request on the same 16 experts cost the CuTe DSL kernels ~145 us against
    ~60 for the Triton fused MoE (H200, session 28: they read each expert once but dot it with every row)."""
    import importlib.util

    from latency_specialized.kernels.moe_experts_triton import MIN_TOKENS

    reg = get_registry()
    for k, batch in ((7, 1), (3, 1), (0, 4)):
        plan = build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.for_arch("sm_90"), tp=8, batch=batch,
                          spec_tokens=k)
        site = next(c for c in plan.choices if c.site.name == "kda+moe/moe.experts")
        ctx = site.site.ctx
        assert ctx.spec_tokens == k and ctx.tokens == plan.bucket * (1 + k) and ctx.requests == plan.bucket
        assert all(c.site.ctx.spec_tokens == k for c in plan.choices)
        if importlib.util.find_spec("triton") is not None:
            assert (site.impl.name == "moe.experts.triton_fused") == (ctx.tokens >= MIN_TOKENS), (k, batch)


def test_gate_down_reference_is_the_two_gemm_sites():
    """moe.gate_down: the router logits (fp32) and the latent (activation dtype) of one concatenated
    weight equal the router-gemm and latent-down gemm sites exactly; bad splits name the rows."""
    import pytest
    import torch

    from latency_specialized.ops.gemm import gemm_reference
    from latency_specialized.ops.moe import gate_down_reference

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 64, generator=g).bfloat16()
    w_gate, w_down = torch.randn(8, 64, generator=g).bfloat16(), torch.randn(24, 64, generator=g).bfloat16()
    logits, latent = gate_down_reference(x, torch.cat([w_gate, w_down]), 8)
    assert logits.dtype == torch.float32 and latent.dtype == torch.bfloat16
    assert torch.equal(logits, gemm_reference(x, w_gate, out_dtype=torch.float32))
    assert torch.equal(latent, gemm_reference(x, w_down))
    with pytest.raises(ValueError, match="inside the 32 weight rows"):
        gate_down_reference(x, torch.cat([w_gate, w_down]), 32)


def test_plan_names_the_sites_a_program_does_not_call():
    """Plan.skipped_sites reads the sites' declared relations: at batch 1 on the H200 the fused router +
    latent GEMV replaces the two gemm sites and the q_b GEMV takes the q_a norm; past GATE_DOWN_MAX_M (4)
    the gemm sites run (the fusing site is skipped). explain prints the same."""
    from latency_specialized.kernels.compile_cache import cute_available

    if cute_available() is not True:
        import pytest

        pytest.skip("the CuTe DSL kernels' supports() need nvidia-cutlass-dsl (installed by make test)")
    _, plan1 = _kimi_choices(1)
    s1 = plan1.skipped_sites()
    for kind in ("kda+moe", "mla+moe"):
        assert s1[f"{kind}/moe.router_gemm"].startswith(f"fused into {kind}/moe.gate_down")
        assert f"{kind}/moe.latent_down" in s1 and f"{kind}/moe.gate_down" not in s1
    assert "normalises its input itself" in s1["mla+moe/attn.q_a_norm"]
    assert "not called: fused into" in plan1.to_text()
    _, plan4 = _kimi_choices(4)
    assert "mla+moe/attn.q_a_norm" not in plan4.skipped_sites()  # small-M q_b at batch 4: no norm prologue
    _, plan8 = _kimi_choices(8)
    s8 = plan8.skipped_sites()
    assert "only its reference serves it" in s8["kda+moe/moe.gate_down"]
    assert "kda+moe/moe.router_gemm" not in s8
