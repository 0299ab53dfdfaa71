"""Routed experts over 4-bit weights kept as the checkpoint stores them (``moe.experts``, Triton).

The expert weights arrive as :class:`latency_specialized.quant.QuantizedWeight` (``w_gate_up``: logical
``[E, 2I, K]``, ``w_down``: ``[E, N, I]``) in MXFP4 (Kimi K3, DeepSeek-V4.1 routed experts) or NVFP4 (Muse
Spark); the site says so with the attribute ``weight_format`` (the bf16 implementations refuse such sites,
the reference dequantises). Two implementations, picked by tokens per step (``MIN_TOKENS_GROUPED``):

* ``moe.experts.q4_gemv_triton``: every route's expert read once, on CUDA cores, three kernels (gate/up +
  activation; down per route; routing weight + sum over the routes).
* ``moe.experts.q4_grouped_triton``: stock's fused-MoE shape (align by expert, gate/up GEMM, activation,
  down GEMM x routing weight, sum) with the weight tiles dequantised to bf16 in registers for the tensor
  cores: an expert chosen by several tokens is dequantised once per 16 of its pairs.

Kernels and numerics: ``kernels/triton_q4.py``. Static shapes, no host sync after the first call of a weight
(which checks its scales once, eagerly, before any capture), graph capturable.
"""

from __future__ import annotations

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.kernels.gemm_common import check_once
from latency_specialized.kernels.moe_addend import Addend, add_addend, check_addend_use
from latency_specialized.kernels.triton_common import quantized_experts_refusal
from latency_specialized.quant.checkpoint_io import QuantizedWeight
from latency_specialized.quant.codecs import as_bytes
from latency_specialized.spec import ActivationSpec

NAME_GEMV = "moe.experts.q4_gemv_triton"
NAME_GROUPED = "moe.experts.q4_grouped_triton"
FORMATS = ("mxfp4", "mxfp4-deepseek", "nvfp4", "mxfp4/pairs", "mxfp4-deepseek/pairs", "nvfp4/pairs")
"""``weight_format`` values served: the e2m1 formats as checkpoints pack them, or in the paired layout
(``quant.layout.paired_nibbles``, the mma kernel's faster decode) so one rearranged copy serves every bucket."""
MIN_TOKENS_GROUPED = 8
"""Tokens per step from which the grouped tensor-core path serves (below: the gemv path)."""
ENABLED = True
"""False: both implementations refuse every site (an A/B switch). ``moe.experts.mma`` outranks them where it serves
(up to 64 tokens, K and I multiples of 128); ``moe_experts_mma.ENABLED=False`` hands those sites back to these."""
GROUPED_BLOCK_K = 128
"""K step of the grouped GEMMs: K and I must be multiples of it."""
GEMV_TUNING: dict = {"gate_up": dict(block_i=4, block_w=128, num_warps=4),
                     "down": dict(block_n=32, block_w=None, num_warps=4)}
"""Launch constants of the gemv kernels (module-level so a sweep can set them; block_w None: whole rows). H200,
Kimi K3 TP8 MXFP4 (benchmarks/results/h200/ops_moe_experts_q4_mxfp4_tp8.md): gate/up 4 rows x 128 words and
down 32 rows were the best of the swept ones, each alone."""
GROUPED_TUNING = dict(block_n=128, num_warps=8, num_stages=4)
"""Launch constants of the grouped GEMMs (the best of the swept ones at 4-64 tokens, same results file)."""

