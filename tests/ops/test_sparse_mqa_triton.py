"""attention.sparse_mqa.triton (and the compressor, attention.sparse_mqa_compress.triton) on the CPU: the Triton
interpreter in fp32, dispatch, splits, the sm_90 build.

The kernel cases (marker ``interpreter_case``) run in a child process started with ``TRITON_INTERPRET=1``
(``test_kernel_cases_under_the_interpreter``; why: ``tests/interpret.py``). Every tensor is fp32 there (the
interpreter's bf16 casts and dots are unreliable): the tolerance is an fp32 one, the kernels' arithmetic being
dtype-generic; bf16 at the real shapes is ``tests/ops/test_sparse_mqa_triton_gpu.py``.

Every case (``make_case``): fresh random inputs, the raw q off unit RMS (an unapplied norm shows); ``out``
poisoned with NaN; the kernel's copies of the ring and of the compressed cache poisoned with NaN wherever no
valid key lives (ring slots >= seq_len, the new token's slot - written before it is read -, unused ring rows,
every cache row no valid selected entry reads); rows with the window partly filled (seq < W) and wrapped
(seq > W), padding rows (seq_lens 0); per row a duplicate-free random selection of complete compressed rows at
random slots of the top-k, the rest -1 or (every third free slot) rows not complete yet (>= seq // ratio,
skipped); -1 block ids past each row's end. The result must equal ``sparse_mqa_decode_reference`` (on clean
copies), the ring change at exactly the new tokens' slots, the cache not at all. Compressor cases
(``make_compress_case``): the token's own pending slot poisoned (written before the pool reads it), slots -1
where the token completes no row; lat, pending and cache must equal the reference's.

Sampling (the interpreter's time on the 2-core CI): by default ``test_matches_reference`` runs every (M, splits)
of ``_MATRIX`` at the ``small`` shape and two at ``small_h16``, and ``test_deepseek_widths`` its TP4 M3 and TP8
M8 cases (both head counts, padding and long rows) - 51 cases instead of 62, every code path kept. With
``LS_FULL_INTERPRETER=1`` the full parameter set runs (62 cases). Cases left out are not generated, not skipped.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.attention.sparse_mqa import sparse_mqa_compress_reference, sparse_mqa_decode_reference
from latency_specialized.ops.registry import make_context
from latency_specialized.ops.rope import rope_inv_freq

from tests.interpret import run_interpreted

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (its interpreter runs the kernels on the CPU)")
interpreted = pytest.mark.interpreter_case
"""Needs TRITON_INTERPRET=1 from the process start: collected only there (the driver below runs these)."""
compiled_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                                   reason="compiles only where triton was imported without the interpreter")
"""The offline sm_90 builds: not in the interpreter's child process (triton there was imported to interpret)."""

FP32 = dict(rtol=1e-5, atol=1e-5)
SMALL = dict(H=8, D=64, R=16, W=16, K=24, bs=4)
SMALL_H16 = dict(H=16, D=64, R=16, W=16, K=40, bs=8)
DSV4_TP8 = dict(H=8, D=512, R=64, W=128, K=512, bs=64)
DSV4_TP4 = dict(H=16, D=512, R=64, W=128, K=512, bs=64)


FULL = os.environ.get("LS_FULL_INTERPRETER") == "1"
"""The full parameter set (module docstring: what the default samples)."""


@pytest.mark.interpreter_driver
def test_kernel_cases_under_the_interpreter():
    run_interpreted(__file__, min_passed=69 if FULL else 58)


@pytest.fixture
def smq():
    from latency_specialized.kernels import sparse_mqa_triton

    return sparse_mqa_triton


