"""attention.indexer.triton on the CPU: the Triton interpreter in fp32, the sm_90 compile, dispatch, and the
reference's ``k_norm_kind="rms"``.

The kernel cases (marker ``interpreter_case``) run in a child process started with ``TRITON_INTERPRET=1``
(``tests/interpret.py``; ``test_kernel_cases_under_the_interpreter`` drives them), as in
``test_mla_triton.py``. Every tensor is fp32 (the interpreter's bf16 is unreliable here).

Every case: fresh random inputs; ``out`` poisoned with garbage; every cache row that no live position
reads poisoned with NaN (the new tokens' slots before the write too); -1 or poisoned spare block ids past
each sequence's end; seq_lens 0 / 1 / < K / = K / > K in one batch; padding rows (slot -1). The selection is
a set: each row must hold ``min(K, seq_len)`` distinct live positions and -1 elsewhere, and the
reference logits of the selected positions must equal (as a multiset, to fp32 rounding) the reference's
top-K logits - so any valid choice among ties passes. The cache must change at exactly the live slots,
to the reference's values.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.attention.sparse_mla import indexer_topk_reference, rotate_leading
from latency_specialized.ops.registry import make_context

from tests.interpret import programs_in_reverse, run_interpreted

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (its interpreter runs the kernels on the CPU)")
interpreted = pytest.mark.interpreter_case
"""Needs TRITON_INTERPRET=1 from the process start: collected only there (the driver below runs these)."""

SELECTIONS = pytest.mark.parametrize("selection", ["radix", "split", "torch"])


@pytest.mark.interpreter_driver
def test_kernel_cases_under_the_interpreter():
    run_interpreted(__file__, min_passed=66)


@pytest.fixture
def ix():
    from latency_specialized.kernels import indexer_triton

    return indexer_triton


def _early_exit(ix, monkeypatch, early: bool) -> None:
    """``SELECT_EARLY_EXIT`` set to ``early``; without the early exit the select cannot start from the leading-byte
    counts (``SELECT_FIRST_BYTE``, on by default: the op refuses the pair), so those go off with it."""
    monkeypatch.setattr(ix, "SELECT_EARLY_EXIT", early)
    if not early:
        monkeypatch.setattr(ix, "SELECT_FIRST_BYTE", False)


@pytest.fixture
def tk():
    from latency_specialized.kernels import topk_triton

    return topk_triton


def _inv_freq(rope: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, rope, 2).float() / rope))


def _case(seed, lens, *, H=4, D=32, K=8, bs=4, rope=8, interleaved=True, norm="layer", bias=True, spare=3,
          strided=False, per=None, near_ties=False, dead_slots=()):
    """Inputs as the sparse MLA piece passes them (q a view of a projection, k / weights column slices)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    per = per or max(-(-max(max(lens), 1) // bs), 1) + 1
    nb = B * per + spare
    cache = torch.randn(nb, bs, D, generator=g)
    if near_ties:  # keys equal up to their last bits: the radix passes past the first byte decide
        cache = cache[:1, :1] + 1e-3 * cache
    perm = torch.randperm(nb, generator=g)
    blocks, spare_id = perm[:B * per].view(B, per).to(torch.int32), int(perm[B * per])
    slots = torch.full((B,), -1, dtype=torch.int64)
    read = torch.zeros(nb * bs, dtype=torch.bool)
    for b, n in enumerate(lens):
        if n > 0 and b not in dead_slots:
            p = n - 1
            slots[b] = int(blocks[b, p // bs]) * bs + p % bs
        pos = torch.arange(n if b in dead_slots else max(n - 1, 0))
        read[blocks[b, pos // bs].long() * bs + pos % bs] = True
        # past the end: -1, or a spare (NaN-poisoned) block - never read (the reference needs ids in range)
        blocks[b, -(-n // bs):] = -1 if b % 2 else spare_id
    cache.view(-1, D)[~read] = float("nan")
    proj = torch.randn(B, H * D + D + H + 3, generator=g)    # [q | k | weights | other columns]
    proj[:, H * D:H * D + D] = 2.0 * proj[:, H * D:H * D + D] + 0.3   # the raw key off zero mean / unit variance
    if strided:
        q, k, w = proj[:, :H * D].view(B, H, D), proj[:, H * D:H * D + D], proj[:, H * D + D:H * D + D + H]
    else:
        q, k, w = (proj[:, :H * D].reshape(B, H, D).clone(), proj[:, H * D:H * D + D].clone(),
                   proj[:, H * D + D:H * D + D + H].clone())
    lens_t = torch.tensor(lens, dtype=torch.int32)
    kw = dict(topk=K, positions=(lens_t.long() - 1).clamp(min=0) * 37)
    if rope:
        kw.update(rope_inv_freq=_inv_freq(rope), rope_interleaved=interleaved)
    if norm:
        kw.update(k_norm_weight=1.0 + 0.2 * torch.randn(D, generator=g), k_norm_eps=1e-5, k_norm_kind=norm)
        if norm == "layer" and bias:
            kw["k_norm_bias"] = 0.1 * torch.randn(D, generator=g)
    return (q, k, w, cache, slots, blocks, lens_t), kw


def _ref_logits(q, w, cache, blocks, seq_lens, kw) -> torch.Tensor:
    """[B, capacity] fp32 logits of the contract over a written cache (-inf past seq_len)."""
    B, H, D = q.shape
    qf = q.float()
    if kw.get("rope_inv_freq") is not None:
        qf = rotate_leading(qf, kw["positions"], kw["rope_inv_freq"], kw.get("rope_interleaved", False))
    bs = cache.shape[1]
    pos = torch.arange(blocks.shape[1] * bs)
    rows = blocks[:, pos // bs].long().clamp(min=0, max=cache.shape[0] - 1) * bs + pos % bs
    valid = pos[None, :] < seq_lens.long()[:, None]
    ctx = torch.where(valid[..., None], cache.view(-1, D)[rows].float(), 0.0)
    s = torch.einsum("bhd,btd->bht", qf, ctx).clamp(min=0)
    lg = torch.einsum("bht,bh->bt", s, w.float()) * (D ** -0.5 * H ** -0.5)
    return lg.masked_fill(~valid, float("-inf"))


def check_selection(got: torch.Tensor, logits: torch.Tensor, seq_lens: torch.Tensor, K: int, *, atol: float,
                    rtol: float) -> None:
    """``got`` [B, K] is a valid top-K set of ``logits`` (reference, -inf past seq_len): counts, ranges,
    distinct positions, and the selected logits equal the K largest as multisets (ties: any choice)."""
    for b in range(got.shape[0]):
        n = int(seq_lens[b])
        row = got[b].long().cpu()
        live = row[row >= 0]
        want = min(K, n)
        assert len(live) == want and int((row == -1).sum()) == K - want, f"row {b}: {row.tolist()} (seq_len {n})"
        assert len(set(live.tolist())) == want and bool((live < n).all()), f"row {b}: {row.tolist()} (seq_len {n})"
        if want:
            lg = logits[b, :max(n, 1)].float().cpu()
            top = torch.topk(lg, want).values.sort().values
            sel = lg[live].sort().values
            torch.testing.assert_close(sel, top, atol=atol * max(1.0, float(lg.abs().max())), rtol=rtol,
                                       msg=lambda m: f"row {b}: selected logits are not the top {want}: {m}")


def _check(ix, args, kw, **call):
    q, k, w, cache, slots, blocks, seq_lens = args
    K = kw["topk"]
    before, c_ref, c_tri = cache.clone(), cache.clone(), cache.clone()
    want = indexer_topk_reference(q, k, w, c_ref, slots, blocks, seq_lens, **kw)
    out = torch.randint(-(2 ** 20), 2 ** 20, (q.shape[0], K), dtype=torch.int32)   # poisoned
    got = ix.indexer_topk_triton(q, k, w, c_tri, slots, blocks, seq_lens, out=out, **kw, **call)
    assert got is out
    logits = _ref_logits(q, w, c_ref, blocks, seq_lens, kw)
    check_selection(want, logits, seq_lens, K, atol=0, rtol=0)      # the checker accepts the reference
    check_selection(got, logits, seq_lens, K, atol=1e-5, rtol=1e-5)
    D = cache.shape[-1]
    changed = torch.zeros(cache.shape[0] * cache.shape[1], dtype=torch.bool)
    if k is not None:   # k=None: no key step, the cache untouched
        changed[slots[slots >= 0]] = True
    flat, flat0, flat_ref = c_tri.view(-1, D), before.view(-1, D), c_ref.view(-1, D)
    torch.testing.assert_close(flat[~changed], flat0[~changed], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(flat[changed], flat_ref[changed], rtol=1e-5, atol=1e-5)
    return got


def _tied_case(seed, lens, **kw):
    """A case with no rope or norm, K 10, where row 0's weights are 0 (every logit 0, +-0) and row 2's negative
    (negative logits): exact ties for the select."""
    args, kw_ = _case(seed, lens, K=10, bs=4, norm=None, rope=0, **kw)
    w = args[2]
    w[0] = 0.0
    w[2] = -w[2].abs()
    return args, kw_


# ---------------------------------------------------------------------------------------------- interpreter
@interpreted
@SELECTIONS
def test_mixed_lengths_interleaved_layer_norm(ix, selection):
    """seq_len 0 / 1 / K-1 / K / K+1 / >> K in one batch (K = 8), interleaved RoPE, LayerNorm with bias."""
    args, kw = _case(1, [0, 1, 7, 8, 9, 45, 0, 30], K=8)
    _check(ix, args, kw, selection=selection, num_splits=2)


@interpreted
@SELECTIONS
def test_odd_shapes_neox_rms(ix, selection):
    """5 heads (padded to 16), D = 24 (padded to 32), NeoX RoPE of 8 channels, RMS key norm, K = 7, blocks of 3."""
    args, kw = _case(2, [13, 0, 7, 40, 6, 8], H=5, D=24, K=7, bs=3, rope=8, interleaved=False, norm="rms")
    _check(ix, args, kw, selection=selection, num_splits=3)


@interpreted
@SELECTIONS
def test_no_rope_no_norm_and_dead_slots(ix, selection):
    """No RoPE, no norm; rows with live seq_lens but slot -1 write nothing and score the cache as it is."""
    args, kw = _case(3, [20, 9, 33, 2], rope=0, norm=None, dead_slots=(0, 2))
    _check(ix, args, kw, selection=selection, num_splits=1)


@interpreted
@SELECTIONS
def test_no_key_in_this_call(ix, selection):
    """``k=None`` (the new keys written by an earlier op - the fused compressor - or a layer scoring against another
    layer's keys): no key step, the cache untouched (slots given, not read), the selection over the cache as it is."""
    args, kw = _case(5, [20, 9, 33, 0, 2], norm="rms")
    q, k, w, cache, slots, blocks, lens = args
    written = cache.clone()
    indexer_topk_reference(q, k, w, written, slots, blocks, lens, **kw)   # what the key step leaves
    _check(ix, (q, None, w, written, slots, blocks, lens), kw, selection=selection, num_splits=2)


@interpreted
@pytest.mark.parametrize("lens,splits,early,fine", [
    ([0, 1, 7, 8, 9, 45, 0, 30], 2, True, False), ([13, 0, 7, 40, 6, 8], 3, False, False),
    ([60, 80, 150, 9], 7, True, True), ([200, 3], 1, True, False)])
def test_score_kernel_selects_its_rows(ix, monkeypatch, lens, splits, early, fine):
    """``SCORE_SELECTS``: the last scoring program of each row to arrive selects it (one launch): the same valid
    top-K as the select kernel's, for rows short of K, rows with no scoring work, one and many programs a row; the
    arrival counters are back at zero after the call (the next call's count starts there)."""
    monkeypatch.setattr(ix, "SCORE_SELECTS", True)
    _early_exit(ix, monkeypatch, early)
    monkeypatch.setattr(ix, "SELECT_FINE_WIDTHS", fine)
    if fine:   # a 256-wide table holding its rows at 1/4, 3/8 (a pair), 3/4 (a pair) of it
        monkeypatch.setattr(ix, "SELECT_NARROW_MIN_TILE", 64)
    args, kw = _case(30 + splits, lens, K=8, bs=4, per=(64 if fine else None), norm="rms")
    _check(ix, args, kw, selection="radix", num_splits=splits)
    with programs_in_reverse():   # the last to arrive selects, whichever program that is
        _check(ix, args, kw, selection="radix", num_splits=splits)
    assert not ix.arrival_counts(torch.device("cpu"), len(lens)).any()


@interpreted
@pytest.mark.parametrize("case,splits,ahead,select,reverse", [
    ("mixed", 2, False, False, False), ("odd", 3, False, True, True), ("dead", 1, False, False, False),
    ("strided", 2, True, False, True), ("long", 7, True, True, False), ("long", 7, False, True, True),
    ("decisive", 2, False, False, True)])
def test_score_kernel_writes_the_key(ix, monkeypatch, case, splits, ahead, select, reverse):
    """``SCORE_WRITES_KEY``: the scoring program holding a row's last position writes its new key first - the cache
    equals the reference's (the key at each live slot, nothing else), the selection is valid: LayerNorm with bias and
    interleaved RoPE, RMS norm and NeoX RoPE on odd widths, no norm / RoPE with dead slots (slot -1: nothing written,
    the cache scored as it is), strided inputs, 1-7 programs a row, the keys a step ahead; with the select in the
    score kernel too (one launch); programs run in reverse grid order too (no program may rely on another of the
    launch having written the key)."""
    monkeypatch.setattr(ix, "SCORE_WRITES_KEY", True)
    monkeypatch.setattr(ix, "SCORE_KEYS_AHEAD", ahead)
    monkeypatch.setattr(ix, "SCORE_SELECTS", select)
    args, kw = {"mixed": lambda: _case(51, [0, 1, 7, 8, 9, 45, 0, 30], K=8),
                "odd": lambda: _case(52, [13, 0, 7, 40, 6, 8], H=5, D=24, K=7, bs=3, interleaved=False, norm="rms"),
                "dead": lambda: _case(53, [20, 9, 33, 2], rope=0, norm=None, dead_slots=(0, 2)),
                "strided": lambda: _case(54, [17, 3, 26], strided=True),
                "long": lambda: _case(55, [200, 64, 65, 3], K=8),
                "decisive": lambda: _case(57, [65, 66, 3], K=64)}[case]()
    if case == "decisive":   # positive head weights: logits >= 0, so a stale (zeroed) new row scores 0 and leaves the
        args[2].abs_()       # top 64 of 65 that its true key is in - and the new position lies in the second chunk
    with programs_in_reverse() if reverse else contextlib.nullcontext():
        _check(ix, args, kw, selection="radix", num_splits=splits)


@interpreted
@SELECTIONS
def test_strided_inputs_as_the_piece_passes_them(ix, selection):
    """q a view of a projection, k and weights column slices (strided rows)."""
    args, kw = _case(4, [17, 3, 26], strided=True)
    assert args[0].stride(0) != args[0].shape[1] * args[0].shape[2] and not args[1].is_contiguous()
    _check(ix, args, kw, selection=selection, num_splits=2)


@interpreted
@pytest.mark.parametrize("splits,ahead", [(1, False), (3, False), (7, False), (1, True), (3, True)])
def test_many_splits_and_select_tiles(ix, tk, monkeypatch, splits, ahead):
    """Short chunks (several scoring programs per row, some dead) and narrow select tiles (several steps per
    radix pass and per compaction; several programs per row of the split select), contexts well past K; the scoring
    tiles' keys loaded one step ahead or not (``SCORE_KEYS_AHEAD``)."""
    monkeypatch.setattr(ix, "SCORE_KEYS_AHEAD", ahead)
    monkeypatch.setattr(ix, "MIN_CHUNK", 16)
    monkeypatch.setattr(ix, "SELECT_TILE", 64)
    monkeypatch.setattr(ix, "FILL_BLOCK", 16)
    monkeypatch.setattr(tk, "MIN_CHUNK", 32)
    monkeypatch.setattr(tk, "TILE", 32)
    monkeypatch.setattr(tk, "WAVES", 16)          # the CPU counts one SM: several select programs per row
    args, kw = _case(10 + splits, [250, 0, 97, 16, 131], K=16, bs=8)
    for selection in ("radix", "split", "torch"):
        _check(ix, args, kw, selection=selection, num_splits=splits)


@interpreted
@pytest.mark.parametrize("bits,resident,early", [(4, False, False), (4, True, False), (8, True, False),
                                                 (4, False, True), (4, True, True), (8, True, True)])
def test_radix_select_digit_widths_and_resident_rows(ix, monkeypatch, bits, resident, early):
    """The radix select with 4-bit digits (8 passes of 16 bins) and/or the row kept in registers across the
    passes (one tile as wide as the table), with or without the early exit: the same sets as the reference on
    long rows, near ties decided by the low digits, exact ties, and rows at or below K."""
    _early_exit(ix, monkeypatch, early)
    monkeypatch.setattr(ix, "SELECT_BITS", bits)
    monkeypatch.setattr(ix, "SELECT_RESIDENT_MAX", 1 << 20 if resident else 0)
    monkeypatch.setattr(ix, "SELECT_TILE", 64)
    args, kw = _case(30 + bits, [250, 0, 97, 16, 131], K=16, bs=8)
    _check(ix, args, kw, selection="radix", num_splits=3)
    args, kw = _case(40 + bits, [150, 90, 41], K=12, bs=4, near_ties=True)
    _check(ix, args, kw, selection="radix", num_splits=2)
    args, kw = _tied_case(50 + bits, [70, 70, 70, 12])
    _check(ix, args, kw, selection="radix", num_splits=2)


@interpreted
@pytest.mark.parametrize("early", [False, True])
def test_radix_select_half_width_path_for_short_rows(ix, monkeypatch, early):
    """A resident tile with the half-width path (``NARROW``): rows at most half the tile wide take it, longer ones
    the whole tile, in one launch; near ties, exact ties and rows at or below K on both sides of the split."""
    _early_exit(ix, monkeypatch, early)
    monkeypatch.setattr(ix, "SELECT_NARROW_MIN_TILE", 64)
    monkeypatch.setattr(ix, "SELECT_RESIDENT_MAX", 1 << 20)
    # capacity 33 blocks x 4 = 132 -> a 256-wide tile: 128 and below take the 128-wide path
    args, kw = _case(61, [128, 129, 131, 40, 0, 12, 127], K=16, bs=4, per=33)
    _check(ix, args, kw, selection="radix", num_splits=3)
    args, kw = _case(62, [120, 130, 64], K=12, bs=4, per=33, near_ties=True)
    _check(ix, args, kw, selection="radix", num_splits=2)
    args, kw = _tied_case(63, [100, 131, 100, 12], per=33)
    _check(ix, args, kw, selection="radix", num_splits=2)


@interpreted
@pytest.mark.parametrize("early", [False, True])
def test_radix_select_fine_widths(ix, monkeypatch, early):
    """``SELECT_FINE_WIDTHS``: in one launch, rows on both sides of every step of the width held (1/4, 3/8 as a pair,
    1/2, 3/4 as a pair, all of a 256-wide tile), with near ties, exact ties and rows at or below K."""
    monkeypatch.setattr(ix, "SELECT_FINE_WIDTHS", True)
    _early_exit(ix, monkeypatch, early)
    monkeypatch.setattr(ix, "SELECT_NARROW_MIN_TILE", 64)
    monkeypatch.setattr(ix, "SELECT_RESIDENT_MAX", 1 << 20)
    # capacity 64 blocks x 4 = 256 -> a 256-wide tile: steps at 64, 96, 128, 192 live logits
    args, kw = _case(71, [64, 65, 96, 97, 128, 129, 192, 193, 250, 0, 12, 40], K=16, bs=4, per=64)
    _check(ix, args, kw, selection="radix", num_splits=3)
    args, kw = _case(72, [90, 120, 180, 256], K=12, bs=4, per=64, near_ties=True)
    _check(ix, args, kw, selection="radix", num_splits=2)
    args, kw = _tied_case(73, [95, 190, 95, 12], per=64)
    _check(ix, args, kw, selection="radix", num_splits=2)


@interpreted
@pytest.mark.parametrize("early,counted,selects", [(True, True, False), (False, False, False), (True, False, True)])
def test_radix_select_wide_loops(ix, monkeypatch, early, counted, selects):
    """``SELECT_WIDE_LOOPS``: in one launch, rows on the half-width path and rows past it (looped over quarter-tile
    tiles of their live logits) - the reference's sets with near ties, exact ties and rows at or below K; from the
    leading-byte counts, with all passes, and inside the score kernel (``SCORE_SELECTS``)."""
    monkeypatch.setattr(ix, "SELECT_WIDE_LOOPS", True)
    monkeypatch.setattr(ix, "SELECT_WIDE_LOOPS_MIN_TILE", 64)
    _early_exit(ix, monkeypatch, early)
    monkeypatch.setattr(ix, "SELECT_FIRST_BYTE", counted)
    monkeypatch.setattr(ix, "SCORE_SELECTS", selects)
    monkeypatch.setattr(ix, "SELECT_NARROW_MIN_TILE", 64)
    monkeypatch.setattr(ix, "SELECT_RESIDENT_MAX", 1 << 20)
    monkeypatch.setattr(ix, "MIN_CHUNK", 16)
    # capacity 64 blocks x 4 = 256 -> a 256-wide tile, the half 128, looped rows in 64-wide tiles
    consts, _ = ix.select_config(256)
    assert consts["LOOPS"] and consts["LOOP_TILE"] == 64
    args, kw = _case(101, [64, 127, 128, 129, 130, 193, 250, 256, 0, 12, 40], K=16, bs=4, per=64)
    _check(ix, args, kw, selection="radix", num_splits=3)
    args, kw = _case(102, [90, 140, 200, 256], K=12, bs=4, per=64, near_ties=True)
    _check(ix, args, kw, selection="radix", num_splits=2)
    args, kw = _tied_case(103, [150, 131, 95, 12], per=64)
    _check(ix, args, kw, selection="radix", num_splits=2)
    if counted:
        assert not ix.first_byte_counts(torch.device("cpu")).any()


def test_wide_loops_and_fine_widths_refused_together(ix, monkeypatch):
    """Both choose the width of a row past the half-width path: the config names the switches to turn off."""
    monkeypatch.setattr(ix, "SELECT_WIDE_LOOPS", True)
    monkeypatch.setattr(ix, "SELECT_FINE_WIDTHS", True)
    with pytest.raises(UserError, match="switch one of them off"):
        ix.select_config(8192)
    assert not ix.select_config(1 << 20)[0]["LOOPS"]   # a looped table: no half-width path, nothing to choose
    monkeypatch.setattr(ix, "SELECT_FINE_WIDTHS", False)
    assert not ix.select_config(4096)[0]["LOOPS"]      # below SELECT_WIDE_LOOPS_MIN_TILE: the resident rows stay
    assert ix.select_config(8192)[0]["LOOPS"]


@interpreted
@pytest.mark.parametrize("resident,fine,ahead,bits,packed", [
    (True, False, False, 4, False), (False, False, True, 4, True), (True, True, False, 4, True),
    (True, False, True, 8, False)])
def test_select_from_the_leading_byte_counts(ix, monkeypatch, resident, fine, ahead, bits, packed):
    """``SELECT_FIRST_BYTE``: the score kernel counts every live logit's leading key byte and the select starts from
    those counts - the same valid sets on long rows (several scoring programs a row, in either grid order), near ties
    decided past the first byte, exact ties (+-0 logits, negative ones) and rows at or below K; the row held
    resident (one tile, or at the finer widths' pairs) or looped over tiles; 4- and 8-bit digits after the byte. The
    counts are back at zero after every call: the next call, on other rows, starts from there."""
    monkeypatch.setattr(ix, "SELECT_FIRST_BYTE", True)
    monkeypatch.setattr(ix, "SELECT_PACKED_SCAN", packed)
    monkeypatch.setattr(ix, "SELECT_BITS", bits)
    monkeypatch.setattr(ix, "SCORE_KEYS_AHEAD", ahead)
    monkeypatch.setattr(ix, "SELECT_RESIDENT_MAX", 1 << 20 if resident else 0)
    monkeypatch.setattr(ix, "SELECT_TILE", 64)
    monkeypatch.setattr(ix, "MIN_CHUNK", 16)
    if fine:
        monkeypatch.setattr(ix, "SELECT_FINE_WIDTHS", True)
        monkeypatch.setattr(ix, "SELECT_NARROW_MIN_TILE", 64)
    counts = ix.first_byte_counts(torch.device("cpu"))
    cases = [(_case(81, [250, 0, 97, 16, 131, 65], K=16, bs=8, per=(32 if fine else None)), 3),
             (_case(82, [150, 90, 41], K=12, bs=4, near_ties=True), 2),
             (_tied_case(83, [70, 70, 70, 12]), 2)]
    for (args, kw), splits in cases:
        _check(ix, args, kw, selection="radix", num_splits=splits)
        assert not counts.any(), "the select left leading-byte counts behind"
        with programs_in_reverse():
            _check(ix, args, kw, selection="radix", num_splits=splits)
        assert not counts.any()


@interpreted
@pytest.mark.parametrize("path,early", [("resident", True), ("resident", False), ("narrow", True), ("fine", True),
                                        ("fine", False), ("looped", True), ("looped", False)])
def test_radix_select_packed_scan(ix, monkeypatch, path, early):
    """``SELECT_PACKED_SCAN``: the compaction ranks the keys > T and == T with one prefix sum of both (16-bit fields)
    - the same sets as the reference on every path of the select (one resident tile, its half-width path, the finer
    widths' pairs, tiles looped with running bases), with near ties, exact ties and rows at or below K."""
    monkeypatch.setattr(ix, "SELECT_PACKED_SCAN", True)
    _early_exit(ix, monkeypatch, early)
    monkeypatch.setattr(ix, "SELECT_TILE", 64)
    monkeypatch.setattr(ix, "SELECT_RESIDENT_MAX", 0 if path == "looped" else 1 << 20)
    monkeypatch.setattr(ix, "SELECT_NARROW_MIN_TILE", 64 if path in ("narrow", "fine") else 0)
    monkeypatch.setattr(ix, "SELECT_FINE_WIDTHS", path == "fine")
    per = 64 if path == "fine" else 33
    args, kw = _case(91, [64, 65, 96, 97, 128, 129, 131, 40, 0, 12, 127][:11 if path == "fine" else 9], K=16, bs=4,
                     per=per)
    _check(ix, args, kw, selection="radix", num_splits=3)
    args, kw = _case(92, [120, 130, 64], K=12, bs=4, per=per, near_ties=True)
    _check(ix, args, kw, selection="radix", num_splits=2)
    # the finer widths: exact ties in both pairs (3/4: 150, 3/8: 95)
    args, kw = _tied_case(93, [150, 131, 95, 12] if path == "fine" else [100, 131, 100, 12], per=per)
    got = _check(ix, args, kw, selection="radix", num_splits=2)
    # among ties the first positions, as with two scans: the same set exactly
    monkeypatch.setattr(ix, "SELECT_PACKED_SCAN", False)
    q, k, w, cache, slots, blocks, lens = args
    want = ix.indexer_topk_triton(q, k, w, cache.clone(), slots, blocks, lens, selection="radix", num_splits=2, **kw)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    # row 0's logits all tie (zero weights): the tie rule takes the lowest positions, whichever tiles hold them
    assert torch.equal(got[0].sort().values, torch.arange(kw["topk"], dtype=torch.int32))


def test_select_from_the_leading_byte_counts_needs_the_early_exit(ix, monkeypatch):
    monkeypatch.setattr(ix, "SELECT_FIRST_BYTE", True)
    monkeypatch.setattr(ix, "SELECT_EARLY_EXIT", False)
    args, kw = _case(84, [20, 9], K=4)
    with pytest.raises(UserError, match="SELECT_EARLY_EXIT"):
        ix.indexer_topk_triton(*args, **kw, selection="radix")


def test_radix_select_refuses_other_digit_widths(ix):
    with pytest.raises(UserError, match="digit width 5"):
        ix.launch_select(None, torch.zeros(1, 8), torch.ones(1, dtype=torch.int32),
                         torch.zeros(1, 4, dtype=torch.int32), 4, 8, bits=5)


@interpreted
@pytest.mark.parametrize("selection", ["radix", "radix_early", "split"])
def test_near_ties_decided_by_low_bytes(ix, monkeypatch, selection):
    """Keys equal up to 1e-3: logits share their leading bytes, so the later radix passes pick the K-th (the early
    exit's passes too: it stops only where the K-th key's bucket holds just the keys still to take)."""
    _early_exit(ix, monkeypatch, selection == "radix_early")
    selection = selection.removesuffix("_early")
    monkeypatch.setattr(ix, "SELECT_TILE", 64)
    args, kw = _case(20, [150, 90, 41], K=12, bs=4, near_ties=True)
    _check(ix, args, kw, selection=selection, num_splits=2)


@interpreted
@pytest.mark.parametrize("selection", ["radix", "radix_early", "split", "torch"])
def test_exact_ties(ix, monkeypatch, selection):
    """Zero weights (every logit 0, +-0), duplicated keys (equal logits) and negative weights (negative logits):
    any choice among the ties is valid; the compaction must take exactly enough of the tied keys."""
    _early_exit(ix, monkeypatch, selection == "radix_early")
    selection = selection.removesuffix("_early")
    monkeypatch.setattr(ix, "SELECT_TILE", 32)
    args, kw = _tied_case(21, [70, 70, 70, 12])
    q, k, w, cache, slots, blocks, lens = args
    flat = cache.view(-1, cache.shape[-1])
    dup = blocks[1, :6].long() * 4          # the first slot of each of row 1's first blocks: one key, repeated
    flat[dup] = flat[dup[0]].clone()
    _check(ix, args, kw, selection=selection, num_splits=2)


@interpreted
@SELECTIONS
def test_topk_wider_than_the_table(ix, selection):
    """K = 64 over a 40-token block table: every live position, then -1."""
    args, kw = _case(22, [37, 0, 12], K=64, bs=4, per=10)
    _check(ix, args, kw, selection=selection)


@interpreted
def test_fresh_inputs_repeatedly(ix):
    """Several seeds at the default (host-chosen) split count, both selections, random lengths around K."""
    for seed in range(30, 34):
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(0, 60, (5,), generator=g).tolist()
        args, kw = _case(seed, lens, K=int(torch.randint(1, 24, (1,), generator=g)), interleaved=seed % 2 == 0,
                         norm=("layer", "rms", None)[seed % 3])
        for selection in ("radix", "split", "torch"):
            _check(ix, args, kw, selection=selection)


# ---------------------------------------------------------------------------------------------- host side
def test_reference_rms_kind_is_the_hand_formula():
    """k_norm_kind='rms': the cache row is k * rsqrt(mean(k^2) + eps) * weight (fp32), rotated; the default
    stays the LayerNorm (bias included)."""
    args, kw = _case(40, [5, 9], norm=None, rope=0)
    q, k, w, cache, slots, blocks, lens = args
    D = k.shape[-1]
    wt = 1.0 + 0.2 * torch.randn(D)
    c = cache.clone()
    indexer_topk_reference(q, k, w, c, slots, blocks, lens, topk=4, k_norm_weight=wt, k_norm_eps=1e-5,
                           k_norm_kind="rms")
    want = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-5) * wt
    torch.testing.assert_close(c.view(-1, D)[slots], want, rtol=1e-6, atol=1e-6)
    # with RoPE: the normed key, then the rotation
    c = cache.clone()
    pos, inv = torch.tensor([4, 8]), _inv_freq(8)
    indexer_topk_reference(q, k, w, c, slots, blocks, lens, topk=4, k_norm_weight=wt, k_norm_eps=1e-5,
                           k_norm_kind="rms", positions=pos, rope_inv_freq=inv, rope_interleaved=True)
    torch.testing.assert_close(c.view(-1, D)[slots], rotate_leading(want[:, None], pos, inv, True)[:, 0],
                               rtol=1e-6, atol=1e-6)
    # the default is the LayerNorm, unchanged
    b = 0.1 * torch.randn(D)
    c1, c2 = cache.clone(), cache.clone()
    r1 = indexer_topk_reference(q, k, w, c1, slots, blocks, lens, topk=4, k_norm_weight=wt, k_norm_bias=b)
    r2 = indexer_topk_reference(q, k, w, c2, slots, blocks, lens, topk=4, k_norm_weight=wt, k_norm_bias=b,
                                k_norm_kind="layer")
    mean, var = k.mean(-1, keepdim=True), k.var(-1, unbiased=False, keepdim=True)
    torch.testing.assert_close(c1.view(-1, D)[slots], (k - mean) * torch.rsqrt(var + 1e-6) * wt + b,
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(r1, r2)
    torch.testing.assert_close(c1, c2, rtol=0, atol=0, equal_nan=True)


def test_reference_rejects_bad_norm_kinds():
    args, kw = _case(41, [5], norm=None, rope=0)
    D = args[1].shape[-1]
    with pytest.raises(UserError, match="RMSNorm"):
        indexer_topk_reference(*args, topk=4, k_norm_weight=torch.ones(D), k_norm_bias=torch.zeros(D),
                               k_norm_kind="rms")
    with pytest.raises(UserError, match="k_norm_kind"):
        indexer_topk_reference(*args, topk=4, k_norm_kind="batch")


def test_host_checks_raise_user_errors(ix):
    args, kw = _case(42, [5, 3], norm=None, rope=0)
    q = args[0]
    with pytest.raises(UserError, match="int32"):
        ix.indexer_topk_triton(*args, topk=4, out=torch.empty(2, 4, dtype=torch.int64))
    with pytest.raises(UserError, match="RMSNorm"):
        ix.indexer_topk_triton(*args, topk=4, k_norm_weight=torch.ones(32), k_norm_bias=torch.ones(32),
                               k_norm_kind="rms")
    with pytest.raises(UserError, match="selection"):
        ix.indexer_topk_triton(*args, topk=4, selection="heap")
    with pytest.raises(UserError, match="positions"):
        ix.indexer_topk_triton(*args, topk=4, rope_inv_freq=_inv_freq(8))
    with pytest.raises(UserError, match="fit"):
        ix.indexer_topk_triton(q[:, :2], *args[1:], topk=4)
    with pytest.raises(UserError, match="MAX_SELECT_ROWS"):
        ix.arrival_counts(torch.device("cpu"), ix.MAX_SELECT_ROWS + 1)


@pytest.mark.parametrize("writes_key,selects,cross,k_given,want", [
    (False, False, False, True, ["key_kernel", "score_kernel", "select_kernel"]),
    (False, False, False, False, ["score_kernel", "select_kernel"]),
    (True, False, False, True, ["score_kernel", "select_kernel"]),
    (True, True, False, True, ["score_kernel"]),
    (True, True, True, True, ["key_kernel", "score_kernel"]),
    (False, True, False, False, ["score_kernel"])])
def test_launches_per_call(ix, monkeypatch, writes_key, selects, cross, k_given, want):
    """The launches of one radix call: key, score, select by default; no key launch for ``k=None``; the key inside the
    score kernel (``SCORE_WRITES_KEY``) but not for verification rows (``cross_row_reads``); the select inside it
    (``SCORE_SELECTS``): the whole indexer in one launch."""
    from tests.triton_offline import recorded_launches

    monkeypatch.setattr(ix, "SCORE_WRITES_KEY", writes_key)
    monkeypatch.setattr(ix, "SCORE_SELECTS", selects)
    args, kw = _case(56, [30, 9], K=8)
    if not k_given:
        args = (args[0], None) + args[2:]
    with recorded_launches() as launches:
        ix.indexer_topk_triton(*args, **kw, selection="radix", cross_row_reads=cross)
    assert [fn.fn.__name__ for fn, _, _ in launches] == want
    score = [kw_ for fn, _, kw_ in launches if fn.fn.__name__ == "score_kernel"][0]
    assert score["KEY"] == (writes_key and k_given and not cross) and score["SELECT"] == selects


def _ctx(arch="sm_90", dtype="bfloat16", heads=32, head_dim=128, topk=2048, rope=64, **attrs):
    attrs = {"rope_interleaved": True, "k_norm": "layer_norm", **attrs}
    return make_context("attention.indexer", arch=arch, dtype=dtype, tokens=8,
                        dims=dict(heads=heads, head_dim=head_dim, topk=topk, rope=rope), attrs=attrs)


def test_supports_names_the_reason(ix):
    sup = ix.IMPLEMENTATIONS[0].supports
    assert sup(_ctx()) is True and sup(_ctx("sm_100a")) is True
    assert sup(_ctx(topk=512, k_norm="rms_norm")) is True                       # DeepSeek-V4.1-Flash
    assert "GPU" in sup(_ctx("cpu")) and "sm_80" in sup(_ctx("sm_75"))
    assert "norm" in sup(_ctx(k_norm="group_norm"))
    assert "query tile" in sup(_ctx(heads=256, head_dim=512))
    assert "rope" in sup(_ctx(rope=7))


def test_dispatch_triton_on_hopper_reference_on_cpu():
    from latency_specialized.plugins import get_registry

    reg = get_registry().implementations
    names = [i.name for i in reg.family("attention.indexer")]
    assert names.index("attention.indexer.triton") < names.index("attention.indexer.reference")
    assert reg.select(_ctx("sm_90"))[0].name == "attention.indexer.triton"
    assert reg.select(_ctx("sm_90", topk=512, k_norm="rms_norm"))[0].name == "attention.indexer.triton"
    chosen, refusals = reg.select(_ctx("cpu"))
    assert chosen.name == "attention.indexer.reference"
    assert [n for n, _ in refusals] == ["attention.indexer.triton"]


def test_kernels_compile_for_hopper_without_a_gpu(ix):
    """The three kernels build for sm_90 on the CPU (ptxas bundled with Triton): GLM-5.3 / DeepSeek-V4.1-Flash
    shapes, every norm kind, both RoPE layouts; the scoring dot on tensor cores, no register spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kern = ix._kernels(False)

    def ptx(fn, sig, const, warps):
        src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in const}}, constexprs=const)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)).asm["ptx"]

    sig = dict(k="*bf16", k_w="*fp32", k_b="*fp32", inv_freq="*fp32", positions="*i64", slots="*i64",
               cache="*bf16", eps="fp32", s_k="i32", s_row="i32")
    for norm, inter in ((0, False), (1, True), (2, False)):
        ptx(kern["key"], sig, dict(D=128, D_PAD=128, HALF=32, NORM=norm, HAS_BIAS=norm == 1, ROPE=True,
                                   INTERLEAVED=inter), 1)
    sig = dict(q="*bf16", w="*bf16", inv_freq="*fp32", positions="*i64", cache="*bf16", block_table="*i32",
               seq_lens="*i32", logits="*fp32", H="i32", num_splits="i32", block_size="i32", cap="i32",
               fill_chunk="i32", scale="fp32", s_qb="i32", s_qh="i32", s_wb="i32", s_row="i32", s_bt="i32",
               s_lb="i32", arrivals="*i32", out="*i32", K="i32", s_ob="i32", k="*bf16", k_w="*fp32", k_b="*fp32",
               slots="*i64", k_eps="fp32", s_k="i32", first_bytes="*i32")
    for rope, ahead, counted in ((False, False, False), (True, False, False), (False, True, False),
                                 (True, True, False), (False, False, True), (False, True, True)):
        p = ptx(kern["score"], sig, dict(D=128, D_PAD=128, H_PAD=32, HALF=32, ROPE=rope, INTERLEAVED=True,
                                         BT=ix.BLOCK_T, MIN_CHUNK=ix.MIN_CHUNK, FILL=ix.FILL_BLOCK, PREC="tf32",
                                         AHEAD=ahead, SELECT=False, **ix._NO_SELECT, KEY=False, NORM=0,
                                         HAS_BIAS=False, BYTES=counted), ix.SCORE_WARPS)
        assert "mma.sync" in p or "wgmma" in p
        # SELECT_FIRST_BYTE: the program's 256 leading-byte counts added with relaxed atomics, no acquire / release
        assert ("atom.global.gpu.relaxed.add" in p or "red.global.gpu.relaxed.add" in p) == counted, (rope, ahead)
        if not rope:  # with RoPE, libdevice's sin/cos keep a small local array for huge arguments
            assert "ld.local" not in p and "st.local" not in p, ahead
    # the score kernel that selects its rows (SCORE_SELECTS) and writes the new keys (SCORE_WRITES_KEY: GLM-5.3's
    # LayerNorm with bias, DeepSeek-V4.1-Flash's RMS norm): 4,096- and 8,192-wide tables, 64 heads, the select's
    # warps; the arrival an acquire-release atomic at GPU scope
    for cap, norm, rope in ((4096, 1, True), (8192, 2, True), (8192, 2, False)):
        consts, warps = ix.select_config(cap)
        p = ptx(kern["score"], sig, dict(D=128, D_PAD=128, H_PAD=64, HALF=32, ROPE=rope, INTERLEAVED=True,
                                         BT=ix.BLOCK_T, MIN_CHUNK=ix.MIN_CHUNK, FILL=ix.FILL_BLOCK, PREC="tf32",
                                         AHEAD=False, SELECT=True, **consts, KEY=True, NORM=norm,
                                         HAS_BIAS=norm == 1, BYTES=False), warps)
        assert ("mma.sync" in p or "wgmma" in p) and "atom.global.gpu.acq_rel.add" in p, cap
        if not rope:
            assert "ld.local" not in p and "st.local" not in p, cap
    sig = dict(logits="*fp32", seq_lens="*i32", out="*i32", K="i32", s_lb="i32", s_ob="i32", first_bytes="*i32")
    for bits in (4, 8):   # 16- and 256-bin histograms; rows looped over tiles or kept in registers (4096 wide)
        for resident, tile, narrow in ((False, ix.SELECT_TILE, False), (True, 4096, False), (True, 4096, True)):
            for early, fine in ((False, False), (True, False), (True, narrow)):
                p = ptx(kern["select"], sig, dict(TILE=tile, BITS=bits, RESIDENT=resident, NARROW=narrow,
                                                  TRIGGER=False, EARLY=early, FINE=fine, PACKED=early,
                                                  BYTES=early, LOOPS=False, LOOP_TILE=1024), ix.SELECT_WARPS)
                assert "ld.local" not in p and "st.local" not in p, (bits, resident, narrow, early, fine)
    # the widest resident row (SELECT_RESIDENT_MAX) on the wide warp count, with its half-width path / finer widths /
    # the wide rows looped
    for early, fine, counted, loops in ((False, False, False, False), (True, False, False, False),
                                        (True, True, False, False), (True, False, True, False),
                                        (True, True, True, False), (True, False, True, True)):
        p = ptx(kern["select"], sig, dict(TILE=ix.SELECT_RESIDENT_MAX, BITS=ix.SELECT_BITS, RESIDENT=True,
                                          NARROW=True, TRIGGER=False, EARLY=early, FINE=fine, PACKED=counted,
                                          BYTES=counted, LOOPS=loops, LOOP_TILE=ix.SELECT_TILE), ix.SELECT_WARPS_WIDE)
        assert "ld.local" not in p and "st.local" not in p, (early, fine, counted, loops)


def test_auto_selection_rule(ix):
    """``"auto"`` from the block table's width and the rows only: radix on short rows, the split select for
    one row (any capacity) and a few rows (up to SPLIT_MAX_CAPACITY), torch.topk beyond."""
    R, S = ix.RADIX_MAX_CAPACITY, ix.SPLIT_MAX_CAPACITY
    assert [ix.auto_selection(c, 64) for c in (64, R)] == ["radix", "radix"]
    assert [ix.auto_selection(c, 1) for c in (R + 1, S, 1 << 20)] == ["split"] * 3
    assert [ix.auto_selection(c, ix.SPLIT_ROWS) for c in (S, S + 1)] == ["split", "torch"]
    assert ix.auto_selection(R + 1, ix.SPLIT_ROWS + 1) == "torch"


def test_num_splits_from_static_shapes(ix):
    c = ix.MIN_CHUNK
    assert ix.choose_num_splits(1, 32768, 132) == min(264, 32768 // c)   # WAVES x SMs, or the capacity's chunks
    assert ix.choose_num_splits(1, 4096, 132) == 4096 // c               # capped by the capacity's MIN_CHUNK chunks
    assert ix.choose_num_splits(64, 32768, 132) == 5
    assert ix.choose_num_splits(64, 64, 132) == 1
