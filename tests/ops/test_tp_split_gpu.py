"""GPU tests of this round's decode changes: Triton fused-MoE experts for many tokens, fp32 router
logits from bf16 weights (cuBLAS out_dtype), the all-reduce writing the residual in place, and the
TP-split router + latent projection in one all-gather (bench communicator).

Fresh random inputs, NaN-poisoned outputs checked fully written, per-dtype tolerances against the
references, graph replay == eager. Run on the H200: ``pytest -m gpu tests/ops/test_tp_split_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.ops.allreduce import allreduce_residual_rmsnorm_reference
from latency_specialized.ops.gemm import gemm_reference, gemm_torch
from latency_specialized.ops.moe import experts_reference
from latency_specialized.spec import ActivationSpec

from gpu_helpers import graph_replay as _graph_replay, random_experts, seeded_generator as _gen

pytestmark = pytest.mark.gpu

DEV = "cuda"
SITU = ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)


def _routing(M, E, k, g):
    ids = torch.rand(M, E, generator=g, device=DEV).topk(k, dim=-1).indices
    w = torch.rand(M, k, generator=g, device=DEV) + 0.05
    return w / w.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("M,E,K,I,N,k", [(8, 896, 3584, 384, 3584, 16), (64, 896, 3584, 384, 3584, 16),
                                         (13, 37, 512, 136, 200, 3), (64, 8, 256, 64, 128, 4)])
def test_triton_experts_match_reference_and_replay(M, E, K, I, N, k):
    from latency_specialized.kernels.moe_experts_triton import experts_triton

    g = _gen(f"triton-experts-{M}-{E}")
    w13, w2 = random_experts(E, 2 * I, K, g), random_experts(E, N, I, g)
    x = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    w, ids = _routing(M, E, k, g)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    experts_triton(x, w, ids, w13, w2, SITU, out=out)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "experts left outputs unwritten"
    ref = experts_reference(x, w, ids, w13, w2, SITU)
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * scale)
    replay = torch.full_like(out, float("nan"))
    graph = _graph_replay(lambda: experts_triton(x, w, ids, w13, w2, SITU, out=replay))
    assert torch.equal(replay, out)
    # new routing in the same static tensors is picked up by the replay (no host state)
    w2_, ids2 = _routing(M, E, k, g)
    w.copy_(w2_)
    ids.copy_(ids2)
    replay.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref2 = experts_reference(x, w, ids, w13, w2, SITU)
    torch.testing.assert_close(replay.float(), ref2.float(), rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("impl,M,N", [("cublas", 1, 112), ("cublas", 8, 112), ("cublas", 64, 112),
                                      ("gemv", 1, 112), ("gemv", 2, 56), ("gemv", 1, 37)])
def test_router_logits_fp32_from_bf16_weights(impl, M, N):
    from latency_specialized.kernels.gemm_gemv import gemm_gemv

    g = _gen(f"router-gemm-{impl}-{M}-{N}")
    x = torch.randn(M, 7168, generator=g, device=DEV).bfloat16()
    w = (torch.randn(N, 7168, generator=g, device=DEV) * 7168 ** -0.5).bfloat16()
    if impl == "gemv":
        out = torch.full((M, N), float("nan"), device=DEV)
        assert gemm_gemv(x, w, out=out, out_dtype=torch.float32) is out
        replay = torch.full_like(out, float("nan"))
        _graph_replay(lambda: gemm_gemv(x, w, out=replay, out_dtype=torch.float32))
        assert torch.equal(replay, out)
    else:
        out = gemm_torch(x, w, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and out.shape == (M, N) and not out.isnan().any()
    ref = gemm_reference(x, w, out_dtype=torch.float32)
    # same products (exact in fp32), different summation order: fp32-level agreement, far below bf16's step
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert (out.bfloat16().float() - out).abs().max() > 0  # really fp32, not bf16 values widened


@pytest.mark.parametrize("M,with_norm", [(1, False), (8, True), (64, False)])
def test_local_allreduce_writes_the_residual_in_place(M, with_norm):
    from latency_specialized.kernels.rmsnorm import allreduce_residual_rmsnorm_local

    g = _gen(f"ar-inplace-{M}-{with_norm}")
    partial = torch.randn(M, 7168, generator=g, device=DEV).bfloat16()
    residual = torch.randn(M, 7168, generator=g, device=DEV).bfloat16()
    weight = (1 + 0.1 * torch.randn(7168, generator=g, device=DEV)).bfloat16() if with_norm else None
    ref_y, ref_h = allreduce_residual_rmsnorm_reference(partial, residual.clone(), weight, 1e-6)
    normed = torch.full_like(partial, float("nan")) if with_norm else None
    y, h = allreduce_residual_rmsnorm_local(partial, residual, weight, 1e-6, out=(normed, residual))
    torch.cuda.synchronize()
    assert h.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(residual.float(), ref_h.float(), rtol=0, atol=0)  # one rounding, same bits
    if with_norm:
        assert y.data_ptr() == normed.data_ptr() and not torch.isnan(normed).any()
        torch.testing.assert_close(y.float(), ref_y.float(), rtol=1.6e-2, atol=1.6e-2)


def test_split_router_gather_with_excluded_communicator_keeps_rank_slice_and_stand_ins():
    from latency_specialized.comm.base import ExcludedCommunicator
    from latency_specialized.ops.tp_moe import gather_parts

    comm = ExcludedCommunicator(8)
    g = _gen("gather")
    logits = torch.randn(4, 112, generator=g, device=DEV)
    latent = torch.randn(4, 448, generator=g, device=DEV).bfloat16()
    full_logits, full_latent = gather_parts(comm, [logits, latent])
    assert full_logits.shape == (4, 896) and full_logits.dtype == torch.float32
    assert full_latent.shape == (4, 3584) and full_latent.dtype == torch.bfloat16
    assert torch.equal(full_logits[:, :112], logits) and torch.equal(full_latent[:, :448], latent)
    assert torch.isfinite(full_logits).all() and torch.isfinite(full_latent.float()).all()
    stand_in = full_logits[:, 112:].clone()
    logits.add_(1.0)
    again, _ = gather_parts(comm, [logits, latent])
    assert again.data_ptr() == full_logits.data_ptr()  # static buffer: graph-capturable
    assert torch.equal(again[:, :112], logits) and torch.equal(again[:, 112:], stand_in)


@pytest.mark.parametrize("M", [1, 4, 16])
@pytest.mark.parametrize("split", [1, 2, 4, 8])
def test_router_split_warps_match_reference_with_ties(M, split):
    from latency_specialized.kernels.moe_router import route
    from latency_specialized.ops.moe import route_reference
    from latency_specialized.spec import RouterSpec

    g = _gen(f"router-split-{M}-{split}")
    router = RouterSpec(score_func="sigmoid")
    E, k = 896, 16
    for logits in (torch.randn(M, E, generator=g, device=DEV) * 2,
                   torch.randint(0, 4, (M, E), generator=g, device=DEV).float() * 0.25):  # many exact ties
        bias = torch.randn(E, generator=g, device=DEV) * 0.1
        w = torch.full((M, k), float("nan"), device=DEV)
        ids = torch.full((M, k), -1, dtype=torch.int64, device=DEV)
        route(logits, bias, k, router, out_weights=w, out_ids=ids, split=split)
        torch.cuda.synchronize()
        rw, rids = route_reference(logits, bias, k, router)
        assert torch.equal(ids, rids), f"split={split}: ids differ\n{ids}\n{rids}"
        torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
        replay_w, replay_ids = torch.full_like(w, float("nan")), torch.full_like(ids, -1)
        _graph_replay(lambda: route(logits, bias, k, router, out_weights=replay_w, out_ids=replay_ids, split=split))
        assert torch.equal(replay_ids, ids) and torch.equal(replay_w, w)


@pytest.mark.parametrize("kernel,M", [("gemv", 1), ("gemv", 3), ("small_m", 8), ("splitk", 16), ("splitk", 64)])
def test_gemm_kernels_add_into_a_strided_column_slice_in_place(kernel, M):
    """The latent up-projection of rank r adds into columns r*H/tp.. of the shared experts' output."""
    from latency_specialized.kernels import gemm_gemv, gemm_small_m, gemm_splitk

    fn = {"gemv": gemm_gemv.gemm_gemv, "small_m": gemm_small_m.gemm_small_m, "splitk": gemm_splitk.gemm_splitk}[kernel]
    g = _gen(f"strided-{kernel}-{M}")
    N, K = 896, 3584
    x = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    w = (torch.randn(N, K, generator=g, device=DEV) * K ** -0.5).bfloat16()
    wide = torch.randn(M, 8 * N, generator=g, device=DEV).bfloat16()
    before = wide.clone()
    part = wide[:, 3 * N:4 * N]
    assert not part.is_contiguous() or M == 1
    ref = gemm_reference(x, w, residual=part.clone())
    assert fn(x, w, residual=part, out=part) is part
    torch.cuda.synchronize()
    torch.testing.assert_close(part.float(), ref.float(), rtol=1.6e-2, atol=1.6e-2)
    others = torch.cat([wide[:, :3 * N], wide[:, 4 * N:]], dim=1)
    assert torch.equal(others, torch.cat([before[:, :3 * N], before[:, 4 * N:]], dim=1))  # nothing else written
    # replay in a graph from the same starting values gives the same bits
    wide.copy_(before)
    fn(x, w, residual=part, out=part)
    eager = part.clone()
    wide.copy_(before)
    graph = _graph_replay(lambda: fn(x, w, residual=part, out=part))  # warm-up + capture + 1 replay: 2 adds
    wide.copy_(before)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(part, eager)
