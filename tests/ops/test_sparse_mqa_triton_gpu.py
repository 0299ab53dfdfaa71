"""attention.sparse_mqa.triton on the GPU: bf16 at DeepSeek-V4.1-Flash TP8 / TP4 widths, fp32, CUDA graphs.

Cases from ``test_sparse_mqa_triton.make_case`` (fresh random inputs; ``out``, unread ring slots and unread cache
rows poisoned with NaN; windows partly filled and wrapped; padding rows; selections with -1 and incomplete rows;
-1 block ids past the end) moved to the device: bf16 tolerance against the reference (fp32 math, the same
roundings of q and the ring row; the raw kv normed in the kernel too), the ring written at exactly the new tokens' slots (one bf16 ulp: the kernel's
own fp32 RoPE order), the cache untouched. A captured call replays for new positions / lengths / selections /
ring and cache contents bit-identically to the eager call, and is two kernels. The compressor
(``attention.sparse_mqa_compress.triton``, ``make_compress_case``): bf16 at D = 512, ratios 1 / 2 / 4, replay ==
eager; with the indexer's key (``attention.sparse_mqa_compress_index.triton``, Dk 128): the key cache at the
completed rows' slots against the reference, replay == eager. Verification steps (1 + k rows per request reading
each other's new ring / pending rows, ``cross_row_reads``) at TP8 widths, replay == eager.
Run on the H200: ``pytest -m gpu tests/ops/test_sparse_mqa_triton_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.kernels import sparse_mqa_triton
from latency_specialized.kernels.sparse_mqa_triton import sparse_mqa_compress_triton, sparse_mqa_decode_triton
from latency_specialized.ops.attention.sparse_mqa import sparse_mqa_compress_reference, sparse_mqa_decode_reference
from latency_specialized.ops.rope import rope_inv_freq

from gpu_helpers import graph_replay
from test_sparse_mqa_triton import (DSV4_TP4, DSV4_TP8, check_case, check_compress, check_compress_index, make_case,
                                   make_compress_case, make_compress_index_case, make_index_key_args)

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16 = dict(rtol=2e-2, atol=2e-2, ring_tol=2 ** -7)
SHAPES = {"tp8": DSV4_TP8, "tp4": DSV4_TP4}


def _lens(M: int, seed: int, context: int = 4096) -> list[int]:
    """Lengths up to ``context``: padding rows, partly filled windows (< 128) and wrapped ones."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randint(1, context + 1, (M,), generator=g).tolist()
    for i in range(M):
        if i % 7 == 3:
            out[i] = 0
        elif i % 5 == 1:
            out[i] = 1 + out[i] % 127
    return out


def _case(seed, lens, shape, **kw):
    return make_case(seed, lens, device=DEV, dtype=kw.pop("dtype", torch.bfloat16), **{**SHAPES[shape], **kw})


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("M", [1, 3, 8, 64])
@pytest.mark.parametrize("topk", [512, 0], ids=["compressed", "window_only"])
def test_matches_reference_bf16(shape, M, topk):
    args, kw, poisoned = _case(M * 7 + topk, _lens(M, M), shape, K=topk)
    check_case(sparse_mqa_decode_triton, args, kw, poisoned, **BF16)


@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("splits", [1, 2, 7, 20])
def test_forced_splits_and_ratios(ratio, splits):
    args, kw, poisoned = _case(100 + splits, [1, 0, 90, 4096, 129, 128, 2500, 3], "tp8", ratio=ratio)
    check_case(sparse_mqa_decode_triton, args, kw, poisoned, num_splits=splits, **BF16)


@pytest.mark.parametrize("sinks,norm", [(False, True), (True, False)], ids=["no_sinks", "q_normed"])
def test_no_sinks_and_prenormed_q(sinks, norm):
    args, kw, poisoned = _case(200 + sinks, _lens(8, 9), "tp4", sinks=sinks, norm=norm)
    check_case(sparse_mqa_decode_triton, args, kw, poisoned, **BF16)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("M", [1, 8, 64])
