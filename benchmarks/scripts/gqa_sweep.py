"""Sweep the GQA split-KV kernel's launch constants on the GPU (H200): median us per call of each variant at
the cells that matter (tests/ops/test_gqa_triton_gpu.py's timing method: CUDA graphs, inputs rotated past the
L2, median of groups). Writes one JSON row per (variant, cell) to argv[1].

argv[2] picks the sweep: ``tiles`` (session 19's: waves, stages, warps, tile bytes; the default), ``merge`` (the
merge's launch and shape: ``MERGE_PDL``, ``EARLY_TRIGGER``, ``MERGE_D_BLOCK``, the first variant the baseline) or
``waves`` (programs per SM 1-4 x pipeline stages, around batch 8: issue 23's 70% there needs ~1 us of the ~11 us a
call spends outside streaming - per-program prologue / tail against more, shorter splits and a wider merge) or
``fused`` (the split kernel's own merge, ``FUSED_MERGE_MAX_SPLITS`` / ``FUSED_MERGE_UNROLL``, against the merge
kernel: the first variant; only the listed combinations)."""

from __future__ import annotations

import itertools
import json
import sys

import latency_specialized.kernels.gqa_decode_triton as gk
from tests.ops.test_gqa_triton_gpu import MUSE_TP8, _time_cell

SWEEPS = {
    "tiles": dict(cells=[(8, 32768, None), (64, 32768, None), (1, 32768, None), (1, 4096, None), (8, 32768, 2048)],
                  variants={"WAVES": (2, 8), "NUM_STAGES": (2, 3, 4), "NUM_WARPS": (4, 8),
                            "TILE_BYTES": (8192, 16384)}),
    "merge": dict(cells=[(8, 32768, None), (16, 32768, None), (64, 32768, None), (1, 32768, None), (1, 131072, None),
                         (1, 4096, None), (8, 32768, 2048)],
                  variants={"MERGE_PDL": (False, True), "EARLY_TRIGGER": (False, True), "MERGE_D_BLOCK": (0, 16)}),
    "waves": dict(cells=[(8, 32768, None), (16, 32768, None), (8, 131072, None), (64, 32768, None), (1, 32768, None)],
                  variants={"WAVES": (2, 1, 3, 4), "NUM_STAGES": (3, 4)}),
    "fused": dict(cells=[(8, 32768, None), (16, 32768, None), (64, 32768, None), (4, 32768, None), (1, 32768, None),
                         (1, 131072, None), (8, 32768, 2048), (1, 4096, None)],
                  variants={"FUSED_MERGE_MAX_SPLITS": (0, 32, 256), "FUSED_MERGE_UNROLL": (4, 8)},
                  only=[(0, 4), (32, 4), (32, 8), (256, 4)]),
}


def main(out: str, sweep: str = "tiles") -> None:
    cells, variants = SWEEPS[sweep]["cells"], SWEEPS[sweep]["variants"]
    rows = []
    keys = list(variants)
    only = SWEEPS[sweep].get("only")
    for combo in itertools.product(*variants.values()):
        if only is not None and combo not in only:
            continue
        if sweep == "merge" and combo[1] and not combo[0]:
            continue   # the early trigger only means something with the merge launched by PDL
        for k, v in zip(keys, combo):
            setattr(gk, k, v)
        for batch, ctx, window in cells:
            r = _time_cell(MUSE_TP8, batch, ctx, window, groups=7)
            row = dict(zip(keys, combo), batch=batch, context=ctx, window=window or 0, us=r["us"],
                       roofline=r["roofline"], splits=gk.choose_num_splits(batch, 2, gk.span(ctx, window), 132))
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=0)


if __name__ == "__main__":
    main(*sys.argv[1:3])
