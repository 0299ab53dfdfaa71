"""GPU tests of the MXFP4 mma kernel (``kernels/gemm_q4_mma.py``: e2m1 decoded to bf16 in registers, mma.sync).

Shapes: Kimi K3-like expert matrices (gate | up [2 x 512, 7168] and down [7168, 512]), a wide one ([4096, 2048]) and
an odd one ([200, 384]), in mxfp4 and mxfp4-deepseek; M 1, 3, 8, 16, 33, 64; the heuristic config and 8 warps along
K. Every case: fresh random weights quantized by the codec, NaN-poisoned strided outputs fully written and nothing
outside touched, against the dequantising reference at bf16 tolerance and in fp32, deterministic, CUDA-graph replay
equal to eager. Decoding: every e2m1 code under the decodable ue8m0 range's ends, read back exactly; out-of-range
scales refused.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels import gemm_q4_mma as q4m
from latency_specialized.ops.gemm import gemm_reference
from latency_specialized.quant.checkpoint_io import QuantizedWeight

from gpu_helpers import check_gemm_into_poisoned_slice, graph_replay, quantized_rows, rel_err, seeded_generator

pytestmark = pytest.mark.gpu

DEV = "cuda"
SHAPES = {  # name: (N, K, format)
    "gate_up": (1024, 7168, "mxfp4"),
    "down": (7168, 512, "mxfp4"),
    "wide": (4096, 2048, "mxfp4-deepseek"),
    "odd": (200, 384, "mxfp4"),
}
TOL = 1.0 / 128


@pytest.fixture(scope="module", params=list(SHAPES))
def shape(request):
    return request.param, quantized_rows(request.param, *SHAPES[request.param])


@pytest.mark.parametrize("M", [1, 3, 8, 16, 33, 64])
def test_mxfp4_mma_gemm_matches_the_reference(shape, M):
    name, w = shape
    N, K = w.shape
    g = seeded_generator(f"{name}-q4-{M}")
    x = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    r = torch.randn(M, N, generator=g, device=DEV).bfloat16()
    ref = gemm_reference(x, w, residual=r)
    base = q4m.default_config(N, K, M)
    configs = {"default": None, "prefetch": replace(base, prefetch=True)}
    if K // 128 >= 8 and replace(base, wk=8).smem_bytes() <= 48 * 1024:
        configs["warps8"] = replace(base, wk=8, cb=1)
    for cfg in configs.values():
        check_gemm_into_poisoned_slice(q4m.gemm_mxfp4_mma, x, w, r, ref, TOL, config=cfg)
    y32 = q4m.gemm_mxfp4_mma(x, w, out_dtype=torch.float32)
    assert rel_err(y32, gemm_reference(x.float(), w)) <= 1e-5
    x2 = torch.randn_like(x)
    eager = q4m.gemm_mxfp4_mma(x2, w, residual=r)
    xs, o = x.clone(), torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    graph = graph_replay(lambda: q4m.gemm_mxfp4_mma(xs, w, residual=r, out=o))
    xs.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, eager)


def test_mxfp4_mma_decoding_of_every_code_under_edge_scales_is_exact():
    """Every e2m1 code (+-0, the subnormal +-0.5, +-6) under ue8m0 ``MIN_UE8M0`` / 100 / 127 / ``MAX_UE8M0`` (rows in
    four groups): one-hot tokens read the weight back (fp32 output), equal to the codec's dequantised values."""
    from latency_specialized.quant.formats import QuantFormat

    f = QuantFormat.get("mxfp4")
    N, K = 64, 256
    nib = torch.arange(16, device=DEV, dtype=torch.uint8).repeat(N * K // 16).view(N, K)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous()
    sc = torch.tensor([q4m.MIN_UE8M0, 100, 127, q4m.MAX_UE8M0], device=DEV, dtype=torch.uint8)
    scale = sc.repeat_interleave(N // 4).view(N, 1).expand(N, K // 32).contiguous()
    q = QuantizedWeight(f, (N, K), packed, scale, name="edge-q4.weight")
    ref = q.dequantize()
    eye = torch.eye(K, device=DEV, dtype=torch.bfloat16)
    got = torch.empty(N, K, device=DEV)
    for i in range(0, K, 64):
        got[:, i:i + 64] = q4m.gemm_mxfp4_mma(eye[i:i + 64], q, out_dtype=torch.float32).t()
    assert torch.equal(got, ref)


def test_mxfp4_mma_refuses_undecodable_scales():
    from latency_specialized.quant.formats import QuantFormat

    f = QuantFormat.get("mxfp4")
    x = torch.randn(1, 128, device=DEV).bfloat16()
    for byte in (q4m.MIN_UE8M0 - 1, q4m.MAX_UE8M0 + 1):
        s = torch.full((16, 4), byte, device=DEV, dtype=torch.uint8)
        with pytest.raises(UserError, match="requantize"):
            q4m.gemm_mxfp4_mma(x, QuantizedWeight(f, (16, 128), torch.zeros(16, 64, device=DEV, dtype=torch.uint8),
                                                  s, name=f"s{byte}"))
