"""attention.sparse_mla.triton_splitkv on the GPU: bf16 at GLM-5.3 TP8 / TP4 and Kimi-like shapes, CUDA graphs.

Every case: fresh random inputs; ``out`` poisoned with NaN; cache rows that no valid selected entry reads
poisoned with NaN (the new tokens' slots too: written first); per row a duplicate-free random selection of
``min(K, seq_len)`` positions (the new token's among them) at random slots of the K, the rest -1 (contexts
shorter than K) and, in odd rows, some positions >= seq_len (skipped); -1 / garbage block ids past each
sequence's end; padding rows (seq_lens 0, slot -1) among live ones. bf16 tolerance against the fp32
reference (``sparse_mla_decode_reference``: fp32 math, one rounding); the cache written at exactly the live
slots. A captured call replays for new selections / seq_lens / slots / cache contents bit-identically to the
eager call. The RoPE cases pass unrotated q / k_pe with per-row positions up to 2^20 (the op rotates them;
the cache holds apply_rope's rope key up to one bf16 ulp). Run on the H200:
``pytest -m gpu tests/ops/test_sparse_mla_triton_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.kernels.sparse_mla_triton import sparse_mla_decode_triton
from latency_specialized.ops.attention.sparse_mla import sparse_mla_decode_masked, sparse_mla_decode_reference
from latency_specialized.ops.attention.mla import roped
from latency_specialized.ops.norm import rmsnorm_reference
from latency_specialized.ops.rope import rope_inv_freq

from gpu_helpers import graph_replay, seeded_generator as _gen

pytestmark = pytest.mark.gpu

DEV = "cuda"
GLM_TP8 = dict(H=8, L=512, R=64, nope=192, v=256)     # GLM-5.3: 64 heads / TP8
GLM_TP4 = dict(H=16, L=512, R=64, nope=192, v=256)
KIMI_TP8 = dict(H=12, L=512, R=64, nope=128, v=128)   # Kimi-like MLA widths, 96 heads / TP8
K = 2048
POSITIONS = (0, 100000, 7, 2 ** 20, 1, 65535, 4095, 31)


def _rope(B, R, seed, style, theta=1e6):
    """RoPE keywords: per-row positions (cycled ``POSITIONS``), inverse frequencies, pair layout."""
    pos = torch.tensor([POSITIONS[(seed + b) % len(POSITIONS)] for b in range(B)], dtype=torch.int64, device=DEV)
    return dict(positions=pos, rope_inv_freq=rope_inv_freq(theta, R, DEV), rope_interleaved=style == "interleaved")


def _selection(g, lens_t: torch.Tensor, K: int, cap: int) -> torch.Tensor:
    """[B, K] int32 on the device: per row ``min(K, n)`` distinct positions of [0, n) (n - 1 always), at random
    slots, the rest -1; in odd rows every fourth -1 slot then holds a position >= n (skipped)."""
    B = lens_t.shape[0]
    pos = torch.arange(cap, device=DEV)
    score = torch.rand(B, cap, generator=g, device=DEV)
    score = torch.where(pos[None, :] == (lens_t.long() - 1)[:, None], 2.0, score)        # the new token
    score = torch.where(pos[None, :] < lens_t.long()[:, None], score, -1.0)
    kk = min(K, cap)
    val, idx = torch.topk(score, kk, dim=1)
    sel = torch.where(val >= 0, idx, -1)
    if kk < K:
        sel = torch.cat([sel, sel.new_full((B, K - kk), -1)], dim=1)
    sel = sel.gather(1, torch.rand(B, K, generator=g, device=DEV).argsort(dim=1))        # random slots
    odd = (torch.arange(B, device=DEV) % 2 == 1)[:, None]
    far = lens_t.long()[:, None] + torch.arange(K, device=DEV)[None, :]
    sel = torch.where(odd & (sel < 0) & (torch.arange(K, device=DEV)[None, :] % 4 == 0), far, sel)
    return sel.to(torch.int32)


def _case(seed, lens, *, H, L, R, nope, v, bs=64, K=K, per=None, gate=True, dtype=torch.bfloat16, kv_norm=False):
    g = _gen(seed)
    B = len(lens)
    per = per or -(-max(max(lens), 1) // bs) + 2
    nb = B * per + 5
    cache = torch.randn(nb, bs, L + R, generator=g, device=DEV).to(dtype)
    blocks = torch.randperm(nb, generator=g, device=DEV)[:B * per].view(B, per).to(torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    sel = _selection(g, lens_t, K, per * bs)
    last = (lens_t.long() - 1).clamp(min=0)
    slots = torch.where(lens_t > 0, blocks.long().gather(1, (last // bs)[:, None])[:, 0] * bs + last % bs, -1)
    sl = sel.long()
    ok = (sl >= 0) & (sl < lens_t.long()[:, None] - 1)                           # read, not written
    rows = blocks.long().gather(1, (sl.clamp(min=0) // bs).clamp(max=per - 1)) * bs + sl.clamp(min=0) % bs
    read = torch.zeros(nb * bs, dtype=torch.bool, device=DEV)
    read[rows[ok]] = True
    cache.view(-1, L + R)[~read] = float("nan")
    used = (lens_t.long() + bs - 1) // bs
    past = torch.arange(per, device=DEV)[None, :] >= used[:, None]
    # garbage ids only where the reference's clamped look-up cannot reach them: even live rows (no far entries)
    even_live = (torch.arange(B, device=DEV) % 2 == 0) & (lens_t > 0)
    garbage = torch.where(even_live[:, None], 2 ** 30, -1)
    blocks = torch.where(past, garbage.to(torch.int32), blocks)
    q = torch.randn(B, H * (nope + R), generator=g, device=DEV).to(dtype).view(B, H, nope + R)
    kv = torch.randn(B, L + R, generator=g, device=DEV).to(dtype)
    w = (torch.randn(H * (nope + v), L, generator=g, device=DEV) * L ** -0.5).to(dtype)
    gt = torch.randn(B, H * v, generator=g, device=DEV).to(dtype) if gate else None
    kw = dict(qk_nope_head_dim=nope, v_head_dim=v, gate=gt)
    if kv_norm:  # the raw latent as the GLM program passes it: kv[:, :L] of the projection, off unit RMS
        kv = (3.0 * kv.float() + 0.5).to(dtype)
        norm_w = (1.0 + 0.1 * torch.randn(L, generator=g, device=DEV)).to(dtype)
        return (q, kv[:, :L], kv[:, L:], cache, slots, blocks, lens_t, w, sel), dict(kw, kv_norm_weight=norm_w,
                                                                                     kv_norm_eps=1e-5)
    return (q, kv[:, :L].contiguous(), kv[:, L:], cache, slots, blocks, lens_t, w, sel), kw


def _check(args, kw, **call):
    q, kv_c, k_pe, cache, slots, blocks, seq_lens, w, sel = args
    before, c_ref, c_tri = cache.clone(), cache.clone(), cache.clone()
    want = sparse_mla_decode_reference(q, kv_c, k_pe, c_ref, slots, blocks, seq_lens, w, sel, **kw)
    out = torch.full((q.shape[0], q.shape[1] * kw["v_head_dim"]), float("nan"), device=DEV, dtype=q.dtype)
    got = sparse_mla_decode_triton(q, kv_c, k_pe, c_tri, slots, blocks, seq_lens, w, sel, out=out, **kw, **call)
    torch.cuda.synchronize()
    assert got is out and not torch.isnan(out).any(), "output left unwritten or NaN leaked"
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale)
    empty = ~((sel >= 0) & (sel < seq_lens[:, None])).any(1)
    assert torch.equal(got[empty], torch.zeros_like(got[empty])), "rows without a valid entry must be exact zeros"
    live = slots[slots >= 0]
    changed = torch.zeros(cache.shape[0] * cache.shape[1], dtype=torch.bool, device=DEV)
    changed[live] = True
    flat, flat0 = c_tri.view(-1, cache.shape[-1]), before.view(-1, cache.shape[-1])
    torch.testing.assert_close(flat[~changed], flat0[~changed], rtol=0, atol=0, equal_nan=True)
    norm_w = kw.get("kv_norm_weight")
    L = kv_c.shape[-1]
    rope = kw.get("positions") is not None
    if rope:  # the rotated rope key: apply_rope's up to one bf16 ulp (the kernel's fp32 may contract into FMAs)
        k_rot = roped(q, k_pe, kw["qk_nope_head_dim"], kw["positions"], kw["rope_inv_freq"], kw["rope_interleaved"])[1]
        torch.testing.assert_close(flat[live][:, L:].float(), k_rot[slots >= 0].float(), rtol=2 ** -7, atol=1e-3)
    if norm_w is None:
        assert torch.equal(flat[live][:, :L], kv_c[slots >= 0])
    else:  # one bf16 ulp of the norm reference's rounding (the kernel's own fp32 order)
        normed = rmsnorm_reference(kv_c, norm_w, kw["kv_norm_eps"])[slots >= 0]
        torch.testing.assert_close(flat[live][:, :L].float(), normed.float(), rtol=2 ** -7, atol=0)
    if not rope:
        assert torch.equal(flat[live][:, L:], k_pe[slots >= 0])
    return got


SHAPES = {"glm_tp8": GLM_TP8, "glm_tp4": GLM_TP4, "kimi_tp8": KIMI_TP8}
LENS = {"B1": [1], "B1_long": [32768], "B5_short": [0, 3000, 7, 1, 0],
        "B64": [(613 * i) % 40000 for i in range(64)]}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("lens", list(LENS), ids=list(LENS))
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_epilogue"])
def test_matches_reference_bf16(shape, lens, fused):
    args, kw = _case(f"{shape}-{lens}", LENS[lens], **SHAPES[shape])
    _check(args, kw, fused=fused)


@pytest.mark.parametrize("B", [1, 2, 8, 16, 17, 33, 64])
@pytest.mark.parametrize("bs", [64, 16])
def test_batch_sizes_bf16(B, bs):
    """GLM TP8 across batches (prologue row tiles at 16 / 17 / 33; both fused merges), contexts shorter and
    longer than K, padding rows among live ones; block sizes 64 (the bench's) and 16 (the runtime default)."""
    lens = [0 if i % 5 == 3 else 1 + (2711 * i + 100) % 9000 for i in range(B)]
    args, kw = _case(f"batch{B}-{bs}", lens, bs=bs, **GLM_TP8)
    _check(args, kw)


@pytest.mark.parametrize("splits", [1, 2, 7, 16, 64])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_epilogue"])
def test_forced_splits_and_no_gate(splits, fused):
    args, kw = _case(f"splits{splits}", [0, 4000, 129, 2048, 2049], gate=False, **GLM_TP8)
    _check(args, kw, num_splits=splits, fused=fused)


@pytest.mark.parametrize("K_", [1, 100, 512, 4096])
def test_other_selection_widths(K_):
    args, kw = _case(f"k{K_}", [0, 5000, 77, 1, 300], K=K_, **GLM_TP4)
    _check(args, kw)


@pytest.mark.parametrize("lens", [[1], [0, 3000, 7, 1, 0], [(613 * i) % 40000 for i in range(64)]],
                         ids=["B1", "B5", "B64"])
def test_kv_norm_matches_reference_bf16(lens):
    """The kv_a RMSNorm fused (raw latent a strided column slice of the projection), GLM TP8."""
    args, kw = _case(f"kvnorm-{len(lens)}", lens, kv_norm=True, **GLM_TP8)
    assert len(lens) == 1 or not args[1].is_contiguous()
    _check(args, kw)


def test_agrees_with_torch_masked():
    args, kw = _case("masked", [(997 * i) % 9000 for i in range(8)], **GLM_TP8)
    a = sparse_mla_decode_triton(*args[:3], args[3].clone(), *args[4:], **kw).float()
    b = sparse_mla_decode_masked(*args[:3], args[3].clone(), *args[4:], **kw).float()
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


@pytest.mark.parametrize("kv_norm", [False, True], ids=["plain", "kv_norm"])
@pytest.mark.parametrize("B", [1, 8, 64])
def test_graph_replay_equals_eager(B, kv_norm):
    """Capture once; new selections / seq_lens / slots / cache contents / q in the static buffers; replay ==
    eager bit for bit (and both right). kv_norm: the raw latent stays a strided slice of one static buffer."""
    shape, per = GLM_TP8, 80

    def lens_for(seed):
        return [0 if (i + seed) % 7 == 3 else 1 + (1237 * i + 811 * seed) % 5119 for i in range(B)]

    a0, kw = _case(f"graph0-{B}", lens_for(0), per=per, kv_norm=kv_norm, **shape)
    static = [t.clone() for t in a0]
    if kv_norm:  # clone() of a column slice is contiguous: keep the strided layout the program passes
        wide = torch.cat([a0[1], a0[2]], -1)
        static[1], static[2] = wide[:, :shape["L"]], wide[:, shape["L"]:]
    norm = {k: (kw[k].clone() if isinstance(kw[k], torch.Tensor) else kw[k])
            for k in ("kv_norm_weight", "kv_norm_eps") if k in kw}
    gate = kw["gate"].clone()
    out = torch.empty(B, shape["H"] * shape["v"], device=DEV, dtype=torch.bfloat16)

    def call():
        sparse_mla_decode_triton(*static, qk_nope_head_dim=kw["qk_nope_head_dim"], v_head_dim=kw["v_head_dim"],
                                 gate=gate, out=out, **norm)

    graph = graph_replay(call)
    for seed in (1, 2):
        a, kw2 = _case(f"graph{seed}-{B}", lens_for(seed), per=per, kv_norm=kv_norm, **shape)
        for dst, src in zip(static, a):
            dst.copy_(src)
        gate.copy_(kw2["gate"])
        if kv_norm:
            norm["kv_norm_weight"].copy_(kw2["kv_norm_weight"])
        eager_cache = a[3].clone()
        eager = sparse_mla_decode_triton(*a[:3], eager_cache, *a[4:], **kw2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"replay {seed} != eager"
        torch.testing.assert_close(static[3], eager_cache, rtol=0, atol=0, equal_nan=True)
        _check(a, kw2)


@pytest.mark.parametrize("B", [1, 4])
def test_latent_tiled_merge_replays_identically(B):
    """The small-batch merge's last-arriver reduction over the sparse partials: 64 replays give the eager
    output bit for bit; the v-blocked merge agrees."""
    from latency_specialized.kernels import mla_decode_triton as mk

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert mk.merge_l_tiles(B, GLM_TP8["H"], GLM_TP8["L"], sms) > 1
    args, kw = _case(f"tiles{B}", [(1237 * i + 4000) % 9000 for i in range(B)], **GLM_TP8)
    out = torch.empty(B, GLM_TP8["H"] * GLM_TP8["v"], device=DEV, dtype=torch.bfloat16)
    cache = args[3].clone()

    def call():
        cache.copy_(args[3])
        sparse_mla_decode_triton(*args[:3], cache, *args[4:], out=out, **kw)

    call()
    torch.cuda.synchronize()
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(64):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    old = mk.MERGE_L_TILE
    try:
        mk.MERGE_L_TILE = 0
        vblocked = sparse_mla_decode_triton(*args[:3], args[3].clone(), *args[4:], **kw)
    finally:
        mk.MERGE_L_TILE = old
    torch.testing.assert_close(eager.float(), vblocked.float(), rtol=2e-2, atol=2e-2 * vblocked.abs().max().item())


def test_work_follows_k_not_the_table():
    """Timing-free: the call is three kernels (prologue, split, merge) in a captured graph, and a block table
    8x wider (-1 columns past the context, as a runtime sized for a longer context passes it) gives the same
    splits and the bit-identical result (the split count follows K, not the table capacity)."""
    from latency_specialized.kernels import mla_decode_triton as mk
    from latency_specialized.runtime.census import KernelCensus

    lens = [(997 * i) % 9000 + 1 for i in range(8)]
    args, kw = _case("table-width", lens, **GLM_TP8)
    blocks = args[5]
    wide = torch.cat([blocks, blocks.new_full((blocks.shape[0], 7 * blocks.shape[1]), -1)], dim=1)
    narrow = sparse_mla_decode_triton(*args[:3], args[3].clone(), *args[4:], **kw)
    widened = sparse_mla_decode_triton(*args[:3], args[3].clone(), args[4], wide, *args[6:], **kw)
    torch.cuda.synchronize()
    assert torch.equal(narrow, widened)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert mk.choose_sparse_splits(8, GLM_TP8["H"], K, sms) <= -(-K // mk.min_chunk(8, sparse=True))

    census = KernelCensus()
    if not census.available:
        pytest.skip("no CUDA driver for the census")
    out = torch.empty_like(narrow)
    cache = args[3].clone()
    fn = census.wrap("sparse_mla", 8, lambda: sparse_mla_decode_triton(*args[:3], cache, *args[4:], out=out, **kw))
    graph_replay(fn)
    assert census.kernels(8)["sparse_mla"] == 3


@pytest.mark.parametrize("lens", [[1], [0, 3000, 7, 1, 0], [(613 * i) % 40000 for i in range(64)]],
                         ids=["B1", "B5", "B64"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_epilogue"])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_matches_reference_bf16(lens, fused, style):
    """GLM-5.3 TP8 as its program calls the op: unrotated q / k_pe, positions, inverse frequencies, the kv_a
    norm fused, no gate; against the fp32 reference given the same positions (up to 2^20)."""
    args, kw = _case(f"rope-{len(lens)}-{style}", lens, gate=False, kv_norm=True, **GLM_TP8)
    _check(args, dict(kw, **_rope(len(lens), GLM_TP8["R"], len(lens), style)), fused=fused)


@pytest.mark.parametrize("B,style", [(1, "interleaved"), (8, "neox"), (64, "interleaved")])
def test_rope_graph_replay_equals_eager(B, style):
    """Capture once with RoPE (positions a static buffer, GLM TP8, kv norm); new positions, selections,
    seq_lens, slots, cache contents and q: replay == eager bit for bit, and both right."""
    shape, per = GLM_TP8, 80

    def lens_for(seed):
        return [0 if (i + seed) % 7 == 3 else 1 + (1237 * i + 811 * seed) % 5119 for i in range(B)]

    a0, kw = _case(f"rope-graph0-{B}", lens_for(0), per=per, gate=False, kv_norm=True, **shape)
    static = [t.clone() for t in a0]
    wide = torch.cat([a0[1], a0[2]], -1)              # keep the strided latent the program passes
    static[1], static[2] = wide[:, :shape["L"]], wide[:, shape["L"]:]
    norm = dict(kv_norm_weight=kw["kv_norm_weight"].clone(), kv_norm_eps=kw["kv_norm_eps"])
    rope = _rope(B, shape["R"], 0, style)
    out = torch.empty(B, shape["H"] * shape["v"], device=DEV, dtype=torch.bfloat16)

    def call():
        sparse_mla_decode_triton(*static, qk_nope_head_dim=kw["qk_nope_head_dim"], v_head_dim=kw["v_head_dim"],
                                 out=out, **norm, **rope)

    graph = graph_replay(call)
    for seed in (1, 2):
        a, kw2 = _case(f"rope-graph{seed}-{B}", lens_for(seed), per=per, gate=False, kv_norm=True, **shape)
        for dst, src in zip(static, a):
            dst.copy_(src)
        norm["kv_norm_weight"].copy_(kw2["kv_norm_weight"])
        new_rope = _rope(B, shape["R"], 3 * seed, style)
        rope["positions"].copy_(new_rope["positions"])
        eager_cache = a[3].clone()
        eager = sparse_mla_decode_triton(*a[:3], eager_cache, *a[4:], **kw2, **new_rope)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"replay {seed} != eager"
        torch.testing.assert_close(static[3], eager_cache, rtol=0, atol=0, equal_nan=True)
        _check(a, dict(kw2, **new_rope))


@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_epilogue"])
def test_selection_from_a_side_stream(B, fused):
    """``before_split``: the selection is written on a side stream (behind a ~20 us sleep there, so a split that did
    not wait would read the garbage the buffer holds first) and joined by the op between its prologue and its split
    kernel - eagerly and replayed from a CUDA graph (two branches), the plain call's output and cache."""
    from latency_specialized.runtime.side_stream import SideStream

    side = SideStream(torch.device(DEV))
    lens = [3000] if B == 1 else [0, 3000, 7, 1, 5000, 2049, 4097, 12]
    a, kw = _case(f"side{B}{fused}", lens, per=80, **GLM_TP8)
    sel = a[8]
    buffer = torch.full_like(sel, 2 ** 30)
    want_cache = a[3].clone()
    want = sparse_mla_decode_triton(*a[:3], want_cache, *a[4:], fused=fused, **kw)

    def call(cache, out):
        buffer.fill_(2 ** 30)
        pending = side.run(lambda: (torch.cuda._sleep(40000), buffer.copy_(sel)))
        return sparse_mla_decode_triton(*a[:3], cache, *a[4:8], buffer, fused=fused, out=out,
                                        before_split=pending.join, **kw)

    cache = a[3].clone()
    out = torch.empty_like(want)
    call(cache, out)
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    # the cache keeps its NaN poison in rows nobody reads, and NaN != NaN under torch.equal
    torch.testing.assert_close(cache, want_cache, rtol=0, atol=0, equal_nan=True)
    static_cache = a[3].clone()
    graph = graph_replay(lambda: call(static_cache, out))
    for _ in range(3):
        static_cache.copy_(a[3])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        torch.testing.assert_close(static_cache, want_cache, rtol=0, atol=0, equal_nan=True)
