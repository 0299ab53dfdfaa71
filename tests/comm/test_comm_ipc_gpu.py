"""Real kernels over CUDA IPC: W processes (2, 4, 8) share the GPU(s), gloo for the reference.

Per world: both kernels against the reference for bf16 N=7168 (M = 1, 2, 16, 64) and fp32
N=2048, with spiky inputs (-0.0, subnormals) and NaN-poisoned outputs, zero-centred and no-norm
variants; thousands of back-to-back calls with a side stream busy (every call checked on the
device; the run_world watchdog fails the test on a hang); one CUDA graph of four calls replayed
with fresh inputs; bit-identical outputs on every rank; the device call counter in step.

``LS_STRESS_CALLS`` sets the back-to-back count (default 2000); ``LS_RESULTS_DIR`` (optional)
receives a JSON report per world.
"""

from __future__ import annotations

import os

import pytest

import comm_gpu_worlds as cgw

pytestmark = pytest.mark.gpu

STRESS_CALLS = int(os.environ.get("LS_STRESS_CALLS", "2000"))
GRAPH_REPLAYS = 20


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_fused_allreduce_kernels_over_cuda_ipc(world_size):
    cgw.check_world(world_size, STRESS_CALLS, GRAPH_REPLAYS, float(os.environ.get("LS_WORLD_TIMEOUT", "300")),
                    os.environ.get("LS_RESULTS_DIR"))
