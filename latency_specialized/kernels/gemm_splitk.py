"""gemm.cutedsl_splitk: y[M, N] = x[M, K] @ W[N, K]^T (+ residual) for M <= 64, split-K on tensor cores.

The tensor-core kernel of gemm_small_m.py with K also split across the ``sk`` CTAs of a thread-block
cluster (sm_90 clusters, up to 8): each CTA streams 1/sk of every weight row, the partial tiles
meet in distributed shared memory and are summed in a fixed (CTA, warp) order - deterministic,
no global workspace, no atomics, nothing to reset between graph replays. Split-K is what keeps
enough independent load streams in flight when N is small (router, latent projections: N =
112..448) or when M is large enough (32-64 tokens: n-tiles 4-8, two 16-row m-tiles per warp so
each activation vector feeds 32 rows) that fewer, fatter warps fit on an SM.

Where cuBLAS is faster (it is, for some shapes at M = 32-64) the measured table keeps cuBLAS.
"""

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.kernels.gemm_common import mma_supports
from latency_specialized.kernels.gemm_small_m import MmaConfig, default_config, run_mma

NAME = "gemm.cutedsl_splitk"
MAX_M = 64
MAX_CLUSTER = 8  # portable cluster size on sm_90


def splitk_config(n: int, k: int, m: int) -> MmaConfig:
    """Heuristic split-K config (cluster allowed) where the tuning table has no entry."""
    return default_config(n, k, m, sk_max=MAX_CLUSTER)


def gemm_splitk(x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
                out: torch.Tensor | None = None, config: MmaConfig | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ residual), cluster split-K on tensor cores, M <= 64 (gemm contract).

    Parameters
    ----------
    x : [M, K] bf16, M <= 64, K % 32 == 0.
    weight : [N, K] bf16.
    residual : optional [M, N] bf16 added before the single rounding.
    out : optional [M, N] destination (bf16, or fp32 with ``out_dtype=torch.float32``).
    config : kernel choices; default: the tuning table's, else a heuristic.
    out_dtype : torch.float32 stores the fp32 sums unrounded (router logits, no residual).
    """
    from latency_specialized.errors import UserError

    m, n, k = x.shape[0], weight.shape[0], x.shape[-1]
    if m > MAX_M:
        raise UserError(f"{NAME} serves M<={MAX_M} (got M={m}): use gemm.cublas")
    if config is None:
        from latency_specialized.kernels import tuning

        config = tuning.config_for(NAME, n, k, m, MmaConfig) or splitk_config(n, k, m)
    if config.nt * 8 < m:  # a table config of a smaller bucket cannot happen; a caller's can
        raise UserError(f"{NAME}: config {config.label()} serves M<={8 * config.nt}, got M={m}")
    return run_mma(x, weight, residual, out, config, NAME, out_dtype)


def _supports(ctx: OpContext) -> Support:
    return mma_supports(NAME, "split-K", MAX_M, ctx)


IMPLEMENTATIONS = [
    Implementation("gemm", NAME, gemm_splitk, _supports, priority=10, strided_out=True,
                   description="CuTe DSL mma.sync, K split over warps and a CTA cluster (DSMEM, fixed order), M<=64"),
]
