"""Decode context parallelism in the composed program (issue 25): the paged KV caches split by token across a
DCP group (``runtime.dcp_states.dcp_rank_states``), the GQA and MLA pieces attending over their rank's tokens
and merging across the group (``ComposedProgram(..., dcp=DcpGroup(...))``). Teacher-forced decode steps of the
tiny models from a reference prefill: every rank's logits equal the fp32 reference's over whole sequences
(the matrix's bound of the adapter, of max |logits|) and each other bit for bit.

Cases: Qwen3-MoE (plain GQA), Muse Spark (GQA with a sliding window, a NoPE full-attention layer, gates and
sinks-free softmax), Kimi K3 (MLA with KDA layers, whose recurrent states every rank keeps whole); DCP worlds of
1 (one process: the program equals itself without DCP), 2 and 4 gloo processes, both merges, interleave 1 and 2.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from latency_specialized.comm.worlds import run_world
from latency_specialized.errors import UserError

ADAPTERS = ("qwen3_moe", "muse_spark", "kimi_k3")
CONTEXT, BATCH, STEPS = 40, 3, 3
PRELOAD = ("latency_specialized.ops.attention.dcp", "latency_specialized.testing.verify")


def run_dcp_program(adapter_name: str, layout, comm, merge: str = "allgather", device: str = "cpu") -> dict:
    """STEPS teacher-forced decode steps of the tiny ``adapter_name`` program on this DCP rank: max |program -
    reference| over the steps, the reference's max |logits|, and the program's logits of every step."""
    from latency_specialized.ops.attention.dcp import DcpGroup
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
    from latency_specialized.runtime.dcp_states import dcp_rank_states
    from latency_specialized.runtime.gate import DecodeGate, StepState
    from latency_specialized.runtime.graph_runner import CUDAGraphRunner
    from latency_specialized.testing.matrix import Cell, cell_plan
    from latency_specialized.testing.verify import batch_states, prototypes
    from latency_specialized.trace import Trace

    torch.set_num_threads(1)
    adapter = get_registry().adapter(adapter_name)
    ref, proto, lens = prototypes(adapter, CONTEXT, device)
    max_len = CONTEXT + STEPS
    states = batch_states(ref, proto, lens, BATCH, max_len, seed=BATCH)
    positions = [lens[b % len(lens)] for b in range(BATCH)]
    mine = (dcp_rank_states(adapter.composed_model(ref.spec), states, positions, layout, max_len)
            if layout is not None else states.clone())  # the reference decodes on ``states`` alongside
    plan = cell_plan(adapter, get_registry().implementations, Cell(adapter_name, BATCH, 1, CONTEXT, 0, device))
    program = adapter.program(ref.spec, plans=plan, cache=mine, reference=ref, trace=Trace(),
                              dcp=DcpGroup(layout, comm, merge=merge) if layout is not None else None)
    buffers = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(mine.slots[0].blocks),
                                       block_size=mine.block_size, pad_state=0,
                                       dcp_world=layout.world if layout is not None else 1), device)
    toks = torch.randint(3, ref.spec.vocab_size, (BATCH,), generator=torch.Generator().manual_seed(7)).to(device)
    buffers.load(toks, positions, [s.row for s in mine.slots], mine.block_table(device="cpu"))
    runner = CUDAGraphRunner(program, buffers, use_graphs=False, feed_back_tokens=False,
                             gate=DecodeGate(max_batch=plan.bucket, buckets=(plan.bucket,)))
    err, scale, logits = 0.0, 0.0, []
    for _ in range(STEPS):
        got = runner.run(StepState(num_seqs=BATCH), tokens=toks).outputs["logits"][:BATCH].clone()
        want = ref.decode(states, states.slots, positions, toks)
        err = max(err, (got.double() - want.double()).abs().max().item())
        scale = max(scale, want.abs().max().item())
        logits.append(got)
        toks = want.argmax(-1)  # teacher-forced by the reference: every rank feeds the same tokens
        positions = [p + 1 for p in positions]
    # with DCP the pieces attend through the group, not through their single-rank attention sites
    attention_calls = sum(n for site, n in program.calls.items() if site.endswith(("/attn.gqa", "/attn.mla")))
    paged = sum(t.numel() for i, by in mine.by_layer.items() for n, t in by.items() if mine.decls[i][n].kind == "paged")
    return {"err": err, "scale": scale, "logits": torch.stack(logits).cpu(), "attention_calls": attention_calls,
            "paged_numel": paged}


def dcp_world(rank: int, world: int, merge: str, interleave: int, device: str = "cpu") -> dict:
    """Every adapter on this rank of a gloo DCP group (module level: spawned processes import it by name); on
    ``cuda`` every rank runs on the one GPU (gloo collectives over CUDA tensors, as tests/comm's GPU tests)."""
    from latency_specialized.comm.base import TorchDistributedCommunicator
    from latency_specialized.ops.attention.dcp import DcpLayout

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    comm = TorchDistributedCommunicator()
    out = {}
    for name in ADAPTERS:
        try:
            out[name] = run_dcp_program(name, DcpLayout(world, rank, interleave), comm, merge, device)
            # plain floats back to the parent: a tensor would travel as a file descriptor the exiting child closes
            out[name]["logits"] = out[name]["logits"].tolist()
        except Exception as e:  # noqa: BLE001 - reported to the parent (the other ranks would wait otherwise)
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


@functools.cache
def _world(size: int, merge: str, interleave: int, device: str = "cpu") -> list[dict]:
    return run_world(dcp_world, size, merge, interleave, device,
                     timeout=float(os.environ.get("LS_WORLD_TIMEOUT", "600")), preload=PRELOAD)


def _check(result: dict, name: str) -> None:
    """Within the matrix's bound of the adapter (its ``verify_rel_tol``, else ``REL_TOL``) of max |logits|."""
    from latency_specialized.plugins import get_registry
    from latency_specialized.testing.verify import REL_TOL

    assert "error" not in result, (name, result.get("error"))
    tol = getattr(get_registry().adapter(name.split()[0]), "verify_rel_tol", None) or REL_TOL
    assert result["err"] <= tol * result["scale"], (name, result["err"], result["scale"], tol)


@pytest.mark.parametrize("name", ADAPTERS)
def test_one_rank_dcp_equals_the_reference_and_the_plain_program(name):
    """A DCP group of one: the program's logits equal the reference's and those of the same program without DCP."""
    from latency_specialized.comm.base import LocalCommunicator
    from latency_specialized.ops.attention.dcp import DcpLayout
    from latency_specialized.plugins import get_registry
    from latency_specialized.testing.verify import REL_TOL

    with_dcp = run_dcp_program(name, DcpLayout(1, 0), LocalCommunicator())
    plain = run_dcp_program(name, None, None)
    _check(with_dcp, name)
    _check(plain, name)
    assert with_dcp["attention_calls"] == 0 < plain["attention_calls"]
    # the same bound between the two programs (the DCP path rounds its softmax apart from the plain op's)
    tol = getattr(get_registry().adapter(name), "verify_rel_tol", None) or REL_TOL
    assert (with_dcp["logits"] - plain["logits"]).abs().max() <= tol * plain["logits"].abs().max(), name


@pytest.mark.parametrize("size,merge,interleave", [(2, "allgather", 1), (2, "rescale", 2), (4, "allgather", 1)])
def test_dcp_program_over_gloo_processes_equals_the_reference(size, merge, interleave):
    _check_world(_world(size, merge, interleave), size)


@pytest.mark.gpu
@pytest.mark.parametrize("size", [2, 4])
def test_dcp_program_over_processes_sharing_the_gpu_equals_the_reference(size):
    """The same on the H200: each rank's program runs the GPU plan (every site but the DCP attention on its
    kernels), the ranks are processes sharing the GPU."""
    _check_world(_world(size, "allgather", 1, "cuda"), size)


@functools.cache
def _whole_paged_numel(name: str) -> int:
    return run_dcp_program(name, None, None)["paged_numel"]


def _check_world(reports: list[dict], size: int) -> None:
    for name in ADAPTERS:
        for rank in range(size):
            _check(reports[rank][name], f"{name} rank {rank}")
        first = reports[0][name]["logits"]
        for rank in range(1, size):  # every rank of the group computes the same step
            assert reports[rank][name]["logits"] == first, (name, rank)
        assert all(r[name]["attention_calls"] == 0 for r in reports)
        # each rank's paged caches hold about 1 / size of the tokens (blocks of whole interleave runs)
        whole = _whole_paged_numel(name)
        assert reports[0][name]["paged_numel"] <= whole // size + whole // 4, (name, reports[0][name]["paged_numel"], whole)


def test_pieces_without_a_dcp_path_are_refused():
    """A model whose paged states a piece cannot split (GLM-5.3's sparse MLA: its indexer selects over whole
    sequences; DeepSeek-V4.1's sparse MQA) and verification steps are refused by name, never run whole."""
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime.composed import dcp_problems

    reg = get_registry()
    for name, piece in (("glm53", "SparseMLAAttention"), ("deepseek_v41_flash", "SparseMQAAttention")):
        a = reg.adapter(name)
        problems = dcp_problems(a.composed_model(a.spec("tiny")))
        assert problems and all("no DCP path" in p for p in problems) and piece in problems[0], (name, problems)
    kimi = reg.adapter("kimi_k3")
    assert dcp_problems(kimi.composed_model(kimi.spec("tiny"))) == []
    assert "plain decode steps only" in dcp_problems(kimi.composed_model(kimi.spec("tiny")), k=3)[0]
    with pytest.raises(UserError, match="no DCP path"):
        _glm_program_with_dcp()


def _glm_program_with_dcp():
    from latency_specialized.comm.base import LocalCommunicator
    from latency_specialized.ops.attention.dcp import DcpGroup, DcpLayout
    from latency_specialized.plugins import get_registry
    from latency_specialized.testing.matrix import Cell, cell_plan
    from latency_specialized.testing.verify import prototypes

    a = get_registry().adapter("glm53")
    ref, states, _ = prototypes(a, 8, "cpu")
    plan = cell_plan(a, get_registry().implementations, Cell("glm53", 1, 1, 8, 0))
    return a.program(ref.spec, plans=plan, cache=states, reference=ref,
                     dcp=DcpGroup(DcpLayout(1, 0), LocalCommunicator()))


def test_dcp_group_checks_its_communicator():
    from latency_specialized.comm.base import LocalCommunicator
    from latency_specialized.ops.attention.dcp import DcpGroup, DcpLayout

    with pytest.raises(UserError, match="communicator has 1"):
        DcpGroup(DcpLayout(2, 0), LocalCommunicator())
    with pytest.raises(UserError, match="choose 'allgather' or 'rescale'"):
        DcpGroup(DcpLayout(1, 0), LocalCommunicator(), merge="max")
