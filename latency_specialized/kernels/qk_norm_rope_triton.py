"""``attention.qk_norm_rope.triton``: per-head QK RMSNorm + RoPE of a fused qkv projection in one launch.

Contract: ``ops.attention.qk_norm_rope.qk_norm_rope_reference``. Grid ``(M, Hq + KV)``: one program per
(row, head) loads the head's ``D`` values once from the (strided) qkv row as two halves - the rotation
pairs (``neox``: channel i with i + D/2; ``interleaved``: 2i with 2i + 1) - normalises them in fp32 with
the sum of squares of both halves, multiplies the gain, rotates by ``positions[m] * inv_freq[i]`` and
stores the head once, rounded to the activation dtype. It replaces two norm launches and the rope's
~10 elementwise launches (a GQA layer at batch 1 spends ~1 us per launch inside a graph). No host
reads: graph-capturable. Triton is imported on the first call (``supports()`` names it if missing).
"""

from __future__ import annotations

import functools
import os

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.kernels.triton_common import triton_gpu_refusal

NAME = "attention.qk_norm_rope.triton"


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The jitted kernel (one build per ``TRITON_INTERPRET`` setting)."""
    del interpret
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def qk_norm_rope_kernel(qkv, s_row, q_out, k_out, q_w, k_w, pos, inv_freq, eps, HQ: tl.constexpr,
                            HALF: tl.constexpr, HAS_QW: tl.constexpr, HAS_KW: tl.constexpr,
                            ROPE: tl.constexpr, INTERLEAVED: tl.constexpr):
        m = tl.program_id(0)
        h = tl.program_id(1)
        D = 2 * HALF
        i = tl.arange(0, HALF)
        # first / second element of each rotation pair
        a_off = 2 * i if INTERLEAVED else i
        b_off = 2 * i + 1 if INTERLEAVED else i + HALF
        src = qkv + m * s_row + h * D
        is_q = h < HQ
        # every load before the reduction (a load written after it waits for it: one more DRAM round trip)
        x1 = tl.load(src + a_off).to(tl.float32)
        x2 = tl.load(src + b_off).to(tl.float32)
        if HAS_QW:   # both gains read by every head (a few hundred bytes), the head's own chosen below
            qw1 = tl.load(q_w + a_off).to(tl.float32)
            qw2 = tl.load(q_w + b_off).to(tl.float32)
        if HAS_KW:
            kw1 = tl.load(k_w + a_off).to(tl.float32)
            kw2 = tl.load(k_w + b_off).to(tl.float32)
        if ROPE:
            ang = tl.load(pos + m).to(tl.float32) * tl.load(inv_freq + i)
            c = tl.cos(ang)
            s = tl.sin(ang)
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
        x1 = x1 * rstd
        x2 = x2 * rstd
        if HAS_QW:
            x1 = tl.where(is_q, x1 * qw1, x1)
            x2 = tl.where(is_q, x2 * qw2, x2)
        if HAS_KW:
            x1 = tl.where(is_q, x1, x1 * kw1)
            x2 = tl.where(is_q, x2, x2 * kw2)
        if ROPE:
            y1 = x1 * c - x2 * s
            y2 = x2 * c + x1 * s
        else:
            y1 = x1
            y2 = x2
        if is_q:
            dst = q_out + (m * HQ + h) * D
        else:
            dst = k_out + (m * (tl.num_programs(1) - HQ) + h - HQ) * D
        tl.store(dst + a_off, y1.to(dst.dtype.element_ty))
        tl.store(dst + b_off, y2.to(dst.dtype.element_ty))

    return qk_norm_rope_kernel


def qk_norm_rope_triton(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, eps: float, *,
                        q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                        positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
                        style: str = "neox") -> tuple[torch.Tensor, torch.Tensor]:
    """q [M, Hq, D], k [M, KV, D] from ``qkv`` [M, W] (contract: ops/attention/qk_norm_rope.py)."""
    M = qkv.shape[0]
    if qkv.stride(1) != 1:
        raise ValueError("qk_norm_rope: qkv needs a unit column stride")
    rope = inv_freq is not None
    if rope and (positions is None or inv_freq.shape[0] * 2 != head_dim):
        raise ValueError("qk_norm_rope (Triton): RoPE over the whole head (inv_freq of head_dim / 2) with positions")
    q = torch.empty(M, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(M, kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if M == 0:
        return q, k
    dummy = q  # never read: the constexpr flags compile the loads out
    _kernel(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))[(M, heads + kv_heads)](
        qkv, qkv.stride(0), q, k, q_weight if q_weight is not None else dummy,
        k_weight if k_weight is not None else dummy, positions if rope else dummy,
        inv_freq if rope else dummy, float(eps), HQ=heads, HALF=head_dim // 2, HAS_QW=q_weight is not None,
        HAS_KW=k_weight is not None, ROPE=rope, INTERLEAVED=style == "interleaved")
    return q, k


def _supports(ctx: OpContext) -> Support:
    refusal = triton_gpu_refusal(ctx, "it")
    if refusal:
        return refusal
    d = ctx.dim("head_dim")
    if d < 4 or d & (d - 1):
        return f"head_dim {d}: a power of two >= 4"
    if ctx.attr("rotary_dim", d) != d:
        return f"partial rotary ({ctx.attr('rotary_dim')} of {d} channels): the kernel rotates whole heads"
    return True


IMPLEMENTATIONS = [
    Implementation("attention.qk_norm_rope", NAME, qk_norm_rope_triton, _supports, priority=10, strided_rows=True,
                   description="Triton: per-head QK RMSNorm + RoPE in one launch, a program per (row, head)"),
]
