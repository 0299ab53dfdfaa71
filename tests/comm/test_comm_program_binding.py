"""Which communicator a program's all-reduce sites run on: the plan's pick always runs on it.

The program binds every all-reduce site to its communicator where the implementation the plan
picked runs on it, else to a symmetric-memory workspace it builds over the communicator's process
group (CUDA IPC; the GPU test), else fails its build naming the fix. CPU here: the refusals, the
workspace sizing, real gloo worlds; ``test_comm_program_gpu.py`` builds the workspaces on the GPU.
"""

from __future__ import annotations

import pytest

import comm_program_worlds as cpw
from latency_specialized.comm.base import ExcludedCommunicator
from latency_specialized.comm.worlds import run_world
from latency_specialized.errors import UserError
from latency_specialized.kernels.compile_cache import cute_available
from latency_specialized.runtime.communicators import workspace_needs

needs_cute = pytest.mark.skipif(cute_available() is not True, reason="nvidia-cutlass-dsl not installed")


@needs_cute
def test_program_refuses_a_plan_its_communicator_cannot_run():
    plans = cpw.tiny_plans(2, "sm_90")  # default: planned for symmetric memory, the fused kernels picked
    assert {c.impl.name for p in plans.values() for c in p.choices if c.site.family == "allreduce"} \
        == {"allreduce.lamport_one_shot"}
    with pytest.raises(UserError) as e:
        cpw.tiny_program(2, plans, ExcludedCommunicator(2), "cpu")
    msg = str(e.value)
    for needle in ("attn.allreduce (bucket 1) is planned for allreduce.lamport_one_shot on a symmetric-memory",
                   "this program's communicator (excluded)", "communication excluded",
                   "no symmetric-memory workspace can be built: the program's tensors are on cpu",
                   "Fix: build the plans for the communicator the program gets (build_plan(..., comm=comm))"):
        assert needle in msg, msg


@needs_cute
def test_program_over_the_communicator_its_plans_were_made_for():
    comm = ExcludedCommunicator(2)
    plans = cpw.tiny_plans(2, "sm_90", comm=comm)
    prog = cpw.tiny_program(2, plans, comm, "cpu")
    kinds = prog.site_comms.kinds()
    # 7 tiny layers of 3 kinds: attn + ffn all-reduce per kind, + the latent all-reduce of the 2 MoE kinds
    assert len(kinds) == 2 * (3 * 2 + 2) and set(kinds.values()) == {"excluded"}
    assert not prog.site_comms.built
    assert all(prog.site_comms(b, s) is comm for b, s in kinds)
    with pytest.raises(UserError, match="no communication site"):
        prog.site_comms(1, "lm_head")
    prog.close()


@needs_cute
def test_workspaces_one_per_width_sized_for_the_largest_bucket():
    plans = cpw.tiny_plans(2, "sm_90", buckets=(1, 4, 16))
    # tiny Kimi K3: hidden 64 (attention and FFN all-reduces), latent 32 (the experts' all-reduce), fp32
    assert workspace_needs(plans, "torch.distributed") == {(64, "float32"): 16, (32, "float32"): 16}
    assert workspace_needs(plans, "symmetric-memory") == {}  # the communicator already is one
    assert workspace_needs(cpw.tiny_plans(2, "sm_90", comm="torch.distributed"), "torch.distributed") == {}
    assert workspace_needs(cpw.tiny_plans(2, "cpu"), "torch.distributed") == {}


def test_gloo_world_binds_to_its_communicator_and_refuses_gpu_plans_on_every_rank():
    reps = run_world(cpw.cpu_binding_world, 2, timeout=240)
    for rep in reps:
        assert rep["plan_comm"] == ["torch.distributed"]
        assert rep["kinds"] == ["torch.distributed"] and rep["sites"] == 16 and rep["built"] == 0
        assert rep["bound_to_comm"] and rep["impls"] == ["allreduce.reference"]
        if cute_available() is True:
            assert rep["gpu_plan_impls"] == ["allreduce.lamport_one_shot"]
            assert "cannot run on this program's communicator (torch.distributed)" in rep["gpu_plan_error"]
            assert "the program's tensors are on cpu" in rep["gpu_plan_error"]


@pytest.mark.parametrize("own_host_per_rank", [False, True])
def test_workspace_needs_the_ranks_on_one_host(own_host_per_rank):
    reps = run_world(cpw.hosts_world, 2, own_host_per_rank, timeout=120)
    if own_host_per_rank:
        assert all("run on 2 hosts" in r and "one host only" in r for r in reps), reps
    else:
        assert reps == [None, None]
