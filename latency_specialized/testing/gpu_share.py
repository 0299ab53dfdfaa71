"""Memory admission for test processes that share one GPU.

The H200 suite runs the matrix on several pytest-xdist workers, each with its own TP process pools, all on
one GPU. Long-context cells hold up to ~24 GiB each (``testing.matrix.long_cell_bytes``); unadmitted, four
workers that draw large cells at once exhaust the GPU and fail with out-of-memory errors that say nothing
about the code under test (session 23's matrix run: 15 such failures). ``admitted(nbytes)`` lets a cell
start only while the estimated bytes of the cells running on the GPU, its own included, fit a budget; the
ledger is a JSON file under a lock (``fcntl``), so every process on the machine sees it, and entries of dead
processes are dropped, so a killed worker cannot hold the budget forever. A cell larger than the whole
budget runs once nothing else is admitted.

The budget is also bounded by what the device has free now plus what the admitted cells hold: memory the
ledger does not count - CUDA contexts of the workers and of their TP process pools (~0.9 GiB a process on an
H100; 6 workers' pools are up to 60 processes), other tests' caches - shrinks it (session 39's long matrix on an
80 GB H100 with 6 workers: 3 cells out of memory beside ~20 GiB of contexts, the ledger at half the card).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

LEDGER_ENV = "LS_GPU_SHARE_LEDGER"
"""Path of the ledger file (default: one per user under the temp directory)."""
BUDGET_ENV = "LS_GPU_SHARE_BYTES"
"""Budget in bytes (default: half the device's memory, the rest left to CUDA contexts, weights, caches)."""
POLL_S = 0.5
MARGIN_BYTES = 2**30
"""Free device memory a cell leaves unclaimed (allocator block rounding, a context that starts meanwhile)."""
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


def device_free_bytes() -> int | None:
    """Free memory of this process's CUDA device now (the driver's figure: other processes' use counted), or None
    without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info()[0])


def room(budget: int, held: int, free: int | None, margin: int = MARGIN_BYTES) -> int:
    """Bytes the admitted cells may hold together: ``budget``, bounded by ``free`` (the device's free memory) plus
    ``held`` (the admitted cells' estimates, taken as allocated: exact once they are, generous before) less
    ``margin``."""
    return budget if free is None else min(budget, free + held - margin)


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
def admitted(nbytes: int, *, budget: int | None = None, path: Path | None = None, label: str = "",
             free_bytes: Callable[[], int | None] = device_free_bytes) -> Iterator[None]:
    """Block until ``nbytes`` fits the room beside the cells admitted now (or nothing else is admitted),
    hold them while the body runs, and release them after it (also on errors). The room is ``budget`` bounded by
    the device's free memory (``room``; ``free_bytes`` returns None without a GPU)."""
    path = path or ledger_path()
    budget = default_budget() if budget is None else budget
    key, t0, noted = uuid.uuid4().hex, time.monotonic(), 0.0
    while True:
        free = free_bytes()  # read before the lock: the driver call must not hold the other processes up
        with _locked(path) as entries:
            held = sum(int(v[1]) for v in entries.values())
            fits = room(budget, held, free)
            if not entries or held + nbytes <= fits:
                entries[key] = [os.getpid(), int(nbytes)]
                break
        waited = time.monotonic() - t0
        if waited - noted >= WAIT_NOTE_S:
            noted = waited
            free_gib = "-" if free is None else f"{free / 2**30:.1f}"
            print(f"gpu_share: {label or 'a cell'} ({nbytes / 2**30:.1f} GiB) waits for {held / 2**30:.1f} GiB "
                  f"held of {fits / 2**30:.1f} GiB (budget {budget / 2**30:.1f}, device free {free_gib} GiB; "
                  f"{waited:.0f} s)", file=sys.stderr, flush=True)
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
