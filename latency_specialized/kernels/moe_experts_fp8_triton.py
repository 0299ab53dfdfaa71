"""Routed experts over block-FP8 weights kept as the checkpoint stores them (``moe.experts``, Triton).

The expert weights arrive as :class:`latency_specialized.quant.QuantizedWeight` (``w_gate_up``: logical
``[E, 2I, K]``, ``w_down``: ``[E, N, I]``) in ``fp8-block-128`` (e4m3 codes, one fp32 scale per 128 x 128 block:
GLM-5.3's routed experts); the site says so with ``weight_format`` (the bf16 and 4-bit implementations refuse such
sites, the reference dequantises). Stock's fused-MoE shape for every token count (sort/align by expert, gate/up GEMM,
activation, down GEMM x routing weight, sum; ``kernels/triton_moe.py``), each 128-wide K block's partial scaled by
its rows' block scale (``kernels/triton_fp8.py``), in two ways: ``moe.experts.fp8_triton`` converts the weight tiles
e4m3 -> bf16 in registers (exact; the reference's numerics), ``moe.experts.fp8_w8a8_triton`` quantizes the
activation rows to e4m3 per K block in the GEMMs and multiplies on the FP8 tensor cores (stock's numerics; no
per-weight conversion). Which wins is the H200's to say; W8A16 has the higher priority until then. Static shapes,
no host sync, graph capturable.
"""

from __future__ import annotations

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.kernels.moe_addend import Addend, check_addend_use
from latency_specialized.kernels.triton_common import quantized_experts_refusal
from latency_specialized.quant.checkpoint_io import QuantizedWeight
from latency_specialized.spec import ActivationSpec

NAME = "moe.experts.fp8_triton"
NAME_A8 = "moe.experts.fp8_w8a8_triton"
FORMATS = ("fp8-block-128",)
"""``weight_format`` values served."""
ENABLED = True
"""False: both implementations refuse every site (an A/B switch: ``bench --ab mma:latency_specialized.kernels.
moe_experts_fp8_triton.ENABLED=False`` runs GLM-5.3's FP8 experts on ``moe.experts.mma_fp8``, registered below these
until timed)."""
TUNING = dict(block_n=64, num_warps=4, num_stages=3)
"""Launch constants of the two GEMMs (not yet swept on the H200: the values of the bf16 fused MoE's smallest tiles)."""


def _parts(w: QuantizedWeight, what: str) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    if not isinstance(w, QuantizedWeight):
        raise UserError(f"{what}: the FP8 experts take a QuantizedWeight (got {type(w).__name__}); bf16 weights go to "
                        "the bf16 implementations (the site's weight_format attribute must be unset)")
    if w.fmt.name.split("/")[0] not in FORMATS or w.weight.dim() != 3:  # "/rows": one scale per row (layout.cat)
        raise UserError(f"{what}: expected experts stacked [E, N, K] in {' / '.join(FORMATS)}, got {w.fmt.name} "
                        f"{tuple(w.weight.shape)}")
    s = w.scale if w.scale.dtype == torch.float32 else w.scale.float()
    return w.weight, s.contiguous(), tuple(w.fmt.block)  # type: ignore[return-value]


def experts_fp8(x: torch.Tensor, weights: torch.Tensor | None, ids: torch.Tensor, w_gate_up: QuantizedWeight,
                w_down: QuantizedWeight, activation: ActivationSpec, *, per_route: bool = False,
                out: torch.Tensor | None = None, addend: Addend = None) -> torch.Tensor:
    """Routed experts (contract: ``ops.moe.experts_reference``) over block-FP8 weights on the tensor cores.

    x [M, K] bf16; weights [M, top_k] fp32 (ignored with ``per_route``); ids [M, top_k] int; w_gate_up:
    QuantizedWeight [E, 2I, K]; w_down: [E, N, I]; out [M, N] ([M, top_k, N] with ``per_route``). Rounding as
    stock's fused MoE: gate/up, activation and each route's down output to bf16, the weighted rows summed in fp32.
    addend: added by the sum kernel (``kernels/moe_addend.py``)."""
    return _experts(x, weights, ids, w_gate_up, w_down, activation, per_route, out, False, NAME, addend)


def experts_fp8_w8a8(x: torch.Tensor, weights: torch.Tensor | None, ids: torch.Tensor, w_gate_up: QuantizedWeight,
                     w_down: QuantizedWeight, activation: ActivationSpec, *, per_route: bool = False,
                     out: torch.Tensor | None = None, addend: Addend = None) -> torch.Tensor:
    """As :func:`experts_fp8`, with the activation rows (the tokens for gate/up, the pairs' activations for down)
    quantized to e4m3 per 128-wide K block in the GEMMs and multiplied on the FP8 tensor cores (stock's W8A8
    block-FP8 MoE numerics; ``triton_fp8.quantize_activations_reference`` is that rounding in torch)."""
    return _experts(x, weights, ids, w_gate_up, w_down, activation, per_route, out, True, NAME_A8, addend)


