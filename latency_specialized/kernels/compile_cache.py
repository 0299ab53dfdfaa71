"""Compile cache shared by every CuTe DSL kernel.

Kernels compile through :func:`cached_compile`, keyed by (kernel qualname, hashable static
config: shapes, dtype, tile/split choice) + the target arch. Compiling is slow (0.1-10 s) and a
CUDA graph cannot JIT, so the runtime compiles everything before capture (``warm`` lists what was
compiled, for progress output). Dynamic sizes (the token count M) stay symbolic where a kernel
supports it, so one compile serves every batch bucket.

``cute_available()`` says whether nvidia-cutlass-dsl imports here; implementations use it in
``supports()`` so that the plan names the missing package instead of failing at call time.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any, Callable, Hashable

_LOCK = threading.Lock()  # cute.compile is not thread-safe (MLIR thread-local state)
_CACHE: dict[tuple[Hashable, ...], Any] = {}
COMPILE_LOG: list[tuple[str, float]] = []
"""(key description, seconds) of every compile in this process, for progress/bench output."""


@functools.cache
def cute_available() -> bool | str:
    """True when nvidia-cutlass-dsl imports, else the reason (names the fix)."""
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return f"nvidia-cutlass-dsl not importable ({type(e).__name__}); install the [gpu] or [kernels] extra"
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
            t0 = time.perf_counter()
            hit = build(arch)
            _CACHE[full_key] = hit
            COMPILE_LOG.append((f"{name}{key}@{arch}", time.perf_counter() - t0))
    return hit


def compiled_count() -> int:
    return len(_CACHE)
