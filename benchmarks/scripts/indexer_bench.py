"""The DSA lightning indexer (``attention.indexer``) on the GPU: the Triton kernels (radix select and
torch.topk selection) vs the torch reference.

    python benchmarks/scripts/indexer_bench.py --out benchmarks/results/h200

For each (batch B, context): a bf16 key cache of B sequences of ``context`` tokens (blocks in a shuffled
order, the block table ``--capacity`` tokens wide, -1 past the context), every ``seq_lens = context``, at
GLM-5.3's indexer shape (32 heads x 128, top-2048, interleaved RoPE of 64 channels, key LayerNorm with
bias: the indexer is replicated, so these are its TP8 shapes too; ``--heads/--head-dim/--topk/--norm``
give DeepSeek-V4.1-Flash's). First a correctness check of both variants against the reference (each row
a valid set of ``min(K, seq_len)`` positions whose reference logits are the top K within a bf16
tolerance), then each variant captured into a CUDA graph of ``calls`` back-to-back calls over distinct
caches (at least ``--rotate-mb`` read per graph, so the L2 cannot hold what a call reads), CUDA events
around each replay after warm-up, median of ``--reps`` replays divided by ``calls``. The reference is
skipped where its fp32 gather of the whole table would exceed ``--ref-limit-gb``.

Also timed: the score kernel alone (key write + scoring, no selection), so selection = call - that.
Writes ``indexer.json`` and ``indexer.md`` (``--tag`` suffix) into ``--out``.
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


def _inputs(B: int, ctx: int, a, n_caches: int, g: torch.Generator):
    H, D, bs = a.heads, a.head_dim, a.block_size
    per = -(-ctx // bs)
    nb = B * per
    caches = [torch.randn(nb, bs, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(n_caches)]
    blocks = torch.randperm(nb, device="cuda", generator=g).view(B, per).to(torch.int32)
    cap = -(-max(a.capacity or 0, ctx) // bs)
    if cap > per:  # a table wider than the context (a runtime sized for its longest sequence): -1 past the end
        blocks = torch.cat([blocks, blocks.new_full((B, cap - per), -1)], dim=1)
    lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    p = ctx - 1
    slots = blocks[:, p // bs].long() * bs + p % bs
    proj = torch.randn(B, H * D + D + H, device="cuda", generator=g).to(torch.bfloat16)
    q, k, w = proj[:, :H * D].view(B, H, D), proj[:, H * D:H * D + D], proj[:, H * D + D:]
    kw = dict(topk=a.topk, positions=lens.long() - 1, rope_interleaved=a.rope_interleaved, k_norm_eps=1e-6,
              k_norm_weight=1.0 + 0.1 * torch.randn(D, device="cuda", generator=g), k_norm_kind=a.norm)
    if a.rope:
        kw["rope_inv_freq"] = 1.0 / (1e4 ** (torch.arange(0, a.rope, 2, device="cuda").float() / a.rope))
    if a.norm == "layer":
        kw["k_norm_bias"] = 0.1 * torch.randn(D, device="cuda", generator=g)
    return caches, (q, k, w), blocks, lens, slots, kw


def _ref_logits(q, w, cache, blocks, lens, kw):
    """[B, ctx] fp32 logits of the contract over a written cache (one row at a time)."""
    from latency_specialized.ops.attention.sparse_mla import rotate_leading

    B, H, D = q.shape
    qf = q.float()
    if kw.get("rope_inv_freq") is not None:
        qf = rotate_leading(qf, kw["positions"], kw["rope_inv_freq"], kw["rope_interleaved"])
    bs, n = cache.shape[1], int(lens.max())
    out = torch.full((B, n), float("-inf"), device="cuda")
    for b in range(B):
        m = int(lens[b])
        p = torch.arange(m, device="cuda")
        rows = blocks[b, p // bs].long() * bs + p % bs
        out[b, :m] = (w[b].float() @ (qf[b] @ cache.view(-1, D)[rows].float().T).clamp(min=0)) * (D ** -0.5 * H ** -0.5)
    return out


def _selection_error(sel: torch.Tensor, logits: torch.Tensor, lens: torch.Tensor, K: int) -> tuple[bool, float]:
    """(valid set, the worst shortfall of a selected logit below the K-th largest, relative to the logit scale)."""
    ok, worst = True, 0.0
    for b in range(sel.shape[0]):
        n = int(lens[b])
        row = sel[b].long()
        live = row[row >= 0]
        want = min(K, n)
        ok &= live.numel() == want and torch.unique(live).numel() == want and bool((live < n).all())
        if want and live.numel():
            lg = logits[b, :n]
            kth = torch.topk(lg, want).values[-1]
            worst = max(worst, float((kth - lg[live].min()).clamp(min=0) / lg.abs().max().clamp(min=1e-30)))
    return ok, worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/h200", help="where indexer.{json,md} go")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--rope", type=int, default=64, help="rotated leading channels (0: none)")
    ap.add_argument("--rope-interleaved", type=int, choices=(0, 1), default=1)
    ap.add_argument("--norm", choices=("layer", "rms"), default="layer")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--capacity", type=int, default=None, help="block-table width in tokens (default: the context)")
    ap.add_argument("--reps", type=int, default=25, help="timed replays per graph (median)")
    ap.add_argument("--rotate-mb", type=float, default=200.0, help="bytes read per graph at least (L2 is 50 MB)")
    ap.add_argument("--max-calls", type=int, default=32, help="calls (distinct caches) per graph at most")
    ap.add_argument("--ref-limit-gb", type=float, default=4.0, help="skip the reference above this fp32 gather")
    ap.add_argument("--bw", type=float, default=None,
                    help="roofline bandwidth, bytes/s (default: this device's, hardware.roofline_bandwidth())")
    ap.add_argument("--tag", default="", help="suffix of the output file names (sweeps)")
    ap.add_argument("--block-t", type=int, default=None, help="BLOCK_T (positions per scoring tile)")
    ap.add_argument("--min-chunk", type=int, default=None, help="MIN_CHUNK")
    ap.add_argument("--waves", type=int, default=None, help="WAVES")
    ap.add_argument("--score-warps", type=int, default=None)
    ap.add_argument("--select-tile", type=int, default=None)
    ap.add_argument("--select-warps", type=int, default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("indexer_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    a.bw = a.bw or roofline_bandwidth()

    from latency_specialized.bench.machine import machine_info
    from latency_specialized.kernels import indexer_triton as ix
    from latency_specialized.ops.attention.sparse_mla import indexer_topk_reference

    for flag, const in (("block_t", "BLOCK_T"), ("min_chunk", "MIN_CHUNK"), ("waves", "WAVES"),
                        ("score_warps", "SCORE_WARPS"), ("select_tile", "SELECT_TILE"),
                        ("select_warps", "SELECT_WARPS")):
        if getattr(a, flag) is not None:
            setattr(ix, const, getattr(a, flag))
    tuning = {k: getattr(ix, k) for k in ("BLOCK_T", "MIN_CHUNK", "WAVES", "MAX_SPLITS", "SCORE_WARPS",
                                          "SELECT_TILE", "SELECT_WARPS")}
    H, D, K = a.heads, a.head_dim, a.topk
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    t0 = time.time()
    print(f"indexer_bench: H={H} D={D} K={K} rope={a.rope} norm={a.norm} block={a.block_size} {tuning}", flush=True)
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for ctx in _ints(a.contexts):
        for B in _ints(a.batches):
            cache_bytes = B * ctx * D * 2
            calls = max(1, min(a.max_calls, math.ceil(a.rotate_mb * 1e6 / cache_bytes)))
            caches, (q, k, w), blocks, lens, slots, kw = _inputs(B, ctx, a, calls, g)
            cap = blocks.shape[1] * a.block_size
            # correctness once, before timing
            c_ref = caches[0].clone()
            for b in range(B):  # the reference row by row: its fp32 gather of one row's table only
                r = slice(b, b + 1)
                indexer_topk_reference(q[r], k[r], w[r], c_ref, slots[r], blocks[r], lens[r],
                                       **dict(kw, positions=kw["positions"][r]))
            logits = _ref_logits(q, w, c_ref, blocks, lens, kw)
            checks = {}
            for sel in ("radix", "torch"):
                c = caches[0].clone()
                got = ix.indexer_topk_triton(q, k, w, c, slots, blocks, lens, selection=sel, **kw)
                valid, short = _selection_error(got, logits, lens, K)
                checks[sel] = dict(valid=valid, worst_shortfall=float(f"{short:.3g}"),
                                   cache_max_err=float((c.float() - c_ref.float()).abs().max()))
            del c_ref, c, logits
            outs = [torch.empty(B, K, device="cuda", dtype=torch.int32) for _ in range(calls)]

            def timed(fn, n=calls, reps=a.reps):
                return time_graph(lambda r: fn(caches[r], outs[r]), n, replays=reps, warmup=3, sync_each=True)

            radix = timed(lambda c, o: ix.indexer_topk_triton(q, k, w, c, slots, blocks, lens, out=o,
                                                              selection="radix", **kw))
            torch_sel = timed(lambda c, o: ix.indexer_topk_triton(q, k, w, c, slots, blocks, lens, out=o,
                                                                  selection="torch", **kw))
            # the key write + scoring alone: topk = seq_len makes the select kernel a trivial copy of 0..n-1
            score_only = timed(lambda c, o: ix.indexer_topk_triton(q, k, w, c, slots, blocks, lens,
                                                                   **dict(kw, topk=cap), selection="radix"))
            gather_gb = B * cap * D * 4 / 1e9
            ref, ref_note = None, ""
            if gather_gb > a.ref_limit_gb:
                ref_note = f"skipped: fp32 gather {gather_gb:.1f} GB > {a.ref_limit_gb:g} GB"
            else:
                rcalls = min(calls, 4)
                ref = timed(lambda c, o: indexer_topk_reference(q, k, w, c, slots, blocks, lens, out=o, **kw),
                            n=rcalls, reps=max(5, a.reps // 4))
            roof = cache_bytes / a.bw * 1e6
            row = dict(B=B, context=ctx, capacity=cap, MB=round(cache_bytes / 1e6, 2), roofline_us=round(roof, 2),
                       radix_us=round(radix, 2), torch_topk_us=round(torch_sel, 2),
                       score_only_us=round(score_only, 2), reference_us=None if ref is None else round(ref, 1),
                       reference_note=ref_note, num_splits=ix.choose_num_splits(B, cap, sms), calls_per_graph=calls,
                       check=checks)
            rows.append(row)
            ok = all(v["valid"] and v["worst_shortfall"] < 2e-2 for v in checks.values())
            print(f"B={B:3d} ctx={ctx:6d} {row['MB']:8.1f} MB roof {roof:7.1f} us  radix {radix:8.1f} us  "
                  f"torch.topk {torch_sel:8.1f} us  score only {score_only:8.1f} us  reference "
                  f"{ref_note or f'{ref:9.1f} us'}  check {'ok' if ok else 'FAILED'} {checks}  "
                  f"[{time.time() - t0:.0f} s]", flush=True)
            del caches, outs
            torch.cuda.empty_cache()

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(shape=dict(heads=H, head_dim=D, topk=K, rope=a.rope, rope_interleaved=bool(a.rope_interleaved),
                           norm=a.norm, block_size=a.block_size, dtype="bfloat16"),
                tuning=tuning, bandwidth=a.bw, reps=a.reps, machine=machine_info())
    (out / f"indexer{a.tag}.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))
    m = meta["machine"]
    lines = [f"# attention.indexer: Triton (radix select / torch.topk) vs the torch reference (H={H} D={D} K={K}, "
             f"rope {a.rope}, {a.norm} norm, block {a.block_size}, bf16)", "",
             f"GPU {m['gpu']}, torch {m['torch']}, triton {m['triton']}, commit {m['git_commit']}; roofline = the "
             f"key-cache read at {a.bw / 1e12:g} TB/s; tuning {tuning}", "",
             "radix / torch.topk: the whole call (key write, scoring, selection); score only: key write + scoring "
             "(the select kernel with K = capacity is a copy). Check: valid sets, worst shortfall of a selected "
             "logit below the reference's K-th largest (relative to the logit scale).", "",
             "| B | context | MB | roofline us | radix us | torch.topk us | score only us | reference us | splits "
             "| check |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = r["reference_note"] if r["reference_us"] is None else f"{r['reference_us']}"
        chk = ", ".join(f"{s}: {'ok' if v['valid'] else 'INVALID'} {v['worst_shortfall']:.2g}" for s, v in r["check"].items())
        lines.append(f"| {r['B']} | {r['context']} | {r['MB']} | {r['roofline_us']} | {r['radix_us']} | "
                     f"{r['torch_topk_us']} | {r['score_only_us']} | {ref} | {r['num_splits']} | {chk} |")
    (out / f"indexer{a.tag}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / f'indexer{a.tag}.json'} and .md", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
