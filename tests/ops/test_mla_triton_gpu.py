"""attention.mla.triton_splitkv on the GPU: bf16 at Kimi K3 TP8 and medium-model shapes, CUDA graphs.

Every case: fresh random inputs, ``out`` poisoned with NaN, cache rows that no live position reads
poisoned with NaN, -1 / garbage block ids past each sequence's end, padding rows (seq_lens 0, slot
-1) before live rows; bf16 tolerance against the fp32 reference (``mla_decode_reference``: fp32 math,
one rounding), the cache written at exactly the live slots. A captured call replays for new
seq_lens / slot_mapping / cache contents bit-identically to the eager call. The kv_norm cases fuse
the kv_a RMSNorm: the raw latent is a strided column slice, the cache rows hold its norm up to one
bf16 rounding of the norm reference's. The RoPE cases (GLM-5.3 TP8 widths) pass unrotated q / k_pe with
per-row positions up to 2^20; the op rotates them (in the prologue, fused) and the cache rows hold the
rotated rope key up to one bf16 rounding of apply_rope's (fp32 FMA contraction may move it by one ulp).
Run on the H200: ``pytest -m gpu tests/ops/test_mla_triton_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.kernels.mla_decode_triton import _prologue, mla_decode_triton
from latency_specialized.ops.attention.mla import mla_decode_reference, roped
from latency_specialized.ops.norm import rmsnorm_reference
from latency_specialized.ops.rope import apply_rope, rope_inv_freq

from gpu_helpers import graph_replay, seeded_generator as _gen

pytestmark = pytest.mark.gpu

DEV = "cuda"
KIMI_TP8 = dict(H=12, L=512, R=64, nope=128, v=128)
MEDIUM = dict(H=8, L=128, R=32, nope=64, v=64)
GLM_TP8 = dict(H=8, L=512, R=64, nope=192, v=256)
POSITIONS = (0, 100000, 7, 2 ** 20, 1, 65535, 4095, 31)


def _rope(B, R, seed, style, theta=1e6):
    """RoPE keywords: per-row positions (cycled ``POSITIONS``), inverse frequencies, pair layout."""
    pos = torch.tensor([POSITIONS[(seed + b) % len(POSITIONS)] for b in range(B)], dtype=torch.int64, device=DEV)
    return dict(positions=pos, rope_inv_freq=rope_inv_freq(theta, R, DEV), rope_interleaved=style == "interleaved")


def _case(seed, lens, *, H, L, R, nope, v, bs, per=None, gate=True, dtype=torch.bfloat16, kv_norm=False):
    g = _gen(seed)
    B = len(lens)
    per = per or -(-max(max(lens), 1) // bs) + 2
    nb = B * per + 5
    cache = torch.randn(nb, bs, L + R, generator=g, device=DEV).to(dtype)
    blocks = torch.randperm(nb, generator=g, device=DEV)[:B * per].view(B, per).to(torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    # the new token sits at position len - 1; padding rows write nothing
    last = (lens_t.long() - 1).clamp(min=0)
    slots = torch.where(lens_t > 0, blocks.long().gather(1, (last // bs)[:, None])[:, 0] * bs + last % bs, -1)
    pos = torch.arange(per * bs, device=DEV)
    live = pos[None, :] < lens_t[:, None] - 1                                       # read, not written
    read = torch.zeros(nb * bs, dtype=torch.bool, device=DEV)
    read[(blocks.long()[:, pos // bs] * bs + pos % bs)[live]] = True
    cache.view(-1, L + R)[~read] = float("nan")
    used = (lens_t.long() + bs - 1) // bs
    past = torch.arange(per, device=DEV)[None, :] >= used[:, None]
    garbage = torch.where(torch.arange(B, device=DEV)[:, None] % 2 == 1, -1, 2 ** 30)
    blocks = torch.where(past, garbage.to(torch.int32), blocks)
    q = torch.randn(B, H * (nope + R), generator=g, device=DEV).to(dtype).view(B, H, nope + R)
    kv = torch.randn(B, L + R, generator=g, device=DEV).to(dtype)
    w = (torch.randn(H * (nope + v), L, generator=g, device=DEV) * L ** -0.5).to(dtype)
    gt = torch.randn(B, H * v, generator=g, device=DEV).to(dtype) if gate else None
    if kv_norm:  # the raw latent as the Kimi program passes it: kv[:, :L] of the projection, off unit RMS
        kv = (3.0 * kv.float() + 0.5).to(dtype)
        norm_w = (1.0 + 0.1 * torch.randn(L, generator=g, device=DEV)).to(dtype)
        args = (q, kv[:, :L], kv[:, L:], cache, slots, blocks, lens_t, w)
        return args, dict(qk_nope_head_dim=nope, v_head_dim=v, gate=gt, kv_norm_weight=norm_w, kv_norm_eps=1e-5)
    args = (q, kv[:, :L].contiguous(), kv[:, L:], cache, slots, blocks, lens_t, w)
    return args, dict(qk_nope_head_dim=nope, v_head_dim=v, gate=gt)


def _check(args, kw, **call):
    q, kv_c, k_pe, cache, slots, blocks, seq_lens, w = args
    before, c_ref, c_tri = cache.clone(), cache.clone(), cache.clone()
    want = mla_decode_reference(q, kv_c, k_pe, c_ref, slots, blocks, seq_lens, w, **kw)
    out = torch.full((q.shape[0], q.shape[1] * kw["v_head_dim"]), float("nan"), device=DEV, dtype=q.dtype)
    got = mla_decode_triton(q, kv_c, k_pe, c_tri, slots, blocks, seq_lens, w, out=out, **kw, **call)
    torch.cuda.synchronize()
    assert got is out and not torch.isnan(out).any(), "output left unwritten or NaN leaked"
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale)
    pad = seq_lens == 0
    assert torch.equal(got[pad], torch.zeros_like(got[pad])), "padding rows must be exact zeros"
    live = slots[slots >= 0]
    changed = torch.zeros(cache.shape[0] * cache.shape[1], dtype=torch.bool, device=DEV)
    changed[live] = True
    flat, flat0 = c_tri.view(-1, cache.shape[-1]), before.view(-1, cache.shape[-1])
    torch.testing.assert_close(flat[~changed], flat0[~changed], rtol=0, atol=0, equal_nan=True)
    norm_w = kw.get("kv_norm_weight")
    L = kv_c.shape[-1]
    if kw.get("positions") is not None:
        # the rotated rope key: apply_rope's up to one bf16 ulp (the kernel's fp32 may contract into FMAs)
        k_rot = roped(q, k_pe, kw["qk_nope_head_dim"], kw["positions"], kw["rope_inv_freq"], kw["rope_interleaved"])[1]
        torch.testing.assert_close(flat[live][:, L:].float(), k_rot[slots >= 0].float(), rtol=2 ** -7, atol=1e-3)
        if norm_w is None:
            assert torch.equal(flat[live][:, :L], kv_c[slots >= 0])
        else:
            normed = rmsnorm_reference(kv_c, norm_w, kw["kv_norm_eps"])[slots >= 0]
            torch.testing.assert_close(flat[live][:, :L].float(), normed.float(), rtol=2 ** -7, atol=0)
        return got
    if norm_w is None:
        assert torch.equal(flat[live], torch.cat([kv_c, k_pe], -1)[slots >= 0])
    else:
        # the normed latent: the kernel's fp32 sum of squares (its own order, its sqrt/divide) may round
        # to the neighbouring bf16 value of the norm reference's: one bf16 ulp (2^-7 relative at most)
        normed = rmsnorm_reference(kv_c, norm_w, kw["kv_norm_eps"])[slots >= 0]
        torch.testing.assert_close(flat[live][:, :L].float(), normed.float(), rtol=2 ** -7, atol=0)
        assert torch.equal(flat[live][:, L:], k_pe[slots >= 0])
    return got


@pytest.mark.parametrize("shape,bs", [(KIMI_TP8, 64), (KIMI_TP8, 2), (MEDIUM, 2)], ids=["k3tp8_b64", "k3tp8_b2",
                                                                                       "medium_b2"])
@pytest.mark.parametrize("lens", [[1], [0, 3000, 7, 1, 0], [(37 * i) % 4099 for i in range(64)]],
                         ids=["B1", "B5", "B64"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_epilogue"])
def test_matches_reference_bf16(shape, bs, lens, fused):
    args, kw = _case(f"{bs}-{len(lens)}-{shape['L']}", lens, bs=bs, **shape)
    _check(args, kw, fused=fused)


@pytest.mark.parametrize("splits", [1, 2, 7, 64])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_epilogue"])
def test_forced_splits_and_no_gate(splits, fused):
    args, kw = _case(f"splits{splits}", [0, 4000, 129, 64, 65], bs=64, gate=False, **KIMI_TP8)
    _check(args, kw, num_splits=splits, fused=fused)


@pytest.mark.parametrize("B", [1, 2, 16, 17, 64])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_epilogue"])
def test_batch_sizes_bf16(B, fused):
    """bf16 against the fp32 reference across the prologue's 16-row tiles (17: a second, 1-row tile),
    padding rows (slot -1) among live ones."""
    lens = [0 if i % 5 == 3 else 1 + (97 * i) % 3000 for i in range(B)]
    args, kw = _case(f"batch{B}", lens, bs=64, **KIMI_TP8)
    _check(args, kw, fused=fused)


@pytest.mark.parametrize("B", [1, 2, 16, 17, 64])
def test_prologue_q_lat_and_write_bf16(B):
    """The prologue kernel alone at Kimi K3 TP8 widths (nope 128, L 512, R 64): q_lat (NaN-poisoned) ==
    the unfused path's bf16 bmm up to one bf16 rounding, and == the fp32 product up to one rounding;
    the NaN-poisoned cache written at exactly the live slots, bit-exact."""
    H, L, R, nope, v = (KIMI_TP8[k] for k in ("H", "L", "R", "nope", "v"))
    g = _gen(f"prologue{B}")
    nslots = 4 * B + 9
    q = torch.randn(B, H * (nope + R), generator=g, device=DEV).to(torch.bfloat16).view(B, H, nope + R)
    w = (torch.randn(H * (nope + v), L, generator=g, device=DEV) * L ** -0.5).to(torch.bfloat16)
    w_uk = w.view(H, nope + v, L)[:, :nope]
    kv = torch.randn(B, L + R, generator=g, device=DEV).to(torch.bfloat16)
    slots = torch.randperm(nslots, generator=g, device=DEV)[:B]
    slots[::3] = -1
    if B > 1:
        slots[-1] = -1
    flat = torch.full((nslots, L + R), float("nan"), device=DEV, dtype=torch.bfloat16)
    q_lat = torch.full((H, B, L), float("nan"), device=DEV, dtype=torch.bfloat16)
    _prologue(q, kv[:, :L].contiguous(), kv[:, L:], slots, flat, w_uk, q_lat)
    torch.cuda.synchronize()
    assert not torch.isnan(q_lat).any(), "q_lat rows left unwritten"
    exact = torch.bmm(q[..., :nope].transpose(0, 1).float(), w_uk.float())
    scale = exact.abs().max().item()
    bmm = torch.bmm(q[..., :nope].transpose(0, 1), w_uk).float()
    torch.testing.assert_close(q_lat.float(), bmm, rtol=1e-2, atol=1e-2 * scale)
    torch.testing.assert_close(q_lat.float(), exact, rtol=8e-3, atol=1e-3 * scale)
    live = slots >= 0
    assert torch.equal(flat[slots[live]], kv[live])
    untouched = torch.ones(nslots, dtype=torch.bool, device=DEV)
    untouched[slots[live]] = False
    assert torch.isnan(flat[untouched]).all(), "a negative slot or a masked row wrote the cache"


@pytest.mark.parametrize("lens", [[1], [0, 3000, 7, 1, 0], [(37 * i) % 4099 for i in range(64)]],
                         ids=["B1", "B5", "B64"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_epilogue"])
def test_kv_norm_matches_reference_bf16(lens, fused):
    """kv_norm_weight at Kimi K3 TP8 widths: the raw latent (a strided column slice of the projection)
    normalised inside the prologue (fused) or by rmsnorm_reference (unfused), against the reference
    with the same norm; cache rows == the normed latent up to one bf16 rounding."""
    args, kw = _case(f"kvnorm-{len(lens)}", lens, bs=64, kv_norm=True, **KIMI_TP8)
    assert len(lens) == 1 or not args[1].is_contiguous()
    _check(args, kw, fused=fused)


def test_long_context_single_sequence():
    args, kw = _case("long", [32768], bs=64, **KIMI_TP8)
    _check(args, kw)


@pytest.mark.parametrize("kv_norm", [False, True], ids=["plain", "kv_norm"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_epilogue"])
def test_graph_replay_equals_eager(fused, kv_norm):
    """Capture once; new seq_lens / slots / cache contents / q in the static buffers; replay == eager.
    kv_norm: the raw latent stays a strided slice of one static projection buffer, the norm weight static."""
    shape, bs, per = KIMI_TP8, 64, 80
    a0, kw = _case("graph0", [0, 2500, 7, 4000, 1], bs=bs, per=per, kv_norm=kv_norm, **shape)
    static = [t.clone() for t in a0]
    if kv_norm:  # clone() of a column slice is contiguous: keep the strided layout the program passes
        wide = torch.cat([a0[1], a0[2]], -1)
        static[1], static[2] = wide[:, :shape["L"]], wide[:, shape["L"]:]
    norm = {k: (kw[k].clone() if isinstance(kw[k], torch.Tensor) else kw[k])
            for k in ("kv_norm_weight", "kv_norm_eps") if k in kw}
    gate = kw["gate"].clone()
    out = torch.empty(len(a0[6]), shape["H"] * shape["v"], device=DEV, dtype=torch.bfloat16)

    def call():
        mla_decode_triton(*static, qk_nope_head_dim=kw["qk_nope_head_dim"], v_head_dim=kw["v_head_dim"], gate=gate,
                          out=out, fused=fused, **norm)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()                                           # compile + warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for seed, lens in (("graph1", [3000, 0, 1, 5000, 64]), ("graph2", [1, 1, 0, 0, 5119])):
        a, kw2 = _case(seed, lens, bs=bs, per=per, kv_norm=kv_norm, **shape)   # same shapes, new contents
        for dst, src in zip(static, a):
            dst.copy_(src)
        gate.copy_(kw2["gate"])
        if kv_norm:
            norm["kv_norm_weight"].copy_(kw2["kv_norm_weight"])
        eager_cache = a[3].clone()
        eager = mla_decode_triton(*a[:3], eager_cache, *a[4:], **kw2, fused=fused)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"{seed}: replay != eager"
        torch.testing.assert_close(static[3], eager_cache, rtol=0, atol=0, equal_nan=True)
        _check(a, kw2, fused=fused)                        # and both are right


@pytest.mark.parametrize("B,splits", [(1, None), (4, None), (1, 256), (2, 160)])
def test_latent_tiled_merge_replays_identically(B, splits):
    """The small-batch merge's last-arriver reduction (arrival counters zeroed by the split kernel each
    call): 64 graph replays give the eager output bit for bit, and it matches the v-blocked merge.
    Forced wide split grids (more programs than SMs: no PDL for the split kernel) run the merge with the
    late PDL trigger (``late_merge_pdl``) on an sm_90 GPU."""
    from latency_specialized.kernels import mla_decode_triton as mk

    dev = torch.device(DEV)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert mk.merge_l_tiles(B, KIMI_TP8["H"], KIMI_TP8["L"], sms) > 1
    if splits is not None:
        pdl = mk.pdl_enabled(dev, B * -(-KIMI_TP8["H"] // mk.BLOCK_H) * splits)
        assert not pdl and mk.late_merge_pdl(dev, pdl, True) == (torch.cuda.get_device_capability()[0] >= 9)
    args, kw = _case(f"tiles{B}", [(1237 * i + 4000) % 4097 for i in range(B)], bs=64, **KIMI_TP8)
    if splits is not None:
        kw = dict(kw, num_splits=splits)
    out = torch.empty(B, KIMI_TP8["H"] * KIMI_TP8["v"], device=DEV, dtype=torch.bfloat16)
    cache = args[3].clone()

    def call():
        cache.copy_(args[3])
        mla_decode_triton(*args[:3], cache, *args[4:], out=out, **kw)

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
        mk.MERGE_L_TILE = 0                               # the v-blocked merge: same contract
        vblocked = mla_decode_triton(*args[:3], args[3].clone(), *args[4:], **kw)
    finally:
        mk.MERGE_L_TILE = old
    torch.testing.assert_close(eager.float(), vblocked.float(), rtol=2e-2, atol=2e-2 * vblocked.abs().max().item())


def test_pdl_reads_q_after_a_producer_that_triggers_early(monkeypatch):
    """With PDL on (``mla_decode_triton.PDL``, off by default since session 17) and q produced by a CuTe GEMV
    that lets its dependents launch right after its own wait - as the Kimi program's q projection does - one
    graph of GEMV -> MLA, replayed with new x each time, matches the reference from the GEMV's q every time.
    The prologue whose wait sat inside its k loop read q early in exactly this arrangement (a layer A/B routed
    different experts); switch PDL back on only with this passing."""
    from latency_specialized.kernels import mla_decode_triton as mk
    from latency_specialized.kernels.gemm_gemv import gemm_gemv

    monkeypatch.setattr(mk, "PDL", True)
    B, K = 4, 1536
    args, kw = _case("pdl-producer", [(997 * i + 3000) % 4096 + 1 for i in range(B)], bs=64, **KIMI_TP8)
    _, kv_c, k_pe, cache, slots, blocks, lens, w = args
    H, qk = KIMI_TP8["H"], KIMI_TP8["nope"] + KIMI_TP8["R"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = mk.choose_num_splits(B, H, blocks.shape[1] * 64, sms)
    assert mk.pdl_enabled(torch.device(DEV), B * -(-H // mk.BLOCK_H) * splits), "the PDL path must run here"
    g = _gen("pdl-producer-w")
    wq = (torch.randn(H * qk, K, generator=g, device=DEV) * K ** -0.5).to(torch.bfloat16)
    x = torch.randn(B, K, generator=g, device=DEV).to(torch.bfloat16)
    q = torch.empty(B, H * qk, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(B, H * KIMI_TP8["v"], device=DEV, dtype=torch.bfloat16)

    def step():
        gemm_gemv(x, wq, out=q)
        mla_decode_triton(q.view(B, H, qk), kv_c, k_pe, cache, slots, blocks, lens, w, out=out, **kw)

    graph = graph_replay(step)                            # warmed up on a side stream, captured, replayed once
    for i in range(16):
        x.copy_(torch.randn(B, K, generator=g, device=DEV).to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        q_ref = gemm_gemv(x, wq).view(B, H, qk)           # the same rounding as the graph's q
        want = mla_decode_reference(q_ref, kv_c, k_pe, cache.clone(), slots, blocks, lens, w, **kw)
        scale = want.float().abs().max().item()
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2 * scale,
                                   msg=lambda m: f"replay {i}: {m}")


# ---------------------------------------------------------------------------------------------- RoPE fused
@pytest.mark.parametrize("shape,bs", [(GLM_TP8, 64), (MEDIUM, 2)], ids=["glm53tp8_b64", "medium_b2"])
@pytest.mark.parametrize("lens", [[1], [0, 3000, 7, 1, 0], [(37 * i) % 4099 for i in range(64)]],
                         ids=["B1", "B5", "B64"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_epilogue"])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_matches_reference_bf16(shape, bs, lens, fused, style):
    """positions + rope_inv_freq (GLM-5.3 TP8 widths, kv_a norm fused, no gate): the op rotates q's rope part
    and k_pe - inside the prologue (fused) or by the torch rotation (unfused) - against the fp32 reference
    with the same positions (up to 2^20); the cache holds the rotated k_pe."""
    args, kw = _case(f"rope-{bs}-{len(lens)}-{style}", lens, bs=bs, gate=False, kv_norm=True, **shape)
    _check(args, dict(kw, **_rope(len(lens), shape["R"], len(lens), style)), fused=fused)


@pytest.mark.parametrize("B", [1, 17, 64])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_prologue_rotates_bf16(B, style):
    """The prologue alone at GLM-5.3 TP8 widths: the NaN-poisoned q_pe == apply_rope of q's rope part (bf16,
    one rounding) up to one bf16 ulp, every row (two row tiles at 17) and head; the live cache rows' rope
    columns == apply_rope(k_pe) up to one ulp, latent columns exact; nothing else written."""
    H, L, R, nope = (GLM_TP8[k] for k in ("H", "L", "R", "nope"))
    g = _gen(f"rope-prologue{B}{style}")
    nslots = 3 * B + 5
    q = torch.randn(B, H * (nope + R), generator=g, device=DEV).to(torch.bfloat16).view(B, H, nope + R)
    w_uk = (torch.randn(H, nope, L, generator=g, device=DEV) * nope ** -0.5).to(torch.bfloat16)
    kv = torch.randn(B, L + R, generator=g, device=DEV).to(torch.bfloat16)
    slots = torch.randperm(nslots, generator=g, device=DEV)[:B]
    slots[1::3] = -1
    rope = _rope(B, R, B, style)
    flat = torch.full((nslots, L + R), float("nan"), device=DEV, dtype=torch.bfloat16)
    q_lat = torch.full((H, B, L), float("nan"), device=DEV, dtype=torch.bfloat16)
    q_pe = torch.full((B, H, R), float("nan"), device=DEV, dtype=torch.bfloat16)
    _prologue(q, kv[:, :L], kv[:, L:], slots, flat, w_uk, q_lat, q_pe=q_pe, **rope)
    torch.cuda.synchronize()
    assert not torch.isnan(q_pe).any() and not torch.isnan(q_lat).any(), "rows left unwritten"
    sty = "interleaved" if rope["rope_interleaved"] else "neox"
    want = apply_rope(q[..., nope:], rope["positions"], rope["rope_inv_freq"], sty)
    torch.testing.assert_close(q_pe.float(), want.float(), rtol=2 ** -7, atol=1e-3)
    live = slots >= 0
    k_rot = apply_rope(kv[:, L:].unsqueeze(1), rope["positions"], rope["rope_inv_freq"], sty).squeeze(1)
    assert torch.equal(flat[slots[live]][:, :L], kv[live][:, :L])
    torch.testing.assert_close(flat[slots[live]][:, L:].float(), k_rot[live].float(), rtol=2 ** -7, atol=1e-3)
    untouched = torch.ones(nslots, dtype=torch.bool, device=DEV)
    untouched[slots[live]] = False
    assert torch.isnan(flat[untouched]).all(), "a negative slot or a masked row wrote the cache"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_epilogue"])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_graph_replay_equals_eager(fused, style):
    """Capture once with RoPE (GLM-5.3 TP8 widths, kv norm, positions a static buffer); new positions,
    seq_lens, slots, cache contents and q in the static buffers: replay == eager bit for bit, both right."""
    shape, bs, per = GLM_TP8, 64, 80
    a0, kw = _case(f"rope-graph0{style}", [0, 2500, 7, 4000, 1], bs=bs, per=per, gate=False, kv_norm=True, **shape)
    static = [t.clone() for t in a0]
    wide = torch.cat([a0[1], a0[2]], -1)              # keep the strided latent the program passes
    static[1], static[2] = wide[:, :shape["L"]], wide[:, shape["L"]:]
    rope = _rope(5, shape["R"], 0, style)
    norm = dict(kv_norm_weight=kw["kv_norm_weight"].clone(), kv_norm_eps=kw["kv_norm_eps"])
    out = torch.empty(5, shape["H"] * shape["v"], device=DEV, dtype=torch.bfloat16)

    def call():
        mla_decode_triton(*static, qk_nope_head_dim=kw["qk_nope_head_dim"], v_head_dim=kw["v_head_dim"], out=out,
                          fused=fused, **norm, **rope)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()                                           # compile + warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for i, (seed, lens) in enumerate(((f"rope-graph1{style}", [3000, 0, 1, 5000, 64]),
                                      (f"rope-graph2{style}", [1, 1, 0, 0, 5119]))):
        a, kw2 = _case(seed, lens, bs=bs, per=per, gate=False, kv_norm=True, **shape)
        for dst, src in zip(static, a):
            dst.copy_(src)
        norm["kv_norm_weight"].copy_(kw2["kv_norm_weight"])
        new_rope = _rope(5, shape["R"], 3 + 2 * i, style)
        rope["positions"].copy_(new_rope["positions"])
        eager_cache = a[3].clone()
        eager = mla_decode_triton(*a[:3], eager_cache, *a[4:], **kw2, **new_rope, fused=fused)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"{seed}: replay != eager"
        torch.testing.assert_close(static[3], eager_cache, rtol=0, atol=0, equal_nan=True)
        _check(a, dict(kw2, **new_rope), fused=fused)
