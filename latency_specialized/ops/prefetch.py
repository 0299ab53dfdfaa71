"""prefetch: warm the L2 with upcoming weights from a side stream.

``prefetch_l2(tensors, max_bytes)`` asks the hardware to pull (a prefix of) each tensor into
L2. It changes no values, so the reference is a no-op; a GPU implementation issues
``cp.async.bulk.prefetch.L2`` over a table of (address, bytes).
"""

from __future__ import annotations

from typing import Sequence

import torch

from latency_specialized.ops.registry import Implementation, always


def prefetch_reference(tensors: Sequence[torch.Tensor], max_bytes: int | None = None) -> None:
    """No-op: prefetching is a hint and must never change results."""
    return None


IMPLEMENTATIONS = [
    Implementation("prefetch", "prefetch.none", prefetch_reference, always, priority=-100, is_reference=True,
                   description="no prefetch"),
]
