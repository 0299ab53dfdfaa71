"""attention.gqa.triton_splitkv on the GPU: bf16 at Muse Spark TP8 and Qwen3-30B TP1 shapes, CUDA graphs.

Every case: fresh random inputs, ``out`` poisoned with NaN, every cache row that no live position reads
poisoned with NaN (block tails, unused blocks, positions before a sliding window, the new tokens' slots
before the write), -1 / garbage block ids past each sequence's end and before its window, shuffled
blocks, padding rows (seq_lens 0, slot -1) among live rows; bf16 tolerance against the fp32 reference
(``gqa_decode_reference``: fp32 math, one rounding); the caches written at exactly the live slots, bit
for bit. A captured call replays for new seq_lens / slot_mapping / cache contents / q bit-identically to
the eager call. ``test_timing_figures`` measures (never asserts) the call at the notes' cells and writes
them to ``$LS_RESULTS_DIR/gqa_decode_triton_timing.json`` when that is set.
Run on the H200: ``pytest -m gpu tests/ops/test_gqa_triton_gpu.py`` (timing: ``-k timing -s``).
"""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch

from latency_specialized.hardware import roofline_bandwidth
from latency_specialized.kernels import gqa_decode_triton as gk
from latency_specialized.ops.attention.gqa import gqa_decode_paged, gqa_decode_reference

from gpu_helpers import seeded_generator as _gen

pytestmark = pytest.mark.gpu

DEV = "cuda"
MUSE_TP8 = dict(Hq=16, KV=2, D=64)
QWEN3_TP1 = dict(Hq=32, KV=4, D=128)
GARBAGE = 2 ** 30


