"""Shared fixtures of the Qwen3-MoE tests: one torch thread (tiny ops lose from threading on 2 cores)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
