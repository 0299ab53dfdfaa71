"""A readable record of what the backend decided and ran.

Every decision is an event: which implementation serves an op site (``site``), a decode step
entering the fast path (``fast``) or running stock (``stock``, with the reason), a graph captured
(``capture``), anything else worth telling (``note``). Per-step events are counted in full and
the newest ``max_events`` are kept, so a server can run for days without the trace growing.
"""

from __future__ import annotations

import json
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

EventKind = Literal["plan", "site", "fast", "stock", "capture", "note"]


@dataclass(frozen=True)
class TraceEvent:
    kind: EventKind
    """What happened."""
    message: str
    """One human-readable line."""
    site: str | None = None
    """Op site, for 'site' events."""
    impl: str | None = None
    """Implementation name, for 'site' events."""
    step: int | None = None
    """Decode step counter, for 'fast'/'stock' events."""
    data: dict[str, Any] = field(default_factory=dict)
    """Extra structured detail (batch, bucket, refusals ...)."""
    t: float = field(default_factory=time.time)
    """Wall-clock time of the event."""


class Trace:
    """Append-only event log with counters; render with ``to_text()`` / ``to_json()``."""

    def __init__(self, max_events: int = 10_000):
        self.events: deque[TraceEvent] = deque(maxlen=max_events)
        self.counts: Counter[str] = Counter()
        self.stock_reasons: Counter[str] = Counter()
        self.impl_calls: Counter[str] = Counter()
        self.step = 0

    def record(self, kind: EventKind, message: str, **kw: Any) -> TraceEvent:
        ev = TraceEvent(kind=kind, message=message, **kw)
        self.events.append(ev)
        self.counts[kind] += 1
        return ev

    def site(self, site: str, impl: str, reason: str = "") -> None:
        """Implementation ``impl`` serves ``site`` (recorded when a program binds its plan)."""
        self.impl_calls[impl] += 1
        self.record("site", f"{site}: {impl}" + (f" ({reason})" if reason else ""), site=site, impl=impl)

    def fast(self, batch: int, bucket: int | None = None, **data: Any) -> None:
        """A decode step ran the fast path."""
        self.step += 1
        self.record("fast", f"step {self.step}: fast path, batch {batch}" + (f" (bucket {bucket})" if bucket else ""),
                    step=self.step, data={"batch": batch, "bucket": bucket, **data})

    def stock(self, reason: str, **data: Any) -> None:
        """A step ran the stock path; ``reason`` says why."""
        self.step += 1
        self.stock_reasons[reason] += 1
        self.record("stock", f"step {self.step}: stock path: {reason}", step=self.step, data=data)

    def note(self, message: str, **data: Any) -> None:
        self.record("note", message, data=data)

    # ---------------------------------------------------------------- reading
    def summary(self) -> dict[str, Any]:
        return {
            "fast_steps": self.counts["fast"],
            "stock_steps": self.counts["stock"],
            "stock_reasons": dict(self.stock_reasons),
            "sites": self.counts["site"],
            "captures": self.counts["capture"],
        }

    def to_text(self, last: int = 20) -> str:
        s = self.summary()
        lines = [f"trace: {s['fast_steps']} fast steps, {s['stock_steps']} stock steps, {s['captures']} graph captures"]
        for reason, n in s["stock_reasons"].items():
            lines.append(f"  stock x{n}: {reason}")
        tail = list(self.events)[-last:] if last else list(self.events)
        lines += [f"  [{e.kind}] {e.message}" for e in tail]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"summary": self.summary(), "events": [asdict(e) for e in self.events]}, default=str)
