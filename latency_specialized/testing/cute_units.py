"""Record the CuTe DSL kernels a GPU run compiles, as calls another machine can repeat into its disk cache.

The CuTe DSL side of ``testing.triton_specs``: every ``compile_cache.compile_unit`` call that reached a new kernel
(``compile_cache.UNIT_LOG``) is kept as ``{"fn": "module:qualname", "args": [...], "kwargs": {...}}`` in JSON - plain
values, tuples and the kernels' config dataclasses (by class name and fields) - and ``units`` turns a list back into
``compile_cache.precompile`` units, which compile in parallel worker processes into ``$LS_KERNEL_CACHE_DIR``. A
record whose function or config class no longer fits the code (renamed, a field gone) is reported and skipped; one
whose fields changed meaning compiles a kernel nobody loads (the cache is keyed by the full config): time, never a
wrong kernel.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
from typing import Any, Callable


def encode(value: Any) -> Any:
    """JSON form of a compile argument; ``TypeError`` for anything else (such a call is not recorded)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [encode(v) for v in value]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        return {"dataclass": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    raise TypeError(f"compile argument of type {type(value).__name__} has no JSON form")


def _named(ref: str) -> Any:
    module, qualname = ref.split(":", 1)
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def decode(value: Any) -> Any:
    if isinstance(value, dict) and "tuple" in value:
        return tuple(decode(v) for v in value["tuple"])
    if isinstance(value, dict) and "dataclass" in value:
        return _named(value["dataclass"])(**{k: decode(v) for k, v in value["fields"].items()})
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def record(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """A unit's record (None where an argument has no JSON form)."""
    try:
        return {"fn": f"{fn.__module__}:{fn.__qualname__}", "args": [encode(a) for a in args],
                "kwargs": {k: encode(v) for k, v in kwargs.items()}}
    except TypeError:
        return None


def start() -> None:
    """Record from now on in this process (``compile_cache.UNIT_LOG``)."""
    from latency_specialized.kernels import compile_cache

    if compile_cache.UNIT_LOG is None:
        compile_cache.UNIT_LOG = []


def recorded() -> list[dict[str, Any]]:
    """The records of this process's new kernels so far, deduplicated, in first-seen order."""
    from latency_specialized.kernels import compile_cache

    out: dict[str, dict[str, Any]] = {}
    for fn, args, kwargs in compile_cache.UNIT_LOG or ():
        r = record(fn, args, kwargs)
        if r is not None:
            out.setdefault(json.dumps(r, sort_keys=True), r)
    return list(out.values())


def units(records: list[dict[str, Any]]) -> tuple[list[tuple[Callable[..., Any], tuple[Any, ...]]], list[str]]:
    """``compile_cache.precompile`` units (keyword arguments bound to their positions) and the records that no
    longer fit the code, with why."""
    out: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
    stale: list[str] = []
    for r in records:
        try:
            fn = _named(r["fn"])
            bound = inspect.signature(fn).bind(*decode(r["args"]), **{k: decode(v) for k, v in r["kwargs"].items()})
            bound.apply_defaults()
            out.append((fn, tuple(bound.args)))
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            stale.append(f"{r['fn']}: {type(e).__name__}: {str(e)[:200]}")
    return out, stale
