"""CPU tests of the block-FP8 routed experts (``moe.experts.fp8_triton``, GLM-5.3's experts kept as stored).

* dispatch: a site with ``weight_format`` fp8-block-128 goes to the FP8 experts on sm_90 at every token count, never
  to the bf16 or 4-bit ones; the reasons name the fix; bad weights are UserErrors;
* ``quant.layout``: gate | up parts whose rows end inside a 128-row block join with one scale per row, exactly;
* under the Triton interpreter (``tests/interpret.py``): both activations, per-route rows, partial K / N blocks,
  row-scaled and block-scaled weights, poisoned outputs - against ``ops.moe.experts_reference`` over the same
  ``QuantizedWeight`` experts (the interpreter truncates fp32 -> bf16, so its tolerance is a few bf16 steps looser
  than the GPU tests', ``test_moe_experts_fp8_gpu.py``).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.moe import experts_reference
from latency_specialized.ops.registry import make_context
from latency_specialized.quant import layout
from latency_specialized.quant.checkpoint_io import quantize_weight
from latency_specialized.spec import ActivationSpec

from tests.interpret import run_interpreted

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
interpreted = pytest.mark.interpreter_case

SWIGLU = ActivationSpec(kind="swiglu")
SWIGLU_CLAMP = ActivationSpec(kind="swiglu", clamp=10.0)
SITU = ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)
INTERP_TOL = 4e-2
"""Interpreter tolerance (max error over max |reference|): truncating bf16 casts at 3 points."""


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _experts(seed: int, E: int, I: int, K: int, N: int, *, split_rows: bool = False):
    """(w13 [E, 2I, K], w2 [E, N, I]) fp8-block-128; ``split_rows``: gate and up quantized apart and joined (as a
    checkpoint's separate gate_proj / up_proj are), which gives one scale per row when I is not a multiple of 128."""
    g = _gen(seed)
    w1, w3 = (torch.randn(E, I, K, generator=g) * K ** -0.5 for _ in range(2))
    w2 = quantize_weight("e.w2.weight", torch.randn(E, N, I, generator=g) * I ** -0.5, "fp8-block-128")
    if split_rows:
        w13 = layout.cat([quantize_weight("e.w1.weight", w1, "fp8-block-128"),
                          quantize_weight("e.w3.weight", w3, "fp8-block-128")], 1)
    else:
        w13 = quantize_weight("e.w13.weight", torch.cat([w1, w3], 1), "fp8-block-128")
    return w13, w2


def _routing(seed: int, M: int, E: int, k: int, same: bool = False):
    g = _gen(seed)
    ids = torch.randn(1 if same else M, E, generator=g).topk(k, dim=-1).indices.expand(M, k).contiguous()
    w = torch.rand(M, k, generator=g) + 0.05
    return (w / w.sum(-1, keepdim=True)).contiguous(), ids.to(torch.int32)


def _rel(y, ref):
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


def _ctx(tokens, fmt="fp8-block-128", arch="sm_90a", act="swiglu"):
    attrs = {"activation": act}
    if fmt:
        attrs["weight_format"] = fmt
    return make_context("moe.experts", arch=arch, dtype="bfloat16", tokens=tokens,
                        dims=dict(E=256, topk=8, N=256, K=6144), attrs=attrs)


# ------------------------------------------------------------------------------ layout / dispatch
def test_joined_partial_blocks_get_one_scale_per_row_exactly():
    w13, _ = _experts(1, 3, 16, 200, 32, split_rows=True)
    assert w13.fmt.name == "fp8-block-128/rows" and w13.fmt.block == (1, 128) and w13.scale.shape == (3, 32, 2)
    g = _gen(1)
    w1, w3 = (torch.randn(3, 16, 200, generator=g) * 200 ** -0.5 for _ in range(2))
    parts = [quantize_weight("a.weight", w1, "fp8-block-128"), quantize_weight("b.weight", w3, "fp8-block-128")]
    assert torch.equal(w13.dequantize(), torch.cat([p.dequantize() for p in parts], 1))
    # aligned parts keep their 128-row blocks
    big = layout.cat([quantize_weight("c.weight", torch.randn(256, 64), "fp8-block-128")] * 2, 0)
    assert big.fmt.name == "fp8-block-128" and big.scale.shape == (4, 1)
    whole = quantize_weight("d.weight", torch.randn(16, 64), "fp8-block-128")
    whole = dataclasses.replace(whole, fmt=dataclasses.replace(whole.fmt, partial_blocks=False))
    with pytest.raises(UserError, match="whole 128-row blocks"):  # a format without partial blocks cannot split
        layout.row_scaled(whole)


def test_fp8_sites_go_to_the_fp8_experts_and_others_refuse():
    from latency_specialized.kernels import moe_experts_fp8_triton as f8
    from latency_specialized.plugins import get_registry

    impls = get_registry().implementations
    by_name = {i.name: i for i in impls.family("moe.experts")}
    assert _HAVE_TRITON
    for tokens in (1, 7, 8, 64):
        ok = {n for n, i in by_name.items() if i.supports(_ctx(tokens)) is True and not i.is_reference}
        # and the mma experts' FP8 registration (moe.experts.mma_fp8, below until timed) where the DSL is installed
        assert ok - {"moe.experts.mma_fp8"} == {f8.NAME, f8.NAME_A8}, (tokens, ok)
        assert impls.select(_ctx(tokens))[0].name == f8.NAME  # W8A16 first until the H200 says otherwise
    assert "fp8-block-128" in by_name["moe.experts.q4_gemv_triton"].supports(_ctx(1))
    assert "bf16 expert weights only" in by_name["moe.experts.triton_fused"].supports(_ctx(16))
    assert "reads block-FP8 experts" in by_name[f8.NAME].supports(_ctx(1, fmt=None))
    assert "reads block-FP8 experts" in by_name[f8.NAME].supports(_ctx(1, fmt="mxfp4"))
    assert "activation" in by_name[f8.NAME].supports(_ctx(1, act="gelu"))
    chosen, refusals = impls.select(_ctx(1, arch="cpu"))
    assert chosen.name == "moe.experts.reference" and any(n == f8.NAME and "CUDA" in w for n, w in refusals)


def test_fp8_experts_refuse_bad_weights_with_the_fix():
    from latency_specialized.kernels.moe_experts_fp8_triton import experts_fp8

    w13, w2 = _experts(2, 2, 16, 64, 32)
    x = torch.randn(1, 64).bfloat16()
    w, ids = _routing(2, 1, 2, 1)
    with pytest.raises(UserError, match="bf16 implementations"):
        experts_fp8(x, w, ids, w13.dequantize(torch.bfloat16), w2, SWIGLU)  # type: ignore[arg-type]
    q4 = quantize_weight("e.weight", torch.randn(2, 32, 64), "mxfp4")
    with pytest.raises(UserError, match="fp8-block-128"):
        experts_fp8(x, w, ids, q4, w2, SWIGLU)
    with pytest.raises(UserError, match="do not match"):
        experts_fp8(torch.randn(1, 96).bfloat16(), w, ids, w13, w2, SWIGLU)


# ------------------------------------------------------------------------------ interpreter cases
@interpreted
@pytest.mark.parametrize("act", [SWIGLU, SWIGLU_CLAMP, SITU], ids=["swiglu", "swiglu_clamp", "situ"])
@pytest.mark.parametrize("M,E,k,I,K,N,split,same", [
    (1, 6, 3, 16, 64, 48, True, False),      # tiny GLM-like: partial blocks, row-scaled gate|up
    (5, 6, 2, 128, 200, 72, False, False),   # whole 128-row blocks, partial K block
    (16, 4, 4, 48, 136, 40, True, True),     # every token the same experts: tiles of many pairs
])
def test_fp8_experts_match_the_reference(act, M, E, k, I, K, N, split, same):
    from latency_specialized.kernels.moe_experts_fp8_triton import experts_fp8

    w13, w2 = _experts(10 + M, E, I, K, N, split_rows=split)
    x = torch.randn(M, K, generator=_gen(20 + M)).bfloat16()
    w, ids = _routing(30 + M, M, E, k, same)
    out = torch.full((M, N), float("nan")).bfloat16()
    y = experts_fp8(x, w, ids, w13, w2, act, out=out)
    assert y.data_ptr() == out.data_ptr() and not y.isnan().any()
    assert _rel(y, experts_reference(x, w, ids, w13, w2, act)) < INTERP_TOL
    rows = torch.full((M, k, N), float("nan")).bfloat16()
    experts_fp8(x, None, ids, w13, w2, act, per_route=True, out=rows)
    assert not rows.isnan().any()
    assert _rel(rows, experts_reference(x, w, ids, w13, w2, act, per_route=True)) < INTERP_TOL


@interpreted
@pytest.mark.parametrize("a_per_pair", [False, True])
def test_w8a8_expert_gemm_is_exact_over_its_activation_rounding(a_per_pair):
    """The W8A8 GEMM against the same math in torch: activation rows rounded per (row, 128 of K) as
    ``quantize_activations_reference`` rounds them, times the dequantised weight, fp32 out (no bf16 rounding)."""
    from latency_specialized.kernels import triton_fp8 as k
    from latency_specialized.kernels.moe_experts_triton import align_buffers
    from latency_specialized.kernels.triton_moe import moe_align

    w13, _ = _experts(7, 6, 80, 300, 32)  # [6, 160, 300]: partial K block
    M, top = 5, 2
    _, ids = _routing(8, M, 6, top)
    rows = M * top if a_per_pair else M
    a = torch.randn(rows, 300, generator=_gen(9)).bfloat16()
    a[0, :100] *= 40  # a loud slice: per-(row, block) scales matter
    align = align_buffers(M * top, 6, torch.device("cpu"))
    moe_align(ids, align)
    out = torch.full((M * top, 160), float("nan"))
    k.moe_gemm_fp8(a, w13.weight, w13.scale, align, top, out=out, a_per_pair=a_per_pair, scale_block=(128, 128),
                   a8=True)
    q, sx = k.quantize_activations_reference(a, 128)
    seen = q * sx.repeat_interleave(128, 1)[:, :300]
    deq = w13.dequantize()
    ref = torch.stack([seen[p if a_per_pair else p // top] @ deq[ids.flatten()[p]].t() for p in range(M * top)])
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-5


@interpreted
def test_w8a8_experts_match_the_reference_within_e4m3():
    from latency_specialized.kernels.moe_experts_fp8_triton import experts_fp8_w8a8

    w13, w2 = _experts(11, 6, 128, 200, 72)
    x = torch.randn(4, 200, generator=_gen(12)).bfloat16()
    w, ids = _routing(13, 4, 6, 2)
    out = torch.full((4, 72), float("nan")).bfloat16()
    y = experts_fp8_w8a8(x, w, ids, w13, w2, SWIGLU, out=out)
    assert not y.isnan().any()
    assert _rel(y, experts_reference(x, w, ids, w13, w2, SWIGLU)) < 8e-2


@pytest.mark.skipif(not _HAVE_TRITON, reason="triton not installed")
def test_fp8_experts_kernel_compiles_for_hopper():
    """sm_90 PTX without a GPU (specialized as the JIT would): bf16 wgmma over the converted e4m3 tiles, the tiles
    arriving by pipelined 16-byte cp.async."""
    from latency_specialized.kernels import triton_fp8 as k
    from latency_specialized.kernels.moe_experts_triton import align_buffers

    from tests.triton_offline import ptx_for_hopper, recorded_launches

    w13, _ = _experts(3, 4, 128, 256, 64)
    x = torch.randn(8, 256).bfloat16()
    out = torch.empty(16, 256).bfloat16()
    align = align_buffers(16, 4, torch.device("cpu"))
    with recorded_launches() as launches:
        k.moe_gemm_fp8(x, w13.weight, w13.scale, align, 2, out=out, a_per_pair=False, scale_block=(128, 128))
    (ptx,) = ptx_for_hopper(launches).values()
    assert "wgmma.mma_async" in ptx and ".bf16.bf16" in ptx and "cp.async.cg.shared.global" in ptx
    with recorded_launches() as launches:
        k.moe_gemm_fp8(x, w13.weight, w13.scale, align, 2, out=out, a_per_pair=False, scale_block=(128, 128), a8=True)
    (ptx,) = ptx_for_hopper(launches).values()
    assert ".e4m3.e4m3" in ptx  # W8A8: the codes go to the FP8 wgmma as they are


@pytest.mark.interpreter_driver
def test_kernel_cases_under_the_interpreter():
    run_interpreted(__file__, min_passed=12)
