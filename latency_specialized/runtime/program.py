"""DecodeProgram: the per-layer op sequence of one model's decode step, as the runtime sees it.

An adapter composes its decode step from op-family calls and hands the runtime an object with
this shape. The graph runner only needs four things from it:

* ``prepare(bucket)`` - compile every kernel and allocate every workspace the step of that
  bucket touches, *before* capture (a graph cannot JIT or allocate outside its pool);
* ``step(buffers, bucket)`` - run one decode step on rows ``[:bucket]`` of the static buffers and
  write the static ``outputs()``; no host syncs, no allocation that depends on data, side streams
  forked from and joined back into the current stream (so a capture takes them in);
* ``state_tensors()`` - the mutable device state (recurrent states, KV caches) that a step
  updates, so the runner can snapshot it around warm-up runs;
* ``outputs()`` - the static output tensors (``[max_batch, ...]``), read after a replay.

``FunctionProgram`` adapts a plain function to this shape (tests, benches, toy programs).

A program that binds op sites also exposes them as ``op_table``: an object with
``wrap(hook) -> int`` that replaces every bound op ``fn`` by ``hook(site, bucket, fn)`` (the census,
routing recorders and the benches' communication stand-ins instrument a program only this way);
``runtime.op_table.OpTable`` is the one the composed program binds.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import torch

from latency_specialized.runtime.buffers import DecodeBuffers


@runtime_checkable
class DecodeProgram(Protocol):
    """What the graph runner drives (see the module docstring)."""

    max_batch: int
    """Largest bucket the program's workspaces are sized for."""

    def prepare(self, bucket: int) -> None:
        """Compile kernels and allocate workspaces for ``bucket`` (called before capture)."""
        ...

    def step(self, buffers: DecodeBuffers, bucket: int) -> None:
        """One decode step over rows ``[:bucket]``; graph-capturable (no host syncs)."""
        ...

    def state_tensors(self) -> Sequence[torch.Tensor]:
        """Device state the step mutates in place (recurrent state, KV cache, conv tails)."""
        ...

    def outputs(self) -> Mapping[str, torch.Tensor]:
        """Static outputs ``[max_batch, ...]`` written by ``step`` (e.g. 'logits', 'next_tokens')."""
        ...


OpHook = Callable[[str, int, Callable[..., Any]], Callable[..., Any]]
"""``hook(site, bucket, fn) -> fn'``: wraps (or replaces) one bound op."""


@runtime_checkable
class WrappableOps(Protocol):
    """A program's bound ops as instrumentation sees them (``program.op_table``)."""

    def wrap(self, hook: OpHook) -> int:
        """Replace every bound op ``fn`` by ``hook(site, bucket, fn)``; returns the number of ops wrapped."""
        ...


class FunctionProgram:
    """A DecodeProgram from plain callables and tensors.

    Parameters
    ----------
    step_fn : ``step_fn(buffers, bucket)``; must write ``outputs`` in place.
    outputs : static output tensors by name.
    state : mutable device state the step updates.
    max_batch : largest bucket.
    prepare_fn : optional ``prepare_fn(bucket)`` warm-up/compile hook.
    """

    def __init__(self, step_fn: Callable[[DecodeBuffers, int], None], outputs: Mapping[str, torch.Tensor],
                 state: Sequence[torch.Tensor] = (), *, max_batch: int,
                 prepare_fn: Callable[[int], None] | None = None):
        self._step, self._outputs, self._state = step_fn, dict(outputs), list(state)
        self._prepare = prepare_fn
        self.max_batch = max_batch
        self.prepared: list[int] = []
        """Buckets ``prepare`` was called for, in order (lets tests check the hook ran before capture)."""

    def prepare(self, bucket: int) -> None:
        if self._prepare is not None:
            self._prepare(bucket)
        self.prepared.append(bucket)

    def step(self, buffers: DecodeBuffers, bucket: int) -> None:
        self._step(buffers, bucket)

    def state_tensors(self) -> Sequence[torch.Tensor]:
        return self._state

    def outputs(self) -> Mapping[str, torch.Tensor]:
        return self._outputs


def check_program(program: object) -> None:
    """Raise TypeError naming the missing members when ``program`` is not a DecodeProgram."""
    missing = [m for m in ("max_batch", "prepare", "step", "state_tensors", "outputs") if not hasattr(program, m)]
    if missing:
        raise TypeError(f"{type(program).__name__} is not a DecodeProgram: missing {', '.join(missing)}")
