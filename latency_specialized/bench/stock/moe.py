"""Stock MoE kernels: the Triton fused-MoE kernels of ``kernels/triton_moe.py`` (ours serves many-token
buckets with them too, so they live with the kernels; this name stays for the stock composition)."""

from latency_specialized.kernels.triton_moe import (  # noqa: F401
    AlignBuffers,
    AlignSizes,
    grouped_topk,
    moe_align,
    moe_gemm,
    moe_sum,
    situ_and_mul,
)
