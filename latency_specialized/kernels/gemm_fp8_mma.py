"""gemm.fp8_w8a16_mma: decode gemms over block-FP8 weights on the mma.sync kernel of gemm_small_m.py (CuTe DSL).

``y[M, N] = x[M, K] @ deq(W)[N, K]^T (+ residual)`` for M <= 64, W a :class:`QuantizedWeight` in
``fp8-block-128`` (fp32 scale per 128 x 128: GLM-5.3) or ``fp8-block-32`` (ue8m0 per 32 x 32: DeepSeek-V4.1-Flash's
dense weights), or their ``/rows`` forms (one scale per row: ``quant.layout.row_scaled``).

The Triton block-FP8 kernels (``gemm_fp8_triton.py``) put a 64-row ``wgmma`` tile and a shared-memory pipeline on a
decode gemm and measured 14-27% of the FP8 roofline on the H200 (session 32), slower than bf16 cuBLAS over twice
the bytes. This one is the bf16 small-M / split-K kernel's weight stream - every lane one 16-byte load per weight
row straight into registers, no shared memory, K split over warps and a cluster - at half the bytes per value:
a 16-byte load now holds 16 e4m3 values, decoded to bf16 in registers (``ptx.e4m3x4_to_bf16x2``: byte permutes,
shifts and masks, one bf16x2 multiply per pair; exact) and fed to four ``m16n8k16`` bf16 MMAs. So the numerics
are the reference's (W8A16: no activation rounding), and the per-value cost is a handful of integer operations,
not a conversion instruction.

Scales: fp32 block scales multiply each 64-wide chunk's partial sums per row (a chunk sits inside one 128-wide
block); ue8m0 scales are powers of two and join the decode's multiplier (2^(e - 7): exact while e <= 134, which
real checkpoints satisfy - DeepSeek-V4.1's sit near 117; the wrapper refuses others, naming the Triton kernel).
Static shapes; the first call on a weight checks its codes (no NaN) and scales once, eagerly, before any capture.
"""

from __future__ import annotations


import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.kernels.gemm_common import check_once
from latency_specialized.kernels.gemm_small_m import MmaConfig, quantized_config, run_quantized_mma
from latency_specialized.kernels.mma_quant_weights import QuantCoding
from latency_specialized.quant.checkpoint_io import QuantizedWeight

NAME = "gemm.fp8_w8a16_mma"
FORMATS = ("fp8-block-128", "fp8-block-32")
MAX_M = 64
MAX_CLUSTER = 8
MIN_UE8M0, MAX_UE8M0 = 10, 134
"""ue8m0 bytes decoded exactly: the decode multiplies by the bf16 2^(e - 7), a finite bf16 up to e = 134; below 10
the products leave the normal range (as the Triton kernel's ``MIN_UE8M0``)."""
E4M3_NAN = (0x7F, 0xFF)

