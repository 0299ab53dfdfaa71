"""CPU tests of the MXFP4 variant of the mma.sync kernel (``kernels/gemm_q4_mma.py``, ``QuantCoding(element="e2m1")``):
the integer e2m1 -> bf16 decode emulated bit for bit over every code and position, a lane-by-lane fragment emulator of
a 128-wide chunk, offline sm_90 compiles and what their PTX holds, the weight checks. GPU: ``test_gemm_q4_mma_gpu.py``.
"""

from __future__ import annotations

import struct

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels import gemm_q4_mma as q4m
from latency_specialized.kernels.compile_cache import cute_available
from latency_specialized.quant.checkpoint_io import QuantizedWeight
from latency_specialized.quant.formats import QuantFormat
from mma_emulation import decode_e2m1_word, e2m1
from ptx_patterns import loads_before_wait, weight_loads

needs_cute = pytest.mark.skipif(cute_available() is not True, reason="nvidia-cutlass-dsl not installed")


def _mult(e: int) -> int:
    """bf16 bits of 2^(e - 1): the decode's 2^126 times the block scale 2^(e - 127)."""
    return (e + 126) << 7


@pytest.mark.parametrize("e", [q4m.MIN_UE8M0, 100, 127, q4m.MAX_UE8M0])
def test_integer_decode_equals_e2m1_for_every_code_in_every_position(e):
    for code in range(16):
        for filler in (0, 7, 8, 15):
            for pos in range(8):
                nibbles = [filler] * 8
                nibbles[pos] = code
                word = sum(c << (4 * n) for n, c in enumerate(nibbles))
                pairs = decode_e2m1_word(word, _mult(e))
                got = [None] * 8
                for n in range(4):
                    got[n], got[n + 4] = pairs[n]
                want = [e2m1(c) * 2.0 ** (e - 127) for c in nibbles]
                assert got == want, (code, filler, pos)
                signs = [struct.pack("<f", v)[3] >> 7 for v in got]
                assert signs == [c >> 3 for c in nibbles]  # -0 stays -0


def test_fragment_mapping_of_a_chunk_computes_the_dot_products():
    """One warp's 128-wide chunk of a 16-row tile, lane by lane as the kernel builds it (a 16-byte load at byte 16t of
    rows g and g + 8 = 32 values from K = 32t; word i -> pairs (8i + n, 8i + n + 4); MMA 2i takes pairs n = 0, 1 and
    2i + 1 pairs 2, 3 as A registers (K 2t, 2t + 1 | 2t + 8, 2t + 9); the activations paired alike), equals
    W[16, 128] @ x[8, 128]^T."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 128), generator=g)
    w = torch.tensor([[e2m1(c) for c in row] for row in codes.tolist()], dtype=torch.float64)
    x = torch.randn(8, 128, generator=g, dtype=torch.float64).bfloat16().double()
    got = torch.zeros(16, 8, dtype=torch.float64)
    for i in range(4):              # word i of the lane's load
        for half in range(2):       # MMA 2i + half: pairs (2 half, 2 half + 1)
            A = torch.zeros(16, 16, dtype=torch.float64)
            B = torch.zeros(16, 8, dtype=torch.float64)
            for lane in range(32):
                gi, t = lane // 4, lane % 4
                base = 32 * t + 8 * i
                for row in (gi, gi + 8):
                    word = sum(int(c) << (4 * n) for n, c in enumerate(codes[row, base:base + 8].tolist()))
                    pairs = decode_e2m1_word(word, _mult(127))
                    A[row, 2 * t:2 * t + 2] = torch.tensor(pairs[2 * half], dtype=torch.float64)
                    A[row, 2 * t + 8:2 * t + 10] = torch.tensor(pairs[2 * half + 1], dtype=torch.float64)
                n0 = 2 * half
                B[2 * t:2 * t + 2, gi] = x[gi, [base + n0, base + n0 + 4]]
                B[2 * t + 8:2 * t + 10, gi] = x[gi, [base + n0 + 1, base + n0 + 5]]
            got += A @ B
    assert torch.allclose(got, w @ x.t(), rtol=1e-12, atol=1e-12)


def _mxfp4(N: int = 32, K: int = 128, scale_byte: int = 120) -> QuantizedWeight:
    f = QuantFormat.get("mxfp4")
    return QuantizedWeight(f, (N, K), torch.full((N, K // 2), 0x21, dtype=torch.uint8),
                           torch.full((N, K // 32), scale_byte, dtype=torch.uint8), name="t.weight")


def test_weight_checks_refuse_undecodable_scales_and_other_formats():
    q, s = q4m.mxfp4_parts(_mxfp4())
    assert q.shape == (32, 64) and s.shape == (32, 4) and q.dtype == s.dtype == torch.uint8
    for bad in (q4m.MIN_UE8M0 - 1, q4m.MAX_UE8M0 + 1):
        with pytest.raises(UserError, match="requantize"):
            q4m.mxfp4_parts(_mxfp4(scale_byte=bad))
    with pytest.raises(UserError, match="mxfp4"):
        q4m.mxfp4_parts(torch.zeros(4, 64))


@needs_cute
def test_e2m1_variant_compiles_to_decode_plus_mma_without_spills(sm90):
    """Per warp and 128-wide chunk: one 16-byte load per weight row (g, g + 8), 16 bf16x2 multiplies per row (4 per
    word), 8 MMAs and 16 activation permutes per n-tile, one scale byte per row; no local memory; the first batch of
    weight loads before the PDL wait."""
    from latency_specialized.kernels.gemm_common import ptx_of
    from latency_specialized.kernels.gemm_small_m import MmaConfig, compile_mma

    K, cfg = 7168, MmaConfig(nt=1, wk=8, cb=4)
    p = ptx_of(compile_mma(K, cfg, False, coding=q4m.CODING))
    chunks = K // 128 // cfg.wk
    assert "ld.local" not in p and "st.local" not in p
    assert weight_loads(p) == 2 * chunks and loads_before_wait(p) == 2 * cfg.cb
    assert p.count("mul.rn.bf16x2") == 2 * 16 * chunks
    assert p.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 8 * cfg.nt * chunks
    assert p.count("prmt.b32") == 16 * cfg.nt * chunks
    assert "ld.global.b8" in p  # the rows' ue8m0 bytes
    with pytest.raises(ValueError, match="not compiled"):
        compile_mma(7168 + 64, cfg, False, coding=q4m.CODING)  # K % 128
