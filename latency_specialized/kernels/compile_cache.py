"""Compile cache shared by every CuTe DSL kernel.

Kernels compile through :func:`cached_compile`, keyed by (kernel qualname, hashable static
config: shapes, dtype, tile/split choice) + the target arch. Compiling is slow (0.1-10 s) and a
CUDA graph cannot JIT, so the runtime compiles everything before capture (``warm`` lists what was
compiled, for progress output). Dynamic sizes (the token count M) stay symbolic where a kernel
supports it, so one compile serves every batch bucket.

Two tiers:

* memory: one compiled function per key and process;
* disk (opt-in: ``$LS_KERNEL_CACHE_DIR``): the TVM-FFI object file of each compile
  (``export_to_c``), loaded back with ``cute.runtime.load_module`` in ~1 ms. The directory is
  fingerprinted by the CuTe DSL kernel sources (``dsl_sources``) and the cutlass-dsl / tvm-ffi
  versions, files are written to a temporary name and renamed (no torn reads when processes
  race), and an object that fails to load is recompiled and the failure logged - a cache may only ever cost time.

:func:`precompile` compiles a list of (function, args) units in parallel, GPU-blind worker
processes (spawned, ``CUTE_DSL_ARCH`` pinned: ``cute.compile`` is not thread-safe and forking a
CUDA process is unsafe) that fill the disk tier; the parent then loads instead of compiling.

``cute_available()`` says whether nvidia-cutlass-dsl imports here; implementations use it in
``supports()`` so that the plan names the missing package instead of failing at call time.
"""

from __future__ import annotations

import ast
import contextvars
import functools
import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Sequence

_LOCK = threading.Lock()  # cute.compile is not thread-safe (MLIR thread-local state)
_CACHE: dict[tuple[Hashable, ...], Any] = {}
COMPILE_LOG: list[tuple[str, float]] = []
"""(key description, seconds) of every compile or disk load in this process, for progress/bench output."""

CACHE_DIR_ENV = "LS_KERNEL_CACHE_DIR"
UNIT_LOG: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] | None = None
"""While a list (``testing.cute_units`` sets one for a recorded GPU run): the (compile function, args, kwargs) of
every call of a :func:`compile_unit` function that compiled or loaded a new kernel in this process - what another
machine needs to compile the same kernels ahead (``precompile``)."""
_UNIT: contextvars.ContextVar[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None] = \
    contextvars.ContextVar("ls_compile_unit", default=None)


@functools.cache
def cute_available() -> bool | str:
    """True when nvidia-cutlass-dsl is installed, else the reason (names the fix).

    Only locates the package (planning must stay fast: importing cutlass takes seconds); a broken
    install then fails at the first compile, with the DSL's own error.
    """
    import importlib.util

    try:
        found = importlib.util.find_spec("cutlass") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return "nvidia-cutlass-dsl not installed; install the [gpu] or [kernels] extra"
    return True


def target_arch() -> str:
    """The arch kernels are compiled for: $CUTE_DSL_ARCH, else the current GPU, else sm_90a.

    A process without a GPU must name the arch explicitly (the DSL would silently pick sm_100a).
    """
    env = os.environ.get("CUTE_DSL_ARCH")
    if env:
        return env
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}a"
    except Exception:  # noqa: BLE001
        pass
    return "sm_90a"


_PACKAGE = "latency_specialized.kernels"


def _imported_modules(tree: ast.AST) -> set[str]:
    """Dotted names a module's source imports, anywhere in it (function-level imports too): ``import a.b`` -> a.b,
    ``from a import b`` -> a and a.b, relative imports resolved inside the kernels package."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:      # relative: inside the kernels package
                base = f"{_PACKAGE}.{base}" if base else _PACKAGE
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def dsl_sources(root: Path | None = None) -> list[Path]:
    """The kernel modules whose source can change a CuTe DSL compile: every module of ``root`` (the kernels
    package) that imports cutlass, what they import from the package (transitively) and this module. A Triton-only
    kernel's source enters Triton's own cache key, not this one: editing it keeps the CuTe DSL objects. So a module
    with DSL code imports cutlass itself (``tests/foundation/test_compile_cache_fingerprint.py`` checks it)."""
    root = root or Path(__file__).parent
    imports = {p.stem: _imported_modules(ast.parse(p.read_text(), str(p))) for p in sorted(root.glob("*.py"))}
    todo = [m for m, names in imports.items() if any(n.split(".")[0] == "cutlass" for n in names)]
    todo.append(Path(__file__).stem)
    seen: set[str] = set()
    while todo:
        m = todo.pop()
        if m in seen or m not in imports:
            continue
        seen.add(m)
        todo.extend(n.split(".")[2] for n in imports[m] if n.startswith(_PACKAGE + "."))
    return [root / f"{m}.py" for m in sorted(seen)]


@functools.cache
def _fingerprint() -> str:
    return source_fingerprint()


def source_fingerprint(root: Path | None = None) -> str:
    """Hash of the sources that can change a CuTe DSL compile (``dsl_sources`` of ``root``) and the DSL versions: a
    change to either starts a new disk-cache directory."""
    from importlib import metadata

    h = hashlib.sha256()
    for path in dsl_sources(root):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
        try:
            h.update(f"{dist}={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist}=?".encode())
    return h.hexdigest()[:16]


def disk_dir() -> Path | None:
    """The disk tier's directory, or None when $LS_KERNEL_CACHE_DIR is unset/empty."""
    root = os.environ.get(CACHE_DIR_ENV)
    if not root:
        return None
    d = Path(root) / _fingerprint()
    d.mkdir(parents=True, exist_ok=True)
    return d