def _experts(x, weights, ids, w_gate_up, w_down, activation, per_route, out, a8: bool, what: str,
             addend: Addend) -> torch.Tensor:
    from latency_specialized.kernels import triton_fp8 as k
    from latency_specialized.kernels import triton_moe as moe_k
    from latency_specialized.kernels.moe_experts_triton import align_buffers, route_rows, sum_routes

    check_addend_use(addend, per_route, what)
    q13, s13, b13 = _parts(w_gate_up, what)
    q2, s2, b2 = _parts(w_down, what)
    M, K = x.shape
    E, two_i, k13 = q13.shape
    I, N, top_k = two_i // 2, q2.shape[1], ids.shape[1]
    if k13 != K or tuple(q2.shape) != (E, N, I):
        raise UserError(f"{what}: x{tuple(x.shape)} w_gate_up{tuple(q13.shape)} w_down{tuple(q2.shape)} do not match "
                        "[M, K], [E, 2I, K], [E, N, I]")
    if activation.kind not in ("swiglu", "situ_glu"):
        raise UserError(f"{what}: activation {activation.kind} (SwiGLU or SiTU-GLU only): use moe.experts.reference")
    x, T = x.contiguous(), M * top_k
    align = align_buffers(T, E, x.device)
    moe_k.moe_align(ids.contiguous(), align)
    gu = torch.empty(T, two_i, device=x.device, dtype=x.dtype)
    k.moe_gemm_fp8(x, q13, s13, align, top_k, out=gu, a_per_pair=False, scale_block=b13, a8=a8, **TUNING)
    h = torch.empty(T, I, device=x.device, dtype=x.dtype)
    if activation.kind == "swiglu":
        moe_k.silu_and_mul(gu, activation.clamp, out=h)
    else:
        moe_k.situ_and_mul(gu, activation.beta, activation.beta_lin, out=h)
    shape = (M, top_k, N) if per_route else (M, N)
    if out is not None and (tuple(out.shape) != shape or out.stride(-1) != 1):
        raise UserError(f"{what}: out {tuple(out.shape)} must be {list(shape)} with unit stride in N")
    if per_route:
        y = out if out is not None else torch.empty(shape, device=x.device, dtype=x.dtype)
        yp, direct = route_rows(y)
        k.moe_gemm_fp8(h, q2, s2, align, top_k, out=yp, a_per_pair=True, scale_block=b2, a8=a8, **TUNING)
        if not direct:
            y.copy_(yp.view(M, top_k, N))
        return y
    yp = torch.empty(T, N, device=x.device, dtype=x.dtype)
    w_flat = weights.reshape(-1)
    k.moe_gemm_fp8(h, q2, s2, align, top_k, out=yp, a_per_pair=True, scale_block=b2, a8=a8,
                   topk_weights=(w_flat if w_flat.dtype == torch.float32 else w_flat.float()).contiguous(), **TUNING)
    return sum_routes(yp, top_k, out, addend, x.dtype, what)


def _supports(ctx: OpContext) -> Support:
    if not ENABLED:
        return f"{NAME}: switched off (moe_experts_fp8_triton.ENABLED = False)"
    return quantized_experts_refusal(ctx, NAME, FORMATS, "block-FP8", min_sm=89) or True


def _supports_a8(ctx: OpContext) -> Support:
    if not ENABLED:
        return f"{NAME_A8}: switched off (moe_experts_fp8_triton.ENABLED = False)"
    return quantized_experts_refusal(ctx, NAME_A8, FORMATS, "block-FP8", min_sm=89) or True


IMPLEMENTATIONS = [
    Implementation("moe.experts", NAME, experts_fp8, _supports, priority=20,
                   description="block-FP8 experts: stock's fused-MoE shape with e4m3 weight tiles converted to bf16 "
                               "in registers, partials scaled per 128x128 block (align, gate/up, act, down x w, sum)"),
    Implementation("moe.experts", NAME_A8, experts_fp8_w8a8, _supports_a8, priority=10,
                   description="block-FP8 experts, W8A8: activation rows quantized to e4m3 per 128 in the GEMMs, "
                               "FP8 tensor cores (stock's block-FP8 MoE numerics)"),
]

__all__ = ["experts_fp8", "experts_fp8_w8a8", "IMPLEMENTATIONS", "NAME", "NAME_A8", "FORMATS", "TUNING"]
