"""Trace: events, counters, text and JSON, bounded memory."""

from __future__ import annotations

import json

from latency_specialized.trace import Trace


def test_trace_records_fast_and_stock_steps_with_reasons():
    t = Trace()
    t.site("kda+moe/attn.o_proj", "gemm.cublas")
    t.fast(batch=3, bucket=4)
    t.stock("prefill")
    t.stock("prefill")
    t.stock("batch 80 beyond the scope")
    s = t.summary()
    assert s == {"fast_steps": 1, "stock_steps": 3, "stock_reasons": {"prefill": 2, "batch 80 beyond the scope": 1},
                 "sites": 1, "captures": 0}
    text = t.to_text()
    assert "1 fast steps, 3 stock steps" in text and "stock x2: prefill" in text
    assert "kda+moe/attn.o_proj: gemm.cublas" in text
    data = json.loads(t.to_json())
    assert data["summary"]["fast_steps"] == 1
    assert [e["kind"] for e in data["events"]] == ["site", "fast", "stock", "stock", "stock"]
    assert data["events"][1]["data"]["bucket"] == 4


def test_trace_is_bounded_but_counts_everything():
    t = Trace(max_events=10)
    for _ in range(1000):
        t.fast(batch=1)
    assert len(t.events) == 10
    assert t.summary()["fast_steps"] == 1000
    assert t.events[-1].step == 1000
