"""On the real engine (vLLM 0.32 CPU build, in-process ``vllm.LLM``): the decode steps of
``latency_specialized`` are the runtime's ComposedProgram, bound to the plans' SiteChoices, over views
of vLLM's own weights and KV caches - and their greedy tokens equal stock vLLM's (``auto``).

Both engines run at once, each in its own process (:mod:`composed_script`, ~30 s on 2 cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_harness import START_TIMEOUT_S, base_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("composed")
    script = str(Path(__file__).with_name("composed_script.py"))
    procs = {}
    for backend in ("latency_specialized", "auto"):
        log = open(root / f"{backend}.log", "w")
        procs[backend] = (subprocess.Popen([sys.executable, script, str(tiny_checkpoint), backend,
                                            str(root / f"{backend}.json")], stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, env=base_env(), start_new_session=True), log)
    out = {}
    try:
        for backend, (proc, log) in procs.items():
            rc = proc.wait(timeout=START_TIMEOUT_S)
            log.close()
            text = (root / f"{backend}.log").read_text(errors="replace")
            assert rc == 0, f"{backend} run failed ({rc}):\n{text[-3000:]}"
            out[backend] = json.loads((root / f"{backend}.json").read_text())
    finally:
        for proc, log in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            log.close()
    return out


def test_tokens_equal_stock(runs):
    ours, auto = runs["latency_specialized"], runs["auto"]
    assert len(ours["tokens"]) == 5 and all(len(t) == 12 for t in ours["tokens"])
    assert ours["tokens"] == auto["tokens"]
    summary = ours["trace"]
    assert summary["fast_steps"] >= 11 and ours["steps_run"] == summary["fast_steps"]


def test_the_program_is_a_composed_program_bound_to_the_plans_site_choices(runs):
    f = runs["latency_specialized"]
    assert f["step"] == "latency_specialized.runtime.vllm_binding.VllmComposedStep" and f["step_is_composed_step"]
    assert f["program"] == "latency_specialized.runtime.composed.ComposedProgram" and f["is_composed_program"]
    assert f["head_is_none"] and f["outputs"] == ["hidden"]  # vLLM's compute_logits stays the head
    # one bucket rule: the gate routes to the buckets the binding planned, the program binds them all
    assert f["gate_buckets"] == f["planned_buckets"] == f["program_buckets"] == [1, 2, 4, 8]
    for bucket, b in f["bound"].items():
        assert b["same_plan"] and b["all_site_choices"] and b["bound_is_choice"], bucket
    assert f["stock"] == {"gqa+dense/attn.gqa": "vLLM's Attention layer owns the paged KV cache and its backend",
                          "gqa+moe/attn.gqa": "vLLM's Attention layer owns the paged KV cache and its backend"}
    assert f["stock_fn_is_vllm_attention"]
    assert f["served"]["gqa+moe/moe.experts"] == "moe.experts.reference"
    # every site the pieces call ran, once per layer of its kind per step (1 dense layer, 2 MoE layers)
    steps = f["steps_run"]
    for site, n in f["calls"].items():
        assert n == steps * (1 if site.startswith("gqa+dense/") else 2), (site, n)
    assert set(f["calls"]) == set(f["served"])


def test_weights_and_states_are_views_of_vllms_tensors(runs):
    f = runs["latency_specialized"]
    assert f["weights_are_views"] and all(f["weights_are_views"].values()), f["weights_are_views"]
    assert f["states_are_vllm_caches"] == {"0": True, "1": True, "2": True}


def test_layout_checks_on_the_real_module_tree(runs):
    """The start-time checks find nothing in vLLM's modules as loaded, and name what changed otherwise."""
    p = runs["latency_specialized"]["layout_problems"]
    assert p["as_loaded"] == [] and p["restored"] == []
    assert p["sliding_window"] == ["layer 1 self_attn.attn has a sliding window, sinks, ALiBi or a logit soft cap: "
                                   "the plan's attention site declares none"]
    assert p["bias"] == ["layer 0 self_attn.o_proj: has a bias (the composed program reads unquantized, bias-free "
                         "weights)"]
    assert len(p["rope"]) == 1 and p["rope"][0].startswith("layer 0 self_attn.rotary_emb (rotary_dim 32, neox True")