def _symbol(full_key: tuple[Hashable, ...]) -> tuple[str, str]:
    digest = hashlib.sha1(repr(full_key).encode()).hexdigest()[:20]
    return f"k{digest}", f"k{digest}.o"


def _disk_load(full_key: tuple[Hashable, ...]) -> Any | None:
    d = disk_dir()
    if d is None:
        return None
    sym, fname = _symbol(full_key)
    path = d / fname
    if not path.exists():
        return None
    try:
        import cutlass.cute as cute

        module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
        return getattr(module, sym)
    except Exception as e:  # noqa: BLE001 - a bad object only costs a recompile, and is logged
        COMPILE_LOG.append((f"disk load failed for {full_key}: {type(e).__name__}: {e}", 0.0))
        return None


def _disk_store(full_key: tuple[Hashable, ...], compiled: Any) -> None:
    d = disk_dir()
    if d is None or not hasattr(compiled, "export_to_c"):
        return
    sym, fname = _symbol(full_key)
    tmp = d / f".{fname}.{os.getpid()}.tmp.o"
    try:
        compiled.export_to_c(str(tmp), function_name=sym)
        os.replace(tmp, d / fname)
    except Exception as e:  # noqa: BLE001
        COMPILE_LOG.append((f"disk store failed for {full_key}: {type(e).__name__}: {e}", 0.0))
        tmp.unlink(missing_ok=True)


def compile_unit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a module-level compile function (its arguments: plain values and config dataclasses) whose calls that
    reach a new kernel are recorded while :data:`UNIT_LOG` is a list; otherwise the call passes straight through."""

    @functools.wraps(fn)
    def unit(*args: Any, **kwargs: Any) -> Any:
        if UNIT_LOG is None:
            return fn(*args, **kwargs)
        token = _UNIT.set((unit, args, kwargs))
        try:
            return fn(*args, **kwargs)
        finally:
            _UNIT.reset(token)

    return unit


def cached_compile(name: str, key: tuple[Hashable, ...], build: Callable[[str], Any]) -> Any:
    """Return the compiled kernel for (name, key, arch), building it with ``build(arch)`` once."""
    arch = target_arch()
    full_key = (name, arch) + tuple(key)
    hit = _CACHE.get(full_key)
    if hit is not None:
        return hit
    with _LOCK:
        hit = _CACHE.get(full_key)
        if hit is None:
            unit = _UNIT.get()
            if UNIT_LOG is not None and unit is not None:
                UNIT_LOG.append(unit)
            t0 = time.perf_counter()
            hit = _disk_load(full_key)
            if hit is not None:
                COMPILE_LOG.append((f"{name}{key}@{arch} (disk)", time.perf_counter() - t0))
            else:
                hit = build(arch)
                _disk_store(full_key, hit)
                COMPILE_LOG.append((f"{name}{key}@{arch}", time.perf_counter() - t0))
            _CACHE[full_key] = hit
    return hit


def compiled_count() -> int:
    return len(_CACHE)


def forget() -> None:
    """Drop the memory tier (the disk tier stays): the next lookups load from disk or compile."""
    with _LOCK:
        _CACHE.clear()


CompileUnit = tuple[Callable[..., Any], Sequence[Any]]
"""A module-level compile function and its arguments, e.g. (compile_gemv, (7168, 1, cfg, False))."""


def _worker(args: tuple[CompileUnit, str]) -> tuple[str, float, str]:
    (fn, fargs), arch = args
    os.environ["CUTE_DSL_ARCH"] = arch
    t0 = time.perf_counter()
    try:
        fn(*fargs)
        return (f"{fn.__name__}{tuple(fargs)}", time.perf_counter() - t0, "")
    except Exception as e:  # noqa: BLE001 - reported to the parent, which compiles it itself later
        return (f"{fn.__name__}{tuple(fargs)}", time.perf_counter() - t0, f"{type(e).__name__}: {e}")


def precompile(units: Iterable[CompileUnit], jobs: int | None = None) -> list[tuple[str, float, str]]:
    """Compile ``units`` in ``jobs`` spawned processes into the disk tier; returns (unit, s, error).

    Without a disk tier ($LS_KERNEL_CACHE_DIR) or with jobs <= 1 the units compile here, serially.
    A worker that dies (not just raises) breaks the pool: the units left then compile here.
    """
    units = list(dict.fromkeys((fn, tuple(a)) for fn, a in units))
    jobs = jobs or max(1, (os.cpu_count() or 2) - 1)
    arch = target_arch()
    if disk_dir() is None or jobs <= 1 or len(units) <= 1:
        return [_worker(((fn, a), arch)) for fn, a in units]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    out: list[tuple[str, float, str]] = []
    try:
        with ProcessPoolExecutor(min(jobs, len(units)), mp_context=mp.get_context("spawn")) as pool:
            for r in pool.map(_worker, [((fn, a), arch) for fn, a in units]):
                out.append(r)
    except BrokenProcessPool as e:
        done = len(out)
        out.append(("worker pool", 0.0, f"BrokenProcessPool: {e}; compiling the rest here"))
        out += [_worker(((fn, a), arch)) for fn, a in units[done:]]
    return out
