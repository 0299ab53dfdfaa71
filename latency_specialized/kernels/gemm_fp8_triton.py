"""Decode gemms over block-scaled FP8 weights kept as the checkpoint stores them (``gemm``, Triton).

The weight arrives as a :class:`latency_specialized.quant.QuantizedWeight` ``[N, K]`` in ``fp8-block-128`` (e4m3,
fp32 scale per 128 x 128: GLM-5.3, DeepSeek-V3) or ``fp8-block-32`` (e4m3, ue8m0 per 32 x 32: DeepSeek-V4.1-Flash
dense weights); the site says so with the attribute ``weight_format`` (the bf16 gemms refuse such sites, the
reference dequantises). Two implementations of one kernel (``kernels/triton_fp8.py``):

* ``gemm.fp8_w8a16_triton``: weights become bf16 in registers (exact), bf16 activations - the reference's numerics.
* ``gemm.fp8_w8a8_triton``: activations quantized to e4m3 per (token, scale-block slice of K) inside the kernel,
  e4m3 x e4m3 on the FP8 tensor cores - no per-weight conversion, one more rounding (the activations').

Which one wins at which M is the H200's to say (``benchmarks/scripts/fp8_gemm_bench.py``); until a measured
table exists W8A16 has the higher priority (it adds no rounding) and W8A8 serves where a plan asks for it by name.
Static shapes, no host sync after a weight's first call (which checks its ue8m0 scales once, eagerly, before any
capture), graph capturable (the split-K tickets reset themselves).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.kernels.gemm_common import check_once
from latency_specialized.kernels.triton_common import quantized_weight_refusal
from latency_specialized.quant.checkpoint_io import QuantizedWeight

NAME_A16 = "gemm.fp8_w8a16_triton"
NAME_A8 = "gemm.fp8_w8a8_triton"
NAME_A16_NORM = "gemm.fp8_w8a16_norm_triton"
NORM_MAX_M = 0
"""Rows up to which the RMSNorm-prologue variant serves a gemm behind a norm site (0: never). H200, session 32
(``ops_gemm_fp8``, best launch config each): the prologue - every program re-reducing the whole rows - costs more
than the separate norm kernel it saves: GLM-5.3 TP8 q_b + wq_b 19.75 vs 12.92 us (norm + W8A16) at M = 1,
DeepSeek-V4.1-Flash TP8 wq_b 16.45 vs 13.60; so it is off until a prologue that reduces each row once is built."""
FORMATS = ("fp8-block-128", "fp8-block-32")
"""``weight_format`` values served."""
MAX_M = 64
"""Rows per call served (decode: batch x (1 + spec tokens) up to 64)."""
SMS_H200 = 132


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Launch choices: N rows per program, programs per N tile along K, K per step (None: the scale block's),
    warps, pipeline stages."""

    block_n: int = 128
    split_k: int = 1
    block_k: int | None = None
    num_warps: int = 4
    num_stages: int = 4

    def label(self) -> str:
        return f"n{self.block_n}-sk{self.split_k}-k{self.block_k or 'S'}-w{self.num_warps}-s{self.num_stages}"


