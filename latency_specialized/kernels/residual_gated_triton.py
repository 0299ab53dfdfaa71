"""``residual.gated.triton``: one residual join (post-norm, plain or norm-preserving gated add, next
RMSNorm) in one launch - contract ``ops.residual_gated.gated_join_reference``.

One program per row holds the row (``N`` up to 16384) in registers: it loads the sublayer output, the
stream, the gains and the gate logits once, all before its first reduction, computes the post norm
(none / weightless / weighted / input-scaled), the gate's
``alpha, beta`` from the fp32 logits, stores the new stream in its dtype, re-reads nothing, and writes
the next sublayer's normed input (fp32 math, the stream's store and the output the only roundings,
as the reference). vLLM 0.33 fuses the same three steps into one boundary kernel. Graph-capturable;
Triton is imported on the first call.
"""

from __future__ import annotations

import functools
import os

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.kernels.triton_common import triton_gpu_refusal

NAME = "residual.gated.triton"
MAX_N = 16384
POSTS = {"none": 0, "weightless": 1, "weighted": 2, "input_scaled": 3}


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    del interpret
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def gated_join_kernel(y, s_y, stream, x_out, w, pw, gate, N, eps, post_eps, inv_t, gate_eps,
                          HAS_Y: tl.constexpr, POST: tl.constexpr, ZC: tl.constexpr, POST_ZC: tl.constexpr,
                          HAS_W: tl.constexpr, GATE: tl.constexpr, SCALAR_GATE: tl.constexpr,
                          BLOCK: tl.constexpr):
        m = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        mask = c < N
        s_ptr = stream + m * N + c
        # every operand is loaded before the first reduction: a block reduction is a barrier the compiler does not
        # move loads across, so a load written after one waits a DRAM round trip of its own
        # (kept in their storage types until used: 16-bit operands take half the registers while they wait)
        s = tl.load(s_ptr, mask=mask, other=0.0)
        if HAS_Y:
            b = tl.load(y + m * s_y + c, mask=mask, other=0.0)
            if POST >= 2:
                pg = tl.load(pw + c, mask=mask, other=0.0)
            if GATE:
                if SCALAR_GATE:
                    z = tl.load(gate)
                else:
                    z = tl.load(gate + c, mask=mask, other=0.0)
        if HAS_W:
            g = tl.load(w + c, mask=mask, other=0.0)
        s = s.to(tl.float32)
        if HAS_Y:
            b = b.to(tl.float32)
            if POST >= 2:
                pg = pg.to(tl.float32)
                if POST_ZC:
                    pg = pg + 1.0
            if POST == 3:  # input-scaled: the gain before the norm
                b = b * pg
            if POST != 0:
                b = b / tl.sqrt(tl.sum(b * b, 0) / N + post_eps)
            if POST == 2:
                b = b * pg
            if GATE:
                z = z.to(tl.float32) * inv_t
                beta = 1.0 / (1.0 + tl.exp(-z))
                alpha = tl.sqrt(tl.maximum((1.0 / (1.0 + tl.exp(z))) * (1.0 + beta), gate_eps))
                s = alpha * s + beta * b
            else:
                s = s + b
            s = s.to(stream.dtype.element_ty)
            tl.store(s_ptr, s, mask=mask)
            s = s.to(tl.float32)  # the next norm reads the stored (rounded) stream, as the reference
        xn = s / tl.sqrt(tl.sum(s * s, 0) / N + eps)
        if HAS_W:
            g = g.to(tl.float32)
            if ZC:
                g = g + 1.0
            xn = xn * g
        tl.store(x_out + m * N + c, xn.to(x_out.dtype.element_ty), mask=mask)

    return gated_join_kernel


def gated_join_triton(y: torch.Tensor | None, stream: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                      zero_centered: bool = False, post: str = "none", post_weight: torch.Tensor | None = None,
                      post_eps: float = 1e-6, post_zero_centered: bool = False, gate: torch.Tensor | None = None,
                      gate_temperature: float = 0.3, gate_eps: float = 1e-3, out_dtype: torch.dtype | None = None,
                      out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [M, N], stream) - see ``ops/residual_gated.py``; ``y`` may have strided rows."""
    import triton

    M, N = stream.shape
    if post not in POSTS:
        raise ValueError(f"residual.gated: post norm {post!r}: use one of {', '.join(POSTS)}")
    if post in ("weighted", "input_scaled") and post_weight is None:
        raise ValueError(f"residual.gated: post norm {post!r} needs post_weight")
    if not stream.is_contiguous() or (y is not None and (y.shape != stream.shape or y.stride(1) != 1)):
        raise ValueError("residual.gated (Triton): a contiguous stream and an output of its shape (unit column stride)")
    x = out if out is not None else torch.empty(M, N, dtype=out_dtype or (y.dtype if y is not None else stream.dtype),
                                                device=stream.device)
    if M == 0:
        return x, stream
    dummy = stream
    _kernel(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))[(M,)](
        y if y is not None else dummy, y.stride(0) if y is not None else 0, stream, x,
        weight if weight is not None else dummy, post_weight if post_weight is not None else dummy,
        gate if gate is not None else dummy, N, float(eps), float(post_eps), 1.0 / float(gate_temperature),
        float(gate_eps), HAS_Y=y is not None, POST=POSTS[post], ZC=bool(zero_centered),
        POST_ZC=bool(post_zero_centered), HAS_W=weight is not None, GATE=gate is not None,
        SCALAR_GATE=gate is not None and gate.numel() == 1, BLOCK=triton.next_power_of_2(N),
        num_warps=16 if N > 8192 else 8 if N >= 4096 else 4)  # <= 32 fp32 of each of the 5 operands a thread
    return x, stream


def _supports(ctx: OpContext) -> Support:
    refusal = triton_gpu_refusal(ctx, "it")
    if refusal:
        return refusal
    if ctx.dim("N") > MAX_N:
        return f"N={ctx.dim('N')} > {MAX_N}: one row per program in registers"
    return True


IMPLEMENTATIONS = [
    Implementation("residual.gated", NAME, gated_join_triton, _supports, priority=10, strided_rows=True,
                   description="Triton: post-norm + (gated) residual add + next RMSNorm of a row in one launch"),
]
