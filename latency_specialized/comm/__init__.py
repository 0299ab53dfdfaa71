"""Communicators: how TP ranks exchange partial results.

* :class:`LocalCommunicator` - one rank, every collective is the identity.
* :class:`TorchDistributedCommunicator` - torch.distributed (gloo on CPU, NCCL on GPU): the
  reference the fast symmetric-memory path is tested against.
* :class:`SymmetricMemoryCommunicator` - the same process group plus a peer-mapped workspace
  (CUDA IPC; /dev/shm for the CPU emulation) that the barrier-free fused all-reduce kernels
  store into. Unicast only: NVLink multicast stays off (:data:`NO_MULTICAST_ENV`).

``layout`` defines the workspace protocol, ``emulation`` runs it in plain torch, ``worlds``
starts W local processes (tests, benchmarks).
"""

from latency_specialized.comm.base import Communicator, LocalCommunicator, TorchDistributedCommunicator
from latency_specialized.comm.symmetric import NO_MULTICAST_ENV, SymmetricMemoryCommunicator

__all__ = ["Communicator", "LocalCommunicator", "TorchDistributedCommunicator", "SymmetricMemoryCommunicator",
           "NO_MULTICAST_ENV"]
