"""CPU tests of the 4-bit routed experts (MXFP4 / NVFP4 weights kept as stored, ``moe.experts``).

* the reference takes ``QuantizedWeight`` experts and equals the reference over the dequantised weights;
* dispatch: a site with ``weight_format`` goes to the 4-bit implementations (gemv below
  ``MIN_TOKENS_GROUPED`` tokens, grouped from it), never to the bf16 kernels; the reasons name the fix;
* under the Triton interpreter (``tests/interpret.py``): the kernels' decoding of every code under extreme
  scales equals the codec's exactly, and both experts paths (both formats, both activations, per-route, odd
  widths, poisoned outputs) match the reference. The interpreter truncates fp32 -> bf16 instead of rounding,
  so its tolerance is a few bf16 steps looser than the GPU tests' (``tests/ops/test_moe_experts_q4_gpu.py``).
"""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

from latency_specialized.ops.moe import experts_reference
from latency_specialized.ops.registry import make_context
from latency_specialized.quant.checkpoint_io import QuantizedWeight, quantize_weight
from latency_specialized.spec import ActivationSpec

from tests.interpret import run_interpreted

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
interpreted = pytest.mark.interpreter_case

SWIGLU = ActivationSpec(kind="swiglu")
SITU = ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)
INTERP_TOL = 4e-2
"""Interpreter tolerance (max error over max |reference|): truncating bf16 casts at 3 points."""


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _case(seed, M, fmt, *, E=6, k=3, K=64, I=32, N=48, same=False):
    g = _gen(seed)
    x = torch.randn(M, K, generator=g).bfloat16()
    w13 = quantize_weight("experts.w13", torch.randn(E, 2 * I, K, generator=g) * K ** -0.5, fmt)
    w2 = quantize_weight("experts.w2", torch.randn(E, N, I, generator=g) * I ** -0.5, fmt)
    logits = torch.randn(1 if same else M, E, generator=g)
    ids = logits.topk(k, dim=-1).indices.expand(M, k).contiguous().to(torch.int32)
    w = torch.rand(M, k, generator=g) + 0.05
    return x, (w / w.sum(-1, keepdim=True)).contiguous(), ids, w13, w2


def _rel(y, ref):
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


# ------------------------------------------------------------------------------ reference
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_reference_dequantises_quantized_experts_exactly(fmt):
    x, w, ids, w13, w2 = _case(1, 4, fmt)
    got = experts_reference(x, w, ids, w13, w2, SWIGLU)
    plain = experts_reference(x, w, ids, w13.dequantize(), w2.dequantize(), SWIGLU)
    assert torch.equal(got, plain)
    # the dequantised values are exact in bf16 (e2m1 x a power of two / x an e4m3 x fp32 product)
    assert torch.equal(w13.dequantize(torch.bfloat16).float(), w13.dequantize()) or fmt == "nvfp4"
    rows = experts_reference(x, w, ids, w13, w2, SWIGLU, per_route=True)
    assert rows.shape == (4, 3, 48)


# ------------------------------------------------------------------------------ dispatch
def _ctx(tokens, fmt="mxfp4", arch="sm_90a", K=3584, N=384, act="situ_glu"):
    attrs = {"activation": act}
    if fmt:
        attrs["weight_format"] = fmt
    return make_context("moe.experts", arch=arch, dtype="bfloat16", tokens=tokens,
                        dims=dict(E=896, topk=16, N=N, K=K), attrs=attrs)


