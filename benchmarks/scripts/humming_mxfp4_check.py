"""Check and time the humming MXFP4 MoE peer: stock vLLM 0.33's routed experts on Hopper, on one GPU.

Builds random MXFP4 expert weights in the compressed-tensors layout (random e2m1 codes with ue8m0 scales
in ``[--scale-lo, --scale-hi]``, or ``--weights quantize``: random bf16 weights through
``quant.codecs.mxfp4_quantize``), converts them as vLLM does at load (``HummingMxfp4MoE.prepare``), then per
batch M:

* checks the peer against the torch reference: the weights dequantised with ``mxfp4_dequantize``, through
  ``ops.moe.experts_reference`` with the same ``ActivationSpec`` - after the eager calls and again after the
  graph replays; the error is ``max|out - ref| / max|ref|`` (``rel_l2`` too);
* times it: a CUDA graph of ``--rotations`` calls on different inputs and routings back to back (their
  experts' weights together exceed the 60 MB L2), ``--warmup`` replays, then ``--replays`` replays each timed
  with CUDA events; the figure is the median us per call, measured ``--runs`` times (``us`` = the lowest).
  Eager timing, with a printed warning, only if graph capture fails.

Writes ``humming_mxfp4_check.json`` ({batch: {us, rel_err, ...}}) and ``humming_mxfp4_meta.json`` (which
humming ran, from where, with which compiler and CUDA tree; the peer's description) to ``--out``. Exit
status 1 if an error exceeds ``--tol``, 2 if humming or a GPU is missing.

Needs torch with CUDA, triton, this repo (with pydantic) and humming-kernels; no vLLM. The first call
JIT-compiles humming's kernels for every M interval of its tuning lists (minutes; cached in
``$HUMMING_CACHE_DIR``, default ``~/.humming/cache``). With the humming wheel copied into the git-ignored
``.whl/`` beside the repo's other carried wheels (pydantic & co), on the H200 device machine (carry ``.whl``),
from the repo root::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hk .whl/humming_kernels-*.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v humming)
    PYTHONPATH=/tmp/hk:/tmp/site python3 benchmarks/scripts/humming_mxfp4_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from latency_specialized.bench.ops_bench_moe_kda import time_graph  # the op benches' graph timing

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=896)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--hidden", type=int, default=3584, help="K (the w13 input) and N (the w2 output)")
    p.add_argument("--inter", type=int, default=384, help="I, the expert width per rank")
    p.add_argument("--batch", type=_ints, default=[1, 8, 64], help="comma-separated token counts M")
    p.add_argument("--out", required=True, help="directory for the JSON results")
    p.add_argument("--activation", choices=("situ_glu", "swiglu"), default="situ_glu")
    p.add_argument("--beta", type=float, default=4.0, help="SiTU-GLU gate saturation (Kimi K3: 4)")
    p.add_argument("--beta-lin", type=float, default=25.0, help="SiTU-GLU up saturation (Kimi K3: 25)")
    p.add_argument("--clamp", type=float, default=None, help="SwiGLU clamp (none by default)")
    p.add_argument("--activation-backend", choices=("humming", "triton"), default="humming",
                   help="humming: vLLM's (the activation in humming's process-input kernel); triton: ours")
    p.add_argument("--weights", choices=("codes", "quantize"), default="codes",
                   help="codes: random e2m1 codes + ue8m0 scales; quantize: mxfp4_quantize of random bf16")
    p.add_argument("--scale-lo", type=int, default=118, help="lowest ue8m0 byte (codes)")
    p.add_argument("--scale-hi", type=int, default=124, help="highest ue8m0 byte (codes)")
    p.add_argument("--weight-std", type=float, default=0.02, help="std of the bf16 weights (quantize)")
    p.add_argument("--x-std", type=float, default=None,
                   help="std of x (default: 1 / (sqrt(K) * rms(w13)), gate/up outputs of about unit size)")
    p.add_argument("--rotations", type=int, default=8, help="input sets per graph (different routings)")
    p.add_argument("--replays", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--runs", type=int, default=2, help="timings per batch (each its own capture)")
    p.add_argument("--check-rotations", type=int, default=2, help="rotations checked against the reference")
    p.add_argument("--tol", type=float, default=3e-2, help="largest accepted max|out-ref| / max|ref|")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.hidden % 32 or a.inter % 32:
        p.error("--hidden and --inter must be multiples of 32 (MXFP4 blocks)")
    if not 0 < a.top_k <= a.experts:
        p.error("--top-k must be in [1, --experts]")
    if not 0 <= a.scale_lo <= a.scale_hi <= 254:
        p.error("need 0 <= --scale-lo <= --scale-hi <= 254 (255 is NaN)")
    if a.activation == "situ_glu" and not (a.beta > 0 and a.beta_lin > 0):
        p.error("situ_glu needs --beta > 0 and --beta-lin > 0 (the reference applies both)")
    if not a.batch or min(a.batch) < 1:
        p.error("--batch: positive token counts")
    a.rotations = max(1, a.rotations)
    a.check_rotations = max(1, min(a.check_rotations, a.rotations))
    return a


# ------------------------------------------------------------------------------------------ weights
def make_weights(args: argparse.Namespace, dev: torch.device, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Compressed-tensors MXFP4 expert weights: w13 [E, 2I, K/2] + [E, 2I, K/32], w2 [E, N, I/2] + [E, N, I/32]."""
    from latency_specialized.quant.codecs import mxfp4_quantize

    E, K, inter, N = args.experts, args.hidden, args.inter, args.hidden
    out: dict[str, torch.Tensor] = {}
    for name, rows, cols in (("w13", 2 * inter, K), ("w2", N, inter)):
        if args.weights == "codes":
            out[f"{name}_packed"] = torch.randint(0, 256, (E, rows, cols // 2), dtype=torch.uint8, device=dev,
                                                  generator=g)
            out[f"{name}_scale"] = torch.randint(args.scale_lo, args.scale_hi + 1, (E, rows, cols // 32),
                                                 dtype=torch.uint8, device=dev, generator=g)
        else:
            packed = torch.empty(E, rows, cols // 2, dtype=torch.uint8, device=dev)
            scale = torch.empty(E, rows, cols // 32, dtype=torch.uint8, device=dev)
            for lo in range(0, E, 32):
                hi = min(lo + 32, E)
                w = torch.randn(hi - lo, rows, cols, device=dev, generator=g) * args.weight_std
                packed[lo:hi], scale[lo:hi] = mxfp4_quantize(w.to(torch.bfloat16), name=f"{name}[{lo}:{hi}]")
                del w
            out[f"{name}_packed"], out[f"{name}_scale"] = packed, scale
    return out


def dequantize_bf16(packed: torch.Tensor, scale: torch.Tensor, chunk: int = 32) -> torch.Tensor:
    """[E, R, C/2] + [E, R, C/32] -> [E, R, C] bf16 (exact: e2m1 x 2^e fits bf16), a few experts at a time."""
    from latency_specialized.quant.codecs import mxfp4_dequantize

    E, R, half = packed.shape
    out = torch.empty(E, R, 2 * half, dtype=torch.bfloat16, device=packed.device)
    for lo in range(0, E, chunk):
        out[lo:lo + chunk] = mxfp4_dequantize(packed[lo:lo + chunk], scale[lo:lo + chunk]).to(torch.bfloat16)
    return out


def routing(M: int, E: int, k: int, dev: torch.device, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 weights (positive, summing to 1) and int32 ids (distinct per row) [M, k]."""
    ids = torch.randn(M, E, device=dev, generator=g).topk(k, dim=-1).indices.to(torch.int32)
    w = torch.rand(M, k, device=dev, generator=g) + 0.05
    return (w / w.sum(-1, keepdim=True)).contiguous(), ids.contiguous()


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max|out-ref| / max|ref|, ||out-ref|| / ||ref||), NaN-aware (a NaN anywhere gives inf)."""
    d = (out.float() - ref.float())
    if not bool(torch.isfinite(out.float()).all()):
        return math.inf, math.inf
    scale = ref.float().abs().max().clamp_min(1e-30)
    return float(d.abs().max() / scale), float(d.norm() / ref.float().norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------- timing
def time_eager(step: Callable[[int], None], rotations: int, replays: int, warmup: int) -> float:
    """Median us per call of eager ``step(r)`` loops (host launch overhead included)."""
    for _ in range(warmup):
        for r in range(rotations):
            step(r)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for e0, e1 in events:
        e0.record()
        for r in range(rotations):
            step(r)
        e1.record()
    torch.cuda.synchronize()
    return statistics.median(e0.elapsed_time(e1) * 1e3 / rotations for e0, e1 in events)


def stepper(moe: Callable, xs: list[torch.Tensor], routes: list[tuple[torch.Tensor, torch.Tensor]],
            outs: list[torch.Tensor]) -> Callable[[int], None]:
    """``step(r)``: the peer on input set r, into ``outs[r]``."""

    def step(r: int) -> None:
        moe(xs[r], routes[r][0], routes[r][1], out=outs[r])

    return step


# --------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("ERROR: no CUDA device: humming runs on the GPU", flush=True)
        return 2

    from latency_specialized.bench.peers.humming_mxfp4 import (
        HummingMxfp4MoE,
        humming_runtime_info,
    )
    from latency_specialized.errors import UserError
    from latency_specialized.ops.moe import experts_reference
    from latency_specialized.spec import ActivationSpec

    try:
        info = humming_runtime_info()
    except UserError as e:
        print(f"ERROR: {e}", flush=True)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    cap = torch.cuda.get_device_capability(dev)
    print(f"humming ran: humming-kernels {info['version']} (commit {info['commit']}) from {info['path']}", flush=True)
    print(f"  compiler {info['compiler']}; CUDA tree {info['cuda_tree']}; NVRTC {info['nvrtc_library']}; "
          f"cache {info['cache_dir']}; vLLM 0.33.0 pins humming-kernels {info['vllm_pins']}", flush=True)
    import triton

    print(f"device {torch.cuda.get_device_name(dev)} (sm_{cap[0]}{cap[1]}); torch {torch.__version__} "
          f"(CUDA {torch.version.cuda}); triton {triton.__version__}", flush=True)
    if cap != (9, 0):
        print(f"WARNING: the peer stands for vLLM on SM90; this device is sm_{cap[0]}{cap[1]}", flush=True)
    meta: dict = {"humming": info, "device": torch.cuda.get_device_name(dev), "capability": list(cap),
                  "torch": torch.__version__, "torch_cuda": torch.version.cuda, "triton": triton.__version__,
                  "args": dict(vars(args)),
                  "method": (f"CUDA graph of {args.rotations} calls on different inputs/routings, {args.warmup} "
                             f"warm-up replays, median of {args.replays} event-timed replays per call, {args.runs} "
                             "runs (us = lowest); rel_err = max|out-ref|/max|ref| vs ops.moe.experts_reference on "
                             "the dequantised weights, after the eager calls and after the replays")}
    results: dict[str, dict] = {}

    def write() -> None:  # after every step, so that a crash or a time-out still leaves what was measured
        (out_dir / "humming_mxfp4_check.json").write_text(json.dumps(results, indent=1) + "\n")
        (out_dir / "humming_mxfp4_meta.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")

    write()

    E, K, inter, N = args.experts, args.hidden, args.inter, args.hidden
    g = torch.Generator(device=dev)
    g.manual_seed(args.seed)
    t0 = time.perf_counter()
    wts = make_weights(args, dev, g)
    print(f"weights: E={E} K={K} I={inter} N={N} ({args.weights}): "
          f"{sum(t.numel() for t in wts.values()) / 1e9:.2f} GB packed, {time.perf_counter() - t0:.1f} s", flush=True)

    if args.activation == "situ_glu":
        spec = ActivationSpec(kind="situ_glu", beta=args.beta, beta_lin=args.beta_lin)
        act_kw = {"beta": args.beta, "beta_lin": args.beta_lin}
    else:
        spec = ActivationSpec(kind="swiglu", clamp=args.clamp)
        act_kw = {"clamp": args.clamp}

    moe = HummingMxfp4MoE()
    t0 = time.perf_counter()
    try:
        moe.prepare(wts["w13_packed"], wts["w13_scale"], wts["w2_packed"], wts["w2_scale"],
                    activation_kind=args.activation, activation_backend=args.activation_backend, **act_kw)
    except Exception as e:  # noqa: BLE001 - recorded in the meta file
        if not isinstance(e, UserError):
            traceback.print_exc()
        print(f"ERROR: prepare failed: {type(e).__name__}: {e}", flush=True)
        meta["error"] = f"prepare: {type(e).__name__}: {e}"
        write()
        return 2
    torch.cuda.synchronize()
    prepare_s = time.perf_counter() - t0
    print(f"prepare (vLLM's load-time conversion, incl. humming's JIT weight kernels): {prepare_s:.1f} s", flush=True)
    meta["prepare_s"] = round(prepare_s, 2)

    w13_ref = dequantize_bf16(wts["w13_packed"], wts["w13_scale"])
    w2_ref = dequantize_bf16(wts["w2_packed"], wts["w2_scale"])
    x_std = args.x_std
    if x_std is None:
        x_std = 1.0 / (math.sqrt(K) * float(w13_ref[0].float().pow(2).mean().sqrt()))
    print(f"x std {x_std:.4g}", flush=True)
    meta["x_std"] = x_std

    failed = False
    for M in args.batch:
        try:
            results[str(M)] = check_batch(args, moe, M, dev, g, x_std, w13_ref, w2_ref, spec, experts_reference)
        except Exception as e:  # noqa: BLE001 - recorded; later batches may still run
            traceback.print_exc()
            results[str(M)] = {"us": None, "rel_err": None, "ok": False, "error": f"{type(e).__name__}: {e}"}
        failed |= not results[str(M)]["ok"]
        meta["peer"] = moe.describe()
        write()
    print(f"wrote {out_dir / 'humming_mxfp4_check.json'} and humming_mxfp4_meta.json", flush=True)
    return 1 if failed else 0


def check_batch(args: argparse.Namespace, moe: Callable, M: int, dev: torch.device, g: torch.Generator,
                x_std: float, w13_ref: torch.Tensor, w2_ref: torch.Tensor, spec: object,
                experts_reference: Callable) -> dict:
    """Check and time one batch M (see the module docstring); the JSON entry for it."""
    E, K, N, k = args.experts, args.hidden, args.hidden, args.top_k
    R = args.rotations
    xs = [(torch.randn(M, K, device=dev, generator=g) * x_std).to(torch.bfloat16) for _ in range(R)]
    routes = [routing(M, E, k, dev, g) for _ in range(R)]
    outs = [torch.empty(M, N, dtype=torch.bfloat16, device=dev) for _ in range(R)]
    step = stepper(moe, xs, routes, outs)

    t0 = time.perf_counter()
    step(0)  # first call of this shape: humming compiles (all tuning intervals, once), buffers allocated
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for r in range(1, R):
        step(r)
    torch.cuda.synchronize()
    refs = [experts_reference(xs[r], routes[r][0], routes[r][1].long(), w13_ref, w2_ref, spec)
            for r in range(args.check_rotations)]
    eager_err = [errors(outs[r], refs[r]) for r in range(args.check_rotations)]

    runs: list[float] = []
    timing = "cuda-graph"
    for _ in range(args.runs):
        if timing == "cuda-graph":
            try:
                runs.append(time_graph(step, R, replays=args.replays, warmup=args.warmup))
                continue
            except Exception as e:  # noqa: BLE001 - reported, then timed eagerly
                print(f"WARNING: M={M}: CUDA-graph capture failed ({type(e).__name__}: {e}); timing eager "
                      "calls instead (host launch overhead included)", flush=True)
                timing = "eager"
                torch.cuda.synchronize()
        runs.append(time_eager(step, R, args.replays, args.warmup))
    torch.cuda.synchronize()
    after_err = [errors(outs[r], refs[r]) for r in range(args.check_rotations)]
    rel = max(e[0] for e in eager_err + after_err)
    rel_l2 = max(e[1] for e in eager_err + after_err)
    ok = rel <= args.tol
    b13, b2 = moe.block_m(M, k)
    print(f"M={M:4d}: {min(runs):8.2f} us/call ({timing}; runs {', '.join(f'{u:.2f}' for u in runs)}) "
          f"rel_err {rel:.3e} (l2 {rel_l2:.3e}) {'ok' if ok else 'FAIL > ' + str(args.tol)}; "
          f"block_m w13/w2 {b13}/{b2}; first call {first_s:.1f} s", flush=True)
    return {"us": round(min(runs), 3), "rel_err": rel, "rel_l2": rel_l2, "ok": ok,
            "us_runs": [round(u, 3) for u in runs], "timing": timing,
            "rel_err_eager": max(e[0] for e in eager_err), "rel_err_after_timing": max(e[0] for e in after_err),
            "first_call_s": round(first_s, 2), "block_m": [b13, b2]}


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
