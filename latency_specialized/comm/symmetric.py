"""SymmetricMemoryCommunicator: peer-mapped Lamport workspace + a torch.distributed group.

The fused all-reduce kernels (``kernels/allreduce_lamport.py``, ``kernels/allreduce_two_stage.py``)
store straight into peers' buffers; everything else (``all_reduce``, ``all_gather`` of the
Communicator protocol, handle exchange, barriers at set-up) goes through the process group.

Create it collectively, before any CUDA-graph capture (it allocates and maps memory), once per
stream that issues all-reduces: two streams sharing one workspace would interleave their calls
and break the slot rotation (the classic custom-all-reduce deadlock). Every rank must issue the
same sequence of calls with the same token counts.

Environment: NVLink multicast stays off everywhere we launch (:data:`NO_MULTICAST_ENV`); this
class never creates a multicast object.
"""

from __future__ import annotations

import os

import torch

from latency_specialized.comm import layout as L
from latency_specialized.comm.base import TorchDistributedCommunicator
from latency_specialized.errors import UserError

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""Set in every process that may touch NCCL / symmetric memory: unicast stores only."""


def disable_multicast_env() -> None:
    """Force :data:`NO_MULTICAST_ENV` into this process's environment (call before NCCL init)."""
    os.environ.update(NO_MULTICAST_ENV)


class SymmetricMemoryCommunicator:
    """Communicator with a peer-mapped workspace for the barrier-free fused all-reduce.

    Parameters
    ----------
    group : torch.distributed process group (None: the default group). gloo works for the CPU
        emulation and for single-GPU multi-process runs (NCCL refuses two ranks on one GPU).
    hidden : row width N of the all-reduced activations.
    dtype : 'bfloat16' or 'float32' (torch dtypes accepted).
    max_tokens : largest row count M of one call.
    device : where the workspace lives (cuda: CUDA IPC; cpu: /dev/shm, emulation only).
    """

    name = "symmetric-memory"

    def __init__(self, group=None, *, hidden: int, dtype: str | torch.dtype = "bfloat16", max_tokens: int = 64,
                 device: torch.device | str | None = None):
        disable_multicast_env()
        self._base = TorchDistributedCommunicator(group)
        self.group, self.rank, self.world_size = group, self._base.rank, self._base.world_size
        self.dtype = str(dtype).removeprefix("torch.")
        problem = L.layout_problem(hidden, self.dtype, self.world_size)
        if problem:
            raise UserError(f"symmetric all-reduce workspace: {problem}")
        if max_tokens < 1:
            raise UserError(f"max_tokens={max_tokens}: use the largest batch bucket x (1 + spec tokens)")
        self.hidden, self.max_tokens = hidden, max_tokens
        self.row_words = L.words_per_row(hidden, self.dtype)
        self.slot_words = L.slot_words(self.world_size, max_tokens, self.row_words)
        numel = L.SLOTS * self.slot_words
        if numel >= 2**31:
            raise UserError(f"workspace of {numel} words exceeds int32 offsets: lower max_tokens={max_tokens}")
        device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        if device.type == "cuda":
            from latency_specialized.comm.ipc import CudaIpcBuffers

            self._mem = CudaIpcBuffers(numel, group, device)
        else:
            from latency_specialized.comm.ipc import ShmBuffers

            self._mem = ShmBuffers(numel, group)
        self.device = device
        self.buffer: torch.Tensor = self._mem.local
        """This rank's int32 workspace [SLOTS * slot_words]; peers store into it."""
        self.peers: list[torch.Tensor] = self._mem.peers
        """Every rank's workspace as mapped here (index = rank; own included)."""
        self.peer_ptrs = torch.tensor(self._mem.peer_ptrs, dtype=torch.int64, device=device)
        """Device addresses of ``peers`` [W] int64, what the kernels take."""
        self.flags = torch.zeros(L.FLAG_WORDS, dtype=torch.int32, device=device)
        """Local protocol state (call counter, arrivals, dirty words per slot)."""
        self.buffer.fill_(L.SENTINEL_WORD[self.dtype])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self._base._dist.barrier(group=group)  # nobody stores into a peer before it is cleared

    # Communicator protocol: plain collectives go through the process group.
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self._group_comm().all_reduce(t)

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self._group_comm().all_gather(t, dim)

    def _group_comm(self) -> TorchDistributedCommunicator:
        if self._base is None:
            raise UserError("a single_process_world communicator has no process group: build the "
                            "SymmetricMemoryCommunicator from an initialised torch.distributed group")
        return self._base

    def check_call(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None) -> None:
        """Raise UserError when a call does not fit this workspace (shape, dtype, device)."""
        M, N = partial.shape if partial.dim() == 2 else (None, None)
        dt = str(partial.dtype).removeprefix("torch.")
        if N != self.hidden or dt != self.dtype:
            raise UserError(f"all-reduce of {tuple(partial.shape)} {dt} on a workspace built for [M, {self.hidden}] "
                            f"{self.dtype}: build the SymmetricMemoryCommunicator with hidden={N}, dtype={dt}")
        if M > self.max_tokens or M < 1:
            raise UserError(f"all-reduce of {M} rows > max_tokens={self.max_tokens}: build the communicator "
                            f"with max_tokens >= {M}")
        if residual.shape != partial.shape or residual.dtype != partial.dtype:
            raise UserError(f"residual {tuple(residual.shape)} {residual.dtype} must match partial "
                            f"{tuple(partial.shape)} {partial.dtype}")
        if weight is not None and (weight.shape != (N,) or weight.dtype != partial.dtype):
            raise UserError(f"norm weight {tuple(weight.shape)} {weight.dtype}: use [{N}] {partial.dtype}")
        if partial.device != self.device:
            raise UserError(f"partial on {partial.device}, workspace on {self.device}: move the tensors to "
                            f"{self.device}")

    @classmethod
    def single_process_world(cls, world_size: int, *, hidden: int, dtype: str | torch.dtype = "bfloat16",
                             max_tokens: int = 64, device: torch.device | str = "cuda"
                             ) -> list["SymmetricMemoryCommunicator"]:
        """W ranks as W communicators of ONE process (no process group, no IPC), for benchmarks.

        Rank r's kernels are meant to run on stream r of the same GPU: they store into plain
        device buffers of the other "ranks". ``all_reduce``/``all_gather`` are unavailable. The
        W x M CTAs of one call must all be resident at once (every rank's CTAs spin on the
        others'), so keep W x M <= the SM count.
        """
        dt = str(dtype).removeprefix("torch.")
        problem = L.layout_problem(hidden, dt, world_size)
        if problem:
            raise UserError(f"symmetric all-reduce workspace: {problem}")
        device = torch.device(device)
        row_words = L.words_per_row(hidden, dt)
        slot = L.slot_words(world_size, max_tokens, row_words)
        buffers = [torch.full((L.SLOTS * slot,), L.SENTINEL_WORD[dt], dtype=torch.int32, device=device)
                   for _ in range(world_size)]
        ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=device)
        world = []
        for r in range(world_size):
            c = cls.__new__(cls)
            c._base, c._mem, c.group = None, buffers, None
            c.rank, c.world_size, c.dtype, c.hidden, c.max_tokens = r, world_size, dt, hidden, max_tokens
            c.row_words, c.slot_words, c.device = row_words, slot, device
            c.buffer, c.peers, c.peer_ptrs = buffers[r], buffers, ptrs
            c.flags = torch.zeros(L.FLAG_WORDS, dtype=torch.int32, device=device)
            world.append(c)
        return world

    def reset(self) -> None:
        """Back to the freshly built state (all slots sentinel, counters 0). Collective."""
        self.buffer.fill_(L.SENTINEL_WORD[self.dtype])
        self.flags.zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._base is not None:
            self._base._dist.barrier(group=self.group)

    def destroy(self) -> None:
        """Release the workspace (collective). The communicator is unusable afterwards."""
        if self._mem is not None:
            self.peer_ptrs = None
            if hasattr(self._mem, "close"):  # single_process_world holds plain tensors
                self._mem.close()
            self._mem = None
            self.buffer, self.peers = None, []


