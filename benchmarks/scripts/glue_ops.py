"""Torch ops a decode program runs OUTSIDE its op sites, per step, by source line (CPU, tiny spec).

    .venv/bin/python benchmarks/scripts/glue_ops.py deepseek_v41_flash [context]

On the GPU every such op is a kernel of its own in the step's graph ('(between sites)' in the bench's
kernel census, ``runtime.census``); this finds where they come from without a GPU: it runs one matrix cell
(batch 1, TP1, eager) with the program's op table wrapped (ops inside a site are not counted) under a
``TorchDispatchMode`` that records each aten op with the innermost ``latency_specialized`` / ``models`` frame.
Views and allocations are left out (no kernel). CPU plans run every site's torch reference, so a site the GPU
plan fuses or skips may show glue here that the GPU step does not run (e.g. RoPE where a fused QK-norm + RoPE
kernel serves on the GPU): read the lines, not only the counts.
"""
import collections
import sys
import threading
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from latency_specialized.plugins import get_registry
from latency_specialized.testing.matrix import Cell
import latency_specialized.runtime.graph_runner as gr

name = sys.argv[1]; ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 40
reg = get_registry(); adapter = reg.adapter(name)
flag = threading.local(); flag.depth = 0
counts = collections.Counter(); sites_seen = collections.Counter()
SKIP = {"aten.detach.default", "aten.view.default", "aten._unsafe_view.default", "aten.alias.default",
        "aten.slice.Tensor", "aten.select.int", "aten.t.default", "aten.transpose.int", "aten.unsqueeze.default",
        "aten.squeeze.dim", "aten.expand.default", "aten.as_strided.default", "aten.permute.default",
        "aten.split.Tensor", "aten.unbind.int", "aten.split_with_sizes.default", "aten.narrow.default",
        "aten.lift_fresh.default", "aten.empty.memory_format", "aten.empty_strided.default",
        "aten.promote_types.default", "aten.scalar_tensor.default"}  # no kernel on the GPU
class Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if flag.depth == 0 and str(func) not in SKIP:
            fr = [f for f in traceback.extract_stack() if ("latency_specialized" in f.filename or "models/" in f.filename) and "glue.py" not in f.filename]
            where = fr[-1] if fr else None
            key = (str(func), f"{where.filename.split('main/')[-1]}:{where.lineno} {where.name}" if where else "?")
            counts[key] += 1
        return func(*args, **(kwargs or {}))
orig_prog = type(adapter).program
def program(self, *a, **k):
    p = orig_prog(self, *a, **k)
    def hook(site, bucket, fn):
        def w(*aa, **kk):
            flag.depth += 1
            try:
                sites_seen[site] += 1
                return fn(*aa, **kk)
            finally:
                flag.depth -= 1
        return w
    p.op_table.wrap(hook)
    return p
type(adapter).program = program
orig_run = gr.CUDAGraphRunner.run
runs = [0]
def run(self, *a, **k):
    runs[0] += 1
    with Mode():
        return orig_run(self, *a, **k)
gr.CUDAGraphRunner.run = run
torch.set_num_threads(1)
res = adapter.verify_cell(Cell(name, 1, 1, ctx, 0, "cpu"), comm=None)
print("runs", runs[0], "err", res.max_abs_err, res.tolerance)
tot = sum(counts.values())
print("ops outside sites per step:", tot / runs[0])
for (f, where), n in sorted(counts.items(), key=lambda x: -x[1])[:60]:
    print(f"{n/runs[0]:6.1f}  {f:40s} {where}")
