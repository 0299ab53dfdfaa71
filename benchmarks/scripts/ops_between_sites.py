"""Which torch ops a composed decode step runs *between* its op sites, and from where (CPU, tiny model).

On the GPU the layer bench's census counts the kernel nodes between sites per layer ("(between sites)") but not
what they are. This runs one decode step of an adapter's tiny program on the CPU under a TorchDispatchMode, with
every bound op wrapped so that ops inside a site are not counted, and attributes each remaining op that would be a
GPU kernel (views, reshapes and metadata excluded) to the innermost frame in the pieces / runtime that issued it:

    python benchmarks/scripts/ops_between_sites.py --model glm53 [--batch 1] [--context 8] [--out FILE.json]

The count is per decode step over all layers of the tiny model, printed per frame and per layer-average; the CPU
reference implementations serve the sites (what runs between them does not depend on that, except copies that a
site's ``strided_rows`` flag avoids: those are counted as they happen here).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "unsqueeze", "squeeze", "permute",
         "transpose", "t", "as_strided", "alias", "detach", "unbind", "split", "split_with_sizes", "chunk",
         "narrow", "diagonal", "lift_fresh", "_reshape_alias", "empty", "empty_like", "empty_strided", "size",
         "stride", "sym_size", "sym_stride", "is_contiguous", "unfold", "view_as_real", "view_as_complex", "numel",
         "dim", "item", "_local_scalar_dense", "_to_copy_noop"}
"""aten ops that launch no kernel (views, allocation, metadata)."""


class BetweenSites(TorchDispatchMode):
    """Counts non-view aten ops while no site is running, by (op, innermost latency_specialized frame)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.depth == 0 and name not in VIEWS:
            self.counts[(name, _origin())] += 1
        return func(*args, **(kwargs or {}))


def _origin() -> str:
    for f in reversed(traceback.extract_stack()[:-3]):
        if "latency_specialized" in f.filename and "ops_between_sites" not in f.filename \
                and "/runtime/op_table.py" not in f.filename:
            return f"{Path(f.filename).name}:{f.name}:{f.lineno}"
    return "?"


def run(model: str, batch: int, context: int) -> dict:
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
    from latency_specialized.runtime.gate import DecodeGate, StepState
    from latency_specialized.runtime.graph_runner import CUDAGraphRunner
    from latency_specialized.runtime.states import shard_states
    from latency_specialized.testing.matrix import Cell, cell_plan
    from latency_specialized.testing.verify import batch_states, prototypes

    torch.set_num_threads(1)
    adapter = get_registry().adapter(model)
    cell = Cell(model, batch, 1, context, 0, "cpu")
    ref, proto, lens = prototypes(adapter, context, "cpu")
    spec = ref.spec
    states = batch_states(ref, proto, lens, batch, context + 2, seed=batch)
    plan = cell_plan(adapter, get_registry().implementations, cell)
    program = adapter.program(spec, plans=plan, cache=shard_states(adapter.composed_model(spec), states, 0, 1),
                              reference=ref)
    mode = BetweenSites()

    def hook(site, bucket, fn):
        def inside(*a, **kw):
            mode.depth += 1
            try:
                return fn(*a, **kw)
            finally:
                mode.depth -= 1
        return inside

    program.op_table.wrap(hook)
    buffers = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(states.slots[0].blocks),
                                       block_size=states.block_size, pad_state=0), "cpu")
    toks = torch.randint(3, spec.vocab_size, (batch,), generator=torch.Generator().manual_seed(0))
    buffers.load(toks, [lens[b % len(lens)] for b in range(batch)], [s.row for s in states.slots],
                 states.block_table(device="cpu"))
    runner = CUDAGraphRunner(program, buffers, use_graphs=False, feed_back_tokens=False,
                             gate=DecodeGate(max_batch=plan.bucket, buckets=(plan.bucket,)))
    runner.run(StepState(num_seqs=batch), tokens=toks)        # warm (first-call setup is not a step's work)
    with mode:
        runner.run(StepState(num_seqs=batch), tokens=toks)
    by_origin: collections.Counter[str] = collections.Counter()
    for (op, origin), n in mode.counts.items():
        by_origin[origin] += n
    layers = spec.num_layers
    return {"model": model, "batch": batch, "context": context, "layers": layers,
            "ops_between_sites": sum(mode.counts.values()),
            "per_layer": round(sum(mode.counts.values()) / layers, 1),
            "by_origin": dict(by_origin.most_common()),
            "by_op": {f"{op} @ {origin}": n for (op, origin), n in mode.counts.most_common()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=8)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    r = run(a.model, a.batch, a.context)
    print(f"{r['model']}: {r['ops_between_sites']} ops between sites per step over {r['layers']} layers "
          f"({r['per_layer']} per layer)")
    for origin, n in r["by_origin"].items():
        print(f"  {n:5d}  {origin}")
    if a.out:
        a.out.write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
