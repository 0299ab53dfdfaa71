"""Record the Triton kernels a GPU run compiles, and compile them again ahead of the next run, on all cores at once.

The GPU suite on a fresh machine spends most of its time compiling (``testing.compile_clock``); its pytest workers
compile one kernel each at a time while most of the machine's cores idle. A run records every specialisation it
compiles - Triton's own serialised form (``specialization_data``, the input of ``JITFunction.preload``), captured by
``knobs.runtime.jit_cache_hook`` - and the next machine compiles the recorded list in a process pool before the
suite starts, into the same on-disk cache the suite's launches then hit. A record whose kernel has changed since
compiles the new source (a kernel the suite may not launch any more: time, never a wrong kernel, since Triton keys
its cache by the source); one that no longer resolves or compiles is counted and skipped.

A record: ``{"fn": "module:qualname", "data": specialization_data}``. Kernels made by a module's cached
``_kernels(interpret)`` factory (qualname ``_kernels.<locals>.name``) resolve through ``_kernels(False)``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

@dataclass
class SpecRecorder:
    """Collects ``{"fn", "data"}`` of every Triton compile this process starts (``install`` hooks Triton)."""

    records: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    skipped: int = 0
    """Compiles whose specialisation Triton could not serialise (a constexpr JSON cannot hold)."""

    def on_compile(self, *, fn: Any = None, compile: dict | None = None, **_: Any) -> None:  # noqa: A002
        data = (compile or {}).get("specialization_data")
        if fn is None or data is None:
            self.skipped += 1
            return
        ref = f"{fn.module}:{fn.name}"
        self.records.setdefault((ref, data), {"fn": ref, "data": data})

    def install(self) -> bool:
        """Hook ``knobs.runtime.jit_cache_hook`` (chained to one already set; it never stops a compile) and make
        Triton's serialiser total: with a hook set Triton serialises every specialisation, and a value JSON cannot
        hold would otherwise fail the launch itself. False where this Triton has neither."""
        try:
            import triton.runtime.jit as jit
            from triton import knobs
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        serialize = getattr(jit, "serialize_specialization_data", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook") or serialize is None:
            return False

        def safe_serialize(*args: Any, **kw: Any) -> str | None:
            try:
                return serialize(*args, **kw)
            except (TypeError, ValueError):
                return None

        if not getattr(serialize, "_ls_safe", False):
            safe_serialize._ls_safe = True  # type: ignore[attr-defined]
            jit.serialize_specialization_data = safe_serialize
        previous = runtime.jit_cache_hook

        def hook(**kw: Any) -> Any:
            try:
                self.on_compile(**kw)
            except Exception:  # noqa: BLE001 - recording must never fail a launch
                self.skipped += 1
            return previous(**kw) if previous is not None else None

        runtime.jit_cache_hook = hook
        return True

    def values(self) -> list[dict[str, str]]:
        return list(self.records.values())


def resolve(ref: str) -> Any:
    """The ``JITFunction`` named ``module:qualname``; a factory-made one through its factory: ``_kernels(False)``
    (interpret off) making a dict, namespace or tuple of kernels, or a factory of no arguments making the kernel."""
    module_name, qualname = ref.split(":", 1)
    module = importlib.import_module(module_name)
    if "<locals>" not in qualname:
        obj: Any = module
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj
    factory = getattr(module, qualname.split(".")[0])
    made = factory(False) if inspect.signature(factory).parameters else factory()
    if hasattr(made, "fn"):
        kernels: Any = [made]
    elif isinstance(made, dict):
        kernels = made.values()
    else:  # a namespace, or a tuple of kernels (a NamedTuple: kda_verify_triton)
        kernels = made if isinstance(made, tuple) else vars(made).values()
    for kernel in kernels:
        if getattr(getattr(kernel, "fn", None), "__qualname__", None) == qualname:
            return kernel
    raise LookupError(f"{ref}: {module_name}.{factory.__name__} makes no such kernel")


class StaleRecord(Exception):
    """A record whose kernel no longer takes the arguments it was recorded with (added, removed or renamed)."""


def _argument_change(recorded: list[str], now: list[str]) -> str | None:
    if recorded == now:
        return None
    added, dropped = [a for a in now if a not in recorded], [a for a in recorded if a not in now]
    return (f"the kernel's arguments changed since the record (added {added}, dropped {dropped}"
            f"{', reordered' if not added and not dropped else ''})")


def stale_reason(record: dict[str, str]) -> str | None:
    """Why ``record`` no longer fits its kernel - the kernel is gone, or its arguments changed - found without
    compiling, as ``precompile`` reports it; None where it fits (a changed body shows only when compiled)."""
    try:
        fn = resolve(record["fn"])
    except (ImportError, AttributeError, LookupError) as e:
        return f"{record['fn']}: {type(e).__name__}: {str(e)[:200]}"
    change = _argument_change(list(json.loads(record["data"])["signature"]), list(fn.arg_names))
    return None if change is None else f"{record['fn']}: {StaleRecord.__name__}: {change}"


def record_constexprs(record: dict[str, str]) -> dict[str, Any]:
    """The constexpr arguments a record was compiled with, by name, and its ``num_warps``."""
    obj = json.loads(record["data"])
    names = list(obj["signature"])
    values = {names[k[0]]: v for k, v in zip(obj["constant_keys"], obj["constant_vals"])}
    return {**values, "num_warps": obj["options"]["num_warps"]}


def with_constexprs(record: dict[str, str], now: list[str], values: dict[str, Any]) -> dict[str, str]:
    """``record`` for a kernel whose arguments are now ``now``: the constexprs it lacks added with ``values`` at their
    positions in ``now`` (the argument indices after them shift), recorded ones set to ``values`` where named there,
    and ``num_warps`` from ``values`` if given. A kernel that gained a constexpr (a new switch) keeps its records
    compiling the entries its launches ask for, instead of dropping them as stale."""
    obj = json.loads(record["data"])
    old = list(obj["signature"])
    if [a for a in old if a not in now]:
        raise StaleRecord(_argument_change(old, now) or "")
    given = record_constexprs(record)
    given.update(values)
    missing = [a for a in now if a not in old and a not in values]
    if missing:
        raise ValueError(f"{record['fn']}: no value for the new arguments {missing}")
    where = {a: now.index(a) for a in old}
    obj["signature"] = {a: obj["signature"].get(a, "constexpr") for a in now}
    constexprs = [a for a in now if obj["signature"][a] == "constexpr"]
    obj["constant_keys"] = [[now.index(a)] for a in constexprs]
    obj["constant_vals"] = [given[a] for a in constexprs]
    obj["attrs_keys"] = [[where[old[k[0]]]] + list(k[1:]) for k in obj["attrs_keys"]]
    obj.pop("key", None)   # Triton's launch key of the old arguments (not read here)
    if "num_warps" in values:
        obj["options"]["num_warps"] = values["num_warps"]
    return {**record, "data": json.dumps(obj)}


def compile_record(record: dict[str, str], target: Any) -> bool:
    """Compile one record for ``target`` (a ``GPUTarget``) into Triton's cache, as ``JITFunction.preload``
    deserialises it; True: it was in the cache already (``testing.compile_clock`` counts the same)."""
    import triton
    import triton.language as tl
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import convert_to_tuple_if_list

    fn = resolve(record["fn"])
    obj = json.loads(record["data"])
    change = _argument_change(list(obj["signature"]), list(fn.arg_names))
    if change is not None:   # else Triton builds an entry no launch asks for (missing constexprs), or fails
        raise StaleRecord(change)

    def constant(v: Any) -> Any:
        # JSON made the tuples lists: back to tuples (lists are no kernel argument), as Triton >= 3.7's preload does
        if tl.dtype.is_dtype(v):
            return tl.dtype(v)
        if isinstance(v, dict) and "constexpr" in v:
            return tl.constexpr(convert_to_tuple_if_list(v["constexpr"]))
        if isinstance(v, dict) and "jit_function" in v:   # a kernel passed as a constexpr (Triton >= 3.7)
            return resolve(v["jit_function"])
        return convert_to_tuple_if_list(v)

    constexprs = {tuple(k): constant(v) for k, v in zip(obj["constant_keys"], obj["constant_vals"])}
    attrs = dict(zip(map(tuple, obj["attrs_keys"]), obj["attrs_vals"]))
    signature = {k: convert_to_tuple_if_list(v) for k, v in obj["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in obj["options"].items()}
    libs = options.get("extern_libs") or ()
    if not all(Path(path).is_file() for _, path in libs):
        # the recording machine's paths (its libdevice): this Triton's own instead - the cache key hashes the
        # library's content, not its path, so the same Triton release gives the same key
        options.pop("extern_libs")
    options = make_backend(target).parse_options(options)
    hits: list[bool] = []
    comp = triton.knobs.compilation
    previous = comp.listener

    def listener(**kw: Any) -> None:
        hits.append(bool(kw.get("cache_hit")))
        if previous is not None:
            previous(**kw)

    comp.listener = listener
    try:
        triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    finally:
        comp.listener = previous
    return bool(hits and hits[0])


def toolchain_fingerprint(target: tuple[str, int, int] = ("cuda", 90, 32)) -> str:
    """``triton <version> key <digest> backend <digest>``: the parts of Triton's cache key that depend on the
    installation (its own sources and binaries; the ptxas it calls, and the arch). Two machines whose fingerprints
    agree compile a record to the same cache entry, so a cache filled on one (a CPU machine with the same Triton
    wheel) serves the other."""
    import hashlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.cache import triton_key

    def digest(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    return (f"triton {triton.__version__} key {digest(triton_key())} "
            f"backend {digest(str(make_backend(GPUTarget(*target)).hash()))}")


def _compile_chunk(args: tuple[list[dict[str, str]], tuple[str, int, int], float]) -> tuple[int, int, list[str]]:
    records, (backend, arch, warp), deadline = args
    from triton.backends.compiler import GPUTarget

    target = GPUTarget(backend, arch, warp)
    compiled = hits = 0
    errors: list[str] = []
    for r in records:
        if time.time() > deadline:
            errors.append(f"{r['fn']}: not reached (time limit)")
            continue
        try:
            if compile_record(r, target):
                hits += 1
            else:
                compiled += 1
        except Exception as e:  # noqa: BLE001 - reported: a stale record costs nothing but its line
            errors.append(f"{r['fn']}: {type(e).__name__}: {str(e)[:200]}")
    return compiled, hits, errors


def precompile(records: list[dict[str, str]], *, jobs: int, target: tuple[str, int, int] = ("cuda", 90, 32),
               time_limit_s: float = 150.0) -> tuple[int, int, list[str]]:
    """Compile ``records`` in ``jobs`` spawned processes (round-robin chunks); returns (compiled, already cached,
    errors). Records left when ``time_limit_s`` runs out are reported, not compiled."""
    import multiprocessing as mp

    deadline = time.time() + time_limit_s
    chunks = [records[i::jobs] for i in range(jobs) if records[i::jobs]]
    if jobs <= 1 or len(chunks) <= 1:
        return _compile_chunk((records, target, deadline))
    compiled = hits = 0
    errors: list[str] = []
    with ProcessPoolExecutor(len(chunks), mp_context=mp.get_context("spawn")) as pool:
        for c, h, e in pool.map(_compile_chunk, [(chunk, target, deadline) for chunk in chunks]):
            compiled, hits, errors = compiled + c, hits + h, errors + e
    return compiled, hits, errors
