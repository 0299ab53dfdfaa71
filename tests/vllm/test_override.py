"""The decode override's gate and dispatch, driven by fake attention metadata (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from latency_specialized.runtime.gate import DecodeGate
from latency_specialized.trace import Trace
from latency_specialized.vllm.override import _NO_CONTEXT, DecodeOverride, step_state
from latency_specialized.vllm.trace_file import TraceWriter


def meta(query_lens: list[int]) -> SimpleNamespace:
    """CPU-backend-like metadata of a step with these per-request query lengths."""
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    return SimpleNamespace(num_actual_tokens=sum(query_lens), max_query_len=max(query_lens), query_start_loc=qsl)


def test_step_state_reads_host_metadata():
    s = step_state({"layers.0.attn": meta([1, 1, 1])})
    assert (s.num_seqs, s.num_prefill_tokens) == (3, 0)
    s = step_state({"a": meta([5, 1, 1])})  # a mixed step: one prompt of 5 tokens, two decodes
    assert (s.num_seqs, s.num_prefill_tokens) == (3, 5)
    assert step_state(None) == "no attention metadata (profiling or warm-up run)"
    assert step_state([{"a": meta([1])}]) == "micro-batched step (ubatching)"
    assert step_state({"a": SimpleNamespace()}) == "attention metadata carries no max_query_len"
    # Device-resident offsets are never read (a sync): the count falls back to the shape.
    dev = SimpleNamespace(num_actual_tokens=7, max_query_len=5, query_start_loc=torch.empty(3, device="meta"))
    assert step_state({"a": dev}).num_prefill_tokens == 5


class Harness:
    def __init__(self, max_batch: int = 4):
        self.metadata = None
        self.stock_calls, self.fast_calls = [], []
        self.trace = Trace()
        self.override = DecodeOverride(self._stock, self._fast, gate=DecodeGate(max_batch=max_batch, buckets=(1, 2, 4)),
                                       trace=self.trace, writer=TraceWriter(self.trace, None),
                                       metadata_fn=lambda: self.metadata)

    def _stock(self, **kw):
        self.stock_calls.append(kw)
        return "stock"

    def _fast(self, input_ids, positions, batch):
        self.fast_calls.append(batch)
        return "fast"


def test_pure_decode_steps_in_scope_run_the_program_everything_else_stock():
    h = Harness(max_batch=4)
    ids = torch.randint(0, 100, (3,))
    h.metadata = {"a": meta([1, 1, 1])}
    assert h.override(input_ids=ids, positions=torch.arange(3)) == "fast"
    assert h.fast_calls == [3]

    steps = [({"a": meta([4, 1])}, "not a pure decode step (4 prefill tokens)"),
             ({"a": meta([1] * 5)}, "batch 5 beyond the fast path (1..4)"),
             (None, "no attention metadata"),
             (_NO_CONTEXT, "no forward context")]
    for metadata, reason in steps:
        h.metadata = metadata
        assert h.override(input_ids=torch.zeros(5, dtype=torch.long), positions=torch.arange(5)) == "stock"
        assert any(reason in r for r in h.trace.stock_reasons), (reason, dict(h.trace.stock_reasons))
    h.metadata = {"a": meta([1])}
    assert h.override(input_ids=None, positions=torch.arange(1), inputs_embeds=torch.zeros(1, 8)) == "stock"
    assert h.override(input_ids=ids[:1], positions=torch.arange(1), intermediate_tensors={"x": 1}) == "stock"
    s = h.trace.summary()
    assert s["fast_steps"] == 1 and s["stock_steps"] == 6
    fast = [e for e in h.trace.events if e.kind == "fast"][0]
    assert fast.data["batch"] == 3 and fast.data["bucket"] == 4


def test_stock_forward_receives_the_original_arguments():
    h = Harness()
    h.metadata = {"a": meta([3])}
    ids, pos = torch.arange(3), torch.arange(3)
    h.override(input_ids=ids, positions=pos)
    call = h.stock_calls[0]
    assert call["input_ids"] is ids and call["positions"] is pos
    assert call["intermediate_tensors"] is None and call["inputs_embeds"] is None


@pytest.mark.parametrize("kw", [{"foo": 1}])
def test_unknown_forward_arguments_go_stock(kw):
    h = Harness()
    h.metadata = {"a": meta([1])}
    assert h.override(input_ids=torch.arange(1), positions=torch.arange(1), **kw) == "stock"
    assert "extra forward arguments (foo)" in h.trace.stock_reasons
