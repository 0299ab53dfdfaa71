"""attention.sparse_mla.triton_splitkv on the CPU: the Triton interpreter in fp32, dispatch, splits, sm_90 build.

The kernel cases (marker ``interpreter_case``) run in a child process started with ``TRITON_INTERPRET=1``
(``test_kernel_cases_under_the_interpreter``; why: ``tests/ops/test_mla_triton.py``'s docstring). Every
tensor is fp32 (the interpreter's bf16 casts and dots are unreliable): the tolerance is an fp32 one, the
kernels' arithmetic being dtype-generic; bf16 at the real shapes is ``tests/ops/test_sparse_mla_triton_gpu.py``.

Every case: fresh random inputs; ``out`` poisoned with NaN; every cache row that no valid selected entry
reads poisoned with NaN (unselected positions, tails of blocks, unused blocks, the new tokens' slots before
the write); a duplicate-free random selection per row at random slots of the K, the rest -1 or positions
at or past ``seq_lens[b]`` (skipped); -1 / garbage block ids past each sequence's end; padding rows
(seq_lens 0, slot -1). The result must equal ``sparse_mla_decode_reference`` and the cache must change at
exactly the live slots. Several splits of the K slots are forced with 16-slot chunks. The RoPE cases pass
unrotated q / k_pe with per-row positions (large ones too) in NeoX and interleaved layouts; the cache must
hold the rotated rope key.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.attention.mla import roped
from latency_specialized.ops.attention.sparse_mla import sparse_mla_decode_masked, sparse_mla_decode_reference
from latency_specialized.ops.norm import rmsnorm_reference
from latency_specialized.ops.registry import make_context
from latency_specialized.ops.rope import apply_rope, rope_inv_freq

from tests.interpret import run_interpreted

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (its interpreter runs the kernels on the CPU)")
interpreted = pytest.mark.interpreter_case
"""Needs TRITON_INTERPRET=1 from the process start: collected only there (the driver below runs these)."""

FP32 = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter_driver
def test_kernel_cases_under_the_interpreter():
    run_interpreted(__file__, min_passed=41)


@pytest.fixture
def mk():
    from latency_specialized.kernels import mla_decode_triton

    return mla_decode_triton


@pytest.fixture
def sparse():
    from latency_specialized.kernels import sparse_mla_triton

    return sparse_mla_triton


def _selection(g, lens, K, *, beyond: bool) -> torch.Tensor:
    """[B, K] int32: per row a duplicate-free random subset of [0, n) (min(K, n) of them, the new token's
    position n - 1 always among them, as the indexer scores it too) at random slots; the other slots -1,
    or (``beyond``) some of them positions >= n that the kernel must skip."""
    B = len(lens)
    sel = torch.full((B, K), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        if n > 0:
            pick = torch.randperm(n, generator=g)[:K]
            if (pick != n - 1).all():
                pick[0] = n - 1
            slots = torch.randperm(K, generator=g)[:pick.numel()]
            sel[b, slots] = pick.to(torch.int32)
        if beyond:
            free = (sel[b] < 0).nonzero().flatten()
            far = free[::3]                                  # every third free slot: n, n + 1, ... (skipped)
            sel[b, far] = n + torch.arange(far.numel(), dtype=torch.int32)
    return sel


def _case(seed, lens, K, *, H=4, L=32, R=16, nope=16, v=16, bs=4, gate=False, beyond=True, spare=3):
    """Inputs as the GLM program passes them (q a view, k_pe a column slice of the kv projection)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    per = max(-(-max(max(lens), 1) // bs), 1) + 1       # one block more than the longest needs
    nb = B * per + spare
    cache = torch.randn(nb, bs, L + R, generator=g)
    blocks = torch.randperm(nb, generator=g)[:B * per].view(B, per).to(torch.int32)
    sel = _selection(g, lens, K, beyond=beyond)
    slots = torch.full((B,), -1, dtype=torch.int64)
    read = torch.zeros(nb * bs, dtype=torch.bool)
    for b, n in enumerate(lens):
        if n > 0:
            p = n - 1
            slots[b] = int(blocks[b, p // bs]) * bs + p % bs
            pos = sel[b][(sel[b] >= 0) & (sel[b] < n - 1)].long()   # read, not written (n - 1: written first)
            read[blocks[b, pos // bs].long() * bs + pos % bs] = True
        used = -(-n // bs)
        # past the end: -1 or garbage, never read; the reference looks block ids up for every entry (its
        # column clamped: -1 -> column 0, far ones -> the last) and masks the invalid ones, so garbage only
        # where it cannot index out of bounds: live rows without entries >= n
        far = bool((sel[b] >= n).any())
        blocks[b, used:] = 2 ** 30 if (b % 2 == 0 and n > 0 and not far) else -1
    flat = cache.view(-1, L + R)
    flat[~read] = float("nan")                           # nothing may read these (new slots: written first)
    q = torch.randn(B, H * (nope + R), generator=g).view(B, H, nope + R)
    kv = torch.randn(B, L + R, generator=g)
    w = torch.randn(H * (nope + v), L, generator=g) * L ** -0.5
    gt = torch.randn(B, H * v, generator=g) if gate else None
    args = (q, kv[:, :L].contiguous(), kv[:, L:], cache, slots, blocks, torch.tensor(lens, dtype=torch.int32), w, sel)
    return args, dict(qk_nope_head_dim=nope, v_head_dim=v, gate=gt)


def _norm_case(seed, lens, K, **case):
    """``_case`` with the kv_a norm fused: kv_c the raw latent, a strided column slice of a wider projection
    output, off unit RMS so an unapplied norm shows."""
    args, kw = _case(seed, lens, K, **case)
    g = torch.Generator().manual_seed(seed + 7919)
    B, L, R = len(lens), args[1].shape[-1], args[2].shape[-1]
    wide = 3.0 * torch.randn(B, 8 + L + R, generator=g) + 0.5
    kv_c = wide[:, 8:8 + L]
    weight = 1.0 + 0.1 * torch.randn(L, generator=g)
    return (args[0], kv_c, *args[2:]), dict(kw, kv_norm_weight=weight, kv_norm_eps=1e-5)


def _check(sparse, args, kw, **call):
    q, kv_c, k_pe, cache, slots, blocks, seq_lens, w, sel = args
    norm_w = kw.get("kv_norm_weight")
    rope = kw.get("positions") is not None
    latent = kv_c if norm_w is None else rmsnorm_reference(kv_c, norm_w, kw["kv_norm_eps"])
    k_new = k_pe if not rope else roped(q, k_pe, kw["qk_nope_head_dim"], kw["positions"], kw["rope_inv_freq"],
                                        kw["rope_interleaved"])[1]
    before, c_ref, c_tri = cache.clone(), cache.clone(), cache.clone()
    want = sparse_mla_decode_reference(q, kv_c, k_pe, c_ref, slots, blocks, seq_lens, w, sel, **kw)
    B, H = q.shape[:2]
    out = torch.full((B, H * kw["v_head_dim"]), float("nan"))
    got = sparse.sparse_mla_decode_triton(q, kv_c, k_pe, c_tri, slots, blocks, seq_lens, w, sel, out=out, **kw,
                                          **call)
    assert got is out and not torch.isnan(out).any(), "output left unwritten or NaN leaked"
    scale = want.abs().max().item() + 1e-6
    torch.testing.assert_close(got, want, rtol=FP32["rtol"], atol=FP32["atol"] * scale)
    empty = ~((sel >= 0) & (sel < seq_lens.unsqueeze(1))).any(1)      # padding rows, empty selections
    assert torch.equal(got[empty], torch.zeros_like(got[empty])), "rows without a valid entry must be exact zeros"
    flat, flat0 = c_tri.view(-1, c_tri.shape[-1]), before.view(-1, before.shape[-1])
    live = slots[slots >= 0]
    changed = torch.zeros(flat.shape[0], dtype=torch.bool)
    changed[live] = True
    torch.testing.assert_close(flat[~changed], flat0[~changed], rtol=0, atol=0, equal_nan=True)
    new = torch.cat([latent, k_new], -1)[slots >= 0]
    if rope and call.get("fused", True):   # the kernel's cos/sin (numpy's under the interpreter): fp32 ulps
        torch.testing.assert_close(flat[live], new, rtol=2e-6, atol=2e-6)
    elif norm_w is not None:   # the kernel's fp32 sum of squares runs in its own order: an fp32 rounding
        torch.testing.assert_close(flat[live], new, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(flat[live], new)
    return got


def _short_chunks(mk, monkeypatch, n: int = 16) -> None:
    """``n``-slot chunks at every batch: several live splits of these small selections."""
    monkeypatch.setattr(mk, "MIN_CHUNK", n)
    monkeypatch.setattr(mk, "MIN_CHUNK_SMALL_BATCH", n)
    monkeypatch.setattr(mk, "SPARSE_MIN_CHUNK_SMALL_BATCH", n)


LENS = [0, 1, 7, 33, 0, 60, 20]
"""Padding rows first and among live ones; contexts shorter than K (partly -1) and longer."""


@interpreted
@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("splits", [1, 2, 3, None])
@pytest.mark.parametrize("gate", [False, True])
def test_matches_reference(mk, sparse, monkeypatch, bs, splits, gate):
    _short_chunks(mk, monkeypatch)
    args, kw = _case(bs * 100 + (splits or 0) * 10 + gate, LENS, 40, bs=bs, gate=gate)
    _check(sparse, args, kw, num_splits=splits)


@interpreted
@pytest.mark.parametrize("splits", [1, 3])
def test_unfused_epilogue_matches_reference(mk, sparse, monkeypatch, splits):
    """fused=False: torch latent write, merge to o_lat (or the split kernel writes it: one split), torch W_UV
    bmm and the reference's gate epilogue."""
    _short_chunks(mk, monkeypatch)
    args, kw = _case(300 + splits, LENS, 40, gate=True)
    _check(sparse, args, kw, num_splits=splits, fused=False)


@interpreted
@pytest.mark.parametrize("splits", [1, 4])
def test_odd_widths_two_head_groups(mk, sparse, monkeypatch, splits):
    """H = 20 (two head-group programs, the second part-masked), L = 64, R = 32, nope 24 (a masked prologue K
    step), v = 24 (masked merge lanes), K = 37 (not a multiple of the 16-slot tile), block size 3."""
    _short_chunks(mk, monkeypatch)
    args, kw = _case(7 + splits, [0, 40, 3, 90], 37, H=20, L=64, R=32, nope=24, v=24, bs=3, gate=True)
    _check(sparse, args, kw, num_splits=splits)
    _check(sparse, args, kw, num_splits=splits, fused=False)


@interpreted
@pytest.mark.parametrize("K", [1, 5, 16, 17])
def test_small_selections(mk, sparse, monkeypatch, K):
    """K below, at and just past one tile; K = 1 (one slot: one split, one entry)."""
    _short_chunks(mk, monkeypatch)
    args, kw = _case(50 + K, [3, 0, 30, 1], K, gate=True)
    _check(sparse, args, kw)
    _check(sparse, args, kw, num_splits=2)


@interpreted
def test_empty_selections_and_padding_give_zeros(mk, sparse, monkeypatch):
    """A live row (its token written) whose selection holds only -1 or positions >= seq_len gives zeros; so do
    padding rows; a whole batch of them too."""
    _short_chunks(mk, monkeypatch)
    args, kw = _case(61, [5, 0, 9, 12], 32, gate=True)
    sel = args[8]
    sel[0] = -1
    sel[2] = torch.where(torch.arange(32) % 2 == 0, 9 + torch.arange(32), -1).to(torch.int32)   # all >= 9
    for splits in (1, 2):
        got = _check(sparse, args, kw, num_splits=splits)
        assert torch.equal(got[0], torch.zeros_like(got[0])) and torch.equal(got[2], torch.zeros_like(got[2]))
        assert got[3].abs().max() > 0
    args, kw = _case(62, [0, 0], 32)
    for splits in (1, 2):
        _check(sparse, args, kw, num_splits=splits)


@interpreted
def test_leading_invalid_tiles_with_very_negative_scores(mk, sparse, monkeypatch):
    """The first tiles of a split hold no valid entry (m stays -inf, exponents taken against 0) and every valid
    score lies far below 0 (log2 units < -126, where exp2 against 0 would underflow): the softmax still takes
    the valid entries' own max. Each cache row is -c * (the row's absorbed query) for c > 0."""
    _short_chunks(mk, monkeypatch)
    H, L, R, nope, v, bs, K = 2, 32, 16, 16, 16, 4, 64
    args, kw = _case(71, [48, 40], K, H=H, L=L, R=R, nope=nope, v=v, bs=bs, beyond=False)
    q, kv_c, k_pe, cache, slots, blocks, lens, w, sel = args
    q[:, 1] = q[:, 0]                                   # both heads the same absorbed query
    w.view(H, nope + v, L)[1] = w.view(H, nope + v, L)[0]
    q_abs = torch.cat([torch.einsum("bn,nl->bl", q[:, 0, :nope], w.view(H, nope + v, L)[0, :nope]),
                       q[:, 0, nope:]], -1)              # [B, L + R]
    g = torch.Generator().manual_seed(72)
    flat = cache.view(-1, L + R)
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        rows = blocks[b, pos // bs].long() * bs + pos % bs
        flat[rows] = -(0.5 + torch.rand(n, 1, generator=g)) * q_abs[b] / q_abs[b].norm()
    kv_c[:] = -q_abs[:, :L] / q_abs.norm(dim=1, keepdim=True)    # the new token's latent too
    k_pe[:] = -q_abs[:, L:] / q_abs.norm(dim=1, keepdim=True)
    sel[:] = -1
    for b, n in enumerate(lens.tolist()):
        sel[b, 20:20 + min(n, K - 20)] = torch.randperm(n, generator=g)[:K - 20].to(torch.int32)
    scale = 400.0 / q_abs.norm(dim=1).min().item()       # every score < -200 (natural log units)
    got = _check(sparse, args, dict(kw, scale=scale), num_splits=1)
    assert got.abs().max() > 0


@interpreted
@pytest.mark.parametrize("tile,B", [(16, 3), (0, 3)], ids=["latent_tiled_merge", "v_blocked_merge"])
def test_both_fused_merges(mk, sparse, monkeypatch, tile, B):
    """The L-tiled merge (last arriver adds the tiles; counters zeroed by the split kernel) and the v-blocked
    merge read the same partials of the sparse split kernel."""
    _short_chunks(mk, monkeypatch)
    monkeypatch.setattr(mk, "MERGE_L_TILE", tile)
    monkeypatch.setattr(mk, "sm_count", lambda device: 10_000)
    assert (mk.merge_l_tiles(B, 4, 32, 10_000) > 1) == (tile > 0)
    args, kw = _case(80 + tile, [0, 40, 7][:B], 48, gate=True)
    for splits in (1, 3):
        _check(sparse, args, kw, num_splits=splits)


@interpreted
@pytest.mark.parametrize("splits", [1, 2])
def test_kv_norm_matches_reference(mk, sparse, monkeypatch, splits):
    """kv_norm_weight: the raw latent (a strided column slice) normalised by the prologue's latent writers;
    the cache rows hold the normed latent; selections may include the new token (written first)."""
    _short_chunks(mk, monkeypatch)
    args, kw = _norm_case(90 + splits, LENS, 40, gate=True)
    assert not args[1].is_contiguous()
    _check(sparse, args, kw, num_splits=splits)
    _check(sparse, args, kw, num_splits=splits, fused=False)


@interpreted
def test_int64_and_strided_selection_and_scale(mk, sparse, monkeypatch):
    """int64 positions; a selection that is a column slice of a wider buffer (strided rows, read in place);
    a given softmax scale; the masked torch implementation agrees too."""
    _short_chunks(mk, monkeypatch)
    args, kw = _case(101, [9, 0, 30], 24, gate=True)
    sel = args[8]
    wide = torch.full((3, 24 + 5), -7, dtype=torch.int64)
    wide[:, 2:26] = sel.long()
    strided = wide[:, 2:26]
    assert not strided.is_contiguous()
    args = (*args[:8], strided)
    got = _check(sparse, args, dict(kw, scale=0.3), num_splits=2)
    masked = sparse_mla_decode_masked(*args[:3], args[3].clone(), *args[4:], **dict(kw, scale=0.3))
    torch.testing.assert_close(got, masked, rtol=FP32["rtol"], atol=FP32["atol"] * masked.abs().max().item())


@interpreted
@pytest.mark.parametrize("B", [1, 17])
def test_batches_across_prologue_row_tiles(mk, sparse, monkeypatch, B):
    """Batch 1 and 17 (two prologue row tiles), default splits (``choose_sparse_splits`` on the CPU's nominal SM
    count), padding rows among live ones."""
    _short_chunks(mk, monkeypatch)
    lens = [0 if i % 4 == 1 else 1 + (7 * i) % 45 for i in range(B)]
    args, kw = _case(110 + B, lens, 32, H=3, gate=True)
    _check(sparse, args, kw)


# --------------------------------------------------------------------------------------------- host side
def _rope(B, R, seed, style, theta=10000.0):
    """RoPE keywords: per-row positions (0, 100000 and 2^20 among them), inverse frequencies, pair layout."""
    positions = (0, 100000, 7, 2 ** 20, 1, 65535, 4095, 31)
    pos = torch.tensor([positions[(seed + b) % len(positions)] for b in range(B)], dtype=torch.int64)
    return dict(positions=pos, rope_inv_freq=rope_inv_freq(theta, R), rope_interleaved=style == "interleaved")


@interpreted
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_epilogue"])
def test_rope_matches_reference(mk, sparse, monkeypatch, style, fused):
    """positions + rope_inv_freq: the shared prologue rotates q's rope part and k_pe (fused; unfused: the torch
    rotation) against the reference with the same positions; the cache holds the rotated k_pe."""
    _short_chunks(mk, monkeypatch)
    args, kw = _case(83 + fused, LENS, 40, gate=True)
    _check(sparse, args, dict(kw, **_rope(len(LENS), 16, 2, style)), num_splits=2, fused=fused)


@interpreted
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_glm_shapes_with_kv_norm(mk, sparse, monkeypatch, style):
    """GLM-5.3 TP8 widths (8 heads, kv_lora 512, rope 64, nope 192, v 256, no gate), the kv_a norm and RoPE
    fused, a 32-wide selection in two splits, padding rows."""
    _short_chunks(mk, monkeypatch)
    args, kw = _norm_case(89, [0, 3, 50, 20], 32, H=8, L=512, R=64, nope=192, v=256, bs=16)
    _check(sparse, args, dict(kw, **_rope(4, 64, 5, style, theta=1e6)), num_splits=2)


@pytest.mark.parametrize("masked", [False, True], ids=["reference", "torch_masked"])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_contract_is_rotate_then_attention(masked, style):
    """With positions the torch implementations equal themselves on apply_rope-rotated q (rope part) and k_pe,
    results and caches, bit for bit (the rotation the sparse MLA piece did before the call)."""
    fn = sparse_mla_decode_masked if masked else sparse_mla_decode_reference
    args, kw = _norm_case(97, [0, 5, 12, 1], 8, gate=True, beyond=False)
    q, kv_c, k_pe, cache, *rest = args
    rope = _rope(4, 16, 3, style)
    sty = "interleaved" if rope["rope_interleaved"] else "neox"
    nope = kw["qk_nope_head_dim"]
    q_rot = torch.cat([q[..., :nope], apply_rope(q[..., nope:], rope["positions"], rope["rope_inv_freq"], sty)], -1)
    k_rot = apply_rope(k_pe.unsqueeze(1), rope["positions"], rope["rope_inv_freq"], sty).squeeze(1)
    c_fused, c_plain = cache.clone(), cache.clone()
    got = fn(q, kv_c, k_pe, c_fused, *rest, **kw, **rope)
    want = fn(q_rot, kv_c, k_rot, c_plain, *rest, **kw)
    assert torch.equal(got, want)
    torch.testing.assert_close(c_fused, c_plain, rtol=0, atol=0, equal_nan=True)
    assert not torch.equal(got, fn(q, kv_c, k_pe, cache.clone(), *rest, **kw)), "positions changed nothing"


def test_rope_without_inv_freq_raises_a_user_error(sparse):
    args, kw = _case(101, [3, 4], 8)
    rope = dict(_rope(2, 16, 0, "neox"), rope_inv_freq=None)
    for fn in (sparse_mla_decode_reference, sparse_mla_decode_masked, sparse.sparse_mla_decode_triton):
        with pytest.raises(UserError, match="both positions"):
            fn(*args, **kw, **rope)


def test_sparse_splits_are_sized_to_k_and_all_live():
    """``choose_sparse_splits``: ``choose_num_splits`` with K as the capacity, trimmed so that every split owns
    slots under the device's chunk rule (none idles, the merge's live count is every split)."""
    from latency_specialized.kernels.mla_decode_triton import (BLOCK_N, MAX_SPLITS, choose_num_splits,
                                                               choose_sparse_splits, min_chunk)

    assert choose_sparse_splits(1, 8, 2048, 132) == 2048 // min_chunk(1, sparse=True) == 64     # GLM TP8, batch 1: K-bound
    assert choose_sparse_splits(8, 8, 2048, 132) == 2048 // min_chunk(8, sparse=True) == 16
    assert choose_sparse_splits(64, 8, 2048, 132) == choose_num_splits(64, 8, 2048, 132, sparse=True) == 4   # SM-bound
    assert choose_sparse_splits(64, 16, 2048, 132) == 4                              # TP4: 16 heads, 1 group
    assert choose_sparse_splits(1, 8, 1, 132) == 1
    for B in (1, 2, 3, 8, 17, 64):
        for H in (8, 12, 16, 64):
            for K in (1, 7, 100, 513, 2048, 4096):
                for bn in (16, BLOCK_N):
                    n = choose_sparse_splits(B, H, K, 132, bn)
                    chunk = -(-max(-(-K // n), min_chunk(B, sparse=True)) // bn) * bn
                    assert 1 <= n <= MAX_SPLITS and (n - 1) * chunk < K <= n * chunk, (B, H, K, bn, n)


def test_bad_selection_raises_a_user_error(sparse):
    args, kw = _case(3, [4, 5], 8)
    for bad, match in ((args[8][:1], "needs \\[B=2, K\\]"), (args[8].view(2, 8, 1), "needs"),
                       (args[8][:, :0], "K=0"), (args[8].float(), "dtype")):
        with pytest.raises(UserError, match=match):
            sparse.sparse_mla_decode_triton(*args[:8], bad, **kw)


def test_unsupported_widths_raise_a_user_error(sparse):
    args, kw = _case(3, [4], 8, L=24, R=8, nope=8, v=8)
    with pytest.raises(UserError, match="attention.sparse_mla.torch_masked"):
        sparse.sparse_mla_decode_triton(*args, **kw)


def _signature(fn, types: dict[str, str]) -> dict[str, str]:
    """A kernel's whole signature in its argument order: the given types, "constexpr" for the rest."""
    return {name: types.get(name, "constexpr") for name in fn.arg_names}


def _ctx(arch="sm_90", dtype="bfloat16", **dims):
    d = dict(heads=8, kv_lora=512, rope=64, nope=192, v=256, topk=2048)   # GLM-5.3 TP8
    d.update(dims)
    return make_context("attention.sparse_mla", arch=arch, dtype=dtype, tokens=4, world_size=8, dims=d,
                        attrs={"gate": "none", "rope": True, "rope_interleaved": True})


def test_supports_names_the_reason(sparse):
    sup = sparse.IMPLEMENTATIONS[0].supports
    assert sup(_ctx()) is True and sup(_ctx("sm_100a")) is True and sup(_ctx(heads=16)) is True
    assert "GPU" in sup(_ctx("cpu")) and "sm_80" in sup(_ctx("sm_75"))
    assert "rope 8" in sup(_ctx(kv_lora=16, rope=8))
    assert "dtype" in sup(_ctx(dtype="float8_e4m3fn"))
    assert "topk 0" in sup(_ctx(topk=0))


def test_dispatch_gpu_gets_the_kernel_cpu_the_reference():
    from latency_specialized.plugins import get_registry

    impls = get_registry().implementations
    names = [i.name for i in impls.family("attention.sparse_mla")]
    assert names.index("attention.sparse_mla.triton_splitkv") < names.index("attention.sparse_mla.torch_masked")
    for arch in ("sm_90", "sm_90a", "sm_100"):
        chosen, _ = impls.select(_ctx(arch))
        assert chosen.name == "attention.sparse_mla.triton_splitkv", arch
    chosen, refusals = impls.select(_ctx("cpu"))
    assert chosen.name == "attention.sparse_mla.reference"
    assert {n for n, _ in refusals} >= {"attention.sparse_mla.triton_splitkv", "attention.sparse_mla.torch_masked"}
    chosen, refusals = impls.select(_ctx(kv_lora=24))                  # a width the kernel cannot tile
    assert chosen.name == "attention.sparse_mla.torch_masked" and "kv_lora 24" in dict(refusals)[
        "attention.sparse_mla.triton_splitkv"]


@interpreted
@pytest.mark.parametrize("fused", [True, False])
def test_selection_joined_before_the_split(mk, sparse, monkeypatch, fused):
    """``before_split`` (the side stream's join of an indexer running beside the attention): called once, after the
    prologue's launch (or the torch latent write and absorbed query) and before the split kernel's; the selection it
    makes ready (here: written into the buffer by the call itself, garbage before) is the one attended over - the
    reference's output and cache, as if the selection had been there from the start."""
    _short_chunks(mk, monkeypatch)
    order = []
    for name in ("_prologue", "_split_attention"):
        real = getattr(mk, name)
        monkeypatch.setattr(mk, name, lambda *a, _real=real, _name=name, **k: (order.append(_name), _real(*a, **k))[1])
    args, kw = _case(71, LENS, 40)
    sel = args[8]
    buffer = torch.full_like(sel, 2 ** 30)   # what the split would read if it ran before the join

    def join():
        order.append("join")
        buffer.copy_(sel)

    _check(sparse, (*args[:8], sel), kw, fused=fused)   # the plain call's result and cache, for comparison
    order.clear()
    cache = args[3].clone()
    got = sparse.sparse_mla_decode_triton(*args[:3], cache, *args[4:8], buffer, fused=fused, before_split=join, **kw)
    want = sparse_mla_decode_reference(*args[:3], args[3].clone(), *args[4:8], sel, **kw)
    torch.testing.assert_close(got, want, rtol=FP32["rtol"], atol=FP32["atol"] * (want.abs().max().item() + 1e-6))
    assert order == (["_prologue"] if fused else []) + ["join", "_split_attention"], order


def test_selection_joined_needs_a_unit_stride_selection(sparse):
    args, kw = _case(72, [5, 9], 8)
    strided = torch.full((2, 16), -1, dtype=torch.int32)[:, ::2]
    with pytest.raises(UserError, match="before_split"):
        sparse.sparse_mla_decode_triton(*args[:8], strided, before_split=lambda: None, **kw)


@pytest.mark.parametrize("impl", ["reference", "masked"])
def test_torch_implementations_join_before_they_read_the_selection(impl):
    """The torch implementations of the contract call ``before_split`` before they read the selection."""
    from latency_specialized.ops.attention import sparse_mla as ops

    fn = ops.sparse_mla_decode_reference if impl == "reference" else ops.sparse_mla_decode_masked
    args, kw = _case(73, [5, 9, 0], 8)
    sel = args[8]
    buffer = torch.full_like(sel, 2 ** 30)
    got = fn(*args[:3], args[3].clone(), *args[4:8], buffer, before_split=lambda: buffer.copy_(sel), **kw)
    want = ops.sparse_mla_decode_reference(*args[:3], args[3].clone(), *args[4:8], sel, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_piece_call_is_the_kernel_signature(sparse):
    """The sparse MLA piece calls the op with 9 positional arguments and these keywords (``attend``): the
    entry point takes exactly that call (and the reference's signature)."""
    import inspect

    from latency_specialized.pieces.attention import sparse_mla as piece

    sig = inspect.signature(sparse.sparse_mla_decode_triton)
    ref = inspect.signature(sparse_mla_decode_reference)
    assert list(sig.parameters)[:9] == list(ref.parameters)[:9]
    src = inspect.getsource(piece.SparseMLAAttention.attend)
    for kwarg in ("qk_nope_head_dim", "v_head_dim", "gate", "kv_norm_weight", "kv_norm_eps", "scale"):
        assert f"{kwarg}" in src and kwarg in sig.parameters, kwarg
    assert "rope_args" in src   # positions / rope_inv_freq / rope_interleaved (the dense piece's rope_args)
    for kwarg in ("positions", "rope_inv_freq", "rope_interleaved"):
        assert kwarg in inspect.getsource(piece.MLAAttention.rope_args) and kwarg in sig.parameters, kwarg
    for name, p in ref.parameters.items():   # every keyword of the contract
        assert name in sig.parameters and sig.parameters[name].kind == p.kind, name


def test_kernels_compile_for_hopper_without_a_gpu(mk):
    """The split kernel (sparse and dense) and both merges (sparse) build for sm_90 on the CPU (ptxas bundled
    with Triton) at GLM-5.3 widths: syntax, constexpr use and the tensor-core path (wgmma or mma) are checked
    before any GPU run. Needs a process that is not interpreting (``_kernels(False)``: jitted for the compiler)."""
    import os

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("compiles only where triton was imported without the interpreter")
    kernels = mk._kernels(False)
    target = GPUTarget("cuda", 90, 32)
    ptr = dict(q_lat="*bf16", q_pe="*bf16", cache="*bf16", block_table="*i32", seq_lens="*i32", ws_acc="*fp32",
               ws_m="*fp32", ws_l="*fp32", o_lat="*fp32", count="*i32", topk_idx="*i32")
    ints = ("topk", "H", "num_splits", "block_size", "s_qb", "s_qh", "s_pb", "s_ph", "s_row", "s_bt", "s_tk", "s_wb",
            "s_ws", "s_wh", "s_mb", "s_ms", "s_ob", "s_oh")
    sig = {**ptr, **{n: "i32" for n in ints}, "sm_scale_log2": "fp32"}
    for sparse_flag in (True, False):
        const = dict(L=512, R=64, BH=16, BN=32, MIN_CHUNK=64, DIRECT=False, PREC="tf32", PDL=False, ZERO_COUNT=True,
                     TRIGGER_END=False, SPARSE=sparse_flag)
        src = ASTSource(fn=kernels["split"], signature=_signature(kernels["split"], sig), constexprs=const)
        ptx = triton.compile(src, target=target, options=dict(num_warps=4, num_stages=2)).asm["ptx"]
        assert "mma" in ptx
    ints = ("num_splits", "V", "topk", "s_wb", "s_ws", "s_wh", "s_mb", "s_ms", "s_ob", "s_oh", "s_uh", "s_uv", "s_g",
            "s_o")
    sig = dict(ws_acc="*fp32", ws_m="*fp32", ws_l="*fp32", seq_lens="*i32", o_lat="*bf16", w_uv="*bf16",
               gate="*bf16", out="*bf16", **{n: "i32" for n in ints})
    const = dict(BN=32, MIN_CHUNK=64, S_PAD=32, S_TILE=32, L=512, ML=512, V_PAD=256, EPILOGUE=True, HAS_GATE=False,
                 PDL=False, SPARSE=True)
    src = ASTSource(fn=kernels["merge"], signature=_signature(kernels["merge"], sig), constexprs=const)
    triton.compile(src, target=target, options=dict(num_warps=4))
    ints = ("num_splits", "H", "V", "topk", "s_wb", "s_ws", "s_wh", "s_mb", "s_ms", "s_uh", "s_uv", "s_g", "s_o")
    sig = dict(ws_acc="*fp32", ws_m="*fp32", ws_l="*fp32", seq_lens="*i32", w_uv="*bf16", gate="*bf16", out="*bf16",
               ws_o="*fp32", count="*i32", **{n: "i32" for n in ints})
    const = dict(BN=32, MIN_CHUNK=64, S_PAD=32, S_TILE=32, LT=64, NLT=8, NLT_PAD=8, V_PAD=256, HAS_GATE=True,
                 PDL=False, SPARSE=True)
    src = ASTSource(fn=kernels["merge_tiles"], signature=_signature(kernels["merge_tiles"], sig),
                    constexprs=const)
    triton.compile(src, target=target, options=dict(num_warps=4))
