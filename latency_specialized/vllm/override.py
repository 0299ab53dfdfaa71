"""The decode override installed on a vLLM model: the gate, the dispatch, the trace.

``DecodeOverride`` replaces the model's ``forward`` on that one instance. Per step it decides from
host state only - identical on every TP rank, so ranks never diverge - whether the step is a pure
decode step in scope:

* attention metadata present (profiling and warm-up runs have none),
* one token per request (``max_query_len == 1`` in every attention group: no prefill, no mixed
  batch, no speculative verification),
* batch within the adapter's scope, no pipeline-parallel intermediate tensors, no input embeddings.

The batch rules are :class:`latency_specialized.runtime.gate.DecodeGate`'s, shared with the
standalone runtime, so a step is refused for the same reason with the same words everywhere.

Such a step runs the adapter's decode program; every other step runs the stock forward and the
trace records why. ``compute_logits``, sampling and everything else stay vLLM's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from latency_specialized.runtime.gate import DecodeGate, StepState
from latency_specialized.trace import Trace
from latency_specialized.vllm.trace_file import TraceWriter


def step_state(attn_metadata: Any) -> StepState | str:
    """What the step is, from vLLM's attention metadata (host values only), or why unknown.

    Every attention group sees the same step; tokens / max query length / request count come from
    the group metadata fields vLLM's backends share (``num_actual_tokens``, ``max_query_len``,
    ``query_start_loc``).
    """
    if attn_metadata is None:
        return "no attention metadata (profiling or warm-up run)"
    if isinstance(attn_metadata, list):
        return "micro-batched step (ubatching)"
    metas = list(attn_metadata.values()) if isinstance(attn_metadata, dict) else [attn_metadata]
    metas = [m for m in metas if getattr(m, "num_actual_tokens", None) is not None
             and getattr(m, "max_query_len", None) is not None]
    if not metas:
        return "attention metadata carries no max_query_len"
    m = max(metas, key=lambda m: int(m.num_actual_tokens))
    tokens, max_q = int(m.num_actual_tokens), int(m.max_query_len)
    if max_q < 1 or tokens < 1:
        return "empty step"
    if max_q == 1:
        return StepState(num_seqs=tokens)
    # Query length > 1: prompt tokens (or speculative ones, which the start check keeps out of
    # scope). Count them from the host copy of the query offsets when there is one (never read a
    # device tensor here: that would sync); else everything beyond one token per request.
    qsl = getattr(m, "query_start_loc_cpu", None)
    if qsl is None:
        qsl = getattr(m, "query_start_loc", None)
    if isinstance(qsl, torch.Tensor) and qsl.device.type == "cpu" and qsl.numel() > 1:
        lens = qsl[1:] - qsl[:-1]
        return StepState(num_seqs=int(qsl.numel()) - 1, num_prefill_tokens=int(lens[lens > 1].sum()))
    reqs = int(qsl.shape[0]) - 1 if isinstance(qsl, torch.Tensor) else 1
    return StepState(num_seqs=reqs, num_prefill_tokens=max(tokens - reqs, 1))


_NO_CONTEXT = object()


def current_attn_metadata() -> Any:
    """The attention metadata of vLLM's current forward context (``_NO_CONTEXT`` outside one)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return _NO_CONTEXT
    return get_forward_context().attn_metadata


class DecodeOverride:
    """Callable that stands in for ``model.forward`` (see module docstring)."""

    def __init__(self, stock_forward: Callable[..., Any], step: Callable[..., Any], *, gate: DecodeGate,
                 trace: Trace, writer: TraceWriter, metadata_fn: Callable[[], Any] = current_attn_metadata):
        self.stock_forward, self.step, self.decode_gate = stock_forward, step, gate
        self.trace, self.writer, self.metadata_fn = trace, writer, metadata_fn

    def gate(self, input_ids: Any, intermediate_tensors: Any, inputs_embeds: Any) -> tuple[int, int, str]:
        """(batch, bucket, '') for a step the program serves, else (0, 0, reason)."""
        if intermediate_tensors is not None:
            return 0, 0, "pipeline-parallel intermediate tensors"
        if inputs_embeds is not None or input_ids is None:
            return 0, 0, "input embeddings instead of token ids"
        metadata = self.metadata_fn()
        state = step_state(metadata) if metadata is not _NO_CONTEXT else "no forward context"
        if isinstance(state, str):
            return 0, 0, state
        decision = self.decode_gate.decide(state)
        if not decision.fast:
            return 0, 0, decision.reason
        return state.num_seqs, int(decision.bucket), ""

    def __call__(self, input_ids: Any = None, positions: Any = None, intermediate_tensors: Any = None,
                 inputs_embeds: Any = None, **kwargs: Any) -> Any:
        batch, bucket, reason = self.gate(input_ids, intermediate_tensors, inputs_embeds)
        if kwargs and not reason:
            reason = f"extra forward arguments ({', '.join(sorted(kwargs))})"
        if reason:
            with self.writer.lock:
                self.trace.stock(reason)
                self.writer.touched()
            return self.stock_forward(input_ids=input_ids, positions=positions,
                                      intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds, **kwargs)
        out = self.step(input_ids, positions, batch)
        with self.writer.lock:
            self.trace.fast(batch, bucket, tokens=int(input_ids.shape[0]))
            self.writer.touched()
        return out
