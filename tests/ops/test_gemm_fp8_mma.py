"""CPU tests of ``gemm.fp8_w8a16_mma`` (the block-FP8 variant of the CuTe DSL mma.sync kernel): the integer e4m3 ->
bf16 decode it runs, emulated bit for bit over every code; offline sm_90 compiles and what their PTX holds; the
weight checks and the dispatch. The numerics on the GPU: ``test_gemm_fp8_mma_gpu.py``."""

from __future__ import annotations

import struct

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels import gemm_fp8_mma as f8m
from latency_specialized.kernels.compile_cache import cute_available
from latency_specialized.quant.checkpoint_io import QuantizedWeight
from latency_specialized.quant.formats import QuantFormat
from mma_emulation import bf16 as _bf16, prmt as _prmt
from ptx_patterns import loads_before_wait, weight_loads

needs_cute = pytest.mark.skipif(cute_available() is not True, reason="nvidia-cutlass-dsl not installed")


def _decode_word(word: int, mult_bits: int) -> list[float]:
    """``ptx.e4m3x4_to_bf16x2`` step by step (the PTX's instructions on Python ints); bf16 x bf16 of a power of two
    is exact, so a float product stands for ``mul.rn.bf16x2``."""
    out = []
    for sel in (0x1404, 0x3424):
        r = _prmt(word, 0, sel)
        v = (r & 0x80008000) | ((r >> 4) & 0x07F007F0)
        out += [_bf16(v) * _bf16(mult_bits), _bf16(v >> 16) * _bf16(mult_bits)]
    return out


def _decode_word_split(word: int, mult_bits: int) -> list[float]:
    """``ptx.e4m3x4_to_bf16x2_split`` step by step: [byte 0, byte 2, byte 1, byte 3] (the even pair, then the odd)."""
    odd = (word & 0x80008000) | ((word & 0x7F007F00) >> 4)
    even = (((word * 256) & 0xFFFFFFFF) & 0x80008000) | (((word & 0x007F007F) * 16) & 0xFFFFFFFF)
    m = _bf16(mult_bits)
    return [_bf16(even) * m, _bf16(even >> 16) * m, _bf16(odd) * m, _bf16(odd >> 16) * m]


@pytest.mark.parametrize("split", [False, True])
def test_integer_decode_equals_e4m3_for_every_code(split):
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float().tolist()
    for base in range(0, 256, 4):
        word = base | (base + 1) << 8 | (base + 2) << 16 | (base + 3) << 24
        got = _decode_word_split(word, 0x7B80) if split else _decode_word(word, 0x7B80)  # 2^120
        order = (0, 2, 1, 3) if split else (0, 1, 2, 3)
        for i, g in zip(order, got):
            c = base + i
            if c & 0x7F == 0x7F:
                assert abs(g) == 480.0  # NaN codes: finite - the wrapper refuses weights holding them
            else:
                assert g == want[c] and (struct.pack("<f", g)[3] >> 7) == (c >> 7), hex(c)  # signed zeros too