def has_process_group(comm) -> bool:
    """True when ``comm`` reaches its peers through a torch.distributed process group (what a
    workspace's IPC handles travel over): a TorchDistributedCommunicator, or a SymmetricMemoryCommunicator
    built over a group (not a ``single_process_world`` one)."""
    if isinstance(comm, SymmetricMemoryCommunicator):
        return comm._base is not None
    return isinstance(comm, TorchDistributedCommunicator)


def workspace_problem(comm, device: torch.device | str) -> str | None:
    """Why a SymmetricMemoryCommunicator cannot be built over ``comm``'s process group for tensors on
    ``device``, or None.

    Collective once the local checks pass (every rank of a program makes the same checks): the ranks
    compare host names, since CUDA IPC maps memory between the processes of one host only.
    """
    import socket

    import torch.distributed as dist

    device = torch.device(device)
    if device.type != "cuda":
        return (f"the program's tensors are on {device}: the symmetric-memory workspace is CUDA IPC memory "
                "(on CPU the torch.distributed communicator serves)")
    if not has_process_group(comm):
        return (f"communicator {getattr(comm, 'name', type(comm).__name__)} has no process group to exchange "
                "CUDA IPC handles over (build the program with a TorchDistributedCommunicator)")
    base = comm._base if isinstance(comm, SymmetricMemoryCommunicator) else comm
    hosts: list = [None] * base.world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=base.group)
    if len(set(hosts)) > 1:
        return (f"the {base.world_size} ranks run on {len(set(hosts))} hosts ({', '.join(sorted(set(hosts)))}): "
                "CUDA IPC maps memory between the processes of one host only")
    return None


def workspace_over(comm, *, hidden: int, dtype: str | torch.dtype, max_tokens: int,
                   device: torch.device | str) -> SymmetricMemoryCommunicator:
    """A SymmetricMemoryCommunicator over the process group of ``comm`` (collective: every rank calls it
    in the same order). Check :func:`workspace_problem` first."""
    if not has_process_group(comm):
        raise UserError(workspace_problem(comm, device) or "no process group")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # tensors name their index: cuda:0 != cuda
        device = torch.device("cuda", torch.cuda.current_device())
    return SymmetricMemoryCommunicator(comm.group, hidden=hidden, dtype=dtype, max_tokens=max_tokens, device=device)