def make_case(seed, lens, *, H, D, R, W, K, bs, ratio=2, dtype=torch.float32, device="cpu", sinks=True,
              norm=True, beyond=True, theta=1e4, pos_offset=0, per=None, kv_norm=False):
    """``(args, kwargs, poisoned)``: the op's arguments (clean ring and cache: the reference's) and the
    kernel's NaN-poisoned copies ``(window, cache)`` (module docstring). ``K == 0``: a window-only layer.
    ``kv_norm``: kv raw and off unit RMS, with a random gain ``kv_norm_weight`` (the op norms it).
    ``pos_offset``: positions past seq - 1 by this much (large angles; the ring slot follows the position);
    ``per``: block-table width (default: one block more than the longest row needs)."""
    g = torch.Generator().manual_seed(seed)
    M = len(lens)
    seq = torch.tensor(lens, dtype=torch.int32)
    pos = (seq.long() - 1).clamp(min=0) + pos_offset
    n_rows = M + 3
    rows = (torch.randperm(n_rows - 1, generator=g)[:M] + 1).to(torch.int32)       # distinct; row 0 unused
    window = torch.randn(n_rows, W, D, generator=g)
    q = 3.0 * torch.randn(M, H, D, generator=g) + 0.5
    kv = torch.randn(M, D, generator=g)
    sk = torch.randn(H, generator=g) * 2 if sinks else None
    inv = rope_inv_freq(theta, R)
    live_w = torch.zeros(n_rows, W, dtype=torch.bool)                               # read from memory
    for m, n in enumerate(lens):
        live_w[rows[m], :min(n, W)] = True
        live_w[rows[m], int(pos[m]) % W] = False                                    # written first
    cache = block_table = sel = None
    if K:
        seq_c = [n // ratio for n in lens]
        per = per or max(-(-max(max(seq_c), 1) // bs), 1) + 1
        nb = M * per + 3
        cache = torch.randn(nb, bs, D, generator=g)
        block_table = torch.randperm(nb, generator=g)[:M * per].view(M, per).to(torch.int32)
        sel = torch.full((M, K), -1, dtype=torch.int32)
        read = torch.zeros(nb * bs, dtype=torch.bool)
        for m, n in enumerate(seq_c):
            pick = torch.randperm(n, generator=g)[:K] if n > 0 else torch.zeros(0, dtype=torch.long)
            slots = torch.randperm(K, generator=g)[:pick.numel()]
            sel[m, slots] = pick.to(torch.int32)
            read[block_table[m, pick // bs].long() * bs + pick % bs] = True
            if beyond:
                far = (sel[m] < 0).nonzero().flatten()[::3]
                sel[m, far] = n + torch.arange(far.numel(), dtype=torch.int32)        # not complete yet: skipped
            block_table[m, -(-n // bs):] = -1                                       # past the end
        poisoned_cache = cache.clone()
        poisoned_cache.view(-1, D)[~read] = float("nan")
    poisoned_window = torch.where(live_w[..., None], window, float("nan"))
    to = dict(device=device)
    cast = (lambda t: None if t is None else t.to(dtype=dtype, **to))
    ints = (lambda t: None if t is None else t.to(**to))
    args = (cast(q), cast(kv), ints(pos), ints(rows), ints(seq), cast(window), cast(cache), ints(block_table),
            ints(sel), None if sk is None else sk.to(**to), inv.to(**to))
    kw = dict(scale=D ** -0.5, compress_ratio=ratio, q_norm_eps=1e-6 if norm else None)
    if kv_norm:   # drawn last: the other cases keep their inputs
        args = args[:1] + (cast(2.5 * torch.randn(M, D, generator=g) + 0.4),) + args[2:]
        kw.update(kv_norm_weight=cast(1.0 + 0.3 * torch.randn(D, generator=g)), kv_norm_eps=1e-5)
    poisoned = (cast(poisoned_window), cast(poisoned_cache) if K else None)
    return args, kw, poisoned


def check_case(fn, args, kw, poisoned, *, rtol=FP32["rtol"], atol=FP32["atol"], ring_tol=1e-6, **call):
    """Run ``fn`` (the kernel) on the poisoned copies and the reference on clean ones; compare (module docstring).
    Returns the kernel's output."""
    q, kv, pos, rows, seq, window, cache, bt, sel, sinks, inv = args
    ref_window = window.clone()
    want = sparse_mqa_decode_reference(q, kv, pos, rows, seq, ref_window, cache, bt, sel, sinks, inv, **kw)
    win0 = poisoned[0]
    tri_window = win0.clone()
    tri_cache = None if poisoned[1] is None else poisoned[1].clone()
    out = torch.full_like(want, float("nan"))
    got = fn(q, kv, pos, rows, seq, tri_window, tri_cache, bt, sel, sinks, inv, out=out, **kw, **call)
    if q.is_cuda:
        torch.cuda.synchronize()
    assert got is out and not torch.isnan(out).any(), "output left unwritten or NaN leaked"
    scale = want.float().abs().max().item() + 1e-6
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol * scale)
    empty = seq == 0
    assert torch.equal(got[empty], torch.zeros_like(got[empty])), "rows without a visible key must be zeros"
    written = torch.zeros(window.shape[:2], dtype=torch.bool, device=window.device)
    written[rows.long(), pos.long() % window.shape[1]] = True
    torch.testing.assert_close(tri_window[written].float(), ref_window[written].float(), rtol=ring_tol, atol=ring_tol)
    torch.testing.assert_close(tri_window[~written], win0[~written], rtol=0, atol=0, equal_nan=True)
    if tri_cache is not None:
        torch.testing.assert_close(tri_cache, poisoned[1], rtol=0, atol=0, equal_nan=True)
    return got


LENS = {1: [37], 3: [0, 9, 40], 8: [3, 0, 16, 17, 1, 60, 15, 33], 64: [(13 * i + 5) % 70 for i in range(64)]}
"""Partly filled windows (seq < W = 16), exactly full, wrapped, padding rows (0) among live ones."""


_MATRIX = [(M, splits) for M in (1, 3, 8) for splits in (1, 3, None)] + [(64, None)]
"""(M, splits): batch 64 with the default splits only (the interpreter's time)."""


_H16_SAMPLE = [(3, 3), (8, None)]
"""(M, splits) of the small_h16 shape by default (several rows; explicit and default splits)."""
_MATCH = [(shape, M, splits) for shape in ("small", "small_h16") for M, splits in _MATRIX
          if FULL or shape == "small" or (M, splits) in _H16_SAMPLE]


@interpreted
@pytest.mark.parametrize("shape,M,splits", _MATCH)
def test_matches_reference(smq, M, shape, splits):
    s = SMALL if shape == "small" else SMALL_H16
    args, kw, poisoned = make_case(M * 10 + (splits or 0), LENS[M], **s)
    check_case(smq.sparse_mqa_decode_triton, args, kw, poisoned, num_splits=splits)


@interpreted
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("splits", [2, None])
def test_window_only_matches_reference(smq, M, splits):
    args, kw, poisoned = make_case(100 + M, LENS[M], K=0, **{k: v for k, v in SMALL.items() if k != "K"})
    check_case(smq.sparse_mqa_decode_triton, args, kw, poisoned, num_splits=splits)


@interpreted
@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("sinks,norm", [(False, True), (True, False)], ids=["no_sinks", "q_normed"])
def test_ratios_without_sinks_and_prenormed_q(smq, ratio, sinks, norm):
    """Ratio 1 (every token a compressed row) and 4; no sinks (rows with nothing visible still zeros); a q
    already normed (``q_norm_eps=None``: the kernel must not norm again)."""
    args, kw, poisoned = make_case(200 + ratio + 10 * sinks, LENS[8], ratio=ratio, sinks=sinks, norm=norm, **SMALL)
    check_case(smq.sparse_mqa_decode_triton, args, kw, poisoned, num_splits=3)


_DSV4 = [("tp8", [600]), ("tp4", [600]), ("tp8", [0, 100, 1500]), ("tp4", [0, 100, 1500]),
         ("tp8", [(517 * i + 3) % 2100 for i in range(8)])]
_DSV4_IDS = ["tp8-M1", "tp4-M1", "tp8-M3", "tp4-M3", "tp8-M8"]
_DSV4_SAMPLE = ("tp4-M3", "tp8-M8")
"""The DeepSeek-width cases by default: both head counts, a padding row, long wrapped rows, batch 8."""


@interpreted
@pytest.mark.parametrize("shape,lens", [pytest.param(*c, id=i) for c, i in zip(_DSV4, _DSV4_IDS)
                                        if FULL or i in _DSV4_SAMPLE])
def test_deepseek_widths(smq, shape, lens):
    """D = 512 with 64 rope channels, W = 128, top-512 selections, block size 64 (H = 8: TP8, 16: TP4), default
    splits (the CPU's nominal SM count) and one split."""
    args, kw, poisoned = make_case(300 + len(lens), lens, **(DSV4_TP8 if shape == "tp8" else DSV4_TP4))
    check_case(smq.sparse_mqa_decode_triton, args, kw, poisoned)
    check_case(smq.sparse_mqa_decode_triton, args, kw, poisoned, num_splits=1)


@interpreted
def test_no_program_reads_the_new_row_from_memory(smq, monkeypatch):
    """Without the ring store the output is unchanged (every reader takes the new row from registers; its slot
    holds NaN) and the ring keeps its NaN there."""
    monkeypatch.setattr(smq, "_STORE_NEW", False)
    args, kw, poisoned = make_case(400, LENS[8], **SMALL)
    q, kv, pos, rows, seq, window, cache, bt, sel, sinks, inv = args
    want = sparse_mqa_decode_reference(*args[:5], window.clone(), *args[6:], **kw)
    ring = poisoned[0].clone()
    got = smq.sparse_mqa_decode_triton(q, kv, pos, rows, seq, ring, poisoned[1], bt, sel, sinks, inv, num_splits=4,
                                       **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert ring[rows.long(), pos % window.shape[1]].isnan().all()


@interpreted
def test_empty_rows_give_zeros(smq):
    """A live row whose selection holds only -1 / incomplete rows still sees its window; padding rows (and a
    batch of nothing but padding) give exact zeros, with and without sinks."""
    args, kw, poisoned = make_case(500, [0, 9, 0], **SMALL)
    args[8][1] = torch.where(torch.arange(SMALL["K"]) % 2 == 0, 100, -1).to(torch.int32)
    check_case(smq.sparse_mqa_decode_triton, args, kw, poisoned, num_splits=2)
    for sinks in (True, False):
        args, kw, poisoned = make_case(501, [0, 0], sinks=sinks, **SMALL)
        check_case(smq.sparse_mqa_decode_triton, args, kw, poisoned, num_splits=2)


@interpreted
def test_strided_inputs_int64_indices_and_large_positions(smq):
    """q a head slice of a wider projection (strided rows and heads), int64 selection as a column slice of a
    wider buffer, int64 rows / seq_lens, positions near 500k (sin / cos of large angles)."""
    args, kw, poisoned = make_case(600, LENS[8], pos_offset=500_000, **SMALL)
    q, kv, pos, rows, seq, window, cache, bt, sel, sinks, inv = args
    M, H, D = q.shape
    wide_q = torch.randn(M, H + 2, D + 0)
    wide_q[:, 1:H + 1] = q
    wide_sel = torch.full((M, sel.shape[1] + 3), -5, dtype=torch.int64)
    wide_sel[:, 2:-1] = sel.long()
    args = (wide_q[:, 1:H + 1], kv, pos, rows.long(), seq.long(), window, cache, bt.long(), wide_sel[:, 2:-1],
            sinks, inv)
    assert not args[0].is_contiguous() and not args[8].is_contiguous()
    check_case(smq.sparse_mqa_decode_triton, args, kw, poisoned, num_splits=3)


@interpreted
@pytest.mark.parametrize("M,splits,K", [(1, None, 24), (3, 3, 24), (8, 1, 24), (8, 2, 0), (64, None, 24)])
def test_kv_norm_in_the_prologue_matches_reference(smq, M, splits, K):
    """The raw kv row with ``kv_norm_weight``: normed (gain, eps) in the split kernel's prologue, as the reference
    norms it; compressed and window-only layers, one split and several."""
    s = dict(SMALL, K=K)
    args, kw, poisoned = make_case(1000 + M + K, LENS[M], kv_norm=True, **s)
    check_case(smq.sparse_mqa_decode_triton, args, kw, poisoned, num_splits=splits)


@interpreted
@pytest.mark.parametrize("shape", ["tp8", "tp4"])
def test_kv_norm_deepseek_widths_from_a_strided_kv_slice(smq, shape):
    """D = 512: the raw kv a column slice of a wider projection (strided rows, as the fused input projection
    hands it over), odd lengths, default splits and one split."""
    args, kw, poisoned = make_case(1100, [0, 129, 1501], kv_norm=True, **(DSV4_TP8 if shape == "tp8" else DSV4_TP4))
    kv = args[1]
    wide = torch.full((kv.shape[0], kv.shape[1] + 96), float("nan"))
    wide[:, 32:32 + kv.shape[1]] = kv
    args = args[:1] + (wide[:, 32:32 + kv.shape[1]],) + args[2:]
    assert not args[1].is_contiguous()
    check_case(smq.sparse_mqa_decode_triton, args, kw, poisoned)
    check_case(smq.sparse_mqa_decode_triton, args, kw, poisoned, num_splits=1)


@interpreted
def test_kv_norm_new_row_still_comes_from_registers(smq, monkeypatch):
    """With the kv norm too, no program reads the new (normed, roped) row from memory."""
    monkeypatch.setattr(smq, "_STORE_NEW", False)
    args, kw, poisoned = make_case(1200, LENS[8], kv_norm=True, **SMALL)
    q, kv, pos, rows, seq, window, cache, bt, sel, sinks, inv = args
    want = sparse_mqa_decode_reference(*args[:5], window.clone(), *args[6:], **kw)
    ring = poisoned[0].clone()
    got = smq.sparse_mqa_decode_triton(q, kv, pos, rows, seq, ring, poisoned[1], bt, sel, sinks, inv, num_splits=4,
                                       **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert ring[rows.long(), pos % window.shape[1]].isnan().all()


@interpreted
@pytest.mark.parametrize("k", [3, 7])
def test_verification_rows_read_each_others_new_ring_slots(smq, monkeypatch, k):
    """A verification step: 2 requests x (1 + k) rows on a ring of window + k rows, ``sliding_window`` = the
    window; row t reads the slots rows 0..t-1 of its request write in the same call. ``cross_row_reads=True``
    (the piece's flag in verification steps) writes every row first: equal to the reference, every new slot
    written. A row takes only its *own* new slot from registers, so with the stores left out (``_STORE_NEW``)
    the later rows read the earlier rows' poisoned slots: what a single launch would race on."""
    g = torch.Generator().manual_seed(1100 + k)
    S, H, D, R, T = 16, 8, 64, 16, 1 + k
    W, M = S + k, 2 * T
    rows = torch.tensor([1, 2]).repeat_interleave(T).to(torch.int32)
    pos = torch.cat([torch.arange(40, 40 + T), torch.arange(9, 9 + T)])            # wrapped / partly filled
    seq = (pos + 1).to(torch.int32)
    window = torch.randn(3, W, D, generator=g)
    q, kv = 3.0 * torch.randn(M, H, D, generator=g) + 0.5, torch.randn(M, D, generator=g)
    sinks, inv = torch.randn(H, generator=g), rope_inv_freq(1e4, R)
    kw = dict(scale=D ** -0.5, q_norm_eps=1e-6, sliding_window=S)
    ref_ring = window.clone()
    want = sparse_mqa_decode_reference(q, kv, pos, rows, seq, ref_ring, None, None, None, sinks, inv, **kw)
    poisoned = window.clone()
    poisoned[rows.long(), pos % W] = float("nan")                                  # written by this call
    for splits in (1, 3):
        ring = poisoned.clone()
        got = smq.sparse_mqa_decode_triton(q, kv, pos, rows, seq, ring, None, None, None, sinks, inv,
                                           cross_row_reads=True, num_splits=splits, **kw)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        torch.testing.assert_close(ring, ref_ring, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(smq, "_STORE_NEW", False)
    raced = smq.sparse_mqa_decode_triton(q, kv, pos, rows, seq, poisoned.clone(), None, None, None, sinks, inv,
                                         num_splits=2, **kw)
    for b in range(2):
        torch.testing.assert_close(raced[b * T], want[b * T], rtol=1e-5, atol=1e-5 * want.abs().max().item())
        for t in range(1, T):   # each later row met an earlier row's poisoned slot
            assert raced[b * T + t].isnan().any(), (b, t)


@interpreted
@pytest.mark.parametrize("M,splits", [(3, 2), (8, None)])
def test_ring_longer_than_the_window_matches_reference(smq, M, splits):
    """A ring of window + 7 rows (the sparse MQA piece's, in plain steps too) with ``sliding_window`` = the
    window: the kernel sees exactly the reference's last ``window`` positions of each row."""
    args, kw, poisoned = make_case(1200 + M, LENS[M], **{**SMALL, "W": SMALL["W"] + 7})
    check_case(smq.sparse_mqa_decode_triton, args, {**kw, "sliding_window": SMALL["W"]}, poisoned, num_splits=splits)


# --------------------------------------------------------------------------------------------- compressor
def make_compress_case(seed, M, *, D, R, ratio, bs=4, dtype=torch.float32, device="cpu", live=True):
    """``(args, kwargs, poisoned pending)`` of one compressor call: distinct state rows, random positions, the
    slot of the completed row where ``(pos + 1) % ratio == 0`` (distinct random cache slots; -1 elsewhere, and
    everywhere unless ``live``)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(M + 3, generator=g)[:M].to(torch.int32)
    pos = torch.randint(0, 5000, (M,), generator=g)
    c = 2.0 * torch.randn(M, 2 * D if ratio > 1 else D, generator=g) + 0.3
    pending = torch.randn(M + 3, ratio, 2 * D, generator=g) if ratio > 1 else None
    norm_w = 1.0 + 0.1 * torch.randn(D, generator=g)
    nb = M + 2
    cache = torch.randn(nb, bs, D, generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:M]
    slots = torch.where(((pos + 1) % ratio == 0) & torch.tensor(live), slots, -1)
    poisoned = None
    if pending is not None:
        poisoned = pending.clone()
        poisoned[rows.long(), pos % ratio] = float("nan")
    cast = (lambda t: None if t is None else t.to(device=device, dtype=dtype))
    args = (cast(c), cast(pending), rows.to(device), pos.to(device), cast(norm_w), rope_inv_freq(1e4, R).to(device),
            cast(cache), slots.to(device))
    return args, dict(eps=1e-6, ratio=ratio), cast(poisoned)


def check_compress(fn, args, kw, poisoned, *, tol=1e-5):
    c, pending, rows, pos, w, inv, cache, slots = args
    p_ref = None if pending is None else pending.clone()
    c_ref, c_tri = cache.clone(), cache.clone()
    want = sparse_mqa_compress_reference(c, p_ref, rows, pos, w, inv, c_ref, slots, **kw)
    p_tri = None if poisoned is None else poisoned.clone()
    out = torch.full_like(want, float("nan"))
    got = fn(c, p_tri, rows, pos, w, inv, c_tri, slots, out=out, **kw)
    assert got is out and not torch.isnan(out).any()
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.float().abs().max().item())
    if p_ref is not None:   # the pending write is a copy; the rest untouched
        assert torch.equal(p_tri, p_ref)
    flat_ref, flat_tri, flat0 = (t.view(-1, t.shape[-1]) for t in (c_ref, c_tri, cache))
    live = slots[slots >= 0]
    torch.testing.assert_close(flat_tri[live].float(), flat_ref[live].float(), rtol=tol, atol=tol)
    keep = torch.ones(flat0.shape[0], dtype=torch.bool, device=flat0.device)
    keep[live] = False
    assert torch.equal(flat_tri[keep], flat0[keep])
    return got


@interpreted
@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("D,R,M", [(64, 16, 5), (512, 64, 3)])
def test_compressor_matches_reference(smq, ratio, D, R, M):
    args, kw, poisoned = make_compress_case(900 + ratio + D, M, D=D, R=R, ratio=ratio)
    check_compress(smq.sparse_mqa_compress_triton, args, kw, poisoned)


@interpreted
def test_compressor_without_a_completed_row_writes_no_cache(smq):
    args, kw, poisoned = make_compress_case(950, 4, D=64, R=16, ratio=2, live=False)
    assert (args[7] < 0).all()
    check_compress(smq.sparse_mqa_compress_triton, args, kw, poisoned)


@interpreted
@pytest.mark.parametrize("ratio", [1, 2])
def test_compressor_from_a_strided_slice_of_the_input_projection(smq, ratio):
    """``c`` a column slice of the fused input projection (strided rows), as the piece passes it."""
    args, kw, poisoned = make_compress_case(970 + ratio, 5, D=64, R=16, ratio=ratio)
    c = args[0]
    wide = torch.full((c.shape[0], c.shape[1] + 48), float("nan"))
    wide[:, 40:40 + c.shape[1]] = c
    args = (wide[:, 40:40 + c.shape[1]],) + args[1:]
    assert not args[0].is_contiguous()
    check_compress(smq.sparse_mqa_compress_triton, args, kw, poisoned)


@interpreted
@pytest.mark.parametrize("ratio,k", [(2, 3), (2, 7), (4, 3)])
def test_compressor_verification_rows_pool_each_others_pending_rows(smq, ratio, k):
    """1 + k consecutive tokens of each of 2 requests in one call, pending rings of ratio + k rows, this call's
    pending slots poisoned: with ``cross_row_reads`` (one launch writes every row first) lat, pending and cache
    equal the reference's; a token closing its group pools what earlier tokens of the call wrote."""
    g = torch.Generator().manual_seed(1300 + 10 * ratio + k)
    D, R, T = 64, 16, 1 + k
    M = 2 * T
    rows = torch.tensor([2, 0]).repeat_interleave(T).to(torch.int32)
    pos = torch.cat([torch.arange(30, 30 + T), torch.arange(5, 5 + T)])
    c = 2.0 * torch.randn(M, 2 * D, generator=g) + 0.3
    pending = torch.randn(3, ratio + k, 2 * D, generator=g)
    cache = torch.randn(M + 2, 4, D, generator=g)
    slots = torch.where((pos + 1) % ratio == 0, torch.randperm((M + 2) * 4, generator=g)[:M], -1)
    poisoned = pending.clone()
    poisoned[rows.long(), pos % (ratio + k)] = float("nan")
    args = (c, pending, rows, pos, 1.0 + 0.1 * torch.randn(D, generator=g), rope_inv_freq(1e4, R), cache, slots)
    p_ref, c_ref, c_tri, p_tri = pending.clone(), cache.clone(), cache.clone(), poisoned.clone()
    want = sparse_mqa_compress_reference(c, p_ref, rows, pos, args[4], args[5], c_ref, slots, eps=1e-6, ratio=ratio)
    got = smq.sparse_mqa_compress_triton(c, p_tri, rows, pos, args[4], args[5], c_tri, slots, eps=1e-6, ratio=ratio,
                                         cross_row_reads=True)
    closes = slots >= 0
    assert closes.sum() >= 2
    torch.testing.assert_close(got[closes], want[closes], rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(p_tri, p_ref)
    torch.testing.assert_close(c_tri, c_ref, rtol=1e-5, atol=1e-5)


def make_index_key_args(seed, M, D, Dk, bs=4, dtype=torch.float32, device="cpu"):
    """``(index_weight [Dk, D], index_norm_weight [Dk], index_cache [M + 2, bs, Dk])`` of a fused compressor call,
    the key cache NaN-poisoned (only the completed rows' slots may change, and they are written)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(Dk, D, generator=g) / D ** 0.5).to(device=device, dtype=dtype)
    nw = (1.0 + 0.1 * torch.randn(Dk, generator=g)).to(device=device, dtype=dtype)
    return w, nw, torch.full((M + 2, bs, Dk), float("nan"), dtype=dtype, device=device)


def make_compress_index_case(seed, M, *, D, R, ratio, bs=4, dtype=torch.float32, device="cpu"):
    """``make_compress_case`` where row 0 completes its group and (ratio > 1, M > 1) row 1 does not."""
    args, kw, poisoned = make_compress_case(seed, M, D=D, R=R, ratio=ratio, bs=bs)
    if ratio > 1:
        pos = args[3].clone()
        pos[0] = ratio - 1 + ratio * int(pos[0] // ratio)
        if M > 1:
            pos[1] = ratio * int(pos[1] // ratio)
        g = torch.Generator().manual_seed(seed + 1)
        slots = torch.where((pos + 1) % ratio == 0, torch.randperm((M + 2) * bs, generator=g)[:M], -1)
        poisoned = args[1].clone()
        poisoned[args[2].long(), pos % ratio] = float("nan")
        args = args[:3] + (pos,) + args[4:7] + (slots,)
    cast = (lambda t: None if t is None else t.to(device=device, dtype=dtype) if t.is_floating_point()
            else t.to(device))
    return tuple(cast(t) for t in args[:5]) + (args[5].to(device),) + tuple(cast(t) for t in args[6:]), kw, \
        cast(poisoned)


def check_compress_index(smq, args, kw, poisoned, index, *, cross_row_reads=False, tol=1e-5):
    """The fused compressor against ``sparse_mqa_compress_index_reference`` on clean copies: lat, pending, the
    compressed cache (``check_compress``) and the key cache - equal at the completed rows' slots, untouched
    elsewhere."""
    from latency_specialized.ops.attention.sparse_mqa import sparse_mqa_compress_index_reference

    w, nw, icache = index
    slots = args[7]
    i_ref, i_tri = icache.clone(), icache.clone()

    def fused(c, pending, rows, pos, nwt, inv, cache, sl, **k):
        return smq.sparse_mqa_compress_index_triton(c, pending, rows, pos, nwt, inv, cache, sl, w, nw, i_tri,
                                                    index_eps=1e-6, cross_row_reads=cross_row_reads, **k)

    got = check_compress(fused, args, kw, poisoned, tol=tol)
    c, pending, rows, pos, nwt, inv, cache, _ = args
    sparse_mqa_compress_index_reference(c, None if pending is None else pending.clone(), rows, pos, nwt, inv,
                                        cache.clone(), slots, w, nw, i_ref, index_eps=1e-6, **kw)
    live = slots[slots >= 0]
    assert live.numel() >= 1
    f_ref, f_tri = i_ref.view(-1, w.shape[0]), i_tri.view(-1, w.shape[0])
    assert not torch.isnan(f_tri[live]).any()
    torch.testing.assert_close(f_tri[live], f_ref[live], rtol=tol, atol=tol)
    keep = torch.ones(f_tri.shape[0], dtype=torch.bool, device=f_tri.device)
    keep[live] = False
    assert torch.isnan(f_tri[keep]).all()
    return got


@interpreted
@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("D,R,Dk,M", [(64, 16, 32, 5), (512, 64, 128, 3)])
def test_compressor_with_the_index_key_matches_reference(smq, ratio, D, R, Dk, M):
    """``attention.sparse_mqa_compress_index.triton``: the compressor's outputs as alone, and the indexer's new key
    (projection, RMSNorm, leading interleaved RoPE) at each completed row's slot of the key cache. Every row
    completes one at ratio 1; at ratio 2 / 4 some rows complete none (their key slots stay poisoned)."""
    args, kw, poisoned = make_compress_index_case(1400 + ratio + D, M, D=D, R=R, ratio=ratio)
    check_compress_index(smq, args, kw, poisoned, make_index_key_args(1450 + D, M, D, Dk))


@interpreted
def test_compressor_with_the_index_key_in_a_verification_step(smq):
    """1 + 3 tokens of 2 requests, ratio 2, ``cross_row_reads``: the write-first launch writes no key; the second
    writes every completed row's key."""
    D, R, Dk, T, ratio = 64, 16, 32, 4, 2
    g = torch.Generator().manual_seed(1470)
    rows = torch.tensor([2, 0]).repeat_interleave(T).to(torch.int32)
    pos = torch.cat([torch.arange(30, 30 + T), torch.arange(5, 5 + T)])
    M = 2 * T
    pending = torch.randn(3, ratio + 3, 2 * D, generator=g)
    poisoned = pending.clone()
    poisoned[rows.long(), pos % (ratio + 3)] = float("nan")
    slots = torch.where((pos + 1) % ratio == 0, torch.randperm((M + 2) * 4, generator=g)[:M], -1)
    args = (2.0 * torch.randn(M, 2 * D, generator=g) + 0.3, pending, rows, pos, 1.0 + 0.1 * torch.randn(D, generator=g),
            rope_inv_freq(1e4, R), torch.randn(M + 2, 4, D, generator=g), slots)
    check_compress_index(smq, args, dict(eps=1e-6, ratio=ratio), poisoned, make_index_key_args(1471, M, D, Dk),
                         cross_row_reads=True)


# --------------------------------------------------------------------------------------------- host side
def test_splits_are_sized_to_the_rows(smq):
    """``choose_splits``: about WAVES x SMs programs, at least one tile each, never more splits than tiles of the
    W + topk slots (nor MAX_SPLITS)."""
    bn = smq.block_n(512, 2, 8)
    assert bn == 32 and smq.block_n(64, 4, 8) == 64 and smq.block_h(8) == 16 and smq.block_h(64) == 32
    assert smq.block_n(512, 2, 1) == 16 and smq.block_n(64, 4, 1) == 64     # one row: half the tile, clamped
    assert smq.choose_splits(1, 640, 1, 132, bn) == 20                 # one tile per split
    assert smq.choose_splits(64, 640, 1, 132, bn) == 4                 # SM-bound
    assert smq.choose_splits(1, 128, 1, 132, bn) == 4                  # window only
    assert smq.choose_splits(1, 640, 1, 132, smq.block_n(512, 2, 1)) == 40   # batch 1's 16-slot tiles
    for M in (1, 3, 8, 64):
        for T in (16, 128, 640, 2176):
            for groups in (1, 2):
                n = smq.choose_splits(M, T, groups, 132, bn)
                assert 1 <= n <= min(-(-T // bn), smq.MAX_SPLITS)
                assert n == 1 or M * groups * n <= smq.WAVES * 132


def _ctx(arch="sm_90", dtype="bfloat16", **dims):
    d = dict(heads=8, head_dim=512, topk=512, window=128, compress_ratio=2, rope=64)   # DeepSeek-V4.1 TP8
    d.update(dims)
    return make_context("attention.sparse_mqa", arch=arch, dtype=dtype, tokens=1, world_size=8, dims=d,
                        attrs={"sinks": True, "q_norm": True, "rope_interleaved": True})


def test_supports_names_the_reason(smq):
    sup = smq.IMPLEMENTATIONS[0].supports
    assert sup(_ctx()) is True and sup(_ctx(heads=16)) is True and sup(_ctx(topk=0, compress_ratio=0)) is True
    assert "GPU" in sup(_ctx("cpu")) and "sm_80" in sup(_ctx("sm_75"))
    assert "head_dim 48" in sup(_ctx(head_dim=48)) and "rope 7" in sup(_ctx(rope=7))


def test_dispatch_gpu_gets_the_kernel_cpu_the_reference():
    from latency_specialized.plugins import get_registry

    impls = get_registry().implementations
    for arch in ("sm_90", "sm_90a", "sm_100"):
        assert impls.select(_ctx(arch))[0].name == "attention.sparse_mqa.triton", arch
    chosen, refusals = impls.select(_ctx("cpu"))
    assert chosen.name == "attention.sparse_mqa.reference"
    assert {n for n, _ in refusals} >= {"attention.sparse_mqa.triton", "attention.sparse_mqa.torch"}
    chosen, refusals = impls.select(_ctx(head_dim=48))
    assert chosen.name == "attention.sparse_mqa.torch"
    assert "head_dim 48" in dict(refusals)["attention.sparse_mqa.triton"]


def test_the_kernels_take_the_contract_signatures(smq):
    import inspect

    from latency_specialized.ops.attention.sparse_mqa import sparse_mqa_compress_index_reference

    for kernel, reference, positional in ((smq.sparse_mqa_decode_triton, sparse_mqa_decode_reference, 11),
                                          (smq.sparse_mqa_compress_triton, sparse_mqa_compress_reference, 8),
                                          (smq.sparse_mqa_compress_index_triton, sparse_mqa_compress_index_reference,
                                           11)):
        sig, ref = inspect.signature(kernel), inspect.signature(reference)
        for name, p in ref.parameters.items():
            assert name in sig.parameters and sig.parameters[name].kind == p.kind, name
        assert list(sig.parameters)[:positional] == list(ref.parameters)[:positional]


def test_compressor_dispatch_and_refusals(smq):
    from latency_specialized.plugins import get_registry

    impls = get_registry().implementations

    def ctx(arch="sm_90", **dims):
        d = {**dict(head_dim=512, compress_ratio=2, rope=64), **dims}
        return make_context("attention.sparse_mqa_compress", arch=arch, dtype="bfloat16", tokens=1, world_size=8,
                            dims=d, attrs={"rope_interleaved": True})

    assert impls.select(ctx())[0].name == "attention.sparse_mqa_compress.triton"
    assert impls.select(ctx("cpu"))[0].name == "attention.sparse_mqa_compress.reference"
    chosen, refusals = impls.select(ctx(head_dim=48))
    assert chosen.name == "attention.sparse_mqa_compress.torch"
    assert "head_dim 48" in dict(refusals)["attention.sparse_mqa_compress.triton"]
    args, kw, _ = make_compress_case(960, 2, D=64, R=16, ratio=2)
    with pytest.raises(UserError, match="do not fit ratio"):
        smq.sparse_mqa_compress_triton(args[0][:, :64], *args[1:], **kw)


def test_compressor_with_the_index_key_dispatch_and_refusals(smq, monkeypatch):
    """Off by default (the switch named in the refusal, so the program runs the three sites apart); on, the kernel
    serves sm_90 with plain weights, the reference the CPU; a quantized key projection or an odd key width is
    refused with the reason; mismatched operands raise a UserError naming the shapes."""
    from latency_specialized.plugins import get_registry

    impls = get_registry().implementations

    def ctx(arch="sm_90", attrs=(), **dims):
        d = {**dict(head_dim=512, index_head_dim=128, compress_ratio=2, rope=64), **dims}
        return make_context("attention.sparse_mqa_compress_index", arch=arch, dtype="bfloat16", tokens=1,
                            world_size=8, dims=d, attrs={"rope_interleaved": True, **dict(attrs)})

    chosen, refusals = impls.select(ctx())
    assert chosen.name == "attention.sparse_mqa_compress_index.reference"
    assert "COMPRESS_INDEX_KEY" in dict(refusals)[smq.COMPRESS_INDEX_NAME]
    monkeypatch.setattr(smq, "COMPRESS_INDEX_KEY", True)
    assert impls.select(ctx())[0].name == smq.COMPRESS_INDEX_NAME
    assert impls.select(ctx("cpu"))[0].name == "attention.sparse_mqa_compress_index.reference"
    for bad, why in ((ctx(attrs={"weight_format": "fp8_block"}), "fp8_block"), (ctx(index_head_dim=96), "96"),
                     (ctx(head_dim=48), "head_dim 48")):
        chosen, refusals = impls.select(bad)
        assert chosen.name == "attention.sparse_mqa_compress_index.reference" and why in dict(refusals)[
            smq.COMPRESS_INDEX_NAME]
    args, kw, _ = make_compress_case(965, 2, D=64, R=16, ratio=2)
    w, nw, icache = make_index_key_args(966, 2, 64, 32)
    for bad in ((w[:, :32], nw, icache), (w, nw[:16], icache), (w[:8], nw[:8], icache[..., :8])):
        with pytest.raises(UserError, match="index_weight"):
            smq.sparse_mqa_compress_index_triton(*args, *bad, index_eps=1e-6, **kw)


def test_bad_arguments_raise_user_errors(smq):
    args, kw, _ = make_case(700, [3, 5], **SMALL)
    fn = smq.sparse_mqa_decode_triton
    q, kv, pos, rows, seq, window, cache, bt, sel, sinks, inv = args
    with pytest.raises(UserError, match="kv_norm_weight"):
        fn(*args, kv_norm_weight=torch.ones(kv.shape[1] + 1), **kw)
    cases = [((q[0],) + args[1:], "\\[M, H, D\\]"), ((q, kv[:1]) + args[2:], "kv has shape"),
             (args[:6] + (None,) + args[7:], "together"), (args[:8] + (sel[:, :0],) + args[9:], "topk >= 1"),
             (args[:9] + (sinks[:3],) + args[10:], "sinks"), (args[:8] + (sel.float(),) + args[9:], "int32"),
             (args[:6] + (cache.transpose(0, 1),) + args[7:], "contiguous")]
    for bad, match in cases:
        with pytest.raises(UserError, match=match):
            fn(*bad, **kw)
    small = make_case(701, [3], **dict(SMALL, D=48))[0]
    with pytest.raises(UserError, match="attention.sparse_mqa.torch"):
        fn(*small, **kw)


@compiled_only
def test_kernels_compile_for_hopper_without_a_gpu(smq):
    """Both kernels build for sm_90 on the CPU (ptxas bundled with Triton) with the argument types and constexprs
    of real bf16 calls - DeepSeek TP8 and TP4 widths, batches 1 and 64, window-only, the kv norm in the prologue
    and without it, no sinks / pre-normed q:
    syntax, constexpr use and the tensor-core path are checked before any GPU run. (sin / cos keep a small local
    array for their large-argument path: not a spill.)"""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.triton_offline import _signature, recorded_launches

    with recorded_launches() as launches:
        for M, shape, K, sinks, norm, kvn in ((1, DSV4_TP8, 512, True, True, True),
                                              (64, DSV4_TP4, 512, True, True, True),
                                              (8, DSV4_TP8, 0, True, True, True),
                                              (8, DSV4_TP8, 0, False, False, False)):
            s = dict(shape, K=K)
            args, kw, _ = make_case(800 + M, [1] * M, dtype=torch.bfloat16, sinks=sinks, norm=norm, kv_norm=kvn, **s)
            smq.sparse_mqa_decode_triton(*args, **kw)
        # a verification step's call: the write-first launch, then the split kernel that stores nothing
        args, kw, _ = make_case(890, [1] * 8, dtype=torch.bfloat16, kv_norm=True, **DSV4_TP8)
        smq.sparse_mqa_decode_triton(*args, **kw, sliding_window=100, cross_row_reads=True)
        for ratio, cross in ((1, False), (2, False), (2, True)):
            args, kw, _ = make_compress_case(850 + ratio, 8, D=512, R=64, ratio=ratio, bs=64, dtype=torch.bfloat16)
            smq.sparse_mqa_compress_triton(*args, **kw, cross_row_reads=cross)
            # with the indexer's key (DeepSeek-V4.1-Flash: Dk 128)
            index = make_index_key_args(860 + ratio, 8, 512, 128, bs=64, dtype=torch.bfloat16)
            smq.sparse_mqa_compress_index_triton(*args, *index, index_eps=1e-6, **kw, cross_row_reads=cross)
    assert {fn.fn.__name__ for fn, _, _ in launches} == {"split_kernel", "combine_kernel", "compress_kernel"}
    seen = set()
    for fn, args, kw in launches:
        sig, const = _signature(fn, args, kw)
        key = (fn.fn.__name__, tuple(sorted(const.items())))
        if key in seen:
            continue
        seen.add(key)
        opts = {k: kw[k] for k in ("num_warps", "num_stages") if k in kw}
        ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                             options=opts).asm["ptx"]
        if fn.fn.__name__ == "split_kernel" and not const.get("WRITE_ONLY"):
            assert "mma" in ptx, const
    assert len(seen) >= 13
    assert {dict(c).get("NORM_KV") for name, c in seen if name == "split_kernel"} == {True, False}
    assert {dict(c).get("INDEX") for name, c in seen if name == "compress_kernel"} == {True, False}


@compiled_only
def test_selection_pdl_waits_before_the_selection_and_the_partials(smq, monkeypatch):
    """With ``SELECTION_PDL`` (offline sm_90a SASS, a batch-1 DeepSeek TP8 call behind its selection): the split kernel
    launches with PDL and has two grid-dependency waits (``ACQBULK``): before its loop (the programs with selected
    rows) and before its partial stores (window-only programs); only the ring row is stored before the first, every
    partial after the last. The radix select with ``SELECT_TRIGGER_START`` waits for its own prerequisites, then
    triggers (``PREEXIT``) before its first load of a logit. Off, or without ``after_selection``: no wait."""
    import latency_specialized.kernels.indexer_triton as ixt
    from latency_specialized.testing.offline_sass import sass_of
    from tests.triton_offline import ptx_for_hopper, recorded_launches

    for on, after in ((False, True), (True, False), (True, True)):
        monkeypatch.setattr(smq, "selection_pdl", lambda device, on=on: on)
        with recorded_launches() as launches:
            args, kw, _ = make_case(801, [1], dtype=torch.bfloat16, sinks=True, norm=True, kv_norm=True,
                                    **dict(DSV4_TP8, K=512))
            smq.sparse_mqa_decode_triton(*args, **kw, after_selection=after)
        wait = on and after
        assert [(fn.fn.__name__, k.get("launch_pdl", False)) for fn, _, k in launches] == [
            ("split_kernel", wait), ("combine_kernel", False)]
        split = sass_of(next(iter(ptx_for_hopper(launches[:1]).values()))).order
        waits = [i for i, op in enumerate(split) if op == "ACQBULK"]
        assert len(waits) == (2 if wait else 0), waits
        if wait:
            stores = [i for i, op in enumerate(split) if op.startswith("STG")]
            assert len([i for i in stores if i < waits[0]]) == 1, "only the ring row is stored before the wait"
            partials = [i for i in stores if i > waits[0]]
            assert len(partials) >= 3 and min(partials) > waits[-1], (waits, stores)
    with recorded_launches() as launches:
        ixt.launch_select(ixt._kernels(False)["select"], torch.randn(1, 4096), torch.tensor([2100], dtype=torch.int32),
                          torch.empty(1, 512, dtype=torch.int32), 512, 4096, trigger=True)
    select = sass_of(next(iter(ptx_for_hopper(launches).values()))).order
    first_load = next(i for i, op in enumerate(select) if op.startswith("LDG"))
    assert select.index("ACQBULK") < select.index("PREEXIT") < first_load


@compiled_only
def test_combine_pdl_reads_partials_only_after_its_wait(smq, monkeypatch):
    """With ``COMBINE_PDL`` (offline sm_90a SASS, a batch-1 DeepSeek TP8 call): the split kernel triggers its dependents
    (``PREEXIT``) after its last store, and the combine - launched with PDL - loads only the RoPE angle inputs and the
    sinks (3 loads) before its grid-dependency wait (``ACQBULK``), every partial after it. Off: neither."""
    from latency_specialized.testing.offline_sass import sass_of
    from tests.triton_offline import ptx_for_hopper, recorded_launches

    for on in (False, True):
        monkeypatch.setattr(smq, "combine_pdl", lambda device, on=on: on)
        with recorded_launches() as launches:
            args, kw, _ = make_case(801, [1], dtype=torch.bfloat16, sinks=True, norm=True, kv_norm=True,
                                    **dict(DSV4_TP8, K=512))
            smq.sparse_mqa_decode_triton(*args, **kw)
        assert [(fn.fn.__name__, k.get("launch_pdl", False)) for fn, _, k in launches] == [
            ("split_kernel", False), ("combine_kernel", on)]
        split, combine = (sass_of(p).order for p in ptx_for_hopper(launches).values())
        assert ("PREEXIT" in split) == on and ("ACQBULK" in combine) == on
        if on:
            assert split.index("PREEXIT") > max(i for i, op in enumerate(split) if op.startswith("STG"))
            wait = combine.index("ACQBULK")
            early = sorted(op for op in combine[:wait] if op.startswith(("LDG", "STG")))
            assert early == ["LDG.E", "LDG.E", "LDG.E.64"], early