def test_quantized_sites_go_to_the_4bit_implementations_and_bf16_ones_refuse():
    from latency_specialized.kernels import moe_experts_q4_triton as q4
    from latency_specialized.plugins import get_registry

    impls = get_registry().implementations
    names = [i.name for i in impls.family("moe.experts")]
    assert q4.NAME_GEMV in names and q4.NAME_GROUPED in names
    assert _HAVE_TRITON, "the CPU suite installs triton (vLLM's CPU build pins it): the interpreter cases need it"
    by_name = {i.name: i for i in impls.family("moe.experts")}
    for tokens, want in ((1, q4.NAME_GEMV), (7, q4.NAME_GEMV), (8, q4.NAME_GROUPED), (64, q4.NAME_GROUPED)):
        assert by_name[want].supports(_ctx(tokens)) is True
        other = q4.NAME_GROUPED if want == q4.NAME_GEMV else q4.NAME_GEMV
        assert "tokens" in by_name[other].supports(_ctx(tokens))
        for bf16 in ("moe.experts.cutedsl", "moe.experts.triton_fused"):
            why = by_name[bf16].supports(_ctx(tokens))
            assert why is not True and ("mxfp4" in why or "cutlass" in why.lower() or "CuTe" in why)
    # bf16 sites never go to the 4-bit kernels
    assert "bf16" in by_name[q4.NAME_GEMV].supports(_ctx(1, fmt=None))
    assert "fp8-block-128" in by_name[q4.NAME_GEMV].supports(_ctx(1, fmt="fp8-block-128"))
    # on the CPU the reference serves, and the refusal says so
    chosen, refusals = impls.select(_ctx(1, arch="cpu"))
    assert chosen.name == "moe.experts.reference"
    assert any(n == q4.NAME_GEMV and "CUDA" in why for n, why in refusals)
    assert "multiples of 128" in by_name[q4.NAME_GROUPED].supports(_ctx(16, N=320))
    assert by_name[q4.NAME_GEMV].supports(_ctx(16, N=320)) is True  # widths the grouped path cannot take: gemv
    assert "activation" in by_name[q4.NAME_GEMV].supports(_ctx(1, act="gelu"))


def test_4bit_experts_refuse_bf16_weights_with_the_fix():
    from latency_specialized.errors import UserError
    from latency_specialized.kernels.moe_experts_q4_triton import experts_q4_gemv

    x, w, ids, w13, w2 = _case(2, 1, "mxfp4")
    with pytest.raises(UserError, match="QuantizedWeight"):
        experts_q4_gemv(x, w, ids, w13.dequantize(torch.bfloat16), w2, SWIGLU)
    fp8 = quantize_weight("experts.w13", torch.randn(6, 64, 128), "fp8-block-128")
    with pytest.raises(UserError, match="not a 4-bit"):
        experts_q4_gemv(x, w, ids, fp8, w2, SWIGLU)


