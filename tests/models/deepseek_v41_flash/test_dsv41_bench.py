"""DeepSeek-V4.1-Flash's layer bench: its kinds and bench specs, the roofline terms, "ours" through the generic harness
on the CPU (the plumbing of every cell), and the stock composition (``bench/stock/sparse_mqa_moe.py``, stand-ins in
``bench/stock/sparse_mqa_kernels.py``): each stand-in and the stock layer against torch math, on the GPU (``-m gpu``)
and on the CPU under the Triton interpreter (``interpreter_case``, run by the driver in a child process)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from latency_specialized.cli import main
from latency_specialized.errors import UserError
from latency_specialized.plugins import get_registry
from latency_specialized.spec import ParallelSpec

from tests.interpret import INTERPRETING, run_interpreted

try:
    import triton  # noqa: F401

    _HAVE_TRITON = True
except Exception:  # noqa: BLE001
    _HAVE_TRITON = False

DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
           pytest.param("cpu", marks=pytest.mark.interpreter_case, id="interpret")]
KINDS = ("c2_idx", "c1_reuse", "window")
TINY_LAYERS = {"c2_idx": 2, "c1_reuse": 7, "window": 0, "c1_idx": 8}
"""The tiny spec's layers of each sort (its layer 7 reads layer 6's KV and top-k; 8 runs an indexer, owns no KV)."""


def _adapter():
    return get_registry().adapter("deepseek_v41_flash")


# ------------------------------------------------------------------------------------------ kinds and specs
def test_bench_kinds_and_specs():
    from latency_specialized_models.deepseek_v41_flash.composed import composed_model, layer_kind
    from latency_specialized_models.deepseek_v41_flash.reference import refuse_unmodelled

    adapter = _adapter()
    full, kinds = adapter.spec("full"), adapter.bench_kinds()
    assert list(kinds) == list(KINDS)
    want = {"c2_idx": "sparse_mqa.c2.src.idx+moe", "c1_reuse": "sparse_mqa.c1+moe", "window": "sparse_mqa.window+moe"}
    for name, bk in kinds.items():
        assert (bk.context, bk.kv_block_size, bk.stock, bk.router_weight_bytes) == (True, 64, "sparse_mqa_moe", 2)
        assert layer_kind(full, full.layers[bk.layer]) == want[name]
        for tp in (4, 8):
            spec = adapter.bench_spec(full, tp, name, 3)
            refuse_unmodelled(spec, "program")                       # no Engram, no YaRN
            assert spec.num_layers == 3 and spec.hidden_size == 5120 and spec.vocab_size == 512 * tp
            src = full.layers[bk.layer]
            for L in spec.layers:
                assert L.ffn == src.ffn
                assert L.attention.model_copy(update={"indexer": None}) == \
                    src.attention.model_copy(update={"indexer": None})
            got = {k: tuple(lp.index for lp in v) for k, v in composed_model(spec).kinds.items()}
            first = {"c2_idx": {want["c2_idx"]: (0, 1, 2)}, "window": {want["window"]: (0, 1, 2)},
                     "c1_reuse": {"sparse_mqa.c1.src.idx+moe": (0,), want["c1_reuse"]: (1, 2)}}[name]
            assert got == first
            one = {k for k in composed_model(adapter.bench_spec(full, tp, name, 1)).kinds}
            assert one == {want[name] if name != "c1_reuse" else "sparse_mqa.c1.src.idx+moe"}
            rank = spec.shard(tp)
            a = rank.layers[0].attention
            assert (a.num_heads, a.o_groups, a.head_dim, a.q_lora_rank) == (64 // tp, 8 // tp, 512, 1280)
            assert rank.layers[0].ffn.expert_intermediate == 2304 // tp
            assert (spec.index_topk, spec.residual.streams, spec.layers[0].ffn.top_k) == (512, 4, 6)
        names = [s.name for s in adapter.op_sites(adapter.bench_spec(full, 8, name, 3).shard(8), ParallelSpec(tp=8), 4,
                                                  "sm_90", "bfloat16", context=4096)]
        assert (f"{want['c2_idx']}/attn.indexer" in names) == (name == "c2_idx")


def test_unknown_kind_and_the_cli_checks(capsys, monkeypatch):
    adapter = _adapter()
    with pytest.raises(UserError, match="use c2_idx, c1_reuse, window"):
        adapter.bench_spec(adapter.spec("full"), 8, "c2", 3)
    assert main(["bench", "--model", "deepseek_v41_flash", "--kinds", "c2"]) == 2
    assert "not benchable for deepseek_v41_flash: use --kinds with c2_idx, c1_reuse, window" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--model", "deepseek_v41_flash", "--tp", "8", "--kinds", ",".join(KINDS),
                 "--context", "4096", "--batch", "1,8", "--layers", "3"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_roofline_terms_and_notes():
    """The sparse MQA terms by hand (TP 8, batch 2, context 4096), the kinds' summaries and notes."""
    from latency_specialized.bench.layer_bench import bench_kinds, bench_notes, kind_summary, layer_bytes

    adapter = _adapter()
    full = adapter.spec("full")
    kinds = bench_kinds(adapter, KINDS)
    D, N, tp, B = 512, 5120, 8, 2
    base_w = ((1280 + D) * N + 64 * D * 1280 + 8 * 1024 * 4096 + N * 8 * 1024 + 1280 + D) * 2 + 64 * 4
    mhc = 2 * ((24 * 4 * N + 24 + 3) * 4 + N * 2) / tp + 2 * B * 4 * N * 2 * 3
    c2 = layer_bytes(full, 2, tp, batch=B, context=4096, distinct_experts=10)
    assert c2["kv_cache"] == B * (128 + 512 + 2) * D * 2 and c2["indexer_cache"] == B * (2048 + 1) * 128 * 2
    assert c2["compressor_state"] == B * 2 * 2 * D * 2 * 2
    assert c2["attn_weights"] == (base_w + (2 * D * N + D + 32 * 128 * 1280 + 32 * N + 128 * D + 128) * 2) / tp
    assert c2["mhc"] == mhc and "norms" not in c2
    assert c2["routed_experts"] == 10 * 3 * 2304 * N * 2 / tp and c2["shared_experts"] == 3 * 2304 * N * 2 / tp
    c1 = layer_bytes(full, 21, tp, batch=B, context=4096, distinct_experts=10)
    assert c1["kv_cache"] == B * (128 + 512 + 1) * D * 2 and c1["attn_weights"] == base_w / tp
    assert "indexer_cache" not in c1 and "compressor_state" not in c1
    w = layer_bytes(full, 0, tp, batch=B, context=50, distinct_experts=10)
    assert w["kv_cache"] == B * (51 + 1) * D * 2
    for name, bk in kinds.items():
        s = kind_summary(full, tp, name, bk)
        assert (s["stock"], s["window"], s["kv_bytes_per_token"]) == ("sparse_mqa_moe", 128, 1024)
    text = "\n".join(bench_notes(full, kinds, tp))
    for stand_in in ("FlashMLA", "fp8_paged_mqa_logits", "fused_topk_bias", "MHC_PRE_NORM_KERNEL", "stand-in",
                     "sparse_mqa_bytes", "eager break"):
        assert stand_in in text, stand_in
    assert text.count("DeepSeek-V4.1 layers, stock") == 1


