"""GLM-5.3's layer bench: its kinds, bench specs, "ours" through the generic harness and the stock DSA + MoE
composition (``bench/stock/dsa_moe.py``, stand-ins in ``bench/stock/dsa_kernels.py``).

CPU: the kinds, the bench specs at TP 4 / 8 rank shapes (layer pattern, op sites), the CLI checks, the kinds'
summaries, notes and roofline terms. The stand-in kernels and the stock layer against their torch references: on the
GPU (``-m gpu``) and on the CPU under the Triton interpreter (``interpreter_case``, run by the driver in a
``TRITON_INTERPRET=1`` child process, ``tests/interpret.py``). The bench itself needs CUDA: what it does per cell -
ours' K- and 1-layer programs and stock's K layers for every batch, both kinds - runs at tiny widths under the
interpreter (``test_bench_cells_at_tiny_widths``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from latency_specialized.cli import main
from latency_specialized.errors import UserError
from latency_specialized.plugins import get_registry
from latency_specialized.spec import ParallelSpec

from tests.interpret import run_interpreted

try:
    import triton  # noqa: F401

    _HAVE_TRITON = True
except Exception:  # noqa: BLE001
    _HAVE_TRITON = False

DEVICES = [
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
    pytest.param("cpu", marks=pytest.mark.interpreter_case, id="interpret"),
]
KINDS = ("moe", "moe_shared_topk")


def _adapter():
    return get_registry().adapter("glm53")


# ------------------------------------------------------------------------------------------ kinds and specs
def test_bench_kinds_are_an_indexer_layer_and_a_shared_topk_layer():
    from latency_specialized.bench.stock.compositions import composition
    from latency_specialized.bench.stock.dsa_moe import StockDSAOptions, runs_own_indexer

    adapter = _adapter()
    full, kinds = adapter.spec("full"), adapter.bench_kinds()
    assert list(kinds) == list(KINDS)
    assert (kinds["moe"].layer, kinds["moe_shared_topk"].layer) == (6, 3)   # the first MoE layer of each sort
    for name, bk in kinds.items():
        layer = full.layers[bk.layer]
        assert layer.ffn.kind == "moe" and layer.attention.kind == "mla"
        assert runs_own_indexer(layer.attention, bk.layer) == (name == "moe")
        assert (bk.context, bk.kv_block_size, bk.stock, bk.router_weight_bytes) == (True, 64, "dsa_moe", 2)
        assert StockDSAOptions.from_mapping(bk.stock_options).indexer_rope == "interleaved"
        assert len(bk.notes) == 1 and bk.notes[0].startswith(f"{name} (GLM-5.3): ")
    assert "DeepSeek-V3.2 / GLM-5" in composition("dsa_moe").description


@pytest.mark.parametrize("tp", [4, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_bench_spec_layers_widths_and_sites(kind, tp):
    """Full widths, MoE on every layer; ``moe``: an indexer on every layer, ``moe_shared_topk``: on layer 0 only (the
    1-layer program is then an indexer layer and K - 1 layers reuse its top-k); the rank's op sites say the same."""
    adapter = _adapter()
    full = adapter.spec("full")
    spec = adapter.bench_spec(full, tp, kind, 3)
    src = full.layers[adapter.bench_kinds()[kind].layer]
    assert spec.num_layers == 3 and spec.hidden_size == 6144 and spec.vocab_size == 512 * tp
    assert all(L.ffn == src.ffn and L.attention.model_copy(update={"indexer": None}) ==
               src.attention.model_copy(update={"indexer": None}) for L in spec.layers)
    want = (0, 1, 2) if kind == "moe" else (0,)
    assert spec.indexer_layers() == want
    assert spec.layers[0].attention.indexer.topk == 2048 and spec.layers[0].attention.indexer.num_heads == 32
    rank = spec.shard(tp)
    assert rank.layers[0].attention.num_heads == 64 // tp and rank.layers[0].ffn.expert_intermediate == 2048 // tp
    names = [s.name for s in adapter.op_sites(rank, ParallelSpec(tp=tp), 4, "sm_90", "bfloat16", context=4096)]
    kinds_seen = {n.split("/")[0] for n in names if "/" in n}
    assert kinds_seen == ({"mla+moe"} if kind == "moe" else {"mla+moe", "mla.reuse+moe"})
    assert "mla+moe/attn.indexer" in names and "mla.reuse+moe/attn.indexer" not in names
    assert adapter.bench_spec(full, tp, kind, 1).indexer_layers() == (0,)


