"""Helpers shared by the GPU op tests (imported as a sibling module by pytest's rootdir import)."""

from __future__ import annotations

import zlib

import torch


def seeded_generator(seed: int | str, device: str = "cuda") -> torch.Generator:
    """A device generator; string seeds hash with crc32 (stable across processes, unlike hash())."""
    if isinstance(seed, str):
        seed = zlib.crc32(seed.encode())
    return torch.Generator(device=device).manual_seed(seed)


def graph_replay(fn) -> torch.cuda.CUDAGraph:
    """Capture ``fn`` in a CUDA graph (after one warm-up call on a side stream) and replay it once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return g
