"""TP=2 on vLLM's CPU build: the tiny Qwen3-MoE served stock (``auto``) and with ``latency_specialized``,
two CPU workers each; greedy tokens equal, and both ranks' traces show the composed program's fast
steps (its all-reduce sites over vLLM's TP group, the weights of each rank's shard, the embedding
gathered once).

Both servers start once for the module, concurrently (~2-4 min on 2 cores), and stop at teardown.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vllm_harness import Server, base_env, read_trace

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = ["The quick brown fox", "Hello world! How are you", "Numbers: 0 1 2"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def servers(tiny_checkpoint, tmp_path_factory):
    logs = tmp_path_factory.mktemp("servers-tp2")
    trace = logs / "trace.json"
    cpus = sorted(os.sched_getaffinity(0))
    tp2 = dict(VLLM_CPU_OMP_THREADS_BIND=f"{cpus[0]}|{cpus[1 % len(cpus)]}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    args = ("--tensor-parallel-size", "2")
    auto = Server("auto-tp2", tiny_checkpoint, logs / "auto.log", args, env=base_env(**tp2))
    ours = Server("latency_specialized-tp2", tiny_checkpoint, logs / "ours.log",
                  (*args, "--decode-backend", "latency_specialized"),
                  env=base_env(LATENCY_SPECIALIZED_TRACE_FILE=str(trace), **tp2))
    try:
        for s in (auto, ours):
            s.start()
        for s in (auto, ours):
            s.wait_ready()
        yield {"auto": auto, "ours": ours, "trace": trace}
    finally:
        for s in (auto, ours):
            s.stop()


def _complete_all(server: Server) -> list[list[int]]:
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        done = pool.map(lambda p: server.post("/v1/completions", {**body, "prompt": p}), PROMPTS)
        return [r["choices"][0]["token_ids"] for r in done]


def test_tp2_tokens_equal_auto_and_both_ranks_run_the_program(servers):
    ours, auto = _complete_all(servers["ours"]), _complete_all(servers["auto"])
    assert all(len(t) == MAX_TOKENS for t in auto)
    assert ours == auto
    trace: Path = servers["trace"]
    for path in (trace, Path(f"{trace}.rank1")):
        data = read_trace(path, min_fast=MAX_TOKENS - 1)
        assert data["summary"]["fast_steps"] >= MAX_TOKENS - 1, (path, data.get("summary"))
        served = {e["site"]: e["impl"] for e in data["events"] if e["kind"] == "site"}
        assert served["gqa+moe/attn.allreduce"] == "allreduce.reference" and served["gqa+moe/attn.gqa"] == "stock"
    assert "decode override installed for vllm_moe" in servers["ours"].log()
