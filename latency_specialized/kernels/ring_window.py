"""Sliding-window rings of per-sequence rows (position ``p`` at slot ``p % ring``), shared by the sparse MQA
reference (``ops.attention.sparse_mqa``) and its kernels: the check of the window a row attends to. A ring may
be longer than the window (verification steps write up to ``MAX_SPEC_TOKENS`` positions ahead of a reader)."""

from __future__ import annotations

from latency_specialized.errors import UserError


def check_sliding_window(sliding_window: int | None, ring: int, name: str) -> int:
    """The window a row sees: ``sliding_window`` (default: the ring's length); UserError past the ring."""
    if sliding_window is None:
        return ring
    if not 1 <= sliding_window <= ring:
        raise UserError(f"{name}: sliding_window {sliding_window} must be in [1, ring length {ring}]: allocate the "
                        "ring with at least the window's rows")
    return int(sliding_window)


__all__ = ["check_sliding_window"]
