"""MLA decode (absorbed, paged latent cache) on the GPU: Triton split-KV kernel vs the torch composition.

    python benchmarks/scripts/bench_mla.py --out benchmarks/results/h200

For each (batch B, context): a bf16 cache of B sequences of ``context`` tokens (blocks assigned in a
shuffled order), every ``seq_lens = context``. Checks ``attention.mla.triton_splitkv`` once against
``mla_decode_reference`` (bf16 tolerance, max error relative to the output scale), then times it and
``attention.mla.torch_paged`` (skipped where its fp32 gather would exceed ``--paged-limit-gb``), each
captured into a CUDA graph of ``calls`` back-to-back calls over distinct caches (so that the L2 cannot
hold what a call reads: at least ``--rotate-mb`` read per graph), CUDA events around each replay,
median of ``--reps`` replays after warm-up, divided by ``calls``.

Also timed: the same call with ``fused=False`` (torch latent write and epilogue), and the split
kernel alone (its cache-read bandwidth).

Roofline: ``bytes / --bw`` with bytes = B x context x (L + R) x 2 (the cache read) + H (nope + v) L x 2
(kv_b_proj). Writes ``mla_decode.json`` and ``mla_decode.md`` into ``--out``. The tuning flags
(``--block-n``, ``--warps``, ``--stages``, ``--min-chunk``, ``--waves``, ``--max-splits``, ``--merge-s-tile``,
``--merge-warps``, ...) override the kernel module's constants for a sweep (``mla_sweep.py`` runs several in
one process). Which values won on the H200 is in ``kernels/NOTES.md`` (the split kernel's warps only since
session 27: before, ``--warps`` did not reach the launch).
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


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _inputs(B, ctx, a, n_caches, g):
    H, L, R, nope, v, bs = a.heads, a.kv_lora, a.rope, a.nope, a.v, a.block_size
    per = -(-ctx // bs)
    nb = B * per
    caches = [torch.randn(nb, bs, L + R, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(n_caches)]
    blocks = torch.randperm(nb, device="cuda", generator=g).view(B, per).to(torch.int32)
    cap = -(-max(a.capacity or 0, ctx) // bs)
    if cap > per:  # a table wider than the context (as a runtime sized for its longest sequence): -1 past the end
        blocks = torch.cat([blocks, blocks.new_full((B, cap - per), -1)], dim=1)
    lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    p = ctx - 1
    slots = blocks[:, p // bs].long() * bs + p % bs
    q = torch.randn(B, H, nope + R, device="cuda", generator=g, dtype=torch.bfloat16)
    kv = torch.randn(B, L + R, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(H * (nope + v), L, device="cuda", generator=g) * L ** -0.5).to(torch.bfloat16)
    gate = torch.randn(B, H * v, device="cuda", generator=g, dtype=torch.bfloat16)
    return caches, (q, kv[:, :L].contiguous(), kv[:, L:]), blocks, lens, slots, w, gate


def _time_graph(fns, reps: int) -> float:
    """Median us of one replay of a graph that runs every fn once (each replay waited for)."""
    return time_graph(lambda r: fns[r](), len(fns), replays=reps, warmup=3, sync_each=True) * len(fns)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/h200", help="where mla_decode.{json,md} go")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-lora", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--nope", type=int, default=128)
    ap.add_argument("--v", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=25, help="timed replays per graph (median)")
    ap.add_argument("--rotate-mb", type=float, default=200.0, help="bytes read per graph at least (L2 is 50 MB)")
    ap.add_argument("--max-calls", type=int, default=32, help="calls (distinct caches) per graph at most")
    ap.add_argument("--paged-limit-gb", type=float, default=8.0, help="skip torch_paged above this fp32 gather")
    ap.add_argument("--no-paged", action="store_true", help="time the Triton kernel only")
    ap.add_argument("--bw", type=float, default=None,
                    help="roofline bandwidth, bytes/s (default: this device's, hardware.roofline_bandwidth())")
    ap.add_argument("--tag", default="", help="suffix of the output file names (sweeps)")
    ap.add_argument("--capacity", type=int, default=None,
                    help="block-table width in tokens (default: the context): num_splits follows it, the "
                         "columns past the context hold -1 (how a runtime sized for a longer context calls it)")
    ap.add_argument("--block-n", type=int, default=None)
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--min-chunk", type=int, default=None)
    ap.add_argument("--min-chunk-small", type=int, default=None, help="MIN_CHUNK_SMALL_BATCH (batch <= 2)")
    ap.add_argument("--waves", type=int, default=None)
    ap.add_argument("--max-splits", type=int, default=None, help="MAX_SPLITS (most splits of one sequence)")
    ap.add_argument("--skip-unfused", action="store_true", help="do not time the unfused (torch glue) call")
    ap.add_argument("--merge-s-tile", type=int, default=None)
    ap.add_argument("--merge-warps", type=int, default=None)
    ap.add_argument("--merge-l-fused", type=int, default=None)
    ap.add_argument("--merge-tile", type=int, default=None)
    ap.add_argument("--merge-v-block", type=int, default=None, help="MERGE_V_BLOCK (values per fused-merge program)")
    ap.add_argument("--merge-w-tile", type=int, default=None,
                    help="MERGE_W_TILE (most V_PAD x ML W_UV values per fused-merge program; 1073741824: no cap)")
    ap.add_argument("--pdl", type=int, choices=(0, 1), default=None, help="PDL (programmatic dependent launch) off/on")
    ap.add_argument("--merge-l-tile", type=int, default=None, help="MERGE_L_TILE (0: the v-blocked merge everywhere)")
    ap.add_argument("--merge-pdl", type=int, choices=(0, 1), default=None,
                    help="MERGE_PDL: the tiled merge with PDL behind a split grid wider than the SMs")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_mla: needs a CUDA GPU", file=sys.stderr)
        return 2
    a.bw = a.bw or roofline_bandwidth()

    from latency_specialized.bench.machine import machine_info
    from latency_specialized.kernels import mla_decode_triton as mk
    from latency_specialized.ops.attention.mla import mla_decode_paged, mla_decode_reference

    for flag, const in (("block_n", "BLOCK_N"), ("warps", "NUM_WARPS"), ("stages", "NUM_STAGES"),
                        ("min_chunk", "MIN_CHUNK"), ("min_chunk_small", "MIN_CHUNK_SMALL_BATCH"), ("waves", "WAVES"), ("max_splits", "MAX_SPLITS"), ("merge_s_tile", "MERGE_S_TILE"),
                        ("merge_warps", "MERGE_WARPS"), ("merge_l_fused", "MERGE_L_FUSED"),
                        ("merge_tile", "MERGE_TILE"), ("merge_v_block", "MERGE_V_BLOCK"), ("pdl", "PDL"),
                        ("merge_l_tile", "MERGE_L_TILE"), ("merge_pdl", "MERGE_PDL"), ("merge_w_tile", "MERGE_W_TILE")):
        if getattr(a, flag) is not None:
            setattr(mk, const, getattr(a, flag))
    tuning = {k: getattr(mk, k) for k in ("BLOCK_H", "BLOCK_N", "NUM_WARPS", "NUM_STAGES", "MIN_CHUNK", "MIN_CHUNK_SMALL_BATCH", "WAVES",
                                          "MAX_SPLITS", "MERGE_L", "MERGE_S_TILE", "MERGE_WARPS", "MERGE_L_FUSED",
                                          "MERGE_TILE", "MERGE_V_BLOCK", "PDL", "MERGE_L_TILE", "MERGE_PDL",
                                          "MERGE_W_TILE")}
    H, L, R, nope, v = a.heads, a.kv_lora, a.rope, a.nope, a.v
    kw = dict(qk_nope_head_dim=nope, v_head_dim=v)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    t_start = time.time()
    print(f"bench_mla: H={H} L={L} R={R} nope={nope} v={v} block={a.block_size} {tuning}", flush=True)
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for ctx in _ints(a.contexts):
        for B in _ints(a.batches):
            cache_bytes = B * ctx * (L + R) * 2
            bytes_total = cache_bytes + H * (nope + v) * L * 2
            calls = max(1, min(a.max_calls, math.ceil(a.rotate_mb * 1e6 / cache_bytes)))
            caches, (q, kv_c, k_pe), blocks, lens, slots, w, gate = _inputs(B, ctx, a, calls, g)
            splits = mk.choose_num_splits(B, H, blocks.shape[1] * a.block_size, sms)
            # correctness once, before timing
            c_ref, c_tri = caches[0].clone(), caches[0].clone()
            want = mla_decode_reference(q, kv_c, k_pe, c_ref, slots, blocks, lens, w, gate=gate, **kw).float()
            got = mk.mla_decode_triton(q, kv_c, k_pe, c_tri, slots, blocks, lens, w, gate=gate, **kw).float()
            rel = ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()
            cache_ok = torch.equal(c_ref, c_tri)
            del c_ref, c_tri
            outs = [torch.empty(B, H * v, device="cuda", dtype=torch.bfloat16) for _ in range(calls)]
            tri, tri_unfused = (
                _time_graph([lambda c=c, o=o, f=fused: mk.mla_decode_triton(q, kv_c, k_pe, c, slots, blocks, lens, w,
                                                                             gate=gate, out=o, fused=f, **kw)
                             for c, o in zip(caches, outs)], a.reps) / calls if run else float("nan")
                for fused, run in ((True, True), (False, not a.skip_unfused)))
            # the split kernel alone (the bytes): same inputs, q_lat precomputed
            q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w.view(H, nope + v, L)[:, :nope])
            q_pe = q[..., nope:]
            split = _time_graph([lambda c=c: mk._split_attention(q_lat, q_pe, c.view(-1, L + R), blocks, lens,
                                                                 a.block_size, (nope + R) ** -0.5, None, None)
                                 for c in caches], a.reps) / calls
            gather_gb = B * blocks.shape[1] * a.block_size * (L + R) * 4 / 1e9
            paged, paged_note = None, ""
            if a.no_paged:
                paged_note = "not run (--no-paged)"
            elif gather_gb > a.paged_limit_gb:
                paged_note = f"skipped: fp32 gather {gather_gb:.1f} GB > {a.paged_limit_gb:g} GB"
            else:
                pcalls = min(calls, 4)
                paged = _time_graph([lambda c=c, o=o: mla_decode_paged(q, kv_c, k_pe, c, slots, blocks, lens, w,
                                                                      gate=gate, out=o, **kw)
                                     for c, o in zip(caches[:pcalls], outs)], max(5, a.reps // 4)) / pcalls
            roof = bytes_total / a.bw * 1e6
            row = dict(B=B, context=ctx, capacity=blocks.shape[1] * a.block_size, MB=round(cache_bytes / 1e6, 2), roofline_us=round(roof, 2),
                       triton_us=round(tri, 2), pct_roofline=round(100 * roof / tri, 1),
                       split_kernel_us=round(split, 2), split_kernel_tbps=round(cache_bytes / split / 1e6, 2),
                       triton_unfused_us=round(tri_unfused, 2),
                       torch_paged_us=None if paged is None else round(paged, 1), torch_paged_note=paged_note,
                       max_rel_err=float(f"{rel:.3g}"), cache_ok=cache_ok, num_splits=splits, calls_per_graph=calls)
            rows.append(row)
            print(f"B={B:3d} ctx={ctx:6d} {row['MB']:9.1f} MB roof {roof:8.1f} us  triton {tri:8.1f} us "
                  f"({row['pct_roofline']:5.1f}%)  split kernel {split:8.1f} us ({row['split_kernel_tbps']:.2f} TB/s)  "
                  f"unfused {tri_unfused:8.1f} us  torch_paged {paged_note or f'{paged:9.1f} us'}  "
                  f"splits {splits:3d} rel err {rel:.2e} cache {'ok' if cache_ok else 'DIFFERS'}  "
                  f"[{time.time() - t_start:.0f} s]", flush=True)
            del caches, outs
            torch.cuda.empty_cache()

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(shape=dict(heads=H, kv_lora=L, rope=R, nope=nope, v=v, block_size=a.block_size, dtype="bfloat16"),
                tuning=tuning, bandwidth=a.bw, reps=a.reps, machine=machine_info())
    (out / f"mla_decode{a.tag}.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))
    lines = [f"# MLA decode: Triton split-KV vs torch_paged (H={H} L={L} R={R} nope={nope} v={v}, block "
             f"{a.block_size}, bf16)", "",
             f"GPU {meta['machine']['gpu']}, torch {meta['machine']['torch']}, triton {meta['machine']['triton']}, "
             f"commit {meta['machine']['git_commit']}; roofline at {a.bw / 1e12:g} TB/s; tuning {tuning}", "",
             "triton: the whole call (fused: prologue = latent write + absorbed query, split, merge + W_UV + gate: "
             "3 launches); split kernel: that kernel alone (TB/s of cache read); unfused: torch latent write "
             "and epilogue (~25 launches).", "",
             "| B | context | table capacity | MB | roofline us | triton us | % roofline | split kernel us (TB/s) "
             "| triton unfused us | torch_paged us | max rel err | splits |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        paged = r["torch_paged_note"] if r["torch_paged_us"] is None else f"{r['torch_paged_us']}"
        lines.append(f"| {r['B']} | {r['context']} | {r['capacity']} | {r['MB']} | {r['roofline_us']} | {r['triton_us']} | "
                     f"{r['pct_roofline']} | {r['split_kernel_us']} ({r['split_kernel_tbps']}) | "
                     f"{r['triton_unfused_us']} | {paged} | {r['max_rel_err']:.2e} | {r['num_splits']} |")
    (out / f"mla_decode{a.tag}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / f'mla_decode{a.tag}.json'} and .md in {time.time() - t_start:.0f} s")
    bad = [r for r in rows if r["max_rel_err"] > 2e-2 or not r["cache_ok"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
