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
