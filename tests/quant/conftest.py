"""Fresh random data per test: each test gets a generator seeded anew (the seed is printed, so a failure's
captured output says how to replay it: QUANT_SEED=<seed>)."""

from __future__ import annotations

import os
import secrets

import pytest
import torch


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(os.environ.get("QUANT_SEED") or secrets.randbits(31))
    print(f"QUANT_SEED={seed}")
    return torch.Generator().manual_seed(seed)
