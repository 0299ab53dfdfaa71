"""Import a repository script (``benchmarks/scripts/*.py``: not a package) as a module for its CPU tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str | None = None) -> ModuleType:
    """The script at ``ROOT / relative`` executed as module ``name`` (default: its file stem), registered in
    ``sys.modules`` first so that its dataclasses and pickles resolve their module."""
    path = ROOT / relative
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
