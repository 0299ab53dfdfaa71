"""Fixtures shared by the kernel tests of this folder."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def poisoned(monkeypatch):
    """Every float ``torch.empty`` filled with NaN while the test runs: a kernel's output or workspace that it
    reads before writing shows up as NaN."""
    real = torch.empty

    def empty(*args, **kw):
        t = real(*args, **kw)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)
