"""Communicator interface and the two reference communicators."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Communicator(Protocol):
    """What the allreduce and TP-split MoE ops need from a process group."""

    name: str
    rank: int
    world_size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over ranks in place and return it."""
        ...

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim`` (rank order)."""
        ...


class LocalCommunicator:
    """World of one: collectives are identities (the TP=1 case of every op)."""

    name = "local"
    rank = 0
    world_size = 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return t


class TorchDistributedCommunicator:
    """torch.distributed process group; fp32 reduction for bf16 inputs so every rank rounds once."""

    name = "torch.distributed"

    def __init__(self, group: object | None = None):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
        self._dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype in (torch.bfloat16, torch.float16):
            acc = t.float()
            self._dist.all_reduce(acc, group=self.group)
            t.copy_(acc)
        else:
            self._dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self._dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


class ExcludedCommunicator:
    """One rank of a ``world_size``-rank group on one GPU, with communication left out (benches).

    PERF.md's one-GPU bench times rank 0 of a TP shard and excludes communication. This stands in
    for the group so that a TP program runs its rank's share of the work unchanged:

    * ``all_reduce`` returns its input (the other ranks' partial sums are not added);
    * ``all_gather`` writes this rank's slice into a static buffer (one copy kernel) whose other
      ranks' slices were filled once with N(0, stand_in_std) values - so a gathered router's
      top-k sees logits of a realistic scale for the other ranks' experts, not zeros or copies;
      a producer may write into that slice directly (``gather_slot``): no copy then.

    Numbers that go through it are NOT those of a real group: use it for timing only.
    """

    name = "excluded"

    def __init__(self, world_size: int, rank: int = 0, *, seed: int = 0, stand_in_std: float = 1.0):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of a world of {world_size}")
        self.stand_in_std = stand_in_std
        """Scale of the other ranks' stand-in values (normed activations through 1/sqrt(fan_in) weights: ~1)."""
        self.rank, self.world_size = rank, world_size
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._seed = seed

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        dim = dim % t.dim()
        buf, mine = self.gather_slot(tuple(t.shape), t.dtype, t.device, dim)
        if not _same_view(t, mine):   # a producer that wrote into gather_slot() needs no copy
            mine.copy_(t)
        return buf

    def gather_slot(self, part_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                    dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """(gathered buffer, this rank's slice of it) for a part of ``part_shape``: a producer that
        writes its output into the slice makes ``all_gather`` of that slice free of copies - as an
        in-place all-gather would be on a real group (the bench excludes communication, not copies
        of the stand-in's own making)."""
        dim = dim % len(part_shape)
        device = torch.device(device)
        key = (tuple(part_shape), dim, dtype, device)
        buf = self._buffers.get(key)
        width = part_shape[dim]
        if buf is None:
            shape = list(part_shape)
            shape[dim] = width * self.world_size
            # seeded by creation order, not by data: two programs built alike get the same stand-ins
            g = torch.Generator(device=device).manual_seed(self._seed + len(self._buffers))
            if dtype.is_floating_point:
                buf = (torch.randn(shape, generator=g, device=device) * self.stand_in_std).to(dtype)
            else:
                buf = torch.zeros(shape, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf, buf.narrow(dim, self.rank * width, width)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` are the same elements of the same storage (same start, shape, strides)."""
    return (a.device == b.device and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)
