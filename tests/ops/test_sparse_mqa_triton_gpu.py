"""attention.sparse_mqa.triton on the GPU: bf16 at DeepSeek-V4.1-Flash TP8 / TP4 widths, fp32, CUDA graphs.

Cases from ``test_sparse_mqa_triton.make_case`` (fresh random inputs; ``out``, unread ring slots and unread cache
rows poisoned with NaN; windows partly filled and wrapped; padding rows; selections with -1 and incomplete rows;
-1 block ids past the end) moved to the device: bf16 tolerance against the reference (fp32 math, the same
roundings of q and the ring row; the raw kv normed in the kernel too), the ring written at exactly the new tokens' slots (one bf16 ulp: the kernel's
own fp32 RoPE order), the cache untouched. A captured call replays for new positions / lengths / selections /
ring and cache contents bit-identically to the eager call, and is two kernels. The compressor
(``attention.sparse_mqa_compress.triton``, ``make_compress_case``): bf16 at D = 512, ratios 1 / 2 / 4, replay ==
eager.
Run on the H200: ``pytest -m gpu tests/ops/test_sparse_mqa_triton_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.kernels.sparse_mqa_triton import sparse_mqa_compress_triton, sparse_mqa_decode_triton
from latency_specialized.ops.attention.sparse_mqa import sparse_mqa_decode_reference

from gpu_helpers import graph_replay
from test_sparse_mqa_triton import DSV4_TP4, DSV4_TP8, check_case, check_compress, make_case, make_compress_case

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


@pytest.mark.parametrize("topk", [512, 0], ids=["compressed", "window_only"])
@pytest.mark.parametrize("M", [1, 8, 64])
def test_graph_replay_equals_eager(M, topk):
    """Capture once on static buffers; new inputs copied in (positions, lengths, rows, selection, ring, cache, q,
    kv); replay == eager bit for bit, ring included (and both right)."""
    per = 34                                   # one block-table width for every case: 4096 // 2 // 64 + 2
    a0, kw, p0 = _case(600 + M, _lens(M, 0), "tp8", K=topk, per=per)
    static = [None if t is None else t.clone() for t in a0]
    static[5], static[6] = p0[0].clone(), None if p0[1] is None else p0[1].clone()
    out = torch.empty_like(a0[0])

    def call():
        sparse_mqa_decode_triton(*static, out=out, **kw)

    graph = graph_replay(call)
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
