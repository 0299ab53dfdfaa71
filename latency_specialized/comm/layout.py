"""The symmetric all-reduce workspace layout: ``latency_specialized.kernels.allreduce_layout``.

The layout is the fused all-reduce kernels' protocol, so it is defined with them (kernels sit below
comm); the communicators, the emulation and their tests use it through this module.
"""

from latency_specialized.kernels.allreduce_layout import *  # noqa: F401,F403
from latency_specialized.kernels.allreduce_layout import __all__  # noqa: F401
