"""Memory admission for test processes that share one GPU.

The H200 suite runs the matrix on several pytest-xdist workers, each with its own TP process pools, all on
one GPU. Long-context cells hold up to ~24 GiB each (``testing.matrix.long_cell_bytes``); unadmitted, four
workers that draw large cells at once exhaust the GPU and fail with out-of-memory errors that say nothing
about the code under test (session 23's matrix run: 15 such failures). ``admitted(nbytes)`` lets a cell
start only while the estimated bytes of the cells running on the GPU, its own included, fit a budget; the
ledger is a JSON file under a lock (``fcntl``), so every process on the machine sees it, and entries of dead
processes are dropped, so a killed worker cannot hold the budget forever. A cell larger than the whole
budget runs once nothing else is admitted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

LEDGER_ENV = "LS_GPU_SHARE_LEDGER"
"""Path of the ledger file (default: one per user under the temp directory)."""
BUDGET_ENV = "LS_GPU_SHARE_BYTES"
"""Budget in bytes (default: half the device's memory, the rest left to CUDA contexts, weights, caches)."""
POLL_S = 0.5
WAIT_NOTE_S = 60.0
"""A waiting cell says so on stderr after this long, and again each period (progress on long runs)."""


def ledger_path() -> Path:
    default = Path(os.environ.get("TMPDIR", "/tmp")) / f"ls_gpu_share_{os.getuid()}.json"
    return Path(os.environ.get(LEDGER_ENV, default))


def default_budget() -> int:
    if BUDGET_ENV in os.environ:
        return int(os.environ[BUDGET_ENV])
    import torch

    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory // 2


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[dict[str, list]]:
    """The ledger ({entry id: [pid, bytes]}, live processes only) under an exclusive lock; written back after."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.seek(0)
            text = f.read()
            entries = json.loads(text) if text.strip() else {}
            entries = {k: v for k, v in entries.items() if _alive(int(v[0]))}
            yield entries
            f.seek(0)
            f.truncate()
            f.write(json.dumps(entries))
            f.flush()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def held_bytes(path: Path | None = None) -> int:
    """Estimated bytes of the cells admitted now."""
    with _locked(path or ledger_path()) as entries:
        return sum(int(v[1]) for v in entries.values())


@contextlib.contextmanager
def admitted(nbytes: int, *, budget: int | None = None, path: Path | None = None,
             label: str = "") -> Iterator[None]:
    """Block until ``nbytes`` fits the budget beside the cells admitted now (or nothing else is admitted),
    hold them while the body runs, and release them after it (also on errors)."""
    path = path or ledger_path()
    budget = default_budget() if budget is None else budget
    key, t0, noted = uuid.uuid4().hex, time.monotonic(), 0.0
    while True:
        with _locked(path) as entries:
            held = sum(int(v[1]) for v in entries.values())
            if not entries or held + nbytes <= budget:
                entries[key] = [os.getpid(), int(nbytes)]
                break
        waited = time.monotonic() - t0
        if waited - noted >= WAIT_NOTE_S:
            noted = waited
            print(f"gpu_share: {label or 'a cell'} ({nbytes / 2**30:.1f} GiB) waits for {held / 2**30:.1f} GiB "
                  f"held of {budget / 2**30:.1f} GiB ({waited:.0f} s)", file=sys.stderr, flush=True)
        time.sleep(POLL_S)
    try:
        yield
    finally:
        with _locked(path) as entries:
            entries.pop(key, None)


def release_cached_memory() -> None:
    """Hand the caching allocator's free blocks back to the driver, so a process that ran a large cell does not
    keep its peak for the rest of the session (other processes share the GPU)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
