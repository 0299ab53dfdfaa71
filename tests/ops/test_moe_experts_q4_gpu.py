"""GPU tests of the 4-bit routed experts (``moe.experts.q4_gemv_triton`` / ``q4_grouped_triton``).

Shapes: Kimi K3 at TP8 (896 experts, top-16, latent K = N = 3584, expert width 384, SiTU-GLU) in MXFP4, and
Muse Spark at TP8 (256 experts, top-8, 4096, width 512, SwiGLU) in NVFP4; odd tokens (1, 3, 7, 8, 13, 64),
the same experts for every token (each expert serves many pairs), per-route results.

Every case: fresh random codes and scales, outputs poisoned with NaN and checked fully written, compared with
the dequantising reference (``ops.moe.experts_reference`` over ``QuantizedWeight``; on the routed experts
only) at bf16 tolerances; CUDA-graph replay equals eager bit for bit. Edge codes and scales are checked on the
decoding itself (every e2m1 code under ue8m0 0 / 1 / 127 / 240 and e4m3 subnormal / max scales).
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.bench.ops_bench_q4 import random_q4_experts
from latency_specialized.kernels import moe_experts_q4_triton as q4
from latency_specialized.ops.moe import experts_reference
from latency_specialized.spec import ActivationSpec

from gpu_helpers import graph_replay, seeded_generator

pytestmark = pytest.mark.gpu

DEV = "cuda"
SITU = ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)
SWIGLU = ActivationSpec(kind="swiglu")
KIMI = dict(E=896, k=16, K=3584, I=384, fmt="mxfp4", act=SITU)
MUSE = dict(E=256, k=8, K=4096, I=512, fmt="nvfp4", act=SWIGLU)
IMPLS = {"gemv": q4.experts_q4_gemv, "grouped": q4.experts_q4_grouped}
REL_TOL = 1.5e-2
"""Max |ours - reference| over max |reference|: a few bf16 roundings of the gate/up, activation and route
outputs (the reference rounds at the same points; the sums run in another order)."""


@pytest.fixture(scope="module", params=["kimi_mxfp4", "muse_nvfp4"])
def model(request):
    cfg = KIMI if request.param == "kimi_mxfp4" else MUSE
    g = seeded_generator(request.param)
    w13 = random_q4_experts(cfg["E"], 2 * cfg["I"], cfg["K"], cfg["fmt"], g)
    w2 = random_q4_experts(cfg["E"], cfg["K"], cfg["I"], cfg["fmt"], g)
    return cfg, w13, w2


def _routing(M, E, k, g, same=False):
    logits = torch.randn(1 if same else M, E, generator=g, device=DEV)
    ids = logits.topk(k, dim=-1).indices.expand(M, k).contiguous()
    w = torch.rand(M, k, generator=g, device=DEV) + 0.05
    return (w / w.sum(-1, keepdim=True)).contiguous(), ids


def _rel(y, ref):
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("M,same", [(1, False), (3, False), (7, True), (8, False), (13, False), (64, False)])
def test_q4_experts_match_the_dequantising_reference(model, impl, M, same):
    cfg, w13, w2 = model
    g = seeded_generator(f"q4-{impl}-{M}-{same}")
    x = torch.randn(M, cfg["K"], generator=g, device=DEV).bfloat16()
    w, ids = _routing(M, cfg["E"], cfg["k"], g, same)
    ref = experts_reference(x, w, ids, w13, w2, cfg["act"])
    out = torch.full((M, cfg["K"]), float("nan"), device=DEV, dtype=torch.bfloat16)
    y = IMPLS[impl](x, w, ids, w13, w2, cfg["act"], out=out)
    assert y.data_ptr() == out.data_ptr() and torch.isfinite(y).all()
    assert _rel(y, ref) < REL_TOL
    # graph replay == eager, bit for bit
    x2 = torch.randn_like(x)
    eager = IMPLS[impl](x2, w, ids, w13, w2, cfg["act"])
    xs = x.clone()
    out.fill_(float("nan"))
    graph_replay(lambda: IMPLS[impl](xs, w, ids, w13, w2, cfg["act"], out=out))
    xs.copy_(x2)
    graph = graph_replay(lambda: IMPLS[impl](xs, w, ids, w13, w2, cfg["act"], out=out))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("M", [1, 9])
def test_q4_experts_per_route_rows(model, impl, M):
    cfg, w13, w2 = model
    g = seeded_generator(f"q4-route-{impl}-{M}")
    x = torch.randn(M, cfg["K"], generator=g, device=DEV).bfloat16()
    w, ids = _routing(M, cfg["E"], cfg["k"], g)
    out = torch.full((M, cfg["k"], cfg["K"]), float("nan"), device=DEV, dtype=torch.bfloat16)
    y = IMPLS[impl](x, None, ids, w13, w2, cfg["act"], per_route=True, out=out)
    assert torch.isfinite(y).all()

    ref = experts_reference(x, w, ids, w13, w2, cfg["act"], per_route=True)
    assert _rel(y, ref) < REL_TOL


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("M", [1, 8, 64])
def test_q4_experts_take_the_paired_layout(model, impl, M):
    """The weights rearranged once into the paired layout (``quant.layout.paired_nibbles``, the mma kernel's
    decode): within the tolerance of the dequantising reference; the gemv path gives the checkpoint packing's bits
    (same values, same order), the grouped path sums its K steps in another order; graph replay == eager."""
    from latency_specialized.quant.layout import paired_nibbles

    cfg, w13, w2 = model
    p13, p2 = paired_nibbles(w13), paired_nibbles(w2)
    g = seeded_generator(f"q4-paired-{impl}-{M}")
    x = torch.randn(M, cfg["K"], generator=g, device=DEV).bfloat16()
    w, ids = _routing(M, cfg["E"], cfg["k"], g)
    out = torch.full((M, cfg["K"]), float("nan"), device=DEV, dtype=torch.bfloat16)
    y = IMPLS[impl](x, w, ids, p13, p2, cfg["act"], out=out)
    assert torch.isfinite(y).all()
    assert _rel(y, experts_reference(x, w, ids, w13, w2, cfg["act"])) < REL_TOL
    if impl == "gemv":
        assert torch.equal(y, IMPLS[impl](x, w, ids, w13, w2, cfg["act"]))
    eager = y.clone()
    out.fill_(float("nan"))
    graph = graph_replay(lambda: IMPLS[impl](x, w, ids, p13, p2, cfg["act"], out=out))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_q4_decoding_edge_codes_and_scales_exact(fmt):
    """Every e2m1 code (+-0, subnormal 0.5, max 6) under extreme scales: the kernel's dequantised weight equals
    the codec's exactly (one expert, one route, identity-like activations read back through gate/up)."""
    from latency_specialized.kernels import triton_q4 as k
    from latency_specialized.quant.checkpoint_io import QuantizedWeight
    from latency_specialized.quant.codecs import as_bytes
    from latency_specialized.quant.formats import QuantFormat

    f = QuantFormat.get(fmt)
    group = f.block[1]
    codes = torch.arange(256, device=DEV, dtype=torch.uint8).view(1, 8, 32)  # every byte: all code pairs
    if fmt == "mxfp4":
        sc = torch.tensor([0, 1, 127, 240, 100, 113, 200, 2], device=DEV, dtype=torch.uint8)
    else:
        sc = torch.tensor([0x01, 0x07, 0x08, 0x7E, 0x38, 0x40, 0x10, 0x30], device=DEV, dtype=torch.uint8)
    scale = sc.view(1, 8, 1).expand(1, 8, 64 // group).contiguous()
    gs = torch.tensor([1.0], device=DEV) if fmt == "nvfp4" else None
    w = QuantizedWeight(f, (1, 8, 64), codes, scale if fmt == "mxfp4" else scale.view(torch.float8_e4m3fn), gs)
    out = torch.full((1, 8, 64), float("nan"), device=DEV)
    k.dequantize_q4(as_bytes(w.weight), as_bytes(w.scale), gs if gs is not None else codes, out,
                    scale_kind=k.SCALE_UE8M0 if fmt == "mxfp4" else k.SCALE_E4M3, group=group)
    ref = w.dequantize()
    bad = (out != ref).nonzero().tolist()
    assert not bad, f"{len(bad)} mismatches, first {[(i, float(out[tuple(i)]), float(ref[tuple(i)])) for i in bad[:4]]}"


def test_q4_large_ue8m0_scale_is_refused_with_the_fix():
    from latency_specialized.errors import UserError
    from latency_specialized.quant.checkpoint_io import QuantizedWeight
    from latency_specialized.quant.formats import MXFP4

    codes = torch.zeros(2, 64, 64, device=DEV, dtype=torch.uint8)
    scale = torch.full((2, 64, 4), 241, device=DEV, dtype=torch.uint8)
    w13 = QuantizedWeight(MXFP4, (2, 64, 128), codes, scale)
    w2 = QuantizedWeight(MXFP4, (2, 128, 32), torch.zeros(2, 128, 16, device=DEV, dtype=torch.uint8),
                         torch.full((2, 128, 1), 120, device=DEV, dtype=torch.uint8))
    x = torch.randn(1, 128, device=DEV).bfloat16()
    with pytest.raises(UserError, match="requantize"):
        q4.experts_q4_gemv(x, torch.ones(1, 1, device=DEV), torch.zeros(1, 1, dtype=torch.int32, device=DEV),
                           w13, w2, SWIGLU)
