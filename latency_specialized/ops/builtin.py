"""The built-in op implementations, registered as a plugin through the entry-point group.

Every op module exposes ``IMPLEMENTATIONS``; GPU kernel modules are listed too and contribute
only what imports on this machine (a module whose optional dependency is missing registers its
implementations with a ``supports`` that names the missing package).
"""

from __future__ import annotations

import importlib

from latency_specialized.plugins.hookspecs import hookimpl

OP_MODULES = (
    "latency_specialized.ops.gemm",
    "latency_specialized.ops.norm",
    "latency_specialized.ops.mlp",
    "latency_specialized.ops.moe",
    "latency_specialized.ops.allreduce",
    "latency_specialized.ops.prefetch",
    "latency_specialized.ops.attnres",
    "latency_specialized.ops.attention.kda",
    "latency_specialized.ops.attention.kda_verify",
    "latency_specialized.ops.attention.mla",
    "latency_specialized.ops.attention.gqa",
    "latency_specialized.ops.attention.qk_norm_rope",
    "latency_specialized.ops.attention.sparse",
    "latency_specialized.ops.attention.dcp_merge",
    "latency_specialized.ops.residual_mhc",
    "latency_specialized.ops.residual_gated",
    "latency_specialized.ops.attention.sparse_mla",
    "latency_specialized.ops.attention.sparse_mqa",
    "latency_specialized.kernels.registry",
)


@hookimpl
def register_implementations(register):
    for name in OP_MODULES:
        module = importlib.import_module(name)
        for impl in module.IMPLEMENTATIONS:
            register(impl)