def test_unknown_kind_and_the_cli_checks(capsys, monkeypatch):
    adapter = _adapter()
    with pytest.raises(UserError, match="use moe, moe_shared_topk"):
        adapter.bench_spec(adapter.spec("full"), 8, "dense", 3)
    assert main(["bench", "--model", "glm53", "--kinds", "dense"]) == 2
    assert "not benchable for glm53: use --kinds with moe, moe_shared_topk" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--model", "glm53", "--tp", "8", "--kinds", "moe,moe_shared_topk",
                 "--context", "4096,32768", "--batch", "1,64"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_kind_summaries_notes_and_roofline_terms():
    """What the results say per kind; the roofline's DSA terms (selected latents, indexer weights and keys), by hand."""
    from latency_specialized.bench.layer_bench import bench_kinds, bench_notes, kind_summary, layer_bytes
    from latency_specialized.bench.stock.dsa_moe import sparse_attention_bytes

    adapter = _adapter()
    full = adapter.spec("full")
    kinds = bench_kinds(adapter, KINDS)
    for name, bk in kinds.items():
        s = kind_summary(full, 8, name, bk)
        assert (s["layer_index"], s["context_axis"], s["stock"], s["kv_block_size"]) == (bk.layer, True, "dsa_moe", 64)
        assert s["kv_bytes_per_token"] == 576 * 2 and "DeepSeek-V3.2 / GLM-5" in s["stock_description"]
    notes = bench_notes(full, kinds, 8)
    text = "\n".join(notes)
    for stand_in in ("fp8_paged_mqa_logits", "cooperative_topk", "FLASH_ATTN_MLA_SPARSE", "fused_norm_rope",
                     "fused_q", "attention.mla.triton_splitkv", "stand-in"):
        assert stand_in in text, stand_in
    assert sum(" roofline: the bytes of the selected" in n for n in notes) == 2
    assert sum("DSA + MoE layers, stock" in n for n in notes) == 1
    assert "MLA 8 of 64 heads per rank" in text and "reuses the latest indexer layer's top-2048" in text
    # the roofline takes the layer's real reads (batch 2, context 4096, TP 8), not the whole latent cache
    counted = layer_bytes(full, 6, 8, batch=2, context=4096, distinct_experts=16)
    own = sparse_attention_bytes(full, 6, 8, 2, 4096)
    assert {k: counted[k] for k in own} == own and counted["kv_cache"] < 2 * 4097 * 576 * 2
    reuse = layer_bytes(full, 3, 8, batch=2, context=4096, distinct_experts=16)
    assert reuse["kv_cache"] == 2 * 2049 * 576 * 2 and "indexer_cache" not in reuse
    assert own["kv_cache"] == 2 * 2049 * 576 * 2 and own["indexer_cache"] == 2 * 4098 * 128 * 2
    assert own["indexer_weights"] == ((32 * 128 * 2048 + 160 * 6144) * 2 + 2 * 128 * 4) / 8
    assert set(sparse_attention_bytes(full, 3, 8, 2, 4096)) == {"kv_cache"}
    assert sparse_attention_bytes(full, 6, 8, 1, 100, key_bytes=132)["indexer_cache"] == 102 * 132


# ------------------------------------------------------------------------------------------ stand-in kernels
def _rope(R, device):
    from latency_specialized.ops.rope import rope_inv_freq

    return rope_inv_freq(8e6, R, device=device)


