"""GPU tests of the block-FP8 gemms (``gemm.fp8_w8a16_triton`` / ``gemm.fp8_w8a8_triton``).

Shapes: GLM-5.3 TP8 / TP4 shards in fp8-block-128 (o_proj [6144, 2048] / [6144, 4096], the fused q_a + kv_a
[2624, 6144], a dense gate|up [3072, 6144]) and DeepSeek-V4.1-Flash in fp8-block-32 (wq_b [4096, 1280] at TP8,
wo_b [5120, 2048] at TP4), plus an odd one ([200, 328]); M 1, 3, 8, 16, 64; the heuristic split-K and a forced one.

Every case: fresh random codes and scales (rows of different magnitudes), outputs poisoned with NaN and checked fully
written, W8A16 against the dequantising reference at bf16 tolerance, W8A8 against the reference over its own
activation rounding (same tolerance) and the dequantising one within e4m3's error; CUDA-graph replay equals eager
bit for bit; repeated calls are bit-identical (the split-K reduction order is fixed); two streams at once each get
their own tickets; the RMSNorm prologue (M 1-4, strided x rows) against the reference's norm-then-gemm. Decoding: every e4m3 code under ue8m0 1 / 100 / 127 / 246 and fp32 scales, read back exactly.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels import gemm_fp8_triton as f8
from latency_specialized.kernels import triton_fp8 as f8_kernel
from latency_specialized.kernels.triton_fp8 import quantize_activations_reference
from latency_specialized.ops.gemm import gemm_reference
from latency_specialized.quant.checkpoint_io import QuantizedWeight, quantize_weight

from gpu_helpers import graph_replay, quantized_rows, seeded_generator

pytestmark = pytest.mark.gpu

DEV = "cuda"
SHAPES = {  # name: (N, K, format)
    "glm_tp8_o_proj": (6144, 2048, "fp8-block-128"),
    "glm_tp4_o_proj": (6144, 4096, "fp8-block-128"),
    "glm_q_a_kv_a": (2624, 6144, "fp8-block-128"),
    "glm_tp8_dense_gate_up": (3072, 6144, "fp8-block-128"),
    "dsv4_tp8_wq_b": (4096, 1280, "fp8-block-32"),
    "dsv4_tp4_wo_b": (5120, 2048, "fp8-block-32"),
    "odd": (200, 328, "fp8-block-128"),
}
IMPLS = {"w8a16": f8.gemm_fp8_w8a16, "w8a8": f8.gemm_fp8_w8a8}
TOL = 1.0 / 128
"""max |diff| / max |ref| against a reference with the same inputs: one bf16 output rounding, fp32 sums reordered."""
A8_TOL = 6e-2
"""W8A8 against the bf16-activation reference: e4m3's 3 mantissa bits on the activations."""


def _rel(y, ref):
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture(scope="module", params=list(SHAPES))
def shape(request):
    return request.param, quantized_rows(request.param, *SHAPES[request.param])


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("M", [1, 3, 8, 16, 64])
def test_fp8_gemm_matches_the_reference(shape, impl, M):
    name, w = shape
    N, K = w.shape
    g = seeded_generator(f"{name}-{impl}-{M}")
    x = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    r = torch.randn(M, N, generator=g, device=DEV).bfloat16()
    wide = torch.full((M, N + 16), float("nan"), device=DEV, dtype=torch.bfloat16)
    out = wide[:, 8:8 + N]
    y = IMPLS[impl](x, w, residual=r, out=out)
    assert y.data_ptr() == out.data_ptr() and torch.isfinite(y).all()
    assert wide[:, :8].isnan().all() and wide[:, 8 + N:].isnan().all()
    ref = gemm_reference(x, w, residual=r)
    if impl == "w8a16":
        assert _rel(y, ref) <= TOL
    else:
        q, sx = quantize_activations_reference(x, w.fmt.block[1])
        seen = (q * sx.repeat_interleave(w.fmt.block[1], 1)[:, :K]).bfloat16()
        # the seen activations are e4m3 x fp32 scale: rounding them to bf16 for the reference loses < 2^-9
        assert _rel(y, gemm_reference(seen, w, residual=r)) <= 2 * TOL
        assert _rel(y, ref) <= A8_TOL
    # deterministic: the same call again is bit-identical
    assert torch.equal(IMPLS[impl](x, w, residual=r), y)
    # graph replay == eager, bit for bit
    x2 = torch.randn_like(x)
    eager = IMPLS[impl](x2, w, residual=r)
    xs, o = x.clone(), torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    graph = graph_replay(lambda: IMPLS[impl](xs, w, residual=r, out=o))
    xs.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, eager)


