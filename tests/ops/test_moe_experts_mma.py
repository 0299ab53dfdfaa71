"""CPU tests of the quantized routed experts on the mma.sync kernel (``kernels/moe_experts_mma.py``): the kernels'
sm_90a PTX executed by the emulator (``ptx_emulator.py``) through the public wrapper - route and aligned groups,
SiTU-GLU and SwiGLU (clamped), MXFP4, NVFP4 (e4m3 scales per 16, a global scale per expert) and block FP8 (128 x 128
fp32 scales), int32 / int64 ids, K split over warps (ragged), rows past N, an expert chosen by every token, per-route
rows and the weighted combination (``down_sum``: a warp per route, more routes than warps) - against the
dequantising reference; what the PTX holds; the refusals. GPU: ``test_moe_experts_mma_gpu.py``.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels import moe_experts_mma as mm
from latency_specialized.kernels.compile_cache import cute_available
from latency_specialized.kernels.gemm_small_m import MmaConfig
from latency_specialized.ops.moe import experts_reference
from latency_specialized.quant.checkpoint_io import quantize_weight
from latency_specialized.spec import ActivationSpec

from emulated_kernels import EmulatedExpertsStage, emulate_experts

needs_cute = pytest.mark.skipif(cute_available() is not True, reason="nvidia-cutlass-dsl not installed")

SITU = ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)
SWIGLU = ActivationSpec(kind="swiglu", clamp=3.0)
TOL = 1.0 / 64
"""Max error over max |reference|: the kernel rounds where the reference does; fp32 sums in another order may move a
gate / up value across a bf16 rounding boundary."""


def _case(seed: int, M: int, *, E=6, k=2, K=128, I=128, N=48, same=False, fmt="mxfp4", ids_dtype=torch.int32,
          paired=False):
    from latency_specialized.quant.layout import paired_nibbles

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).bfloat16()
    w13 = quantize_weight("experts.w13", torch.randn(E, 2 * I, K, generator=g) * K ** -0.5, fmt)
    w2 = quantize_weight("experts.w2", torch.randn(E, N, I, generator=g) * I ** -0.5, fmt)
    if paired:  # the codes rearranged for the decode (quant.layout.paired_nibbles): the same values
        w13, w2 = paired_nibbles(w13), paired_nibbles(w2)
    logits = torch.randn(1 if same else M, E, generator=g)
    ids = logits.topk(k, dim=-1).indices.expand(M, k).contiguous().to(ids_dtype)
    w = torch.rand(M, k, generator=g) + 0.05
    return x, (w / w.sum(-1, keepdim=True)).contiguous(), ids, w13, w2


def _rel(y, ref) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


CASES = {  # label: (M, case kwargs, activation, configs or None)
    "b1-situ": (1, {}, SITU, None),
    "b3-swiglu-int64-routes-ragged": (3, dict(k=3, ids_dtype=torch.int64, fmt="mxfp4-deepseek"), SWIGLU,
                                      (MmaConfig(nt=1, mt=2, wk=1, cb=4, pdl=False),
                                       MmaConfig(nt=1, mt=1, wk=2, cb=1, pdl=False))),
    "b2-warps2-ragged": (2, dict(K=384), SITU, (MmaConfig(nt=1, mt=2, wk=2, cb=1, pdl=False),
                                                MmaConfig(nt=1, mt=2, wk=1, cb=1, pdl=False))),
    "b16-aligned-nvfp4": (16, dict(k=3, N=32, fmt="nvfp4"), SITU, None),
    "b1-nvfp4-swiglu": (1, dict(k=3, N=32, fmt="nvfp4"), SWIGLU, None),
    "b2-fp8-swiglu": (2, dict(N=128, fmt="fp8-block-128"), SWIGLU, None),
    "b16-aligned-fp8": (16, dict(k=2, N=128, fmt="fp8-block-128"), SITU, None),
    "b17-aligned-same-pdl": (17, dict(same=True, K=256), SWIGLU, (MmaConfig(nt=1, mt=2, wk=2, cb=2, pdl=True),
                                                              MmaConfig(nt=1, mt=1, wk=1, cb=1, pdl=True))),
    "b3-down-sum-routes-ahead1": (3, dict(k=5, I=256), SITU, (MmaConfig(nt=1, mt=2, wk=1, cb=2, pdl=False),
                                                           MmaConfig(nt=1, mt=1, wk=2, cb=2, lookahead=1, pdl=False))),
    "b2-down-sum-routes-ahead2-pdl": (2, dict(k=6), SWIGLU, (MmaConfig(nt=1, mt=2, wk=1, cb=1, pdl=True),
                                                           MmaConfig(nt=1, mt=1, wk=2, cb=1, lookahead=2, pdl=True))),
    "b1-situ-paired": (1, dict(paired=True, K=256), SITU, None),
    "b16-aligned-nvfp4-paired-swiglu": (16, dict(k=3, N=32, fmt="nvfp4", paired=True), SWIGLU, None),
}


@needs_cute
@pytest.mark.parametrize("label", list(CASES))
def test_mma_experts_match_the_reference_in_the_emulator(monkeypatch, label):
    emulate_experts(monkeypatch)
    M, kw, act, configs = CASES[label]
    x, w, ids, w13, w2 = _case(len(label), M, **kw)
    ref_rows = experts_reference(x, None, ids, w13, w2, act, per_route=True)
    rows = torch.full_like(ref_rows, float("nan"))
    got = mm.experts_mma(x, None, ids, w13, w2, act, per_route=True, out=rows, configs=configs)
    assert got.data_ptr() == rows.data_ptr() and torch.isfinite(rows).all()
    assert _rel(rows, ref_rows) <= TOL, _rel(rows, ref_rows)
    assert (rows != ref_rows).float().mean() <= 0.01  # the reference's roundings: equal but for a rare boundary
    ref = experts_reference(x, w, ids, w13, w2, act)
    y = mm.experts_mma(x, w, ids, w13, w2, act, configs=configs)
    assert _rel(y, ref) <= TOL, _rel(y, ref)
    st, cfg, groups, _ = EmulatedExpertsStage.launches[-1]
    assert st.aligned == (M >= mm.MIN_TOKENS_ALIGNED) and st.coding.paired == kw.get("paired", False)
    # route groups: the combined output from down_sum (a CTA per token and row tile), no route-sum kernel
    assert (st.stage, groups) == (("down", groups) if st.aligned else ("down_sum", M))


@needs_cute
def test_kimi_tp8_stages_compile_to_the_gemm_weight_stream_without_spills(sm90):
    """Kimi K3 TP8 rank shapes (K = N = 3584, I = 384), batch 1's configs: per warp and 128-wide chunk, one 16-byte
    load per weight row (2 per m-tile), 16 bf16x2 multiplies per row and 8 MMAs per m-tile - the MXFP4 gemm's stream;
    gate_up's GLU in registers, down_sum's 8 warps two routes each (all 3 chunks of a route at once), the per-route
    down; no local memory."""
    from latency_specialized.kernels.gemm_common import ptx_of

    K, I, N, k = 3584, 384, 3584, 16
    cfg13, cfg_sum = mm.default_configs(1, k, 896, K, I, N, aligned=False)
    _, cfg_rows = mm.default_configs(1, k, 896, K, I, N, aligned=False, per_route=True)
    assert (cfg13.mt, cfg13.wk, cfg13.cb, cfg_sum.wk, cfg_sum.cb, cfg_rows.wk, cfg_rows.mt) == (2, 4, 2, 8, 3, 1, 2)
    load = re.compile(r"ld\.global(\.nc)?\.L1::no_allocate\.L2::256B\.v4\.b32")  # the first batch: coherent
    stages = ((mm.ExpertsStage("gate_up", K, 2 * I, k, False, act="situ_glu", beta=4, beta_lin=25), cfg13, 7, 1),
              (mm.ExpertsStage("down_sum", I, N, k, False), cfg_sum, 2 * 3, 1),
              (mm.ExpertsStage("down", I, N, k, False), cfg_rows, 3, 4))
    # (stage, config, chunks per warp (down_sum: 2 routes of 3), stores: gate_up's 4 (gate, up) slot pairs over 4
    # reducing warps, down_sum's 4 slots over 8; down's 8 slots (2 m-tiles) of which the odd columns can never be a
    # route's column 0, compiled out)
    for st, cfg, per_warp, stores in stages:
        p = ptx_of(mm.compile_stage(st, cfg))
        assert "ld.local" not in p and "st.local" not in p, st.stage
        assert len(load.findall(p)) == 2 * cfg.mt * per_warp, st.stage
        # the first batch of weight loads ahead of the wait (PDL's, and a fence against ptxas sinking them)
        assert len(load.findall(p[:p.index("griddepcontrol.wait")])) == 2 * cfg.mt * cfg.cb, st.stage
        assert p.count("mul.rn.bf16x2") == 2 * cfg.mt * 16 * per_warp, st.stage
        assert p.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 8 * cfg.mt * per_warp, st.stage
        assert p.count("st.global.b16") == stores, st.stage


def _mx(E, rows, K, fmt="mxfp4"):
    return quantize_weight("w", torch.randn(E, rows, K) * K ** -0.5, fmt)


def test_refusals_name_the_fix():
    x = torch.randn(2, 128).bfloat16()
    ids = torch.zeros(2, 2, dtype=torch.int32)
    w13, w2 = _mx(3, 256, 128), _mx(3, 32, 128)
    with pytest.raises(UserError, match="multiples of 128"):
        mm.experts_mma(x, None, ids, _mx(3, 2 * 64, 128), _mx(3, 32, 64), SITU, per_route=True)
    with pytest.raises(UserError, match="q4_grouped_triton"):
        mm.experts_mma(torch.randn(65, 128).bfloat16(), None, torch.zeros(65, 2, dtype=torch.int32), w13, w2,
                             SITU, per_route=True)
    with pytest.raises(UserError, match="stacked"):
        mm.experts_mma(x, None, ids, w13.dequantize(), w2, SITU, per_route=True)
    with pytest.raises(UserError, match="nvfp4"):
        mm.experts_mma(x, None, ids, _mx(3, 256, 128, "nvfp4"), w2, SITU, per_route=True)  # formats mixed
    with pytest.raises(UserError, match="fp8-block-128"):  # formats mixed
        mm.experts_mma(x, None, ids, _mx(3, 256, 128, "fp8-block-128"), w2, SITU, per_route=True)
    with pytest.raises(UserError, match="scale block"):  # 96 down rows cut a 128-row FP8 scale block
        mm.experts_mma(x, None, ids, _mx(3, 256, 128, "fp8-block-128"), _mx(3, 96, 128, "fp8-block-128"), SITU,
                          per_route=True)
    nan = _mx(3, 256, 128, "nvfp4")
    nan.scale.view(torch.uint8)[1, 2, 3] = 0x7F
    with pytest.raises(UserError, match="NaN"):
        mm.experts_mma(x, None, ids, nan, _mx(3, 32, 128, "nvfp4"), SITU, per_route=True)
    with pytest.raises(UserError, match="nt = 1"):
        mm.experts_mma(x, None, ids, w13, w2, SITU, per_route=True,
                             configs=(MmaConfig(nt=1, mt=1), MmaConfig(nt=1)))
    bad = _mx(3, 256, 128)
    bad.scale.view(torch.uint8)[0, 0, 0] = 1  # 2^-126: below the exact range
    with pytest.raises(UserError, match="requantize"):
        mm.experts_mma(x, None, ids, bad, w2, SITU, per_route=True)


def test_dispatch_puts_the_4bit_registration_first_and_fp8_below_until_timed():
    """``moe.experts.mma`` serves MXFP4 / NVFP4 sites on sm_90 up to 64 tokens above the Triton 4-bit kernels (timed
    on the H200); ``moe.experts.mma_fp8`` serves block-FP8 (128 x 128) sites below ``moe.experts.fp8_triton``. Each
    refuses other formats, archs, widths off 128 and larger steps, saying why."""
    from latency_specialized.contract import make_context
    from latency_specialized.plugins import get_registry

    impls = {i.name: i for i in get_registry().implementations.family("moe.experts")}
    ours, ours_fp8 = impls[mm.NAME], impls[mm.NAME_FP8]
    assert ours.priority > impls["moe.experts.q4_gemv_triton"].priority
    assert ours.priority > impls["moe.experts.q4_grouped_triton"].priority
    assert ours_fp8.priority < impls["moe.experts.fp8_triton"].priority

    def ctx(tokens=1, fmt="mxfp4", arch="sm_90a", K=3584, N=384):
        return make_context("moe.experts", arch=arch, dtype="bfloat16", tokens=tokens,
                            dims=dict(E=896, topk=16, N=N, K=K), attrs={"activation": "situ_glu",
                                                                        "weight_format": fmt})

    if cute_available() is True:
        assert all(ours.supports(ctx(fmt=f)) is True for f in ("mxfp4", "mxfp4-deepseek", "nvfp4"))
        assert ours_fp8.supports(ctx(fmt="fp8-block-128")) is True
    assert "fp8-block-128" in str(ours.supports(ctx(fmt="fp8-block-128")))
    assert "mxfp4" in str(ours_fp8.supports(ctx(fmt="mxfp4")))
    for impl in (ours, ours_fp8):
        fmt = "mxfp4" if impl is ours else "fp8-block-128"
        assert "128" in str(impl.supports(ctx(fmt=fmt, N=64 + 128)))
        assert "64" in str(impl.supports(ctx(fmt=fmt, tokens=65)))
        assert "fp8-block-32" in str(impl.supports(ctx(fmt="fp8-block-32")))
        assert impl.supports(ctx(fmt=fmt, arch="sm_80")) is not True


def test_gate_up_takes_the_measured_launch_at_every_batch():
    """``gate_up``: 4 warps along K and 2 chunks of loads a batch at Kimi K3 TP8 shapes, 1-64 tokens (the H200's
    choice over ``stage_config``); fewer warps where K holds under 2 chunks a warp."""
    for M in (1, 4, 8, 16, 64):
        c13, _ = mm.default_configs(M, 16, 896, 3584, 384, 3584, M >= mm.MIN_TOKENS_ALIGNED)
        assert (c13.wk, c13.cb, c13.mt) == (mm.GATE_UP_WARPS_K, mm.GATE_UP_BATCH, 2), (M, c13.label())
    assert (mm.gate_up_config(4).wk, mm.gate_up_config(4).cb) == (2, 2)
    assert (mm.gate_up_config(1).wk, mm.gate_up_config(1).cb) == (1, 1)


@needs_cute
def test_down_sum_routes_ahead_request_every_route_before_the_math(sm90):
    """``lookahead`` on down_sum (Kimi K3 TP8, batch 1: 8 warps, 2 routes each, 3 chunks a route): all 12 weight
    loads of a warp's two routes are requested before the PDL wait / fence and so before the first MMA, through the
    coherent path; without it, only the first route's 6 (offline SASS: ptxas then issues the second route's late)."""
    from dataclasses import replace

    from latency_specialized.kernels.gemm_common import ptx_of
    from ptx_patterns import loads_before_wait, weight_loads

    _, cfg = mm.default_configs(1, 16, 896, 3584, 384, 3584, aligned=False)
    st = mm.ExpertsStage("down_sum", 384, 3584, 16, False)
    for ahead, before in ((0, 6), (1, 12)):
        p = ptx_of(mm.compile_stage(st, replace(cfg, lookahead=ahead)))
        assert weight_loads(p) == 12 and loads_before_wait(p) == before, ahead
        assert p.index("mma.sync") > p.index("griddepcontrol.wait")


def test_sum_routes_ahead_switch_reaches_down_sum_only(monkeypatch):
    """``SUM_ROUTES_AHEAD`` (what ``bench --ab`` sets) becomes down_sum's lookahead; the aligned down stage and
    gate_up keep theirs."""
    shapes = (16, 896, 3584, 384, 3584)
    assert mm.SUM_ROUTES_AHEAD == 0 and mm.default_configs(1, *shapes, aligned=False)[1].lookahead == 0
    monkeypatch.setattr(mm, "SUM_ROUTES_AHEAD", 1)
    gate_up, down_sum = mm.default_configs(1, *shapes, aligned=False)
    assert down_sum.lookahead == 1 and gate_up.lookahead == 0
    assert mm.default_configs(16, *shapes, aligned=True)[1].lookahead == 0


def test_bench_variants_make_configs_the_wrapper_takes():
    """``ops_bench_q4.MMA_VARIANTS`` at Kimi K3 TP8 shapes: every variant's configs pass the wrapper's checks (nt 1,
    gate_up mt 2, shared memory within the limit) at batch 1, 16 and 64."""
    from latency_specialized.bench import ops_bench_q4 as b
    from latency_specialized.kernels.gemm_small_m import SMEM_LIMIT

    for name, v in b.MMA_VARIANTS.items():
        for M in (1, 16, 64):
            c13, c2, aligned = b.mma_variant_configs(v, M, 16, 896, 3584, 384, 3584)
            assert aligned == v.get("aligned", M >= mm.MIN_TOKENS_ALIGNED)
            assert c13.mt == 2 and c13.nt == c2.nt == 1 and max(c13.smem_bytes(), c2.smem_bytes()) <= SMEM_LIMIT


def test_bench_paired_variant_rearranges_the_weights_once(monkeypatch):
    """The bench's "paired" variant hands the wrapper the paired-nibble forms of the weights (``<fmt>/pairs``),
    rearranged on its first call only; the other variants the weights as given."""
    from latency_specialized.bench import ops_bench_q4 as b

    seen = []
    monkeypatch.setattr(mm, "experts_mma", lambda x, w, ids, w13, w2, act, **kw: seen.append((w13, w2)))
    x, w, ids, w13, w2 = _case(7, 1)
    paired_fn = b._mma_plan("paired", b.MMA_VARIANTS["paired"], 1, 2, 6, 128, 128, 48)[1]
    for _ in range(2):
        paired_fn(x, w, ids, w13, w2, SITU)
    b._mma_plan("default", b.MMA_VARIANTS["default"], 1, 2, 6, 128, 128, 48)[1](x, w, ids, w13, w2, SITU)
    assert [p13.fmt.name for p13, _ in seen] == ["mxfp4/pairs", "mxfp4/pairs", "mxfp4"]
    assert seen[0][0] is seen[1][0] and seen[0][1].fmt.name == "mxfp4/pairs" and seen[2][0] is w13
    assert torch.equal(seen[0][0].dequantize(), w13.dequantize())


def test_ab_switch_hands_the_sites_back_to_the_triton_kernels(monkeypatch):
    """``moe_experts_mma.ENABLED = False`` (what ``bench --ab`` sets) makes the plan pick the Triton 4-bit kernels on
    sm_90, and the refusal names the switch."""
    from latency_specialized.contract import make_context
    from latency_specialized.kernels import moe_experts_q4_triton as q4
    from latency_specialized.plugins import get_registry

    ctx = make_context("moe.experts", arch="sm_90a", dtype="bfloat16", tokens=1, dims=dict(E=896, topk=16, N=384,
                       K=3584), attrs={"activation": "situ_glu", "weight_format": "mxfp4"})
    impls = get_registry().implementations
    if cute_available() is True:
        assert impls.select(ctx)[0].name == mm.NAME
    monkeypatch.setattr(mm, "ENABLED", False)
    chosen, refusals = impls.select(ctx)
    assert any(n == mm.NAME and "ENABLED" in why for n, why in refusals)
    assert chosen.name == q4.NAME_GEMV