def _paged(batch, context, block, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-(context + 1) // block)
    bt = torch.randperm(batch * per_seq, generator=g).to(torch.int32).view(batch, per_seq).to(device)
    slots = bt[:, context // block].long() * block + context % block
    return bt, slots, per_seq


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("indexer", [True, False])
@pytest.mark.parametrize("interleaved", [True, False])
def test_norm_rope_cache_matches_reference(device, indexer, interleaved):
    from latency_specialized.bench.stock import dsa_kernels as dk

    torch.manual_seed(1)
    M, ql, L, R, D, block, ctx = 3, 48, 32, 16, 32, 8, 20
    bt, slots, per_seq = _paged(M, ctx, block, device)
    slots[1] = -1                                                     # a padding row writes nothing
    y = torch.randn(M, 2 * (ql + L + R), device=device).to(torch.bfloat16)[:, :ql + L + R]   # strided rows
    ik = torch.randn(M, 2 * D, device=device).to(torch.bfloat16)[:, :D]
    qw, kvw = ((1 + 0.1 * torch.randn(n, device=device)).to(torch.bfloat16) for n in (ql, L))
    kn = (1 + 0.1 * torch.randn(D, device=device), 0.1 * torch.randn(D, device=device))
    pos = torch.tensor([ctx, 5, ctx], device=device)
    inv = _rope(R, device)
    cache = torch.full((M * per_seq, block, L + R), float("nan"), device=device, dtype=torch.bfloat16)
    keys = torch.zeros(M * per_seq, block, D, device=device, dtype=torch.float8_e4m3fn)
    scales = torch.full((M * per_seq, block), -1.0, device=device)
    kw = dict(index_k=ik, index_k_norm=kn, key_cache=keys, key_scales=scales, index_inv_freq=inv,
              index_rope_interleaved=not interleaved) if indexer else {}
    ref_cache, ref_kw = cache.clone(), dict(kw, key_cache=keys.clone(), key_scales=scales.clone()) if indexer else {}
    q_c = torch.full((M, ql), float("nan"), device=device, dtype=torch.bfloat16)
    dk.norm_rope_cache(pos, y, qw, kvw, 1e-5, cache, slots, inv, q_lora=ql, rope_interleaved=interleaved, q_c=q_c, **kw)
    want = dk.norm_rope_cache_reference(pos, y, qw, kvw, 1e-5, ref_cache, slots, inv, q_lora=ql,
                                        rope_interleaved=interleaved, **ref_kw)
    torch.testing.assert_close(q_c.float(), want.float(), rtol=1e-2, atol=1e-2)
    flat, rflat = cache.view(-1, L + R), ref_cache.view(-1, L + R)
    written = torch.zeros(flat.shape[0], dtype=torch.bool, device=device)
    written[slots[slots >= 0]] = True
    torch.testing.assert_close(flat[written].float(), rflat[written].float(), rtol=1e-2, atol=1e-2)
    assert torch.isnan(flat[~written].float()).all()                  # nothing else written
    if indexer:
        s, rs = scales.view(-1), ref_kw["key_scales"].view(-1)
        assert torch.equal(s[written], rs[written]) and (s[~written] == -1).all()
        k = keys.view(-1, D)[written].float() * s[written, None]
        rk = ref_kw["key_cache"].view(-1, D)[written].float() * rs[written, None]
        # one fp8 e4m3 step at most (3 mantissa bits: 1/8 relative), from fp32 LayerNorm / RoPE rounding order
        assert float((k - rk).abs().max()) <= float(rk.abs().max()) / 8


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("indexer", [True, False])
def test_rope_q_index_matches_reference(device, indexer):
    from latency_specialized.bench.stock import dsa_kernels as dk

    torch.manual_seed(2)
    M, H, nope, R, hi, D = 3, 4, 32, 16, 4, 32
    q = torch.randn(M, H, nope + R, device=device).to(torch.bfloat16)
    iq = torch.randn(M, 2 * hi * D, device=device).to(torch.bfloat16)[:, :hi * D].view(M, hi, D)
    iw = torch.randn(M, 2 * hi, device=device).to(torch.bfloat16)[:, hi:]
    pos = torch.tensor([7, 300, 0], device=device)
    inv = _rope(R, device)
    kw = dict(index_q=iq, index_weights=iw, index_inv_freq=inv, index_rope_interleaved=True,
              weight_scale=D ** -0.5 * hi ** -0.5) if indexer else {}
    q_ref = q.clone()
    q8, w = dk.rope_q_index(pos, q, inv, nope=nope, rope_interleaved=True, **kw)
    r8, rw = dk.rope_q_index_reference(pos, q_ref, inv, nope=nope, rope_interleaved=True, **kw)
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=1e-2, atol=1e-2)
    if not indexer:
        assert q8 is None and w is None
        return
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)          # the same power-of-two scale per head
    s = (rw / iw.float()).view(M, hi, 1)
    assert float((q8.float() * s - r8.float() * s).abs().max()) <= float((r8.float() * s).abs().max()) / 8


