"""The start-time scope verdict is collective: every rank raises the same error listing every problem."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from latency_specialized.errors import ScopeError, UserError
from latency_specialized.testing.matrix import free_port
from latency_specialized.vllm.scope import DeploymentScopeError, gather_problems, merge_problem_lists


def test_merge_keeps_order_and_names_ranks_of_partial_problems():
    merged = merge_problem_lists([["dtype float16 not supported (use bfloat16, float32)", "arch x"],
                                  ["dtype float16 not supported (use bfloat16, float32)"]])
    assert merged == ["dtype float16 not supported (use bfloat16, float32)", "arch x (ranks 0)"]
    assert merge_problem_lists([[], []]) == []


def test_scope_error_is_a_user_error_with_every_problem_and_the_auto_fix():
    err = DeploymentScopeError("vllm_moe", ["dtype float16 not supported (use bfloat16, float32)",
                                            "2 speculative tokens not supported (use one of [0])"])
    assert isinstance(err, ScopeError) and isinstance(err, UserError)
    msg = str(err)
    assert msg.startswith("vllm_moe: outside the latency_specialized scope: dtype float16 not supported")
    assert "2 speculative tokens not supported" in msg
    assert msg.endswith("(or run stock vLLM with --decode-backend auto)")


def test_single_process_gather_is_local():
    assert gather_problems(["a", "b"]) == ["a", "b"]


def _rank(rank: int, world: int, port: int, problems: list[str], out) -> None:  # runs in a spawned process
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        merged = gather_problems(problems)
        try:
            if merged:
                raise DeploymentScopeError("vllm_moe", merged)
            out.put((rank, "ok"))
        except DeploymentScopeError as e:
            out.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("per_rank", [
    [["arch sm_80 not supported (use one of cpu)"], []],          # one rank alone has a problem
    [["TP=3 not supported (use one of [1, 2, 4, 8])"], ["TP=3 not supported (use one of [1, 2, 4, 8])"]],
    [[], []],
])
def test_two_gloo_ranks_fail_together_with_the_union(per_rank):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, per_rank[r], out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    expected = merge_problem_lists(per_rank)
    if not expected:
        assert got == {0: "ok", 1: "ok"}
        return
    assert got[0] == got[1], "ranks must fail with the same message"
    for problem in expected:
        assert problem in got[0]