def test_kv_norm_in_the_prologue_bf16(shape, M):
    """The raw kv with ``kv_norm_weight`` (the piece's call): the normed row may round one bf16 ulp apart from
    torch's (another reduction order) before its RoPE, hence two ulps on the ring."""
    args, kw, poisoned = _case(400 + M, _lens(M, 13 + M), shape, kv_norm=True)
    check_case(sparse_mqa_decode_triton, args, kw, poisoned, **{**BF16, "ring_tol": 2 ** -6})


def test_fp32_uses_ieee_dots():
    args, kw, poisoned = _case(300, _lens(8, 11), "tp8", dtype=torch.float32)
    check_case(sparse_mqa_decode_triton, args, kw, poisoned, rtol=1e-4, atol=1e-4, ring_tol=1e-5)


def test_large_positions():
    args, kw, poisoned = _case(301, _lens(8, 12), "tp8", pos_offset=900_000)
    check_case(sparse_mqa_decode_triton, args, kw, poisoned, **BF16)


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "combine_pdl"])
@pytest.mark.parametrize("topk", [512, 0], ids=["compressed", "window_only"])
@pytest.mark.parametrize("M", [1, 8, 64])
def test_graph_replay_equals_eager(monkeypatch, M, topk, pdl):
    """Capture once on static buffers; new inputs copied in (positions, lengths, rows, selection, ring, cache, q,
    kv); replay == eager bit for bit, ring included (and both right). With ``COMBINE_PDL`` the captured combine
    launches early behind the split kernel; the eager calls run without PDL, so a partial read before the combine's
    wait would show as a difference."""
    import latency_specialized.kernels.sparse_mqa_triton as smq

    monkeypatch.setattr(smq, "COMBINE_PDL", pdl)
    assert smq.combine_pdl(torch.device(DEV)) == pdl, "PDL asked for but not available (sm_90+, Triton gdc_wait)"
    per = 34                                   # one block-table width for every case: 4096 // 2 // 64 + 2
    a0, kw, p0 = _case(600 + M, _lens(M, 0), "tp8", K=topk, per=per)
    static = [None if t is None else t.clone() for t in a0]
    static[5], static[6] = p0[0].clone(), None if p0[1] is None else p0[1].clone()
    out = torch.empty_like(a0[0])

    def call():
        sparse_mqa_decode_triton(*static, out=out, **kw)

    graph = graph_replay(call)
    monkeypatch.setattr(smq, "COMBINE_PDL", False)
    for seed in (1, 2):
        a, kw2, p = _case(seed * 31 + M, _lens(M, seed), "tp8", K=topk, per=per)
        assert kw2 == kw
        for i, src in enumerate(a):
            if static[i] is not None and i not in (5, 6):
                static[i].copy_(src)
        static[5].copy_(p[0])
        if p[1] is not None:
            static[6].copy_(p[1])
        eager_ring = p[0].clone()
        eager = sparse_mqa_decode_triton(*a[:5], eager_ring, p[1], *a[7:], **kw)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"replay {seed} != eager"
        torch.testing.assert_close(static[5], eager_ring, rtol=0, atol=0, equal_nan=True)
        check_case(sparse_mqa_decode_triton, a, kw, p, **BF16)


