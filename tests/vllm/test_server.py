"""End to end on vLLM's CPU build: the tiny Qwen3-MoE served through the OpenAI API twice - stock
(``auto``) and with ``--decode-backend latency_specialized`` - and compared request by request.

Both servers start once for the module, concurrently (~2 min on 2 cores), and stop at teardown.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_harness import Server, base_env, read_trace

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = ["The quick brown fox", "Hello world! How are you", "Tensor parallel ranks exchange",
           "Once upon a time there was a kernel", "Numbers: 0 1 2"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def servers(tiny_checkpoint, tmp_path_factory):
    logs = tmp_path_factory.mktemp("servers")
    trace = logs / "trace.json"
    auto = Server("auto", tiny_checkpoint, logs / "auto.log")
    ours = Server("latency_specialized", tiny_checkpoint, logs / "latency_specialized.log",
                  ("--decode-backend", "latency_specialized"), env=base_env(LATENCY_SPECIALIZED_TRACE_FILE=str(trace)))
    try:
        for s in (auto, ours):
            s.start()
        for s in (auto, ours):
            s.wait_ready()
        yield {"auto": auto, "ours": ours, "trace": trace}
    finally:
        for s in (auto, ours):
            s.stop()


def _complete(server: Server, prompt: str, **kw) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **kw}
    return server.post("/v1/completions", body)["choices"][0]


def _concurrently(server: Server, prompts: list[str], **kw) -> list[dict]:
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(lambda p: _complete(server, p, **kw), prompts))


def test_same_greedy_tokens_as_auto_and_the_trace_shows_the_fast_path(servers):
    ours = _concurrently(servers["ours"], PROMPTS)
    auto = _concurrently(servers["auto"], PROMPTS)
    for prompt, a, o in zip(PROMPTS, auto, ours):
        assert len(a["token_ids"]) == MAX_TOKENS
        assert o["token_ids"] == a["token_ids"], f"greedy tokens differ for {prompt!r}"
        assert o["text"] == a["text"]

    trace = read_trace(servers["trace"], min_fast=MAX_TOKENS - 1)
    summary = trace["summary"]
    # Every request decodes MAX_TOKENS - 1 tokens after its prefill; batched steps serve several.
    assert summary["fast_steps"] >= MAX_TOKENS - 1, summary
    assert any("prefill always runs stock" in r for r in summary["stock_reasons"]), summary
    fast = [e for e in trace["events"] if e["kind"] == "fast"]
    assert max(e["data"]["batch"] for e in fast) > 1, "concurrent requests should share decode steps"
    assert all(e["data"]["bucket"] >= e["data"]["batch"] for e in fast)
    served = {e["site"]: e["impl"] for e in trace["events"] if e["kind"] == "site"}
    # The program (the runtime's ComposedProgram of the pieces) runs the op families over vLLM's
    # weights (references serve on the CPU)...
    assert served["gqa+moe/moe.experts"] == "moe.experts.reference"
    assert served["gqa+moe/moe.router"] == "moe.router.reference"
    assert served["gqa+moe/attn.qkv_proj"] == "gemm.reference"
    assert served["gqa+dense/mlp"] == "mlp.reference"
    assert served["gqa+moe/attn.allreduce"] == "allreduce.reference"
    # ...calls vLLM's own Attention layer at the attention sites (its paged KV cache and backend)...
    assert served["gqa+moe/attn.gqa"] == served["gqa+dense/attn.gqa"] == "stock"
    stock = [e for e in trace["events"] if e["kind"] == "site" and e["site"] == "gqa+moe/attn.gqa"]
    assert "vLLM's Attention layer owns the paged KV cache" in stock[0]["message"]
    # ...and the pre-norm residual joins every sublayer output in an all-reduce site that norms it for
    # its consumer: the later layers' input norms and the final norm are no sites of their own.
    assert "final_norm" not in served and "gqa+moe/attn.norm" not in served and "lm_head" not in served
    assert served["gqa+dense/attn.norm"] == "norm.reference"  # layer 0's own input norm
    assert trace["model"] == "vllm_moe" and trace["rank"] == 0

    ours_log, auto_log = servers["ours"].log(), servers["auto"].log()
    assert "latency_specialized: decode override installed for vllm_moe" in ours_log
    assert "gqa+moe/moe.experts" in ours_log  # the plan is logged
    assert ours_log.count("decode override installed") == 1
    assert "latency_specialized" not in auto_log.split("\n", 1)[1]  # auto: the plugin stays silent and inert


def test_streaming_matches_auto(servers):
    prompt = PROMPTS[1]
    events = servers["ours"].stream("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                         "temperature": 0.0, "ignore_eos": True})
    streamed = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    assert len(events) >= MAX_TOKENS // 2  # really streamed, not one chunk
    assert streamed == _complete(servers["auto"], prompt)["text"]


def test_stop_strings(servers):
    full = _complete(servers["auto"], PROMPTS[3])["text"]
    # A stop string taken from the middle of the greedy continuation: generation must end right before it.
    candidates = [full[i:i + 3] for i in range(2, len(full) - 3) if full[i:i + 3].strip() and full.find(full[i:i + 3]) == i]
    assert candidates, f"no usable stop string in {full!r}"
    stop = candidates[0]
    ours = _complete(servers["ours"], PROMPTS[3], stop=[stop])
    auto = _complete(servers["auto"], PROMPTS[3], stop=[stop])
    assert ours["finish_reason"] == "stop" and ours["text"] == full[:full.index(stop)]
    assert ours["text"] == auto["text"]


def test_structured_outputs(servers):
    choice = {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}
    regex = {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}
    for kw, check in ((choice, lambda t: t in ("yes", "no", "maybe")), (regex, re.compile(r"[0-9]{3}-[a-z]{2}").fullmatch)):
        ours = _complete(servers["ours"], "Is it red?", ignore_eos=False, **kw)["text"]
        auto = _complete(servers["auto"], "Is it red?", ignore_eos=False, **kw)["text"]
        assert check(ours), ours
        assert ours == auto
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
              "required": ["ok", "color"], "additionalProperties": False}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Give me json"}], "max_tokens": 64,
            "temperature": 0.0, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}

    ours = servers["ours"].post("/v1/chat/completions", body)["choices"][0]["message"]["content"]
    auto = servers["auto"].post("/v1/chat/completions", body)["choices"][0]["message"]["content"]
    parsed = json.loads(ours)
    assert set(parsed) == {"ok", "color"} and isinstance(parsed["ok"], bool) and parsed["color"] in ("red", "green")
    assert ours == auto
    # These requests decoded through the fast path too (structured output masks the logits only).
    assert read_trace(servers["trace"])["summary"]["fast_steps"] > 0
