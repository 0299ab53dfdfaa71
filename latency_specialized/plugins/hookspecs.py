"""Hooks a plugin may implement.

A plugin is a module (or object) with ``@hookimpl`` functions, exposed through the entry-point
group ``latency_specialized.adapters``. The four built-in adapters and the built-in op
implementations load through that same group, exactly like a third-party package::

    # pyproject.toml of a third-party package
    [project.entry-points."latency_specialized.adapters"]
    my_model = "my_package.plugin"

    # my_package/plugin.py
    from latency_specialized.plugins import hookimpl

    @hookimpl
    def register_adapters(register):
        register(MyModelAdapter())
"""

from __future__ import annotations

from typing import Callable

import pluggy

PROJECT = "latency_specialized"
ENTRY_POINT_GROUP = "latency_specialized.adapters"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_adapters(register: Callable[[object], None]) -> None:
    """Call ``register(adapter)`` once per ModelAdapter instance this plugin provides."""


@hookspec
def register_implementations(register: Callable[[object], None]) -> None:
    """Call ``register(implementation)`` once per op Implementation this plugin provides."""
