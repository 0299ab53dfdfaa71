"""Zeroed int32 workspaces kept per (device, stream): ticket counters and grid-barrier words of kernels whose every
call leaves them zeroed again (so graph replays need no memset). Calls on one stream run one after another and may
share a workspace; two streams (the side stream's shared experts beside the main stream) never do.

Kept out of ``triton_common``: that module is in the CuTe DSL compile fingerprint, and a Triton-only helper must not
move it."""

from __future__ import annotations

import torch

from latency_specialized.kernels.triton_common import cached_zeroed_int32


def zeroed_int32_per_stream(owner: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``cached_zeroed_int32`` for calls on the current stream of ``device``: one tensor per (``owner``, shape,
    device, stream). Inside a CUDA-graph capture on a stream that has none yet, a fresh one is made in the graph (its
    zeroing replays with it) and not kept."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    return cached_zeroed_int32(f"{owner}@stream{stream}", shape, device)


__all__ = ["zeroed_int32_per_stream"]