def default_config(n: int, k: int, m: int) -> MmaConfig:
    """Measured launch config (``TUNING``) where one exists, else ``gemm_small_m.quantized_config`` over 64-wide
    chunks."""
    return TUNING.get((n, k, m)) or quantized_config(n, k // 64, m)


TUNING: dict[tuple[int, int, int], MmaConfig] = {
    # H200, session 33 (benchmarks/results/h200/session33/ops_gemm_fp8.md: the best of the heuristic + MMA_SWEEP)
    (6144, 2048, 16): MmaConfig(nt=2, mt=1, wk=4, sk=1, cb=8),      # GLM-5.3 TP8 q_b + wq_b: 6.30 us (w8 c4 7.29)
    (32768, 1280, 1): MmaConfig(nt=1, mt=1, wk=4, sk=1, cb=4),      # DeepSeek-V4.1 TP1 wq_b: 15.17 (w1 15.72)
    (32768, 1280, 4): MmaConfig(nt=1, mt=1, wk=1, sk=1, cb=4),      # 15.88 (w4 16.10)
    (32768, 1280, 16): MmaConfig(nt=2, mt=1, wk=1, sk=1, cb=4),     # 17.98 (w8 18.21)
    (32768, 1280, 64): MmaConfig(nt=8, mt=2, wk=2, sk=1, cb=2),     # 29.81 (w4 c4 35.23)
}
"""(N, K, M) -> the launch config measured fastest on the H200; the heuristic elsewhere. The heuristic reproduces the
measured best at GLM-5.3 TP8 q_b M = 1 / 4 (8 warps along K: 5.51 / 5.41 us against 6.73 / 6.68 with the bf16 rule's 4),
TP4 o_proj M = 1 / 4 / 16 (9.36 / 9.48 / 10.86 against 13.24 / 13.48 / 15.57) and both at M = 64 (4 warps, no
cluster, 4 chunks: 28.66 / 15.99 against 34.58 / 20.06)."""


def fp8_parts(w: QuantizedWeight, what: str, stacked: bool = False) -> tuple[torch.Tensor, torch.Tensor, QuantCoding]:
    """(codes [N, K] uint8, scales [N / rows, K / cols] fp32 or uint8, scale layout) of a block-FP8 weight -
    ``stacked``: of experts, [E, N, K] and [E, N / rows, K / cols]; its codes and ue8m0 scales are checked once per
    weight (eagerly: call once before a graph capture)."""
    from latency_specialized.quant.codecs import as_bytes

    if not isinstance(w, QuantizedWeight):
        raise UserError(f"{what}: takes a QuantizedWeight in {' / '.join(FORMATS)} (got {type(w).__name__}); bf16 "
                        "weights go to the bf16 gemms (the site's weight_format attribute must be unset)")
    if w.fmt.name.split("/")[0] not in FORMATS or w.weight.dim() != 2 + stacked:
        raise UserError(f"{what}: expected {'experts [E, N, K]' if stacked else 'one [N, K] matrix'} in block FP8 "
                        f"({', '.join(FORMATS)}), got {w.fmt.name} codes {tuple(w.weight.shape)}")
    q = as_bytes(w.weight)
    ue8m0 = w.fmt.scale == "ue8m0"
    s = (as_bytes(w.scale) if ue8m0 else w.scale.float()).contiguous()

    def check() -> None:
        nan = int(((q == E4M3_NAN[0]) | (q == E4M3_NAN[1])).sum())
        if nan:
            raise UserError(f"{what} ({w.name}): {nan} e4m3 NaN codes in the weight: requantize the checkpoint")
        if ue8m0:
            lo, hi = int(s.min()), int(s.max())
            if lo < MIN_UE8M0 or hi > MAX_UE8M0:
                raise UserError(f"{what} ({w.name}): ue8m0 scale bytes span {lo}..{hi}; this kernel decodes "
                                f"{MIN_UE8M0}..{MAX_UE8M0} exactly: use gemm.fp8_w8a16_triton (10..246) or "
                                "gemm.reference")

    check_once(w.weight, (NAME, s.data_ptr()), check)
    return q, s, QuantCoding(ue8m0=ue8m0, block=tuple(w.fmt.block))


def gemm_fp8_mma(x: torch.Tensor, weight: QuantizedWeight, *, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 config: MmaConfig | None = None) -> torch.Tensor:
    """y = x @ deq(weight)^T (+ residual) (contract: ``ops.gemm.gemm_reference``), weights e4m3 -> bf16 in registers.

    Parameters
    ----------
    x : [M, K] bf16, M <= 64, K % 64 == 0 (rows contiguous).
    weight : QuantizedWeight [N, K] in fp8-block-128 / fp8-block-32 (or their /rows forms).
    residual : optional [M, N] bf16 added before the single rounding.
    out : optional [M, N] destination (unit column stride; bf16, or fp32 with ``out_dtype=torch.float32``).
    config : kernel choices; default: :func:`default_config`.
    """
    q, s, coding = fp8_parts(weight, NAME)
    if x.dim() != 2 or x.shape[-1] % 64:
        raise UserError(f"{NAME}: x must be [M, K] with K % 64 == 0 (got {tuple(x.shape)}): use gemm.fp8_w8a16_triton")
    config = config or default_config(q.shape[0], x.shape[-1], x.shape[0])
    return run_quantized_mma(NAME, x, q, s, coding, residual, out, out_dtype, config, MAX_M, MAX_CLUSTER)


def _supports(ctx: OpContext) -> Support:
    from latency_specialized.kernels.compile_cache import cute_available
    from latency_specialized.kernels.triton_common import arch_number

    if (arch_number(ctx.arch) or 0) != 90:
        return f"a CuTe DSL kernel verified on sm_90 (H200) only (bf16x2 multiplies of sm_90), not {ctx.arch}"
    fmt = ctx.attr("weight_format")
    if fmt not in FORMATS:
        return f"weights {fmt or 'bf16'}: reads block-FP8 weights ({', '.join(FORMATS)})"
    if ctx.dtype != "bfloat16":
        return f"dtype {ctx.dtype} (bf16 activations only)"
    if ctx.tokens > MAX_M:
        return f"serves M<={MAX_M} (M={ctx.tokens})"
    if ctx.dim("K") % 64:
        return f"needs K % 64 == 0 (K={ctx.dim('K')}): gemm.fp8_w8a16_triton serves"
    if ctx.attr("out_dtype") not in (None, "bfloat16", "float32") or (ctx.attr("out_dtype") == "float32"
                                                                     and ctx.attr("residual")):
        return f"writes bf16, or fp32 without a residual (out_dtype={ctx.attr('out_dtype')})"
    return cute_available()


IMPLEMENTATIONS = [
    Implementation("gemm", NAME, gemm_fp8_mma, _supports, priority=30, strided_out=True,
                   description="block-FP8 weights (fp8-block-128 / -32) decoded to bf16 in registers straight from "
                               "16-byte loads, mma.sync m16n8k16, K split over warps and a cluster, M<=64"),
]

__all__ = ["FORMATS", "IMPLEMENTATIONS", "MAX_M", "NAME", "default_config", "fp8_parts", "gemm_fp8_mma"]
