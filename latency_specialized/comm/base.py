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
