"""The mma.sync gemm kernels' sm_90a PTX executed on the CPU (``ptx_emulator.py``) through their public wrappers:
bf16 (``gemm_small_m``, GPU-verified: the emulator's own check), block FP8 (``gemm_fp8_mma``, GPU-verified) and
MXFP4 (``gemm_q4_mma``, not yet run on a GPU). Each case: NaN-poisoned column slice of a wider output fully written
and nothing outside touched (``gpu_helpers.check_gemm_into_poisoned_slice``), against the dequantising reference;
ragged N (rows past N masked), odd M, K split over warps (shared-memory reduction; 3 warps: a ragged split), two
m-tiles and two n-tiles, a persistent grid walking several tiles, the first batch of weights through the coherent
path (``MmaConfig.prefetch``), batches requested ahead behind fences (``MmaConfig.lookahead``). Every access
bounds-checked by the emulator. Also the CuTe DSL GEMV and NVFP4 decoding.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.kernels.compile_cache import cute_available
from latency_specialized.kernels.gemm_small_m import MmaConfig
from latency_specialized.ops.gemm import gemm_reference

from emulated_kernels import EmulatedMma, emulate_mma
from gpu_helpers import check_gemm_into_poisoned_slice, quantized_rows, rel_err, seeded_generator

pytestmark = pytest.mark.skipif(cute_available() is not True, reason="nvidia-cutlass-dsl not installed")

CONFIGS = {  # label: (M, config)
    "m5-w2": (5, MmaConfig(nt=1, wk=2, cb=2)),
    "m4-w2-prefetch-ragged": (4, MmaConfig(nt=1, wk=3, cb=2, prefetch=True)),
    "m2-w1-lookahead2": (2, MmaConfig(nt=1, wk=1, cb=1, lookahead=2)),
    "m3-w1-persistent": (3, MmaConfig(nt=1, wk=1, cb=4, ctas_per_sm=1)),
    "m13-mt2-nt2-w2": (13, MmaConfig(nt=2, mt=2, wk=2, cb=1)),
}


def _inputs(name: str, M: int, N: int, K: int):
    g = seeded_generator(name, "cpu")
    return torch.randn(M, K, generator=g).bfloat16(), torch.randn(M, N, generator=g).bfloat16()


@pytest.mark.parametrize("label", list(CONFIGS))
def test_bf16_mma_kernel_runs_in_the_emulator_as_on_the_gpu(monkeypatch, label):
    from latency_specialized.kernels.gemm_small_m import run_mma

    emulate_mma(monkeypatch)
    M, cfg = CONFIGS[label]
    N, K = 40, 256
    x, r = _inputs(label, M, N, K)
    w = (torch.randn(N, K, generator=seeded_generator(label + "w", "cpu")) * K ** -0.5).bfloat16()
    ref = gemm_reference(x, w, residual=r)
    check_gemm_into_poisoned_slice(lambda x, w, **kw: run_mma(x, w, kw["residual"], kw.get("out"), cfg,
                                                              "gemm.cutedsl_small_m"), x, w, r, ref, 1 / 128)


QUANTIZED = {"fp8-block-128": ("gemm_fp8_mma", "gemm_fp8_mma", 256),
             "fp8-block-32": ("gemm_fp8_mma", "gemm_fp8_mma", 256),
             "mxfp4": ("gemm_q4_mma", "gemm_mxfp4_mma", 512),
             "mxfp4-deepseek": ("gemm_q4_mma", "gemm_mxfp4_mma", 512)}
"""format: (kernel module, wrapper, K)."""


@pytest.mark.parametrize("fmt", list(QUANTIZED))
@pytest.mark.parametrize("label", list(CONFIGS))
def test_quantized_mma_kernels_in_the_emulator(monkeypatch, fmt, label):
    """Block FP8 (GPU-verified) and MXFP4 (not yet run on a GPU), bf16 and fp32 outputs."""
    import importlib

    module, wrapper, K = QUANTIZED[fmt]
    gemm = getattr(importlib.import_module(f"latency_specialized.kernels.{module}"), wrapper)
    emulate_mma(monkeypatch)
    M, cfg = CONFIGS[label]
    N = 40
    w = quantized_rows(f"{label}{fmt}", N, K, fmt, device="cpu")
    x, r = _inputs(label + fmt, M, N, K)
    ref = gemm_reference(x, w, residual=r)
    check_gemm_into_poisoned_slice(gemm, x, w, r, ref, 1 / 128, config=cfg)
    y32 = gemm(x, w, out_dtype=torch.float32, config=cfg)
    assert rel_err(y32, gemm_reference(x.float(), w)) <= 1e-5
    assert EmulatedMma.launches[-1][2].element == ("e2m1" if fmt.startswith("mx") else "e4m3")


def test_mxfp4_mma_reads_every_code_back_exactly_under_edge_scales_in_the_emulator(monkeypatch):
    """The GPU test's exactness check on the CPU: every e2m1 code (+-0, the subnormal +-0.5, +-6) in every nibble
    position, under ue8m0 ``MIN_UE8M0`` / 100 / 127 / ``MAX_UE8M0`` (rows in four groups); one-hot tokens read the
    weight back (fp32 output) equal to the codec's dequantised values."""
    from latency_specialized.kernels import gemm_q4_mma as q4m
    from latency_specialized.quant.checkpoint_io import QuantizedWeight
    from latency_specialized.quant.formats import QuantFormat

    emulate_mma(monkeypatch)
    N, K = 16, 128
    i = torch.arange(N * K, dtype=torch.int64)
    nib = ((i + i // 8) % 16).to(torch.uint8).view(N, K)  # every code in every nibble position of a word
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous()
    sc = torch.tensor([q4m.MIN_UE8M0, 100, 127, q4m.MAX_UE8M0], dtype=torch.uint8)
    scale = sc.repeat_interleave(N // 4).view(N, 1).expand(N, K // 32).contiguous()
    q = QuantizedWeight(QuantFormat.get("mxfp4"), (N, K), packed, scale, name="edge-q4-emulated.weight")
    eye = torch.eye(K, dtype=torch.bfloat16)
    got = torch.cat([q4m.gemm_mxfp4_mma(eye[i:i + 64], q, out_dtype=torch.float32).t() for i in (0, 64)], dim=1)
    assert torch.equal(got, q.dequantize())


def test_paired_decode_reads_every_code_back_exactly_in_the_emulator(monkeypatch):
    """The paired-nibble decode (``ptx.e2m1x8_paired_to_bf16x2``, ``QuantCoding(paired=True)``) on codes rearranged by
    ``quant.codecs.pair_codes``: every e2m1 code in every slot of a word (both halves), under ue8m0 ``MIN_UE8M0`` /
    100 / 127 / ``MAX_UE8M0``; one-hot tokens read the weight back equal to the original packing's dequantised values.
    The checkpoint packing's decode on the same rearranged bytes reads other values (the test can fail)."""
    from dataclasses import replace

    from latency_specialized.kernels import gemm_q4_mma as q4m
    from latency_specialized.kernels.gemm_small_m import quantized_config, run_quantized_mma
    from latency_specialized.quant.checkpoint_io import QuantizedWeight
    from latency_specialized.quant.codecs import pair_codes
    from latency_specialized.quant.formats import QuantFormat

    emulate_mma(monkeypatch)
    N, K = 16, 128
    i = torch.arange(N * K, dtype=torch.int64)
    nib = ((i + i // 8) % 16).to(torch.uint8).view(N, K)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous()
    sc = torch.tensor([q4m.MIN_UE8M0, 100, 127, q4m.MAX_UE8M0], dtype=torch.uint8)
    scale = sc.repeat_interleave(N // 4).view(N, 1).expand(N, K // 32).contiguous()
    want = QuantizedWeight(QuantFormat.get("mxfp4"), (N, K), packed, scale, name="paired.weight").dequantize()
    paired = pair_codes(packed)
    eye = torch.eye(K, dtype=torch.bfloat16)
    cfg = quantized_config(N, K // q4m.CODING.chunk, 64)

    def read(coding):
        return torch.cat([run_quantized_mma("paired-test", eye[j:j + 64], paired, scale, coding, None, None,
                                            torch.float32, cfg, 64).t() for j in (0, 64)], dim=1)

    assert torch.equal(read(replace(q4m.CODING, paired=True)), want)
    assert not torch.equal(read(q4m.CODING), want)


def test_nvfp4_coding_reads_every_code_back_exactly_under_edge_e4m3_scales_in_the_emulator(monkeypatch):
    """NVFP4 in the mma kernel (``QuantCoding(ue8m0=False, block=(1, 16), element="e2m1")``: two e4m3 scales per
    lane load folded into the decode's multiplier): every code in every nibble position under the e4m3 scale bytes
    0x01 (the smallest subnormal, 2^-9), 0x07, 0x08 (the smallest normal), 0x38 (1.0), 0x7E (448, the largest) - one
    per 16-value block, so a lane's two blocks differ; one-hot tokens read value x scale x 2^-64 back exactly."""
    from latency_specialized.kernels.gemm_small_m import quantized_config, run_quantized_mma
    from latency_specialized.kernels.mma_quant_weights import NVFP4_UNDO, QuantCoding
    from latency_specialized.quant.codecs import e2m1_decode

    emulate_mma(monkeypatch)
    coding = QuantCoding(ue8m0=False, block=(1, 16), element="e2m1")
    N, K = 16, 128
    i = torch.arange(N * K, dtype=torch.int64)
    nib = ((i + i // 8) % 16).to(torch.uint8).view(N, K)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous()
    edge = torch.tensor([0x01, 0x07, 0x08, 0x38, 0x7E], dtype=torch.uint8)
    scale = edge[torch.arange(N * K // 16) % 5].view(N, K // 16).contiguous()
    want = (e2m1_decode(nib) * scale.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1))
    eye = torch.eye(K, dtype=torch.bfloat16)
    cfg = quantized_config(N, K // coding.chunk, 64)
    got = torch.cat([run_quantized_mma("nvfp4-test", eye[j:j + 64], packed, scale, coding, None, None, torch.float32,
                                       cfg, 64).t() for j in (0, 64)], dim=1)
    assert torch.equal(got.double() * NVFP4_UNDO, want.double())


GEMV_CONFIGS = {  # label: (M, GemvConfig fields)
    "m1-default": (1, {}),
    "m3-rows2": (3, dict(rows_per_warp=2)),
    "m1-lookahead-prefetch": (1, dict(batch=1, lookahead=1, prefetch=True)),
    "m2-ksplit2": (2, dict(k_split=2)),
    "m1-persistent": (1, dict(ctas_per_sm=1)),
}


@pytest.mark.parametrize("smem", [False, True], ids=["per_warp", "norm_smem"])
@pytest.mark.parametrize("label", ["m1-default", "m3-rows2", "m2-ksplit2", "m1-persistent"])
def test_gemv_norm_prologue_runs_in_the_emulator(monkeypatch, label, smem):
    """The GEMV with the RMSNorm prologue, per warp and once per CTA in shared memory (``NORM_SMEM``, new in session
    55, not yet on a GPU): x a column slice of a wider row, K with a ragged tail, rows past N, into a poisoned slice,
    against the norm reference then the gemm reference."""
    from latency_specialized.kernels import gemm_gemv
    from latency_specialized.kernels.gemm_gemv import GemvConfig

    from emulated_kernels import emulate_gemv

    emulate_gemv(monkeypatch)
    monkeypatch.setattr(gemm_gemv, "NORM_SMEM", smem)
    emulated, forms = gemm_gemv.compile_gemv, []
    monkeypatch.setattr(gemm_gemv, "compile_gemv", lambda *a, **kw: forms.append(kw["norm_smem"]) or emulated(*a, **kw))
    M, fields = GEMV_CONFIGS[label]
    N, K = 37, 8 * (32 * 2 + 5) if "ksplit" not in label else 512
    g = seeded_generator("gemv-norm" + label, "cpu")
    wide = (torch.randn(M, K + 24, generator=g) * 3).bfloat16()
    x = wide[:, 8:8 + K]
    w = (torch.randn(N, K, generator=g) * K ** -0.5).bfloat16()
    gain = (1 + 0.2 * torch.randn(K, generator=g)).bfloat16()
    ref = gemm_reference(x, w, norm_weight=gain, norm_eps=1e-6)     # the norm reference, then the gemm
    big = torch.full((M, 64), float("nan"), dtype=torch.bfloat16)      # 16-byte aligned rows and slice
    out = big[:, 8:8 + N]
    gemm_gemv.gemm_gemv(x, w, out=out, norm_weight=gain, norm_eps=1e-6, config=GemvConfig(**fields))
    assert forms == [smem]                                               # the form asked for is the one that ran
    assert not out.isnan().any() and big[:, :8].isnan().all() and big[:, 8 + N:].isnan().all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=1 / 64, atol=1 / 64 * ref.float().abs().max().item())


@pytest.mark.parametrize("label", list(GEMV_CONFIGS))
def test_gemv_kernel_runs_in_the_emulator(monkeypatch, label):
    """The CuTe DSL GEMV (GPU-verified; ``GemvConfig.prefetch`` new this session, run nowhere else yet): K with a
    ragged tail of 16-byte vectors (2 full lane steps + 5 vectors), rows past N, residual, into a poisoned slice."""
    from latency_specialized.kernels import gemm_gemv
    from latency_specialized.kernels.gemm_gemv import GemvConfig

    from emulated_kernels import emulate_gemv

    emulate_gemv(monkeypatch)
    M, fields = GEMV_CONFIGS[label]
    N, K = 37, 8 * (32 * 2 + 5) if "ksplit" not in label else 512
    x, r = _inputs("gemv" + label, M, N, K)
    w = (torch.randn(N, K, generator=seeded_generator(label + "gw", "cpu")) * K ** -0.5).bfloat16()
    ref = gemm_reference(x, w, residual=r)
    check_gemm_into_poisoned_slice(gemm_gemv.gemm_gemv, x, w, r, ref, 1 / 128, config=GemvConfig(**fields))
