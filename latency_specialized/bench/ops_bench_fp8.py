"""Op bench (H200): block-FP8 decode gemms against the peers, the stock stand-in, bf16 cuBLAS and the roofline.

Method as ``ops_bench_moe_kda.time_graph``: one CUDA graph calls the gemm over ``R`` weight copies back to back
(R copies spanning > 2x the 50 MB L2: every call streams its weight from HBM), replayed after warm-up, median us
per call, each variant captured twice. Per shape and M, in one process on the same inputs:

* ``mma[cfg]``: ours, the CuTe DSL mma.sync kernel (``kernels/gemm_fp8_mma.py``), its heuristic and ``MMA_SWEEP``;
* ``w8a16[cfg]`` / ``w8a8[cfg]``: ours in Triton (``kernels/gemm_fp8_triton.py``) per launch config (the heuristic
  default and a sweep of tile width, split-K and stages), each checked against the dequantising reference first
  (``rel_err``; W8A8 within e4m3's error);
* ``peer-humming``: vLLM 0.33's humming block-FP8 linear (W8A16; ``bench/peers/humming_fp8.py``): 128 x 128 blocks,
  and DeepSeek-V4.1's 32 x 32 as MXFP8 (what vLLM serves them as; stock runs Marlin's MXFP8 W8A16 there);
* ``stock``: the stand-in for vLLM's CUTLASS block-FP8 W8A8 path (``bench/stock/fp8_block.py``), 128 x 128 only;
* ``bf16-cublas``: cuBLAS over the dequantised bf16 weight (what the loaders ran until now: 2x the bytes).

Each row that cannot run says why. Roofline = stored bytes (codes + scales) + activations + output, over the
device's HBM bandwidth (``hardware.roofline_bandwidth()``; bf16 rows: 2 bytes a weight).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch

from latency_specialized.bench.ops_bench_moe_kda import Row, twice, write_rows
from latency_specialized.hardware import roofline_bandwidth

SHAPES: dict[str, tuple[int, int, str]] = {
    "glm53-tp8 q_a+kv_a": (2624, 6144, "fp8-block-128"),
    "glm53-tp8 q_b+wq_b": (6144, 2048, "fp8-block-128"),
    "glm53-tp8 o_proj": (6144, 2048, "fp8-block-128"),
    "glm53-tp8 dense gate_up": (3072, 6144, "fp8-block-128"),
    "glm53-tp4 o_proj": (6144, 4096, "fp8-block-128"),
    "glm53-tp4 dense gate_up": (6144, 6144, "fp8-block-128"),
    "glm53-tp4 dense down": (6144, 3072, "fp8-block-128"),
    "dsv41-tp1 wq_b": (32768, 1280, "fp8-block-32"),
    "dsv41-tp2 wo_b": (5120, 4096, "fp8-block-32"),
    "dsv41-tp8 wq_b": (4096, 1280, "fp8-block-32"),
}
"""Shard shapes (N, K, format): GLM-5.3 (hidden 6144, q_lora 2048, kv 512 + 64, 64 heads x v 256, dense 12288) and
DeepSeek-V4.1-Flash (hidden 5120, q_lora 1280, 64 heads x 512, 8 output groups x o_lora 1024)."""
NORM_SHAPES = ("glm53-tp8 q_b+wq_b", "dsv41-tp8 wq_b")
"""Gemms behind a norm site (MLA's q_a norm, DeepSeek's q norm): timed at M <= NORM_BENCH_MAX_M with the RMSNorm in
the gemm's prologue (``gemm.fp8_w8a16_norm_triton``) against the plan's norm kernel + the gemm - where the
prologue stops paying decides ``gemm_fp8_triton.NORM_MAX_M``."""
NORM_BENCH_MAX_M = 16
SWEEP = dict(block_n=(64, 128), split_k=(1, 2, 4, 8), num_stages=(3, 4))
"""Launch configs timed beside the heuristic default (``--quick``: the default only)."""
L2_BYTES = 50 * 2 ** 20
STOCK_MXFP8 = ("stock: Marlin MXFP8 W8A16 (vLLM _C, not loadable here); humming's MXFP8 W8A16 is the peer column")
"""DeepSeek-V4.1-Flash's 32 x 32 blocks: vLLM 0.33 serves them as MXFP8 and on an H200 runs Marlin's W8A16 kernel
(``bench/peers/humming_fp8.py``, ``MX_BLOCK``) - no stand-in of it here; the peer column is humming's MXFP8."""
MMA_SWEEP = ((4, 1, 4), (8, 1, 4), (4, 2, 4), (2, 4, 4), (4, 1, 8), (8, 1, 2), (2, 2, 8))
"""(warps along K, cluster CTAs along K, chunks per batch) of ``gemm.fp8_w8a16_mma`` timed beside its heuristic (its
m-tiles / n-tiles follow M as the heuristic's do), the heuristic with the "split" pairing (``MmaConfig.fp8_pairs``) and
with ``MmaConfig.prefetch`` flipped (its first batch of weights ahead of the PDL wait in SASS, or not; on by default
since session 35); swept even with ``--quick`` (the kernel is new)."""
REL_TOL = {"mma": 1e-2, "w8a16": 1e-2, "w8a8": 6e-2, "peer-humming": 1e-2, "stock": 6e-2, "bf16-cublas": 1e-2}


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


