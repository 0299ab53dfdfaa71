"""attention.indexer.triton on the GPU: bf16 at GLM-5.3 and DeepSeek-V4.1-Flash indexer shapes, CUDA graphs.

Every case: fresh random inputs, ``out`` poisoned with garbage, cache rows that no live position reads
poisoned with NaN, -1 / spare block ids past each sequence's end, padding rows (seq_lens 0, slot -1),
seq_lens around and far beyond K. The kernel rounds the rotated query to bf16 for its tensor-core dot,
so it may pick differently from the fp32 reference where logits nearly tie: the check is that each row
is a valid set (``min(K, seq_len)`` distinct live positions, -1 elsewhere) whose reference logits equal
the reference's top-K logits as sorted multisets within a bf16-sized tolerance. The new keys land in
the cache at the live slots (one bf16 rounding of the fp32 norm + RoPE); nothing else changes. Every
selection variant (radix select, the split select of ``topk_triton``, torch.topk; the radix select inside the
score kernel, ``SCORE_SELECTS``, and the key written by it, ``SCORE_WRITES_KEY``); a captured call replays for new
seq_lens / slots / cache / queries exactly as the eager call computes them.
Run on the H200: ``pytest -m gpu tests/ops/test_indexer_triton_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.kernels import indexer_triton as ix
from latency_specialized.ops.attention.sparse_mla import indexer_topk_reference, rotate_leading

from gpu_helpers import graph_replay, seeded_generator as _gen

pytestmark = pytest.mark.gpu

DEV = "cuda"
GLM53 = dict(H=32, D=128, K=2048, rope=64, interleaved=True, norm="layer")
"""GLM-5.3's indexer (models/glm53/spec.py: 32 heads x 128, top-2048; interleaved RoPE of the MLA's 64
rope channels; key LayerNorm with bias). Replicated on every rank, so TP does not change it."""
DSV41 = dict(H=32, D=128, K=512, rope=64, interleaved=False, norm="rms")
"""DeepSeek-V4.1-Flash's indexer (models/deepseek_v41_flash/spec.py: 32 heads x 128, top-512, RMS key norm)."""


