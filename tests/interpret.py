"""Run test files under the Triton interpreter in a subprocess (``TRITON_INTERPRET=1`` from its start).

Triton fixes interpreted vs compiled when it is first imported, and other test modules import it
during collection; so the Triton kernels' CPU cases run in a child pytest whose environment sets
the variable, and one test of the parent (a driver) asserts the child's outcome.

Two markers route the tests (``tests/conftest.py`` registers them and drops, as deselected, what
does not run in a process):

* ``interpreter_case``: a case that needs the interpreter from the process start. Collected only
  where ``TRITON_INTERPRET=1``: a plain ``pytest -m "not gpu"`` does not show them as skips;
* ``interpreter_driver``: the parent test that runs the cases in the child. Not collected in an
  interpreting process (it would recurse).

The child selects ``-m "interpreter_case and not gpu"`` and must pass every case it collects, skip
none, and pass at least ``min_passed``."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
REPO = Path(__file__).resolve().parents[1]
CASE = "interpreter_case"
"""Marker of a case that runs only in a process interpreting from its start."""
DRIVER = "interpreter_driver"
"""Marker of a parent test that runs ``CASE`` tests in a child process."""


def run_interpreted(*paths: str, min_passed: int) -> None:
    """Run the ``CASE`` tests of ``paths`` (relative to the repo) under the interpreter; fail unless all
    pass, none skips, and at least ``min_passed`` ran (so a collection accident cannot look green)."""
    r = _pytest_child(*paths, "-q", "-m", f"{CASE} and not gpu", interpreting=True, timeout=900)
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, tail
    last = r.stdout.strip().splitlines()[-1]
    m = re.search(r"(\d+) passed", last)
    assert m and int(m.group(1)) >= min_passed, tail
    assert not re.search(r"\d+ (skipped|xfailed|xpassed)", last), f"every interpreter case must run: {last}"


@contextlib.contextmanager
def programs_in_reverse() -> Iterator[None]:
    """Inside the block the interpreter runs each launch's programs in the reverse of grid order (their program ids
    remapped): a kernel whose programs rely on running in grid order - one reading what a lower-numbered program of
    the same launch wrote, which nothing orders on a GPU - then fails the cases that pass in grid order."""
    from triton.runtime import interpreter

    cls = type(interpreter.interpreter_builder)
    original = cls.set_grid_idx

    def reversed_idx(self, x, y, z):
        gx, gy, gz = self.grid_dim
        original(self, gx - 1 - x, gy - 1 - y, gz - 1 - z)

    cls.set_grid_idx = reversed_idx
    try:
        yield
    finally:
        cls.set_grid_idx = original


def collected_ids(*paths: str, interpreting: bool, marks: str = "not gpu") -> list[str]:
    """Node ids ``pytest --collect-only -m MARKS`` collects from ``paths`` (the deselected left out),
    in a child process with or without ``TRITON_INTERPRET=1``."""
    r = _pytest_child(*paths, "--collect-only", "-q", "-m", marks, interpreting=interpreting, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return [line for line in r.stdout.splitlines() if "::" in line]


def _pytest_child(*args: str, interpreting: bool, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpreting:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
