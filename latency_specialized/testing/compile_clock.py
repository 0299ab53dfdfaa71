"""Seconds a process spends compiling kernels, for the GPU suite's per-test record.

The GPU suite's time on a fresh machine is mostly compiling (``benchmarks/NOTES_gpu_suite.md``); the record says per
test how much was compiling and of which kind:

* Triton: through ``triton.knobs.compilation.listener`` (Triton >= 3.4): one call per ``triton.compile``, a cache
  hit or a compile with its stage times. The launcher stub a new signature builds (a host C compile) is not in it.
* CuTe DSL: ``kernels.compile_cache.COMPILE_LOG`` (every compile and disk load with its seconds).

``CompileClock.install()`` chains to a listener already set, so it does not take one from another tool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

FIELDS = ("triton_s", "triton_n", "triton_hits", "cute_s", "cute_n")
"""What ``snapshot`` returns: Triton compile seconds / compiles / cache hits, CuTe DSL compile seconds / compiles."""


@dataclass
class CompileClock:
    """Cumulative compile counters of this process (Triton via its listener, CuTe DSL from the compile log)."""

    triton_s: float = 0.0
    triton_n: int = 0
    triton_hits: int = 0

    def on_triton_compile(self, *, times: Any = None, cache_hit: bool = False, **_: Any) -> None:
        """Triton's listener signature (``src, metadata, metadata_group, times, cache_hit``); times in us."""
        if cache_hit:
            self.triton_hits += 1
            return
        self.triton_n += 1
        if times is not None:
            us = (getattr(times, "ir_initialization", 0) + getattr(times, "store_results", 0)
                  + sum(d for _, d in getattr(times, "lowering_stages", ())))
            self.triton_s += us / 1e6

    def install(self) -> bool:
        """Hook Triton's compile listener (False: this Triton has none, or Triton is not installed)."""
        try:
            from triton import knobs
        except ImportError:
            return False
        comp = getattr(knobs, "compilation", None)
        if comp is None or not hasattr(comp, "listener"):
            return False
        previous: Callable[..., None] | None = comp.listener

        def listener(**kw: Any) -> None:
            self.on_triton_compile(**kw)
            if previous is not None:
                previous(**kw)

        comp.listener = listener
        return True

    def snapshot(self) -> dict[str, float]:
        """The counters now (``FIELDS``), CuTe DSL's read from the compile log (compiles only, not disk loads)."""
        cute_s, cute_n = cute_compile_totals()
        return {"triton_s": self.triton_s, "triton_n": self.triton_n, "triton_hits": self.triton_hits,
                "cute_s": cute_s, "cute_n": cute_n}


def cute_compile_totals() -> tuple[float, int]:
    """(seconds, count) of the CuTe DSL compiles this process made; disk loads and failure notes excluded."""
    from latency_specialized.kernels.compile_cache import COMPILE_LOG

    compiles = [s for desc, s in COMPILE_LOG if not desc.endswith("(disk)") and not desc.startswith("disk ")]
    return float(sum(compiles)), len(compiles)


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Per-field difference, rounded for the record (seconds to 0.01 s)."""
    return {k: round(after[k] - before[k], 2) if k.endswith("_s") else int(after[k] - before[k]) for k in FIELDS}
