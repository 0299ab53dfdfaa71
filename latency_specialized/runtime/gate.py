"""The host-state gate of a decode step: fast path (which graph bucket) or stock path (why).

The gate looks only at host state the scheduler already has - how many sequences, whether any
prefill tokens are in the step, speculative tokens, features the fast path lacks - so it costs
no device sync and decides identically on every TP rank. Its reasons are one line each, written
so that a user reading the trace knows what to change ("batch 80 beyond the fast path: 1..64").
Buckets follow the planner's one rule (``ops.plan.bucket_for`` / ``buckets_upto`` / ``bucket_of``;
``bucket_of`` is re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection

from latency_specialized.ops.plan import bucket_of, buckets_upto


@dataclass(frozen=True)
class StepState:
    """What the host knows about the coming step (no device reads)."""

    num_seqs: int
    """Sequences in the step."""
    num_prefill_tokens: int = 0
    """Prompt tokens scheduled in the same step (any > 0 means not a pure decode step)."""
    spec_tokens: int = 0
    """Speculative draft tokens verified per sequence."""
    features: tuple[str, ...] = ()
    """Per-request features in use this step (e.g. 'logprobs', 'structured_output', 'lora')."""


@dataclass(frozen=True)
class GateDecision:
    """Fast path with a bucket, or stock path with the reason."""

    fast: bool
    """True: replay the graph of ``bucket``."""
    bucket: int | None
    """Graph bucket that holds the batch (None on the stock path)."""
    reason: str = ""
    """Why the stock path runs (empty on the fast path)."""


@dataclass(frozen=True)
class DecodeGate:
    """Decides fast vs stock for each step from host state only.

    Parameters
    ----------
    max_batch : largest batch the fast path decodes (the adapter scope's ``max_batch``).
    buckets : graph batch sizes (default: ``ops.plan.buckets_upto(max_batch)``, the planner's bucket rule).
    spec_tokens : speculative token counts the program supports.
    unsupported_features : features that force the stock path (names as in ``StepState.features``).
    enabled : False forces the stock path (``--decode-backend auto`` or a user switch).
    """

    max_batch: int = 64
    buckets: tuple[int, ...] = ()
    spec_tokens: tuple[int, ...] = (0,)
    unsupported_features: frozenset[str] = field(default_factory=frozenset)
    enabled: bool = True

    def all_buckets(self) -> tuple[int, ...]:
        """The graph buckets this gate routes to, ascending."""
        if self.buckets:
            return tuple(sorted(self.buckets))
        return buckets_upto(self.max_batch)

    def decide(self, state: StepState, captured: Collection[int] | None = None) -> GateDecision:
        """Fast (with the bucket) or stock (with the first reason that applies).

        ``captured`` is the set of buckets that have a graph; None means graphs are not used
        (eager fast path, e.g. on the CPU), so any bucket of the gate is acceptable.
        """
        if not self.enabled:
            return GateDecision(False, None, "fast path disabled (decode_backend is not latency_specialized)")
        if state.num_prefill_tokens > 0:
            return GateDecision(False, None, f"not a pure decode step ({state.num_prefill_tokens} prefill tokens): "
                                             "prefill always runs stock")
        if state.num_seqs < 1:
            return GateDecision(False, None, "empty step (no sequences)")
        if state.num_seqs > self.max_batch:
            return GateDecision(False, None, f"batch {state.num_seqs} beyond the fast path (1..{self.max_batch}); "
                                             "larger batches run stock")
        if state.spec_tokens not in self.spec_tokens:
            return GateDecision(False, None, f"{state.spec_tokens} speculative tokens per step not supported "
                                             f"(fast path: {list(self.spec_tokens)})")
        bad = sorted(set(state.features) & self.unsupported_features)
        if bad:
            return GateDecision(False, None, f"feature(s) {', '.join(bad)} not supported by the fast path")
        bucket = bucket_of(state.num_seqs, self.all_buckets())
        if bucket is None:
            return GateDecision(False, None, f"batch {state.num_seqs} fits no graph bucket "
                                             f"(buckets {list(self.all_buckets())})")
        if captured is not None and bucket not in captured:
            return GateDecision(False, None, f"bucket {bucket} was not captured (captured: {sorted(captured)}); "
                                             "capture it at start-up")
        return GateDecision(True, bucket)


__all__ = ["StepState", "GateDecision", "DecodeGate", "bucket_of"]
