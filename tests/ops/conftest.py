"""Fixtures shared by the kernel tests of this folder."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="module")
def sm90():
    """CuTe DSL kernels compiled for sm_90a with the disk tier off (fresh compiles keep their PTX)."""
    old = {k: os.environ.get(k) for k in ("CUTE_DSL_ARCH", "LS_KERNEL_CACHE_DIR")}
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    os.environ.pop("LS_KERNEL_CACHE_DIR", None)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


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
