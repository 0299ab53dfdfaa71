"""The stock MLA decode kernel beside ours: FlashMLA (what vLLM 0.33 runs for MLA decode on Hopper) built from
its source on the H200, in the same process as ``attention.mla.triton_splitkv``.

    python benchmarks/scripts/bench_mla_flashmla.py --src /tmp/flashmla --out $OUT

``--src``: a FlashMLA checkout (github.com/deepseek-ai/FlashMLA) whose ``csrc/cutlass`` holds the CUTLASS its
submodule pins (``include`` and ``tools/util/include``). Only its SM90 dense decode is compiled (the sched-meta,
split-KV and combine kernels: ``csrc/sm90/decode/dense/instantiations/bf16.cu``, ``csrc/smxx/decode/...``) with
the flags of its ``setup.py`` for ``sm_90a``, behind a pybind module of one function (``dense_decode_fwd`` = its
``dense_attn_decode_interface``; ``bench/stock/flashmla.load_flashmla``): vLLM's wheel carries the same kernels
prebuilt for torch 2.14, which cannot load next to the device's torch.

Per (shape, batch, context 4096 by default), caches as ``bench_mla.py`` makes them (bf16, block 64, shuffled
blocks, ``seq_lens = context``), three things timed with the same CUDA-graph timer over distinct caches:

* ``flashmla``: FlashMLA's kernels alone on the absorbed query (split-KV + combine; its tile-scheduler metadata
  computed once beforehand, as vLLM computes it once per step for all layers);
* ``stock call``: the attention call as vLLM's MLA decode path composes it around FlashMLA
  (``bench/stock/flashmla.StockFlashMLA``, what the stock MLA layers run) - the new latent row written into the
  cache (``concat_and_cache_mla``, one kernel as stock's), ``bmm`` with W_UK, ``cat`` with the rope query,
  FlashMLA, ``bmm`` with W_UV and the head-major copy. (Session 30's results were taken with an ``index_copy_``
  of the pre-concatenated row in place of that kernel, in this script before ``StockFlashMLA`` existed.)
* ``ours``: ``mla_decode_triton`` (prologue, split, merge + W_UV: 3 launches), the same work.

No output gate and no RoPE on either side (both sit outside stock's call). Checked before timing: FlashMLA's
latent output and both calls' outputs against ``mla_decode_reference`` (max error relative to the output
scale, bf16 tolerance 2e-2); a failing cell is not timed and the script exits 1. Writes
``mla_flashmla{tag}.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_mla  # noqa: E402  (a sibling script: the same inputs)

from latency_specialized.bench.ops_bench_moe_kda import time_graph  # noqa: E402 (after the path set-up)
from latency_specialized.hardware import roofline_bandwidth  # noqa: E402

TOLERANCE = 2e-2
SHAPES = {"kimi_k3_tp8": dict(heads=12, nope=128, v=128), "glm53_tp8": dict(heads=8, nope=192, v=256)}
"""Rank shapes at TP8 (kv_lora 512, rope 64 for both): Kimi K3 96 / 8 heads, GLM-5.3 64 / 8."""


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _time(fns, reps: int) -> float:
    """Median us of one call: a graph runs every fn once per replay (distinct caches)."""
    return time_graph(lambda r: fns[r](), len(fns), replays=reps, warmup=3, sync_each=True)


def _cell(fm, shape: str, B: int, ctx: int, a, g) -> dict:
    from latency_specialized.bench.stock.flashmla import StockFlashMLA
    from latency_specialized.kernels.mla_decode_triton import mla_decode_triton
    from latency_specialized.ops.attention.mla import mla_decode_reference

    H, nope, v = (SHAPES[shape][k] for k in ("heads", "nope", "v"))
    L, R, bs = 512, 64, 64
    nb = B * -(-ctx // bs)
    cache_bytes = B * ctx * (L + R) * 2
    calls = max(1, min(a.max_calls, math.ceil(a.rotate_mb * 1e6 / cache_bytes)))
    dims = SimpleNamespace(heads=H, kv_lora=L, rope=R, nope=nope, v=v, block_size=bs, capacity=None)
    caches, (q, kv_c, k_pe), blocks, lens, slots, w, _ = bench_mla._inputs(B, ctx, dims, calls, g)  # as bench_mla
    scale = (nope + R) ** -0.5
    kw = dict(qk_nope_head_dim=nope, v_head_dim=v, scale=scale)
    stock_call = StockFlashMLA(w, H, nope, v, module=fm)
    w_uk, w_uv_t = stock_call.w_uk, stock_call.w_uv_t                       # [H, nope, L], [H, L, v]

    def stock(cache, out):
        stock_call(q, kv_c, k_pe, cache, slots, blocks, lens, w, out=out, **kw)

    # tile-scheduler metadata once (FlashMLA computes it on a call without it), as vLLM does once per step
    q_lat0 = torch.bmm(q[..., :nope].transpose(0, 1).float(), w_uk.float()).transpose(0, 1).to(torch.bfloat16)
    q_all0 = torch.cat([q_lat0, q[..., nope:]], dim=-1).unsqueeze(1).contiguous()
    ref_cache = caches[0].clone()
    want = mla_decode_reference(q, kv_c, k_pe, ref_cache, slots, blocks, lens, w, **kw).float()
    _, _, sched, nsplit = fm.dense_decode_fwd(q_all0, ref_cache.view(nb, bs, 1, L + R), L, lens, blocks, scale,
                                              False, None, None)
    stock_call.meta = (sched, nsplit)
    # FlashMLA's latent output against the reference's (through W_UV in fp32)
    o_lat = fm.dense_decode_fwd(q_all0, ref_cache.view(nb, bs, 1, L + R), L, lens, blocks, scale, False,
                                sched, nsplit)[0].float()
    o_fm = torch.bmm(o_lat.view(B, H, L).transpose(0, 1), w_uv_t.float()).transpose(0, 1).reshape(B, H * v)
    norm = want.abs().max().clamp(min=1e-30)
    errs = {"flashmla": ((o_fm - want).abs().max() / norm).item()}
    c1, c2 = caches[0].clone(), caches[0].clone()
    o1 = torch.empty(B, H * v, device="cuda", dtype=torch.bfloat16)
    stock(c1, o1)
    o2 = mla_decode_triton(q, kv_c, k_pe, c2, slots, blocks, lens, w, **kw)
    errs["stock_call"] = ((o1.float() - want).abs().max() / norm).item()
    errs["ours"] = ((o2.float() - want).abs().max() / norm).item()
    row = dict(shape=shape, B=B, context=ctx, heads=H, nope=nope, v=v, MB=round(cache_bytes / 1e6, 2),
               roofline_us=round((cache_bytes + H * (nope + v) * L * 2) / a.bw * 1e6, 2),
               max_rel_err={k: float(f"{e:.3g}") for k, e in errs.items()},
               caches_equal=bool(torch.equal(c1, ref_cache) and torch.equal(c2, ref_cache)), calls_per_graph=calls)
    del c1, c2, ref_cache
    if max(errs.values()) > TOLERANCE or not row["caches_equal"]:
        row["timed"] = False
        return row
    outs = [torch.empty(B, H * v, device="cuda", dtype=torch.bfloat16) for _ in range(calls)]
    q_lats = [q_all0.clone() for _ in range(calls)]
    row["flashmla_us"] = round(_time([lambda c=c, qq=qq: fm.dense_decode_fwd(
        qq, c.view(nb, bs, 1, L + R), L, lens, blocks, scale, False, sched, nsplit) for c, qq in zip(caches, q_lats)],
        a.reps), 2)
    row["stock_call_us"] = round(_time([lambda c=c, o=o: stock(c, o) for c, o in zip(caches, outs)], a.reps), 2)
    row["ours_us"] = round(_time([lambda c=c, o=o: mla_decode_triton(q, kv_c, k_pe, c, slots, blocks, lens, w, out=o,
                                                                        **kw) for c, o in zip(caches, outs)],
                                 a.reps), 2)
    row["timed"] = True
    row["speedup_vs_stock_call"] = round(row["stock_call_us"] / row["ours_us"], 2)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True, help="FlashMLA checkout with csrc/cutlass populated")
    ap.add_argument("--build-dir", default="/tmp/flashmla_build")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results/h200")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--contexts", default="4096")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--rotate-mb", type=float, default=200.0)
    ap.add_argument("--max-calls", type=int, default=32)
    ap.add_argument("--bw", type=float, default=None,
                    help="roofline bandwidth, bytes/s (default: this device's, hardware.roofline_bandwidth())")
    ap.add_argument("--tag", default="")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_mla_flashmla: needs a CUDA GPU", file=sys.stderr)
        return 2
    a.bw = a.bw or roofline_bandwidth()
    from latency_specialized.bench.machine import machine_info
    from latency_specialized.bench.stock.flashmla import load_flashmla

    t0 = time.time()
    fm = load_flashmla(Path(a.src), Path(a.build_dir), a.jobs)
    print(f"FlashMLA built in {time.time() - t0:.0f} s", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape in a.shapes.split(","):
        for ctx in _ints(a.contexts):
            for B in _ints(a.batches):
                row = _cell(fm, shape, B, ctx, a, g)
                rows.append(row)
                print(json.dumps(row), f"[{time.time() - t0:.0f} s]", flush=True)
                torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(src=a.src, machine=machine_info(), bandwidth=a.bw, reps=a.reps)
    (out / f"mla_flashmla{a.tag}.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))
    lines = ["# MLA decode call: ours vs stock (FlashMLA, built from source) on the same inputs", "",
             f"GPU {meta['machine']['gpu']}, torch {meta['machine']['torch']}; roofline at {a.bw / 1e12:g} TB/s "
             "(latent cache + W_UK / W_UV bytes). flashmla: its split-KV + combine kernels on the absorbed query; "
             "stock call: bench/stock/flashmla.StockFlashMLA (cache write + bmm W_UK + cat + FlashMLA + bmm W_UV + "
             "copy); ours: "
             "mla_decode_triton (3 launches). No gate, no RoPE on either side.", "",
             "| shape | B | context | roofline us | flashmla us | stock call us | ours us | stock / ours | max rel err "
             "(flashmla / stock / ours) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e = r["max_rel_err"]
        t = (f"{r['flashmla_us']} | {r['stock_call_us']} | {r['ours_us']} | {r['speedup_vs_stock_call']}x"
             if r["timed"] else "not timed (check failed) | - | - | -")
        lines.append(f"| {r['shape']} | {r['B']} | {r['context']} | {r['roofline_us']} | {t} | "
                     f"{e['flashmla']:.1e} / {e['stock_call']:.1e} / {e['ours']:.1e} |")
    (out / f"mla_flashmla{a.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["timed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