@pytest.mark.parametrize("M", [1, 2, 4])
def test_fp8_gemm_norm_prologue_matches_the_reference(shape, M):
    """``gemm.fp8_w8a16_norm_triton``: x a column slice of a wider tensor (MLA's q_a), RMS-normalised in the
    prologue; against the reference's norm-then-gemm; graph replay == eager."""
    name, w = shape
    N, K = w.shape
    g = seeded_generator(f"{name}-norm-{M}")
    wide = (torch.randn(M, K + 64, generator=g, device=DEV) * 3).bfloat16()
    x = wide[:, 32:32 + K]
    gain = (1 + 0.1 * torch.randn(K, generator=g, device=DEV)).bfloat16()
    out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    y = f8.gemm_fp8_w8a16(x, w, out=out, norm_weight=gain, norm_eps=1e-6)
    assert torch.isfinite(y).all() and _rel(y, gemm_reference(x, w, norm_weight=gain, norm_eps=1e-6)) <= TOL
    o = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    graph = graph_replay(lambda: f8.gemm_fp8_w8a16(x, w, out=o, norm_weight=gain, norm_eps=1e-6))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, y)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("split", [1, 3, 16])
def test_fp8_gemm_forced_splits_agree(shape, impl, split):
    name, w = shape
    N, K = w.shape
    x = torch.randn(5, K, generator=seeded_generator(f"{name}-split"), device=DEV).bfloat16()
    base = IMPLS[impl](x, w, config=f8.Fp8GemmConfig(split_k=1, block_n=64))
    y = IMPLS[impl](x, w, config=f8.Fp8GemmConfig(split_k=split, block_n=64))
    assert _rel(y, base) <= TOL


def test_fp8_gemm_two_streams_at_once_do_not_share_tickets():
    """The side stream (a shared expert) and the main stream each run split-K gemms concurrently, many times."""
    N, K = 2048, 6144
    g = seeded_generator("two-streams")
    wa = quantize_weight("a.weight", torch.randn(N, K, generator=g, device=DEV) * K ** -0.5, "fp8-block-128")
    wb = quantize_weight("b.weight", torch.randn(N, K, generator=g, device=DEV) * K ** -0.5, "fp8-block-128")
    xa, xb = (torch.randn(4, K, generator=g, device=DEV).bfloat16() for _ in range(2))
    cfg = f8.Fp8GemmConfig(split_k=8, block_n=64)
    ra, rb = f8.gemm_fp8_w8a16(xa, wa, config=cfg), f8.gemm_fp8_w8a16(xb, wb, config=cfg)
    side = torch.cuda.Stream()
    outs_a, outs_b = [], []
    for _ in range(20):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            outs_b.append(f8.gemm_fp8_w8a16(xb, wb, config=cfg))
        outs_a.append(f8.gemm_fp8_w8a16(xa, wa, config=cfg))
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert all(torch.equal(a, ra) for a in outs_a) and all(torch.equal(b, rb) for b in outs_b)


@pytest.mark.parametrize("fmt", ["fp8-block-128", "fp8-block-32"])
def test_fp8_decoding_of_every_code_under_edge_scales_is_exact(fmt):
    """Every finite e4m3 code (+-0, subnormals, +-448) under extreme scales (ue8m0: the decodable range's ends,
    ``MIN_UE8M0`` / ``MAX_UE8M0``): x = one-hot rows read the weight back through the kernel (W8A16, fp32 output),
    equal to the codec's dequantised values."""
    from fp8_edge import every_code_weight, read_back

    q = every_code_weight(fmt, (f8_kernel.MIN_UE8M0, 100, 127, f8_kernel.MAX_UE8M0))
    ref = q.dequantize()
    got = read_back(f8.gemm_fp8_w8a16, q)
    finite = torch.isfinite(ref)
    assert torch.equal(got[finite], ref[finite])


def test_fp8_gemm_refuses_undecodable_ue8m0_scale():
    from latency_specialized.quant.formats import QuantFormat

    f = QuantFormat.get("fp8-block-32")
    w = torch.zeros(64, 64, device=DEV, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.full((2, 2), 250, device=DEV, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(UserError, match="requantize"):
        f8.gemm_fp8_w8a8(torch.randn(1, 64, device=DEV).bfloat16(), QuantizedWeight(f, (64, 64), w, s))
    low = torch.full((2, 2), f8_kernel.MIN_UE8M0 - 1, device=DEV, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(UserError, match="requantize"):  # products below the normal range: flushed on the GPU
        f8.gemm_fp8_w8a16(torch.randn(1, 64, device=DEV).bfloat16(), QuantizedWeight(f, (64, 64), w, low))
