"""H200: GLM-5.3's block-FP8 routed experts at TP rank shapes - the mma experts (``moe.experts.mma_fp8``, registered
below the Triton kernels until this times it) against ``moe.experts.fp8_triton`` (W8A16), ``fp8_w8a8_triton`` and our
bf16 experts over the same weights dequantised.

    python benchmarks/scripts/fp8_experts_bench.py --tp 8 --batch 1,4,8,16,64 --out DIR

Method as ``ops_bench_q4`` (one CUDA graph per variant running 8 independent routings back to back over expert
weights beyond the L2, median us per step, two captures; every variant checked against the dequantising reference
first). Roofline = the distinct selected experts' stored bytes (e4m3 codes + fp32 128 x 128 scales) + activations over
the device's HBM bandwidth (``hardware.roofline_bandwidth()``). Writes DIR/ops_moe_experts_fp8_glm53_tp<tp>.{json,md};
no FP8 MoE peer is wired here (stock's block-FP8 MoE on Hopper is vLLM's Triton fused MoE, which ``fp8_w8a8_triton``
mirrors in numerics, not code).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from latency_specialized.bench.ops_bench_moe_kda import Row, routing, twice, write_rows
from latency_specialized.bench.ops_bench_q4 import rel_err
from latency_specialized.hardware import roofline_bandwidth
from latency_specialized.ops.moe import experts_reference
from latency_specialized.quant.checkpoint_io import quantize_weight
from latency_specialized.quant.formats import QuantFormat
from latency_specialized.spec import ActivationSpec

FMT = "fp8-block-128"


def glm_shapes(tp: int) -> tuple[dict[str, int], ActivationSpec]:
    """GLM-5.3's MoE at TP ``tp`` from the adapter's spec: experts, top-k, hidden K, the rank's expert width I."""
    from latency_specialized.plugins import get_registry

    spec = get_registry().adapter("glm53").spec("full")
    ffn = next(layer.ffn for layer in spec.layers if layer.ffn.kind == "moe")
    return dict(E=ffn.num_experts, k=ffn.top_k, K=spec.hidden_size, I=ffn.expert_intermediate // tp), ffn.activation


def bench(tp: int, M: int, seed: int, rotations: int = 8, log=print) -> list[Row]:
    from latency_specialized.kernels import moe_experts_fp8_triton as f8
    from latency_specialized.kernels import moe_experts_mma as mm
    from latency_specialized.kernels import moe_experts_triton as tri
    from latency_specialized.kernels.moe_experts import experts as cute_experts

    shape, act = glm_shapes(tp)
    E, k, K, I = shape["E"], shape["k"], shape["K"], shape["I"]
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    w13 = quantize_weight("experts.w13", torch.randn(E, 2 * I, K, generator=g, device=dev) * K ** -0.5, FMT)
    w2 = quantize_weight("experts.w2", torch.randn(E, K, I, generator=g, device=dev) * I ** -0.5, FMT)
    f = QuantFormat.get(FMT)
    xs = [torch.randn(M, K, generator=g, device=dev).bfloat16() for _ in range(rotations)]
    routes = [routing(M, E, k, g, dev) for _ in range(rotations)]
    distinct = statistics.mean(len(torch.unique(ids)) for _, ids in routes)
    nbytes = int(distinct * (f.nbytes((2 * I, K)) + f.nbytes((K, I))) + M * K * 2 * 2)
    case = f"glm53 tp{tp} {FMT} M={M} E={E} k={k} K={K} I={I} ({distinct:.0f} distinct experts)"
    ref = experts_reference(xs[0], routes[0][0], routes[0][1], w13, w2, act)
    outs = [torch.empty(M, K, device=dev, dtype=torch.bfloat16) for _ in range(rotations)]
    b13, b2 = w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16)
    workspaces: dict[int, dict] = {}  # one per rotation's input, as ops_bench_q4 gives the CuTe DSL experts

    def bf16(x, w, ids, _w13, _w2, a, out):
        if M >= tri.MIN_TOKENS:
            return tri.experts_triton(x, w, ids.to(torch.int32), b13, b2, a, out=out)
        return cute_experts(x, w, ids, b13, b2, a, out=out, workspace=workspaces.setdefault(x.data_ptr(), {}))

    variants = [("mma", mm.experts_mma), ("fp8_triton (W8A16)", f8.experts_fp8),
                ("fp8_w8a8_triton", f8.experts_fp8_w8a8), ("bf16-ours", bf16)]
    rows = []
    for name, fn in variants:
        if name == "mma" and M > mm.MAX_TOKENS:
            continue
        try:
            outs[0].fill_(float("nan"))
            fn(xs[0], routes[0][0], routes[0][1], w13, w2, act, out=outs[0])
            err = rel_err(outs[0], ref)
            if not err < 2e-2:  # W8A8's activation rounding stays well inside this; a wrong kernel does not
                rows.append(Row("moe.experts", case, name, [], 0, nbytes, notes=f"wrong: rel err {err:.3g}"))
                continue

            def step(r, fn=fn):
                fn(xs[r], routes[r][0], routes[r][1], w13, w2, act, out=outs[r])

            rows.append(Row("moe.experts", case, name, twice(step, rotations), 0, nbytes,
                            extra=dict(rel_err=round(err, 5))))
        except Exception as e:  # noqa: BLE001 - a failing variant is reported, the others still run
            rows.append(Row("moe.experts", case, name, [], 0, nbytes, notes=f"{type(e).__name__}: {e}"[:300]))
        log(f"{case} {name}: {rows[-1].us} {rows[-1].notes or ''}")
    return rows


def to_markdown(rows: list[Row], device: str) -> str:
    """Every variant per case, its roofline fraction and the W8A16 Triton kernel's time over it."""
    lines = [f"# GLM-5.3 block-FP8 routed experts ({device})", "",
             "CUDA-graph replays, median us per step, two captures each; roofline = stored bytes of the distinct "
             f"selected experts + activations over {roofline_bandwidth() / 1e12:.1f} TB/s (bf16-ours over the "
             "dequantised weights: the same bytes counted, so its fraction is not a bf16 roofline). `vs fp8_triton` "
             "= W8A16 Triton us / this row's.", "",
             "| case | impl | us (run1, run2) | roofline us | roofline frac | vs fp8_triton | rel err | notes |",
             "|---|---|---|---|---|---|---|---|"]
    base = {r.case: r.best_us for r in rows if r.impl.startswith("fp8_triton") and r.us}
    for r in rows:
        us = ", ".join(f"{u:.2f}" for u in r.us) if r.us else "-"
        vs = f"{base[r.case] / r.best_us:.2f}x" if r.us and r.case in base else "-"
        cells = [r.case, r.impl, us, f"{r.roofline_us:.2f}", f"{r.roofline_frac:.2f}" if r.us else "-", vs,
                 str(r.extra.get("rel_err", "-")), r.notes]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--batch", default="1,4,8,16,64")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    t0 = time.perf_counter()
    rows: list[Row] = []
    for b in a.batch.split(","):  # written after every batch: a cut-off run keeps what it measured
        rows += bench(a.tp, int(b), seed=int(b), log=lambda s: print(f"[{time.perf_counter() - t0:6.1f}s] {s}",
                                                                       flush=True))
        write_rows(rows, a.out, f"ops_moe_experts_fp8_glm53_tp{a.tp}", to_markdown)


if __name__ == "__main__":
    main()
