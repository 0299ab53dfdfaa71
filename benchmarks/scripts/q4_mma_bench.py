"""H200: the MXFP4 mma kernel (``kernels/gemm_q4_mma.py``) streaming a Kimi K3 TP8 batch-1 expert load, before the
experts kernel exists: the 8 selected experts' gate | up stacked ([8 x 2 x 512, 7168]) and their downs side by side
along K ([7168, 8 x 512]), M 1 / 4 / 16, CUDA-graph replays over copies beyond the L2, median us; beside the 4-bit
roofline (codes + scales at the device's HBM bandwidth, ``hardware.roofline_bandwidth()``) and bf16 cuBLAS over the
dequantised weights. Writes DIR/q4_mma.{json,md}.

    python benchmarks/scripts/q4_mma_bench.py --out DIR
"""

from __future__ import annotations

import argparse

import torch

from latency_specialized.bench.ops_bench_moe_kda import Row, twice, write_rows
from latency_specialized.hardware import roofline_bandwidth

SHAPES = {"8 experts gate|up": (8 * 1024, 7168), "8 experts down": (7168, 8 * 512)}
L2_BYTES = 50 * 2 ** 20


def _md(rows: list[Row], device: str) -> str:
    lines = [f"# MXFP4 mma kernel, batch-1 expert bytes ({device})", "",
             f"Roofline: codes + scales at {roofline_bandwidth() / 1e12:.1f} TB/s.", "",
             "| case | impl | us (two captures) | roofline us | frac | notes |", "|---|---|---|---|---|---|"]
    for r in rows:
        roof = r.bytes / roofline_bandwidth() * 1e6
        best = min(r.us) if r.us else 0
        frac = f"{roof / best:.2f}" if best else "-"
        lines.append(f"| {r.case} | {r.impl} | {r.us} | {roof:.2f} | {frac} | {r.notes} {r.extra or ''} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from latency_specialized.kernels import gemm_q4_mma as q4m
    from latency_specialized.ops.gemm import gemm_reference
    from latency_specialized.quant.checkpoint_io import quantize_weight

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--batch", default="1,4,16")
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows: list[Row] = []
    for label, (N, K) in SHAPES.items():
        probe = quantize_weight("w.weight", torch.randn(N, K, generator=g, device="cuda") * K ** -0.5, "mxfp4")
        copies = max(2, -(-2 * L2_BYTES // probe.nbytes))
        ws = [probe] + [quantize_weight(f"w{i}.weight", torch.randn(N, K, generator=g, device="cuda") * K ** -0.5,
                                        "mxfp4") for i in range(copies - 1)]
        bf = [w.dequantize(torch.bfloat16) for w in ws]
        for M in [int(b) for b in a.batch.split(",")]:
            xs = [torch.randn(M, K, generator=g, device="cuda").bfloat16() for _ in ws]
            outs = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in ws]
            case = f"{label} N={N} K={K} M={M} ({copies} copies)"
            act = M * K * 2 + M * N * 2
            ref = gemm_reference(xs[0], ws[0])
            for name, fn, nbytes in (
                    ("mxfp4-mma", lambda r: q4m.gemm_mxfp4_mma(xs[r], ws[r], out=outs[r]), probe.nbytes + act),
                    ("bf16-cublas", lambda r: torch.mm(xs[r], bf[r].t(), out=outs[r]), N * K * 2 + act)):
                try:
                    outs[0].fill_(float("nan"))
                    fn(0)
                    torch.cuda.synchronize()
                    err = float((outs[0].float() - ref.float()).abs().max() / ref.float().abs().max())
                    if not err <= 1e-2:
                        rows.append(Row("gemm", case, name, [], 1, nbytes, notes=f"wrong: rel err {err:.3g}"))
                        continue
                    rows.append(Row("gemm", case, name, twice(fn, len(ws)), 1, probe.nbytes + act,
                                    extra={"rel_err": round(err, 5), "config": q4m.default_config(N, K, M).label()}))
                except Exception as e:  # noqa: BLE001 - reported, the other rows still run
                    rows.append(Row("gemm", case, name, [], 1, nbytes, notes=f"{type(e).__name__}: {e}"[:300]))
                print(rows[-1].case, rows[-1].impl, rows[-1].us, rows[-1].notes, flush=True)
            write_rows(rows, a.out, "q4_mma", _md)
        del ws, bf
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
