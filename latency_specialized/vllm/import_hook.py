"""Run a callback once a module is imported, without importing it ourselves.

The plugin's ``register()`` runs in every vLLM process, including the API server front-end and
``--help``. Importing vLLM's worker modules there costs ~8 s and pulls in the whole model-runner
stack, so the plugin patches them only when vLLM itself imports them: ``when_imported(name, cb)``
calls ``cb(module)`` right away if the module is loaded, else right after its first import.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Callable

Callback = Callable[[ModuleType], None]

_lock = threading.RLock()
_pending: dict[str, list[Callback]] = {}


class _Loader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the callbacks registered for the module."""

    def __init__(self, inner: importlib.abc.Loader, name: str):
        self.inner, self.name = inner, name

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        with _lock:
            callbacks = _pending.pop(self.name, [])
        for cb in callbacks:
            cb(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds watched modules through the other finders and wraps their loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


_FINDER = _Finder()


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` now if ``name`` is imported, else just after vLLM imports it."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _pending.setdefault(name, []).append(callback)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
    callback(module)
