"""The tiny Kimi K3 program at TP 2 and 8 on the GPU: W processes share the GPU(s) over CUDA IPC.

Plans made without ``comm=`` pick the fused all-reduce kernels (symmetric memory); the program gets a
gloo TorchDistributedCommunicator (as the matrix's TP cells do), builds one symmetric-memory workspace
per all-reduce width (hidden 64, latent 32; fp32) and binds every all-reduce site to it; the matrix
cell then matches the reference with those kernels, identically on every rank.
"""

from __future__ import annotations

import os

import pytest

import comm_program_worlds as cpw

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("world_size", [2, 8])
def test_program_builds_symmetric_workspaces_and_matches_reference(world_size):
    from latency_specialized.comm.worlds import run_world

    batch = 4
    reps = run_world(cpw.gpu_program_world, world_size, batch, 8,
                     timeout=float(os.environ.get("LS_WORLD_TIMEOUT", "400")))
    for rank, rep in enumerate(reps):
        assert rep["plan_comm"] == ["symmetric-memory"], rep
        assert rep["impls"] == ["allreduce.lamport_one_shot"], rep  # small messages: one-shot at TP 2 and 8
        assert rep["kinds"] == ["symmetric-memory"] and rep["all_symmetric"] and rep["sites"] == 16, rep
        assert rep["built"] == [(32, "float32", batch, world_size), (64, "float32", batch, world_size)], rep
        cell = rep["cell"]
        assert rep["cell_ok"], (rank, cell)
        assert {cell["impls"][s] for s in cell["impls"] if s.endswith("allreduce")} == {"allreduce.lamport_one_shot"}
    assert len({rep["cell"]["logits_digest"] for rep in reps}) == 1, "ranks disagree"
