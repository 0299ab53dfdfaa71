"""GPU tests of the MXFP4 routed experts on the mma.sync kernel (``moe.experts.mma``).

Shapes: Kimi K3 at TP8 (896 experts, top-16, K = N = 3584, expert width 384, SiTU-GLU), a DeepSeek-V4.1-like
one in mxfp4-deepseek (256 experts, top-6, 4096, width 256, SwiGLU clamped) and Muse Spark at TP8 in NVFP4 (256
experts, top-8, 4096, width 512: e4m3 scales per 16, a global scale per expert), GLM-5.3 at TP8 in block FP8 (64 of
its 256 experts, top-8, 6144, width 256, 128 x 128 fp32 scales); tokens 1, 3, 8, 13 (single routes),
16, 33, 64 (``moe_align`` runs), the same experts for every token (one expert, many pairs), int64 ids; per-route
rows and the weighted combination (``down_sum`` at single routes: a warp per route, or 4 warps taking turns); the
heuristic configs and 2 / 4 warps along K with PDL on.

Every case: fresh random codes and scales, NaN-poisoned outputs checked fully written, against the dequantising
reference on the routed experts only at bf16 tolerance; deterministic; CUDA-graph replay equals eager bit for bit.
The CPU suite runs the same kernels' PTX in an emulator (``test_moe_experts_mma.py``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from latency_specialized.bench.ops_bench_q4 import random_q4_experts
from latency_specialized.kernels import moe_experts_mma as mm
from latency_specialized.ops.moe import experts_reference
from latency_specialized.spec import ActivationSpec

from gpu_helpers import graph_replay, seeded_generator

pytestmark = pytest.mark.gpu

DEV = "cuda"
SITU = ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)
SWIGLU = ActivationSpec(kind="swiglu", clamp=7.0)
MODELS = {"kimi_tp8": dict(E=896, k=16, K=3584, I=384, fmt="mxfp4", act=SITU),
          "dsv4_like": dict(E=256, k=6, K=4096, I=256, fmt="mxfp4-deepseek", act=SWIGLU),
          "muse_tp8_nvfp4": dict(E=256, k=8, K=4096, I=512, fmt="nvfp4", act=SWIGLU),
          "glm_tp8_fp8": dict(E=64, k=8, K=6144, I=256, fmt="fp8-block-128", act=SWIGLU)}
REL_TOL = 1.5e-2
"""Max |ours - reference| over max |reference| (as the Triton 4-bit experts' tests): the reference rounds at the
same points; sums in another order can move a value across a bf16 rounding boundary."""


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    cfg = MODELS[request.param]
    g = seeded_generator(request.param)
    if cfg["fmt"].startswith("fp8"):  # random block-FP8 experts, quantized by the codec (64 of GLM-5.3's 256)
        from latency_specialized.quant.checkpoint_io import quantize_weight

        def fp8(E, N, K):
            return quantize_weight("experts.w", torch.randn(E, N, K, generator=g, device=DEV) * K ** -0.5, cfg["fmt"])

        return cfg, fp8(cfg["E"], 2 * cfg["I"], cfg["K"]), fp8(cfg["E"], cfg["K"], cfg["I"])
    w13 = random_q4_experts(cfg["E"], 2 * cfg["I"], cfg["K"], cfg["fmt"], g)
    w2 = random_q4_experts(cfg["E"], cfg["K"], cfg["I"], cfg["fmt"], g)
    return cfg, w13, w2


def _routing(M, E, k, g, same=False, ids_dtype=torch.int32):
    logits = torch.randn(1 if same else M, E, generator=g, device=DEV)
    ids = logits.topk(k, dim=-1).indices.expand(M, k).contiguous().to(ids_dtype)
    w = torch.rand(M, k, generator=g, device=DEV) + 0.05
    return (w / w.sum(-1, keepdim=True)).contiguous(), ids


def _chunk(cfg) -> int:
    """K per 64-byte chunk of a weight row: 128 for 4-bit codes, 64 for FP8."""
    return 64 if cfg["fmt"].startswith("fp8") else 128


def _rel(y, ref):
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize("M,same,ids64", [(1, False, False), (3, False, True), (8, True, False), (13, False, False),
                                          (16, False, False), (33, True, True), (64, False, False)])
def test_mma_experts_match_the_dequantising_reference(model, M, same, ids64):
    cfg, w13, w2 = model
    g = seeded_generator(f"mma-{M}-{same}-{ids64}")
    x = torch.randn(M, cfg["K"], generator=g, device=DEV).bfloat16()
    w, ids = _routing(M, cfg["E"], cfg["k"], g, same, torch.int64 if ids64 else torch.int32)
    ref = experts_reference(x, w, ids, w13, w2, cfg["act"])
    y = torch.full((M, cfg["K"]), float("nan"), device=DEV, dtype=torch.bfloat16)
    mm.experts_mma(x, w, ids, w13, w2, cfg["act"], out=y)
    assert torch.isfinite(y).all() and _rel(y, ref) <= REL_TOL, _rel(y, ref)
    assert torch.equal(mm.experts_mma(x, w, ids, w13, w2, cfg["act"]), y)  # deterministic
    # both group modes at the same step agree with the reference
    other = mm.experts_mma(x, w, ids, w13, w2, cfg["act"], aligned=M < mm.MIN_TOKENS_ALIGNED)
    assert _rel(other, ref) <= REL_TOL
    if M < mm.MIN_TOKENS_ALIGNED:  # down_sum with several routes per warp, PDL on
        c13, c2 = mm.default_configs(M, cfg["k"], cfg["E"], cfg["K"], cfg["I"], cfg["K"], False, chunk=_chunk(cfg))
        y4 = mm.experts_mma(x, w, ids, w13, w2, cfg["act"],
                                  configs=(replace(c13, pdl=True), replace(c2, wk=4, pdl=True)))
        assert _rel(y4, ref) <= REL_TOL


@pytest.mark.parametrize("M", [1, 16])
def test_mma_experts_per_route_rows_and_configs(model, M):
    cfg, w13, w2 = model
    g = seeded_generator(f"mma-rows-{M}")
    x = torch.randn(M, cfg["K"], generator=g, device=DEV).bfloat16()
    _, ids = _routing(M, cfg["E"], cfg["k"], g)
    ref = experts_reference(x, None, ids, w13, w2, cfg["act"], per_route=True)
    base13, base2 = mm.default_configs(M, cfg["k"], cfg["E"], cfg["K"], cfg["I"], cfg["K"],
                                       M >= mm.MIN_TOKENS_ALIGNED, per_route=True, chunk=_chunk(cfg))
    for configs in (None, (replace(base13, wk=2, cb=2, pdl=True), replace(base2, wk=2, cb=1, pdl=True)),
                    (replace(base13, wk=4), replace(base2, mt=2))):
        rows = torch.full((M, cfg["k"], cfg["K"]), float("nan"), device=DEV, dtype=torch.bfloat16)
        mm.experts_mma(x, None, ids, w13, w2, cfg["act"], per_route=True, out=rows, configs=configs)
        assert torch.isfinite(rows).all() and _rel(rows, ref) <= REL_TOL, (configs, _rel(rows, ref))


@pytest.mark.parametrize("M", [1, 3, 64])
def test_mma_experts_graph_replay_equals_eager(model, M):
    cfg, w13, w2 = model
    g = seeded_generator(f"mma-graph-{M}")
    x = torch.randn(M, cfg["K"], generator=g, device=DEV).bfloat16()
    w, ids = _routing(M, cfg["E"], cfg["k"], g)
    x2 = torch.randn_like(x)
    w2_, ids2 = _routing(M, cfg["E"], cfg["k"], g)
    eager = mm.experts_mma(x2, w2_, ids2, w13, w2, cfg["act"])
    xs, ws, iss = x.clone(), w.clone(), ids.clone()
    out = torch.full((M, cfg["K"]), float("nan"), device=DEV, dtype=torch.bfloat16)
    graph = graph_replay(lambda: mm.experts_mma(xs, ws, iss, w13, w2, cfg["act"], out=out))
    xs.copy_(x2)
    ws.copy_(w2_)
    iss.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("M", [1, 8, 64])
def test_mma_experts_paired_weights_equal_the_checkpoint_packing(model, M):
    """The 4-bit weights rearranged into the paired-nibble layout (``quant.layout.paired_nibbles``, decoded by
    ``ptx.e2m1x8_paired_to_bf16x2``) give bit-identical outputs to the checkpoint packing: the same values, the same
    roundings, only the decode's instructions differ. Block FP8 weights: refused by the layout."""
    from latency_specialized.errors import UserError
    from latency_specialized.quant.layout import paired_nibbles

    cfg, w13, w2 = model
    if cfg["fmt"].startswith("fp8"):   # block FP8 has no e2m1 codes to rearrange: refused, not mis-decoded
        with pytest.raises(UserError, match="not that"):
            paired_nibbles(w13)
        return
    p13, p2 = paired_nibbles(w13), paired_nibbles(w2)
    g = seeded_generator(f"mma-paired-{M}")
    x = torch.randn(M, cfg["K"], generator=g, device=DEV).bfloat16()
    w, ids = _routing(M, cfg["E"], cfg["k"], g)
    want = mm.experts_mma(x, w, ids, w13, w2, cfg["act"])
    got = torch.full_like(want, float("nan"))
    mm.experts_mma(x, w, ids, p13, p2, cfg["act"], out=got)
    assert torch.equal(got, want)
