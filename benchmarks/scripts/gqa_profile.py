"""Where a GQA decode call's time goes on the GPU (H200): the split and merge kernels' device time per call under the
torch profiler (CUPTI sees every kernel node of a graph replay), beside the call's wall time from CUDA events - the
rest is launch gaps between the graph's nodes. Cells: Muse Spark TP8 full attention at the bars' contexts; variants:
the module's defaults, then each ``NAME=VALUE`` of argv[2:] in turn, applied on top of those before it.

    python benchmarks/scripts/gqa_profile.py $OUT/gqa_profile.json MERGE_PDL=False MERGE_D_BLOCK=16
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import torch

import latency_specialized.kernels.gqa_decode_triton as gk
from latency_specialized.hardware import roofline_bandwidth
from profile_layer import profile   # benchmarks/scripts, this script's directory
from tests.ops.test_gqa_triton_gpu import MUSE_TP8, graph_cell

CELLS = [(1, 4096), (1, 32768), (1, 131072), (8, 32768), (64, 32768)]
REPLAYS = 5


def profile_cell(batch: int, context: int) -> dict:
    graph, sets, cell_bytes, _, held = graph_cell(MUSE_TP8, batch, context, None)
    per_replay, wall = profile(graph, REPLAYS)   # profile_layer's: kernels' device time and wall per replay
    kernels: dict[str, float] = defaultdict(float)
    for name, (us, _) in per_replay.items():
        kernels["split" if "split_kernel" in name else "merge" if "merge_kernel" in name else name[:40]] += us / sets
    del graph, held
    torch.cuda.empty_cache()
    wall /= sets
    floor = cell_bytes / roofline_bandwidth() * 1e6
    return dict(batch=batch, context=context, wall_us=round(wall, 2), floor_us=round(floor, 2),
                roofline=round(floor / wall, 3), **{f"{k}_us": round(v, 2) for k, v in kernels.items()},
                gaps_us=round(wall - sum(kernels.values()), 2))


def main(out: str, *overrides: str) -> None:
    rows = []
    for variant in ("defaults", *overrides):
        if variant != "defaults":
            name, value = variant.split("=")
            setattr(gk, name, {"True": True, "False": False}.get(value, value if not value.isdigit() else int(value)))
        for batch, context in CELLS:
            row = dict(variant=variant, **profile_cell(batch, context))
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=0)


if __name__ == "__main__":
    main(*sys.argv[1:])
