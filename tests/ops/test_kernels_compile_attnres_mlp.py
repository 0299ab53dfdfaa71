"""CPU CI: the AttnRes and fused-MLP kernels compile for sm_90a without a GPU, and their planners
and argument checks behave. Numerics are checked on the H200 by tests/ops/test_attnres_mlp_gpu.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels.compile_cache import cute_available
from latency_specialized.kernels.gemm_common import ptx_of
from latency_specialized.ops.registry import make_context
from latency_specialized.spec import ActivationSpec

needs_cute = pytest.mark.skipif(cute_available() is not True, reason="nvidia-cutlass-dsl not installed")
SITU = ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)


@pytest.fixture(autouse=True)
def _sm90a(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.delenv("LS_KERNEL_CACHE_DIR", raising=False)  # a fresh compile: we read its PTX


@needs_cute
@pytest.mark.parametrize("sources,out_norm", [(2, True), (9, False)])
def test_attnres_compiles_one_pass(sources, out_norm):
    from latency_specialized.kernels import attnres as A

    ptx = ptx_of(A.compile_attnres(A.AttnResVariant(7168, "bfloat16", sources, out_norm)))
    assert ptx is not None and ".target sm_90a" in ptx
    # 16-byte vectors: every source once (twice beyond 4: the mix pass re-reads them from L1 rather
    # than spill), plus 2-3 weight vectors; one 16-byte store
    reads = sources if sources <= 4 else 2 * sources
    assert len(re.findall(r"ld\.global[\w.:]*\.v4", ptx)) == reads + (3 if out_norm else 2)
    assert len(re.findall(r"st\.global[\w.:]*\.v4", ptx)) == 1
    assert "griddepcontrol.wait" in ptx
    assert ".local" not in ptx  # the sources stay in registers


@needs_cute
@pytest.mark.parametrize("sources,out_norm,cluster", [(9, True, 8), (9, False, 4), (5, True, 2)])
def test_attnres_cluster_compiles(sources, out_norm, cluster):
    """A cluster of CTAs per row: each CTA owns N / cluster columns and exchanges its partial sums
    through DSMEM (mapa + st.shared::cluster) between cluster barriers."""
    from latency_specialized.kernels import attnres as A

    var = A.AttnResVariant(7168, "bfloat16", sources, out_norm, cluster=cluster)
    ptx = ptx_of(A.compile_attnres(var))
    assert ptx is not None and ".target sm_90a" in ptx
    threads = 7168 // 8 // cluster
    # CTAs of <= 256 threads keep every source in registers (no L1 re-read in the mix pass)
    reads = sources if threads <= A.SMALL_CTA_THREADS or sources <= 4 else 2 * sources
    assert len(re.findall(r"ld\.global[\w.:]*\.v4", ptx)) == reads + (3 if out_norm else 2)
    assert len(re.findall(r"st\.global[\w.:]*\.v4", ptx)) == 1
    assert "st.shared::cluster.f32" in ptx and "mapa.shared::cluster" in ptx
    # start handshake + one exchange per reduction (sources; the output norm)
    assert ptx.count("barrier.cluster.wait") == (3 if out_norm else 2)
    assert ".local" not in ptx


def test_attnres_cluster_rule():
    from latency_specialized.kernels import attnres as A

    assert A.fits(7168, 2, 8) and A.fits(7168, 2, 1)
    assert not A.fits(7168, 2, 16)                      # past the portable cluster size
    assert not A.fits(7160, 2, 8)                       # 895 vectors do not split in 8
    assert A.default_config(7160, 1).cluster == 1       # the default never picks a misfit
    src = torch.randn(2, 1, 7160, dtype=torch.bfloat16)
    w = torch.randn(7160, dtype=torch.bfloat16)
    with pytest.raises(UserError, match="AttnResConfig"):
        A.attnres_cute(src, 2, w, w, 1e-6, config=A.AttnResConfig(cluster=8))


@pytest.mark.parametrize("m,config,want", [(1, None, 8), (16, None, 4), (64, None, 2), (1, (2,), 2), (64, (1,), 1)])
def test_attnres_config_reaches_the_compiled_variant(monkeypatch, m, config, want):
    """The default (by batch) or explicit cluster is what gets compiled and launched: a wrapper that
    ignored it would still compute right on the GPU, so check the compile key here."""
    from latency_specialized.kernels import attnres as A

    seen = []
    monkeypatch.setattr(A, "compile_attnres", lambda var: seen.append(var) or (lambda *args: None))
    src = torch.randn(3, m, 7168, dtype=torch.bfloat16)
    w = torch.randn(7168, dtype=torch.bfloat16)
    cfg = A.AttnResConfig(*config) if config else None
    A.attnres_cute(src, 3, w, w, 1e-6, out_norm_weight=w, config=cfg)
    assert [v.cluster for v in seen] == [want]


@needs_cute
@pytest.mark.parametrize("act", [SITU, ActivationSpec(kind="swiglu", clamp=10.0), ActivationSpec()])
def test_gated_activation_compiles(act):
    from latency_specialized.kernels import mlp_fused as F

    ptx = ptx_of(F.compile_act(F._act_variant(768, torch.bfloat16, act)))
    assert ptx is not None and ".target sm_90a" in ptx
    assert len(re.findall(r"ld\.global[\w.:]*\.v4", ptx)) == 2  # gate and up vectors
    assert len(re.findall(r"st\.global[\w.:]*\.v4", ptx)) == 1


def test_attnres_supports_reasons():
    from latency_specialized.kernels.attnres import _supports

    ctx = lambda arch="sm_90", n=7168, r=9: make_context("residual.attnres", arch=arch, dtype="bfloat16",  # noqa: E731
                                                         tokens=4, dims={"N": n, "R": r})
    assert "sm_90" in _supports(ctx(arch="sm_80"))
    assert "sources" in _supports(ctx(r=17))
    assert "N" in _supports(ctx(n=7164 + 1))
    assert _supports(ctx()) == cute_available()


def test_mlp_gemm_choice_never_reference():
    """The fused MLP's two gemms are inner op calls the planner resolves, never the reference."""
    from latency_specialized.plugins import get_registry

    reg = get_registry().implementations
    impl = reg.get("mlp.cutedsl_fused")
    for m in (1, 4, 64):
        ctx = make_context("mlp", arch="sm_90", dtype="bfloat16", tokens=m, dims={"N": 768, "K": 7168})
        got = reg.inner_choices(impl, ctx)
        assert [role for role, *_ in got] == ["gate_up", "down"]
        assert [(c.dim("N"), c.dim("K"), c.tokens) for _, c, _, _ in got] == [(1536, 7168, m), (7168, 768, m)]
        names = [chosen.name for _, _, chosen, _ in got]
        assert all(n.startswith("gemm.") and n != "gemm.reference" for n in names), names


