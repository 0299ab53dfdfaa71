"""Communicator kinds: what a plan is told about the communicator its all-reduce sites run on.

The planner writes the kind into the context of every communication site (attr ``comm``), so
that an implementation can refuse a communicator it cannot run on, with the reason, and
``explain`` shows it. A kind is the communicator's ``name``, except that a symmetric-memory
communicator whose workspace is host memory (the CPU emulation) is its own kind.

* ``local`` - one rank, no communicator (every collective is the identity);
* ``torch.distributed`` - a process group only (gloo on CPU, NCCL/gloo on GPUs);
* ``symmetric-memory`` - a process group plus a peer-mapped CUDA IPC workspace: the fused
  barrier-free all-reduce kernels store into it;
* ``symmetric-memory-emulated`` - the same protocol over ``/dev/shm`` (CPU tests of the protocol);
* ``excluded`` - one rank of a group with communication left out (one-GPU benches).

The kernels that need a kind compare against these strings (kernels sit below comm and do not
import it); ``tests/comm`` checks that the two agree.
"""

from __future__ import annotations

from typing import Any

from latency_specialized.errors import UserError

LOCAL = "local"
TORCH_DISTRIBUTED = "torch.distributed"
SYMMETRIC = "symmetric-memory"
EMULATED = "symmetric-memory-emulated"
EXCLUDED = "excluded"
KINDS: tuple[str, ...] = (LOCAL, TORCH_DISTRIBUTED, SYMMETRIC, EMULATED, EXCLUDED)

COMM_FAMILIES: tuple[str, ...] = ("allreduce",)
"""Op families whose sites exchange data through the communicator (their contexts carry ``comm``)."""


def kind_of(comm: Any) -> str:
    """The kind of ``comm``: a communicator, None (one rank: ``local``) or a kind name (checked)."""
    if comm is None:
        return LOCAL
    if isinstance(comm, str):
        if comm not in KINDS:
            raise UserError(f"communicator kind {comm!r}: use one of {', '.join(KINDS)}")
        return comm
    from latency_specialized.comm.symmetric import SymmetricMemoryCommunicator

    if isinstance(comm, SymmetricMemoryCommunicator):
        return SYMMETRIC if comm.device.type == "cuda" else EMULATED
    return str(getattr(comm, "name", type(comm).__name__))


def default_kind(arch: str, world_size: int) -> str:
    """The communicator a deployment of ``world_size`` ranks on ``arch`` runs its all-reduces on when
    the plan is not told otherwise: ``local`` for one rank; on a GPU ``symmetric-memory`` (the
    program builds its CUDA IPC workspaces over the process group: ranks on one host); on a CPU
    ``torch.distributed``."""
    if world_size <= 1:
        return LOCAL
    return SYMMETRIC if arch.startswith("sm_") else TORCH_DISTRIBUTED
