"""Run test files under the Triton interpreter in a subprocess (``TRITON_INTERPRET=1`` from its start).

Triton fixes interpreted vs compiled when it is first imported, and other test modules import it
during collection; so the Triton kernels' CPU cases run in a child pytest whose environment sets
the variable, and one test of the parent asserts the child's outcome. Only the driver itself is
skipped inside the child (it would recurse)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
REPO = Path(__file__).resolve().parents[1]


def run_interpreted(*paths: str, min_passed: int) -> None:
    """Run ``paths`` (relative to the repo) under the interpreter; fail unless all pass and at least
    ``min_passed`` did (so a collection accident that skips everything cannot look green)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", "-m", "not gpu"],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, tail
    m = re.search(r"(\d+) passed", r.stdout.strip().splitlines()[-1])
    assert m and int(m.group(1)) >= min_passed, tail
