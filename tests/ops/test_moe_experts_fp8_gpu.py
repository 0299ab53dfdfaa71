"""GPU tests of the block-FP8 routed experts (``moe.experts.fp8_triton``).

Shapes: GLM-5.3 at TP8 (256 experts, top-8, K = N = 6144, expert width 256, SwiGLU) with whole 128 x 128 blocks,
and an odd one (row-scaled gate | up of 48-row parts, K 200: partial blocks); tokens 1, 3, 8, 13, 64 and every token
on the same experts. Every case: fresh random e4m3 codes and fp32 scales, outputs poisoned with NaN and checked fully
written, compared with ``ops.moe.experts_reference`` over the same ``QuantizedWeight`` (routed experts only) at bf16
tolerance; CUDA-graph replay equals eager bit for bit; per-route rows. Decoding: every e4m3 code under extreme fp32
scales read back exactly through the kernel.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.kernels.moe_experts_fp8_triton import experts_fp8, experts_fp8_w8a8
from latency_specialized.ops.moe import experts_reference
from latency_specialized.quant import layout
from latency_specialized.quant.checkpoint_io import quantize_weight
from latency_specialized.spec import ActivationSpec

from gpu_helpers import graph_replay, seeded_generator

pytestmark = pytest.mark.gpu

DEV = "cuda"
SWIGLU = ActivationSpec(kind="swiglu")
GLM = dict(E=256, k=8, K=6144, I=256, split=False)
ODD = dict(E=12, k=3, K=200, I=48, split=True)
REL_TOL = 1.5e-2
"""Max |ours - reference| over max |reference|: bf16 roundings of gate/up, activation and route outputs (the
reference rounds at the same points; the sums run in another order)."""
IMPLS = {"w8a16": (experts_fp8, REL_TOL), "w8a8": (experts_fp8_w8a8, 8e-2)}
"""W8A8 adds e4m3's rounding of the activation rows (3 mantissa bits, per 128-wide block)."""


@pytest.fixture(scope="module", params=["glm53_tp8", "odd"])
def model(request):
    cfg = GLM if request.param == "glm53_tp8" else ODD
    g = seeded_generator(request.param)
    E, I, K = cfg["E"], cfg["I"], cfg["K"]
    w1, w3 = (torch.randn(E, I, K, generator=g, device=DEV) * K ** -0.5 for _ in range(2))
    if cfg["split"]:
        w13 = layout.cat([quantize_weight("w1.weight", w1, "fp8-block-128"),
                          quantize_weight("w3.weight", w3, "fp8-block-128")], 1)
    else:
        w13 = quantize_weight("w13.weight", torch.cat([w1, w3], 1), "fp8-block-128")
    del w1, w3
    w2 = quantize_weight("w2.weight", torch.randn(E, K, I, generator=g, device=DEV) * I ** -0.5, "fp8-block-128")
    return cfg, w13, w2


def _routing(M, E, k, g, same=False):
    ids = torch.randn(1 if same else M, E, generator=g, device=DEV).topk(k, dim=-1).indices.expand(M, k).contiguous()
    w = torch.rand(M, k, generator=g, device=DEV) + 0.05
    return (w / w.sum(-1, keepdim=True)).contiguous(), ids


def _rel(y, ref):
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("M,same", [(1, False), (3, False), (8, False), (13, True), (64, False)])
def test_fp8_experts_match_the_reference(model, impl, M, same):
    experts_fp8, tol = IMPLS[impl]
    cfg, w13, w2 = model
    g = seeded_generator(f"fp8-experts-{M}-{same}")
    x = torch.randn(M, cfg["K"], generator=g, device=DEV).bfloat16()
    w, ids = _routing(M, cfg["E"], cfg["k"], g, same)
    out = torch.full((M, cfg["K"]), float("nan"), device=DEV, dtype=torch.bfloat16)
    y = experts_fp8(x, w, ids, w13, w2, SWIGLU, out=out)
    assert y.data_ptr() == out.data_ptr() and torch.isfinite(y).all()
    assert _rel(y, experts_reference(x, w, ids, w13, w2, SWIGLU)) < tol
    x2 = torch.randn_like(x)
    eager = experts_fp8(x2, w, ids, w13, w2, SWIGLU)
    xs = x.clone()
    graph = graph_replay(lambda: experts_fp8(xs, w, ids, w13, w2, SWIGLU, out=out))
    xs.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_fp8_experts_per_route_rows(model):

    cfg, w13, w2 = model
    g = seeded_generator("fp8-route")
    x = torch.randn(5, cfg["K"], generator=g, device=DEV).bfloat16()
    w, ids = _routing(5, cfg["E"], cfg["k"], g)
    rows = torch.full((5, cfg["k"], cfg["K"]), float("nan"), device=DEV, dtype=torch.bfloat16)
    experts_fp8(x, None, ids, w13, w2, SWIGLU, per_route=True, out=rows)
    assert torch.isfinite(rows).all()
    ref = experts_reference(x, w, ids, w13, w2, SWIGLU, per_route=True)
    assert _rel(rows, ref) < REL_TOL


def test_fp8_expert_decoding_of_every_code_is_exact():
    """One expert whose rows hold every finite e4m3 code under fp32 block scales 1e-30 .. 6.5e30, read back through
    the experts' GEMM (``moe_gemm_fp8`` with one-hot token rows, fp32 output): equal to the codec's values."""
    from latency_specialized.kernels import triton_fp8 as k
    from latency_specialized.kernels.moe_experts_triton import align_buffers
    from latency_specialized.kernels.triton_moe import moe_align
    from latency_specialized.quant.checkpoint_io import QuantizedWeight
    from latency_specialized.quant.formats import QuantFormat

    f = QuantFormat.get("fp8-block-128")
    codes = torch.arange(256, device=DEV, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    N, K = 512, 128
    wq = codes.repeat(N * K // codes.numel() + 1)[: N * K].view(1, N, K).contiguous()
    scale = torch.tensor([1e-30, 3.7e-3, 1.0, 6.5e30], device=DEV).view(1, 4, 1)
    q = QuantizedWeight(f, (1, N, K), wq.view(torch.float8_e4m3fn), scale, name="edge.weight")
    ref = q.dequantize()[0]  # [N, K]
    got = torch.empty(N, K, device=DEV)
    eye = torch.eye(K, device=DEV, dtype=torch.bfloat16)
    for i in range(0, K, 64):  # 64 one-hot tokens, all routed to expert 0: y[m, n] = W[n, i + m]
        ids = torch.zeros(64, 1, dtype=torch.int32, device=DEV)
        align = align_buffers(64, 1, torch.device(DEV))
        moe_align(ids, align)
        y = torch.empty(64, N, device=DEV, dtype=torch.float32)
        k.moe_gemm_fp8(eye[i:i + 64].contiguous(), q.weight, q.scale, align, 1, out=y, a_per_pair=False,
                       scale_block=(128, 128))
        got[:, i:i + 64] = y.t()
    finite = torch.isfinite(ref)
    assert torch.equal(got[finite], ref[finite])