def _case(seed, lens, *, Hq, KV, D, bs, window=None, sinks=True, dtype=torch.bfloat16, per=None, poison=True):
    g = _gen(seed)
    M = len(lens)
    per = per or -(-max(max(lens), 1) // bs) + 2
    nb = M * per + 5
    kv = torch.randn(2, nb, bs, KV, D, generator=g, device=DEV).to(dtype)      # vLLM's layout: two halves
    kc, vc = kv[0], kv[1]
    blocks = torch.randperm(nb, generator=g, device=DEV)[:M * per].view(M, per).to(torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    last = (lens_t.long() - 1).clamp(min=0)
    slots = torch.where(lens_t > 0, blocks.long().gather(1, (last // bs)[:, None])[:, 0] * bs + last % bs, -1)
    lo = (lens_t.long() - window).clamp(min=0) if window else torch.zeros_like(lens_t, dtype=torch.long)
    if poison:
        pos = torch.arange(per * bs, device=DEV)
        live = (pos[None, :] < lens_t[:, None] - 1) & (pos[None, :] >= lo[:, None])          # read, not written
        read = torch.zeros(nb * bs, dtype=torch.bool, device=DEV)
        read[(blocks.long()[:, pos // bs] * bs + pos % bs)[live]] = True
        for c in (kc, vc):
            c.view(-1, KV, D)[~read] = float("nan")
    used = (lens_t.long() + bs - 1) // bs
    j = torch.arange(per, device=DEV)[None, :]
    garbage = torch.where(torch.arange(M, device=DEV)[:, None] % 2 == 1, -1, GARBAGE).to(torch.int32)
    blocks = torch.where(j >= used[:, None], garbage, blocks)
    blocks = torch.where(j < (lo // bs)[:, None], GARBAGE, blocks)                 # wholly before the window
    qkv = torch.randn(M, (Hq + 2 * KV) * D + 8, generator=g, device=DEV).to(dtype)  # the piece's column slices
    q = qkv[:, :Hq * D].view(M, Hq, D)
    k = qkv[:, Hq * D:(Hq + KV) * D].view(M, KV, D)
    v = qkv[:, (Hq + KV) * D:(Hq + 2 * KV) * D].view(M, KV, D)
    kw = dict(window=window, k=k, v=v, slot_mapping=slots)
    if sinks:
        kw["sinks"] = torch.randn(Hq, generator=g, device=DEV) + 1.0
    return [q, kc, vc, blocks, lens_t], kw


def _tol(dtype):
    return dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def _check(args, kw, **call):
    q, kc, vc, blocks, seq_lens = args
    before = (kc.clone(), vc.clone())
    ref_c, tri_c = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
    want = gqa_decode_reference(q, *ref_c, blocks, seq_lens, **kw)
    out = torch.full(q.shape, float("nan"), device=DEV, dtype=q.dtype)
    got = gk.gqa_decode_triton(q, *tri_c, blocks, seq_lens, out=out, **kw, **call)
    torch.cuda.synchronize()
    assert got is out and not torch.isnan(out).any(), "output left unwritten or NaN leaked"
    tol = _tol(kc.dtype)
    scale = want.float().abs().max().item() + 1e-6
    torch.testing.assert_close(got.float(), want.float(), rtol=tol["rtol"], atol=tol["atol"] * scale)
    pad = seq_lens == 0
    assert torch.equal(got[pad], torch.zeros_like(got[pad])), "padding rows must be exact zeros"
    slots = kw["slot_mapping"]
    live = slots[slots >= 0]
    KV, D = kc.shape[2:]
    changed = torch.zeros(kc.shape[0] * kc.shape[1], dtype=torch.bool, device=DEV)
    changed[live] = True
    for c, c0, c_ref, new in zip(tri_c, before, ref_c, (kw["k"], kw["v"])):
        flat, flat0 = c.reshape(-1, KV, D), c0.reshape(-1, KV, D)
        torch.testing.assert_close(flat[~changed], flat0[~changed], rtol=0, atol=0, equal_nan=True)
        assert torch.equal(flat[live], new[slots >= 0].to(c.dtype))
        torch.testing.assert_close(c, c_ref, rtol=0, atol=0, equal_nan=True)
    return got


LENS = {
    "B1": [1],
    "B1_4k": [4096],
    "B5": [0, 3000, 7, 1, 0],
    "B64": [(37 * i) % 4099 for i in range(64)],
    "long": [32768, 1, 0, 20001],
}


@pytest.mark.parametrize("lens", list(LENS), ids=list(LENS))
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("window", [None, 2048], ids=["full", "w2048"])
def test_muse_tp8_matches_reference_bf16(lens, bs, window):
    args, kw = _case(f"muse-{lens}-{bs}-{window}", LENS[lens], bs=bs, window=window, **MUSE_TP8)
    _check(args, kw)


@pytest.mark.parametrize("lens", ["B1", "B5", "B64", "long"])
@pytest.mark.parametrize("sinks", [False, True], ids=["nosink", "sinks"])
def test_qwen3_matches_reference_bf16(lens, sinks):
    args, kw = _case(f"qwen3-{lens}-{sinks}", LENS[lens], bs=16, sinks=sinks, **QWEN3_TP1)
    _check(args, kw)


@pytest.mark.parametrize("splits", [1, 2, 7, 64, 256])
@pytest.mark.parametrize("window", [None, 1000], ids=["full", "w1000"])
def test_forced_splits(splits, window):
    args, kw = _case(f"splits{splits}-{window}", [0, 4000, 129, 64, 65, 1], bs=16, window=window, **MUSE_TP8)
    _check(args, kw, num_splits=splits)


@pytest.mark.parametrize("pdl,early,d_block,fused", [(False, False, 0, 0), (True, True, 0, 0), (True, False, 16, 0),
                                                     (True, True, 16, 0), (False, False, 16, 256)],
                         ids=["nopdl", "early", "d16", "early-d16", "fused"])
@pytest.mark.parametrize("splits", [2, 16, 132])
def test_merge_variants(monkeypatch, pdl, early, d_block, fused, splits):
    """The merge's variants the A/B times (``gqa_sweep.py merge``): without PDL, triggered as the split programs
    start (``EARLY_TRIGGER``), in 16-column blocks (``MERGE_D_BLOCK``), in the split kernel's last program
    (``FUSED_MERGE_MAX_SPLITS``, here up to 132 splits): the output against the reference; the lse against the
    one-split call's (no merge: the split kernel normalises); a CUDA graph replay behind a busy kernel
    bit-identical to the eager call (the fused merge's arrival counters left at zero by every call)."""
    monkeypatch.setattr(gk, "MERGE_PDL", pdl)
    monkeypatch.setattr(gk, "EARLY_TRIGGER", early)
    monkeypatch.setattr(gk, "MERGE_D_BLOCK", d_block)
    monkeypatch.setattr(gk, "FUSED_MERGE_MAX_SPLITS", fused)
    lens = [0, 4000, 129, 64, 65, 1, 3000, 2049]
    args, kw = _case(f"merge-{pdl}-{early}-{d_block}-{fused}-{splits}", lens, bs=16, **MUSE_TP8)
    _check(args, kw, num_splits=splits)
    q, kc, vc, blocks, seq_lens = args
    M, Hq = len(lens), MUSE_TP8["Hq"]
    lse_direct, lse = (torch.full((M, Hq), float("nan"), device=DEV) for _ in range(2))
    gk.gqa_decode_triton(q, kc.clone(), vc.clone(), blocks, seq_lens, num_splits=1, lse=lse_direct, **kw)
    caches = (kc.clone(), vc.clone())
    eager = gk.gqa_decode_triton(q, *caches, blocks, seq_lens, num_splits=splits, lse=lse, **kw)
    torch.cuda.synchronize()
    fin = torch.isfinite(lse_direct)
    assert torch.equal(fin, torch.isfinite(lse))
    torch.testing.assert_close(lse[0], kw["sinks"].float(), rtol=1e-6, atol=1e-6)   # no position: the sink alone
    torch.testing.assert_close(lse[fin], lse_direct[fin], rtol=1e-5, atol=1e-5)
    out = torch.full_like(eager, float("nan"))
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gk.gqa_decode_triton(q, *caches, blocks, seq_lens, num_splits=splits, out=out, **kw)   # warm-up
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        gk.gqa_decode_triton(q, *caches, blocks, seq_lens, num_splits=splits, out=out, **kw)
    out.fill_(float("nan"))
    torch.cuda._sleep(1_000_000)   # a busy predecessor: the early-launched merge must still wait for the splits
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    if fused:
        counters = gk.arrival_counters(M * MUSE_TP8["KV"], q.device)
        assert torch.equal(counters, torch.zeros_like(counters))
        out.fill_(float("nan"))
        graph.replay()   # again: the counters the first replay reset
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.parametrize("D", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_head_dims_and_dtypes(D, dtype):
    """Every head_dim the support rule admits, bf16 / fp16 / fp32 (fp32: IEEE dots, an fp32 tolerance)."""
    args, kw = _case(f"dims{D}-{dtype}", [0, 1500, 33, 1, 700], Hq=12, KV=4, D=D, bs=16, window=900, dtype=dtype)
    _check(args, kw)
    _check(args, kw, num_splits=5)


def test_separate_write_kernel():
    args, kw = _case("separate", LENS["B5"], bs=16, window=2048, **MUSE_TP8)
    _check(args, kw, fused_write=False)
    _check(args, kw, fused_write=False, num_splits=7)


@pytest.mark.parametrize("splits", [1, 16, 64])
def test_fused_write_never_reads_the_new_token_from_memory(monkeypatch, splits):
    """The fused write's stores left out (``_STORE_NEW``): the result is still right and the new slots keep
    their NaN, so with real concurrency no program reads the slot the split-0 program is writing."""
    monkeypatch.setattr(gk, "_STORE_NEW", False)
    args, kw = _case(f"nostore{splits}", [4000, 1, 0, 2049, 64], bs=16, **MUSE_TP8)
    q, kc, vc, blocks, lens = args
    want = gqa_decode_reference(q, kc.clone(), vc.clone(), blocks, lens, **kw)
    c = (kc.clone(), vc.clone())
    got = gk.gqa_decode_triton(q, *c, blocks, lens, num_splits=splits, **kw)
    torch.cuda.synchronize()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max().item())
    slots = kw["slot_mapping"]
    for cache in c:
        assert torch.isnan(cache.view(-1, *cache.shape[2:])[slots[slots >= 0]]).all()


def test_equals_torch_paged():
    """The sync-free torch composition it replaces in graphs, on a table without garbage ids (torch_paged
    reads every id of the table, clamping negatives)."""
    args, kw = _case("paged", LENS["B5"], bs=16, window=2048, **MUSE_TP8)
    args[3] = torch.where(args[3] >= args[1].shape[0], -1, args[3])
    c1, c2 = (args[1].clone(), args[2].clone()), (args[1].clone(), args[2].clone())
    a = gqa_decode_paged(args[0], *c1, *args[3:], **kw)
    b = gk.gqa_decode_triton(args[0], *c2, *args[3:], **kw)
    torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2 * a.float().abs().max().item())
    torch.testing.assert_close(c1[0], c2[0], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape,window", [(MUSE_TP8, None), (MUSE_TP8, 2048), (QWEN3_TP1, None)],
                         ids=["muse_full", "muse_w2048", "qwen3"])
@pytest.mark.parametrize("fused_write", [True, False], ids=["fused_write", "write_kernel"])
def test_graph_replay_equals_eager(shape, window, fused_write):
    """Capture once (static shapes: split count from the table width); new seq_lens / slots / caches / q /
    k / v in the static buffers, from 1 token to the table's capacity; replay == eager bit for bit, and right."""
    bs, per = 16, 300                                  # 4800-token table
    a0, kw0 = _case("graph0", [0, 2500, 7, 4000, 1], bs=bs, per=per, window=window, **shape)
    static = [t.clone() for t in a0]
    wide = torch.cat([a0[0].flatten(1), kw0["k"].flatten(1), kw0["v"].flatten(1)], -1)   # keep the views strided
    Hq, KV, D = shape["Hq"], shape["KV"], shape["D"]
    sq, sk, sv = wide[:, :Hq * D].view(-1, Hq, D), wide[:, Hq * D:(Hq + KV) * D].view(-1, KV, D), \
        wide[:, (Hq + KV) * D:].view(-1, KV, D)
    sq.copy_(a0[0])
    static[0] = sq
    slots, sinks = kw0["slot_mapping"].clone(), kw0["sinks"].clone()
    out = torch.empty_like(a0[0])

    def call():
        gk.gqa_decode_triton(*static, window=window, sinks=sinks, k=sk, v=sv, slot_mapping=slots, out=out,
                             fused_write=fused_write)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()                                          # compile + warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for seed, lens in (("graph1", [3000, 0, 1, 4800, 64]), ("graph2", [1, 1, 0, 0, 4799]),
                       ("graph3", [2049, 2048, 2047, 17, 4000])):
        a, kw = _case(seed, lens, bs=bs, per=per, window=window, **shape)
        for dst, src in zip(static, a):
            dst.copy_(src)
        sk.copy_(kw["k"])
        sv.copy_(kw["v"])
        slots.copy_(kw["slot_mapping"])
        sinks.copy_(kw["sinks"])
        eager_c = (a[1].clone(), a[2].clone())
        eager = gk.gqa_decode_triton(a[0], *eager_c, *a[3:], fused_write=fused_write, **kw)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"{seed}: replay != eager"
        torch.testing.assert_close(static[1], eager_c[0], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(static[2], eager_c[1], rtol=0, atol=0, equal_nan=True)
        _check(a, kw)                                    # and both are right


# ----------------------------------------------------------------------------------- timing (no assertion)
TIMING_CELLS = [  # (label, shape, batch, context, window)
    *[("muse_tp8", MUSE_TP8, b, 32768, None) for b in (1, 8, 16, 32, 64)],
    *[("muse_tp8", MUSE_TP8, b, 4096, None) for b in (1, 8, 64)],
    *[("muse_tp8_w2048", MUSE_TP8, b, 32768, 2048) for b in (1, 8, 64)],
    *[("qwen3_tp1", QWEN3_TP1, b, 32768, None) for b in (1, 8, 64)],
    ("qwen3_tp1", QWEN3_TP1, 1, 4096, None),
]
ROTATE_BYTES = 150e6
"""Input sets rotate until their KV bytes exceed 2.5 x the 60 MB L2 (PERF.md): HBM, not cache."""


def graph_cell(shape, batch, context, window, *, bs=16):
    """A CUDA graph of the call over ``sets`` input sets rotated past the L2 (distinct caches, tables, q): what
    ``_time_cell`` times and ``benchmarks/scripts/gqa_profile.py`` profiles. Returns (graph, sets, KV bytes a call,
    block-table width in blocks, the tensors the graph reads)."""
    Hq, KV, D = shape["Hq"], shape["KV"], shape["D"]
    read = min(context, window) if window else context
    cell_bytes = gk.kv_bytes(batch, read, KV, D)
    sets = max(2, min(64, -(-int(ROTATE_BYTES) // cell_bytes)))
    per = -(-context // bs)
    nb = sets * batch * per + 1
    g = _gen(f"timing-{batch}-{context}-{D}")
    kv = torch.randn(2, nb, bs, KV, D, generator=g, device=DEV, dtype=torch.bfloat16)   # up to 8.6 GB (Qwen3 M 64)
    perm = torch.randperm(nb - 1, generator=g, device=DEV).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEV)
    inputs = []
    for i in range(sets):
        bt = perm[i * batch * per:(i + 1) * batch * per].view(batch, per)
        last = context - 1
        slots = bt[:, last // bs].long() * bs + last % bs
        inputs.append(dict(q=torch.randn(batch, Hq, D, generator=g, device=DEV).to(torch.bfloat16),
                           k=torch.randn(batch, KV, D, generator=g, device=DEV).to(torch.bfloat16),
                           v=torch.randn(batch, KV, D, generator=g, device=DEV).to(torch.bfloat16),
                           bt=bt, slots=slots, out=torch.empty(batch, Hq, D, device=DEV, dtype=torch.bfloat16)))
    sinks = torch.randn(Hq, generator=g, device=DEV)

    def call_all():
        for d in inputs:
            gk.gqa_decode_triton(d["q"], kv[0], kv[1], d["bt"], lens, window=window, sinks=sinks, k=d["k"],
                                 v=d["v"], slot_mapping=d["slots"], out=d["out"])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call_all()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call_all()
    return graph, sets, cell_bytes, per, (kv, inputs)


def _time_cell(shape, batch, context, window, *, bs=16, groups=11):
    KV = shape["KV"]
    graph, sets, cell_bytes, per, held = graph_cell(shape, batch, context, window, bs=bs)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(groups):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(5):
            graph.replay()
        e1.record()
        e1.synchronize()
        per_call.append(e0.elapsed_time(e1) * 1000.0 / (5 * sets))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = gk.choose_num_splits(batch, KV, gk.span(per * bs, window), sms)
    us = statistics.median(per_call)
    floor = cell_bytes / roofline_bandwidth() * 1e6
    del graph, held
    torch.cuda.empty_cache()
    return dict(us=us, runs_us=per_call, floor_us=floor, roofline=floor / us, bytes=cell_bytes, sets=sets,
                num_splits=splits, kernels=1 if splits == 1 or gk.fused_merge(splits) else 2)


def test_timing_figures():
    """Not a speed assertion: median us per call (CUDA events over graph replays, inputs rotated past the
    L2) at the cells of NOTES_gqa.md, printed, and written to $LS_RESULTS_DIR/gqa_decode_triton_timing.json
    when that is set. Every variant timed twice (two passes)."""
    rows = []
    for label, shape, batch, context, window in TIMING_CELLS:
        runs = [_time_cell(shape, batch, context, window) for _ in range(2)]
        row = dict(cell=label, **shape, batch=batch, context=context, window=window or 0,
                   us=[r["us"] for r in runs], roofline=[r["roofline"] for r in runs],
                   **{k: runs[0][k] for k in ("floor_us", "bytes", "sets", "num_splits", "kernels")})
        rows.append(row)
        print(f"{label} B={batch} ctx={context} w={window}: {row['us'][0]:.2f} / {row['us'][1]:.2f} us, "
              f"floor {row['floor_us']:.2f} us, roofline {row['roofline'][0]:.0%} / {row['roofline'][1]:.0%}, "
              f"{row['num_splits']} splits", flush=True)
    out_dir = os.environ.get("LS_RESULTS_DIR")
    if out_dir:
        p = torch.cuda.get_device_properties(0)
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "gqa_decode_triton_timing.json"), "w") as f:
            json.dump({"device": p.name, "sms": p.multi_processor_count, "torch": torch.__version__,
                       "roofline_bytes_per_s": roofline_bandwidth(), "rows": rows}, f, indent=1)
