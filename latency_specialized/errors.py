"""Errors a user can act on.

Every error raised for a user mistake (unknown model, bad TP, batch out of scope, malformed
config) is a :class:`UserError`. Its message is one line that names the fix; the CLI prints it
without a traceback and exits non-zero. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in how the backend was asked to run; the message names the fix."""


class ScopeError(UserError):
    """A deployment is outside an adapter's scope; lists every missing requirement at once."""

    def __init__(self, model: str, problems: list[str]):
        self.model = model
        self.problems = list(problems)
        joined = "; ".join(self.problems)
        super().__init__(f"{model}: outside the latency_specialized scope: {joined}")


class PluginError(UserError):
    """A plugin could not be loaded or registered something invalid."""


class CheckpointError(UserError):
    """A checkpoint directory is missing a tensor, has a wrong shape or a missing or contradictory config key."""
