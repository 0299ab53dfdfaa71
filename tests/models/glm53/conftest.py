"""Shared fixtures of the GLM-5.3 tests: one torch thread (tiny ops lose from threading)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
