"""Kernel census: how many kernel nodes each op site adds to a CUDA graph while it is captured.

A graph's node count says how many kernels a decode step launches; the census says *which site*
launched them, so a bench can report kernels per layer with and without the communication sites
(the issue's "communication not counted") and a user can see where the kernels go::

    census = KernelCensus()
    census.instrument(program)          # wraps every op of every bucket's bound op table
    runner.capture(buckets)             # sites record while their stream is capturing
    census.kernels(bucket)              # Counter: site -> kernel nodes (one capture)

Only calls made while the current stream is capturing are counted (eager warm-up steps are not);
a site called inside another site counts once, for the outer one. How it reads the count: the
driver's ``cuStreamGetCaptureInfo`` hands back the graph under construction, and
``cuGraphGetNodes`` its nodes so far - before and after the site's host code runs. Without a CUDA
driver (CPU machines) the census stays empty and ``available`` is False: callers report "unknown".
"""

from __future__ import annotations

import ctypes
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from latency_specialized.runtime.graph_runner import count_nodes

COMMUNICATION_SUFFIXES = ("allreduce", "all_gather")
"""Site names ending so are communication: on one GPU their kernels are stand-ins for the exchange
(the fused all-reduce sites run the one-rank residual + RMSNorm kernel that the real fused
all-reduce replaces, the all-gathers copy the rank's slice)."""

_CAPTURE_ACTIVE = 1  # CU_STREAM_CAPTURE_STATUS_ACTIVE


def _current_stream() -> int:
    """The current CUDA stream's handle (0 without CUDA: only fake drivers are asked then)."""
    return torch.cuda.current_stream().cuda_stream if torch.cuda.is_available() else 0


def is_communication(site: str) -> bool:
    """True for all-reduce and all-gather sites (see COMMUNICATION_SUFFIXES)."""
    return site.endswith(COMMUNICATION_SUFFIXES)


def split_communication(kernels: dict[str, float]) -> tuple[float, float]:
    """(communication kernels, other kernels) of a site -> kernels mapping."""
    comm = sum(v for k, v in kernels.items() if is_communication(k))
    return comm, sum(kernels.values()) - comm


class _Driver:
    """The two driver calls the census needs, through ctypes (None-safe on machines without CUDA)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        # v3 (CUDA >= 12.3) and v2 take the same leading arguments; edge data / dependencies may be NULL
        self._info_v3 = getattr(lib, "cuStreamGetCaptureInfo_v3", None)
        self._info_v2 = getattr(lib, "cuStreamGetCaptureInfo_v2", None)
        if self._info_v3 is None and self._info_v2 is None:
            raise OSError("libcuda has no cuStreamGetCaptureInfo_v2/_v3")
        self._lib = lib

    def capturing_graph(self, stream: int) -> tuple[int, int] | None:
        """(capture id, graph handle) of the capture ``stream`` takes part in, or None."""
        status, cid, graph = ctypes.c_int(0), ctypes.c_uint64(0), ctypes.c_void_p()
        s = ctypes.c_void_p(stream)
        if self._info_v3 is not None:
            rc = self._info_v3(s, ctypes.byref(status), ctypes.byref(cid), ctypes.byref(graph), None, None, None)
        else:
            rc = self._info_v2(s, ctypes.byref(status), ctypes.byref(cid), ctypes.byref(graph), None, None)
        if rc != 0 or status.value != _CAPTURE_ACTIVE or not graph.value:
            return None
        return cid.value, graph.value

    def kernel_nodes(self, graph: int) -> int:
        """Kernel nodes of ``graph`` (child graphs included)."""
        counts: dict[str, int] = {}
        count_nodes(self._lib, graph, counts)
        return counts.get("kernel", 0)


class KernelCensus:
    """Kernel nodes per op site per batch bucket, recorded during CUDA-graph capture.

    Parameters
    ----------
    driver : the driver shim (tests pass a fake); default: libcuda through ctypes, or none (then
        ``available`` is False and nothing is recorded).
    """

    def __init__(self, driver: Any = None) -> None:
        self.error: str | None = None
        if driver is None and torch.cuda.is_available():
            try:
                driver = _Driver()
            except OSError as e:
                self.error = str(e)
        self._driver = driver
        self._depth = 0
        self._counts: dict[int, Counter[str]] = {}
        self._capture_of: dict[int, int] = {}

    @property
    def available(self) -> bool:
        return self._driver is not None

    def kernels(self, bucket: int) -> Counter[str] | None:
        """Site -> kernel nodes of the bucket's latest capture (None: not captured with the census)."""
        c = self._counts.get(bucket)
        return Counter(c) if c is not None else None

    @contextmanager
    def site(self, name: str, bucket: int) -> Iterator[None]:
        """Count the kernel nodes the body adds to the graph the current stream is capturing."""
        drv = self._driver
        cap = drv.capturing_graph(_current_stream()) if (drv and self._depth == 0) else None
        if cap is None:  # not capturing, nested, or no driver: run it uncounted
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        cid, graph = cap
        if self._capture_of.get(bucket) != cid:  # a new capture of this bucket starts a new count
            self._capture_of[bucket] = cid
            self._counts[bucket] = Counter()
        before = self._nodes(graph, bucket)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        after = self._nodes(graph, bucket) if before is not None else None
        if after is not None and bucket in self._counts:
            self._counts[bucket][name] += after - before

    def _nodes(self, graph: int, bucket: int) -> int | None:
        """Kernel nodes so far; a driver error never breaks the capture: the census stops counting
        (``error`` says why, the bucket's counts are dropped: callers report "unknown")."""
        if self._driver is None:
            return None
        try:
            return self._driver.kernel_nodes(graph)
        except (OSError, RuntimeError) as e:
            self.error = f"kernel census stopped: {e}"
            self._driver = None
            self._counts.pop(bucket, None)
            return None

    def wrap(self, name: str, bucket: int, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` counted as site ``name`` of ``bucket``."""

        def counted(*args: Any, **kw: Any) -> Any:
            with self.site(name, bucket):
                return fn(*args, **kw)

        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        return counted

    def instrument(self, program: Any) -> int:
        """Wrap every op of ``program``'s bound op table (``program.op_table.wrap(hook)``, the one public
        way to instrument a program: ``runtime/program.py``) and set ``program.census`` (a program that
        counts its non-site communication, e.g. all-gathers, does it through it). Call after any
        rebinding of sites. Returns the number of ops wrapped.

        A ``runtime.op_table.OpTable`` (the composed program) also runs its communication calls through
        the hook, so they are counted too."""
        table = getattr(program, "op_table", None)
        if table is None:
            raise TypeError(f"{type(program).__name__} exposes no op_table: a program the census counts binds its "
                            "sites in an op table with wrap(hook) (runtime.op_table.OpTable)")
        program.census = self
        return table.wrap(self.wrap)


__all__ = ["KernelCensus", "COMMUNICATION_SUFFIXES", "is_communication", "split_communication"]
