"""Plugin system: pluggy hookspecs and the manager that loads entry points."""

from latency_specialized.plugins.hookspecs import ENTRY_POINT_GROUP, hookimpl, hookspec
from latency_specialized.plugins.manager import Registry, get_registry, reset_registry

__all__ = ["ENTRY_POINT_GROUP", "Registry", "get_registry", "hookimpl", "hookspec", "reset_registry"]
