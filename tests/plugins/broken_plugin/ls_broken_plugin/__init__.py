"""Fails at import, as a plugin with a missing dependency would."""

import this_dependency_is_not_installed  # noqa: F401