@pytest.mark.parametrize("M", [1, 8])
def test_split_behind_the_select_with_pdl(monkeypatch, M):
    """``SELECTION_PDL`` with ``SELECT_TRIGGER_START``: a captured [radix select -> sparse MQA] whose split kernel
    launches behind the select (which triggers its dependents at its start). Before every replay the selection
    buffer holds -1 everywhere, so a selection read before the split's wait would attend the window only; replay ==
    the eager pair without PDL, bit for bit (selection, output and ring), and right against the reference."""
    import latency_specialized.kernels.indexer_triton as ixt
    import latency_specialized.kernels.sparse_mqa_triton as smq

    dev = torch.device(DEV)
    monkeypatch.setattr(smq, "SELECTION_PDL", True)
    monkeypatch.setattr(ixt, "SELECT_TRIGGER_START", True)
    assert smq.selection_pdl(dev) and ixt.select_trigger(dev), "PDL asked for but not available (sm_90+, gdc)"
    select = ixt._kernels(False)["select"]
    per, cap = 34, 4096                          # the block-table width of every case; logits of 4,096 positions

    def inputs(seed):
        a, kw, _ = _case(seed, [max(n, 1100) for n in _lens(M, seed)], "tp8", per=per)   # > 512 rows to select
        g = torch.Generator(device=DEV).manual_seed(seed)
        logits = torch.randn(M, cap, device=DEV, generator=g).relu_()
        return list(a), kw, logits, (a[4] // 2).to(torch.int32)

    a0, kw, logits0, seq_c0 = inputs(700 + M)
    static, logits, seq_c = [None if t is None else t.clone() for t in a0], logits0.clone(), seq_c0.clone()
    out = torch.empty_like(a0[0])

    def call():
        ixt.launch_select(select, logits, seq_c, static[8], 512, cap, trigger=ixt.select_trigger(dev))
        sparse_mqa_decode_triton(*static, out=out, after_selection=True, **kw)

    graph = graph_replay(call)
    monkeypatch.setattr(smq, "SELECTION_PDL", False)
    monkeypatch.setattr(ixt, "SELECT_TRIGGER_START", False)
    for seed in (1, 2):
        a, kw2, lg, sc = inputs(seed * 37 + M)
        assert kw2 == kw
        for i, src in enumerate(a):
            if static[i] is not None:
                static[i].copy_(src)
        logits.copy_(lg)
        seq_c.copy_(sc)
        static[8].fill_(-1)
        eager_ring, eager_sel = a[5].clone(), torch.full_like(a[8], -1)
        ixt.launch_select(select, lg, sc, eager_sel, 512, cap)
        eager = sparse_mqa_decode_triton(*a[:5], eager_ring, a[6], a[7], eager_sel, *a[9:], **kw)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static[8], eager_sel), f"replay {seed}: the selection differs"
        assert torch.equal(out, eager), f"replay {seed} != eager"
        assert torch.equal(static[5], eager_ring), f"replay {seed}: the ring differs"
        ref = sparse_mqa_decode_reference(*a[:5], a[5].clone(), a[6], a[7], eager_sel, *a[9:], **kw).float()
        scale = ref.abs().max().item() + 1e-6
        torch.testing.assert_close(out.float(), ref, rtol=BF16["rtol"], atol=BF16["atol"] * scale)


def test_two_kernels_per_call():
    from latency_specialized.runtime.census import KernelCensus

    census = KernelCensus()
    if not census.available:
        pytest.skip("no CUDA driver for the census")
    args, kw, poisoned = _case(400, _lens(8, 4), "tp8")
    ring, out = poisoned[0].clone(), torch.empty_like(args[0])
    fn = census.wrap("sparse_mqa", 8, lambda: sparse_mqa_decode_triton(*args[:5], ring, *args[6:], out=out, **kw))
    graph_replay(fn)
    assert census.kernels(8)["sparse_mqa"] == 2


def test_agrees_with_the_torch_fallback_on_strided_q():
    """q a head slice of a wider buffer; the ``attention.sparse_mqa.torch`` composition (the reference's math)
    agrees."""
    args, kw, poisoned = _case(500, _lens(8, 5), "tp8")
    q = args[0]
    wide = torch.randn(q.shape[0], q.shape[1] + 1, q.shape[2], device=DEV, dtype=q.dtype)
    wide[:, 1:] = q
    a = (wide[:, 1:],) + args[1:]
    got = sparse_mqa_decode_triton(*a[:5], poisoned[0].clone(), poisoned[1], *a[7:], **kw).float()
    want = sparse_mqa_decode_reference(*a[:5], a[5].clone(), *a[6:], **kw).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("M", [1, 8, 64])
def test_compressor_matches_reference_bf16(ratio, M):
    args, kw, poisoned = make_compress_case(700 + M + ratio, M, D=512, R=64, ratio=ratio, bs=64,
                                            dtype=torch.bfloat16, device=DEV)
    check_compress(sparse_mqa_compress_triton, args, kw, poisoned, tol=2e-2)


