"""GPU kernel implementations, registered into their op families by the builtin_ops plugin.

Each kernel module exposes ``IMPLEMENTATIONS`` (list of ops.registry.Implementation) and must
import cutlass lazily (inside compile functions), so that this list builds on any machine and
``supports()`` can name what is missing instead of failing at import.
"""

from __future__ import annotations

import importlib

KERNEL_MODULES: tuple[str, ...] = (
)

IMPLEMENTATIONS: list = []
for _name in KERNEL_MODULES:
    IMPLEMENTATIONS += importlib.import_module(_name).IMPLEMENTATIONS
