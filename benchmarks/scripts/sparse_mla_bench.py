"""Sparse MLA decode (DSA top-k over a paged latent cache) on the GPU: ours vs torch_masked vs dense MLA.

    python benchmarks/scripts/sparse_mla_bench.py --out benchmarks/results/h200

For each (batch B, context): a bf16 latent cache of B sequences of ``context`` tokens (blocks in a shuffled
order), ``seq_lens = context``, and per sequence a random selection of ``--topk`` distinct positions (the new
token's among them) at random slots, as the indexer hands it over. Checks first, for every cell:
``attention.sparse_mla.triton_splitkv`` and ``attention.sparse_mla.torch_masked`` against
``sparse_mla_decode_reference`` (max error relative to the output scale, bf16 tolerance 2e-2; the caches
they wrote equal the reference's); a failing cell is not timed and the script exits 1. Then times, each
captured into a CUDA graph of ``calls`` back-to-back calls over distinct caches and selections (so that the
L2 cannot hold what a call reads: at least ``--rotate-mb`` read per graph), CUDA events around each replay,
median of ``--reps`` replays after warm-up (``latency_specialized.bench.ops_bench_moe_kda.time_graph``, the
MLA bench's timer), per call:

* ``triton_sparse``: ours (prologue, split kernel over the selection, merge + W_UV: 3 launches);
* ``torch_masked``: the sync-free torch composition of the same family;
* ``triton_dense``: ``attention.mla.triton_splitkv`` over the whole context (what the selection saves).

Roofline: ``bytes / --bw`` with bytes = B x K x (L + R) x 2 (the selected rows) + B x K x 4 (the selection)
+ H (nope + v) L x 2 (kv_b_proj). Defaults are GLM-5.3 TP8 (8 heads, kv_lora 512, rope 64, nope 192, v 256,
K 2048, block 64). Writes ``sparse_mla{tag}.json`` and ``.md`` into ``--out``. The tuning flags override
``kernels/mla_decode_triton.py``'s constants (shared with the dense kernel) for a sweep.
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
"""Max error relative to the output scale (bf16 against the fp32 reference)."""


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _selection(B: int, ctx: int, K: int, g: torch.Generator) -> torch.Tensor:
    """[B, K] int32: ``min(K, ctx)`` distinct random positions of [0, ctx) per row (ctx - 1 among them) at random
    slots, -1 in the rest (contexts shorter than K)."""
    score = torch.rand(B, ctx, device="cuda", generator=g)
    score[:, ctx - 1] = 2.0
    kk = min(K, ctx)
    sel = torch.topk(score, kk, dim=1).indices
    if kk < K:
        sel = torch.cat([sel, sel.new_full((B, K - kk), -1)], dim=1)
    return sel.gather(1, torch.rand(B, K, device="cuda", generator=g).argsort(dim=1)).to(torch.int32).contiguous()


def _inputs(B: int, ctx: int, a, n: int, g: torch.Generator):
    """``n`` (cache, selection) pairs of one shape, and the per-call tensors they share."""
    H, L, R, nope, v, bs = a.heads, a.kv_lora, a.rope, a.nope, a.v, a.block_size
    per = -(-ctx // bs)
    nb = B * per
    caches = [torch.randn(nb, bs, L + R, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(n)]
    sels = [_selection(B, ctx, a.topk, g) for _ in range(n)]
    blocks = torch.randperm(nb, device="cuda", generator=g).view(B, per).to(torch.int32)
    lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    p = ctx - 1
    slots = blocks[:, p // bs].long() * bs + p % bs
    q = torch.randn(B, H, nope + R, device="cuda", generator=g, dtype=torch.bfloat16)
    kv = torch.randn(B, L + R, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(H * (nope + v), L, device="cuda", generator=g) * L ** -0.5).to(torch.bfloat16)
    norm_w = (1.0 + 0.1 * torch.randn(L, device="cuda", generator=g)).to(torch.bfloat16)
    return caches, sels, (q, kv[:, :L], kv[:, L:]), blocks, lens, slots, w, norm_w


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30)).item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/h200", help="where sparse_mla{tag}.{json,md} go")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-lora", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--nope", type=int, default=192)
    ap.add_argument("--v", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=25, help="timed replays per graph (median)")
    ap.add_argument("--rotate-mb", type=float, default=200.0, help="bytes read per graph at least (L2 is 50 MB)")
    ap.add_argument("--max-calls", type=int, default=32, help="calls (distinct caches) per graph at most")
    ap.add_argument("--no-masked", action="store_true", help="skip torch_masked")
    ap.add_argument("--no-dense", action="store_true", help="skip the dense MLA kernel")
    ap.add_argument("--bw", type=float, default=None,
                    help="roofline bandwidth, bytes/s (default: this device's, hardware.roofline_bandwidth())")
    ap.add_argument("--tag", default="", help="suffix of the output file names (sweeps)")
    ap.add_argument("--block-n", type=int, default=None)
    ap.add_argument("--min-chunk", type=int, default=None)
    ap.add_argument("--min-chunk-small", type=int, default=None, help="SPARSE_MIN_CHUNK_SMALL_BATCH (batch <= 2)")
    ap.add_argument("--waves", type=int, default=None)
    ap.add_argument("--merge-l-tile", type=int, default=None, help="MERGE_L_TILE (0: the v-blocked merge everywhere)")
    ap.add_argument("--pdl", type=int, choices=(0, 1), default=None, help="PDL (programmatic dependent launch) off/on")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sparse_mla_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    a.bw = a.bw or roofline_bandwidth()

    from latency_specialized.bench.machine import machine_info
    from latency_specialized.kernels import mla_decode_triton as mk
    from latency_specialized.kernels.sparse_mla_triton import sparse_mla_decode_triton
    from latency_specialized.ops.attention.sparse_mla import sparse_mla_decode_masked, sparse_mla_decode_reference

    for flag, const in (("block_n", "BLOCK_N"), ("min_chunk", "MIN_CHUNK"),
                        ("min_chunk_small", "SPARSE_MIN_CHUNK_SMALL_BATCH"), ("waves", "WAVES"),
                        ("merge_l_tile", "MERGE_L_TILE"), ("pdl", "PDL")):
        if getattr(a, flag) is not None:
            setattr(mk, const, bool(getattr(a, flag)) if const == "PDL" else getattr(a, flag))
    tuning = {k: getattr(mk, k) for k in ("BLOCK_H", "BLOCK_N", "NUM_WARPS", "NUM_STAGES", "MIN_CHUNK",
                                          "SPARSE_MIN_CHUNK_SMALL_BATCH", "WAVES", "MAX_SPLITS", "MERGE_L_TILE", "PDL")}
    H, L, R, nope, v, K = a.heads, a.kv_lora, a.rope, a.nope, a.v, a.topk
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    t_start = time.time()
    print(f"sparse_mla_bench: H={H} L={L} R={R} nope={nope} v={v} K={K} block={a.block_size} {tuning}", flush=True)
    rows, failed = [], False
    g = torch.Generator(device="cuda").manual_seed(0)

    def timed(step, calls: int, reps: int) -> float:
        """Median us per call of a graph of ``calls`` calls ``step(r)`` (each replay waited for)."""
        return time_graph(step, calls, replays=reps, warmup=3, sync_each=True)

    for ctx in _ints(a.contexts):
        for B in _ints(a.batches):
            sel_bytes = B * K * (L + R) * 2 + B * K * 4
            bytes_total = sel_bytes + H * (nope + v) * L * 2
            calls = max(1, min(a.max_calls, math.ceil(a.rotate_mb * 1e6 / sel_bytes)))
            caches, sels, (q, kv_c, k_pe), blocks, lens, slots, w, norm_w = _inputs(B, ctx, a, calls, g)
            gate = None  # GLM-5.3 has no output gate
            kw = dict(qk_nope_head_dim=nope, v_head_dim=v, gate=gate, kv_norm_weight=norm_w, kv_norm_eps=1e-6)
            splits = mk.choose_sparse_splits(B, H, K, sms, mk.BLOCK_N)
            # correctness first (fp32 reference, host syncs: outside any graph)
            c_ref, c_tri, c_msk = caches[0].clone(), caches[0].clone(), caches[0].clone()
            want = sparse_mla_decode_reference(q, kv_c, k_pe, c_ref, slots, blocks, lens, w, sels[0], **kw)
            got = sparse_mla_decode_triton(q, kv_c, k_pe, c_tri, slots, blocks, lens, w, sels[0], **kw)
            rel = _rel_err(got, want)
            # the normed latent rounds once in each: equal caches up to that (compare the rows they wrote)
            cache_ok = bool(torch.allclose(c_ref.float(), c_tri.float(), rtol=2 ** -7, atol=0, equal_nan=True))
            rel_masked = None
            if not a.no_masked:
                masked = sparse_mla_decode_masked(q, kv_c, k_pe, c_msk, slots, blocks, lens, w, sels[0], **kw)
                rel_masked = _rel_err(masked, want)
            del c_ref, c_tri, c_msk
            ok = rel <= TOLERANCE and cache_ok and (rel_masked is None or rel_masked <= TOLERANCE)
            row = dict(B=B, context=ctx, topk=K, selected_MB=round(sel_bytes / 1e6, 2),
                       cache_MB=round(B * ctx * (L + R) * 2 / 1e6, 2), roofline_us=round(bytes_total / a.bw * 1e6, 2),
                       max_rel_err=float(f"{rel:.3g}"),
                       max_rel_err_masked=None if rel_masked is None else float(f"{rel_masked:.3g}"),
                       cache_ok=cache_ok, num_splits=splits, calls_per_graph=calls, correct=ok)
            if not ok:
                failed = True
                print(f"B={B} ctx={ctx}: WRONG (rel err {rel:.3g}, masked {rel_masked}, cache "
                      f"{'ok' if cache_ok else 'DIFFERS'}): not timed", flush=True)
                rows.append(row)
                continue
            outs = [torch.empty(B, H * v, device="cuda", dtype=torch.bfloat16) for _ in range(calls)]
            ours = timed(lambda r: sparse_mla_decode_triton(q, kv_c, k_pe, caches[r], slots, blocks, lens, w, sels[r],
                                                            out=outs[r], **kw), calls, a.reps)
            masked_us = None
            if not a.no_masked:
                mcalls = min(calls, 4)
                masked_us = timed(lambda r: sparse_mla_decode_masked(q, kv_c, k_pe, caches[r], slots, blocks, lens, w,
                                                                     sels[r], out=outs[r], **kw),
                                  mcalls, max(5, a.reps // 4))
            dense_us = None
            if not a.no_dense:
                dense_us = timed(lambda r: mk.mla_decode_triton(q, kv_c, k_pe, caches[r], slots, blocks, lens, w,
                                                                out=outs[r], **kw), calls, a.reps)
            roof = row["roofline_us"]
            row.update(triton_sparse_us=round(ours, 2), pct_roofline=round(100 * roof / ours, 1),
                       torch_masked_us=None if masked_us is None else round(masked_us, 1),
                       triton_dense_us=None if dense_us is None else round(dense_us, 2))
            rows.append(row)
            print(f"B={B:3d} ctx={ctx:6d} K={K} sel {row['selected_MB']:7.1f} MB roof {roof:7.1f} us  "
                  f"sparse {ours:7.1f} us ({row['pct_roofline']:5.1f}%)  torch_masked "
                  f"{'-' if masked_us is None else f'{masked_us:8.1f} us'}  dense MLA "
                  f"{'-' if dense_us is None else f'{dense_us:8.1f} us'}  splits {splits:3d} rel err {rel:.2e} "
                  f"[{time.time() - t_start:.0f} s]", flush=True)
            del caches, sels, outs
            torch.cuda.empty_cache()

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(shape=dict(heads=H, kv_lora=L, rope=R, nope=nope, v=v, topk=K, block_size=a.block_size,
                           dtype="bfloat16", kv_norm=True, gate=False),
                tuning=tuning, bandwidth=a.bw, reps=a.reps, tolerance=TOLERANCE, machine=machine_info())
    (out / f"sparse_mla{a.tag}.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))

    def cell(x):
        return "-" if x is None else f"{x}"

    lines = [f"# Sparse MLA decode: Triton vs torch_masked vs dense MLA (H={H} L={L} R={R} nope={nope} v={v}, "
             f"K={K}, block {a.block_size}, bf16)", "",
             f"GPU {meta['machine']['gpu']}, torch {meta['machine']['torch']}, triton {meta['machine']['triton']}, "
             f"commit {meta['machine']['git_commit']}; roofline at {a.bw / 1e12:g} TB/s (selected rows + selection "
             f"+ kv_b_proj); tuning {tuning}", "",
             "triton sparse: attention.sparse_mla.triton_splitkv (3 launches); torch_masked: "
             "attention.sparse_mla.torch_masked; triton dense: attention.mla.triton_splitkv over the whole context. "
             "Every cell checked against the fp32 reference before timing.", "",
             "| B | context | selected MB | roofline us | triton sparse us | % roofline | torch_masked us "
             "| triton dense us | splits | max rel err (masked) | correct |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['B']} | {r['context']} | {r['selected_MB']} | {r['roofline_us']} | "
                     f"{cell(r.get('triton_sparse_us'))} | {cell(r.get('pct_roofline'))} | "
                     f"{cell(r.get('torch_masked_us'))} | {cell(r.get('triton_dense_us'))} | {r['num_splits']} | "
                     f"{r['max_rel_err']:.2e} ({cell(r['max_rel_err_masked'])}) | {'yes' if r['correct'] else 'NO'} |")
    (out / f"sparse_mla{a.tag}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / f'sparse_mla{a.tag}.json'} and .md in {time.time() - t_start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