def default_config(n: int, k: int, m: int, block_k: int, sms: int = SMS_H200) -> Fp8GemmConfig:
    """Heuristic where no measured table entry exists (``block_k``: the K step the kernel will take): 128-row
    tiles where N alone fills half the SMs, else 64; K split until about two programs per SM are in flight, each
    split keeping at least 4 K steps (fewer and the pipeline never fills, while the fp32 partials - split x M x N
    x 8 bytes of traffic - grow). Above 16 rows 8 warps: with 4, the 128 x 64 fp32 accumulator beside a 128 x 128
    weight tile takes all 255 registers and spills (sm_90 cubin, ``cuobjdump --dump-resource-usage``: W8A16 at
    M = 64 255 registers + 64-88 bytes of stack; 8 warps 172 / 85, no stack)."""
    block_n = 128 if n >= 128 * sms // 2 or m > 16 else 64
    tiles = -(-n // block_n)
    steps = -(-k // block_k)
    split = max(1, min(-(-2 * sms // tiles), steps // 4))
    return Fp8GemmConfig(block_n=block_n, split_k=split, block_k=block_k, num_warps=8 if m > 16 else 4)


TUNING: dict[tuple[str, int, int, int], Fp8GemmConfig] = {
    # H200, session 32 (benchmarks/results/h200/session32/ops_gemm_fp8_sweep.md: the sweep's best of 17 configs)
    (NAME_A16, 6144, 2048, 1): Fp8GemmConfig(block_n=64, split_k=4, num_stages=3),     # GLM-5.3 TP8 q_b + wq_b
    (NAME_A16, 6144, 2048, 64): Fp8GemmConfig(block_n=64, split_k=1, num_stages=3),
    (NAME_A8, 6144, 2048, 1): Fp8GemmConfig(block_n=128, split_k=8, num_stages=4),
    (NAME_A8, 6144, 2048, 64): Fp8GemmConfig(block_n=128, split_k=4, num_stages=3),
    (NAME_A16, 4096, 1280, 1): Fp8GemmConfig(block_n=128, split_k=8, num_stages=3),    # DeepSeek-V4.1 TP8 wq_b
    (NAME_A16, 4096, 1280, 64): Fp8GemmConfig(block_n=64, split_k=4, num_stages=3),
    (NAME_A8, 4096, 1280, 1): Fp8GemmConfig(block_n=128, split_k=8, num_stages=3),
    (NAME_A8, 4096, 1280, 64): Fp8GemmConfig(block_n=64, split_k=8, num_stages=3),
}
"""(implementation, N, K, M) -> config measured best on the H200 (the bench's sweep: ``ops_bench_fp8.SWEEP``); the
heuristic elsewhere. The DeepSeek rows step 32 wide (the scale block: ``block_k`` None) - faster there than the
128-wide steps with the power-of-two scales folded into the tile (8.5 vs 12.3 us at M = 1)."""

def _kernel_parts(w: QuantizedWeight, what: str) -> tuple[torch.Tensor, torch.Tensor, int, tuple[int, int]]:
    """(codes [N, K], scales [N/r, K/c] fp32 or uint8, scale kind, scale block) of a block-FP8 weight, its ue8m0
    scales range-checked once per weight."""
    from latency_specialized.kernels import triton_fp8 as k
    from latency_specialized.quant.codecs import as_bytes

    if not isinstance(w, QuantizedWeight):
        raise UserError(f"{what}: takes a QuantizedWeight in {' / '.join(FORMATS)} (got {type(w).__name__}); bf16 "
                        "weights go to the bf16 gemms (the site's weight_format attribute must be unset)")
    if w.fmt.name.split("/")[0] not in FORMATS:  # "<fmt>/rows": one scale per row (quant.layout.cat)
        raise UserError(f"{what}: format {w.fmt.name} is not a block-FP8 format ({', '.join(FORMATS)})")
    if w.weight.dim() != 2:
        raise UserError(f"{what}: expected one [N, K] matrix, got codes {tuple(w.weight.shape)}")
    q = as_bytes(w.weight)
    if w.fmt.scale == "ue8m0":
        s, kind = as_bytes(w.scale), k.SCALE_UE8M0

        def check() -> None:
            lo, hi = int(s.min()), int(s.max())
            if lo < k.MIN_UE8M0 or hi > k.MAX_UE8M0:
                raise UserError(f"{what} ({w.name}): ue8m0 scale bytes span {lo}..{hi}; the kernel decodes "
                                f"{k.MIN_UE8M0}..{k.MAX_UE8M0} exactly (2^-117..2^119): use gemm.reference or "
                                "requantize the checkpoint")

        check_once(w.weight, ("triton-fp8", s.data_ptr()), check)
    else:
        s, kind = w.scale if w.scale.dtype == torch.float32 else w.scale.float(), k.SCALE_FP32
    return q, s.contiguous(), kind, tuple(w.fmt.block)  # type: ignore[return-value]


def _gemm(x: torch.Tensor, weight: QuantizedWeight, residual: torch.Tensor | None, out: torch.Tensor | None,
          out_dtype: torch.dtype | None, config: Fp8GemmConfig | None, a8: bool, what: str,
          norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6) -> torch.Tensor:
    from latency_specialized.kernels import triton_fp8 as k

    q, s, kind, block = _kernel_parts(weight, what)
    M, K = x.shape
    N = q.shape[0]
    if q.shape[1] != K:
        raise UserError(f"{what}: x {tuple(x.shape)} does not match the weight [{N}, {q.shape[1]}] ({weight.name})")
    if M > MAX_M:
        raise UserError(f"{what} serves M<={MAX_M} (got M={M}): use gemm.reference")
    dtype = out_dtype or x.dtype
    y = out if out is not None else torch.empty(M, N, device=x.device, dtype=dtype)
    if tuple(y.shape) != (M, N) or y.stride(-1) != 1 or y.dtype != dtype:
        raise UserError(f"{what}: out {tuple(y.shape)} {y.dtype} must be [{M}, {N}] {dtype} with unit column stride")
    if residual is not None and (tuple(residual.shape) != (M, N) or residual.stride(-1) != 1):
        raise UserError(f"{what}: residual {tuple(residual.shape)} must be [{M}, {N}] with unit column stride")
    if x.stride(-1) != 1:
        x = x.contiguous()
    # W8A16 with power-of-two scales folds them into the tile, so it may step 128 wide over 32-wide blocks
    step = 128 if (kind == k.SCALE_UE8M0 and not a8 and K >= 128 and 128 % block[1] == 0) else block[1]
    cfg = config or TUNING.get((what, N, K, M)) or default_config(N, K, M, step)
    if norm_weight is not None and x.dtype != torch.bfloat16:
        raise UserError(f"{what}: the norm prologue rounds to bf16 activations (got {x.dtype}): use gemm.reference")
    if norm_weight is not None and (norm_weight.shape != (K,) or norm_weight.stride(-1) != 1):
        raise UserError(f"{what}: norm_weight {tuple(norm_weight.shape)} must be a contiguous [{K}] gain")
    k.fp8_block_gemm(x, q, s, y, scale_kind=kind, scale_block=block, a8=a8, residual=residual,
                     norm_weight=norm_weight, norm_eps=norm_eps,
                     block_n=cfg.block_n, block_k=cfg.block_k, split_k=cfg.split_k, num_warps=cfg.num_warps,
                     num_stages=cfg.num_stages)
    return y


def gemm_fp8_w8a16(x: torch.Tensor, weight: QuantizedWeight, *, residual: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                   config: Fp8GemmConfig | None = None, norm_weight: torch.Tensor | None = None,
                   norm_eps: float = 1e-6) -> torch.Tensor:
    """y = x @ deq(weight)^T (+ residual) (contract: ``ops.gemm.gemm_reference``), weights e4m3 -> bf16 in registers.

    x [M, K] bf16, M <= 64 (rows may be strided); weight: QuantizedWeight [N, K] in fp8-block-128 / fp8-block-32;
    residual / out [M, N] (unit column stride, rows may be strided); norm_weight [K]: x RMS-normalised first (the
    norm prologue of ``gemm.fp8_w8a16_norm_triton``). Returns [M, N] in ``out_dtype`` (bf16 default, fp32 allowed)."""
    return _gemm(x, weight, residual, out, out_dtype, config, False, NAME_A16, norm_weight, norm_eps)


def gemm_fp8_w8a8(x: torch.Tensor, weight: QuantizedWeight, *, residual: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                  config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """As :func:`gemm_fp8_w8a16`, with the activations quantized to e4m3 per (token, scale-block slice of K)
    in the kernel and the products on the FP8 tensor cores (``triton_fp8.quantize_activations_reference`` is
    that rounding in torch)."""
    return _gemm(x, weight, residual, out, out_dtype, config, True, NAME_A8)


def _supports(ctx: OpContext, min_sm: int) -> Support:
    why = quantized_weight_refusal(ctx, "this gemm", FORMATS, "block-FP8", min_sm=min_sm)
    if why:
        return why
    if ctx.tokens > MAX_M:
        return f"serves M<={MAX_M} (M={ctx.tokens})"
    if ctx.attr("out_dtype") not in (None, "bfloat16", "float32"):
        return f"writes bf16 or fp32 (out_dtype={ctx.attr('out_dtype')})"
    return True


def _supports_a16(ctx: OpContext) -> Support:
    return _supports(ctx, 89)


def _supports_a8(ctx: OpContext) -> Support:
    return _supports(ctx, 89)  # e4m3 tensor cores: sm_89 (Ada) and sm_90


def _supports_norm(ctx: OpContext) -> Support:
    if not ctx.attr("norm_site"):
        return "serves gemms behind a norm site only (attr norm_site): gemm.fp8_w8a16_triton serves the others"
    if ctx.tokens > NORM_MAX_M:
        return (f"norm prologue up to M={NORM_MAX_M} (M={ctx.tokens}; slower than the norm kernel + the gemm on the "
                "H200, NORM_MAX_M): the norm site and gemm.fp8_w8a16_triton serve")
    return _supports(ctx, 89)


IMPLEMENTATIONS = [
    Implementation("gemm", NAME_A16, gemm_fp8_w8a16, _supports_a16, priority=20, strided_out=True,
                   description="block-FP8 weights (fp8-block-128 / -32) -> bf16 in registers, bf16 tensor cores, "
                               "split-K reduced by the last program (one launch)"),
    Implementation("gemm", NAME_A16_NORM, gemm_fp8_w8a16, _supports_norm, priority=25, strided_out=True,
                   strided_rows=True, norm_prologue=True,
                   description="gemm.fp8_w8a16_triton with the RMSNorm in front of it in its prologue (a few tokens: "
                               "the norm site is skipped)"),
    Implementation("gemm", NAME_A8, gemm_fp8_w8a8, _supports_a8, priority=10, strided_out=True,
                   description="block-FP8 weights x activations quantized to e4m3 per (token, block) in the "
                               "kernel, FP8 tensor cores, split-K reduced by the last program (one launch)"),
]

__all__ = ["Fp8GemmConfig", "FORMATS", "IMPLEMENTATIONS", "MAX_M", "NAME_A16", "NAME_A16_NORM", "NAME_A8", "NORM_MAX_M",
           "TUNING", "default_config",
           "gemm_fp8_w8a16", "gemm_fp8_w8a8"]
