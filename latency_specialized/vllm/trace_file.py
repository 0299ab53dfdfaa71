"""Make a worker's :class:`~latency_specialized.trace.Trace` readable from outside the server.

``LATENCY_SPECIALIZED_TRACE_FILE=path`` makes every worker write its trace as JSON: rank 0 to
``path``, rank r > 0 to ``path.rank<r>`` (or ``{rank}`` in the path is replaced). The file is
rewritten atomically (temp file + rename) at most every ``interval_s`` while steps run, by a
daemon thread once the steps stop (so the last step shows up without another request), and at
interpreter exit. The trace is only touched under :attr:`TraceWriter.lock`.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from latency_specialized.trace import Trace

ENV = "LATENCY_SPECIALIZED_TRACE_FILE"


def trace_path(template: str, rank: int) -> Path:
    """Where rank ``rank`` writes (see module docstring)."""
    if "{rank}" in template:
        return Path(template.replace("{rank}", str(rank)))
    return Path(template if rank == 0 else f"{template}.rank{rank}")


class TraceWriter:
    """Serialises one Trace to one file; thread-safe through ``lock``."""

    def __init__(self, trace: Trace, path: str | Path | None, *, extra: dict[str, Any] | None = None,
                 interval_s: float = 0.5):
        self.trace, self.interval_s = trace, interval_s
        self.path = Path(path) if path else None
        self.extra = dict(extra or {})
        self.lock = threading.RLock()
        self._dirty = False
        self._last = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._loop, name="ls-trace-writer", daemon=True)
            self._thread.start()
            atexit.register(self.close)
            self.flush()

    def touched(self) -> None:
        """Record that the trace changed (call with ``lock`` held); writes if the interval passed."""
        self._dirty = True
        if self.path is not None and time.monotonic() - self._last >= self.interval_s:
            self.flush()

    def to_dict(self) -> dict[str, Any]:
        with self.lock:
            data = json.loads(self.trace.to_json())
            data.update(self.extra)
            return data

    def flush(self) -> None:
        """Write the file now (no-op without a path)."""
        if self.path is None:
            return
        with self.lock:
            payload = json.dumps(self.to_dict(), default=str)
            self._dirty = False
            self._last = time.monotonic()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(payload)
        os.replace(tmp, self.path)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._dirty:
                try:
                    self.flush()
                except OSError:  # a vanished directory must not kill the worker; next flush retries
                    pass

    def close(self) -> None:
        self._stop.set()
        if self.path is not None and self._dirty:
            self.flush()