def _case(seed, lens, *, H, D, K, rope, interleaved, norm, bs=64, per=None, dtype=torch.bfloat16):
    g = _gen(seed)
    B = len(lens)
    per = per or -(-max(max(lens), 1) // bs) + 2
    nb = B * per + 3
    cache = torch.randn(nb, bs, D, generator=g, device=DEV).to(dtype)
    perm = torch.randperm(nb, generator=g, device=DEV)
    blocks, spare = perm[:B * per].view(B, per).to(torch.int32), perm[B * per:B * per + 1].to(torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    last = (lens_t.long() - 1).clamp(min=0)
    slots = torch.where(lens_t > 0, blocks.long().gather(1, (last // bs)[:, None])[:, 0] * bs + last % bs, -1)
    pos = torch.arange(per * bs, device=DEV)
    live = pos[None, :] < lens_t[:, None] - 1                                      # read, not written
    read = torch.zeros(nb * bs, dtype=torch.bool, device=DEV)
    read[(blocks.long()[:, pos // bs] * bs + pos % bs)[live]] = True
    cache.view(-1, D)[~read] = float("nan")
    used = (lens_t.long() + bs - 1) // bs
    past = torch.arange(per, device=DEV)[None, :] >= used[:, None]
    fill = torch.where(torch.arange(B, device=DEV)[:, None] % 2 == 1, -1, spare.view(1, 1))
    blocks = torch.where(past, fill.to(torch.int32), blocks)
    proj = torch.randn(B, H * D + D + H, generator=g, device=DEV)
    proj[:, H * D:H * D + D] = 2.0 * proj[:, H * D:H * D + D] + 0.3
    proj = proj.to(dtype)
    # views / column slices of one projection output, as the sparse MLA piece passes them
    q, k, w = proj[:, :H * D].view(B, H, D), proj[:, H * D:H * D + D], proj[:, H * D + D:]
    kw = dict(topk=K, positions=last * 3 + 11, rope_inv_freq=1.0 / (1e4 ** (torch.arange(0, rope, 2, device=DEV)
                                                                            .float() / rope)),
              rope_interleaved=interleaved, k_norm_weight=1.0 + 0.2 * torch.randn(D, generator=g, device=DEV),
              k_norm_eps=1e-6, k_norm_kind=norm)
    if norm == "layer":
        kw["k_norm_bias"] = 0.1 * torch.randn(D, generator=g, device=DEV)
    return (q, k, w, cache, slots, blocks, lens_t), kw


def _ref_logits(q, w, cache, blocks, seq_lens, kw):
    B, H, D = q.shape
    qf = rotate_leading(q.float(), kw["positions"], kw["rope_inv_freq"], kw["rope_interleaved"])
    bs = cache.shape[1]
    out = torch.full((B, blocks.shape[1] * bs), float("-inf"), device=DEV)
    for b in range(B):  # one row at a time: [n, D] fp32 per row, not [B, capacity, D]
        n = int(seq_lens[b])
        if n:
            p = torch.arange(n, device=DEV)
            rows = blocks[b, p // bs].long() * bs + p % bs
            s = (qf[b] @ cache.view(-1, D)[rows].float().T).clamp(min=0)                  # [H, n]
            out[b, :n] = (w[b].float() @ s) * (D ** -0.5 * H ** -0.5)
    return out


def _check_selection(got, logits, seq_lens, K):
    for b in range(got.shape[0]):
        n = int(seq_lens[b])
        row = got[b].long()
        live = row[row >= 0]
        want = min(K, n)
        assert live.numel() == want and int((row == -1).sum()) == K - want, f"row {b} (seq_len {n})"
        assert torch.unique(live).numel() == want and bool((live < n).all()), f"row {b} (seq_len {n})"
        if want:
            lg = logits[b, :n]
            top = torch.topk(lg, want).values.sort().values
            sel = lg[live].sort().values
            # bf16 query rounding: the K-th largest may move by a few bf16 ulps of the logit scale
            torch.testing.assert_close(sel, top, rtol=0, atol=2e-2 * float(lg.abs().max()))


def _check(args, kw, **call):
    q, k, w, cache, slots, blocks, seq_lens = args
    before, c_ref, c_tri = cache.clone(), cache.clone(), cache.clone()
    indexer_topk_reference(q, k, w, c_ref, slots, blocks, seq_lens, **kw)
    out = torch.randint(-(2 ** 20), 2 ** 20, (q.shape[0], kw["topk"]), dtype=torch.int32, device=DEV)
    got = ix.indexer_topk_triton(q, k, w, c_tri, slots, blocks, seq_lens, out=out, **kw, **call)
    torch.cuda.synchronize()
    assert got is out
    _check_selection(got, _ref_logits(q, w, c_ref, blocks, seq_lens, kw), seq_lens, kw["topk"])
    D = cache.shape[-1]
    changed = torch.zeros(cache.shape[0] * cache.shape[1], dtype=torch.bool, device=DEV)
    changed[slots[slots >= 0]] = True
    flat, flat0, flat_ref = c_tri.view(-1, D), before.view(-1, D), c_ref.view(-1, D)
    torch.testing.assert_close(flat[~changed], flat0[~changed], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(flat[changed].float(), flat_ref[changed].float(), rtol=1e-2, atol=1e-2)
    return got


@pytest.mark.parametrize("selection", ["radix", "split", "torch"])
@pytest.mark.parametrize("shape", [GLM53, DSV41], ids=["glm53", "dsv41"])
@pytest.mark.parametrize("B", [1, 2, 8, 64])
def test_matches_reference(shape, B, selection):
    """Batch 1..64: padding rows, seq_len 1, < K, = K, K + 1, a few K, the rest ~ 2-3 K."""
    K = shape["K"]
    special = [0, 1, K - 1, K, K + 1, 3 * K + 17, 5000]
    lens = (special * (-(-B // len(special))))[:B] if B > 1 else [3 * K + 5]
    args, kw = _case(f"ref{B}{K}{selection}", lens, **shape)
    _check(args, kw, selection=selection)


@pytest.mark.parametrize("selection", ["radix", "split", "torch"])
@pytest.mark.parametrize("shape", [GLM53, DSV41], ids=["glm53", "dsv41"])
def test_long_contexts(shape, selection):
    """32k-token contexts (and one short row) in a 40k-token block table."""
    args, kw = _case(f"long{shape['K']}{selection}", [32768, 700, 0, 32001], per=640, **shape)
    _check(args, kw, selection=selection)


@pytest.mark.parametrize("selection", ["radix", "split", "torch"])
def test_graph_replay_equals_eager(selection):
    """Capture once at GLM-5.3 shapes; new seq_lens / slots / cache / queries in the static buffers;
    the replay equals the eager call on the same inputs, and both are valid selections."""
    a0, kw = _case("graph0", [0, 2500, 7, 4000, 1], per=80, **GLM53)
    static = list(a0)
    static[3] = a0[3].clone()
    out = torch.empty(len(a0[6]), kw["topk"], dtype=torch.int32, device=DEV)
    fn = lambda: ix.indexer_topk_triton(*static, out=out, selection=selection, **kw)  # noqa: E731
    g = graph_replay(fn)
    a1, _ = _case("graph1", [3000, 0, 2049, 1, 5100], per=80, **GLM53)
    for s, n in zip(static, a1):
        s.copy_(n)
    cache_in = static[3].clone()
    g.replay()
    torch.cuda.synchronize()
    replayed, cache_replayed = out.clone(), static[3].clone()
    static[3].copy_(cache_in)
    eager = fn()
    torch.cuda.synchronize()
    assert torch.equal(replayed.sort(-1).values, eager.sort(-1).values)
    torch.testing.assert_close(cache_replayed, static[3], rtol=0, atol=0, equal_nan=True)
    static[3].copy_(cache_in)
    _check(static, kw, selection=selection)


def test_selections_agree():
    """The radix and split selects pick the same sets (one tie rule: the lowest positions), and torch.topk
    too where no two logits tie (random bf16 inputs)."""
    args, kw = _case("agree", [9000, 2048, 30000, 4097], per=480, **GLM53)
    cache = args[3]
    got = []
    for selection in ("radix", "split", "torch"):
        c = cache.clone()
        got.append(ix.indexer_topk_triton(*args[:3], c, *args[4:], selection=selection, **kw).sort(-1).values)
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])


def _variant_matches_default_radix(monkeypatch, args, kw, **switches):
    """With ``switches`` (indexer_triton attributes) set, the radix selection is valid and equals the default one's
    sets, eager and replayed from a CUDA graph."""
    want = ix.indexer_topk_triton(*args[:3], args[3].clone(), *args[4:], selection="radix", **kw).sort(-1).values
    for name, value in switches.items():
        monkeypatch.setattr(ix, name, value)
    got = _check(args, kw, selection="radix")
    assert torch.equal(got.sort(-1).values, want)
    static = list(args)
    out = torch.empty_like(got)
    g = graph_replay(lambda: ix.indexer_topk_triton(*static, out=out, selection="radix", **kw))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.sort(-1).values, want)


def _replays_select(args, kw, want, times=5):
    """A radix call over ``args`` captured in a CUDA graph (its own copy of the cache), replayed ``times`` times: each
    replay's sets are ``want``'s (a call that left counters behind would start the next from them)."""
    static = list(args)
    static[3] = args[3].clone()
    out = torch.empty_like(want)
    g = graph_replay(lambda: ix.indexer_topk_triton(*static, out=out, selection="radix", **kw))
    for _ in range(times):
        out.fill_(-7)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.sort(-1).values, want.sort(-1).values)


@pytest.mark.parametrize("bits,resident,early", [(4, False, False), (4, True, False), (8, True, False),
                                                 (4, False, True), (4, True, True), (8, True, True)])
@pytest.mark.parametrize("shape", [GLM53, DSV41], ids=["glm53", "dsv41"])
def test_radix_digit_widths_and_resident_rows(monkeypatch, shape, bits, resident, early):
    """The radix select with 4-bit digits and/or the row held in registers across its passes (a table of
    up to 8192 positions: one tile), with or without the early exit (``SELECT_EARLY_EXIT``), picks the same sets
    as the default radix select, eager and replayed."""
    K = shape["K"]
    args, kw = _case(f"bits{bits}{resident}{K}", [3 * K + 5, K, 1, 2 * K + 1, 0, 8000], per=128, **shape)
    # the leading-byte counts (on by default) need the early exit: off with it
    _variant_matches_default_radix(monkeypatch, args, kw, SELECT_EARLY_EXIT=early, SELECT_FIRST_BYTE=early,
                                   SELECT_BITS=bits, SELECT_RESIDENT_MAX=8192 if resident else 0)


@pytest.mark.parametrize("shape", [GLM53, DSV41], ids=["glm53", "dsv41"])
@pytest.mark.parametrize("per", [64, 128], ids=["4096", "8192"])
def test_score_kernel_selects_its_rows(monkeypatch, shape, per):
    """``SCORE_SELECTS``: the last scoring program of each row selects it (4,096- and 8,192-wide tables, rows short
    of K, padding rows, rows on the half-width path): a valid top-K eagerly; replayed from a CUDA graph five times,
    each replay the eager sets (the per-row arrival counts return to zero in every call, or a replay would select
    early or never); the counts are zero after."""
    monkeypatch.setattr(ix, "SCORE_SELECTS", True)
    K, cap = shape["K"], per * 64
    lens = [min(n, cap) for n in (3 * K + 5, K, 1, 2 * K + 1, 0, cap - 100, 2080)]
    args, kw = _case(f"fused{K}{per}", lens, per=per, **shape)
    got = _check(args, kw, selection="radix")
    _replays_select(args, kw, got)
    assert not ix.arrival_counts(torch.device(DEV), len(lens)).any()


@pytest.mark.parametrize("shape", [GLM53, DSV41], ids=["glm53", "dsv41"])
@pytest.mark.parametrize("selects", [False, True], ids=["key", "key_select"])
def test_score_kernel_writes_the_key(monkeypatch, shape, selects):
    """``SCORE_WRITES_KEY`` (with ``SCORE_SELECTS``: the indexer in one launch): the new keys in the cache at the live
    slots (a bf16 rounding of the reference's), nothing else changed, valid selections at batch 1 and 8 (padding rows,
    rows short of K, rows whose last position is in a later chunk); replayed from a CUDA graph, the eager sets and
    cache."""
    monkeypatch.setattr(ix, "SCORE_WRITES_KEY", True)
    monkeypatch.setattr(ix, "SCORE_SELECTS", selects)
    K = shape["K"]
    for lens in ([2 * K + 7], [3 * K + 5, K, 1, 2 * K + 1, 0, 4000, 2080, 65]):
        args, kw = _case(f"wkey{K}{len(lens)}", lens, per=128, **shape)
        cache0 = args[3].clone()
        got = _check(args, kw, selection="radix")
        static = list(args)
        static[3] = cache0.clone()
        out = torch.empty_like(got)
        g = graph_replay(lambda: ix.indexer_topk_triton(*static, out=out, selection="radix", **kw))
        eager_cache = cache0.clone()
        ix.indexer_topk_triton(*args[:3], eager_cache, *args[4:], selection="radix", **kw)
        for _ in range(3):
            static[3].copy_(cache0)
            out.fill_(-7)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out.sort(-1).values, got.sort(-1).values)
            torch.testing.assert_close(static[3], eager_cache, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape", [GLM53, DSV41], ids=["glm53", "dsv41"])
def test_radix_fine_widths(monkeypatch, shape):
    """``SELECT_FINE_WIDTHS`` in an 8,192-wide resident tile: rows on both sides of every step of the width held
    (2,048, 3,072 as a pair, 4,096, 6,144 as a pair, 8,192) pick the default radix select's sets, eager and
    replayed."""
    K = shape["K"]
    lens = [2000, 2048, 2049, 2080, 3072, 3073, 4096, 4097, 6144, 6145, 8000, K, 0]
    args, kw = _case(f"fine{K}", lens, per=128, **shape)
    _variant_matches_default_radix(monkeypatch, args, kw, SELECT_FINE_WIDTHS=True)


@pytest.mark.parametrize("shape", [GLM53, DSV41], ids=["glm53", "dsv41"])
@pytest.mark.parametrize("lens", [[4097], [2000, 2048, 2049, 2080, 4096, 4097, 6145, 8000, 0]],
                         ids=["glm_b1", "both_paths"])
def test_radix_wide_loops(monkeypatch, shape, lens):
    """``SELECT_WIDE_LOOPS`` in an 8,192-wide resident tile: rows past its half (GLM-5.3's 4,097 live at batch 1, and
    rows on both sides of the half in one launch) looped over 2,048-wide tiles pick the default radix select's sets,
    eager and replayed; the leading-byte counts (on by default) zero after."""
    args, kw = _case(f"loops{shape['K']}{len(lens)}", lens, per=128, **shape)
    _variant_matches_default_radix(monkeypatch, args, kw, SELECT_WIDE_LOOPS=True)
    assert ix.select_config(128 * 64)[0]["LOOPS"], "the launches above did not take the looped path"
    assert not ix.first_byte_counts(torch.device(DEV), len(lens)).any()


@pytest.mark.parametrize("shape", [GLM53, DSV41], ids=["glm53", "dsv41"])
@pytest.mark.parametrize("B", [1, 8, 64])
def test_scoring_keys_ahead(monkeypatch, shape, B):
    """``SCORE_KEYS_AHEAD``: the scoring programs with each tile's keys loaded a step ahead pick the same sets as
    without, at batch 1 (one tile a program), 8 and 64 (several), eager and replayed."""
    K = shape["K"]
    special = [0, 1, K - 1, K + 1, 3 * K + 17, 5000, 9000]
    lens = (special * (-(-B // len(special))))[:B] if B > 1 else [3 * K + 5]
    args, kw = _case(f"ahead{B}{K}", lens, **shape)
    _variant_matches_default_radix(monkeypatch, args, kw, SCORE_KEYS_AHEAD=True)


@pytest.mark.parametrize("shape", [GLM53, DSV41], ids=["glm53", "dsv41"])
@pytest.mark.parametrize("fine", [False, True], ids=["coarse", "fine"])
@pytest.mark.parametrize("counted,packed", [(True, False), (False, True), (True, True)],
                         ids=["bytes", "packed", "bytes_packed"])
def test_select_from_the_leading_byte_counts_and_packed_scans(monkeypatch, shape, fine, counted, packed):
    """``SELECT_FIRST_BYTE`` (the score kernel counts the leading key bytes, the select starts from them) and
    ``SELECT_PACKED_SCAN`` (one prefix sum for both ranks), both on by default: the sets of the radix select without
    them at batch 1 (GLM-5.3's 4,097 live of an 8,192 tile), at batch 8 (padding rows, rows at or below K, rows on the
    half-width path or the finer widths' pairs) and on rows too wide to hold (a 40,960-wide table: the looped passes),
    eager and replayed five times (a call that left its counts behind would start the next from doubled ones); the
    counts are zero after."""
    K = shape["K"]
    monkeypatch.setattr(ix, "SELECT_FINE_WIDTHS", fine)
    for lens, per in (([4097], 128), ([4097, 3 * K + 5, K, 1, 2 * K + 1, 0, 8000, 2080], 128),
                      ([32768, 700, 0, 32001], 640)):
        args, kw = _case(f"bytes{K}{len(lens)}{fine}{counted}{packed}", lens, per=per, **shape)
        with monkeypatch.context() as m:   # the sets of the select without either (both on by default)
            m.setattr(ix, "SELECT_FIRST_BYTE", False)
            m.setattr(ix, "SELECT_PACKED_SCAN", False)
            want = ix.indexer_topk_triton(*args[:3], args[3].clone(), *args[4:], selection="radix", **kw)
        with monkeypatch.context() as m:
            m.setattr(ix, "SELECT_FIRST_BYTE", counted)
            m.setattr(ix, "SELECT_PACKED_SCAN", packed)
            got = _check(args, kw, selection="radix")
            assert torch.equal(got.sort(-1).values, want.sort(-1).values)
            _replays_select(args, kw, want)
        if counted:
            assert not ix.first_byte_counts(torch.device(DEV)).any()
