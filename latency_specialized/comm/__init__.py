"""Communicators: how TP ranks exchange partial results.

* :class:`LocalCommunicator` - one rank, every collective is the identity.
* :class:`TorchDistributedCommunicator` - torch.distributed (gloo on CPU, NCCL on GPU): the
  reference the fast symmetric-memory path is tested against.
"""

from latency_specialized.comm.base import Communicator, LocalCommunicator, TorchDistributedCommunicator

__all__ = ["Communicator", "LocalCommunicator", "TorchDistributedCommunicator"]
