"""GPU kernel implementations, registered into their op families by the builtin_ops plugin.

Each kernel module exposes ``IMPLEMENTATIONS`` (list of latency_specialized.contract.Implementation) and must
import cutlass lazily (inside compile functions), so that this list builds on any machine and
``supports()`` can name what is missing instead of failing at import.
"""

from __future__ import annotations

import importlib

KERNEL_MODULES: tuple[str, ...] = (
    "latency_specialized.kernels.allreduce_lamport",
    "latency_specialized.kernels.allreduce_two_stage",
    "latency_specialized.kernels.gemm_gemv",
    "latency_specialized.kernels.gemm_small_m",
    "latency_specialized.kernels.gemm_splitk",
    "latency_specialized.kernels.gemm_fp8_triton",
    "latency_specialized.kernels.gemm_fp8_mma",
    "latency_specialized.kernels.rmsnorm",
    "latency_specialized.kernels.prefetch",
    "latency_specialized.kernels.moe_router",
    "latency_specialized.kernels.moe_experts",
    "latency_specialized.kernels.moe_experts_triton",
    "latency_specialized.kernels.moe_experts_q4_triton",
    "latency_specialized.kernels.moe_experts_mma",
    "latency_specialized.kernels.moe_experts_fp8_triton",
    "latency_specialized.kernels.moe_finalize_triton",
    "latency_specialized.kernels.kda_decode",
    "latency_specialized.kernels.kda_verify_triton",
    "latency_specialized.kernels.mla_decode_triton",
    "latency_specialized.kernels.indexer_triton",
    "latency_specialized.kernels.sparse_mla_triton",
    "latency_specialized.kernels.sparse_mqa_triton",
    "latency_specialized.kernels.gqa_decode_triton",
    "latency_specialized.kernels.attnres",
    "latency_specialized.kernels.mlp_fused",
    "latency_specialized.kernels.mlp_one_launch_triton",
    "latency_specialized.kernels.qk_norm_rope_triton",
    "latency_specialized.kernels.residual_gated_triton",
)

IMPLEMENTATIONS: list = []
for _name in KERNEL_MODULES:
    IMPLEMENTATIONS += importlib.import_module(_name).IMPLEMENTATIONS
