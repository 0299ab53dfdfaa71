"""attention.gqa.triton_splitkv on the CPU, under the Triton interpreter (fp32 tight, bf16 looser).

As ``test_mla_triton.py``: the kernel cases (marker ``interpreter_case``) need ``TRITON_INTERPRET=1``
from the process start, so a plain CPU run deselects them and ``test_kernel_cases_under_the_interpreter``
runs them in a child process (``tests/interpret.py``); the other tests here (split rule, support
reasons, registration, argument errors) run in-process.

The interpreter's bf16 ``tl.dot`` is wrong on this CPU, so under it the kernel widens the dots'
operands - rounded to the cache dtype as on the GPU - to fp32 (``DOT_F32``): the bf16 cases check the
roundings, the bf16 cache stores and the output rounding; the bf16 tensor-core dots are checked by
``tests/ops/test_gqa_triton_gpu.py``.

Every case: fresh random inputs; ``out`` poisoned with NaN; every cache row that no live position reads
poisoned with NaN (tails of the last blocks, unused blocks, the positions before a sliding window, the
new tokens' slots before the write); -1 / garbage block ids past each sequence's end *and before its
window* (a read of them fails); shuffled blocks; padding rows (seq_lens 0, slot -1); the cache must
change at exactly the live slots (to the new k/v in the cache dtype) and the result equal the reference.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels import triton_common as tc
from latency_specialized.ops.attention.gqa import gqa_decode_reference
from latency_specialized.ops.registry import make_context

from tests.interpret import run_interpreted

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (its interpreter runs the kernels on the CPU)")
interpreted = pytest.mark.interpreter_case
"""Needs TRITON_INTERPRET=1 from the process start: collected only there (the driver below runs these)."""

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
GARBAGE = 2 ** 30


@pytest.mark.interpreter_driver
def test_kernel_cases_under_the_interpreter():
    run_interpreted(__file__, min_passed=44)


@pytest.fixture
def gk():
    from latency_specialized.kernels import gqa_decode_triton

    return gqa_decode_triton


def _small_tiles(gk, monkeypatch) -> None:
    """16-position tiles and chunks: several tiles and live splits per sequence at these short lengths."""
    monkeypatch.setattr(gk, "TILE_BYTES", 16)
    monkeypatch.setattr(gk, "MIN_CHUNK", 16)


def _case(seed, lens, *, Hq=4, KV=2, D=16, bs=4, window=None, sinks=False, dtype=torch.float32,
          cache_dtype=None, spare=3, vllm_layout=False, strided=True, sink_scale=1.0):
    """Inputs as the GQA piece passes them: q a strided view, k/v column slices of one projection row."""
    g = torch.Generator().manual_seed(seed)
    cdt = cache_dtype or dtype
    M = len(lens)
    per = max(-(-max(max(lens), 1) // bs), 1) + 1            # one block more than the longest needs
    nb = M * per + spare
    if vllm_layout:   # vLLM's [2, num_blocks, block_size, KV, D]: k and v caches are its two halves
        kv = torch.randn(2, nb, bs, KV, D, generator=g).to(cdt)
        kc, vc = kv[0], kv[1]
    else:
        kc = torch.randn(nb, bs, KV, D, generator=g).to(cdt)
        vc = torch.randn(nb, bs, KV, D, generator=g).to(cdt)
    blocks = torch.randperm(nb, generator=g)[:M * per].view(M, per).to(torch.int32)
    slots = torch.full((M,), -1, dtype=torch.int64)
    read = torch.zeros(nb * bs, dtype=torch.bool)
    for b, n in enumerate(lens):
        lo = max(0, n - window) if window else 0
        if n > 0:
            p = n - 1
            slots[b] = int(blocks[b, p // bs]) * bs + p % bs
            pos = torch.arange(lo, n - 1)
            read[blocks[b, pos // bs].long() * bs + pos % bs] = True
        used = -(-n // bs)
        blocks[b, used:] = -1 if b % 2 else GARBAGE         # past the end: never read
        blocks[b, :lo // bs] = GARBAGE                       # wholly before the window: never read
    for c in (kc, vc):
        c.view(-1, KV, D)[~read] = float("nan")              # nothing may read these (new slots: written first)
    width = (Hq + 2 * KV) * D + (5 if strided else 0)
    qkv = torch.randn(M, width, generator=g).to(dtype)
    q = qkv[:, :Hq * D].view(M, Hq, D)
    k = qkv[:, Hq * D:(Hq + KV) * D].view(M, KV, D)
    v = qkv[:, (Hq + KV) * D:(Hq + 2 * KV) * D].view(M, KV, D)
    if not strided:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    kw = dict(window=window, k=k, v=v, slot_mapping=slots)
    if sinks:
        kw["sinks"] = sink_scale * torch.randn(Hq, generator=g)
    return (q, kc, vc, blocks, torch.tensor(lens, dtype=torch.int32)), kw


def _check(gk, args, kw, store_ulp=False, **call):
    q, kc, vc, blocks, seq_lens = args
    before = (kc.clone(), vc.clone())
    ref_c, tri_c = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
    want = gqa_decode_reference(q, *ref_c, blocks, seq_lens, **kw)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    got = gk.gqa_decode_triton(q, *tri_c, blocks, seq_lens, out=out, **kw, **call)
    assert got is out and not torch.isnan(out).any(), "output left unwritten or NaN leaked"
    tol = TOL[kc.dtype if kc.dtype != torch.float32 else q.dtype]
    scale = want.float().abs().max().item() + 1e-6
    torch.testing.assert_close(got.float(), want.float(), rtol=tol["rtol"], atol=tol["atol"] * scale)
    pad = seq_lens == 0
    assert torch.equal(got[pad], torch.zeros_like(got[pad])), "padding rows must be exact zeros"
    if kw.get("k") is None:
        for c, c0 in zip(tri_c, before):
            torch.testing.assert_close(c, c0, rtol=0, atol=0, equal_nan=True)
        return got
    # the caches changed at exactly the live slots, to the new k / v in the cache dtype
    slots = kw["slot_mapping"]
    live = slots[slots >= 0]
    KV, D = kc.shape[2:]
    changed = torch.zeros(kc.shape[0] * kc.shape[1], dtype=torch.bool)
    changed[live] = True
    for c, c0, c_ref, new in zip(tri_c, before, ref_c, (kw["k"], kw["v"])):
        flat, flat0 = c.reshape(-1, KV, D), c0.reshape(-1, KV, D)
        torch.testing.assert_close(flat[~changed], flat0[~changed], rtol=0, atol=0, equal_nan=True)
        if store_ulp:  # the interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest even): one ulp
            torch.testing.assert_close(flat[live].float(), new[slots >= 0].float(), rtol=2 ** -7, atol=0)
        else:
            assert torch.equal(flat[live], new[slots >= 0].to(c.dtype))
            torch.testing.assert_close(c, c_ref, rtol=0, atol=0, equal_nan=True)
    return got


LENS = [0, 1, 70, 0, 37, 16]
"""Padding rows first and in between, a one-token sequence, lengths on and off block/tile boundaries."""


@interpreted
@pytest.mark.parametrize("window,splits,sinks", [
    (None, 1, False), (None, 2, True), (None, 3, False), (None, 5, True),
    (7, 1, True), (7, 3, False), (7, 5, True),
    (20, 1, False), (20, 3, True),
    (1000, 1, True), (1000, 3, False), (1000, 5, True),
], ids=lambda x: str(x))
def test_matches_reference(gk, monkeypatch, splits, window, sinks):
    """fp32, Hq 4 / KV 2 / D 16, block size 4: windows smaller than most contexts and not multiples of the
    block size (7, 20) or larger than every context (1000), sinks on/off, one to five forced splits."""
    _small_tiles(gk, monkeypatch)
    args, kw = _case(100 * splits + (window or 0) + sinks, LENS, window=window, sinks=sinks)
    _check(gk, args, kw, num_splits=splits)


@interpreted
@pytest.mark.parametrize("Hq,KV,D,bs", [(16, 2, 32, 16), (6, 2, 64, 16), (2, 2, 16, 64), (8, 1, 128, 16)],
                         ids=["g8_d32_bs16", "g3_d64", "mha_bs64", "g8_d128"])
@pytest.mark.parametrize("splits", [1, 3])
def test_group_sizes_head_dims_block_sizes(gk, monkeypatch, Hq, KV, D, bs, splits):
    """Groups of 8 (Muse Spark / Qwen3 ratio, padded to 16 tile rows), 3 (masked rows), 1 (MHA); head_dim
    16-128; block sizes 16 and 64; a window of 33 on top of full attention."""
    _small_tiles(gk, monkeypatch)
    lens = [0, 1, 70, 33]
    for window in (None, 33):
        args, kw = _case(Hq * 7 + D + bs + splits, lens, Hq=Hq, KV=KV, D=D, bs=bs, window=window, sinks=True)
        _check(gk, args, kw, num_splits=splits)


@interpreted
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("window", [None, 9], ids=["full", "w9"])
def test_bf16(gk, monkeypatch, splits, window):
    """bf16 q/k/v/caches (a bf16 tolerance): the cache stores and the output rounding (module docstring:
    the dots' bf16 operands are widened under the interpreter)."""
    _small_tiles(gk, monkeypatch)
    args, kw = _case(500 + splits + (window or 0), LENS, Hq=16, KV=2, D=32, bs=16, window=window, sinks=True,
                     dtype=torch.bfloat16)
    _check(gk, args, kw, num_splits=splits)


@interpreted
def test_fp32_activations_bf16_cache(gk, monkeypatch):
    """q/k/v in fp32, caches in bf16: the new k/v are stored rounded to bf16 and attended as stored. The
    interpreter's fp32 -> bf16 cast truncates (the GPU's rounds to nearest even: exact there, see the GPU
    tests), so the stored values are checked to one bf16 ulp here."""
    _small_tiles(gk, monkeypatch)
    args, kw = _case(601, LENS, Hq=8, KV=2, D=32, bs=16, sinks=True, cache_dtype=torch.bfloat16)
    for splits in (1, 3):
        _check(gk, args, kw, store_ulp=True, num_splits=splits)


@interpreted
@pytest.mark.parametrize("splits", [1, 3])
def test_fused_write_never_reads_the_new_token_from_memory(gk, monkeypatch, splits):
    """With the fused write's stores left out (``_STORE_NEW``) the result is still the reference's and the
    new slots still hold their NaN poison: every program took the new k/v from registers, so none depends
    on the order in which the split-0 store and the other programs' loads land on the GPU."""
    _small_tiles(gk, monkeypatch)
    monkeypatch.setattr(gk, "_STORE_NEW", False)
    args, kw = _case(650 + splits, LENS, window=20, sinks=True)
    q, kc, vc, blocks, lens = args
    want = gqa_decode_reference(q, kc.clone(), vc.clone(), blocks, lens, **kw)
    c = (kc.clone(), vc.clone())
    got = gk.gqa_decode_triton(q, *c, blocks, lens, num_splits=splits, **kw)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
    slots = kw["slot_mapping"]
    for cache, cache0 in zip(c, (kc, vc)):
        torch.testing.assert_close(cache, cache0, rtol=0, atol=0, equal_nan=True)
        assert torch.isnan(cache.view(-1, *cache.shape[2:])[slots[slots >= 0]]).all()


@interpreted
@pytest.mark.parametrize("splits", [1, 3])
def test_separate_write_kernel(gk, monkeypatch, splits):
    """fused_write=False: the write kernel runs first, the split kernel reads the new token from the cache."""
    _small_tiles(gk, monkeypatch)
    args, kw = _case(700 + splits, LENS, window=20, sinks=True)
    _check(gk, args, kw, num_splits=splits, fused_write=False)


@interpreted
@pytest.mark.parametrize("splits", [1, 3])
def test_verification_rows_read_each_others_new_slots(gk, monkeypatch, splits):
    """A verification step: the 1 + k rows of one request share its block table, row t attends to the new
    slots of rows 0..t. ``cross_row_reads=True`` writes every row first (the reference's order): equal to the
    reference. The fused write takes only a row's *own* new slot from registers, so with its stores left out
    (``_STORE_NEW``) the later rows read the earlier rows' slots from memory - the poison there spoils them:
    a fused call would race there, which is why the GQA piece passes the flag in verification steps."""
    _small_tiles(gk, monkeypatch)
    g = torch.Generator().manual_seed(900 + splits)
    T, n0, Hq, KV, D, bs = 4, 37, 4, 2, 16, 4
    per = -(-(n0 + T) // bs) + 1
    kc, vc = torch.randn(2 * per, bs, KV, D, generator=g), torch.randn(2 * per, bs, KV, D, generator=g)
    table = torch.randperm(2 * per, generator=g)[:per].to(torch.int32)
    blocks = table.expand(T, per).contiguous()
    pos = torch.arange(n0 - 1, n0 - 1 + T)                               # each row's new position
    slots = table[pos // bs].long() * bs + pos % bs
    for c in (kc, vc):
        c.view(-1, KV, D)[slots] = float("nan")                           # written by this call
    lens = torch.arange(n0, n0 + T, dtype=torch.int32)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (Hq, KV, KV))
    kw = dict(k=k, v=v, slot_mapping=slots, sinks=torch.randn(Hq, generator=g))
    want = gqa_decode_reference(q, kc.clone(), vc.clone(), blocks, lens, **kw)
    got = gk.gqa_decode_triton(q, kc.clone(), vc.clone(), blocks, lens, num_splits=splits, cross_row_reads=True,
                               **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    monkeypatch.setattr(gk, "_STORE_NEW", False)
    raced = gk.gqa_decode_triton(q, kc.clone(), vc.clone(), blocks, lens, num_splits=splits, **kw)
    torch.testing.assert_close(raced[0], want[0], rtol=1e-5, atol=1e-5 * want.abs().max().item())
    for t in range(1, T):   # each later row met the poison of an earlier row's slot: not the reference
        assert not torch.allclose(raced[t], want[t], rtol=1e-3, atol=1e-3), t


@interpreted
@pytest.mark.parametrize("splits", [1, 3])
def test_without_the_kv_write(gk, monkeypatch, splits):
    """The original convention (no k/v/slot_mapping): the caches already hold the new token; nothing written."""
    _small_tiles(gk, monkeypatch)
    args, kw = _case(800 + splits, LENS, window=7, sinks=True)
    q, kc, vc, blocks, lens = args
    slots = kw.pop("slot_mapping")
    for c, new in ((kc, kw.pop("k")), (vc, kw.pop("v"))):
        c.view(-1, *c.shape[2:])[slots[slots >= 0]] = new[slots >= 0]
    _check(gk, args, kw, num_splits=splits)


@interpreted
def test_default_tiles_splits_and_layouts(gk):
    """Default tile size (BLOCK_N = 128 at D 16 fp32: a tile spans many 4-position blocks), default split
    count, vLLM's [2, blocks, ...] cache halves, contiguous inputs, an explicit scale."""
    assert gk.block_n(16, 4) == 128
    args, kw = _case(901, [0, 1, 150, 300, 77], vllm_layout=True, strided=False)
    _check(gk, args, kw)
    _check(gk, args, dict(kw, scale=0.37), num_splits=2)
    args, kw = _case(902, [129, 5, 0], window=130, sinks=True, bs=16)
    _check(gk, args, kw, num_splits=3)


@interpreted
def test_window_of_one_and_large_sinks(gk, monkeypatch):
    """window = 1 (only the new token: its value comes from the write), sinks far above and below the
    scores (the denominator's max includes the sink)."""
    _small_tiles(gk, monkeypatch)
    args, kw = _case(1001, LENS, window=1, sinks=True, sink_scale=30.0)
    for splits in (1, 2):
        _check(gk, args, kw, num_splits=splits)
    args, kw = _case(1002, LENS, sinks=True, sink_scale=-30.0)
    _check(gk, args, kw, num_splits=3)
    args, kw = _case(1003, LENS, sinks=True, sink_scale=30.0)
    _check(gk, args, kw, num_splits=3)


@interpreted
def test_all_padding_batch_gives_zeros(gk):
    args, kw = _case(1101, [0, 0, 0], sinks=True)
    for splits in (1, 2):
        _check(gk, args, kw, num_splits=splits)


@interpreted
@pytest.mark.parametrize("fused", [False, True], ids=["merge_kernel", "fused_merge"])
def test_many_splits_past_every_chunk(gk, monkeypatch, fused):
    """More splits than live chunks (most programs find no position: m = -inf, l = 0): the merge kernel in tiles of
    4, or the split kernel's own merge in rounds of 4."""
    _small_tiles(gk, monkeypatch)
    monkeypatch.setattr(gk, "MERGE_S_TILE", 4)
    monkeypatch.setattr(gk, "FUSED_MERGE_MAX_SPLITS", 32 if fused else 0)
    args, kw = _case(1201, [70, 3, 0], sinks=True)
    _check(gk, args, kw, num_splits=11)


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("the merge kernel launched where the split kernel merges")


@interpreted
@pytest.mark.parametrize("splits,unroll,sinks,window", [(2, 4, True, None), (5, 4, False, 20), (7, 2, True, 7),
                                                        (9, 1, True, None)], ids=lambda x: str(x))
def test_fused_merge_equals_the_merge_kernel_and_leaves_counters_zero(gk, monkeypatch, splits, unroll, sinks, window):
    """The split kernel's own merge (the last program of each (row, KV head) to arrive): the reference's output and
    lse, the merge kernel's within fp32 rounding, rounds of ``FUSED_MERGE_UNROLL`` splits that do not divide the
    split count; the cached counters are zero after the call, so the next call (a replay) starts right."""
    _small_tiles(gk, monkeypatch)
    monkeypatch.setattr(gk, "FUSED_MERGE_UNROLL", unroll)
    args, kw = _case(1401 + splits, LENS, sinks=sinks, window=window)
    q, kc, vc, blocks, seq_lens = args
    M, Hq, _ = q.shape
    monkeypatch.setattr(gk, "FUSED_MERGE_MAX_SPLITS", 32)   # off by default: the A/B switch on
    assert gk.fused_merge(splits)
    results = {}
    kernels = gk._kernels(True)
    merge_kernel = kernels["merge"]
    for fused in (True, False, True):
        monkeypatch.setattr(gk, "FUSED_MERGE_MAX_SPLITS", 32 if fused else 0)
        # the fused calls must not launch the merge kernel: a launch of it fails the test
        monkeypatch.setitem(kernels, "merge", _NoLaunch() if fused else merge_kernel)
        lse = torch.full((M, Hq), float("nan"))
        out = _check(gk, (q, kc.clone(), vc.clone(), blocks, seq_lens), kw, num_splits=splits, lse=lse)
        results.setdefault(fused, []).append((out, lse))
        counters = gk.arrival_counters(M * kc.shape[2], q.device)
        assert torch.equal(counters, torch.zeros_like(counters)), "the last arrivals must reset their counters"
    (o_f, lse_f), (o_f2, lse_f2) = results[True]
    (o_m, lse_m), = results[False]
    assert torch.equal(o_f, o_f2) and torch.equal(lse_f, lse_f2)
    torch.testing.assert_close(o_f, o_m, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_f, lse_m, rtol=1e-6, atol=1e-6, equal_nan=False)


@interpreted
@pytest.mark.parametrize("d_block", [4, 8])
def test_merge_in_column_blocks(gk, monkeypatch, d_block):
    """The merge split over head-dim columns (``MERGE_D_BLOCK``: grid (M, Hq, D / block), each program its columns
    of every split, ``MERGE_S_TILE x D / block`` splits a step): the same output, every column written."""
    _small_tiles(gk, monkeypatch)
    monkeypatch.setattr(gk, "MERGE_D_BLOCK", d_block)
    monkeypatch.setattr(gk, "MERGE_S_TILE", 1)
    monkeypatch.setattr(gk, "FUSED_MERGE_MAX_SPLITS", 0)
    assert gk.merge_d_block(16) == d_block and gk.merge_d_block(d_block) == d_block
    args, kw = _case(1301 + d_block, [70, 3, 0, 41], sinks=True)
    _check(gk, args, kw, num_splits=7)


# ----------------------------------------------------------------------------------- no interpreter needed
def test_num_splits_rule_is_static():
    from latency_specialized.kernels.gqa_decode_triton import MAX_SPLITS, MIN_CHUNK, choose_num_splits, span

    # Muse Spark TP8 (KV 2), a 32k block table, 132 SMs: <= 2 programs per SM, rounded down
    assert [choose_num_splits(b, 2, 32768, 132) for b in (1, 8, 16, 32, 64)] == [132, 16, 8, 4, 2]
    assert choose_num_splits(128, 2, 32768, 132) == 1               # the batch alone fills the GPU
    assert choose_num_splits(1, 4, 32768, 132) == 66                # Qwen3 (KV 4)
    assert choose_num_splits(1, 2, 4096, 132) == 4096 // MIN_CHUNK  # capacity bound
    assert choose_num_splits(1, 1, 10 ** 7, 10_000) == MAX_SPLITS
    assert span(32768, 2048) == 2048 and span(1024, 2048) == 1024 and span(32768, None) == 32768
    assert choose_num_splits(8, 2, span(32768, 2048), 132) == 16   # a window caps the splits by its length
    assert choose_num_splits(1, 2, span(32768, 2048), 132) == 2048 // MIN_CHUNK


def test_tile_shapes():
    from latency_specialized.kernels.gqa_decode_triton import block_g, block_n

    # TILE_BYTES = 16 KB of K per tile (the H200 sweep's choice), clamped to [16, 128] positions
    assert [block_n(d, 2) for d in (16, 32, 64, 128, 256)] == [128, 128, 128, 64, 32]
    assert [block_n(d, 4) for d in (16, 64, 128)] == [128, 64, 32]
    assert [block_g(g) for g in (1, 3, 8, 16, 24)] == [16, 16, 16, 16, 32]


def _ctx(arch="sm_90", dtype="bfloat16", heads=16, kv_heads=2, head_dim=64):
    return make_context("attention.gqa", arch=arch, dtype=dtype, tokens=8, world_size=8,
                        dims=dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, window=2048),
                        attrs=dict(sinks=True, kv_write=True))


def test_supports_names_the_reason(gk):
    sup = gk.IMPLEMENTATIONS[0].supports
    assert sup(_ctx()) is True and sup(_ctx("sm_100a")) is True and sup(_ctx("sm_80", "float32")) is True
    assert sup(_ctx(heads=32, kv_heads=4, head_dim=128)) is True
    assert "GPU" in sup(_ctx("cpu")) and "sm_80" in sup(_ctx("sm_75"))
    assert "dtype" in sup(_ctx(dtype="float8_e4m3fn"))
    assert "head_dim 8" in sup(_ctx(head_dim=8)) and "head_dim 96" in sup(_ctx(head_dim=96))
    assert "head_dim 512" in sup(_ctx(head_dim=512))
    assert "multiple" in sup(_ctx(heads=6, kv_heads=4))
    assert "group" in sup(_ctx(heads=256, kv_heads=1))


def test_registered_above_torch_paged():
    from latency_specialized.plugins import get_registry

    reg = get_registry().implementations
    names = [i.name for i in reg.family("attention.gqa")]
    assert names.index("attention.gqa.triton_splitkv") < names.index("attention.gqa.torch_paged")
    chosen, _ = reg.select(_ctx())
    assert chosen.name == "attention.gqa.triton_splitkv"
    chosen, refusals = reg.select(_ctx("cpu"))
    assert chosen.name == "attention.gqa.reference" and "attention.gqa.triton_splitkv" in dict(refusals)


def test_unsupported_shapes_raise_before_any_kernel(gk):
    args, kw = _case(3, [4, 2], D=8)
    with pytest.raises(UserError, match="torch_paged"):
        gk.gqa_decode_triton(*args, **kw)
    args, kw = _case(4, [4, 2], cache_dtype=torch.float64)
    with pytest.raises(UserError, match="bf16"):
        gk.gqa_decode_triton(*args, **kw)
    args, kw = _case(5, [4, 2])
    with pytest.raises(ValueError, match="together"):
        gk.gqa_decode_triton(*args, k=kw["k"], v=kw["v"])
    q, kc, vc, blocks, lens = args
    with pytest.raises(UserError, match="same strides"):
        gk.gqa_decode_triton(q, kc, vc.transpose(0, 1).contiguous().transpose(0, 1), blocks, lens)
    with pytest.raises(UserError, match="unit last stride"):
        gk.gqa_decode_triton(q, kc, vc, blocks, lens, out=torch.empty(q.shape[::-1]).transpose(0, 2))


def test_host_code_never_reads_device_values():
    """Graph safety, checked on the source: the host side of the module calls nothing that reads a tensor's
    values back (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``nonzero``, a synchronize) and never
    converts a tensor argument with ``int()``/``bool()``/``float()`` - the split count comes from shapes."""
    import ast
    import inspect

    from latency_specialized.kernels import gqa_decode_triton as mod

    tree = ast.parse(inspect.getsource(mod))
    tensors = {"q", "k_cache", "v_cache", "block_table", "seq_lens", "k", "v", "slot_mapping", "sinks", "bt",
               "slots", "kn", "vn"}
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in ("item", "tolist", "cpu", "numpy", "nonzero", "synchronize"):
            bad.append(f"{f.attr}() at line {node.lineno}")
        if isinstance(f, ast.Name) and f.id in ("int", "bool", "float") and node.args:
            a = node.args[0]
            if isinstance(a, ast.Name) and a.id in tensors:
                bad.append(f"{f.id}({a.id}) at line {node.lineno}")
    assert not bad, bad


def test_merge_pdl_only_behind_a_split_kernel_on_sm90(gk, monkeypatch):
    """The merge launches with PDL (the split programs trigger it at their end) only where there is a merge,
    compiled, on sm_90+ with Triton's grid dependency control, and ``MERGE_PDL`` on."""
    monkeypatch.setattr(tc, "interpreting", lambda: False)
    monkeypatch.setattr(tc, "capability", lambda device: (9, 0))
    monkeypatch.setattr(tc, "triton_has_gdc", lambda: True)
    gpu = torch.device("cuda", 0)
    assert gk.late_merge_pdl(gpu, 16) and not gk.late_merge_pdl(gpu, 1)
    assert not gk.late_merge_pdl(torch.device("cpu"), 16)
    monkeypatch.setattr(tc, "capability", lambda device: (8, 0))
    assert not gk.late_merge_pdl(gpu, 16)                         # griddepcontrol needs sm_90
    monkeypatch.setattr(tc, "capability", lambda device: (9, 0))
    monkeypatch.setattr(tc, "triton_has_gdc", lambda: False)
    assert not gk.late_merge_pdl(gpu, 16)
    monkeypatch.setattr(tc, "triton_has_gdc", lambda: True)
    monkeypatch.setattr(gk, "MERGE_PDL", False)
    assert not gk.late_merge_pdl(gpu, 16)
    monkeypatch.setattr(tc, "interpreting", lambda: True)
    monkeypatch.setattr(gk, "MERGE_PDL", True)
    assert not gk.late_merge_pdl(gpu, 16)


def test_merge_d_block_rule(gk, monkeypatch):
    """``MERGE_D_BLOCK`` applies where it is a power of two below the head dim; anything else merges whole heads.
    The default (16: session 36's A/B, NOTES_gqa.md) splits a 64-wide head in four and leaves a 16-wide one whole."""
    assert gk.MERGE_D_BLOCK == 16 and gk.merge_d_block(64) == 16 and gk.merge_d_block(16) == 16
    for block, want in ((0, 64), (16, 16), (64, 64), (128, 64), (24, 64)):
        monkeypatch.setattr(gk, "MERGE_D_BLOCK", block)
        assert gk.merge_d_block(64) == want, block


@pytest.mark.parametrize("late,early", [(False, False), (True, False), (True, True)], ids=["off", "end", "start"])
def test_pdl_launches_compile_for_hopper(gk, monkeypatch, late, early):
    """With the merge launched early, the split kernel triggers it after its stores (or, ``EARLY_TRIGGER``, as it
    starts) and the merge launches with ``launch_pdl`` and waits; every launch (sinks, LSE, window; bf16 Muse Spark
    TP8 widths; the start-trigger case with the merge in 16-column blocks) builds for sm_90 on the CPU
    (``tests/triton_offline.py``: recorded, not run). Without it, neither."""
    import os

    from tests.triton_offline import compile_for_hopper, recorded_launches

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("compiles only where triton was imported without the interpreter")
    monkeypatch.setattr(gk, "late_merge_pdl", lambda device, num_splits: late and num_splits > 1)
    monkeypatch.setattr(gk, "FUSED_MERGE_MAX_SPLITS", 0)   # the merge kernel's launch is what this test is about
    monkeypatch.setattr(gk, "EARLY_TRIGGER", early)
    monkeypatch.setattr(gk, "MERGE_D_BLOCK", 16 if early else 0)
    M, Hq, KV, D, bs, d = 3, 16, 2, 64, 16, torch.bfloat16
    kc, vc = torch.zeros(8, bs, KV, D, dtype=d), torch.zeros(8, bs, KV, D, dtype=d)
    q, k, v = torch.randn(M, Hq, D).to(d), torch.randn(M, KV, D).to(d), torch.randn(M, KV, D).to(d)
    table = torch.arange(6, dtype=torch.int32).view(M, 2)
    lens, slots = torch.tensor([5, 20, 0], dtype=torch.int32), torch.tensor([4, 35, -1])
    with recorded_launches() as launches:
        gk.gqa_decode_triton(q, kc, vc, table, lens, k=k, v=v, slot_mapping=slots, sinks=torch.zeros(Hq),
                             lse=torch.empty(M, Hq), window=8, num_splits=4)
    by_name = {fn.fn.__name__: kw for fn, _, kw in launches}
    assert set(by_name) == {"split_kernel", "merge_kernel"}
    assert by_name["split_kernel"]["TRIGGER_END"] is (late and not early) and by_name["merge_kernel"]["PDL"] is late
    assert by_name["split_kernel"]["TRIGGER_START"] is early and by_name["merge_kernel"]["DB"] == (16 if early else 64)
    assert by_name["merge_kernel"].get("launch_pdl", False) is late and "launch_pdl" not in by_name["split_kernel"]
    assert compile_for_hopper(launches) == {}


@pytest.mark.parametrize("splits", [2, 32])
def test_fused_merge_builds_for_hopper_without_spills(gk, monkeypatch, splits):
    """The split kernel with its own merge (Muse Spark TP8 widths, bf16, sinks, LSE, window; 2 / 32 splits: the
    merge's [S_PAD, BLOCK_G] weights at their smallest and largest) builds for sm_90 on the CPU without a stack
    frame and launches alone (no merge kernel, no PDL); its registers stay at the plain split kernel's (the same
    launch with the merge kernel), so its occupancy (two programs per SM, set by the pipeline's shared memory) holds."""
    import os

    from tests.triton_offline import recorded_launches, resource_usage

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("compiles only where triton was imported without the interpreter")
    M, Hq, KV, D, bs, d = 3, 16, 2, 64, 16, torch.bfloat16
    kc, vc = torch.zeros(8, bs, KV, D, dtype=d), torch.zeros(8, bs, KV, D, dtype=d)
    q, k, v = torch.randn(M, Hq, D).to(d), torch.randn(M, KV, D).to(d), torch.randn(M, KV, D).to(d)
    table = torch.arange(6, dtype=torch.int32).view(M, 2)
    lens, slots = torch.tensor([5, 20, 0], dtype=torch.int32), torch.tensor([4, 35, -1])
    usage = {}
    for fused in (True, False):
        monkeypatch.setattr(gk, "FUSED_MERGE_MAX_SPLITS", 32 if fused else 0)
        with recorded_launches() as launches:
            gk.gqa_decode_triton(q, kc, vc, table, lens, k=k, v=v, slot_mapping=slots, sinks=torch.zeros(Hq),
                                 lse=torch.empty(M, Hq), window=8, num_splits=splits)
        split = [launch for launch in launches if launch[0].fn.__name__ == "split_kernel"]
        kw = split[0][2]
        assert kw["FUSED_MERGE"] is fused and len(launches) == (1 if fused else 2)
        assert not (fused and (kw["TRIGGER_START"] or kw["TRIGGER_END"] or "launch_pdl" in kw))
        usage[fused], = resource_usage(split).values()
    (regs, stack), (plain_regs, _) = usage[True], usage[False]
    assert stack == 0 and regs <= plain_regs + 8, usage
