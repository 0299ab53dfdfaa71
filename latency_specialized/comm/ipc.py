"""Peer-mapped buffers: every rank maps every peer's buffer into its own address space.

Two backends with one shape (``local`` tensor, ``peers`` tensors indexed by rank, ``peer_ptrs``):

* :class:`CudaIpcBuffers` - ``cudaMalloc`` + ``cudaIpcGetMemHandle``; handles travel over the
  process group (``all_gather_object``), peers open them with ``cudaIpcOpenMemHandle`` in their
  *own* device context (lazy peer access), so a kernel on that device can store into them.
  Unicast only: no multicast object is ever created (NVLink multicast must stay off).
* :class:`ShmBuffers` - ``/dev/shm`` files mapped by every rank, for the CPU emulation of the
  protocol (gloo process groups in tests).

Both are created collectively (every rank of the group calls the constructor) and released
with ``close()`` (also collective).
"""

from __future__ import annotations

import ctypes
import os
import secrets

import torch

from latency_specialized.errors import UserError

_IPC_HANDLE_BYTES = 64


class _CudaArray:
    """Minimal ``__cuda_array_interface__`` so torch can view raw device memory without a copy."""

    def __init__(self, ptr: int, numel: int):
        self.__cuda_array_interface__ = {"shape": (numel,), "typestr": "<i4", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _cudart():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise UserError("CUDA IPC needs the cuda-bindings package: pip install cuda-bindings "
                        "(it comes with nvidia-cutlass-dsl)") from e
    return cudart


def _check(result, what: str):
    """Unpack a cuda-bindings (err, value...) tuple, raising with the call's name on error."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def _handle_bytes(handle) -> bytes:
    if hasattr(handle, "reserved"):  # cuda-bindings 12.x
        return bytes(bytearray(int(x) & 0xFF for x in handle.reserved))
    return ctypes.string_at(handle.getPtr(), _IPC_HANDLE_BYTES)


def _handle_from_bytes(cudart, data: bytes):
    handle = cudart.cudaIpcMemHandle_t()
    if hasattr(handle, "reserved"):  # cuda-bindings 12.x
        handle.reserved = list(data)
    else:
        ctypes.memmove(handle.getPtr(), data, _IPC_HANDLE_BYTES)
    return handle


class CudaIpcBuffers:
    """One int32 buffer of ``numel`` words per rank on ``device``, mapped into every peer."""

    def __init__(self, numel: int, group, device: torch.device):
        import torch.distributed as dist

        cudart = _cudart()
        self._cudart, self._dist, self._group = cudart, dist, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        torch.cuda.set_device(device)
        # cuda-bindings keeps its own runtime state: select the device there too (same primary context)
        _check(cudart.cudaSetDevice(device.index if device.index is not None else torch.cuda.current_device()),
               "cudaSetDevice")
        self.device = device
        self._own = int(_check(cudart.cudaMalloc(numel * 4), "cudaMalloc"))
        handle = _check(cudart.cudaIpcGetMemHandle(self._own), "cudaIpcGetMemHandle")
        handles: list = [None] * self.world_size
        dist.all_gather_object(handles, _handle_bytes(handle), group=group)
        self._opened: list[int] = []
        ptrs = []
        for r, data in enumerate(handles):
            if r == self.rank:  # a process cannot open its own handle
                ptrs.append(self._own)
                continue
            h = _handle_from_bytes(cudart, data)
            p = int(_check(cudart.cudaIpcOpenMemHandle(h, cudart.cudaIpcMemLazyEnablePeerAccess),
                           f"cudaIpcOpenMemHandle(rank {r})"))
            self._opened.append(p)
            ptrs.append(p)
        self.peer_ptrs = ptrs
        self.peers = [torch.as_tensor(_CudaArray(p, numel), device=device) for p in ptrs]
        self.local = self.peers[self.rank]

    def close(self) -> None:
        """Unmap the peers, wait for every rank to do the same, then free the own buffer."""
        if self._own is None:
            return
        torch.cuda.synchronize(self.device)
        self.peers, self.local = [], None
        for p in self._opened:
            _check(self._cudart.cudaIpcCloseMemHandle(p), "cudaIpcCloseMemHandle")
        self._opened = []
        self._dist.barrier(group=self._group)
        _check(self._cudart.cudaFree(self._own), "cudaFree")
        self._own = None


class ShmBuffers:
    """CPU stand-in: one ``/dev/shm`` file of ``numel`` int32 per rank, mapped by every rank."""

    def __init__(self, numel: int, group):
        import torch.distributed as dist

        self._dist, self._group = dist, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        token = [secrets.token_hex(8) if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
        root = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
        paths = [os.path.join(root, f"ls_symm_{token[0]}_{r}") for r in range(self.world_size)]
        with open(paths[self.rank], "wb") as f:
            f.truncate(numel * 4)
        dist.barrier(group=group)
        self.peers = [torch.from_file(p, shared=True, size=numel, dtype=torch.int32) for p in paths]
        dist.barrier(group=group)
        os.unlink(paths[self.rank])  # mappings outlive the name; nothing is left behind on a crash later
        self.local = self.peers[self.rank]
        self.peer_ptrs = [t.data_ptr() for t in self.peers]
        self.device = torch.device("cpu")

    def close(self) -> None:
        self.peers, self.local = [], None
        self._dist.barrier(group=self._group)
