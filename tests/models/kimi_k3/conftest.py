"""Shared fixtures of the Kimi K3 tests: one torch thread (tiny ops lose from threading on 2 cores)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # Oversubscribed intra-op threads make 64x64 matmuls ~50x slower on the 2-core CI machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
