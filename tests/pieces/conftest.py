"""Fixtures of the piece tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One intra-op thread per test (each piece-test file used to set it itself): the TP cases run their ranks as
    Python threads (``ThreadWorld``) meeting at barriers, which intra-op thread pools would oversubscribe."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
