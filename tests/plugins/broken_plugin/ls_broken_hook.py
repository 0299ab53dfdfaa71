"""Imports fine but misspells the hook name: check_pending() must reject it."""

from latency_specialized.plugins import hookimpl


@hookimpl
def register_adapter(register):  # missing 's'
    raise AssertionError("never called")
