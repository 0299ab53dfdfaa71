"""Central test configuration.

* GPU tests are skipped (with the reason) where torch sees no CUDA.
* Triton-interpreter cases (marker ``interpreter_case``) are collected only in a process started with
  ``TRITON_INTERPRET=1``, and their drivers (``interpreter_driver``) only in one without: elsewhere they
  are deselected, not skipped - the driver runs the cases in a child process (``tests/interpret.py``).
"""

from __future__ import annotations

import pytest

from tests.interpret import CASE, DRIVER, INTERPRETING


def pytest_configure(config):
    config.addinivalue_line("markers", f"{CASE}: runs only under TRITON_INTERPRET=1 from the process start "
                                       "(collected there only; its driver test runs it in a child process)")
    config.addinivalue_line("markers", f"{DRIVER}: runs {CASE} tests in a TRITON_INTERPRET=1 child process "
                                       "(not collected in an interpreting process)")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - torch missing means no CUDA
        return False


def _route_interpreter_tests(config, items) -> None:
    """Deselect what cannot run in this process: the interpreter cases without TRITON_INTERPRET=1 from
    the start, their drivers with it."""
    absent = DRIVER if INTERPRETING else CASE
    dropped = [item for item in items if item.get_closest_marker(absent) is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item.get_closest_marker(absent) is None]


def pytest_collection_modifyitems(config, items):
    _route_interpreter_tests(config, items)
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `make test-gpu` (pytest -m gpu) on the H200")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
