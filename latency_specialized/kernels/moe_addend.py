"""The routed experts' addend: ``moe.experts(..., addend=a)`` returns ``routed + a`` (a plain MoE's shared experts).

A plain MoE's output is the routed experts' sum plus the shared experts' output. Added by a kernel of its own it
costs a launch between the experts and the residual (measured: ``models/deepseek_v41_flash/NOTES.md``); an
implementation whose last stage writes the routed sum adds the addend there instead.

``addend`` is a ``[M, N]`` tensor in the activation dtype, or a zero-argument callable returning one: the shared
experts' side-stream join (``runtime.side_stream.Pending.join``), which the implementation calls right before the
stage that reads the addend, so the shared experts keep overlapping the routed experts' first stage.

Rounding (every implementation, and the reference): the routed sum is rounded to the activation dtype first, then
``round(routed + addend)`` - exactly ``y + a`` of two bf16 tensors in torch. The result may be written into the
addend's own memory (it is the caller's scratch: the shared experts' output).
"""

from __future__ import annotations

from typing import Callable, Union

import torch

from latency_specialized.errors import UserError

Addend = Union[torch.Tensor, Callable[[], torch.Tensor], None]
"""What ``moe.experts`` adds to the routed sum: a tensor, a callable returning it (a side stream's join), or None."""


def resolve_addend(addend: Addend, rows: int, width: int, dtype: torch.dtype, what: str) -> torch.Tensor | None:
    """The addend as a ``[rows, width]`` tensor of ``dtype`` (calling it if it is a join), or None; UserError if its
    shape or dtype does not fit the experts' output."""
    if addend is None:
        return None
    a = addend() if callable(addend) else addend
    if not isinstance(a, torch.Tensor) or tuple(a.shape) != (rows, width) or a.dtype != dtype:
        got = f"{tuple(a.shape)} {a.dtype}" if isinstance(a, torch.Tensor) else type(a).__name__
        raise UserError(f"{what}: addend must be [{rows}, {width}] {dtype} (the experts' output), got {got}")
    return a


def check_addend_use(addend: Addend, per_route: bool, what: str) -> None:
    """UserError for an addend with ``per_route`` (there is no sum to add it to)."""
    if addend is not None and per_route:
        raise UserError(f"{what}: addend needs the combined output; per_route returns every route apart (add it after "
                        "the finalize instead)")


def add_addend(y: torch.Tensor, addend: Addend, what: str) -> torch.Tensor:
    """``y + addend`` in place in ``y`` (one rounding, as torch's bf16 add) for implementations whose last stage
    cannot take it; ``y`` unchanged without an addend."""
    a = resolve_addend(addend, y.shape[0], y.shape[-1], y.dtype, what)
    if a is not None:
        torch.add(y, a, out=y)
    return y


def accumulate_target(addend: Addend, out: torch.Tensor | None, rows: int, width: int, dtype: torch.dtype,
                      what: str) -> torch.Tensor | None:
    """For a last stage that adds into its destination (``dst = round(round(sum) + dst)``): the destination
    holding the addend - ``out`` (the addend copied in, unless it is ``out`` itself) or the addend's own memory
    where there is no ``out``. None without an addend."""
    a = resolve_addend(addend, rows, width, dtype, what)
    if a is None:
        return None
    if a.stride(-1) != 1:
        a = a.contiguous()
    if out is None:
        return a
    if out.data_ptr() != a.data_ptr():
        out.copy_(a)
    return out


__all__ = ["Addend", "resolve_addend", "check_addend_use", "add_addend", "accumulate_target"]
