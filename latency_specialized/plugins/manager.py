"""Load plugins from entry points into one registry of adapters and op implementations.

Each entry point is loaded and registered on its own: a plugin that fails to import, misnames a
hook or registers something invalid is recorded in ``Registry.failures`` (name + error) and the
others still load. ``LATENCY_SPECIALIZED_BLOCK_PLUGINS=a,b`` skips plugins by entry-point name.
The registry is built once per process and cached; this is the only global state.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import pluggy

from latency_specialized.adapter_contract import AdapterContract
from latency_specialized.errors import PluginError, UserError
from latency_specialized.ops.registry import Implementation, ImplementationRegistry
from latency_specialized.plugins import hookspecs

BLOCK_ENV = "LATENCY_SPECIALIZED_BLOCK_PLUGINS"


@dataclass
class PluginFailure:
    name: str
    """Entry-point name (or module) of the plugin."""
    error: str
    """What went wrong, one line."""


@dataclass
class Registry:
    """Adapters and implementations from every loaded plugin."""

    adapters: dict[str, AdapterContract] = field(default_factory=dict)
    providers: dict[str, str] = field(default_factory=dict)
    implementations: ImplementationRegistry = field(default_factory=ImplementationRegistry)
    failures: list[PluginFailure] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)
    pm: Any = None

    def adapter(self, name: str) -> AdapterContract:
        key = name.strip().lower().replace("-", "_")
        if key in self.adapters:
            return self.adapters[key]
        for a in self.adapters.values():  # also accept an HF architecture name
            if name in a.hf_architectures:
                return a
        known = ", ".join(sorted(self.adapters)) or "none installed"
        raise UserError(f"unknown model '{name}': installed adapters are {known} "
                        f"(see `latency-specialized models`)")

    def adapter_for_architecture(self, architectures: list[str] | tuple[str, ...]) -> AdapterContract | None:
        for arch in architectures:
            for a in self.adapters.values():
                if arch in a.hf_architectures:
                    return a
        return None


def _register_from(plugin: Any, name: str, reg: Registry, pm: pluggy.PluginManager) -> None:
    """Register one plugin object and collect what its hooks register."""
    adapters: list[AdapterContract] = []
    impls: list[Implementation] = []
    pm.register(plugin, name=name)
    pm.check_pending()  # a misspelled hook name is an error of this plugin, not a silent no-op
    caller = pm.subset_hook_caller
    others = [p for p in pm.get_plugins() if p is not plugin]
    caller("register_adapters", remove_plugins=others)(register=adapters.append)
    caller("register_implementations", remove_plugins=others)(register=impls.append)
    for a in adapters:
        if not isinstance(a, AdapterContract) or not a.name:
            raise PluginError(f"registered {a!r}, which is not a named ModelAdapter")
        if a.name in reg.adapters and type(reg.adapters[a.name]) is not type(a):
            raise PluginError(f"adapter name {a.name} is already registered by {reg.providers[a.name]}")
    for i in impls:
        if not isinstance(i, Implementation):
            raise PluginError(f"registered {i!r}, which is not an Implementation")
    # Only commit once everything validated, so a half-broken plugin leaves no trace.
    for a in adapters:
        reg.adapters[a.name] = a
        reg.providers[a.name] = name
    for i in impls:
        reg.implementations.register(dataclasses.replace(i, provider=name))


def build_registry(extra_plugins: list[tuple[str, Any]] | None = None) -> Registry:
    """Load every entry point of the group (plus ``extra_plugins``) into a fresh registry."""
    reg = Registry()
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    reg.pm = pm
    blocked = {b.strip() for b in os.environ.get(BLOCK_ENV, "").split(",") if b.strip()}
    candidates: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for ep in sorted(entry_points(group=hookspecs.ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.name in seen:  # the same distribution visible twice on sys.path
            continue
        seen.add(ep.name)
        if ep.name in blocked:
            reg.blocked.append(ep.name)
            continue
        candidates.append((ep.name, ep))
    candidates += list(extra_plugins or [])
    for name, source in candidates:
        try:
            plugin = source.load() if hasattr(source, "load") and hasattr(source, "group") else source
            _register_from(plugin, name, reg, pm)
            reg.loaded.append(name)
        except Exception as e:  # noqa: BLE001 - reported per plugin, see module docstring
            if pm.get_plugin(name) is not None:
                pm.unregister(name=name)
            reg.failures.append(PluginFailure(name, f"{type(e).__name__}: {e}".splitlines()[0]))
    return reg


_REGISTRY: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, built on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = build_registry()
    return _REGISTRY


def reset_registry() -> None:
    """Forget the cached registry (tests; after installing a plugin at run time)."""
    global _REGISTRY
    _REGISTRY = None
