"""GPU tests of ``gemm.fp8_w8a16_mma`` (block-FP8 weights decoded to bf16 in registers, mma.sync, CuTe DSL).

Shapes: GLM-5.3 shards in fp8-block-128 (TP8 o_proj [6144, 2048], the fused q_a + kv_a [2624, 6144]), DeepSeek-V4.1-
Flash in fp8-block-32 (TP8 wq_b [4096, 1280], TP4 wo_b [5120, 2048]), both formats' ``/rows`` forms (one scale per
row: ``quant.layout.row_scaled``) and odd ones ([200, 320], [72, 192]); M 1, 3, 8, 16, 33, 64; the heuristic
config, the same with the "split" pairing of the decode, a cluster split of K and 8 warps along K.

Every case: fresh random codes and scales (rows of different magnitudes), outputs poisoned with NaN inside a wider
tensor (strided rows) and checked fully written and nothing outside touched, against the dequantising reference at
bf16 tolerance; fp32 output against the fp32 reference; repeated calls bit-identical (the K split's reduction order
is fixed); CUDA-graph replay equals eager bit for bit. Decoding: every finite e4m3 code under the decodable ue8m0
range's ends and extreme fp32 scales, read back exactly through one-hot tokens; NaN codes and out-of-range scales
refused with the fix named.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels import gemm_fp8_mma as f8m
from latency_specialized.kernels.gemm_small_m import SMEM_LIMIT, MmaConfig
from latency_specialized.ops.gemm import gemm_reference
from latency_specialized.quant.checkpoint_io import QuantizedWeight
from latency_specialized.quant.layout import row_scaled

from gpu_helpers import check_gemm_into_poisoned_slice, graph_replay, quantized_rows, rel_err, seeded_generator

pytestmark = pytest.mark.gpu

DEV = "cuda"
SHAPES = {  # name: (N, K, format, one scale per row)
    "glm_tp8_o_proj": (6144, 2048, "fp8-block-128", False),
    "glm_q_a_kv_a": (2624, 6144, "fp8-block-128", False),
    "dsv4_tp8_wq_b": (4096, 1280, "fp8-block-32", False),
    "dsv4_tp4_wo_b": (5120, 2048, "fp8-block-32", False),
    "glm_rows": (1040, 1024, "fp8-block-128", True),
    "dsv4_rows": (600, 1280, "fp8-block-32", True),
    "odd_128": (200, 320, "fp8-block-128", False),
    "odd_32": (72, 192, "fp8-block-32", False),
}
TOL = 1.0 / 128
"""max |diff| / max |ref| against a reference with the same inputs: one bf16 output rounding, fp32 sums reordered."""


@pytest.fixture(scope="module", params=list(SHAPES))
def shape(request):
    N, K, fmt, rows = SHAPES[request.param]
    q = quantized_rows(request.param, N, K, fmt)
    return request.param, row_scaled(q) if rows else q


def _configs(N: int, K: int, M: int) -> dict[str, MmaConfig | None]:
    base = f8m.default_config(N, K, M)
    out: dict[str, MmaConfig | None] = {"default": None, "split_pairs": replace(base, fp8_pairs="split"),
                                        "prefetch": replace(base, prefetch=True)}
    if K // 64 >= 8:
        out["cluster4"] = replace(base, wk=2, sk=4, cb=2)
        out["warps8"] = replace(base, wk=8, sk=1, cb=1)
    return {k: c for k, c in out.items() if c is None or c.smem_bytes() <= SMEM_LIMIT}  # 8 warps x 64 rows do not fit


@pytest.mark.parametrize("M", [1, 3, 8, 16, 33, 64])
def test_fp8_mma_gemm_matches_the_reference(shape, M):
    name, w = shape
    N, K = w.shape
    g = seeded_generator(f"{name}-mma-{M}")
    x = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    r = torch.randn(M, N, generator=g, device=DEV).bfloat16()
    ref = gemm_reference(x, w, residual=r)
    for cfg in _configs(N, K, M).values():
        check_gemm_into_poisoned_slice(f8m.gemm_fp8_mma, x, w, r, ref, TOL, config=cfg)
    y32 = f8m.gemm_fp8_mma(x, w, out_dtype=torch.float32)
    assert y32.dtype == torch.float32 and rel_err(y32, gemm_reference(x.float(), w)) <= 1e-5
    # graph replay == eager, bit for bit
    x2 = torch.randn_like(x)
    eager = f8m.gemm_fp8_mma(x2, w, residual=r)
    xs, o = x.clone(), torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    graph = graph_replay(lambda: f8m.gemm_fp8_mma(xs, w, residual=r, out=o))
    xs.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, eager)


@pytest.mark.parametrize("fmt", ["fp8-block-128", "fp8-block-32"])
def test_fp8_mma_decoding_of_every_code_under_edge_scales_is_exact(fmt):
    """Every finite e4m3 code (+-0, subnormals, +-448) under extreme scales (ue8m0: ``MIN_UE8M0`` / ``MAX_UE8M0``,
    the decodable range's ends; fp32 1e-30 .. 6.5e30): one-hot tokens read the weight back (fp32 output), equal to
    the codec's dequantised values."""
    from fp8_edge import every_code_weight, read_back

    q = every_code_weight(fmt, (f8m.MIN_UE8M0, 100, 127, f8m.MAX_UE8M0))
    ref = q.dequantize()
    for pairs in ("bytes", "split"):
        got = read_back(lambda x, w, **kw: f8m.gemm_fp8_mma(
            x, w, config=replace(f8m.default_config(w.shape[0], w.shape[1], x.shape[0]), fp8_pairs=pairs), **kw), q)
        assert torch.isfinite(ref).all() and torch.equal(got, ref), pairs


def test_fp8_mma_refuses_nan_codes_and_undecodable_scales():
    from latency_specialized.quant.formats import QuantFormat

    x = torch.randn(1, 64, device=DEV).bfloat16()
    f = QuantFormat.get("fp8-block-32")
    w = torch.zeros(64, 64, device=DEV, dtype=torch.uint8)
    for byte in (f8m.MIN_UE8M0 - 1, f8m.MAX_UE8M0 + 1):
        s = torch.full((2, 2), byte, device=DEV, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        with pytest.raises(UserError, match="gemm.fp8_w8a16_triton"):
            f8m.gemm_fp8_mma(x, QuantizedWeight(f, (64, 64), w.view(torch.float8_e4m3fn), s, name=f"s{byte}"))
    w[3, 5] = 0xFF
    s = torch.full((2, 2), 120, device=DEV, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(UserError, match="NaN"):
        f8m.gemm_fp8_mma(x, QuantizedWeight(f, (64, 64), w.view(torch.float8_e4m3fn), s, name="nan"))
