"""RoPE glue vs rotations written as complex products (NeoX rotate-half, interleaved, partial)."""

from __future__ import annotations

import pytest
import torch

from latency_specialized.pieces import apply_rope, rope_inv_freq

from tests.runtime.composed_toy import ToyReference


@pytest.mark.parametrize("style,rot", [("neox", 16), ("neox", 8), ("interleaved", 16), ("interleaved", 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_complex_rotation(style, rot, dtype):
    g = torch.Generator().manual_seed(rot)
    x = torch.randn(5, 3, 16, generator=g).to(dtype)
    pos = torch.randint(0, 5000, (5,), generator=g)
    got = apply_rope(x, pos, rope_inv_freq(1e4, rot), style)
    assert got.dtype == dtype and got.shape == x.shape
    want = torch.stack([ToyReference.rope(x[m].double(), int(pos[m]), 1e4, rot, style == "interleaved")
                        for m in range(5)])
    # fp32 angles (as Hugging Face computes them): |angle error| <= pos * 2**-24, ~3e-4 rad at position 5000
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.double(), want, **tol)
    assert torch.equal(got[..., rot:], x[..., rot:])   # channels past rotary_dim pass through
    # norms are kept per rotated pair, and position 0 is the identity
    zero = apply_rope(x, torch.zeros(5, dtype=torch.long), rope_inv_freq(1e4, rot), style)
    assert torch.equal(zero, x)


def test_hugging_face_rotate_half_formula():
    """q * cos + rotate_half(q) * sin with emb = cat(freqs, freqs) (transformers' apply_rotary_pos_emb)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 2, 8, generator=g)
    pos = torch.tensor([0, 3, 17, 1024])
    inv = 1.0 / (1e6 ** (torch.arange(0, 8, 2, dtype=torch.int64).float() / 8))
    emb = torch.cat([pos[:, None].float() * inv[None]] * 2, dim=-1)[:, None]
    half = torch.cat([-q[..., 4:], q[..., :4]], dim=-1)
    want = q * emb.cos() + half * emb.sin()
    assert torch.equal(rope_inv_freq(1e6, 8), inv)
    torch.testing.assert_close(apply_rope(q, pos, inv, "neox"), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="even"):
        rope_inv_freq(1e4, 7)