@pytest.mark.parametrize("device", DEVICES)
def test_indexer_logits_matches_reference(device):
    from latency_specialized.bench.stock import dsa_kernels as dk

    torch.manual_seed(3)
    B, hi, D, block = 3, 16, 32, 8
    bt, _, per_seq = _paged(B, 50, block, device)
    q8, _ = dk.fp8_quantize_reference(torch.randn(B, hi, D, device=device))
    keys, scales = dk.fp8_quantize_reference(torch.randn(B * per_seq, block, D, device=device))
    w = torch.randn(B, hi, device=device)
    seq = torch.tensor([51, 9, 0], device=device, dtype=torch.int32)   # the last row: padding (all -inf)
    width = per_seq * block + 70                                        # wider than the table: -inf there
    out = torch.full((B, width), float("nan"), device=device)
    dk.indexer_logits(q8, w, keys, scales, bt, seq, out=out)
    want = dk.indexer_logits_reference(q8, w, keys, scales, bt, seq, width)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    assert torch.isinf(out[2]).all() and torch.isfinite(out[0, :51]).all() and torch.isinf(out[0, 51:]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_convert_topk_matches_reference(device):
    from latency_specialized.bench.stock import dsa_kernels as dk

    torch.manual_seed(4)
    B, K, block = 3, 16, 4
    bt, _, _ = _paged(B, 40, block, device)
    seq = torch.tensor([41, 10, 0], device=device, dtype=torch.int32)
    idx = torch.stack([torch.randperm(41)[:K] for _ in range(B)]).to(device)   # int64, as torch.topk gives
    idx[0, 3] = -1
    rows = torch.full((B, K), 7, device=device, dtype=torch.int32)
    counts = torch.full((B,), 99, device=device, dtype=torch.int32)
    dk.convert_topk(idx, bt, seq, block, rows=rows, counts=counts)
    want_rows, want_counts = dk.convert_topk_reference(idx, bt, seq, block)
    assert torch.equal(counts, want_counts) and counts[0] == K - 1 and counts[2] == 0
    assert torch.equal(rows, want_rows)                                  # valid rows first, in order, -1 after


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,width,seqs", [(64, 300, (300, 40, 0)), (2048, 5000, (4097, 4990, 2100))])
def test_topk_and_rows_match_reference(device, k, width, seqs):
    """What the stock indexer layer runs after its logits (the top-k stand-in, then the row conversion) vs the torch
    reference: the same counts, valid rows first and distinct, the same multiset of selected values (logits rounded to
    bf16, so that many are exactly equal: ties may go either way, values may not)."""
    from latency_specialized.bench.stock import dsa_kernels as dk

    torch.manual_seed(5)
    B, block = len(seqs), 64
    per_seq = -(-width // block)
    bt = torch.randperm(B * per_seq).to(torch.int32).view(B, per_seq).to(device)
    x = torch.randn(B, width, device=device).to(torch.bfloat16).float()
    x[0, :10] = float("-inf")
    pos = torch.arange(width, device=device)
    seq = torch.tensor(seqs, device=device, dtype=torch.int32)
    x = x.masked_fill(pos[None, :] >= seq.long()[:, None], float("-inf"))   # what indexer_logits writes past a sequence
    want_rows, want_counts = dk.topk_rows_reference(x, k, bt, seq, block)
    pos_of = torch.full((B * per_seq * block,), -1, dtype=torch.long)
    pos_of[(bt.cpu().long()[:, :, None] * block + torch.arange(block)).flatten()] = \
        torch.arange(per_seq * block).repeat(B)
    rows = torch.full((B, k), 12345, device=device, dtype=torch.int32)
    counts = torch.full((B,), -7, device=device, dtype=torch.int32)
    _, idx = dk.topk_select(x, k)
    dk.convert_topk(idx, bt, seq, block, rows=rows, counts=counts)
    assert torch.equal(counts, want_counts) and counts.tolist() == [min(s, k) for s in seqs]
    for b in range(B):
        n = int(counts[b])
        got = rows[b, :n].cpu().long()
        assert (rows[b, n:] == -1).all() and got.unique().numel() == n
        sel = pos_of[got]
        assert (sel >= 0).all() and (sel < seqs[b]).all()
        ref = pos_of[want_rows[b, :n].cpu().long()]
        assert torch.equal(x[b].cpu()[sel].sort().values, x[b].cpu()[ref].sort().values)


# ------------------------------------------------------------------------------------------ the stock layer
def _tiny_kinds():
    """The bench kinds at the tiny spec's layers (6: indexer + MoE, 3: shared top-k + MoE, as in the full spec)."""
    adapter = _adapter()
    tiny = adapter.spec("tiny")
    assert 6 in tiny.indexer_layers() and 3 in tiny.shared_indexer_layers() and not tiny.dense_layers().count(3)
    return adapter, tiny, adapter.bench_kinds()


def _small_spec():
    """GLM-5.3's layer pattern (3 dense, indexers on 0, 1, 2, 6) at widths the sparse attention kernel takes (kv_lora
    and rope powers of two >= 16; the tiny spec's rope is 8)."""
    from latency_specialized_models.glm53.spec import build_spec

    return build_spec(variant="tiny", hidden=128, vocab=512, num_layers=8, first_dense=3, heads=8, q_lora=64,
                      kv_lora=32, nope=16, rope=16, v_dim=16, idx_heads=16, idx_dim=32, idx_topk=16, freq=4, offset=3,
                      experts=16, top_k=4, shared=1, expert_inter=32, dense_inter=64, max_context=4096)


def _pair(layer):
    """A copy of ``layer`` for the reference (its own caches and selection; weights shared)."""
    ref = copy.copy(layer)
    ref.cache, ref.rows, ref.counts = layer.cache.clone(), layer.rows.clone(), layer.counts.clone()
    if layer.own:
        ref.key_cache, ref.key_scales = layer.key_cache.clone(), layer.key_scales.clone()
    ref.moe = copy.copy(layer.moe)
    ref.moe.topk_ids = layer.moe.topk_ids.clone()
    return ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch,context", [(1, 40), (3, 100)])
def test_stock_dsa_layer_matches_reference(device, kind, batch, context):
    """The stock layer (Triton stand-ins; the sparse attention kernel on the GPU, its torch reference under the
    interpreter, whose bf16 dot is wrong) == the layer from torch references, at small widths, TP 2."""
    from latency_specialized.bench.stock.dsa_moe import StockDSAMoELayer, StockDSAOptions
    from latency_specialized.bench.stock.gqa_moe import GatedStream
    from latency_specialized.ops.attention.mla import mla_decode_reference

    _, _, kinds = _tiny_kinds()
    tiny = _small_spec()
    torch.manual_seed(batch + context)
    layer = StockDSAMoELayer(tiny, kinds[kind].layer, 2, batch, context, device, options=StockDSAOptions("interleaved"),
                             block_size=16, attention=mla_decode_reference if device == "cpu" else None)
    assert layer.own == (kind == "moe")
    ref = _pair(layer)
    st = GatedStream.random(batch, tiny.hidden_size, torch.bfloat16, device)
    st_ref = st.clone()
    layer.forward(st)
    ref.reference_forward(st_ref)
    K = tiny.layers[0].attention.indexer.topk
    assert torch.equal(layer.counts, ref.counts) and (layer.counts == min(K, context + 1)).all()
    sel = [set(layer.rows[b, :K].tolist()) for b in range(batch)]
    overlap = min(len(s & set(ref.rows[b, :K].tolist())) for b, s in enumerate(sel))
    # an own indexer selects from fp8 scores: a near-tie at the K-th place may go either way after different roundings
    assert overlap == K if kind == "moe_shared_topk" else overlap >= K - 2
    if layer.own:   # the selection: the new token's position range, distinct rows of each sequence's blocks
        assert all(len(s) == K for s in sel)
    out, want = st.branch.float(), st_ref.branch.float()
    assert torch.isfinite(out).all()
    # a whole layer of bf16 roundings (each stage ~1 bf16 ulp, ~10 stages; RMSNorms pass relative errors on), plus
    # at most a couple of swapped near-tie tokens of 16 in an own-indexer layer
    assert float((out - want).norm() / want.norm()) < (5e-2 if kind == "moe_shared_topk" else 8e-2)
    s_out, s_want = st.stream.float(), st_ref.stream.float()   # two residual adds
    assert float((s_out - s_want).norm() / s_want.norm()) < (1.5e-2 if kind == "moe_shared_topk" else 4e-2)
    torch.testing.assert_close(layer.cache.float(), ref.cache.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(layer.routed_ids().long().sort(-1).values, ref.routed_ids().long().sort(-1).values) or \
        kind == "moe"   # routing follows the attention output: an own-indexer layer's may differ with its selection


# ------------------------------------------------------------------------------------------ the bench's cells, tiny
@pytest.mark.interpreter_case
@pytest.mark.parametrize("kind", KINDS)
def test_bench_cells_at_tiny_widths(kind, monkeypatch):
    """Per (batch, context) cell what ``run_bench`` builds and runs, on the CPU at the tiny spec's widths (TP 1 rank
    shapes): ours' K- and 1-layer programs through the generic harness (its K-layer step routes every layer) and
    stock's K layers sharing ours' routed experts (the composition the bench builds, its attention the torch reference
    here); then the roofline terms of the cell. Every batch gets a cell with both variants' outputs."""
    from latency_specialized import hardware as hw
    from latency_specialized.bench.layer_bench import add_stock_roofline, layer_bytes
    from latency_specialized.bench.stock.compositions import composition
    from latency_specialized.ops.attention.mla import mla_decode_reference

    adapter, tiny, kinds = _tiny_kinds()
    monkeypatch.setattr(hw, "probe", lambda: hw.for_arch("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    bk, K, batches, contexts = kinds[kind], 3, (1, 3), (40,)
    ours = adapter.layer_bench().build_ours(tiny, 1, kind, K, batches, torch.device("cpu"), say=lambda s: None,
                                            contexts=contexts, steps=4)
    assert any("attn.indexer=" in n for n in ours.notes) and any("attn.sparse_mla=" in n for n in ours.notes)
    cells = []
    for context in contexts:
        for batch in batches:
            k, one = ours.variants(batch, context)
            assert (k.layers, one.layers, k.context) == (K, 1, context)
            ids = k.routing()                                       # one eager K-layer step
            one.eager()
            assert len(ids) == K and all(t.shape == (batch, tiny.layers[bk.layer].ffn.top_k) for t in ids)
            stock = composition(bk.stock).build(tiny, bk, 1, batch, context, K, "cpu", experts=ours.expert_weights(K))
            for layer in stock.layers:
                layer._attention = mla_decode_reference
            assert all(layer.own == (kind == "moe") for layer in stock.layers)
            if kind == "moe_shared_topk":   # one index group: every copy reads the same selection
                assert all(layer.rows is stock.layers[0].rows for layer in stock.layers)
            stock.step()
            assert torch.isfinite(stock.st.branch.float()).all() and len(stock.routed_ids()) == K
            assert stock.layers[0].moe.w13 is ours.expert_weights(K)[0][0]
            distinct = sum(float(torch.unique(t).numel()) for t in ids) / K
            rb = layer_bytes(tiny, bk.layer, 1, batch, context, distinct)
            cell = {"kind": kind, "batch": batch, "context": context, "layer_index": bk.layer,
                    "stock": {"us": 1.0}, "fraction": 0.5,
                    "roofline": {"bytes": rb["total"], "distinct_experts": distinct, "distinct_experts_stock": None}}
            cells.append(add_stock_roofline(cell, tiny, 1))
    ours.close()
    assert [(c["batch"], c["context"]) for c in cells] == [(b, c) for c in contexts for b in batches]
    assert all(c["roofline_stock"]["bytes"] > 0 and c["stock_fraction"] is not None for c in cells)


@pytest.mark.interpreter_driver
@pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (its interpreter runs the kernels on the CPU)")
def test_cpu_cases_under_the_interpreter():
    """The DSA stand-in kernels, the stock DSA + MoE layer and the tiny bench cells on the CPU (Triton interpreter,
    child process)."""
    run_interpreted("tests/models/glm53/test_glm53_bench.py", min_passed=16)


def test_tiny_kinds_are_the_full_kinds():
    """The tiny spec's layers 6 and 3 are the same sorts of layer as the full spec's (as the interpreter cases need)."""
    adapter, tiny, kinds = _tiny_kinds()
    full = adapter.spec("full")
    for bk in kinds.values():
        assert tiny.layers[bk.layer].kind == full.layers[bk.layer].kind
        assert (bk.layer in tiny.indexer_layers()) == (bk.layer in full.indexer_layers())