def _kernel_parts(w: QuantizedWeight, what: str, max_ue8m0: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                         int, int]:
    """(codes uint8 [E, N, K/2], scales [E, N, K/group], global fp32 [E] or a dummy, scale kind, group; the
    packing of the codes is ``w.fmt.packing``, see :func:`_packing`);
    ``max_ue8m0``: the largest ue8m0 byte the calling kernels decode exactly (checked once per weight)."""
    from latency_specialized.kernels import triton_q4 as k

    if not isinstance(w, QuantizedWeight):
        raise UserError(f"{what}: the 4-bit experts take a QuantizedWeight (got {type(w).__name__}); bf16 weights "
                        "go to the bf16 implementations (the site's weight_format attribute must be unset)")
    if w.fmt.name not in FORMATS:
        raise UserError(f"{what}: format {w.fmt.name} is not a 4-bit e2m1 format ({', '.join(FORMATS)})")
    if w.weight.dim() != 3:
        raise UserError(f"{what}: expected experts stacked as [E, N, K/2] codes, got {tuple(w.weight.shape)}")
    q = as_bytes(w.weight)
    if w.fmt.scale == "ue8m0":
        s, kind, group = as_bytes(w.scale), k.SCALE_UE8M0, 32
        gs = q  # unused by the MXFP4 kernels
    else:
        s, kind, group = as_bytes(w.scale), k.SCALE_E4M3, 16
        if w.global_scale is None or w.global_scale.numel() != w.weight.shape[0]:
            raise UserError(f"{what}: NVFP4 needs one fp32 global scale per expert ([E]), got "
                            f"{None if w.global_scale is None else tuple(w.global_scale.shape)}")
        gs = w.global_scale.float().contiguous()

    def check() -> None:
        if kind == k.SCALE_UE8M0 and int(s.max()) > max_ue8m0:
            raise UserError(f"{what} ({w.name}): ue8m0 scale byte {int(s.max())} > {max_ue8m0} (a scale above "
                            f"2^{max_ue8m0 - 127}): the 4-bit kernels do not take it; use the reference "
                            "(moe.experts.reference) or requantize the checkpoint")

    check_once(w.weight, ("q4-experts", s.data_ptr(), max_ue8m0), check)
    return q, s, gs, kind, group


def _packing(w_gate_up: QuantizedWeight, w_down: QuantizedWeight, what: str) -> dict:
    """The kernels' ``paired`` argument: both weights in the paired layout or both as checkpoints pack them."""
    paired = {w_gate_up.fmt.packing == "paired", w_down.fmt.packing == "paired"}
    if len(paired) != 1:
        raise UserError(f"{what}: w_gate_up is {w_gate_up.fmt.name} but w_down is {w_down.fmt.name}: rearrange both "
                        "or neither (quant.layout.paired_nibbles)")
    return {"paired": paired.pop()}


def _activation(activation: ActivationSpec) -> dict:
    from latency_specialized.kernels import triton_q4 as k

    if activation.kind == "swiglu":
        return dict(act=k.ACT_SWIGLU, beta=0.0, beta_lin=0.0, clamp=activation.clamp)
    if activation.kind == "situ_glu":
        return dict(act=k.ACT_SITU, beta=activation.beta, beta_lin=activation.beta_lin, clamp=None)
    raise UserError(f"4-bit experts implement SiTU-GLU and SwiGLU (got {activation.kind}): use moe.experts.reference")


