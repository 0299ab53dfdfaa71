"""GPU: attention.qk_norm_rope.triton and residual.gated.triton against their references at Muse Spark /
Qwen3 TP8 rank shapes (bf16 and fp32), NaN-poisoned outputs, CUDA-graph replay equal to eager with
fresh inputs copied in between replays."""

from __future__ import annotations

import pytest
import torch

from latency_specialized.ops.attention.qk_norm_rope import qk_norm_rope_reference
from latency_specialized.ops.residual_gated import gated_join_reference
from latency_specialized.ops.rope import rope_inv_freq

pytestmark = pytest.mark.gpu
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _qkv(M, H, KV, D, dtype, g):
    wide = torch.randn(M, (2 * H + 2 * KV) * D, device="cuda", generator=g) * 3   # q | k | v | gate
    return wide.to(dtype)


@pytest.mark.parametrize("M", [1, 3, 64])
@pytest.mark.parametrize("H,KV,D,weighted,theta", [(16, 2, 64, False, 5e5), (16, 2, 64, False, None),
                                                    (4, 1, 128, True, 1e6)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qk_norm_rope_kernel_matches_reference_and_replays(M, H, KV, D, weighted, theta, dtype):
    from latency_specialized.kernels.qk_norm_rope_triton import qk_norm_rope_triton

    g = torch.Generator(device="cuda").manual_seed(M * 100 + D)
    qkv = _qkv(M, H, KV, D, dtype, g)
    w = dict(q_weight=(torch.rand(D, device="cuda", generator=g) + 0.5).to(dtype),
             k_weight=(torch.rand(D, device="cuda", generator=g) + 0.5).to(dtype)) if weighted else {}
    pos = torch.randint(0, 40000, (M,), device="cuda", generator=g)
    inv = rope_inv_freq(theta, D, device="cuda") if theta else None
    q, k = qk_norm_rope_triton(qkv, H, KV, D, 1e-5, positions=pos, inv_freq=inv, **w)
    rq, rk = qk_norm_rope_reference(qkv, H, KV, D, 1e-5, positions=pos, inv_freq=inv, **w)
    torch.testing.assert_close(q, rq, **TOL[dtype])
    torch.testing.assert_close(k, rk, **TOL[dtype])
    out = {}

    def step():
        out["q"], out["k"] = qk_norm_rope_triton(qkv, H, KV, D, 1e-5, positions=pos, inv_freq=inv, **w)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    qkv.copy_(_qkv(M, H, KV, D, dtype, g))
    pos.copy_(torch.randint(0, 40000, (M,), device="cuda", generator=g))
    out["q"].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eq, ek = qk_norm_rope_triton(qkv, H, KV, D, 1e-5, positions=pos, inv_freq=inv, **w)
    assert torch.equal(out["q"], eq) and torch.equal(out["k"], ek)


@pytest.mark.parametrize("M", [1, 8, 64])
@pytest.mark.parametrize("post,gated", [("weightless", True), ("input_scaled", True), ("none", False),
                                        ("weighted", True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_join_kernel_matches_reference(M, post, gated, dtype):
    from latency_specialized.kernels.residual_gated_triton import gated_join_triton

    N = 8192
    g = torch.Generator(device="cuda").manual_seed(M + N)
    y = (torch.randn(M, N, device="cuda", generator=g) * 2).to(dtype)
    stream = torch.randn(M, N, device="cuda", generator=g)   # fp32 stream (Muse)
    w = (0.2 * torch.randn(N, device="cuda", generator=g)).to(dtype)
    kw = dict(post=post, post_eps=1e-8, post_zero_centered=True, zero_centered=True)
    if post in ("weighted", "input_scaled"):
        kw["post_weight"] = (0.2 * torch.randn(N, device="cuda", generator=g)).to(dtype)
    if gated:
        kw["gate"] = torch.randn(N, device="cuda", generator=g)
    ref_stream = stream.clone()
    out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
    x, _ = gated_join_triton(y, stream, w, 1e-5, out=out, **kw)
    rx, rs = gated_join_reference(y, ref_stream, w, 1e-5, **kw)
    torch.testing.assert_close(stream, rs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x, rx, **TOL[dtype])