@pytest.mark.parametrize("ratio", [1, 2])
def test_compressor_graph_replay_equals_eager(ratio):
    a0, kw, p0 = make_compress_case(800, 8, D=512, R=64, ratio=ratio, bs=64, dtype=torch.bfloat16, device=DEV)
    static = [None if t is None else t.clone() for t in a0]
    out = torch.empty(8, 512, device=DEV, dtype=torch.bfloat16)
    graph = graph_replay(lambda: sparse_mqa_compress_triton(*static, out=out, **kw))
    for seed in (1, 2):
        a, _, _ = make_compress_case(800 + seed, 8, D=512, R=64, ratio=ratio, bs=64, dtype=torch.bfloat16,
                                     device=DEV)
        for dst, src in zip(static, a):
            if dst is not None:
                dst.copy_(src)
        pend = None if a[1] is None else a[1].clone()
        cache = a[6].clone()
        eager = sparse_mqa_compress_triton(a[0], pend, *a[2:6], cache, a[7], **kw)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager) and torch.equal(static[6], cache)
        assert pend is None or torch.equal(static[1], pend)


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("M", [1, 8, 64])
def test_compressor_with_the_index_key_bf16(ratio, M):
    """DeepSeek-V4.1-Flash widths (D 512, rope 64, Dk 128) in bf16: lat, pending, the compressed cache and the key
    cache at the completed rows' slots against the reference (bf16 tolerance: the key gemm's rounding may differ by
    one ulp before the norm)."""
    args, kw, poisoned = make_compress_index_case(1700 + M + ratio, M, D=512, R=64, ratio=ratio, bs=64,
                                                  dtype=torch.bfloat16, device=DEV)
    index = make_index_key_args(1750 + M, M, 512, 128, bs=64, dtype=torch.bfloat16, device=DEV)
    check_compress_index(sparse_mqa_triton, args, kw, poisoned, index, tol=2e-2)


def test_compressor_with_the_index_key_graph_replay_equals_eager():
    """Captured once, replayed for new inputs, positions and slots: lat, both caches and pending bit-identical to
    the eager call's."""
    M, D, Dk = 8, 512, 128
    fn = sparse_mqa_triton.sparse_mqa_compress_index_triton
    a0, kw, _ = make_compress_index_case(1800, M, D=D, R=64, ratio=2, bs=64, dtype=torch.bfloat16, device=DEV)
    w, nw, ic0 = make_index_key_args(1801, M, D, Dk, bs=64, dtype=torch.bfloat16, device=DEV)
    static, icache = [t.clone() for t in a0], ic0.clone()
    out = torch.empty(M, D, device=DEV, dtype=torch.bfloat16)
    graph = graph_replay(lambda: fn(*static, w, nw, icache, index_eps=1e-6, out=out, **kw))
    for seed in (1, 2):
        a, _, _ = make_compress_index_case(1800 + 10 * seed, M, D=D, R=64, ratio=2, bs=64, dtype=torch.bfloat16,
                                           device=DEV)
        for dst, src in zip(static, a):
            dst.copy_(src)
        icache.copy_(ic0)
        pend, cache, ic = a[1].clone(), a[6].clone(), ic0.clone()
        eager = fn(a[0], pend, *a[2:6], cache, a[7], w, nw, ic, index_eps=1e-6, **kw)
        graph.replay()
        torch.cuda.synchronize()
        assert (a[7] >= 0).any() and torch.equal(out, eager) and torch.equal(static[6], cache)
        assert torch.equal(static[1], pend)
        assert torch.equal(icache.isnan(), ic.isnan()) and torch.equal(icache.nan_to_num(), ic.nan_to_num())


