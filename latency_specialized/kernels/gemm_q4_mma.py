"""MXFP4 weights on the mma.sync kernel (``gemm_small_m.py`` with ``QuantCoding(element="e2m1")``): the building
block of the quantized routed experts (``moe_experts_mma.py``, which take its coding and weight checks; issue 24,
``NOTES_q4.md``). Not registered in the gemm family: no model has a dense MXFP4 projection; the matrix form is
tested (and timed, ``benchmarks/scripts/q4_mma_bench.py``) on its own.

A lane's 16-byte load of a row holds 32 e2m1 values (one MXFP4 scale block: one ue8m0 byte per row and chunk); each
32-bit word decodes to four bf16x2 pairs (values n, n + 4) by shifts and masks (``ptx.e2m1x8_to_bf16x2``), the
activations are paired to match, 8 ``m16n8k16`` MMAs per 128-wide chunk and row pair. Exact for every code with
scale bytes 2..128 (2^(e - 1) is the bf16 multiplier; smaller products leave bf16's normal range).
"""

from __future__ import annotations

import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels.gemm_common import check_once
from latency_specialized.kernels.gemm_small_m import MmaConfig, quantized_config, run_quantized_mma
from latency_specialized.kernels.mma_quant_weights import QuantCoding
from latency_specialized.quant.checkpoint_io import QuantizedWeight

NAME = "gemm.mxfp4_w4a16_mma"
FORMATS = ("mxfp4", "mxfp4-deepseek")
MIN_UE8M0, MAX_UE8M0 = 2, 128
"""ue8m0 bytes decoded exactly: the bf16 multiplier 2^(e - 1) is finite up to e = 128, and the smallest product
(0.5 x 2^(e - 127)) stays a normal bf16 from e = 2."""
MAX_M = 64
CODING = QuantCoding(ue8m0=True, block=(1, 32), element="e2m1")

def mxfp4_parts(w: QuantizedWeight, what: str = NAME, stacked: bool = False,
                paired: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes [N, K/2] uint8, scales [N, K/32] uint8) of an MXFP4 matrix - ``stacked``: of experts, [E, N, K/2]
    and [E, N, K/32]; its scale bytes are range-checked once per weight (eagerly: call once before a graph
    capture). ``paired``: the codes in the paired layout (``<fmt>/pairs``, ``quant.layout.paired_nibbles``), which
    a caller decoding the checkpoint packing never takes."""
    from latency_specialized.quant.codecs import as_bytes

    names = tuple(f + "/pairs" for f in FORMATS) if paired else FORMATS
    if not isinstance(w, QuantizedWeight) or w.fmt.name not in names or w.weight.dim() != 2 + stacked:
        shape = "[E, N, K]" if stacked else "[N, K]"
        raise UserError(f"{what}: takes one {shape} QuantizedWeight in {' / '.join(names)} (got "
                        f"{getattr(getattr(w, 'fmt', None), 'name', type(w).__name__)})")
    q, s = as_bytes(w.weight), as_bytes(w.scale)

    def check() -> None:
        lo, hi = int(s.min()), int(s.max())
        if lo < MIN_UE8M0 or hi > MAX_UE8M0:
            raise UserError(f"{what} ({w.name}): ue8m0 scale bytes span {lo}..{hi}; this kernel decodes "
                            f"{MIN_UE8M0}..{MAX_UE8M0} exactly: use the reference or requantize the checkpoint")

    check_once(w.weight, (NAME, s.data_ptr()), check)
    return q.contiguous(), s.contiguous()


def default_config(n: int, k: int, m: int) -> MmaConfig:
    """``gemm_small_m.quantized_config`` over 128-wide chunks (no measured table yet: the FP8 kernel's ``TUNING`` is
    for its own shapes)."""
    return quantized_config(n, k // CODING.chunk, m)


def gemm_mxfp4_mma(x: torch.Tensor, weight: QuantizedWeight, *, residual: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                   config: MmaConfig | None = None) -> torch.Tensor:
    """y = x @ deq(weight)^T (+ residual) (contract: ``ops.gemm.gemm_reference``), MXFP4 decoded to bf16 in registers.

    Parameters
    ----------
    x : [M, K] bf16, M <= 64, K % 128 == 0 (rows contiguous).
    weight : QuantizedWeight [N, K] in mxfp4 / mxfp4-deepseek (codes [N, K/2], ue8m0 scales [N, K/32]).
    residual : optional [M, N] bf16 added before the single rounding.
    out : optional [M, N] destination (unit column stride; bf16, or fp32 with ``out_dtype=torch.float32``).
    config : kernel choices; default: :func:`default_config`.
    """
    q, s = mxfp4_parts(weight)
    if x.dim() != 2 or x.shape[-1] % CODING.chunk:
        raise UserError(f"{NAME}: x must be [M, K] with K % {CODING.chunk} == 0 (got {tuple(x.shape)})")
    config = config or default_config(q.shape[0], x.shape[-1], x.shape[0])
    return run_quantized_mma(NAME, x, q, s, CODING, residual, out, out_dtype, config, MAX_M)


__all__ = ["CODING", "FORMATS", "MAX_M", "NAME", "default_config", "gemm_mxfp4_mma", "mxfp4_parts"]