def _weights(N: int, K: int, fmt: str, copies: int, g: torch.Generator) -> list[Any]:
    from latency_specialized.quant.checkpoint_io import quantize_weight

    return [quantize_weight(f"w{i}.weight", torch.randn(N, K, generator=g, device="cuda") * K ** -0.5, fmt)
            for i in range(copies)]


def _configs(quick: bool) -> list[Any]:
    from latency_specialized.kernels.gemm_fp8_triton import Fp8GemmConfig

    if quick:
        return [None]
    return [None] + [Fp8GemmConfig(block_n=bn, split_k=sk, num_stages=st)
                     for bn, sk, st in itertools.product(*SWEEP.values())]


def bench_fp8_gemms(shapes: list[str], batches: list[int], *, quick: bool = False, seed: int = 0,
                    log: Callable[[str], None] = print) -> list[Row]:
    from latency_specialized.kernels import gemm_fp8_triton as f8
    from latency_specialized.kernels.gemm_fp8_mma import default_config as mma_default
    from latency_specialized.kernels.gemm_fp8_mma import gemm_fp8_mma
    from latency_specialized.ops.gemm import gemm_reference

    rows: list[Row] = []
    g = torch.Generator(device="cuda").manual_seed(seed)
    for label in shapes:
        N, K, fmt = SHAPES[label]
        probe = _weights(N, K, fmt, 1, g)[0]
        copies = max(2, -(-2 * L2_BYTES // probe.nbytes))
        ws = [probe] + _weights(N, K, fmt, copies - 1, g)
        wbytes = probe.nbytes
        bf16 = [w.dequantize(torch.bfloat16) for w in ws]
        peer, peer_why = _peer(ws)
        stock, stock_why = _stock(ws) if fmt == "fp8-block-128" else (None, STOCK_MXFP8)
        for M in batches:
            xs = [torch.randn(M, K, generator=g, device="cuda").bfloat16() for _ in ws]
            outs = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in ws]
            ref = gemm_reference(xs[0], ws[0])
            act = M * K * 2 + M * N * 2
            case = f"{label} N={N} K={K} {fmt} M={M} ({copies} copies)"
            for cfg in _mma_configs(N, K, M):
                name = f"mma[{cfg.label() if cfg else 'default'}]"
                rows.append(_time(case, name, "mma", lambda r, c=cfg: gemm_fp8_mma(xs[r], ws[r], out=outs[r], config=c),
                                  ref, outs, len(ws), wbytes + act,
                                  extra={"config": cfg.label() if cfg else "default " + mma_default(N, K, M).label()}))
            for impl, fn in (("w8a16", f8.gemm_fp8_w8a16), ("w8a8", f8.gemm_fp8_w8a8)):
                for cfg in _configs(quick):
                    name = f"{impl}[{cfg.label() if cfg else 'default'}]"
                    rows.append(_time(case, name, impl, lambda r, c=cfg, f=fn: f(xs[r], ws[r], out=outs[r], config=c),
                                      ref, outs, len(ws), wbytes + act, extra=_cfg_extra(cfg, f8, N, K, M, fmt)))
            rows.append(_time(case, "bf16-cublas", "bf16-cublas",
                              lambda r: torch.mm(xs[r], bf16[r].t(), out=outs[r]), ref, outs, len(ws),
                              N * K * 2 + act))
            if peer is not None:
                rows.append(_time(case, "peer-humming", "peer-humming", lambda r: outs[r].copy_(peer[r](xs[r])),
                                  ref, outs, len(ws), wbytes + act, extra={"note": "output copied into place"}))
            else:
                rows.append(Row("gemm", case, "peer-humming", [], 0, wbytes + act, notes=peer_why))
            if stock is not None:
                rows.append(_time(case, "stock", "stock", lambda r: outs[r].copy_(stock[r](xs[r])), ref, outs,
                                  len(ws), wbytes + act, extra={"note": "output copied into place"}))
            else:
                rows.append(Row("gemm", case, "stock", [], 0, wbytes + act, notes=stock_why))
            if label in NORM_SHAPES and M <= NORM_BENCH_MAX_M:
                rows += _norm_rows(case, xs, ws, outs, wbytes + act, g)
            best = _best(rows, case)
            log(f"{case}: " + ", ".join(f"{k} {v:.2f}" for k, v in best.items()))
        del bf16, ws, peer, stock
        torch.cuda.empty_cache()
    return rows


def _mma_configs(N: int, K: int, M: int) -> list[Any]:
    """None (the heuristic) and ``MMA_SWEEP`` around it: the split of K varied, the tiles kept."""
    from dataclasses import replace

    from latency_specialized.kernels.gemm_fp8_mma import MAX_CLUSTER, default_config
    from latency_specialized.kernels.gemm_small_m import SMEM_LIMIT

    base = default_config(N, K, M)
    out: list[Any] = [None, replace(base, fp8_pairs="split"), replace(base, prefetch=not base.prefetch)]
    for wk, sk, cb in MMA_SWEEP:
        cfg = replace(base, wk=wk, sk=sk, cb=cb)
        if cfg != base and cfg.smem_bytes() <= SMEM_LIMIT and sk <= MAX_CLUSTER and K // 64 >= wk * sk:
            out.append(cfg)
    return out


def _norm_rows(case: str, xs: list[torch.Tensor], ws: list[Any], outs: list[torch.Tensor], nbytes: int,
               g: torch.Generator) -> list[Row]:
    """``w8a16+norm``: the RMSNorm in the gemm's prologue; ``norm+w8a16``: the norm kernel the plan would pick for
    that width (``norm`` family on this GPU), then the gemm."""
    from latency_specialized import hardware
    from latency_specialized.kernels import gemm_fp8_triton as f8
    from latency_specialized.ops.gemm import gemm_reference
    from latency_specialized.ops.registry import make_context
    from latency_specialized.plugins import get_registry

    M, K = xs[0].shape
    gain = (1 + 0.1 * torch.randn(K, generator=g, device="cuda")).bfloat16()
    ref = gemm_reference(xs[0], ws[0], norm_weight=gain, norm_eps=1e-6)
    ctx = make_context("norm", arch=hardware.probe().arch, dtype="bfloat16", tokens=M, dims={"N": K})
    norm, _ = get_registry().implementations.select(ctx, allow_reference=False)
    normed = [torch.empty_like(x) for x in xs]
    out = [_time(case, "w8a16+norm[prologue]", "w8a16",
                 lambda r: f8.gemm_fp8_w8a16(xs[r], ws[r], out=outs[r], norm_weight=gain, norm_eps=1e-6),
                 ref, outs, len(ws), nbytes)]
    if norm is None:
        return out + [Row("gemm", case, "norm+w8a16[separate]", [], 1, nbytes, notes="no norm kernel for this width")]
    sep = _time(case, "norm+w8a16[separate]", "w8a16",
                lambda r: f8.gemm_fp8_w8a16(norm.fn(xs[r], gain, 1e-6, out=normed[r]), ws[r], out=outs[r]),
                ref, outs, len(ws), nbytes, extra={"norm": norm.name})
    return out + [sep]


def _cfg_extra(cfg: Any, f8: Any, N: int, K: int, M: int, fmt: str) -> dict[str, Any]:
    if cfg is not None:
        return {"config": cfg.label()}
    step = 32 if fmt == "fp8-block-32" else 128
    return {"config": "default " + f8.default_config(N, K, M, step).label()}


def _time(case: str, name: str, kind: str, step: Callable[[int], Any], ref: torch.Tensor, outs: list[torch.Tensor],
          copies: int, nbytes: int, extra: dict[str, Any] | None = None) -> Row:
    extra = dict(extra or {})
    try:
        outs[0].fill_(float("nan"))
        step(0)
        torch.cuda.synchronize()
        err = _rel(outs[0], ref)
        extra["rel_err"] = round(err, 5)
        if not err <= REL_TOL[kind]:
            return Row("gemm", case, name, [], 1, nbytes, notes=f"wrong: rel err {err:.3g}", extra=extra)
        return Row("gemm", case, name, twice(step, copies), 1, nbytes, extra=extra)
    except Exception as e:  # noqa: BLE001 - a failing variant is reported, the others still run
        return Row("gemm", case, name, [], 1, nbytes, notes=f"{type(e).__name__}: {e}"[:300], extra=extra)


def _peer(ws: list[Any]) -> tuple[list[Any] | None, str]:
    try:
        from latency_specialized.bench.peers.humming_fp8 import HummingFp8BlockLinear

        return [HummingFp8BlockLinear().prepare(w.weight, w.scale) for w in ws], ""
    except Exception as e:  # noqa: BLE001 - the table says why the peer did not run
        return None, f"humming unavailable: {type(e).__name__}: {e}"[:300]


def _stock(ws: list[Any]) -> tuple[list[Any] | None, str]:
    try:
        from latency_specialized.bench.stock.fp8_block import StockBlockFp8Linear

        return [StockBlockFp8Linear(w.weight, w.scale) for w in ws], ""
    except Exception as e:  # noqa: BLE001
        return None, f"stock stand-in unavailable: {type(e).__name__}: {e}"[:300]


def _best(rows: list[Row], case: str) -> dict[str, float]:
    """Best us per kind (ours: best config of each path) for one case."""
    out: dict[str, float] = {}
    for r in rows:
        if r.case == case and r.us:
            kind = r.impl.split("[")[0]
            out[kind] = min(out.get(kind, float("inf")), r.best_us)
    return out


def to_markdown(rows: list[Row], device: str) -> str:
    cases = list(dict.fromkeys(r.case for r in rows))
    lines = [f"# Block-FP8 decode gemms ({device})", "",
             "CUDA-graph replays over weight copies beyond the L2, median us per call, two captures each. Roofline = "
             f"stored bytes (e4m3 codes + scales) + activations + output over {roofline_bandwidth() / 1e12:.1f} TB/s. "
             "Ours: the best launch config "
             "of each path (all configs in the JSON); `default` = the heuristic a plan uses today.", "",
             "| case | roofline us | mma best (default) | w8a16 best (default) | w8a8 best (default) | humming | "
             "stock stand-in | bf16 cuBLAS | best ours frac | best ours vs humming | vs stock |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in cases:
        rs = [r for r in rows if r.case == case]
        roof = rs[0].roofline_us
        best = _best(rows, case)
        default = {r.impl.split("[")[0]: r.best_us for r in rs if r.impl.endswith("[default]") and r.us}

        def cell(k: str) -> str:
            if k not in best:
                why = next((r.notes for r in rs if r.impl.split("[")[0] == k and r.notes), "")
                return f"- ({why[:60]})" if why else "-"
            return f"{best[k]:.2f}" + (f" ({default[k]:.2f})" if k in default else "")

        ours = min((best[k] for k in ("mma", "w8a16", "w8a8") if k in best), default=0.0)
        frac = f"{roof / ours:.2f}" if ours else "-"
        vs_h = f"{best['peer-humming'] / ours:.2f}x" if ours and "peer-humming" in best else "-"
        vs_s = f"{best['stock'] / ours:.2f}x" if ours and "stock" in best else "-"
        lines.append(f"| {case} | {roof:.2f} | {cell('mma')} | {cell('w8a16')} | {cell('w8a8')} | {cell('peer-humming')} | "
                     f"{cell('stock')} | {cell('bf16-cublas')} | {frac} | {vs_h} | {vs_s} |")
    norm_cases = [c for c in cases if any(r.case == c and r.impl.startswith("w8a16+norm") for r in rows)]
    if norm_cases:
        lines += ["", "Behind a norm site (`NORM_MAX_M`): the RMSNorm in the gemm's prologue vs the norm kernel + the gemm "
                  "(default launch config both).", "", "| case | w8a16+norm (prologue) | norm kernel + w8a16 |", "|---|---|---|"]
        for case in norm_cases:
            got = {r.impl.split("[")[0]: (f"{r.best_us:.2f}" if r.us else f"- ({r.notes[:60]})") for r in rows
                   if r.case == case and r.impl.startswith(("w8a16+norm", "norm+w8a16"))}
            lines.append(f"| {case} | {got.get('w8a16+norm', '-')} | {got.get('norm+w8a16', '-')} |")
    return "\n".join(lines) + "\n"


def write(rows: list[Row], out_dir: str, stem: str = "ops_gemm_fp8") -> None:
    write_rows(rows, out_dir, stem, to_markdown)


__all__ = ["SHAPES", "SWEEP", "bench_fp8_gemms", "to_markdown", "write"]
