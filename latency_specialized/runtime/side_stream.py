"""Run independent work (the shared expert, a prefetch) on a side CUDA stream, graph-capturable.

    side = SideStream()                       # once, before capture
    pending = side.run(shared_mlp, x, w13, w2, act)   # fork: side waits for the current stream
    routed = experts(...)                     # main stream, overlaps the side work
    shared = pending.join()                   # join: the current stream waits for the side stream

Fork and join are CUDA events recorded on one stream and waited on by the other. Inside
``torch.cuda.graph`` capture those become graph edges, so a captured graph contains both branches
and rejoins (capture fails with "unjoined" work if ``join`` is never called: ``Pending`` also
works as a context manager that joins on exit).

Memory safety across streams (the known failure mode: side-stream tensors freed early ->
illegal address during capture or replay):

* every tensor argument is ``record_stream``-ed on the side stream, so the caching allocator does
  not hand its memory to the main stream while the side kernels may still read it;
* tensors the side work returns were allocated on the side stream; ``join`` records them on the
  joining stream for the same reason, and ``Pending`` holds references to inputs and outputs until
  it is joined.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from latency_specialized.errors import UserError


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors inside (nested) tuples/lists/dicts, for record_stream."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


class Pending:
    """Work forked onto a side stream; ``join()`` makes the current stream wait for it."""

    def __init__(self, side: "SideStream", result: Any, keep_alive: list[torch.Tensor]):
        self._side = side
        self._result = result
        self._keep = keep_alive
        self._done = torch.cuda.Event()
        self._done.record(side.stream)
        self._joined = False

    def join(self) -> Any:
        """Current stream waits for the side work; returns what the side function returned."""
        if self._joined:
            return self._result
        main = torch.cuda.current_stream(self._side.stream.device)
        main.wait_event(self._done)
        for t in _tensors(self._result):
            t.record_stream(main)
        self._joined = True
        self._keep = []
        return self._result

    def __enter__(self) -> "Pending":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.join()


class SideStream:
    """A CUDA stream forked from and joined back into the current stream.

    Create it before graph capture (stream creation is not captured). ``priority`` follows
    torch.cuda.Stream (lower is higher priority); the shared expert runs at the default.
    """

    def __init__(self, device: torch.device | str | int | None = None, priority: int = 0):
        if not torch.cuda.is_available():
            raise UserError("SideStream needs a CUDA device; on CPU call the shared expert inline")
        self.stream = torch.cuda.Stream(device=device, priority=priority)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Pending:
        """Fork: ``fn(*args, **kwargs)`` runs on the side stream after the current stream's prior work."""
        main = torch.cuda.current_stream(self.stream.device)
        fork = torch.cuda.Event()
        fork.record(main)
        self.stream.wait_event(fork)
        inputs = _tensors(args) + _tensors(kwargs)
        for t in inputs:
            if t.is_cuda:
                t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            result = fn(*args, **kwargs)
        return Pending(self, result, inputs + _tensors(result))


__all__ = ["SideStream", "Pending"]
