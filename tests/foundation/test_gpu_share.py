"""testing.gpu_share: the memory admission the H200 matrix run's workers share (CPU: the ledger logic only)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

from latency_specialized.testing import gpu_share


def test_a_cell_waits_until_the_budget_has_room(tmp_path):
    ledger = tmp_path / "ledger.json"
    order: list[str] = []
    with gpu_share.admitted(60, budget=100, path=ledger):
        assert gpu_share.held_bytes(ledger) == 60

        def second():
            with gpu_share.admitted(50, budget=100, path=ledger):
                order.append("second in")

        t = threading.Thread(target=second)
        t.start()
        time.sleep(3 * gpu_share.POLL_S)
        assert order == [], "admitted beyond the budget"
        order.append("first out")
    t.join(timeout=10)
    assert order == ["first out", "second in"]
    assert gpu_share.held_bytes(ledger) == 0


def test_cells_that_fit_run_together_and_an_oversized_one_runs_alone(tmp_path):
    ledger = tmp_path / "ledger.json"
    with gpu_share.admitted(40, budget=100, path=ledger), gpu_share.admitted(50, budget=100, path=ledger):
        assert gpu_share.held_bytes(ledger) == 90
    with gpu_share.admitted(500, budget=100, path=ledger):  # nothing else held: it may start
        assert gpu_share.held_bytes(ledger) == 500
    assert gpu_share.held_bytes(ledger) == 0


def test_release_on_error(tmp_path):
    ledger = tmp_path / "ledger.json"
    try:
        with gpu_share.admitted(70, budget=100, path=ledger):
            raise ValueError("cell failed")
    except ValueError:
        pass
    assert gpu_share.held_bytes(ledger) == 0


def test_entries_of_dead_processes_are_dropped(tmp_path):
    """A worker killed inside a cell leaves its entry behind; the next reader drops it (its pid is gone)."""
    ledger = tmp_path / "ledger.json"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    ledger.write_text(json.dumps({"gone": [int(dead.stdout), 90]}))
    assert gpu_share.held_bytes(ledger) == 0
    with gpu_share.admitted(90, budget=100, path=ledger):
        assert gpu_share.held_bytes(ledger) == 90


def test_room_is_the_budget_bounded_by_free_memory_plus_what_is_held():
    gib = 2**30
    assert gpu_share.room(40 * gib, 0, None) == 40 * gib  # no GPU: the budget alone
    assert gpu_share.room(40 * gib, 0, 100 * gib) == 40 * gib
    # contexts the ledger does not count took the card down to 10 GiB free; 8 GiB held by admitted cells
    assert gpu_share.room(40 * gib, 8 * gib, 10 * gib) == 17 * gib
    assert gpu_share.room(40 * gib, 8 * gib, 10 * gib, margin=0) == 18 * gib


def test_a_cell_waits_for_device_memory_the_ledger_does_not_count(tmp_path):
    """The budget has room, the device does not (other processes' contexts): the second cell waits until the
    device's free memory grows."""
    ledger = tmp_path / "ledger.json"
    free = {"bytes": 2 * 2**30}
    order: list[str] = []
    with gpu_share.admitted(2**30, budget=100 * 2**30, path=ledger, free_bytes=lambda: free["bytes"]):
        def second():
            with gpu_share.admitted(2 * 2**30, budget=100 * 2**30, path=ledger, free_bytes=lambda: free["bytes"]):
                order.append("second in")

        t = threading.Thread(target=second)
        t.start()
        time.sleep(3 * gpu_share.POLL_S)
        assert order == [], "admitted beyond the device's free memory"  # room 2 + 1 - 1 = 2 GiB < 1 + 2
        free["bytes"] = 3 * 2**30  # room 3 GiB: 1 + 2 fit
        t.join(timeout=10)
        assert order == ["second in"]
    assert gpu_share.held_bytes(ledger) == 0