@pytest.mark.parametrize("split", [False, True])
def test_fragment_mapping_of_a_chunk_computes_the_dot_products(split):
    """One warp's 64-wide chunk of a 16-row tile, lane by lane as the kernel builds it (16-byte loads at K = 16t of
    rows g and g + 8, the decode's pairs, the activations' words - permuted with ``split`` - into four m16n8k16
    fragments, PTX's fragment layout), equals W[16, 64] @ x[8, 64]^T."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (16, 64), generator=g, dtype=torch.int64)
    codes[(codes & 0x7F) == 0x7F] = 0x38
    w = codes.to(torch.uint8).view(torch.float8_e4m3fn).double()
    x = torch.randn(8, 64, generator=g, dtype=torch.float64).bfloat16().double()
    got = torch.zeros(16, 8, dtype=torch.float64)
    for i in range(4):  # mma i
        A = torch.zeros(16, 16, dtype=torch.float64)
        B = torch.zeros(16, 8, dtype=torch.float64)
        for lane in range(32):
            gi, t = lane // 4, lane % 4
            for row in (gi, gi + 8):
                b = codes[row, 16 * t + 4 * i:16 * t + 4 * i + 4].tolist()
                word = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
                v = _decode_word_split(word, 0x7B80) if split else _decode_word(word, 0x7B80)
                # registers: pair 0 -> logical K (2t, 2t + 1), pair 1 -> (2t + 8, 2t + 9)
                A[row, 2 * t:2 * t + 2] = torch.tensor(v[:2], dtype=torch.float64)
                A[row, 2 * t + 8:2 * t + 10] = torch.tensor(v[2:], dtype=torch.float64)
            xs = x[gi, 16 * t + 4 * i:16 * t + 4 * i + 4]  # the lane's words 2i, 2i + 1 (token gi)
            xs = xs[[0, 2, 1, 3]] if split else xs        # pair_even_odd
            B[2 * t:2 * t + 2, gi] = xs[:2]
            B[2 * t + 8:2 * t + 10, gi] = xs[2:]
        got += A @ B
    assert torch.allclose(got, w @ x.t(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("e", [f8m.MIN_UE8M0, 117, 127, f8m.MAX_UE8M0])
def test_ue8m0_multiplier_folds_the_block_scale_exactly(e):
    v = (e + 120) << 7
    mult = (v | v << 16) & 0xFFFF
    codes = [0x01, 0x07, 0x08, 0x38, 0x7E, 0x81, 0xFE, 0x00]
    for i in range(0, len(codes), 4):
        word = sum(c << (8 * j) for j, c in enumerate(codes[i:i + 4]))
        got = _decode_word(word, mult)
        want = [float(torch.tensor([c], dtype=torch.uint8).view(torch.float8_e4m3fn).float()) * 2.0 ** (e - 127)
                for c in codes[i:i + 4]]
        assert got == want


def _weight(fmt: str, N: int = 64, K: int = 128, scale_byte: int = 117, code: int = 0x38) -> QuantizedWeight:
    f = QuantFormat.get(fmt)
    q = torch.full((N, K), code, dtype=torch.uint8).view(torch.float8_e4m3fn)
    r, c = f.block
    shape = (-(-N // r), -(-K // c))
    s = (torch.full(shape, scale_byte, dtype=torch.uint8).view(torch.float8_e8m0fnu) if f.scale == "ue8m0"
         else torch.full(shape, 0.5))
    return QuantizedWeight(f, (N, K), q, s, name=f"t{code}.weight")


def test_weight_checks_refuse_nan_codes_and_undecodable_scales():
    q, s, sc = f8m.fp8_parts(_weight("fp8-block-128"), "t")
    assert q.dtype == torch.uint8 and s.dtype == torch.float32 and sc.block == (128, 128) and not sc.ue8m0
    with pytest.raises(UserError, match="NaN codes"):
        f8m.fp8_parts(_weight("fp8-block-128", code=0x7F), "t")
    for bad in (f8m.MIN_UE8M0 - 1, f8m.MAX_UE8M0 + 1):
        with pytest.raises(UserError, match="gemm.fp8_w8a16_triton"):
            f8m.fp8_parts(_weight("fp8-block-32", scale_byte=bad), "t")
    q, s, sc = f8m.fp8_parts(_weight("fp8-block-32", scale_byte=f8m.MAX_UE8M0), "t")
    assert s.dtype == torch.uint8 and sc.ue8m0 and sc.block == (32, 32)
    with pytest.raises(UserError, match="QuantizedWeight"):
        f8m.fp8_parts(torch.zeros(4, 64), "t")


def test_supports_names_what_it_needs():
    from latency_specialized.ops.registry import make_context

    def ctx(**kw):
        base = dict(arch="sm_90a", dtype="bfloat16", tokens=4, dims={"N": 6144, "K": 2048},
                    attrs={"weight_format": "fp8-block-128"})
        base.update(kw)
        return make_context("gemm", **base)

    assert "sm_90" in f8m._supports(ctx(arch="cpu")) and "sm_90" in f8m._supports(ctx(arch="sm_100"))
    assert "bf16" in f8m._supports(ctx(attrs={}))
    assert "M<=64" in f8m._supports(ctx(tokens=65))
    assert "K % 64" in f8m._supports(ctx(dims={"N": 64, "K": 96}))
    assert "bf16 activations" in f8m._supports(ctx(dtype="float32"))
    if cute_available() is True:
        assert f8m._supports(ctx()) is True
        assert f8m._supports(ctx(attrs={"weight_format": "fp8-block-32"})) is True


@pytest.mark.parametrize("N,K,M", [(6144, 2048, 1), (4096, 1280, 1), (6144, 4096, 16), (32768, 1280, 4),
                                   (2624, 6144, 64), (200, 320, 3)])
def test_default_config_serves_m_and_fits(N, K, M):
    from latency_specialized.kernels.gemm_small_m import SMEM_LIMIT

    cfg = f8m.default_config(N, K, M)
    assert 8 * cfg.nt >= M and cfg.smem_bytes() <= SMEM_LIMIT and cfg.sk <= f8m.MAX_CLUSTER
    assert K // 64 >= cfg.wk * cfg.sk  # every warp of the split has a chunk


@needs_cute
@pytest.mark.parametrize("ue8m0,block", [(False, (128, 128)), (True, (32, 32)), (False, (1, 128)), (True, (1, 32))])
def test_fp8_variant_compiles_to_decode_plus_mma_without_spills(sm90, ue8m0, block):
    """Per warp and 64-wide chunk: one 16-byte load per weight row (g, g + 8), 8 bf16x2 multiplies per row, 4 MMAs
    per n-tile; no local memory; the first batch of weight loads issued before the PDL wait."""
    from dataclasses import replace

    from latency_specialized.kernels.gemm_common import ptx_of
    from latency_specialized.kernels.gemm_small_m import MmaConfig, compile_mma
    from latency_specialized.kernels.mma_quant_weights import QuantCoding

    K, cfg = 2048, MmaConfig(nt=2, wk=4, cb=4)
    p = ptx_of(compile_mma(K, cfg, True, coding=QuantCoding(ue8m0, block)))
    chunks = K // 64 // cfg.wk
    assert "ld.local" not in p and "st.local" not in p
    assert weight_loads(p) == 2 * chunks
    assert p.count("mul.rn.bf16x2") == 2 * 8 * chunks
    assert p.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 4 * cfg.nt * chunks
    assert loads_before_wait(p) == 2 * cfg.cb
    # fp32 scales: each chunk's sums scaled into the accumulators; ue8m0: none (folded into the decode)
    assert ("ld.global.b8" in p) == ue8m0 and ("ld.global.b32" in p) != ue8m0
    # "bytes" pairing: 2 byte permutes per weight word; "split": none on the weights, 2 per activation word pair and
    # n-tile instead
    assert p.count("prmt.b32") == chunks * 2 * 4 * 2
    ps = ptx_of(compile_mma(K, replace(cfg, fp8_pairs="split"), True, coding=QuantCoding(ue8m0, block)))
    assert ps.count("prmt.b32") == chunks * 4 * 2 * cfg.nt and ps.count("mul.rn.bf16x2") == 2 * 8 * chunks
    assert "ld.local" not in ps and replace(cfg, fp8_pairs="split").label() == "n2m1w4s1c4xfp"


@needs_cute
def test_fp8_variant_refuses_layouts_it_cannot_scale(sm90):
    from latency_specialized.kernels.gemm_small_m import MmaConfig, compile_mma
    from latency_specialized.kernels.mma_quant_weights import QuantCoding

    for k, sc in ((2016, QuantCoding(False, (128, 128))), (2048, QuantCoding(False, (128, 32))),
                  (2048, QuantCoding(True, (8, 32)))):
        with pytest.raises(ValueError, match="not compiled"):
            compile_mma(k, MmaConfig(), False, coding=sc)


def test_measured_table_and_heuristic_keep_k_split_inside_the_cta():
    """Session 33 (H200): a cluster split of K lost in every cell measured, so neither the table nor the heuristic
    uses one; each table entry serves its M."""
    for (N, K, M), cfg in f8m.TUNING.items():
        assert cfg.sk == 1 and 8 * cfg.nt >= M and f8m.default_config(N, K, M) == cfg
    assert all(f8m.default_config(N, K, M).sk == 1 for N in (64, 6144, 32768) for K in (128, 2048, 7168)
               for M in (1, 5, 16, 40, 64))


def test_weight_checks_run_once_per_weight_object_and_kernel():
    """The checks are cached on the weight's tensor object (weakly): again for the same weight - nothing read; a
    weight freed and another allocated in its place - checked again, whatever its address; the same weight under
    another kernel's tag - checked for that kernel too."""
    from latency_specialized.kernels.gemm_common import check_once

    calls = []
    w = torch.zeros(4, 64, dtype=torch.uint8)
    check_once(w, ("a", 1), lambda: calls.append("a"))
    check_once(w, ("a", 1), lambda: calls.append("a again"))
    check_once(w, ("b", 1), lambda: calls.append("b"))
    assert calls == ["a", "b"]
    del w
    w2 = torch.zeros(4, 64, dtype=torch.uint8)
    check_once(w2, ("a", 1), lambda: calls.append("new weight"))
    assert calls[-1] == "new weight"
    with pytest.raises(UserError, match="NaN"):  # a bad weight is refused every time, never cached as checked
        f8m.fp8_parts(_weight("fp8-block-128", code=0xFF), "t")
