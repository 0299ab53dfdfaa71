"""attention.qk_norm_rope and residual.gated: the Triton kernels against their references on the CPU
(Triton interpreter, fp32: the interpreter's bf16 is unreliable on this CPU, see test_mla_triton.py),
with fresh random inputs, NaN-poisoned outputs, odd shapes and strided rows; plus the references
against a direct transformers-style composition."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from latency_specialized.ops.attention.qk_norm_rope import qk_norm_rope_reference
from latency_specialized.ops.residual_gated import gated_join_reference
from latency_specialized.ops.rope import apply_rope, rope_inv_freq
from tests.interpret import run_interpreted

interpreted = pytest.mark.interpreter_case
_HAVE_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.interpreter_driver
@pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (its interpreter runs the kernels on the CPU)")
def test_kernel_cases_under_the_interpreter():
    run_interpreted(__file__, min_passed=14)


def _qkv(M: int, H: int, KV: int, D: int, extra: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(M, (H + 2 * KV) * D + extra, generator=g) * 3.0
    return wide[:, : (H + 2 * KV) * D]  # strided rows: a column slice of a wider tensor


def test_reference_is_norm_then_rope():
    """Unfused: per-head rmsnorm (weighted) then rope, each in fp32 (what the GQA piece's sites do)."""
    M, H, KV, D = 3, 4, 2, 16
    qkv = _qkv(M, H, KV, D, 8, 0)
    wq, wk = torch.rand(D) + 0.5, torch.rand(D) + 0.5
    pos, inv = torch.tensor([0, 5, 1000]), rope_inv_freq(1e4, D)
    q, k = qk_norm_rope_reference(qkv, H, KV, D, 1e-6, q_weight=wq, k_weight=wk, positions=pos, inv_freq=inv)
    def direct(x, w):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        return apply_rope(x, pos, inv, "neox")
    torch.testing.assert_close(q, direct(qkv[:, : H * D].reshape(M, H, D), wq), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, direct(qkv[:, H * D:(H + KV) * D].reshape(M, KV, D), wk), rtol=1e-6, atol=1e-6)


@interpreted
@pytest.mark.parametrize("M,H,KV,D", [(1, 4, 2, 16), (3, 8, 1, 64), (5, 2, 2, 8)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("style", ["neox", "interleaved", None])
def test_qk_norm_rope_kernel(M, H, KV, D, weighted, style):
    from latency_specialized.kernels.qk_norm_rope_triton import qk_norm_rope_triton

    qkv = _qkv(M, H, KV, D, 24, M * 7 + D)
    wq, wk = (torch.rand(D) + 0.5, torch.rand(D) + 0.5) if weighted else (None, None)
    pos = torch.randint(0, 5000, (M,))
    inv = rope_inv_freq(5e5, D) if style else None
    kw = dict(q_weight=wq, k_weight=wk, positions=pos, inv_freq=inv, style=style or "neox")
    q, k = qk_norm_rope_triton(qkv, H, KV, D, 1e-5, **kw)
    rq, rk = qk_norm_rope_reference(qkv, H, KV, D, 1e-5, **kw)
    torch.testing.assert_close(q, rq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)


def _join_args(M: int, N: int, seed: int, post: str, gated: bool, scalar: bool):
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(M, N + 5, generator=g) * 2)[:, :N]   # strided rows
    stream = torch.randn(M, N, generator=g)
    kw = dict(post=post, post_eps=1e-8, post_zero_centered=True, zero_centered=True, gate_temperature=0.3,
              gate_eps=1e-3)
    if post in ("weighted", "input_scaled"):
        kw["post_weight"] = 0.2 * torch.randn(N, generator=g)
    if gated:
        kw["gate"] = torch.randn(1 if scalar else N, generator=g)
    return y, stream, 0.2 * torch.randn(N, generator=g), kw


def test_join_reference_is_muse_composition():
    """The input-scaled post-norm + norm-preserving gate + zero-centred next norm, written out (transformers'
    MuseSparkTextInputScaledRMSNorm / MuseSparkResidualGate / MuseSparkTextCenteredRMSNorm, fp32)."""
    y, s, w, kw = _join_args(3, 24, 1, "input_scaled", True, False)
    s0 = s.clone()
    x, s1 = gated_join_reference(y, s, w, 1e-5, **kw)
    b = y * (1 + kw["post_weight"])
    b = b * torch.rsqrt(b.pow(2).mean(-1, keepdim=True) + 1e-8)
    z = kw["gate"] / 0.3
    beta = torch.sigmoid(z)
    alpha = torch.sqrt(torch.clamp(torch.sigmoid(-z) * (1 + beta), min=1e-3))
    s_new = alpha * s0 + beta * b
    torch.testing.assert_close(s1, s_new, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x, s_new * torch.rsqrt(s_new.pow(2).mean(-1, keepdim=True) + 1e-5) * (1 + w),
                               rtol=1e-6, atol=1e-6)


@interpreted
@pytest.mark.parametrize("post", ["none", "weightless", "weighted", "input_scaled"])
@pytest.mark.parametrize("gated,scalar", [(False, False), (True, False), (True, True)])
def test_gated_join_kernel(post, gated, scalar):
    from latency_specialized.kernels.residual_gated_triton import gated_join_triton

    y, s, w, kw = _join_args(3, 40, hash((post, gated, scalar)) % 1000, post, gated, scalar)
    s_ref = s.clone()
    out = torch.full((3, 40), float("nan"))
    x, s_out = gated_join_triton(y, s, w, 1e-5, out=out, **kw)
    rx, rs = gated_join_reference(y, s_ref, w, 1e-5, **kw)
    assert x is out and s_out is s
    torch.testing.assert_close(s, rs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x, rx, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("weighted", [False, True])
def test_gated_join_kernel_norm_only(weighted):
    """y None: the first layer's input norm of the stream, the stream untouched."""
    from latency_specialized.kernels.residual_gated_triton import gated_join_triton

    _, s, w, _ = _join_args(2, 33, 5, "none", False, False)
    before = s.clone()
    x, _ = gated_join_triton(None, s, w if weighted else None, 1e-6, zero_centered=True)
    rx, _ = gated_join_reference(None, before.clone(), w if weighted else None, 1e-6, zero_centered=True)
    assert torch.equal(s, before)
    torch.testing.assert_close(x, rx, rtol=1e-5, atol=1e-5)
