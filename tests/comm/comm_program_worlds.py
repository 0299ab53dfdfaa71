"""Per-rank bodies of the tests of which communicator a program's all-reduce sites run on.

Module level: ``latency_specialized.comm.worlds.run_world`` processes import them by name (gloo group
initialised). CPU bodies use the tiny Kimi K3 on CPU tensors; the GPU body runs W processes that
share the GPU(s) through CUDA IPC (one H200: every rank on cuda:0) with a gloo group.
"""

from __future__ import annotations

import torch
import torch.distributed


def tiny_program(world_size: int, plans, comm, device: str):
    """The tiny Kimi K3 program of this rank over ``comm`` for ``plans`` ({bucket: Plan})."""
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime.states import ModelStates

    adapter = get_registry().adapter("kimi_k3")
    spec = adapter.spec("tiny")
    ref = adapter.reference(spec, seed=0, dtype="float32", device=device, tokenizer=False)
    states = ModelStates.allocate(adapter.composed_model(spec), max(plans), 16, tp=world_size, block_size=4,
                                  dtype=torch.float32, device=device)
    return adapter.program(spec, reference=ref, plans=plans, cache=states, comm=comm)


def tiny_plans(world_size: int, arch: str, buckets=(1, 4), comm=None) -> dict:
    from latency_specialized import hardware
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry

    reg = get_registry()
    hw = hardware.probe() if arch == "probe" else hardware.for_arch(arch)
    plans = [build_plan(reg.adapter("kimi_k3"), reg.implementations, hw, tp=world_size, batch=b, dtype="float32",
                        variant="tiny", comm=comm) for b in buckets]
    return {p.bucket: p for p in plans}


def cpu_binding_world(rank: int, world_size: int) -> dict:
    """Over a real gloo group on CPU tensors: (1) plans made for the TorchDistributedCommunicator bind every
    all-reduce site to it; (2) plans made for a GPU (default: symmetric memory, the fused kernels picked)
    fail the program build on every rank with the error naming the fix - before any collective, no hang."""
    from latency_specialized.comm.base import TorchDistributedCommunicator
    from latency_specialized.errors import UserError

    comm = TorchDistributedCommunicator()
    plans = tiny_plans(world_size, "cpu", comm=comm)
    prog = tiny_program(world_size, plans, comm, "cpu")
    kinds = prog.site_comms.kinds()
    out = {"plan_comm": sorted({p.comm for p in plans.values()}), "kinds": sorted(set(kinds.values())),
           "sites": len(kinds), "built": len(prog.site_comms.built),
           "bound_to_comm": all(prog.site_comms(b, s) is comm for b, s in kinds),
           "impls": sorted({c.impl.name for p in plans.values() for c in p.choices if c.site.family == "allreduce"})}
    gpu_plans = tiny_plans(world_size, "sm_90")
    out["gpu_plan_impls"] = sorted({c.impl.name for p in gpu_plans.values() for c in p.choices
                                    if c.site.family == "allreduce"})
    try:
        tiny_program(world_size, gpu_plans, comm, "cpu")
        out["gpu_plan_error"] = None
    except UserError as e:
        out["gpu_plan_error"] = str(e)
    torch.distributed.barrier()  # every rank got here: nobody hung in a collective
    return out


def hosts_world(rank: int, world_size: int, own_host_per_rank: bool) -> str | None:
    """workspace_problem's host check (collective) for CUDA tensors; ``own_host_per_rank`` makes every
    rank report a host name of its own (what ranks of a multi-node group see)."""
    import socket

    from latency_specialized.comm.base import TorchDistributedCommunicator
    from latency_specialized.comm.symmetric import workspace_problem

    if own_host_per_rank:
        socket.gethostname = lambda: f"node{rank}"  # this process only
    return workspace_problem(TorchDistributedCommunicator(), "cuda")


def gpu_program_world(rank: int, world_size: int, batch: int, context: int) -> dict:
    """On CUDA: the program over a gloo TorchDistributedCommunicator, plans made without ``comm=`` (the
    fused kernels picked), builds one symmetric-memory workspace per all-reduce width and binds every
    all-reduce site to it; then the matrix cell of (batch, TP=world_size, context) on this rank."""
    from dataclasses import asdict

    from latency_specialized.comm.base import TorchDistributedCommunicator
    from latency_specialized.comm.symmetric import SymmetricMemoryCommunicator
    from latency_specialized.plugins import get_registry
    from latency_specialized.testing.matrix import Cell

    torch.cuda.set_device(rank % torch.cuda.device_count())
    comm = TorchDistributedCommunicator()
    plans = tiny_plans(world_size, "probe", buckets=(1, batch))
    dev = f"cuda:{torch.cuda.current_device()}"
    prog = tiny_program(world_size, plans, comm, dev)
    sc = prog.site_comms
    out = {"plan_comm": sorted({p.comm for p in plans.values()}), "kinds": sorted(set(sc.kinds().values())),
           "sites": len(sc.kinds()),
           "all_symmetric": all(isinstance(sc(b, s), SymmetricMemoryCommunicator) for b, s in sc.kinds()),
           "built": sorted((n, dt, w.max_tokens, w.world_size) for (n, dt), w in sc.built.items()),
           "impls": sorted({c.impl.name for p in plans.values() for c in p.choices if c.site.family == "allreduce"})}
    prog.close()
    cell = Cell("kimi_k3", batch, world_size, context, 0, "cuda")
    res = get_registry().adapter("kimi_k3").verify_cell(cell, comm=comm)
    out["cell"] = asdict(res)
    out["cell_ok"] = res.ok
    return out
