"""Cross-model matrix: cells come from the adapter registry, so an installed adapter joins with no test edits.

* ``plan_cell``  - every adapter x batch x TP x context x spec tokens (``testing.matrix.plan_cells``: the
  context is a plan input, ``build_plan(context=)``), each a distinct plan: the plan resolves every op site.
* ``program_cell`` - adapters with a decode program: every batch x TP x context x spec tokens x device (the
  long contexts, 32K / 128K synthetic histories, sampled on the CPU: ``testing.matrix.LONG_CPU_SAMPLE``);
  program vs reference on that cell, the fast path proven by the trace, each site served by the
  implementation the cell's plan gives it (kernels where the plan's rules give one). TP>1 cells run
  on gloo process pools (one pool per TP, started once per session). Cells on 'cuda' carry the gpu
  marker (skipped without CUDA; run with -m gpu on the H200).
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.plugins import get_registry
from latency_specialized.testing.matrix import Cell, GlooPool, cells_for, plan_cells


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread for every model test: oversubscribed intra-op threads make the tiny models' 64x64
    matmuls ~50x slower on the 2-core CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _adapters(capability: str | None = None):
    reg = get_registry()
    return [a for _, a in sorted(reg.adapters.items()) if capability is None or capability in a.capabilities]


def _param(cell: Cell):
    marks = [pytest.mark.gpu] if cell.device == "cuda" else []
    return pytest.param(cell, id=cell.id, marks=marks)


def pytest_generate_tests(metafunc):
    if "plan_cell" in metafunc.fixturenames:
        cells = [c for a in _adapters() for c in plan_cells(a)]
        metafunc.parametrize("plan_cell", [_param(c) for c in cells])
    if "program_cell" in metafunc.fixturenames:
        cells = [c for a in _adapters("program") for c in cells_for(a)]
        metafunc.parametrize("program_cell", [_param(c) for c in cells])


@pytest.fixture(scope="session")
def gloo_pools():
    pools: dict[int, GlooPool] = {}

    def get(world: int) -> GlooPool:
        if world not in pools or pools[world].broken:  # a pool whose ranks timed out is closed: start anew
            pools[world] = GlooPool(world)
        return pools[world]

    yield get
    for p in pools.values():
        p.close()
