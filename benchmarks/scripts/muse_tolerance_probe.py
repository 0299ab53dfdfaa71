"""Muse Spark verification cells with the tiny model's q scale at its released value and at 1.0.

Why: the Muse matrix bound (``MuseSparkAdapter.verify_rel_tol``) covers fp32 summation-order differences that the
released q scale (5.47) amplifies through sharp attention. A wrong verification path (mask, ring, rollback) errs at
any q scale; amplified rounding falls to ~1e-6 of max |logits| at scale 1. Prints one line per cell and writes JSON.
    python benchmarks/scripts/muse_tolerance_probe.py --device cuda --out $OUT/muse_probe.json
"""

from __future__ import annotations

import argparse
import json
import time

from latency_specialized.testing.matrix import Cell

CELLS = ((1, 0), (4, 0), (4, 3), (1, 7), (2, 7), (4, 7), (8, 7))
"""(batch, spec tokens) at TP 1, context 40."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from latency_specialized_models.muse_spark.adapter import MuseSparkAdapter
    from latency_specialized_models.muse_spark.spec import QK_SCALE_FACTOR, full_spec, tiny_spec

    rows = []
    for qscale in (QK_SCALE_FACTOR, 1.0):
        class Scaled(MuseSparkAdapter):   # the tiny model at this q scale, the matrix's bound
            def spec(self, variant="full", q=qscale):
                return full_spec() if variant == "full" else tiny_spec(qk_scale_factor=q)

        adapter = Scaled()
        for batch, k in CELLS:
            cell = Cell("muse_spark", batch, 1, 40, k, args.device)
            t0 = time.time()
            r = adapter.verify_cell(cell, comm=None)
            rel = r.max_abs_err / (r.tolerance / adapter.verify_rel_tol)
            rows.append({"cell": cell.id, "qk_scale_factor": qscale, "max_abs_err": r.max_abs_err,
                         "rel_err": rel, "bound_rel": adapter.verify_rel_tol, "top1": r.top1_agreement})
            print(f"q {qscale:.3f} {cell.id}: rel err {rel:.2e} (bound {adapter.verify_rel_tol:.0e}) "
                  f"top-1 {r.top1_agreement:.3f} {time.time() - t0:.1f}s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
