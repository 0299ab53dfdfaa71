"""The committed compile records (``tests/compile_records.json.gz``, what the device's caches are built from:
``scripts/prepare_device_caches.sh``) still fit their Triton kernels' arguments. A kernel that gains a constexpr (a new
switch) leaves its records stale, and the device then compiles those kernels itself inside its budget (sessions 50-53:
the indexer's score and select kernels each time); the fix is to carry them over
(``benchmarks/scripts/migrate_records.py``) or drop them (``precompile.py --drop-stale``) in the same change."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")

from latency_specialized.testing import compile_records  # noqa: E402
from latency_specialized.testing.triton_specs import stale_reason  # noqa: E402

RECORDS = Path(__file__).resolve().parents[1] / "compile_records.json.gz"


def test_every_recorded_triton_specialisation_fits_its_kernel():
    records = compile_records.load(RECORDS)["triton"]
    assert len(records) > 1000, "the records shrank: a GPU suite's records should be merged, not replaced"
    stale = sorted({why.split(" (added")[0] for why in map(stale_reason, records) if why})
    assert not stale, ("records no longer fit their kernels - migrate them (benchmarks/scripts/migrate_records.py) "
                       f"or drop them (precompile.py --drop-stale): {stale[:5]}")
