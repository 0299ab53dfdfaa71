"""Helpers every stock composition shares: side streams (inline on the CPU) and random weights drawn on
the device with the real per-rank shapes."""

from __future__ import annotations

import contextlib

import torch

class StockLayers:
    """``copies`` stock layers of one kind run back to back (weights rotate beyond L2). Each layer has
    ``forward(stream_state)``, ``routed_ids()`` and ``weight_bytes()``; ``stream_state`` is what they share
    (the residual stream of the composition)."""

    name = "stock"

    def __init__(self, layers: list, stream_state: object):
        self.layers, self.st = layers, stream_state
        self.copies = len(layers)

    def step(self) -> None:
        for layer in self.layers:
            layer.forward(self.st)

    def routed_ids(self) -> list[torch.Tensor]:
        return [layer.routed_ids() for layer in self.layers]

    def weight_bytes(self) -> int:
        return sum(layer.weight_bytes() for layer in self.layers)


__all__ = ["on_stream", "fork", "join", "rand_weight", "rand_norm_weight", "StockLayers"]


def on_stream(stream):
    """Run on ``stream`` (a CUDA side stream), or inline where there is none (CPU tests)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def fork(stream) -> None:
    """``stream`` waits for the work queued so far on the current stream (no-op without a stream)."""
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())


def join(stream, *tensors: torch.Tensor) -> None:
    """The current stream waits for ``stream``; ``tensors`` made there are kept from early reuse."""
    if stream is not None:
        main = torch.cuda.current_stream()
        main.wait_stream(stream)
        for t in tensors:  # made on the side stream, used on main: keep the allocator from reusing it early
            t.record_stream(main)


def rand_weight(shape: tuple[int, ...], device, dtype=torch.bfloat16, fan_in: int | None = None) -> torch.Tensor:
    """Random weight ~ N(0, 1/fan_in) (fan_in: the last dim by default), drawn on ``device``."""
    fan = fan_in if fan_in is not None else shape[-1]
    t = torch.randn(shape, device=device, dtype=torch.float32 if dtype == torch.float32 else dtype)
    return t.mul_(fan ** -0.5).to(dtype)


def rand_norm_weight(n: int, device, dtype=torch.bfloat16) -> torch.Tensor:
    """Random RMSNorm gain around 1."""
    return (1.0 + 0.1 * torch.randn(n, device=device)).to(dtype)
