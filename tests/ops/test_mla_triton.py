"""attention.mla.triton_splitkv on the CPU, under the Triton interpreter, in fp32.

The kernels run under ``TRITON_INTERPRET=1``, which must be set before triton is first imported:
``triton.jit`` picks interpreter or compiler when it decorates, and triton.language's own jitted
helpers (``tl.cdiv``, ``tl.max``, ``tl.sum``, ``tl.zeros`` ...) are decorated at its import; in a
process that imported triton without it (any ``make test`` run: other test modules import triton at
collection), an interpreted kernel cannot call them. Setting the variable here would leak into the
rest of the session (other modules' kernels, their interpreter-only cases), so:

* in a process started with ``TRITON_INTERPRET=1`` the kernel cases (marker ``interpreter_case``)
  are collected and run here, in-process;
* otherwise they are not collected (``tests/conftest.py`` deselects them: no skips in a CPU run) and
  ``test_kernel_cases_under_the_interpreter`` runs them in a subprocess with the variable set
  (``tests/interpret.py``); a failing case fails it.

The interpreter's bf16 is unreliable on this CPU (casts and ``tl.dot`` on bf16), so every tensor is
fp32 and the tolerance is an fp32 one: the kernels' arithmetic is dtype-generic (p is cast to the
cache element type for the p.c dot). bf16 at the real shapes is ``tests/ops/test_mla_triton_gpu.py``.

Every case: fresh random inputs, ``out`` poisoned with NaN, every cache row that no live position
reads poisoned with NaN (tails of the last blocks, unused blocks, the new tokens' slots before the
write), -1 and garbage block ids past each sequence's end, padding rows (seq_lens 0, slot -1) before
live rows; the cache must change at exactly the live slots and the result equal the reference.
The kv_norm cases (the model's kv_a RMSNorm fused into the op) pass the *raw* latent as a strided
column slice of a wider projection output, and the cache rows must hold the normed latent. The RoPE
cases (``positions`` + ``rope_inv_freq``: the model's RoPE fused into the op) pass unrotated q and k_pe,
positions that differ per row (0, 100000, 2^20 among them) in int32 and int64, NeoX and interleaved
pairs; the cache rows must hold the rotated rope key (``ops.rope.apply_rope``'s, up to the fp32 ulps
of the interpreter's cos/sin against torch's).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels import triton_common as tc
from latency_specialized.ops.attention.mla import mla_decode_paged, mla_decode_reference, roped
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
    run_interpreted(__file__, min_passed=81)


@pytest.fixture
def mla():
    from latency_specialized.kernels import mla_decode_triton

    return mla_decode_triton


def _case(seed, lens, *, H=12, L=32, R=16, nope=16, v=16, bs=2, spare=3, gate=False):
    """Inputs shaped as the Kimi K3 program passes them (q a view, k_pe a column slice)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    per = max(-(-max(max(lens), 1) // bs), 1) + 1       # one block more than the longest needs
    nb = B * per + spare
    cache = torch.randn(nb, bs, L + R, generator=g)
    blocks = torch.randperm(nb, generator=g)[:B * per].view(B, per).to(torch.int32)
    slots = torch.full((B,), -1, dtype=torch.int64)
    read = torch.zeros(nb * bs, dtype=torch.bool)
    for b, n in enumerate(lens):
        if n > 0:
            p = n - 1
            slots[b] = int(blocks[b, p // bs]) * bs + p % bs
            pos = torch.arange(n - 1)
            read[blocks[b, pos // bs].long() * bs + pos % bs] = True
        used = -(-n // bs)
        blocks[b, used:] = -1 if b % 2 else 2 ** 30      # past the end: -1 or garbage, never read
    flat = cache.view(-1, L + R)
    flat[~read] = float("nan")                           # nothing may read these (new slots: written first)
    q = torch.randn(B, H * (nope + R), generator=g).view(B, H, nope + R)
    kv = torch.randn(B, L + R, generator=g)
    w = torch.randn(H * (nope + v), L, generator=g) * L ** -0.5
    gt = torch.randn(B, H * v, generator=g) if gate else None
    args = (q, kv[:, :L].contiguous(), kv[:, L:], cache, slots, blocks, torch.tensor(lens, dtype=torch.int32), w)
    return args, dict(qk_nope_head_dim=nope, v_head_dim=v, gate=gt)


def _norm_case(seed, lens, **case):
    """``_case`` with the kv_a norm fused: kv_c the raw latent, a strided column slice of a wider
    [B, 8 + L + R] projection output (as the Kimi program passes ``kv[:, :L]``), scaled off unit RMS so
    an unapplied norm shows; a [L] gain near 1 and the model's eps."""
    args, kw = _case(seed, lens, **case)
    g = torch.Generator().manual_seed(seed + 7919)
    B, L, R = len(lens), args[1].shape[-1], args[2].shape[-1]
    wide = 3.0 * torch.randn(B, 8 + L + R, generator=g) + 0.5
    kv_c = wide[:, 8:8 + L]
    assert B == 1 or not kv_c.is_contiguous()
    weight = 1.0 + 0.1 * torch.randn(L, generator=g)
    return (args[0], kv_c, *args[2:]), dict(kw, kv_norm_weight=weight, kv_norm_eps=1e-5)


POSITIONS = (0, 100000, 7, 2 ** 20, 1, 65535, 4095, 31)
"""Token positions the RoPE cases give their rows (cycled from a seed-dependent start): large ones too,
where an fp32 angle of ~1e5 rad needs the full range reduction of cos/sin."""


def _rope(B, R, seed, style, *, dtype=torch.int64, theta=10000.0):
    """The RoPE keywords of a call: per-row positions (``POSITIONS``), inverse frequencies, pair layout."""
    pos = torch.tensor([POSITIONS[(seed + b) % len(POSITIONS)] for b in range(B)], dtype=dtype)
    return dict(positions=pos, rope_inv_freq=rope_inv_freq(theta, R), rope_interleaved=style == "interleaved")


def _check(mla, args, kw, **call):
    q, kv_c, k_pe, cache, slots, blocks, seq_lens, w = args
    norm_w = kw.get("kv_norm_weight")
    rope = kw.get("positions") is not None
    # what the cache must hold at the new slots: the latent itself, or its RMSNorm (the norm reference)
    latent = kv_c if norm_w is None else rmsnorm_reference(kv_c, norm_w, kw["kv_norm_eps"])
    k_new = k_pe
    if rope:   # and the rotated rope key (apply_rope's)
        k_new = roped(q, k_pe, kw["qk_nope_head_dim"], kw["positions"], kw["rope_inv_freq"], kw["rope_interleaved"])[1]
    before = cache.clone()
    c_ref, c_tri = cache.clone(), cache.clone()
    want = mla_decode_reference(q, kv_c, k_pe, c_ref, slots, blocks, seq_lens, w, **kw)
    B, H = q.shape[:2]
    out = torch.full((B, H * kw["v_head_dim"]), float("nan"))
    got = mla.mla_decode_triton(q, kv_c, k_pe, c_tri, slots, blocks, seq_lens, w, out=out, **kw, **call)
    assert got is out and not torch.isnan(out).any(), "output left unwritten or NaN leaked"
    scale = want.abs().max().item() + 1e-6
    torch.testing.assert_close(got, want, rtol=FP32["rtol"], atol=FP32["atol"] * scale)
    pad = seq_lens == 0
    assert torch.equal(got[pad], torch.zeros_like(got[pad])), "padding rows must be exact zeros"
    # the cache changed at exactly the live slots, with the new latents
    flat, flat0 = c_tri.view(-1, c_tri.shape[-1]), before.view(-1, before.shape[-1])
    live = slots[slots >= 0]
    changed = torch.zeros(flat.shape[0], dtype=torch.bool)
    changed[live] = True
    torch.testing.assert_close(flat[~changed], flat0[~changed], rtol=0, atol=0, equal_nan=True)
    new = torch.cat([latent, k_new], -1)[slots >= 0]
    if rope and call.get("fused", True):
        # the kernel's cos/sin (the interpreter's numpy) against torch's, and its own sum-of-squares order
        # with the norm: equal up to fp32 ulps
        torch.testing.assert_close(flat[live], new, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(c_tri, c_ref, rtol=2e-6, atol=2e-6, equal_nan=True)
    elif norm_w is not None and call.get("fused", True):
        # the kernel's fp32 sum of squares runs in its own order (not torch's): equal to an fp32 rounding
        L = kv_c.shape[-1]
        torch.testing.assert_close(flat[live][:, :L], new[:, :L], rtol=1e-6, atol=1e-6)
        assert torch.equal(flat[live][:, L:], new[:, L:])
        torch.testing.assert_close(c_tri, c_ref, rtol=1e-6, atol=1e-6, equal_nan=True)
    else:
        assert torch.equal(flat[live], new)
        torch.testing.assert_close(c_tri, c_ref, rtol=0, atol=0, equal_nan=True)
    return got


def _short_chunks(mla, monkeypatch) -> None:
    """16-position chunks at every batch: several live splits per sequence at these short lengths."""
    monkeypatch.setattr(mla, "MIN_CHUNK", 16)
    monkeypatch.setattr(mla, "MIN_CHUNK_SMALL_BATCH", 16)


@interpreted
@pytest.mark.parametrize("bs,lens,splits", [
    (2, [0, 1, 7, 33, 0, 20], 1),
    (2, [0, 1, 7, 33, 0, 20], 3),
    (2, [0, 1, 7, 33, 0, 20], 5),
    (16, [33, 0, 64, 5], 2),
    (16, [33, 0, 64, 5], 4),
])
@pytest.mark.parametrize("gate", [False, True])
def test_matches_reference(mla, monkeypatch, bs, lens, splits, gate):
    _short_chunks(mla, monkeypatch)   # several live splits per sequence at these lengths
    args, kw = _case(bs * 100 + splits * 10 + gate, lens, bs=bs, gate=gate)
    _check(mla, args, kw, num_splits=splits)


@interpreted
@pytest.mark.parametrize("bs,lens,splits", [(2, [0, 1, 7, 33, 0, 20], 1), (2, [0, 1, 7, 33, 0, 20], 3),
                                            (16, [33, 0, 64, 5], 4)])
def test_unfused_epilogue_matches_reference(mla, monkeypatch, bs, lens, splits):
    """fused=False: torch latent write, merge to o_lat (or the split kernel writes it: one split), torch
    W_UV bmm and the reference's gate epilogue."""
    _short_chunks(mla, monkeypatch)
    args, kw = _case(bs * 100 + splits * 10 + 5, lens, bs=bs, gate=True)
    _check(mla, args, kw, num_splits=splits, fused=False)


@interpreted
def test_two_head_groups_and_medium_widths(mla, monkeypatch):
    """H = 20 (two programs of 16 heads, the second part-masked), L = 64, R = 32, split merge."""
    _short_chunks(mla, monkeypatch)
    args, kw = _case(7, [0, 40, 3], H=20, L=64, R=32, nope=32, v=24, bs=4, gate=True)
    _check(mla, args, kw, num_splits=3)                  # v = 24: two 16-wide v blocks, the second part-masked
    _check(mla, args, kw, num_splits=3, fused=False)


def _latent_tiles(mla, monkeypatch, tile: int) -> None:
    """The L-tiled fused merge at these small widths (tiles of ``tile`` columns) whatever the batch."""
    monkeypatch.setattr(mla, "MERGE_L_TILE", tile)
    monkeypatch.setattr(mla, "sm_count", lambda device: 10_000)


@interpreted
@pytest.mark.parametrize("bs,lens,splits", [(2, [0, 1, 7, 33, 0, 20], 1), (2, [0, 1, 7, 33, 0, 20], 3),
                                            (2, [0, 1, 7, 33, 0, 20], 5), (16, [33, 0, 64, 5], 4)])
@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("one_tile", [True, False], ids=["one_split_tile", "split_steps"])
def test_latent_tiled_merge_matches_reference(mla, monkeypatch, bs, lens, splits, gate, one_tile):
    """Small batches' fused merge: program (b, h, tile) merges one latent tile and multiplies it by its W_UV
    columns; the last arriver of a head (counters zeroed by the split kernel) adds the tiles' outputs in
    order. Padding rows, one and several live splits, 2 tiles of 16 columns (L = 32); every split's partials
    loaded as one tile (``_merged_one_tile``: where ``MERGE_TILE`` holds them) and in one-split steps."""
    _short_chunks(mla, monkeypatch)
    _latent_tiles(mla, monkeypatch, 16)
    if not one_tile:
        monkeypatch.setattr(mla, "MERGE_TILE", 16)   # 16 partials a step: one split of 16 columns
    assert mla.merge_l_tiles(len(lens), 12, 32, mla.sm_count(None)) == 2
    args, kw = _case(bs * 100 + splits * 10 + gate + 3, lens, bs=bs, gate=gate)
    _check(mla, args, kw, num_splits=splits)


@interpreted
def test_latent_tiled_merge_two_head_groups_odd_v(mla, monkeypatch):
    """H = 20 (two head groups), L = 64 in 4 tiles, v = 24 (a 32-wide padded output row, masked)."""
    _short_chunks(mla, monkeypatch)
    _latent_tiles(mla, monkeypatch, 16)
    args, kw = _case(17, [0, 40, 3], H=20, L=64, R=32, nope=32, v=24, bs=4, gate=True)
    _check(mla, args, kw, num_splits=3)
    _check(mla, args, kw, num_splits=1)


def test_latent_tiles_only_for_small_batches(monkeypatch):
    from latency_specialized.kernels import mla_decode_triton as mk

    assert mk.merge_l_tiles(1, 12, 512, 132) == 512 // mk.MERGE_L_TILE > 1   # Kimi TP8, batch 1: 8 tiles
    assert mk.merge_l_tiles(5, 12, 512, 132) > 1                               # 2 x 60 programs <= 132 SMs
    assert mk.merge_l_tiles(6, 12, 512, 132) == 1                              # the v-blocked merge from here
    assert mk.merge_l_tiles(1, 12, 32, 132) == 1                               # fewer than two tiles
    monkeypatch.setattr(mk, "MERGE_L_TILE", 0)
    assert mk.merge_l_tiles(1, 12, 512, 132) == 1                              # switched off


@interpreted
def test_default_splits_and_scale(mla):
    args, kw = _case(11, [5, 0, 19], bs=2)
    _check(mla, args, kw)                                 # num_splits from static shapes
    args, kw = _case(12, [9, 30], bs=2)
    _check(mla, args, dict(kw, scale=0.3), num_splits=2)


@interpreted
def test_all_padding_batch_gives_zeros(mla):
    args, kw = _case(13, [0, 0], bs=2)
    for s in (1, 2):
        _check(mla, args, kw, num_splits=s)


@interpreted
@pytest.mark.parametrize("B", [1, 3, 17, 33])
@pytest.mark.parametrize("nope,L,block_l", [(16, 32, 64), (24, 64, 16), (80, 32, 16)],
                         ids=["nope16_L32", "nope24_2Ltiles", "nope80_2Ksteps"])
def test_prologue_writes_latents_and_absorbs_the_query(mla, monkeypatch, B, nope, L, block_l):
    """The prologue kernel alone: q_lat (NaN-poisoned) == the unfused path's bmm for every row (row tiles
    of PROLOGUE_B crossed at 17 and 33, masked K steps at nope 24 and 80, several column tiles), and the
    NaN-poisoned cache written at exactly the live slots (negative: nothing, first and last rows too)."""
    monkeypatch.setattr(mla, "PROLOGUE_L", block_l)
    g = torch.Generator().manual_seed(B * 1000 + nope)
    H, R, nslots = 5, 16, 3 * B + 7
    q = torch.randn(B, H, nope + R, generator=g)
    w = torch.randn(H * (nope + 8), L, generator=g).view(H, nope + 8, L)[:, :nope]   # a view, as the call passes
    kv = torch.randn(B, L + R, generator=g)
    slots = torch.randperm(nslots, generator=g)[:B]
    slots[::3] = -1                                       # rows 0, 3, ...; and the last row below
    if B > 1:
        slots[-1] = -1
    flat = torch.full((nslots, L + R), float("nan"))
    q_lat = torch.full((H, B, L), float("nan"))
    got = mla._prologue(q, kv[:, :L].contiguous(), kv[:, L:], slots, flat, w, q_lat)
    assert got is q_lat and not torch.isnan(q_lat).any(), "q_lat rows left unwritten"
    want = torch.bmm(q[..., :nope].transpose(0, 1), w)
    torch.testing.assert_close(q_lat, want, rtol=FP32["rtol"], atol=FP32["atol"] * want.abs().max().item())
    live = slots >= 0
    assert torch.equal(flat[slots[live]], kv[live])
    untouched = torch.ones(nslots, dtype=torch.bool)
    untouched[slots[live]] = False
    assert torch.isnan(flat[untouched]).all(), "a negative slot or a masked row wrote the cache"


@interpreted
@pytest.mark.parametrize("B", [1, 3, 17, 33])
@pytest.mark.parametrize("splits", [1, 2])
def test_prologue_batch_sizes_match_reference_and_unfused(mla, monkeypatch, B, splits):
    """The whole fused call (prologue, split, merge) across the prologue's row tiles, padding rows
    (slot -1) among live ones, against the reference and the unfused (torch write + bmm) path."""
    _short_chunks(mla, monkeypatch)
    lens = [0 if i % 4 == 1 else 1 + (7 * i) % 23 for i in range(B)]
    args, kw = _case(B * 10 + splits, lens, H=4, bs=2, gate=True)   # 4 heads: the interpreter's time is B x H
    fused = _check(mla, args, kw, num_splits=splits)
    unfused = _check(mla, args, kw, num_splits=splits, fused=False)
    scale = unfused.abs().max().item() + 1e-6
    torch.testing.assert_close(fused, unfused, rtol=FP32["rtol"], atol=FP32["atol"] * scale)


def test_num_splits_heuristic_is_static():
    from latency_specialized.kernels.mla_decode_triton import MAX_SPLITS, choose_num_splits, min_chunk

    assert choose_num_splits(1, 12, 32768, 132) == min(2 * 132, MAX_SPLITS)
    assert choose_num_splits(8, 12, 32768, 132) == 33           # 264 programs: 2 per SM
    assert choose_num_splits(64, 12, 32768, 132) == 4           # 256 programs, not 320 (a tail wave)
    assert choose_num_splits(64, 96, 32768, 132) == 1           # 6 head groups: the batch alone fills it
    assert choose_num_splits(1, 12, 4 * min_chunk(1), 132) == 4  # capacity bound: chunks of min_chunk(batch)
    assert choose_num_splits(4, 12, 4 * min_chunk(4), 132) == 4
    assert min_chunk(1) == min_chunk(2) < min_chunk(3)            # shorter chunks for one or two sequences
    # the sparse kernel has its own small-batch chunk (measured apart; today the same 32)
    assert min_chunk(1, sparse=True) == min_chunk(2, sparse=True) < min_chunk(3, sparse=True) == min_chunk(3)


def test_merge_v_block_spreads_small_batches():
    from latency_specialized.kernels.mla_decode_triton import merge_v_block

    assert merge_v_block(1, 12, 128, 132) == 16      # 96 programs instead of 12
    assert merge_v_block(4, 12, 128, 132) == 16      # 384 programs: >= 2 per SM
    assert merge_v_block(8, 12, 128, 132) == 128     # 96 heads: re-merging per v block costs more (measured)
    assert merge_v_block(64, 12, 128, 132) == 128    # the batch alone fills the GPU: one block per head
    assert merge_v_block(3, 20, 24, 132) == 16       # never below 16 values per program


def test_pdl_only_for_one_partial_wave_of_split_programs(monkeypatch):
    """PDL where the split grid fits one program per SM (measured: faster at 68 split programs, slower
    at 136-256); never on the CPU / interpreter, nor without Triton's grid dependency control. Off by
    default until its GPU test has run (``PDL``'s docstring): the rule is checked switched on."""
    from latency_specialized.kernels import mla_decode_triton as mk

    assert mk.PDL is False
    monkeypatch.setattr(mk, "PDL", True)
    monkeypatch.setattr(tc, "interpreting", lambda: False)
    monkeypatch.setattr(mk, "sm_count", lambda device: 132)
    monkeypatch.setattr(tc, "capability", lambda device: (9, 0))
    monkeypatch.setattr(tc, "triton_has_gdc", lambda: True)
    gpu = torch.device("cuda", 0)
    assert mk.pdl_enabled(gpu, 68) and mk.pdl_enabled(gpu, 132)
    assert not mk.pdl_enabled(gpu, 136) and not mk.pdl_enabled(gpu, 256)
    assert not mk.pdl_enabled(torch.device("cpu"), 1)
    monkeypatch.setattr(tc, "capability", lambda device: (8, 0))
    assert not mk.pdl_enabled(gpu, 68)                           # griddepcontrol needs sm_90
    monkeypatch.setattr(tc, "capability", lambda device: (9, 0))
    monkeypatch.setattr(tc, "triton_has_gdc", lambda: False)
    assert not mk.pdl_enabled(gpu, 68)
    monkeypatch.setattr(tc, "triton_has_gdc", lambda: True)
    monkeypatch.setattr(mk, "PDL", False)
    assert not mk.pdl_enabled(gpu, 68)
    assert mk._pdl_args(True, 4) == {"num_warps": 4, "PDL": True, "launch_pdl": True}
    assert mk._pdl_args(False, 8) == {"num_warps": 8, "PDL": False}


def test_late_merge_pdl_only_behind_a_split_kernel_without_pdl(monkeypatch):
    """The tiled merge launches with PDL on its own (the split programs trigger it at their end) only where
    the three kernels do not already, the merge is tiled, MERGE_PDL is on, on sm_90+ with gdc."""
    from latency_specialized.kernels import mla_decode_triton as mk

    monkeypatch.setattr(tc, "interpreting", lambda: False)
    monkeypatch.setattr(tc, "capability", lambda device: (9, 0))
    monkeypatch.setattr(tc, "triton_has_gdc", lambda: True)
    gpu = torch.device("cuda", 0)
    assert mk.late_merge_pdl(gpu, False, True)
    assert not mk.late_merge_pdl(gpu, True, True) and not mk.late_merge_pdl(gpu, False, False)
    assert not mk.late_merge_pdl(torch.device("cpu"), False, True)
    monkeypatch.setattr(tc, "capability", lambda device: (8, 0))
    assert not mk.late_merge_pdl(gpu, False, True)
    monkeypatch.setattr(tc, "capability", lambda device: (9, 0))
    monkeypatch.setattr(mk, "MERGE_PDL", False)
    assert not mk.late_merge_pdl(gpu, False, True)


def test_unsupported_widths_raise_a_user_error(mla):
    args, kw = _case(3, [4], L=24, R=8, nope=8, v=8)
    with pytest.raises(UserError, match="torch_paged"):
        mla.mla_decode_triton(*args, **kw)


def _ctx(arch="sm_90", dtype="bfloat16", **attrs):
    return make_context("attention.mla", arch=arch, dtype=dtype, tokens=4, world_size=8,
                        dims=dict(heads=12, kv_lora=512, rope=64, nope=128, v=128), attrs=attrs)


def test_supports_names_the_reason(mla):
    sup = mla.IMPLEMENTATIONS[0].supports
    assert sup(_ctx()) is True and sup(_ctx("sm_100a")) is True
    assert "GPU" in sup(_ctx("cpu")) and "sm_80" in sup(_ctx("sm_75"))
    assert "sparse" in sup(_ctx(sparse_topk=2048))
    bad = make_context("attention.mla", arch="sm_90", dtype="bfloat16", tokens=1,
                       dims=dict(heads=8, kv_lora=16, rope=8, nope=8, v=8))
    assert "rope 8" in sup(bad)


def test_registered_above_torch_paged():
    from latency_specialized.plugins import get_registry

    names = [i.name for i in get_registry().implementations.family("attention.mla")]
    assert names.index("attention.mla.triton_splitkv") < names.index("attention.mla.torch_paged")


@interpreted
@pytest.mark.parametrize("merge_l,merge_tile", [(1 << 12, 1 << 30), (1 << 12, 64), (16, 32)],
                         ids=["whole_latent", "whole_latent_capped_split_tile", "narrow"])
def test_fused_merge_tile_shapes(mla, monkeypatch, merge_l, merge_tile):
    """The fused merge's latent tile (MERGE_L_FUSED, clamped to L) and split-tile cap (MERGE_TILE) change
    how a program walks the partials, never the result: several live splits, padding rows, a gate."""
    _short_chunks(mla, monkeypatch)
    monkeypatch.setattr(mla, "MERGE_L_FUSED", merge_l)
    monkeypatch.setattr(mla, "MERGE_TILE", merge_tile)
    args, kw = _case(77, [0, 40, 7, 33], H=4, bs=2, gate=True)
    for splits in (1, 3, 5):
        _check(mla, args, kw, num_splits=splits)


@interpreted
@pytest.mark.parametrize("bs,lens,splits", [(2, [0, 1, 7, 33, 0, 20], 3), (16, [33, 0, 64, 5], 1)])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_epilogue"])
def test_kv_norm_matches_reference(mla, monkeypatch, bs, lens, splits, fused):
    """kv_norm_weight: the raw latent (a strided column slice) normalised inside the op - by the prologue's
    latent writers (fused) or rmsnorm_reference (unfused) - against the reference with the same norm; the
    cache rows hold the normed latent (``_check``), padding rows write nothing."""
    _short_chunks(mla, monkeypatch)
    args, kw = _norm_case(bs * 100 + splits * 10 + 9, lens, bs=bs, gate=True)
    _check(mla, args, kw, num_splits=splits, fused=fused)


@interpreted
def test_kv_norm_medium_widths_fused_equals_unfused(mla, monkeypatch):
    """L = 64 in several prologue column tiles (each recomputes its rows' sum of squares over all 64
    columns), two head groups, 17 rows (two prologue row tiles); fused == unfused == reference."""
    _short_chunks(mla, monkeypatch)
    monkeypatch.setattr(mla, "PROLOGUE_L", 16)
    lens = [0 if i % 4 == 1 else 1 + (7 * i) % 23 for i in range(17)]
    args, kw = _norm_case(29, lens, H=20, L=64, R=32, nope=32, v=24, bs=4, gate=True)
    fused = _check(mla, args, kw, num_splits=2)
    unfused = _check(mla, args, kw, num_splits=2, fused=False)
    scale = unfused.abs().max().item() + 1e-6
    torch.testing.assert_close(fused, unfused, rtol=FP32["rtol"], atol=FP32["atol"] * scale)


@interpreted
@pytest.mark.parametrize("B", [1, 17])
def test_prologue_writes_normed_latents(mla, monkeypatch, B):
    """The prologue kernel alone with the norm: NaN-poisoned cache rows at the live slots == the norm
    reference of the raw (strided) latent | k_pe, nothing else written; q_lat as without the norm."""
    monkeypatch.setattr(mla, "PROLOGUE_L", 16)            # L = 32: two column tiles, each normalising its half
    g = torch.Generator().manual_seed(B + 4242)
    H, L, R, nope = 3, 32, 16, 16
    q = torch.randn(B, H, nope + R, generator=g)
    w = torch.randn(H, nope, L, generator=g)
    wide = 2.0 * torch.randn(B, 5 + L + R, generator=g) - 0.3
    kv_c, k_pe = wide[:, 5:5 + L], wide[:, 5 + L:]
    weight = 1.0 + 0.1 * torch.randn(L, generator=g)
    nslots = 2 * B + 5
    slots = torch.randperm(nslots, generator=g)[:B]
    slots[1::3] = -1
    flat = torch.full((nslots, L + R), float("nan"))
    q_lat = torch.full((H, B, L), float("nan"))
    mla._prologue(q, kv_c, k_pe, slots, flat, w, q_lat, kv_norm_weight=weight, kv_norm_eps=1e-6)
    want = torch.bmm(q[..., :nope].transpose(0, 1), w)
    torch.testing.assert_close(q_lat, want, rtol=FP32["rtol"], atol=FP32["atol"] * want.abs().max().item())
    live = slots >= 0
    normed = rmsnorm_reference(kv_c, weight, 1e-6)
    torch.testing.assert_close(flat[slots[live]][:, :L], normed[live], rtol=1e-6, atol=1e-6)
    assert torch.equal(flat[slots[live]][:, L:], k_pe[live])
    untouched = torch.ones(nslots, dtype=torch.bool)
    untouched[slots[live]] = False
    assert torch.isnan(flat[untouched]).all(), "a negative slot or a masked row wrote the cache"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("paged", [False, True], ids=["reference", "torch_paged"])
def test_kv_norm_contract_is_norm_then_attention(dtype, paged):
    """The contract: with kv_norm_weight the torch implementations equal themselves called on
    ``rmsnorm_reference(kv_c)`` exactly (results and caches), in fp32 and bf16 (one rounding of the
    normed latent to the activation dtype), for a strided raw latent."""
    fn = mla_decode_paged if paged else mla_decode_reference
    args, kw = _norm_case(31, [0, 5, 12, 1], bs=2, gate=True)
    args = tuple(t.to(dtype) if t.is_floating_point() else t for t in args)
    kw = {k: (t.to(dtype) if isinstance(t, torch.Tensor) else t) for k, t in kw.items()}
    q, kv_c, k_pe, cache, *rest = args
    if paged:  # torch_paged reads every block id of the table (clamping negatives): no garbage ids
        rest[1] = torch.where(rest[1] >= cache.shape[0], -1, rest[1])
    wide = torch.cat([torch.zeros(kv_c.shape[0], 3, dtype=dtype), kv_c], -1)
    kv_c = wide[:, 3:]                                    # .to(dtype) made it contiguous: strided again
    norm = {k: kw.pop(k) for k in ("kv_norm_weight", "kv_norm_eps")}
    c_fused, c_plain = cache.clone(), cache.clone()
    got = fn(q, kv_c, k_pe, c_fused, *rest, **kw, **norm)
    normed = rmsnorm_reference(kv_c, norm["kv_norm_weight"], norm["kv_norm_eps"])
    assert normed.dtype == dtype
    want = fn(q, normed, k_pe, c_plain, *rest, **kw)
    assert torch.equal(got, want)
    torch.testing.assert_close(c_fused, c_plain, rtol=0, atol=0, equal_nan=True)
    live = rest[0] >= 0
    assert torch.equal(c_fused.view(-1, c_fused.shape[-1])[rest[0][live]], torch.cat([normed, k_pe], -1)[live])


@pytest.mark.parametrize("bad,match", [
    (lambda w: w[:-1], "needs \\[32\\]"),
    (lambda w: w.view(1, -1), "needs \\[32\\]"),
    (lambda w: w.double(), "dtype"),
])
def test_kv_norm_bad_weight_raises_a_user_error(mla, bad, match):
    """A wrong kv_norm_weight is refused before any work (every implementation), naming the fix."""
    args, kw = _norm_case(37, [3, 4], bs=2)
    kw = dict(kw, kv_norm_weight=bad(kw["kv_norm_weight"]))
    for fn in (mla_decode_reference, mla_decode_paged, mla.mla_decode_triton):
        with pytest.raises(UserError, match=match):
            fn(*args, **kw)


def test_kv_norm_needs_the_latent_in_q_dtype(mla):
    args, kw = _norm_case(41, [3, 4], bs=2)
    args = (args[0], args[1].double(), *args[2:])
    for fn in (mla_decode_reference, mla.mla_decode_triton):
        with pytest.raises(UserError, match="q's dtype"):
            fn(*args, **kw)


def test_no_pdl_wait_inside_a_loop():
    """Every ``gdc_wait`` of the Triton kernels sits outside loops: Triton's software pipeliner issues a loop's first
    loads ahead of the loop body, so a wait inside one does not order them (session 17: the prologue's wait in its k
    loop let q be read before its producer wrote it). Checked on the source, so without a GPU."""
    import ast
    import inspect

    from latency_specialized.kernels import mla_decode_triton as mk

    tree = ast.parse(inspect.getsource(mk))
    waits, in_loops = 0, []

    def visit(node, loops):
        nonlocal waits
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "gdc_wait":
            waits += 1
            if loops:
                in_loops.append(node.lineno)
        inner = loops + [node] if isinstance(node, (ast.For, ast.While)) else loops
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, [])
    assert waits >= 4 and not in_loops, f"gdc_wait inside a loop at line(s) {in_loops}"


# ---------------------------------------------------------------------------------------------- RoPE fused
@interpreted
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_epilogue"])
@pytest.mark.parametrize("bs,lens,splits,gate", [(2, [0, 1, 7, 33, 0, 20], 3, True), (16, [33, 0, 64, 5], 1, False)])
def test_rope_matches_reference(mla, monkeypatch, style, fused, bs, lens, splits, gate):
    """positions + rope_inv_freq: the op rotates q's rope part (every head) and k_pe - in the prologue launch
    (fused) or by the torch rotation (unfused) - against the reference given the same positions; the cache
    holds the rotated k_pe at exactly the live slots; padding rows write nothing and give zeros."""
    _short_chunks(mla, monkeypatch)
    args, kw = _case(bs * 100 + splits * 10 + gate + 51, lens, bs=bs, gate=gate)
    rope = _rope(len(lens), 16, bs + splits, style, dtype=torch.int32 if gate else torch.int64)
    _check(mla, args, dict(kw, **rope), num_splits=splits, fused=fused)


@interpreted
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_with_kv_norm_odd_widths(mla, monkeypatch, style):
    """RoPE and the kv_a norm together at odd widths: H = 20 (two head groups), nope 24 (a masked K step),
    v 24, R = 32, L = 64 in prologue column tiles of 16 (only tile 0 rotates; every tile normalises),
    padding rows among live ones: fused == unfused == reference (row tiles: the prologue case below)."""
    _short_chunks(mla, monkeypatch)
    monkeypatch.setattr(mla, "PROLOGUE_L", 16)
    lens = [0 if i % 4 == 1 else 1 + (7 * i) % 23 for i in range(6)]
    args, kw = _norm_case(61, lens, H=20, L=64, R=32, nope=24, v=24, bs=4, gate=True)
    kw = dict(kw, **_rope(len(lens), 32, 3, style))
    fused = _check(mla, args, kw, num_splits=2)
    unfused = _check(mla, args, kw, num_splits=2, fused=False)
    scale = unfused.abs().max().item() + 1e-6
    torch.testing.assert_close(fused, unfused, rtol=FP32["rtol"], atol=FP32["atol"] * scale)


@interpreted
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_glm_shapes(mla, monkeypatch, style):
    """GLM-5.3 per-rank widths (TP8: 8 heads, kv_lora 512, rope 64, nope 192, v 256, no gate) with the
    kv_a norm and RoPE fused, padding rows among live ones, two splits."""
    _short_chunks(mla, monkeypatch)
    args, kw = _norm_case(67, [0, 3, 40, 17], H=8, L=512, R=64, nope=192, v=256, bs=16)
    _check(mla, args, dict(kw, **_rope(4, 64, 1, style, theta=1e6)), num_splits=2)


@interpreted
@pytest.mark.parametrize("B", [1, 17, 33])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_prologue_rotates_q_pe_and_k_pe(mla, monkeypatch, B, style):
    """The prologue kernel alone with RoPE: the NaN-poisoned q_pe [B, H, R] == apply_rope of q's rope part
    for every row (row tiles crossed at 17 and 33) and head, written by column tile 0 only (L = 32 in two
    tiles); q_lat as without RoPE; cache rows at the live slots == [kv_c | apply_rope(k_pe)], nothing else
    written. q is a strided view (rows of a wider projection), k_pe a column slice."""
    monkeypatch.setattr(mla, "PROLOGUE_L", 16)
    g = torch.Generator().manual_seed(B * 31 + len(style))
    H, L, R, nope = 5, 32, 16, 24
    q = torch.randn(B, H * (nope + R) + 8, generator=g)[:, 8:].view(B, H, nope + R)
    w = torch.randn(H, nope, L, generator=g)
    kv = torch.randn(B, 3 + L + R, generator=g)[:, 3:]
    nslots = 2 * B + 5
    slots = torch.randperm(nslots, generator=g)[:B]
    slots[1::3] = -1
    rope = _rope(B, R, B, style)
    flat = torch.full((nslots, L + R), float("nan"))
    q_lat = torch.full((H, B, L), float("nan"))
    q_pe = torch.full((B, H, R), float("nan"))
    mla._prologue(q, kv[:, :L], kv[:, L:], slots, flat, w, q_lat, q_pe=q_pe, **rope)
    assert not torch.isnan(q_pe).any(), "q_pe rows left unwritten"
    sty = "interleaved" if rope["rope_interleaved"] else "neox"
    want_q = apply_rope(q[..., nope:], rope["positions"], rope["rope_inv_freq"], sty)
    torch.testing.assert_close(q_pe, want_q, rtol=2e-6, atol=2e-6)
    assert not torch.allclose(q_pe, q[..., nope:]), "nothing rotated"
    want = torch.bmm(q[..., :nope].transpose(0, 1), w)
    torch.testing.assert_close(q_lat, want, rtol=FP32["rtol"], atol=FP32["atol"] * want.abs().max().item())
    live = slots >= 0
    k_rot = apply_rope(kv[:, L:].unsqueeze(1), rope["positions"], rope["rope_inv_freq"], sty).squeeze(1)
    assert torch.equal(flat[slots[live]][:, :L], kv[live][:, :L])
    torch.testing.assert_close(flat[slots[live]][:, L:], k_rot[live], rtol=2e-6, atol=2e-6)
    untouched = torch.ones(nslots, dtype=torch.bool)
    untouched[slots[live]] = False
    assert torch.isnan(flat[untouched]).all(), "a negative slot or a masked row wrote the cache"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rotate_pairs_is_apply_rope(dtype, style):
    """The kernels' torch rotation (``mla_common.rotate_pairs``: the unfused path) is ``ops.rope.apply_rope``
    over a whole-width rope part bit for bit, int32 and int64 positions, a strided input."""
    from latency_specialized.kernels.mla_common import rotate_pairs

    g = torch.Generator().manual_seed(5)
    x = (3 * torch.randn(6, 4, 64 + 16, generator=g)).to(dtype)[..., 16:]
    inv = rope_inv_freq(1e6, 64)
    for pdt in (torch.int32, torch.int64):
        pos = torch.tensor(POSITIONS[:6], dtype=pdt)
        assert torch.equal(rotate_pairs(x, pos, inv, style == "interleaved"), apply_rope(x, pos, inv, style))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("paged", [False, True], ids=["reference", "torch_paged"])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_contract_is_rotate_then_attention(dtype, paged, style):
    """The contract: with positions the torch implementations equal themselves called on apply_rope-rotated
    q (rope part) and k_pe exactly - results and caches - with the kv norm too: the rotation the MLA piece
    did before the call, now inside the op."""
    fn = mla_decode_paged if paged else mla_decode_reference
    args, kw = _norm_case(71, [0, 5, 12, 1], bs=2, gate=True)
    args = tuple(t.to(dtype) if t.is_floating_point() else t for t in args)
    kw = {k: (t.to(dtype) if isinstance(t, torch.Tensor) else t) for k, t in kw.items()}
    q, kv_c, k_pe, cache, *rest = args
    if paged:  # torch_paged reads every block id of the table (clamping negatives): no garbage ids
        rest[1] = torch.where(rest[1] >= cache.shape[0], -1, rest[1])
    rope = _rope(4, 16, 2, style)
    sty = "interleaved" if rope["rope_interleaved"] else "neox"
    nope = kw["qk_nope_head_dim"]
    q_rot = torch.cat([q[..., :nope], apply_rope(q[..., nope:], rope["positions"], rope["rope_inv_freq"], sty)], -1)
    k_rot = apply_rope(k_pe.unsqueeze(1), rope["positions"], rope["rope_inv_freq"], sty).squeeze(1)
    c_fused, c_plain = cache.clone(), cache.clone()
    got = fn(q, kv_c, k_pe, c_fused, *rest, **kw, **rope)
    want = fn(q_rot, kv_c, k_rot, c_plain, *rest, **kw)
    assert torch.equal(got, want)
    torch.testing.assert_close(c_fused, c_plain, rtol=0, atol=0, equal_nan=True)
    unrotated = fn(q, kv_c, k_pe, cache.clone(), *rest, **kw)
    assert not torch.equal(got, unrotated), "positions changed nothing"


@pytest.mark.parametrize("bad,match", [
    (lambda r: dict(r, rope_inv_freq=None), "both positions"),
    (lambda r: dict(r, positions=None), "both positions"),
    (lambda r: dict(r, rope_inv_freq=r["rope_inv_freq"][:-1]), "needs \\[8\\] float32"),
    (lambda r: dict(r, rope_inv_freq=r["rope_inv_freq"].double()), "float32"),
    (lambda r: dict(r, positions=r["positions"].float()), "int"),
    (lambda r: dict(r, positions=r["positions"][:1]), "needs \\[2\\] int"),
])
def test_rope_bad_arguments_raise_a_user_error(mla, bad, match):
    """A wrong RoPE argument is refused before any work by every implementation, naming the fix."""
    args, kw = _case(73, [3, 4], bs=2)
    kw = dict(kw, **bad(_rope(2, 16, 0, "neox")))
    for fn in (mla_decode_reference, mla_decode_paged, mla.mla_decode_triton):
        with pytest.raises(UserError, match=match):
            fn(*args, **kw)


def test_supports_rope_sites(mla):
    """Every implementation of the family rotates: a RoPE site (GLM-5.3's attrs) is served as a NoPE one."""
    from latency_specialized.plugins import get_registry

    for style in (False, True):
        ctx = _ctx(rope=True, rope_interleaved=style)
        assert mla.IMPLEMENTATIONS[0].supports(ctx) is True
        for impl in get_registry().implementations.family("attention.mla"):
            assert impl.supports(_ctx("sm_90", rope=True, rope_interleaved=style)) is True, impl.name


def _arg_signature(fn, types: dict[str, str]) -> dict[str, str]:
    """A kernel's whole signature in its argument order: the given types, "constexpr" for the rest."""
    return {name: types.get(name, "constexpr") for name in fn.arg_names}


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_rope_prologue_compiles_for_hopper_with_accurate_cos_sin(mla, interleaved):
    """The prologue with RoPE builds for sm_90 on the CPU at GLM-5.3 widths (bf16, nope 192, L 512, R 64), and
    its cos/sin are libdevice's (``__nv_cosf`` / ``__nv_sinf``: full range reduction), not the ``.approx``
    instructions, whose error grows with the angle (positions of 1e5 give angles of 1e5 rad). Needs a process
    that is not interpreting (``_kernels(False)``)."""
    import os

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("compiles only where triton was imported without the interpreter")
    fn = mla._kernels(False)["prologue"]
    ptr = dict(q="*bf16", w_uk="*bf16", kv_c="*bf16", k_pe="*bf16", slots="*i64", cache="*bf16", q_lat="*bf16",
               kv_w="*bf16", q_rope="*bf16", q_pe="*bf16", positions="*i64", inv_freq="*fp32")
    ints = ("B", "H", "NOPE", "s_qb", "s_qh", "s_wh", "s_wk", "s_lh", "s_lb", "s_c", "s_p", "s_row", "s_rb", "s_rh",
            "s_eb", "s_eh")
    sig = {**ptr, **{n: "i32" for n in ints}, "eps": "fp32"}
    const = dict(L=512, R=64, BB=16, BL=64, BK=128, PREC="tf32", HAS_NORM=True, PDL=False, ROPE=True,
                 INTERLEAVED=interleaved)
    src = ASTSource(fn=fn, signature=_arg_signature(fn, sig), constexprs=const)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
    assert "__nv_cosf" in ptx and "__nv_sinf" in ptx
    assert "sin.approx" not in ptx and "cos.approx" not in ptx


def test_rope_calls_compile_for_hopper(mla, monkeypatch):
    """Every launch of a dense and a sparse call with RoPE (both layouts, kv norm, GLM-5.3 TP8 widths, bf16)
    builds for sm_90 on the CPU (``tests/triton_offline.py``: recorded, not run)."""
    import os

    from latency_specialized.kernels.sparse_mla_triton import sparse_mla_decode_triton

    from tests.triton_offline import compile_for_hopper, recorded_launches

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("compiles only where triton was imported without the interpreter")
    monkeypatch.setattr(mla, "sm_count", lambda device: 132)
    B, H, L, R, nope, v, bs, d = 2, 8, 512, 64, 192, 256, 64, torch.bfloat16
    cache = torch.zeros(4, bs, L + R, dtype=d)
    blocks = torch.arange(4, dtype=torch.int32).view(2, 2)
    q, kv = torch.randn(B, H, nope + R).to(d), torch.randn(B, L + R).to(d)
    w = torch.randn(H * (nope + v), L).to(d)
    args = (q, kv[:, :L], kv[:, L:], cache, torch.tensor([1, 70]), blocks, torch.tensor([2, 7], dtype=torch.int32), w)
    kw = dict(qk_nope_head_dim=nope, v_head_dim=v, kv_norm_weight=torch.ones(L, dtype=d))
    with recorded_launches() as launches:
        for style in ("neox", "interleaved"):
            rope = _rope(B, R, 1, style)
            mla.mla_decode_triton(*args, **kw, **rope)
            sparse_mla_decode_triton(*args, torch.zeros(B, 2048, dtype=torch.int32), **kw, **rope)
    assert {fn.fn.__name__ for fn, _, _ in launches} >= {"prologue_kernel", "split_kernel"}
    assert compile_for_hopper(launches) == {}


def test_fused_merge_at_glm_batch_64_holds_kimis_tile_and_does_not_spill(mla, monkeypatch):
    """GLM-5.3 TP8 (8 heads, v 256) at batch 64, 32K: the fused merge runs 128-wide v blocks over the whole latent
    (``MERGE_W_TILE``: Kimi K3's measured program shape) - with v 256 in one program its sm_90 cubin had 5,608 bytes
    of stack (32 registers: the W_UV tile in local memory); now at most Kimi's 72-80 bytes."""
    import os

    from tests.triton_offline import recorded_launches, resource_usage

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("compiles only where triton was imported without the interpreter")
    monkeypatch.setattr(mla, "sm_count", lambda device: 132)
    B, H, L, R, nope, v, bs, d = 64, 8, 512, 64, 192, 256, 64, torch.bfloat16
    nb = 32768 // bs + 1
    cache = torch.zeros(nb, bs, L + R, dtype=d)
    q, kv = torch.randn(B, H, nope + R).to(d), torch.randn(B, L + R).to(d)
    args = (q, kv[:, :L], kv[:, L:], cache, torch.zeros(B, dtype=torch.long),
            torch.arange(nb, dtype=torch.int32).repeat(B, 1), torch.full((B,), 32768, dtype=torch.int32),
            torch.randn(H * (nope + v), L).to(d))
    with recorded_launches() as launches:
        mla.mla_decode_triton(*args, qk_nope_head_dim=nope, v_head_dim=v, kv_norm_weight=torch.ones(L, dtype=d))
    merge = [x for x in launches if x[0].fn.__name__ == "merge_kernel"]
    assert len(merge) == 1 and merge[0][2]["V_PAD"] * merge[0][2]["ML"] <= mla.MERGE_W_TILE
    (regs, stack), = resource_usage(merge).values()
    assert stack <= 128, (regs, stack)


@pytest.mark.parametrize("B", [1, 2, 3])
def test_dense_and_sparse_calls_launch_their_own_small_batch_chunk(mla, B, monkeypatch):
    """The split and merge kernels of a dense call get ``min_chunk(B)`` and those of a sparse call
    ``min_chunk(B, sparse=True)`` (both kernels must apply the same chunk rule; the interpreter cases set the two
    constants equal, so only the launches tell them apart); recorded, not run (``tests/triton_offline.py``). The
    sparse constant is set apart from the dense one here: the defaults may agree."""
    import os

    from latency_specialized.kernels.sparse_mla_triton import sparse_mla_decode_triton

    from tests.triton_offline import recorded_launches

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("records compiled launches only where triton was imported without the interpreter")
    monkeypatch.setattr(mla, "SPARSE_MIN_CHUNK_SMALL_BATCH", 2 * mla.MIN_CHUNK_SMALL_BATCH)
    args, kw = _case(B, [5] * B, bs=4, L=32, R=16)
    with recorded_launches() as dense:
        mla.mla_decode_triton(*args, **kw, num_splits=2)
    args, kw = _case(B, [5] * B, bs=4, L=32, R=16)
    with recorded_launches() as sparse:
        sparse_mla_decode_triton(*args, torch.zeros(B, 64, dtype=torch.int32), **kw, num_splits=2)
    for launches, want in ((dense, mla.min_chunk(B)), (sparse, mla.min_chunk(B, sparse=True))):
        chunks = {fn.fn.__name__: k["MIN_CHUNK"] for fn, _, k in launches if "MIN_CHUNK" in k}
        assert "split_kernel" in chunks and any(n.startswith("merge") for n in chunks), chunks
        assert set(chunks.values()) == {want}, chunks
    assert B > mla.SMALL_BATCH or mla.min_chunk(B) != mla.min_chunk(B, sparse=True)

