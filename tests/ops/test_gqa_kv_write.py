"""attention.gqa's KV-write convention (k, v, slot_mapping): the reference writes the new token, padding
(slot -1) writes nothing, the result equals attending a cache that already holds it; the sync-free
torch_paged implementation equals the reference (window, sinks, padding rows)."""

from __future__ import annotations

import math

import pytest
import torch

from latency_specialized.ops.attention.gqa import (IMPLEMENTATIONS, gqa_decode_paged, gqa_decode_reference,
                                                   write_kv_paged, write_kv_reference)


def setup(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    nb, bs, kv, d, H = 9, 4, 2, 8, 4
    kc = torch.randn(nb, bs, kv, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, kv, d, generator=g).to(dtype)
    table = torch.randperm(nb, generator=g)[:8].view(2, 4).to(torch.int32)
    table = torch.cat([table, torch.zeros(1, 4, dtype=torch.int32)])       # row 2: padding
    lens = torch.tensor([7, 13, 0], dtype=torch.int32)                      # incl. the new token
    pos = (lens - 1).clamp(min=0).long()
    slots = torch.where(lens > 0, table.long().gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs,
                        torch.tensor(-1))
    q = torch.randn(3, H, d, generator=g).to(dtype)
    k = torch.randn(3, kv, d, generator=g).to(dtype)
    v = torch.randn(3, kv, d, generator=g).to(dtype)
    return kc, vc, table, lens, slots, q, k, v


def plain_attention(q, kc, vc, table, lens, window=None, sinks=None, scale=None):
    out = torch.zeros(q.shape, dtype=torch.float64)
    bs, H, kv = kc.shape[1], q.shape[1], kc.shape[2]
    scale = scale or 1 / math.sqrt(q.shape[-1])
    for b in range(q.shape[0]):
        n = int(lens[b])
        for h in range(H):
            ts = range(max(0, n - window) if window else 0, n)
            keys = torch.stack([kc[table[b, t // bs], t % bs, h * kv // H].double() for t in ts]) if n else None
            if keys is None:
                continue
            vals = torch.stack([vc[table[b, t // bs], t % bs, h * kv // H].double() for t in ts])
            s = keys @ q[b, h].double() * scale
            z = torch.exp(s).sum() + (torch.exp(sinks[h].double()) if sinks is not None else 0)
            out[b, h] = (torch.exp(s) / z) @ vals
    return out


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_reference_writes_the_new_token_then_attends(window, with_sinks):
    kc, vc, table, lens, slots, q, k, v = setup(1)
    sinks = torch.randn(4) if with_sinks else None
    before_k, before_v = kc.clone(), vc.clone()
    out = gqa_decode_reference(q, kc, vc, table, lens, window=window, sinks=sinks, k=k, v=v, slot_mapping=slots)
    flat_k, flat_v = kc.view(-1, 2, 8), vc.view(-1, 2, 8)
    for b in range(2):
        assert torch.equal(flat_k[slots[b]], k[b]) and torch.equal(flat_v[slots[b]], v[b])
    changed = (kc != before_k).flatten(0, 1).any(-1).any(-1)
    assert set(changed.nonzero().flatten().tolist()) <= set(slots[:2].tolist())     # padding wrote nothing
    torch.testing.assert_close(out.double(), plain_attention(q, kc, vc, table, lens, window, sinks), rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    # the original convention: the caches already hold the token
    again = gqa_decode_reference(q, kc, vc, table, lens, window=window, sinks=sinks)
    assert torch.equal(again, out)
    with pytest.raises(ValueError, match="come together"):
        gqa_decode_reference(q, kc, vc, table, lens, k=k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,with_sinks,scale", [(None, False, None), (3, True, 0.2), (16, False, None)])
def test_paged_implementation_equals_the_reference(dtype, window, with_sinks, scale):
    kc, vc, table, lens, slots, q, k, v = setup(2, dtype)
    sinks = torch.randn(4) if with_sinks else None
    kc2, vc2 = kc.clone(), vc.clone()
    free, = set(range(kc.shape[0])) - set(table[:2].flatten().tolist())   # the block no sequence owns
    kc[free], kc2[free] = float("nan"), float("nan")   # NaN there must not leak into any row (0-weight * NaN)
    ref = gqa_decode_reference(q, kc, vc, table, lens, window=window, sinks=sinks, scale=scale, k=k, v=v,
                               slot_mapping=slots)
    out = torch.full_like(q, float("nan"))
    got = gqa_decode_paged(q, kc2, vc2, table, lens, window=window, sinks=sinks, scale=scale, k=k, v=v,
                           slot_mapping=slots, out=out)
    assert got is out
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), ref.float(), **tol)
    assert torch.equal(kc2.nan_to_num(), kc.nan_to_num()) and torch.equal(vc2, vc)   # same writes


def test_sync_free_write_with_no_live_row_changes_nothing():
    kc, vc, *_ = setup(3)
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    before = kc.clone(), vc.clone()
    write_kv_paged(kc, vc, k, v, torch.tensor([-1, -1]))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    write_kv_reference(kc, vc, k, v, torch.tensor([-1, 5]))
    assert torch.equal(kc.view(-1, 2, 8)[5], k[1])


def test_the_paged_implementation_serves_gpus_only():
    paged = next(i for i in IMPLEMENTATIONS if i.name == "attention.gqa.torch_paged")
    from latency_specialized.ops.registry import make_context

    assert paged.supports(make_context("attention.gqa", arch="sm_90", dtype="bfloat16", tokens=4)) is True
    assert "CPU" in paged.supports(make_context("attention.gqa", arch="cpu", dtype="bfloat16", tokens=4))
