"""Sparse MQA decode (DeepSeek-V4.1-Flash attention between its projections) on the GPU: ours vs the torch
reference vs the stock stand-in.

    python benchmarks/scripts/sparse_mqa_bench.py --out benchmarks/results/h200

For each batch M (default 1, 8, 64) at ``--context`` tokens per sequence: a bf16 window ring (W = 128, full),
a paged compressed cache of ``context // ratio`` rows per sequence (blocks shuffled) and per sequence a random
selection of ``--topk`` distinct complete rows, as the indexer hands it over; the raw q [M, H, D], the new kv
row, fp32 sinks. Checks first, for every cell: ``attention.sparse_mqa.triton`` against
``sparse_mqa_decode_reference`` (max error relative to the output scale, bf16 tolerance 2e-2; the rings they
wrote equal to one bf16 ulp); a failing cell is not timed and the script exits 1. The stock stand-in's output is
compared too (reported, not gating). Then times, each captured into a CUDA graph of ``calls`` back-to-back calls
over distinct rings, caches and selections (at least ``--rotate-mb`` read per graph, so that the L2 cannot hold
what a call reads), CUDA events around each replay, median of ``--reps`` replays after warm-up
(``latency_specialized.bench.ops_bench_moe_kda.time_graph``), per call:

* ``ours``: ``attention.sparse_mqa.triton`` (split + combine: 2 launches; head norm, RoPE, ring write inside);
* ``torch``: the family's reference (the torch composition the piece ran before), as ``attention.sparse_mqa.torch``;
* ``stock``: ``bench/stock/sparse_mqa_kernels.py``'s ``qnorm_rope_kv_insert`` + ``sparse_mqa_decode`` (3 launches,
  fed physical rows), and ``stock_convert``: the same plus ``dsa_kernels.convert_topk`` (positions -> physical
  rows + counts, what a stock step runs in front of it: 4 launches).

Then (unless ``--no-compress``) the KV source's compressor at the same batches: ``attention.sparse_mqa_compress.triton``
(1 launch) vs its torch reference vs the stock stand-in ``compress_insert``, every token completing a row, 32 calls
over distinct pending rows / caches per graph (a few KB per token: L2-resident whatever the rotation), checked
against the reference first.

Roofline: ``bytes / --bw`` with bytes = M x (W + topk) x D x 2 (the rows read) + M x topk x 4 (the selection)
+ M x H x D x 2 x 2 (q in, o out). Defaults are DeepSeek-V4.1-Flash TP8 (8 local heads, D 512, rope 64, W 128,
top-512, ratio 2, block 64). Writes ``sparse_mqa{tag}.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from latency_specialized.bench.ops_bench_moe_kda import time_graph  # noqa: E402 (after the path set-up)
from latency_specialized.hardware import roofline_bandwidth  # noqa: E402

TOLERANCE = 2e-2
"""Max error relative to the output scale (bf16 against the fp32-math reference)."""
EPS = 1e-6


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30)).item()


def _inputs(M: int, a, n: int, g: torch.Generator):
    """``n`` (ring, cache, selection) triples of one shape, and the per-call tensors they share."""
    H, D, W, K, bs, r = a.heads, a.head_dim, a.window, a.topk, a.block_size, a.ratio
    dev, bf = "cuda", torch.bfloat16
    n_c = a.context // r                                           # complete compressed rows per sequence
    per = -(-n_c // bs)
    nb = M * per
    rings = [torch.randn(M + 1, W, D, device=dev, generator=g).to(bf) for _ in range(n)]
    caches = [torch.randn(nb, bs, D, device=dev, generator=g).to(bf) for _ in range(n)]
    sels = []
    for _ in range(n):
        score = torch.rand(M, n_c, device=dev, generator=g)
        kk = min(K, n_c)
        sel = torch.topk(score, kk, dim=1).indices
        if kk < K:
            sel = torch.cat([sel, sel.new_full((M, K - kk), -1)], dim=1)
        sels.append(sel.to(torch.int32).contiguous())
    bt = torch.randperm(nb, device=dev, generator=g).view(M, per).to(torch.int32)
    seq = torch.full((M,), a.context, dtype=torch.int32, device=dev)
    pos = (seq - 1).long()
    rows = torch.arange(1, M + 1, dtype=torch.int32, device=dev)
    q = (3 * torch.randn(M, H, D, device=dev, generator=g) + 0.5).to(bf)
    kv = torch.randn(M, D, device=dev, generator=g).to(bf)
    sinks = torch.randn(H, device=dev, generator=g)
    return rings, caches, sels, bt, seq, pos, rows, q, kv, sinks


def _compress_cells(a, g: torch.Generator, timed) -> list[dict]:
    """The compressor rows of the report (module docstring)."""
    from latency_specialized.bench.stock import sparse_mqa_kernels as sk
    from latency_specialized.kernels import sparse_mqa_triton as smq
    from latency_specialized.ops.attention.sparse_mqa import slot_of, sparse_mqa_compress_reference
    from latency_specialized.ops.rope import rope_inv_freq

    D, r, bs, calls, bf = a.head_dim, a.ratio, a.block_size, 32, torch.bfloat16
    inv = rope_inv_freq(10_000.0, a.rope, device="cuda")
    out_rows = []
    for M in _ints(a.batches):
        n_c = a.context // r
        per = -(-n_c // bs)
        bt = torch.randperm(M * per, device="cuda", generator=g).view(M, per).to(torch.int32)
        seq = torch.full((M,), a.context, dtype=torch.int32, device="cuda")
        pos = (seq - 1).long()
        rows = torch.arange(1, M + 1, dtype=torch.int32, device="cuda")
        width = 2 * D if r > 1 else D
        cs = [torch.randn(M, width, device="cuda", generator=g).to(bf) for _ in range(calls)]
        pends = [torch.randn(M + 1, r, 2 * D, device="cuda", generator=g).to(bf) if r > 1 else None
                 for _ in range(calls)]
        caches = [torch.randn(M * per, bs, D, device="cuda", generator=g).to(bf) for _ in range(calls)]
        norm_w = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(bf)
        seq_l = seq.long()
        slots = slot_of(bt, seq_l // r - 1, bs, (seq_l % r == 0) & (seq_l > 0))
        kw = dict(eps=EPS, ratio=r)
        p_ref = None if pends[0] is None else pends[0].clone()
        p_tri = None if pends[0] is None else pends[0].clone()
        c_ref, c_tri = caches[0].clone(), caches[0].clone()
        want = sparse_mqa_compress_reference(cs[0], p_ref, rows, pos, norm_w, inv, c_ref, slots, **kw)
        got = smq.sparse_mqa_compress_triton(cs[0], p_tri, rows, pos, norm_w, inv, c_tri, slots, **kw)
        rel = _rel_err(got, want)
        ok = rel <= TOLERANCE and bool(torch.allclose(c_ref.float(), c_tri.float(), rtol=2 ** -7, atol=1e-6))
        row = dict(M=M, ratio=r, max_rel_err=float(f"{rel:.3g}"), correct=ok)
        out_rows.append(row)
        if not ok:
            print(f"compressor M={M}: WRONG (rel err {rel:.3g}): not timed", flush=True)
            continue
        lats = [torch.empty(M, D, device="cuda", dtype=bf) for _ in range(calls)]
        ours = timed(lambda i: smq.sparse_mqa_compress_triton(cs[i], pends[i], rows, pos, norm_w, inv, caches[i],
                                                              slots, out=lats[i], **kw), calls, a.reps)
        ref = timed(lambda i: sparse_mqa_compress_reference(cs[i], pends[i], rows, pos, norm_w, inv, caches[i], slots,
                                                            out=lats[i], **kw), 8, max(5, a.reps // 4))
        stock = timed(lambda i: sk.compress_insert(cs[i], pends[i], rows, pos, norm_w, inv, caches[i], bt, r, EPS,
                                                   lat=lats[i]), calls, a.reps)
        row.update(ours_us=round(ours, 2), torch_us=round(ref, 1), stock_us=round(stock, 2))
        print(f"compressor M={M:3d}: ours {ours:6.2f} us  torch {ref:7.1f} us  stock {stock:6.2f} us  "
              f"rel err {rel:.2e}", flush=True)
    return out_rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/h200", help="where sparse_mqa{tag}.{json,md} go")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--ratio", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=25, help="timed replays per graph (median)")
    ap.add_argument("--rotate-mb", type=float, default=200.0, help="bytes read per graph at least (L2 is 50 MB)")
    ap.add_argument("--max-calls", type=int, default=320, help="calls (distinct rings / caches) per graph at most")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch reference timing")
    ap.add_argument("--no-compress", action="store_true", help="skip the compressor timing")
    ap.add_argument("--bw", type=float, default=None,
                    help="roofline bandwidth, bytes/s (default: this device's, hardware.roofline_bandwidth())")
    ap.add_argument("--tag", default="", help="suffix of the output file names (sweeps)")
    ap.add_argument("--waves", type=int, default=None, help="override sparse_mqa_triton.WAVES")
    ap.add_argument("--tile-bytes", type=int, default=None, help="override sparse_mqa_triton.TILE_BYTES")
    ap.add_argument("--num-stages", type=int, default=None, help="override sparse_mqa_triton.NUM_STAGES")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sparse_mqa_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    a.bw = a.bw or roofline_bandwidth()

    from latency_specialized.bench.machine import machine_info
    from latency_specialized.bench.stock import dsa_kernels as dk
    from latency_specialized.bench.stock import sparse_mqa_kernels as sk
    from latency_specialized.kernels import sparse_mqa_triton as smq
    from latency_specialized.ops.attention.sparse_mqa import sparse_mqa_decode_reference
    from latency_specialized.ops.rope import rope_inv_freq

    for flag, const in (("waves", "WAVES"), ("tile_bytes", "TILE_BYTES"), ("num_stages", "NUM_STAGES")):
        if getattr(a, flag) is not None:
            setattr(smq, const, getattr(a, flag))
    tuning = {k: getattr(smq, k) for k in ("TILE_BYTES", "SINGLE_ROW_TILE_BYTES", "WAVES", "MAX_SPLITS", "NUM_STAGES",
                                           "MIN_BLOCK_H", "MAX_BLOCK_H", "COMBINE_TILE")}
    H, D, R, W, K, r = a.heads, a.head_dim, a.rope, a.window, a.topk, a.ratio
    inv = rope_inv_freq(10_000.0, R, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    t_start = time.time()
    print(f"sparse_mqa_bench: H={H} D={D} R={R} W={W} K={K} ratio={r} context={a.context} {tuning}", flush=True)
    rows_out, failed = [], False
    g = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(scale=D ** -0.5, compress_ratio=r, q_norm_eps=EPS)

    def timed(step, calls: int, reps: int) -> float:
        return time_graph(step, calls, replays=reps, warmup=3, sync_each=True)

    for M in _ints(a.batches):
        read = M * (W + K) * D * 2 + M * K * 4
        bytes_total = read + M * H * D * 2 * 2
        calls = max(1, min(a.max_calls, math.ceil(a.rotate_mb * 1e6 / read)))
        rings, caches, sels, bt, seq, pos, srows, q, kv, sinks = _inputs(M, a, calls, g)
        seq_c = (seq // r).to(torch.int32)
        splits = smq.choose_splits(M, W + K, -(-H // smq.block_h(H)), sms, smq.block_n(D, 2, M))
        # correctness first (outside any graph)
        ring_ref, ring_tri = rings[0].clone(), rings[0].clone()
        want = sparse_mqa_decode_reference(q, kv, pos, srows, seq, ring_ref, caches[0], bt, sels[0], sinks, inv, **kw)
        got = smq.sparse_mqa_decode_triton(q, kv, pos, srows, seq, ring_tri, caches[0], bt, sels[0], sinks, inv, **kw)
        rel = _rel_err(got, want)
        ring_ok = bool(torch.allclose(ring_ref.float(), ring_tri.float(), rtol=2 ** -7, atol=1e-6))
        # the stock stand-in on its own inputs: physical rows, q normed + roped in place, [G = 1, M, H D] out
        crow = torch.empty(M, K, dtype=torch.int32, device="cuda")
        cnt = torch.empty(M, dtype=torch.int32, device="cuda")
        dk.convert_topk(sels[0], bt, seq_c, a.block_size, rows=crow, counts=cnt)
        q_st, ring_st = q.clone(), rings[0].clone()
        o_st = torch.empty(1, M, H * D, device="cuda", dtype=torch.bfloat16)
        sk.qnorm_rope_kv_insert(q_st, kv, pos, inv, ring_st, srows, EPS)
        sk.sparse_mqa_decode(q_st, ring_st, srows, seq, caches[0], crow, cnt, sinks, pos, inv, groups=1, out=o_st)
        rel_stock = _rel_err(o_st[0].view(M, H, D), want)
        del ring_ref, ring_tri, ring_st
        ok = rel <= TOLERANCE and ring_ok
        row = dict(M=M, context=a.context, topk=K, read_MB=round(read / 1e6, 3),
                   roofline_us=round(bytes_total / a.bw * 1e6, 2), max_rel_err=float(f"{rel:.3g}"),
                   max_rel_err_stock=float(f"{rel_stock:.3g}"), ring_ok=ring_ok, num_splits=splits,
                   calls_per_graph=calls, correct=ok)
        if not ok:
            failed = True
            print(f"M={M}: WRONG (rel err {rel:.3g}, ring {'ok' if ring_ok else 'DIFFERS'}): not timed", flush=True)
            rows_out.append(row)
            continue
        outs = [torch.empty(M, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(calls)]
        ours = timed(lambda i: smq.sparse_mqa_decode_triton(q, kv, pos, srows, seq, rings[i], caches[i], bt, sels[i],
                                                            sinks, inv, out=outs[i], **kw), calls, a.reps)
        torch_us = None
        if not a.no_torch:
            tc = min(calls, 8)
            torch_us = timed(lambda i: sparse_mqa_decode_reference(q, kv, pos, srows, seq, rings[i], caches[i], bt,
                                                                   sels[i], sinks, inv, out=outs[i], **kw),
                             tc, max(5, a.reps // 4))
        crows = [torch.empty(M, K, dtype=torch.int32, device="cuda") for _ in range(calls)]
        for i in range(calls):
            dk.convert_topk(sels[i], bt, seq_c, a.block_size, rows=crows[i], counts=cnt)
        q_bufs = [q.clone() for _ in range(calls)]
        o_sts = [torch.empty(1, M, H * D, device="cuda", dtype=torch.bfloat16) for _ in range(calls)]

        def stock(i, convert=False):
            if convert:
                dk.convert_topk(sels[i], bt, seq_c, a.block_size, rows=crows[i], counts=cnt)
            sk.qnorm_rope_kv_insert(q_bufs[i], kv, pos, inv, rings[i], srows, EPS)
            sk.sparse_mqa_decode(q_bufs[i], rings[i], srows, seq, caches[i], crows[i], cnt, sinks, pos, inv, groups=1,
                                 out=o_sts[i])

        stock_us = timed(stock, calls, a.reps)
        stock_conv_us = timed(lambda i: stock(i, True), calls, a.reps)
        roof = row["roofline_us"]
        row.update(ours_us=round(ours, 2), pct_roofline=round(100 * roof / ours, 1),
                   torch_us=None if torch_us is None else round(torch_us, 1), stock_us=round(stock_us, 2),
                   stock_convert_us=round(stock_conv_us, 2), speedup_vs_stock=round(stock_us / ours, 2),
                   speedup_vs_stock_convert=round(stock_conv_us / ours, 2))
        rows_out.append(row)
        print(f"M={M:3d} read {row['read_MB']:7.2f} MB roof {roof:6.2f} us  ours {ours:6.2f} us "
              f"({row['pct_roofline']:5.1f}%)  torch {'-' if torch_us is None else f'{torch_us:7.1f} us'}  stock "
              f"{stock_us:6.2f} us (+convert {stock_conv_us:6.2f})  x{row['speedup_vs_stock']} splits {splits} "
              f"rel err {rel:.2e} (stock {rel_stock:.2e}) [{time.time() - t_start:.0f} s]", flush=True)
        del rings, caches, sels, outs, crows, q_bufs, o_sts
        torch.cuda.empty_cache()

    compress_rows = [] if a.no_compress else _compress_cells(a, g, timed)
    if any(not x["correct"] for x in compress_rows):
        failed = True
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(shape=dict(heads=H, head_dim=D, rope=R, window=W, topk=K, ratio=r, block_size=a.block_size,
                           context=a.context, dtype="bfloat16"),
                tuning=tuning, bandwidth=a.bw, reps=a.reps, tolerance=TOLERANCE, machine=machine_info())
    (out / f"sparse_mqa{a.tag}.json").write_text(json.dumps(dict(meta, rows=rows_out, compress=compress_rows),
                                                         indent=1))

    def cell(x):
        return "-" if x is None else f"{x}"

    lines = [f"# Sparse MQA decode: ours vs torch vs stock stand-in (H={H} D={D} R={R} W={W} top-{K} ratio {r}, "
             f"context {a.context}, bf16)", "",
             f"GPU {meta['machine']['gpu']}, torch {meta['machine']['torch']}, triton {meta['machine']['triton']}, "
             f"commit {meta['machine']['git_commit']}; roofline at {a.bw / 1e12:g} TB/s; tuning {tuning}", "",
             "ours: attention.sparse_mqa.triton (2 launches); torch: the family's reference; stock: "
             "qnorm_rope_kv_insert + sparse_mqa_decode (3 launches); stock+convert: with convert_topk in front (4). "
             "Every cell checked against the reference before timing.", "",
             "| M | read MB | roofline us | ours us | % roofline | torch us | stock us | stock+convert us | x stock | "
             "splits | max rel err (stock) | correct |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows_out:
        lines.append(f"| {x['M']} | {x['read_MB']} | {x['roofline_us']} | {cell(x.get('ours_us'))} | "
                     f"{cell(x.get('pct_roofline'))} | {cell(x.get('torch_us'))} | {cell(x.get('stock_us'))} | "
                     f"{cell(x.get('stock_convert_us'))} | {cell(x.get('speedup_vs_stock'))} | {x['num_splits']} | "
                     f"{x['max_rel_err']:.2e} ({x['max_rel_err_stock']:.2e}) | {'yes' if x['correct'] else 'NO'} |")
    if compress_rows:
        lines += ["", f"Compressor (ratio {r}, D={D}): ours = attention.sparse_mqa_compress.triton (1 launch), torch = "
                  "its reference, stock = compress_insert (1 launch).", "",
                  "| M | ours us | torch us | stock us | max rel err | correct |", "|---|---|---|---|---|---|"]
        for x in compress_rows:
            lines.append(f"| {x['M']} | {cell(x.get('ours_us'))} | {cell(x.get('torch_us'))} | "
                         f"{cell(x.get('stock_us'))} | {x['max_rel_err']:.2e} | {'yes' if x['correct'] else 'NO'} |")
    (out / f"sparse_mqa{a.tag}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / f'sparse_mqa{a.tag}.json'} and .md in {time.time() - t_start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
