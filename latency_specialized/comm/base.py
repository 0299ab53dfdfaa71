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
      top-k sees logits of a realistic scale for the other ranks' experts, not zeros or copies.

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
        key = (tuple(t.shape), dim, t.dtype, t.device)
        buf = self._buffers.get(key)
        width = t.shape[dim]
        if buf is None:
            shape = list(t.shape)
            shape[dim] = width * self.world_size
            # seeded by creation order, not by data: two programs built alike get the same stand-ins
            g = torch.Generator(device=t.device).manual_seed(self._seed + len(self._buffers))
            if t.is_floating_point():
                buf = (torch.randn(shape, generator=g, device=t.device) * self.stand_in_std).to(t.dtype)
            else:
                buf = torch.zeros(shape, dtype=t.dtype, device=t.device)
            self._buffers[key] = buf
        buf.narrow(dim, self.rank * width, width).copy_(t)
        return buf