# ------------------------------------------------------------------------------ interpreter cases
@interpreted
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_decoding_of_every_code_under_extreme_scales_is_exact(fmt):
    from latency_specialized.kernels import triton_q4 as k
    from latency_specialized.quant.codecs import as_bytes
    from latency_specialized.quant.formats import QuantFormat

    f = QuantFormat.get(fmt)
    group = f.block[1]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 8, 32)
    if fmt == "mxfp4":
        sc = torch.tensor([0, 1, 127, 240, 100, 113, 200, 2], dtype=torch.uint8)
    else:  # e4m3: smallest subnormal, largest subnormal, smallest normal, max (448), 1.0, 2.0, 2^-5, 0.5
        sc = torch.tensor([0x01, 0x07, 0x08, 0x7E, 0x38, 0x40, 0x10, 0x30], dtype=torch.uint8)
    scale = sc.view(1, 8, 1).expand(1, 8, 64 // group).contiguous()
    gs = torch.tensor([0.75]) if fmt == "nvfp4" else None
    w = QuantizedWeight(f, (1, 8, 64), codes, scale if fmt == "mxfp4" else scale.view(torch.float8_e4m3fn), gs)
    out = torch.full((1, 8, 64), float("nan"))
    k.dequantize_q4(as_bytes(w.weight), as_bytes(w.scale), gs if gs is not None else codes, out,
                    scale_kind=k.SCALE_UE8M0 if fmt == "mxfp4" else k.SCALE_E4M3, group=group)
    assert torch.equal(out, w.dequantize())


@interpreted
@pytest.mark.parametrize("fmt,act,M,same", [("mxfp4", SITU, 1, False), ("mxfp4", SWIGLU, 3, True),
                                            ("nvfp4", SWIGLU, 1, False), ("nvfp4", SITU, 3, False)],
                         ids=["mxfp4-situ-1", "mxfp4-swiglu-3same", "nvfp4-swiglu-1", "nvfp4-situ-3"])
def test_gemv_path_matches_the_reference(fmt, act, M, same):
    from latency_specialized.kernels.moe_experts_q4_triton import experts_q4_gemv

    x, w, ids, w13, w2 = _case(10 + M, M, fmt, same=same)
    out = torch.full((M, 48), float("nan"), dtype=torch.bfloat16)
    y = experts_q4_gemv(x, w, ids, w13, w2, act, out=out)
    assert y is out and torch.isfinite(y).all()
    assert _rel(y, experts_reference(x, w, ids, w13, w2, act)) < INTERP_TOL
    rows = torch.full((M, 3, 48), float("nan"), dtype=torch.bfloat16)
    experts_q4_gemv(x, None, ids, w13, w2, act, per_route=True, out=rows)
    assert torch.isfinite(rows).all()
    assert _rel(rows, experts_reference(x, w, ids, w13, w2, act, per_route=True)) < INTERP_TOL


@interpreted
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("M,same,E", [(2, False, 6), (9, True, 6), (17, False, 6), (5, False, 8)])
def test_grouped_path_matches_the_reference(fmt, M, same, E):
    """E = 8 with 15 pairs: a power-of-two expert count with a pair count that is not (the align kernel's
    masked lanes once counted as expert E - 1 there, and the run overflowed its buffers)."""
    from latency_specialized.kernels.moe_experts_q4_triton import experts_q4_grouped

    x, w, ids, w13, w2 = _case(20 + M, M, fmt, E=E, K=256, I=128, N=40, same=same)
    out = torch.full((M, 40), float("nan"), dtype=torch.bfloat16)
    y = experts_q4_grouped(x, w, ids, w13, w2, SITU, out=out)
    assert y is out and torch.isfinite(y).all()
    assert _rel(y, experts_reference(x, w, ids, w13, w2, SITU)) < INTERP_TOL
    rows = torch.full((M, 3, 40), float("nan"), dtype=torch.bfloat16)
    experts_q4_grouped(x, None, ids, w13, w2, SWIGLU, per_route=True, out=rows)
    assert torch.isfinite(rows).all()
    assert _rel(rows, experts_reference(x, w, ids, w13, w2, SWIGLU, per_route=True)) < INTERP_TOL


@interpreted
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_paired_layout_decodes_every_code_like_the_checkpoint_packing(fmt):
    """Every code (all 256 byte values at every byte of a word) in the paired layout (``paired_nibbles``) decodes
    to the codec's values, scales and global scale applied: the layout moves bits, not values."""
    from latency_specialized.kernels import triton_q4 as k
    from latency_specialized.quant.codecs import as_bytes
    from latency_specialized.quant.layout import paired_nibbles

    g = _gen(7)
    w = quantize_weight("experts.w13", torch.randn(2, 12, 64, generator=g), fmt)
    codes = torch.arange(2 * 12 * 32, dtype=torch.int32).remainder(256).to(torch.uint8).view(2, 12, 32)
    codes = codes[..., torch.randperm(32, generator=g)].contiguous()   # each byte value at several word positions
    gs = torch.tensor([0.75, 1.25]) if fmt == "nvfp4" else None   # exact products, as the codec's order rounds
    w = QuantizedWeight(w.fmt, w.shape, codes.view(w.weight.dtype), w.scale, gs)
    p = paired_nibbles(w)
    assert p.fmt.packing == "paired" and not torch.equal(as_bytes(p.weight), codes)
    gs = gs if gs is not None else codes
    for q, paired in ((w, False), (p, True)):
        out = torch.full((2, 12, 64), float("nan"))
        k.dequantize_q4(as_bytes(q.weight), as_bytes(q.scale), gs, out, scale_kind=k.SCALE_UE8M0 if fmt == "mxfp4"
                        else k.SCALE_E4M3, group=q.fmt.block[1], paired=paired)
        assert torch.equal(out, w.dequantize()), paired


@interpreted
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_both_paths_take_the_paired_layout(fmt):
    """The gemv path over paired codes gives the checkpoint packing's bits (the same values summed in the same
    order); the grouped path (its K steps decoded value-major) matches the reference; mixed packings refused."""
    from latency_specialized.errors import UserError
    from latency_specialized.kernels.moe_experts_q4_triton import experts_q4_gemv, experts_q4_grouped
    from latency_specialized.quant.layout import paired_nibbles

    M = 3
    x, w, ids, w13, w2 = _case(40, M, fmt, K=256, I=128, N=40)
    p13, p2 = paired_nibbles(w13), paired_nibbles(w2)
    for fn in (experts_q4_gemv, experts_q4_grouped):
        out = torch.full((M, 40), float("nan"), dtype=torch.bfloat16)
        y = fn(x, w, ids, p13, p2, SITU, out=out)
        assert y is out and torch.isfinite(y).all()
        assert _rel(y, experts_reference(x, w, ids, w13, w2, SITU)) < INTERP_TOL
        if fn is experts_q4_gemv:
            assert torch.equal(y, fn(x, w, ids, w13, w2, SITU))
        rows = torch.full((M, 3, 40), float("nan"), dtype=torch.bfloat16)
        fn(x, None, ids, p13, p2, SWIGLU, per_route=True, out=rows)
        assert _rel(rows, experts_reference(x, w, ids, w13, w2, SWIGLU, per_route=True)) < INTERP_TOL
        with pytest.raises(UserError, match="rearrange both"):
            fn(x, w, ids, p13, w2, SITU)


@interpreted
@pytest.mark.parametrize("E,M,k", [(8, 5, 3), (16, 3, 5), (6, 7, 2)])
def test_align_pads_every_expert_run_and_nothing_else(E, M, k):
    """moe_align over a power-of-two expert count and a pair count that is not one: the padded runs hold
    exactly the pairs of their expert (the masked lanes must not land in a real expert's bin)."""
    from latency_specialized.kernels import triton_moe as moe_k

    g = _gen(E * 100 + M)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(torch.int32)
    sizes = moe_k.AlignSizes(M * k, E, 4)
    buf = moe_k.moe_align(ids, moe_k.AlignBuffers.allocate(sizes, "cpu"))
    padded = int(buf.num_padded)
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    assert padded == int(((counts + 3) // 4 * 4).sum()) <= sizes.max_padded
    sorted_ids = buf.sorted_ids[:padded]
    for b in range(padded // 4):
        rows = sorted_ids[4 * b:4 * b + 4]
        real = rows[rows < M * k].long()
        assert len(real) and (ids.flatten()[real] == buf.expert_ids[b]).all()
    assert sorted(sorted_ids[sorted_ids < M * k].tolist()) == list(range(M * k))


def test_4bit_kernels_compile_for_hopper_without_a_gpu():
    """The Triton kernels build for sm_90 on the CPU (ptxas bundled with Triton): syntax, constexpr use and
    the tensor-core path are checked before any GPU run."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from latency_specialized.kernels import triton_q4 as k

    sig = dict(a_ptr="*bf16", q_ptr="*u8", s_ptr="*u8", gs_ptr="*fp32", out_ptr="*bf16", sorted_ptr="*i32",
               expert_ids_ptr="*i32", num_padded_ptr="*i32", topk_w_ptr="*fp32", N="i32", K="i32", T="i32",
               stride_am="i32", stride_qe="i32", stride_qn="i32", stride_se="i32", stride_sn="i32", stride_om="i32")
    for (scale, group), paired in itertools.product(((k.SCALE_UE8M0, 32), (k.SCALE_E4M3, 16)), (False, True)):
        const = dict(TOPK=16, A_PER_PAIR=False, MUL_W=True, SCALE=scale, GROUP=group, BLOCK_M=16, BLOCK_N=128,
                     BLOCK_K=128, UPCAST=False, PAIRED=paired)
        src = ASTSource(fn=k._moe_gemm_q4_kernel, signature={**sig, "q_ptr": "*i32" if paired else "*u8",
                                                             **{c: "constexpr" for c in const}}, constexprs=const)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=4)).asm["ptx"]
        assert "wgmma" in ptx, (scale, paired)
    sig = dict(x_ptr="*bf16", ids_ptr="*i32", q_ptr="*i32", s_ptr="*u8", gs_ptr="*fp32", h_ptr="*bf16", K="i32",
               I="i32", stride_xm="i32", stride_qe="i32", stride_qn="i32", stride_se="i32", stride_sn="i32",
               stride_hp="i32", beta="fp32", beta_lin="fp32", clamp="fp32")
    for paired in (False, True):
        const = dict(TOPK=16, ACT=k.ACT_SITU, CLAMP=False, SCALE=k.SCALE_UE8M0, GROUP=32, BLOCK_I=4, BLOCK_W=128,
                     PAIRED=paired)
        src = ASTSource(fn=k._gate_up_words_kernel, signature={**sig, **{c: "constexpr" for c in const}},
                        constexprs=const)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
        assert "cvt.f32.f16" in ptx


@pytest.mark.interpreter_driver
def test_kernel_cases_under_the_interpreter():
    run_interpreted(__file__, min_passed=21)
