"""Run a function on W local processes with a process group: tests, benchmarks, the CPU emulation.

    results = run_world(fn, world_size, *args, timeout=120)

Each process gets ``fn(rank, world_size, *args)`` after ``init_process_group`` (gloo: it works on
CPU and for several processes sharing one GPU, where NCCL refuses duplicate devices).

Processes start fresh, never forked from the caller (which may hold CUDA state): ``spawn``, or by
default ``forkserver`` with torch preloaded - the server imports torch once (it never touches
CUDA) and forks children from that clean state, so a world of 8 starts in about a second
instead of paying ~3 s of torch import per process. A watchdog
kills every process and raises :class:`WorldTimeout` when the world does not finish in
``timeout`` seconds (a hang in a barrier-free protocol must fail a test, not stall CI); a rank
that raises fails the world with its traceback. NVLink multicast stays off in every child.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable, Sequence

from latency_specialized.comm.symmetric import NO_MULTICAST_ENV


class WorldTimeout(RuntimeError):
    """A multi-process run did not finish before its watchdog fired."""


class WorldError(RuntimeError):
    """A rank of a multi-process run raised."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, env: dict[str, str],
           threads: int, timeout: float, out) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)  # W processes on a few cores: no oversubscription
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        result = fn(rank, world_size, *args)
        out.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer may already be gone
                pass


PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.testing", "latency_specialized.comm.worlds",
           "latency_specialized.comm.emulation"]
"""Imported once by the fork server (none touches CUDA): what every world body needs anyway
(torch.distributed.tensor: assert_close imports it lazily, ~4 s of sympy per process). Callers add
the modules their bodies use (``run_world(..., preload=...)``; comm names nothing above itself)."""


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
              env: dict[str, str] | None = None, threads: int = 1, start_method: str = "forkserver",
              preload: Sequence[str] = ()) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each in its own process.

    ``fn`` must be importable by name (module level). ``start_method``: 'forkserver' (default,
    torch preloaded) or 'spawn'. ``preload``: more modules the fork server imports once, after
    :data:`PRELOAD` (the fork server starts with the first forkserver world of a process: its
    ``preload`` counts). Raises WorldError (first failing rank's traceback) or WorldTimeout (every
    process killed).
    """
    import torch.multiprocessing as mp

    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method {start_method!r}: use 'forkserver' or 'spawn' (never fork a CUDA parent)")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD + [m for m in preload if m not in PRELOAD])
    out = ctx.Queue()
    child_env = {**NO_MULTICAST_ENV, **(env or {})}
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, child_env, threads, timeout, out),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise WorldTimeout(f"world of {world_size}: ranks {missing} did not finish within {timeout:.0f} s "
                                   f"(watchdog): a hang or a dead peer")
            try:
                rank, ok, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    raise WorldError(f"world of {world_size}: rank {dead[0]} died with exit code "
                                     f"{procs[dead[0]].exitcode} before reporting")
                continue
            if not ok:
                raise WorldError(f"world of {world_size}: rank {rank} raised:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5.0 if len(results) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    return [results[r] for r in range(world_size)]
