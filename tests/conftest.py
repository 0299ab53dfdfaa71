"""Central test configuration: GPU tests are skipped (with the reason) where torch sees no CUDA."""

from __future__ import annotations

import pytest


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - torch missing means no CUDA
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `make test-gpu` (pytest -m gpu) on the H200")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