@pytest.mark.parametrize("B,k", [(1, 7), (8, 3), (64, 7)])
def test_verification_step_rows_at_deepseek_widths(B, k):
    """A verification step at TP8 widths (D = 512, window 128 on a ring of 128 + 7, top-512 selections): B
    requests x (1 + k) rows on their request's state row, row t reading the ring slots rows 0..t-1 write in the
    same call. ``cross_row_reads=True`` (what the piece passes) against the reference (which writes every row
    first), bf16 tolerance; replayed from a CUDA graph equal to eager. On the GPU the programs of a call run
    concurrently: without the flag this would race (``test_sparse_mqa_triton``'s interpreter case shows which
    reads it is)."""
    T = 1 + k
    lens = [n for n in _lens(B, 300 + B) for _ in range(T)]                      # per request, then per row
    # no not-yet-complete selection entries: rows t > 0 of a request are longer, so entries past the first row's
    # complete rows would turn valid and read block-table columns past its end (-1 there)
    args, kw, poisoned = _case(310 + B + k, lens, "tp8", W=DSV4_TP8["W"] + 7, beyond=False)
    q, kv, pos, rows, seq, window, cache, bt, sel, sinks, inv = args
    req = torch.arange(B * T, device=DEV) // T
    rows = rows[req * T].contiguous()                                             # one state row per request
    off = torch.arange(B * T, device=DEV) % T
    live = seq > 0
    pos = pos + off        # padding rows too: one slot each (several writing one slot would race on the ring)
    seq = torch.where(live, seq + off.to(seq.dtype), seq)
    kw = {**kw, "sliding_window": DSV4_TP8["W"]}
    ref_ring = window.clone()
    want = sparse_mqa_decode_reference(q, kv, pos, rows, seq, ref_ring, cache, bt, sel, sinks, inv, **kw)
    ring = window.clone()
    ring[rows.long(), pos % window.shape[1]] = float("nan")                       # written by this call
    base = ring.clone()
    got = sparse_mqa_decode_triton(q, kv, pos, rows, seq, ring, cache, bt, sel, sinks, inv, cross_row_reads=True, **kw)
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale)
    assert not got.isnan().any()
    torch.testing.assert_close(ring.float(), ref_ring.float(), rtol=2 ** -7, atol=2 ** -7)
    replay_ring = base.clone()
    out = torch.empty_like(got)
    graph = graph_replay(lambda: sparse_mqa_decode_triton(q, kv, pos, rows, seq, replay_ring, cache, bt, sel, sinks,
                                                          inv, cross_row_reads=True, out=out, **kw))
    replay_ring.copy_(base)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got) and torch.equal(replay_ring, ring)


@pytest.mark.parametrize("ratio,k", [(2, 3), (2, 7)])
def test_compressor_verification_rows_bf16(ratio, k):
    """1 + k consecutive tokens of 8 requests in one call (pending rings of ratio + k rows), ``cross_row_reads``:
    lat of the tokens that close a group, pending and cache equal the reference's."""
    B, T, D, R = 8, 1 + k, 512, 64
    g = torch.Generator().manual_seed(400 + ratio + k)
    rows = torch.randperm(B + 2, generator=g)[:B].repeat_interleave(T).to(torch.int32)
    pos = (torch.randint(0, 4000, (B,), generator=g).repeat_interleave(T) + torch.arange(B * T) % T)
    c = (2.0 * torch.randn(B * T, 2 * D, generator=g) + 0.3).bfloat16()
    pending = torch.randn(B + 2, ratio + k, 2 * D, generator=g).bfloat16()
    cache = torch.randn(B * T + 2, 64, D, generator=g).bfloat16()
    slots = torch.where((pos + 1) % ratio == 0, torch.randperm((B * T + 2) * 64, generator=g)[:B * T], -1)
    norm_w, inv = (1.0 + 0.1 * torch.randn(D, generator=g)).bfloat16(), rope_inv_freq(1e4, R)
    dev = [t.to(DEV) for t in (c, pending, rows, pos, norm_w, inv, cache, slots)]
    p_ref, c_ref = dev[1].clone(), dev[6].clone()
    want = sparse_mqa_compress_reference(dev[0], p_ref, *dev[2:6], c_ref, dev[7], eps=1e-6, ratio=ratio)
    p_tri, c_tri = dev[1].clone(), dev[6].clone()
    p_tri[dev[2].long(), dev[3] % (ratio + k)] = float("nan")
    got = sparse_mqa_compress_triton(dev[0], p_tri, *dev[2:6], c_tri, dev[7], eps=1e-6, ratio=ratio,
                                     cross_row_reads=True)
    closes = dev[7] >= 0
    torch.testing.assert_close(got[closes].float(), want[closes].float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(p_tri, p_ref)
    torch.testing.assert_close(c_tri.float(), c_ref.float(), rtol=2e-2, atol=2e-2)
