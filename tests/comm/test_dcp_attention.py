"""Decode context parallelism over real processes: W ranks (2, 4) of a gloo group each hold only their
tokens of every sequence, run ``dcp_gqa_decode`` / ``dcp_mla_decode`` and must all return single-rank
attention (the op family's reference over one cache holding the whole sequences), with the same bits on
every rank, and only the new token's owner writing it.

Cases (``tests/ops/test_dcp_layout.py`` builds them): GQA plain / sinks / bf16, MLA plain / gate+kv_norm /
bf16; batch 1, 3, 8 with lengths below the world and padding rows; both merges (``allgather``,
``rescale``); interleave 1 and 2. Every check is recorded in the rank, never raised, so that every rank
issues the same sequence of collectives; the parent asserts on the reports.

The GPU variant (marker gpu) runs the same ranks as processes sharing the GPU (every rank on cuda:0 on
the one-H200 machine), the partials on the device - the torch composition and, for GQA, the Triton
split-KV kernel with its lse output - and the collectives through gloo on CUDA tensors (NCCL refuses two
ranks on one GPU), as tests/comm's GPU program tests do.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from latency_specialized.comm.worlds import run_world

PRELOAD = ("latency_specialized.ops.attention.dcp", "latency_specialized.ops.attention.gqa",
           "latency_specialized.ops.attention.mla")
WORLDS = (2, 4)


def _cases():
    from tests.ops.test_dcp_layout import CASES, LENGTH_SETS

    out = []
    for kind, opts in CASES:
        for batch, sets in sorted(LENGTH_SETS.items()):
            for i, lens in enumerate(sets):
                for merge in ("allgather", "rescale"):
                    out.append((kind, tuple(sorted(opts.items(), key=str)), lens, merge, 1 + (i + batch) % 2))
    return out


def _fingerprint(t: torch.Tensor):
    import torch.distributed as dist

    b = t.detach().float().cpu().contiguous().view(torch.int32)
    parts = [torch.empty_like(b) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, b)
    return all(torch.equal(parts[0], p) for p in parts)


def dcp_world(rank: int, world: int, device: str, seed: int) -> list[dict]:
    """Every case on this rank (module level: spawned processes import it by name)."""
    from latency_specialized.comm.base import TorchDistributedCommunicator
    from latency_specialized.ops.attention.dcp import DcpLayout, gqa_partial_reference, gqa_partial_triton
    from tests.ops import test_dcp_layout as T

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    comm = TorchDistributedCommunicator()
    partials = [("torch", gqa_partial_reference)]
    if device == "cuda":
        partials.append(("triton", gqa_partial_triton))
    reports = []
    for i, (kind, opts, lens, merge, interleave) in enumerate(_cases()):
        # the Triton partial serves GQA without a window (it refuses one over a DCP slice, by design)
        for pname, partial in partials if kind == "gqa" and "window" not in dict(opts) else partials[:1]:
            rep = {"case": (kind, opts, lens, merge, interleave, pname), "errors": []}
            case = T.make_case(kind, seed + i, lens, **dict(opts))
            lay = DcpLayout(world, rank, interleave)
            st = T.rank_state(case, lay, seed + i)
            want = T.single_rank(case, seed + i)
            if device == "cuda":
                case, st = _to(case, device), _to(st, device)
            try:
                y = T.dcp_step(case, lay, st, comm, merge, partial)
                if device == "cuda":
                    torch.cuda.synchronize()
                rep["err"] = T.close(y.cpu(), want, case["dtype"])
            except Exception as e:  # noqa: BLE001 - recorded: the other ranks still wait in this case's collectives
                rep["errors"].append(f"{type(e).__name__}: {e}")
                y = torch.zeros(1)
            rep["same_on_ranks"] = _fingerprint(y)
            rep["new_token_ok"] = T.new_token_ok(_to(case, "cpu"), _to(st, "cpu"))
            reports.append(rep)
    return reports


def _to(x, device):
    """Every tensor of a (nested) case / state structure moved to ``device`` (the rest unchanged)."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, list):
        return [_to(v, device) for v in x]
    return x


@functools.cache
def world(size: int, device: str) -> list[list[dict]]:
    return run_world(dcp_world, size, device, 31 + size, timeout=float(os.environ.get("LS_WORLD_TIMEOUT", "300")),
                     preload=PRELOAD)


def _check(size: int, device: str) -> None:
    reports = world(size, device)
    assert len({len(r) for r in reports}) == 1 and len(reports[0]) >= len(_cases())
    for rank, per_rank in enumerate(reports):
        for rep in per_rank:
            assert not rep["errors"], (rank, rep["case"], rep["errors"])
            assert rep["same_on_ranks"], (rank, rep["case"], "results differ between ranks")
            assert rep["new_token_ok"], (rank, rep["case"], "new token written off its owner (or wrong value)")


@pytest.mark.parametrize("size", WORLDS)
def test_dcp_attention_over_gloo_processes_equals_single_rank(size):
    _check(size, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("size", WORLDS)
def test_dcp_attention_over_processes_sharing_the_gpu_equals_single_rank(size):
    _check(size, "cuda")