def test_model_files_keep_their_line_budget():
    """1000 lines (1015 for a while: the reference's synthetic-history seeding and its clone keeping the
    histories). Back to 1000 by moving out what is not DeepSeek's: the names.py wrappers of the FP8 / FP4
    codecs (load / save and the tests call ``latency_specialized.quant.codecs`` directly), the copy of
    ReferenceStates.clone (``ModelStates.clone`` keeps the subclass and calls its ``copy_history`` hook),
    and ``spec.layers_with_ratio`` (its one use, in tests/models/test_model_specs.py, is inlined)."""
    root = Path(__file__).resolve().parents[3] / "models" / "deepseek_v41_flash"
    assert sum(len(p.read_text().splitlines()) for p in root.glob("*.py")) <= 1000


def _cpu_harness(monkeypatch):
    from latency_specialized import hardware as hw

    monkeypatch.setattr(hw, "probe", lambda: hw.for_arch("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)


@pytest.mark.parametrize("kind", KINDS)
def test_ours_cells_at_tiny_widths(kind, monkeypatch):
    """What ``run_bench`` builds as "ours" per cell, on the CPU at the tiny spec's widths (TP 1): the K- and
    1-layer programs through the generic harness, one eager step each, the routing of every layer, the experts it
    hands stock, and the cell's roofline. TP 1 (at TP > 1 the harness binds the all-reduce sites to a CuTe kernel)."""
    from latency_specialized.bench.layer_bench import layer_bytes

    _cpu_harness(monkeypatch)
    adapter = _adapter()
    tiny = adapter.spec("tiny")
    K, batches, context = 3, (1, 3), 40
    ours = adapter.layer_bench().build_ours(tiny, 1, kind, K, batches, torch.device("cpu"), say=lambda s: None,
                                            contexts=(context,), steps=4)
    assert any("attn.sparse_mqa" in n for n in ours.notes)
    for batch in batches:
        k, one = ours.variants(batch, context)
        assert (k.layers, one.layers, k.context) == (K, 1, context)
        ids = k.routing()
        one.eager()
        assert len(ids) == K and all(t.shape == (batch, 4) for t in ids)
        w13, w2 = ours.expert_weights(K)[0]
        assert w13.shape == (16, 2 * 32, 64) and w2.shape == (16, 64, 32)
        rb = layer_bytes(tiny, TINY_LAYERS[kind], 1, batch, context, float(torch.unique(ids[0]).numel()))
        assert rb["total"] > rb["routed_experts"] > 0
    ours.close()


# ------------------------------------------------------------------------------------------ stand-in kernels
def _rope(R, device, theta=160_000.0):
    from latency_specialized.ops.rope import rope_inv_freq

    return rope_inv_freq(theta, R, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_mhc_seam_matches_reference(device):
    from latency_specialized.bench.stock import sparse_mqa_kernels as sk
    from latency_specialized.bench.stock.sparse_mqa_moe import MHCState

    torch.manual_seed(0)
    M, n, H = 3, 4, 96          # H not a multiple of the chunk: masked channels
    st = MHCState.random(M, H, n, device)
    ref = st.clone()
    fn = torch.randn(24, n * H, device=device) * (n * H) ** -0.5
    scale, base, w = 0.5 + torch.rand(3, device=device), 0.1 * torch.randn(24, device=device), \
        (1 + 0.1 * torch.randn(H, device=device)).to(torch.bfloat16)
    S = -(-H // sk.MHC_CHUNK)
    mix, sq = torch.empty(S, M, 32, device=device), torch.empty(S, M, device=device)
    kw = dict(rms_eps=1e-20, hc_eps=1e-6, post_mult=2.0, norm_eps=1e-20, iters=20)
    out = torch.full((M, H), float("nan"), device=device, dtype=torch.bfloat16)
    sk.mhc_post_mix(st.streams, st.y, st.post, st.comb, fn, mix=mix, sqrsum=sq)
    sk.mhc_pre_norm(mix, sq, scale, base, st.streams, st.pre[0], w, pre=st.pre[1], post=st.post, comb=st.comb,
                    out=out, **kw)
    x, pre, post, comb = sk.mhc_seam_reference(ref.streams, ref.y, ref.post, ref.comb, fn, scale, base, ref.pre[0], w,
                                               **kw)
    torch.testing.assert_close(st.streams.float(), ref.streams.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), x.float(), rtol=2e-2, atol=2e-2)
    for got, want in ((st.pre[1], pre), (st.post, post), (st.comb, comb)):   # from streams one bf16 ulp apart
        torch.testing.assert_close(got, want, rtol=5e-3, atol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_front_kernels_match_reference(device):
    """q / kv RMSNorms; q head norm + RoPE and the window write (a padding-free ring: slots p % W)."""
    from latency_specialized.bench.stock import sparse_mqa_kernels as sk

    torch.manual_seed(1)
    M, ql, D, H, W, R = 3, 48, 32, 4, 8, 8
    y = torch.randn(M, ql + D, device=device).to(torch.bfloat16)
    qw, kvw = ((1 + 0.1 * torch.randn(k, device=device)).to(torch.bfloat16) for k in (ql, D))
    qr, kv = torch.empty(M, ql, device=device, dtype=torch.bfloat16), torch.empty(M, D, device=device,
                                                                                   dtype=torch.bfloat16)
    sk.q_kv_rmsnorm(y, qw, kvw, 1e-6, q_lora=ql, out=(qr, kv))
    rq, rkv = sk.q_kv_rmsnorm_reference(y, qw, kvw, 1e-6, q_lora=ql)
    torch.testing.assert_close(qr.float(), rq.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(kv.float(), rkv.float(), rtol=1e-2, atol=1e-2)
    q = torch.randn(M, H, D, device=device).to(torch.bfloat16)
    pos, rows = torch.tensor([5, 40, 0], device=device), torch.tensor([2, 0, 1], device=device, dtype=torch.int32)
    win = torch.randn(3, W, D, device=device).to(torch.bfloat16)
    q2, win2, inv = q.clone(), win.clone(), _rope(R, device)
    sk.qnorm_rope_kv_insert(q, kv, pos, inv, win, rows, 1e-6)
    sk.qnorm_rope_kv_insert_reference(q2, kv, pos, inv, win2, rows, 1e-6)
    torch.testing.assert_close(q.float(), q2.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(win.float(), win2.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio", [1, 2])
def test_compressor_and_key_store_match_reference(device, ratio):
    from latency_specialized.bench.stock import sparse_mqa_kernels as sk
    from latency_specialized.bench.stock.dsa_kernels import fp8_quantize_reference

    torch.manual_seed(2 + ratio)
    M, D, R, bs, Di = 3, 32, 8, 4, 16
    pos = torch.tensor([9, 10, 3], device=device)           # ratio 2: rows 0 and 2 complete a group, row 1 does not
    rows = torch.tensor([1, 2, 0], device=device, dtype=torch.int32)
    bt = torch.randperm(M * 4).to(torch.int32).view(M, 4).to(device)
    c = torch.randn(M, D * (2 if ratio > 1 else 1), device=device).to(torch.bfloat16)
    pend = torch.randn(M, ratio, 2 * D, device=device).to(torch.bfloat16) if ratio > 1 else None
    cache = torch.full((M * 4, bs, D), float("nan"), device=device, dtype=torch.bfloat16)
    w, inv = (1 + 0.1 * torch.randn(D, device=device)).to(torch.bfloat16), _rope(R, device)
    pend2, cache2 = (pend.clone() if pend is not None else None), cache.clone()
    lat = torch.empty(M, D, device=device, dtype=torch.bfloat16)
    sk.compress_insert(c, pend, rows, pos, w, inv, cache, bt, ratio, 1e-6, lat=lat)
    want = sk.compress_insert_reference(c, pend2, rows, pos, w, inv, cache2, bt, ratio, 1e-6)
    torch.testing.assert_close(lat.float(), want.float(), rtol=1e-2, atol=1e-2)
    if pend is not None:
        assert torch.equal(pend, pend2)
    written = ~torch.isnan(cache2.float()).all(-1)
    assert int(written.sum()) == (2 if ratio > 1 else 3) and torch.equal(written, ~torch.isnan(cache.float()).all(-1))
    torch.testing.assert_close(cache.float()[written], cache2.float()[written], rtol=1e-2, atol=1e-2)
    k = torch.randn(M, Di, device=device).to(torch.bfloat16)
    kc, ks = fp8_quantize_reference(torch.randn(M * 4, bs, Di, device=device))
    kc2, ks2 = kc.clone(), ks.clone()
    kw = (1 + 0.1 * torch.randn(Di, device=device)).to(torch.bfloat16)
    sk.index_key_store(k, kw, pos, inv, kc, ks, bt, ratio, 1e-6)
    sk.index_key_store_reference(k, kw, pos, inv, kc2, ks2, bt, ratio, 1e-6)
    assert torch.equal(ks, ks2)
    a, b = kc.float() * ks[..., None], kc2.float() * ks2[..., None]
    assert float((a - b).abs().max()) <= float(b.abs().max()) / 8        # one e4m3 step at most


@pytest.mark.parametrize("device", DEVICES)
def test_sqrtsoftplus_topk_matches_reference(device):
    from latency_specialized.bench.stock import sparse_mqa_kernels as sk
    from latency_specialized.spec import RouterSpec

    torch.manual_seed(4)
    M, E, k = 5, 48, 6
    logits = 3 * torch.randn(M, E, device=device)
    logits[0, :4] = 30.0                                      # past softplus' threshold
    bias = 0.1 * torch.randn(E, device=device)
    router = RouterSpec(score_func="sqrtsoftplus", bias_corrected=True, renormalize=True, routed_scaling=1.5, fp32=True)
    w, ids = torch.empty(M, k, device=device), torch.empty(M, k, device=device, dtype=torch.int32)
    sk.sqrtsoftplus_topk(logits, bias, k, renormalize=True, scaling=1.5, renorm_eps=router.renormalize_eps,
                         weights=w, ids=ids)
    rw, rids = sk.sqrtsoftplus_topk_reference(logits, bias, k, router)
    order, rorder = ids.long().sort(-1), rids.sort(-1)
    assert torch.equal(order.values, rorder.values)
    torch.testing.assert_close(w.gather(1, order.indices), rw.float().gather(1, rorder.indices), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compressed", [True, False])
def test_sparse_decode_matches_reference(device, compressed):
    """Window rows (a short sequence: only its first slots valid) + selected compressed rows (some -1), sinks, the
    inverse RoPE and the output groups' layout (2 groups of 4 heads)."""
    from latency_specialized.bench.stock import sparse_mqa_kernels as sk

    torch.manual_seed(5)
    M, H, D, W, R, K, G = 3, 8, 32, 16, 8, 40, 2
    q = torch.randn(M, H, D, device=device).to(torch.bfloat16)
    win = torch.randn(M, W, D, device=device).to(torch.bfloat16)
    rows_s = torch.tensor([2, 0, 1], device=device, dtype=torch.int32)
    seq = torch.tensor([100, 5, 16], device=device, dtype=torch.int32)
    comp = torch.randn(30, 4, D, device=device).to(torch.bfloat16) if compressed else None
    rows = torch.randint(0, 120, (M, K), device=device, dtype=torch.int32) if compressed else None
    counts = torch.tensor([K, 7, 0], device=device, dtype=torch.int32) if compressed else None
    sinks, pos, inv = torch.randn(H, device=device), seq.long() - 1, _rope(R, device)
    out = torch.full((G, M, H // G * D), float("nan"), device=device, dtype=torch.bfloat16)
    sk.sparse_mqa_decode(q, win, rows_s, seq, comp, rows, counts, sinks, pos, inv, groups=G, out=out)
    want = sk.sparse_mqa_decode_reference(q, win, rows_s, seq, comp, rows, counts, sinks, pos, inv, groups=G)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------------------ the stock layer
def _pair(layer):
    """A copy of ``layer`` for the reference: its own states (weights shared)."""
    ref = copy.copy(layer)
    for k in ("window", "comp", "pending", "key_cache", "key_scales", "rows", "counts"):
        if getattr(layer, k, None) is not None:
            setattr(ref, k, getattr(layer, k).clone())
    ref.moe = copy.copy(layer.moe)
    ref.moe.topk_ids = layer.moe.topk_ids.clone()
    return ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sort", list(TINY_LAYERS))
@pytest.mark.parametrize("batch,context", [(1, 41), (3, 100)])
def test_stock_layer_matches_reference(device, sort, batch, context):
    """The stock layer (Triton stand-ins) == the same layer from torch references, tiny widths, TP 2 (2 groups)."""
    from latency_specialized.bench.stock.sparse_mqa_moe import MHCState, StockSparseMQAMoELayer

    tiny = _adapter().spec("tiny")
    torch.manual_seed(batch + context)
    layer = StockSparseMQAMoELayer(tiny, TINY_LAYERS[sort], 2, batch, context, device, block_size=16)
    assert (layer.src, layer.idx) == {"c2_idx": (True, True), "c1_reuse": (False, False), "window": (False, False),
                                      "c1_idx": (False, True)}[sort]
    ref = _pair(layer)
    st = MHCState.random(batch, tiny.hidden_size, 4, device)
    st_ref = st.clone()
    layer.forward(st)
    ref.reference_forward(st_ref)
    if layer.r:
        assert torch.equal(layer.counts, ref.counts)
        K = layer.K
        overlap = min(len(set(layer.rows[b].tolist()) & set(ref.rows[b].tolist())) for b in range(batch))
        assert overlap >= (K if not layer.idx else K - 2)     # fp8 scores: a near-tie may go either way
    for got, want in ((st.streams, st_ref.streams), (st.pre[0], st_ref.pre[0]), (st.comb, st_ref.comb)):
        g, w = got.float(), want.float()
        assert torch.isfinite(g).all() and float((g - w).norm() / w.norm()) < (3e-2 if not layer.idx else 6e-2)
    out, want = st.y.float(), st_ref.y.float()
    # an own indexer's swapped near-tie row moves the attention output a little, which may flip a token's routing:
    # compare the MoE output of the tokens routed alike (all of them without an indexer)
    same = (layer.routed_ids().long().sort(-1).values == ref.routed_ids().long().sort(-1).values).all(-1)
    assert torch.isfinite(out).all() and (same.all() or layer.idx)
    if same.any():
        assert float((out[same] - want[same]).norm() / want[same].norm()) < (5e-2 if not layer.idx else 8e-2)
    torch.testing.assert_close(layer.window.float(), ref.window.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_stock_layers_for_the_kinds(device, kind):
    """What the bench builds per cell (``compositions['sparse_mqa_moe']``) for the tiny spec's layers of each kind:
    ``copies`` layers, readers sharing one compressed cache and one selection, one step, finite, routed."""
    from latency_specialized.bench.stock.compositions import composition

    adapter = _adapter()
    tiny = adapter.spec("tiny")
    bk = adapter.bench_kinds()[kind]
    bk = type(bk)(**{**bk.__dict__, "layer": TINY_LAYERS[kind], "kv_block_size": 16})
    stock = composition(bk.stock).build(tiny, bk, 2, 3, 60, 3, device)
    if kind == "c1_reuse":
        assert all(l.comp is stock.layers[0].comp and l.sel is stock.layers[0].sel for l in stock.layers)
    if kind == "c2_idx":
        assert stock.layers[0].comp is not stock.layers[1].comp
    stock.step()
    assert torch.isfinite(stock.st.y.float()).all() and len(stock.routed_ids()) == 3
    assert stock.weight_bytes() > 0


@pytest.mark.interpreter_driver
@pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (its interpreter runs the kernels on the CPU)")
def test_cpu_cases_under_the_interpreter():
    """The stand-in kernels and the stock layers on the CPU (Triton interpreter, child process)."""
    run_interpreted("tests/models/deepseek_v41_flash/test_dsv41_bench.py", min_passed=18)


@pytest.mark.skipif(not _HAVE_TRITON or INTERPRETING, reason="needs triton, compiling (not interpreting)")
def test_stock_stand_ins_compile_for_hopper():
    """Every Triton kernel one stock step launches (each kind, batch 1 and 3) builds for sm_90 on the CPU: the
    first H200 run of this bench lost its stock column to a compile error the interpreter had let through."""
    from latency_specialized.bench.stock.compositions import composition

    from tests.triton_offline import compile_for_hopper, recorded_launches

    adapter = _adapter()
    tiny = adapter.spec("tiny")
    with recorded_launches() as launches:
        for kind in KINDS:
            bk = adapter.bench_kinds()[kind]
            bk = type(bk)(**{**bk.__dict__, "layer": TINY_LAYERS[kind], "kv_block_size": 16})
            for batch in (1, 3):
                composition(bk.stock).build(tiny, bk, 2, batch, 60, 2, "cpu").step()
    names = {fn.fn.__name__ for fn, _, _ in launches}
    assert {"_q_kv_rmsnorm_kernel", "_sparse_split_kernel", "_sparse_merge_kernel", "_compress_kernel"} <= names
    assert compile_for_hopper(launches) == {}