def _shapes(x: torch.Tensor, ids: torch.Tensor, q13: torch.Tensor, q2: torch.Tensor, what: str):
    M, K = x.shape
    E, two_i, k_half = q13.shape
    I = two_i // 2
    if k_half * 2 != K or tuple(q2.shape) != (E, q2.shape[1], I // 2):
        raise UserError(f"{what}: x{tuple(x.shape)} codes w_gate_up{tuple(q13.shape)} w_down{tuple(q2.shape)} do not "
                        "match [M, K], [E, 2I, K/2], [E, N, I/2]")
    return M, K, I, q2.shape[1], ids.shape[1]


def _out(x, M, top_k, N, per_route, out, what):
    shape = (M, top_k, N) if per_route else (M, N)
    y = out if out is not None else torch.empty(shape, device=x.device, dtype=x.dtype)
    if tuple(y.shape) != shape or y.stride(-1) != 1:
        raise UserError(f"{what}: out {tuple(y.shape)} must be {list(shape)} with unit stride in N")
    return y


def experts_q4_gemv(x: torch.Tensor, weights: torch.Tensor | None, ids: torch.Tensor, w_gate_up: QuantizedWeight,
                    w_down: QuantizedWeight, activation: ActivationSpec, *, per_route: bool = False,
                    out: torch.Tensor | None = None, addend: Addend = None) -> torch.Tensor:
    """Routed experts (contract: ``ops.moe.experts_reference``) over 4-bit weights, each route's expert read once.

    x [M, K] bf16; weights [M, top_k] fp32 (ignored with ``per_route``); ids [M, top_k] int;
    w_gate_up: QuantizedWeight [E, 2I, K]; w_down: QuantizedWeight [E, N, I]; out [M, N] ([M, top_k, N]).
    Returns [M, N] bf16 (per_route: [M, top_k, N]). addend: added after the down kernel (``kernels/moe_addend.py``:
    one add kernel; this path serves buckets above the mma kernel's)."""
    from latency_specialized.kernels import triton_q4 as k

    check_addend_use(addend, per_route, NAME_GEMV)
    q13, s13, g13, kind, group = _kernel_parts(w_gate_up, NAME_GEMV, k.MAX_UE8M0)
    q2, s2, g2, kind2, _ = _kernel_parts(w_down, NAME_GEMV, k.MAX_UE8M0)
    if kind2 != kind:
        raise UserError(f"{NAME_GEMV}: w_gate_up is {w_gate_up.fmt.name} but w_down is {w_down.fmt.name}")
    packing = _packing(w_gate_up, w_down, NAME_GEMV)
    M, K, I, N, top_k = _shapes(x, ids, q13, q2, NAME_GEMV)
    x, ids = x.contiguous(), ids.contiguous()
    h = torch.empty(M * top_k, I, device=x.device, dtype=x.dtype)
    k.gate_up_words(x, ids, q13, s13, g13, h, scale_kind=kind, group=group, **_activation(activation),
                    **GEMV_TUNING["gate_up"], **packing)
    y = _out(x, M, top_k, N, per_route, out, NAME_GEMV)
    w = None
    if not per_route:
        w = weights.contiguous() if weights.dtype == torch.float32 else weights.float().contiguous()
    k.down_words(h, w, ids, q2, s2, g2, y, scale_kind=kind, group=group, per_route=per_route, **GEMV_TUNING["down"],
                 **packing)
    return y if per_route else add_addend(y, addend, NAME_GEMV)


def experts_q4_grouped(x: torch.Tensor, weights: torch.Tensor | None, ids: torch.Tensor, w_gate_up: QuantizedWeight,
                       w_down: QuantizedWeight, activation: ActivationSpec, *, per_route: bool = False,
                       out: torch.Tensor | None = None, addend: Addend = None) -> torch.Tensor:
    """Routed experts (contract: ``ops.moe.experts_reference``) over 4-bit weights on the tensor cores.

    Shapes as :func:`experts_q4_gemv`; K and I multiples of ``GROUPED_BLOCK_K``. Rounding: gate/up, activation
    and each route's down output to bf16, the weighted route rows to bf16, fp32 sum (stock's fused-MoE order).
    addend: added by the sum kernel (``kernels/moe_addend.py``)."""
    from latency_specialized.kernels import triton_moe as moe_k
    from latency_specialized.kernels import triton_q4 as k
    from latency_specialized.kernels.moe_experts_triton import align_buffers, route_rows, sum_routes

    check_addend_use(addend, per_route, NAME_GROUPED)
    q13, s13, g13, kind, group = _kernel_parts(w_gate_up, NAME_GROUPED, k.MAX_UE8M0)
    q2, s2, g2, kind2, _ = _kernel_parts(w_down, NAME_GROUPED, k.MAX_UE8M0)
    if kind2 != kind:
        raise UserError(f"{NAME_GROUPED}: w_gate_up is {w_gate_up.fmt.name} but w_down is {w_down.fmt.name}")
    packing = _packing(w_gate_up, w_down, NAME_GROUPED)
    M, K, I, N, top_k = _shapes(x, ids, q13, q2, NAME_GROUPED)
    if K % GROUPED_BLOCK_K or I % GROUPED_BLOCK_K:
        raise UserError(f"{NAME_GROUPED}: K={K} and I={I} must be multiples of {GROUPED_BLOCK_K}; use {NAME_GEMV}")
    if out is not None:
        _out(x, M, top_k, N, per_route, out, NAME_GROUPED)   # its shape and stride checked before any launch
    act = _activation(activation)
    x = x.contiguous()
    T = M * top_k
    align = align_buffers(T, q13.shape[0], x.device)
    moe_k.moe_align(ids, align)
    tune = dict(GROUPED_TUNING, **packing)
    tune.setdefault("block_k", GROUPED_BLOCK_K)
    gu = torch.empty(T, 2 * I, device=x.device, dtype=x.dtype)
    k.moe_gemm_q4(x, q13, s13, g13, align, top_k, out=gu, a_per_pair=False, scale_kind=kind, group=group, **tune)
    h = torch.empty(T, I, device=x.device, dtype=x.dtype)
    if act["act"] == k.ACT_SWIGLU:
        moe_k.silu_and_mul(gu, act["clamp"], out=h)
    else:
        moe_k.situ_and_mul(gu, act["beta"], act["beta_lin"], out=h)
    if per_route:
        y = _out(x, M, top_k, N, per_route, out, NAME_GROUPED)
        yp, direct = route_rows(y)
        k.moe_gemm_q4(h, q2, s2, g2, align, top_k, out=yp, a_per_pair=True, scale_kind=kind, group=group, **tune)
        if not direct:
            y.copy_(yp.view(M, top_k, N))
        return y
    yp = torch.empty(T, N, device=x.device, dtype=x.dtype)
    w_flat = weights.reshape(-1)
    if w_flat.dtype != torch.float32:
        w_flat = w_flat.float()
    k.moe_gemm_q4(h, q2, s2, g2, align, top_k, out=yp, a_per_pair=True, scale_kind=kind, group=group,
                  topk_weights=w_flat.contiguous(), **tune)
    return sum_routes(yp, top_k, out, addend, x.dtype, NAME_GROUPED)


def _common(ctx: OpContext, name: str, min_sm: int | None) -> Support:
    if not ENABLED:
        return f"{name}: switched off (moe_experts_q4_triton.ENABLED = False)"
    why = quantized_experts_refusal(ctx, name, FORMATS, "4-bit e2m1", min_sm=min_sm)
    if why:
        return why
    fmt = ctx.attr("weight_format")
    group = 16 if fmt.startswith("nvfp4") else 32
    if ctx.dim("K") % group or ctx.dim("N") % group:
        return f"K={ctx.dim('K')} and I={ctx.dim('N')} must be multiples of the {group}-value scale groups"
    return True


def _supports_gemv(ctx: OpContext) -> Support:
    ok = _common(ctx, NAME_GEMV, None)
    if ok is not True:
        return ok
    grouped_fits = not (ctx.dim("K") % GROUPED_BLOCK_K or ctx.dim("N") % GROUPED_BLOCK_K)
    if ctx.tokens >= MIN_TOKENS_GROUPED and grouped_fits:  # else the gemv path serves every count (no reference)
        return f"{ctx.tokens} tokens: the grouped tensor-core path serves from {MIN_TOKENS_GROUPED}"
    return True


def _supports_grouped(ctx: OpContext) -> Support:
    ok = _common(ctx, NAME_GROUPED, 80)
    if ok is not True:
        return ok
    if ctx.dim("K") % GROUPED_BLOCK_K or ctx.dim("N") % GROUPED_BLOCK_K:
        return f"K={ctx.dim('K')} and I={ctx.dim('N')} must be multiples of {GROUPED_BLOCK_K}"
    if ctx.tokens < MIN_TOKENS_GROUPED:
        return f"{ctx.tokens} tokens: the gemv path is faster below {MIN_TOKENS_GROUPED}"
    return True


IMPLEMENTATIONS = [
    Implementation("moe.experts", NAME_GEMV, experts_q4_gemv, _supports_gemv, priority=20,
                   description="4-bit (MXFP4/NVFP4) experts dequantised in registers, each route's expert read "
                               "once on CUDA cores: gate/up+act, down per route, weighted route sum"),
    Implementation("moe.experts", NAME_GROUPED, experts_q4_grouped, _supports_grouped, priority=20,
                   description="4-bit (MXFP4/NVFP4) experts: stock's fused-MoE shape with bf16-dequantised weight "
                               "tiles on the tensor cores (align, gate/up, act, down x weight, sum)"),
]

__all__ = ["experts_q4_gemv", "experts_q4_grouped", "IMPLEMENTATIONS", "NAME_GEMV", "NAME_GROUPED",
           "MIN_TOKENS_GROUPED"]