def test_attnres_rejects_bad_layout():
    from latency_specialized.kernels.attnres import attnres_cute

    src = torch.randn(3, 4, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    with pytest.raises(UserError, match="row stride"):
        attnres_cute(src.transpose(1, 2), 2, w[:4], w[:4], 1e-6)  # [R, N, M] view: column-major slabs
    with pytest.raises(UserError, match="num_sources"):
        attnres_cute(src, 4, w, w, 1e-6)


def test_fused_mlp_rejects_unchained_shapes():
    from latency_specialized.kernels.mlp_fused import mlp_fused

    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with pytest.raises(UserError, match="do not chain"):
        mlp_fused(x, torch.randn(64, 64, dtype=torch.bfloat16), torch.randn(64, 48, dtype=torch.bfloat16), SITU)


def test_plan_serves_kimi_attnres_and_shared_expert_on_gpu_kernels(monkeypatch):
    from latency_specialized import hardware
    from latency_specialized.kernels import mlp_one_launch_triton
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime.harness import SpecBoundAdapter

    if cute_available() is not True:
        pytest.skip("nvidia-cutlass-dsl not installed")
    reg = get_registry()
    base = reg.adapter("kimi_k3")
    adapter = SpecBoundAdapter(base, base.bench_spec(base.spec("full"), 8, "kda", 2))

    def plan_for(batch):
        return build_plan(adapter, reg.implementations, hardware.for_arch("sm_90"), tp=8, batch=batch,
                          dtype="bfloat16")

    def shared_impl(plan):
        return next(c.impl.name for c in plan.choices if c.site.name.endswith("moe.shared"))

    # the defaults: the one-launch MLP serves the side stream's shared experts up to its 4 rows (where Triton is
    # here), the fused MLP above
    want_one = mlp_one_launch_triton.ENABLED and mlp_one_launch_triton._supports(
        next(c.site.ctx for c in plan_for(4).choices if c.site.name.endswith("moe.shared"))) is True
    assert shared_impl(plan_for(4)) == ("mlp.triton_one_launch" if want_one else "mlp.cutedsl_fused")
    assert shared_impl(plan_for(8)) == "mlp.cutedsl_fused"
    # the fused MLP's inner gemms, where it serves batch 4 (one-launch switched off)
    monkeypatch.setattr(mlp_one_launch_triton, "ENABLED", False)
    plan = plan_for(4)
    picked = {c.site.name.split("/")[-1]: c.impl.name for c in plan.choices}
    assert picked["attn.attnres"] == picked["ffn.attnres"] == picked["final.attnres"] == "residual.cutedsl_attnres"
    assert picked["moe.shared"] == "mlp.cutedsl_fused"
    # its gemms are the plan's (shown by explain, bound into the callable), not chosen by the kernel
    shared = next(c for c in plan.choices if c.site.name.endswith("moe.shared"))
    inner = {role: c.impl for role, c in shared.inner}
    assert set(inner) == {"gate_up", "down"} and all(not i.is_reference for i in inner.values())
    assert plan.impl(shared.site.name).keywords["inner"] == inner
    assert "inside: gate_up" in plan.to_text() and plan.to_dict()["sites"][plan.choices.index(shared)]["inner"]
