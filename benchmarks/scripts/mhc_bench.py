"""One mHC seam (``residual.mhc``) on the GPU: ours (one launch) vs the torch reference vs the stock stand-in.

    python benchmarks/scripts/mhc_bench.py --out benchmarks/results/h200 [--sweep]

DeepSeek-V4.1-Flash shapes (streams and seams are not split by TP, so TP8 has the same seam): n = 4
streams of H = 5120 bf16, fn [24, 20480] fp32 (1.9 MiB per seam), batches ``--batches``. For each batch,
``calls`` sets of inputs (fn, streams, y, post, comb, carried pre, norm weight; distinct tensors, so that
at least ``--rotate-mb`` is read per graph and the L2 holds no set from one call to the next) and per
variant a CUDA graph of ``calls`` back-to-back seams, CUDA events around each replay, median of ``--reps``
replays (``latency_specialized.bench.ops_bench_moe_kda.time_graph``), us per seam:

* ``triton``: ``residual.mhc.triton`` (``kernels/mhc_triton.py``) at its default blocks (``choose_blocks``);
  with ``--sweep`` also every (rows per program, channels per chunk, warps) of ``SWEEP``; with ``--pdl`` also
  ``triton_pdl``, launched with PDL (``mhc_triton.PDL``: each seam of the graph starts while the one before drains);
  with ``--out-first`` also ``triton_out_first`` (``mhc_triton.OUT_LOAD_FIRST``);
* ``reference``: ``mhc_seam_reference`` (torch, about 156 kernels);
* ``stock``: the stock stand-in (``bench/stock/sparse_mqa_kernels.py``: ``mhc_post_mix`` + ``mhc_pre_norm``,
  2 launches) - middle seams only (it has no first / last form).

Seams: ``middle`` (fold-in + projection + Sinkhorn + collapse + norm), ``first`` (no fold-in, stream 0)
and ``last`` (no projection). Each variant is checked first against the reference (max |error| relative
to the output scale for x, absolute for the coefficients); a failing one is reported and not timed, and
the script exits 1. Roofline: bytes / ``--bw`` (default: the GPU's own, ``hardware.roofline_bandwidth``) with
bytes = fn (24 x 4H x 4) + streams read and written (2 x M x 4H x 2) + y and x (2 x M x H x 2) + the norm weight.
Writes ``mhc{tag}.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from latency_specialized.bench.ops_bench_moe_kda import time_graph  # noqa: E402 (after the path set-up)
from latency_specialized.kernels import mhc_triton as mk  # noqa: E402
from latency_specialized.ops.residual_mhc import mhc_seam_reference  # noqa: E402

EPS = 1e-20
DEVICE = "cuda"
SWEEP = [(1, 32, 4), (2, 32, 4), (4, 32, 4), (4, 32, 8), (8, 32, 4), (8, 32, 8), (4, 64, 4), (8, 64, 8), (16, 32, 8),
         (2, 16, 4), (1, 16, 4), (1, 16, 2), (1, 32, 2), (1, 64, 4), (1, 64, 8)]
"""(block_m, block_h, num_warps) tried by ``--sweep`` (those with block_m > 2 M are skipped)."""
TOL_X, TOL_COEF = 3e-2, 2e-2


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _set(M: int, H: int, n: int, seam: str, g: torch.Generator) -> dict:
    X = (2 + n) * n
    r = lambda *s: torch.randn(*s, generator=g, device=DEVICE)   # noqa: E731
    d = dict(streams=(r(M, n, H) * 2).to(torch.bfloat16), norm_weight=(1 + 0.1 * r(H)).to(torch.bfloat16))
    mix, y = seam != "last", seam != "first"
    d["fn"] = r(X, n * H) * (n * H) ** -0.5 if mix else None
    d["scale"] = torch.rand(3, generator=g, device=DEVICE) + 0.5 if mix else None
    d["base"] = 0.5 * r(X) if mix else None
    d["pre"] = torch.rand(M, n, generator=g, device=DEVICE) + 0.1 if y else None
    d["y"] = r(M, H).to(torch.bfloat16) if y else None
    d["post"] = 2 * torch.rand(M, n, generator=g, device=DEVICE) if y else None
    d["comb"] = torch.softmax(2 * r(M, n, n), -1) if y else None
    if seam == "middle":  # the stand-in's workspaces and outputs, allocated once per set
        from latency_specialized.bench.stock import sparse_mqa_kernels as sk

        S = -(-H // sk.MHC_CHUNK)
        d["stock"] = dict(mix=torch.empty(S, M, 32, device=DEVICE), sqrsum=torch.empty(S, M, device=DEVICE),
                          pre=torch.empty(M, n, device=DEVICE), post=torch.empty(M, n, device=DEVICE),
                          comb=torch.empty(M, n, n, device=DEVICE),
                          out=torch.empty(M, H, device=DEVICE, dtype=torch.bfloat16))
    return d


ITERS = 20
"""Sinkhorn iterations of every variant (DeepSeek-V4.1-Flash's 20; ``--sinkhorn-iters`` sets it: the difference
to 1 iteration is what the tail's Sinkhorn rounds cost)."""


def _kw(d: dict) -> dict:
    return dict(pre=d["pre"], y=d["y"], post=d["post"], comb=d["comb"], rms_eps=EPS, hc_eps=1e-6, post_mult=2.0,
                sinkhorn_iters=ITERS)


def _ours(pdl: bool = False, out_first: bool = False, **blocks):
    """Ours at ``blocks``; ``pdl``: launched with PDL (``mhc_triton.PDL`` set around the call, so also inside the
    capture), i.e. each seam of the graph starts while the one before it drains; ``out_first``: the tail's rescale
    of ``out`` loaded before the coefficients (``mhc_triton.OUT_LOAD_FIRST``)."""
    def call(d):
        was = mk.PDL, mk.OUT_LOAD_FIRST
        mk.PDL, mk.OUT_LOAD_FIRST = pdl, out_first
        try:
            return mk.mhc_seam_triton(d["streams"], d["fn"], d["scale"], d["base"], d["norm_weight"], EPS, **_kw(d),
                                      **blocks)
        finally:
            mk.PDL, mk.OUT_LOAD_FIRST = was
    return call


def _reference(d):
    return mhc_seam_reference(d["streams"], d["fn"], d["scale"], d["base"], d["norm_weight"], EPS, **_kw(d))


def _stock(d):
    from latency_specialized.bench.stock import sparse_mqa_kernels as sk

    w = d["stock"]
    sk.mhc_post_mix(d["streams"], d["y"], d["post"], d["comb"], d["fn"], mix=w["mix"], sqrsum=w["sqrsum"])
    sk.mhc_pre_norm(w["mix"], w["sqrsum"], d["scale"], d["base"], d["streams"], d["pre"], d["norm_weight"],
                    rms_eps=EPS, hc_eps=1e-6, post_mult=2.0, norm_eps=EPS, iters=ITERS, pre=w["pre"], post=w["post"],
                    comb=w["comb"], out=w["out"])
    return w["out"], w["pre"], w["post"], w["comb"]


def _error(fn, d) -> float:
    """Largest error of ``fn`` against the reference on a copy of the set (x relative to its scale)."""
    a = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
    got, want = fn(a), _reference(b)
    err = ((got[0].float() - want[0].float()).abs().max() / want[0].float().abs().max()).item() / TOL_X
    for u, v in zip(got[1:], want[1:]):
        if v is not None:
            err = max(err, (u - v).abs().max().item() / TOL_COEF)
    return err   # <= 1: within tolerance


def _bytes(M: int, H: int, n: int, seam: str) -> int:
    fn = (2 + n) * n * n * H * 4 if seam != "last" else 0
    streams = M * n * H * 2 * (2 if seam != "first" else 1)
    return fn + streams + M * H * 2 * (2 if seam != "first" else 1) + H * 2


def main(argv: list[str] | None = None) -> int:
    global ITERS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/h200", help="where mhc{tag}.{json,md} go")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--hidden", type=int, default=5120, help="DeepSeek-V4.1-Flash hidden (models/deepseek_v41_flash)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--seams", default="middle,first,last")
    ap.add_argument("--sweep", action="store_true", help="also time every block config of SWEEP")
    ap.add_argument("--pdl", action="store_true", help="also time ours launched with PDL (triton_pdl)")
    ap.add_argument("--out-first", action="store_true",
                    help="also time ours with the tail's out row loaded before the coefficients (triton_out_first)")
    ap.add_argument("--sinkhorn-iters", type=int, default=ITERS, help="Sinkhorn iterations (their cost: 20 vs 1)")
    ap.add_argument("--reps", type=int, default=40, help="timed replays per graph (median)")
    ap.add_argument("--rotate-mb", type=float, default=160.0, help="bytes read per graph at least (L2 is 50 MB)")
    ap.add_argument("--max-calls", type=int, default=96, help="seams (distinct input sets) per graph at most")
    ap.add_argument("--no-reference", action="store_true", help="skip timing the torch reference (slow to capture)")
    ap.add_argument("--bw", type=float, default=None,
                    help="roofline bandwidth, bytes/s (default: this GPU's, hardware.roofline_bandwidth)")
    ap.add_argument("--tag", default="", help="suffix of the output file names (sweeps)")
    a = ap.parse_args(argv)
    if a.bw is None:
        from latency_specialized.hardware import roofline_bandwidth

        a.bw = roofline_bandwidth()
    ITERS = a.sinkhorn_iters
    H, n = a.hidden, a.streams
    mk.counter(torch.device("cuda", torch.cuda.current_device()))   # the counters, before any capture
    rows, failed = [], False
    for seam in [s for s in a.seams.split(",") if s]:
        for M in _ints(a.batches):
            nbytes = _bytes(M, H, n, seam)
            calls = max(1, min(a.max_calls, math.ceil(a.rotate_mb * 2 ** 20 / nbytes)))
            g = torch.Generator(device=DEVICE).manual_seed(1000 * M + len(seam))
            sets = [_set(M, H, n, seam, g) for _ in range(calls)]
            variants = {"triton": _ours()}
            if a.pdl:
                variants["triton_pdl"] = _ours(pdl=True)
            if a.out_first:
                variants["triton_out_first"] = _ours(out_first=True)
            if a.sweep:
                for bm, bh, nw in SWEEP:
                    if bm <= 2 * M:
                        variants[f"triton_m{bm}_h{bh}_w{nw}"] = _ours(block_m=bm, block_h=bh, num_warps=nw)
            if not a.no_reference:
                variants["reference"] = _reference
            if seam == "middle":
                variants["stock"] = _stock
            cell = dict(seam=seam, M=M, H=H, n=n, calls=calls, bytes=nbytes,
                        roofline_us=round(nbytes / a.bw * 1e6, 2), blocks=list(mk.choose_blocks(M, H)), us={},
                        error={})
            for name, fn in variants.items():
                try:
                    err = _error(fn, sets[0]) if name != "reference" else 0.0
                except Exception as e:  # noqa: BLE001 - a config that does not build is reported, not fatal
                    cell["error"][name] = f"{type(e).__name__}: {str(e)[:200]}"
                    continue
                cell["error"][name] = round(err, 3)
                if err > 1.0:
                    failed = True
                    print(f"FAIL {seam} M={M} {name}: error {err:.2f} x tolerance", flush=True)
                    continue
                cell["us"][name] = round(time_graph(lambda r, fn=fn: fn(sets[r]), calls, replays=a.reps), 2)
            best = min((v, k) for k, v in cell["us"].items() if k.startswith("triton")) if cell["us"] else None
            cell["best_triton"] = best[1] if best else None
            print(json.dumps(cell), flush=True)
            rows.append(cell)
            del sets
            torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, bw=a.bw, rotate_mb=a.rotate_mb,
                reps=a.reps, sinkhorn_iters=ITERS)
    (out / f"mhc{a.tag}.json").write_text(json.dumps(dict(meta=meta, cells=rows), indent=1))
    names = sorted({k for r in rows for k in r["us"]}, key=lambda k: (k != "triton", k != "stock", k))
    md = ["# mHC seam (residual.mhc), us per seam (median, CUDA graph, inputs rotated beyond L2)", "",
          f"{meta['device']}; n = {n}, H = {H}, bf16 streams, fn fp32; roofline at {a.bw / 1e12:.1f} TB/s.", "",
          "| seam | M | roofline | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    for r in rows:
        md.append(f"| {r['seam']} | {r['M']} | {r['roofline_us']} | "
                  + " | ".join(str(r["us"].get(k, "-")) for k in names) + " |")
    (out / f"mhc{a.tag}.md").write_text("\n".join(md) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
