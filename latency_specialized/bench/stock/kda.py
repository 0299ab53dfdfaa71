"""Stock KDA decode kernels (Triton): causal-conv update and the fused recurrent delta rule.

Stock vLLM decodes KDA in three kernels: ``causal_conv1d_update`` (SiLU, state shift),
``fused_recurrent_kda`` (q/k L2-norm, decay gate, beta, delta rule on the fp32 state, read-out) and a
gated RMSNorm (``norms.gated_rmsnorm``). Together they compute ``ops.attention.kda`` exactly.

The recurrent kernel splits the value rows of each head's [D_v, D_k] state over programs (BV rows
each), so every program streams a 16 KB slice of state once (read + write), which is what bounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_update_kernel(x_ptr, state_ptr, w_ptr, idx_ptr, out_ptr, stride_x, C,
                        W: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = c < C
    s = tl.load(idx_ptr + b).to(tl.int64)
    x = tl.load(x_ptr + b * stride_x + c, mask=m, other=0.0).to(tl.float32)
    acc = x * tl.load(w_ptr + c * W + (W - 1), mask=m, other=0.0).to(tl.float32)
    base = state_ptr + s * C * (W - 1) + c * (W - 1)
    for j in tl.static_range(W - 1):
        prev = tl.load(base + j, mask=m, other=0.0)
        acc += prev.to(tl.float32) * tl.load(w_ptr + c * W + j, mask=m, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(base + (j - 1), prev, mask=m)  # shift left: oldest drops out
    tl.store(base + (W - 2), x.to(state_ptr.dtype.element_ty), mask=m)
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + b * C + c, y.to(out_ptr.dtype.element_ty), mask=m)


def conv_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, state_idx: torch.Tensor, *,
                out: torch.Tensor) -> torch.Tensor:
    """SiLU(causal depthwise conv) of one new column per sequence; ``conv_state`` shifted in place.

    x : [B, C] (rows may be strided); conv_state : [S, C, W-1] oldest first; weight : [C, W];
    state_idx : [B] rows of conv_state. out : [B, C].
    """
    B, C = x.shape
    W = weight.shape[1]
    BLOCK_C = 512
    _conv_update_kernel[(B, triton.cdiv(C, BLOCK_C))](x, conv_state, weight, state_idx, out, x.stride(0), C,
                                                      W=W, BLOCK_C=BLOCK_C, num_warps=4)
    return out


@triton.jit
def _recurrent_kda_kernel(qkv_ptr, f_ptr, a_log_ptr, dt_bias_ptr, beta_ptr, state_ptr, idx_ptr, out_ptr,
                          stride_f, stride_beta, H, scale, lower_bound,
                          D: tl.constexpr, BV: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = pid % H
    v0 = tl.program_id(1) * BV
    HD = H * D
    dk = tl.arange(0, D)
    dv = v0 + tl.arange(0, BV)
    row = qkv_ptr + b * 3 * HD + h * D
    q = tl.load(row + dk).to(tl.float32)
    k = tl.load(row + HD + dk).to(tl.float32)
    v = tl.load(row + 2 * HD + dv).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    f = tl.load(f_ptr + b * stride_f + h * D + dk).to(tl.float32) + tl.load(dt_bias_ptr + h * D + dk).to(tl.float32)
    g = lower_bound / (1.0 + tl.exp(-(a * f)))
    beta = 1.0 / (1.0 + tl.exp(-tl.load(beta_ptr + b * stride_beta + h).to(tl.float32)))
    s_row = tl.load(idx_ptr + b).to(tl.int64)
    sp = state_ptr + ((s_row * H + h) * D + dv[:, None]) * D + dk[None, :]
    S = tl.load(sp) * tl.exp(g)[None, :]
    vn = beta * (v - tl.sum(S * k[None, :], 1))
    S = S + vn[:, None] * k[None, :]
    tl.store(sp, S)
    o = tl.sum(S * q[None, :], 1)
    tl.store(out_ptr + b * HD + h * D + dv, o.to(out_ptr.dtype.element_ty))


def recurrent_kda(qkv: torch.Tensor, f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                  beta_logit: torch.Tensor, state: torch.Tensor, state_idx: torch.Tensor, *, num_heads: int,
                  lower_bound: float, out: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Gated delta rule for one token per sequence (the conv already applied).

    qkv : [B, 3*H*D] contiguous (conv output). f : [B, H*D] decay input. A_log : [H]. dt_bias : [H*D].
    beta_logit : [B, H] (rows may be strided). state : [S, H, D, D] fp32 [value, key], updated at
    ``state_idx``. out : [B, H*D] read-out before the gated norm.
    """
    B = qkv.shape[0]
    H = num_heads
    D = qkv.shape[1] // (3 * H)
    BV = min(32, D)
    _recurrent_kda_kernel[(B * H, D // BV)](qkv, f, A_log, dt_bias, beta_logit, state, state_idx, out,
                                            f.stride(0), beta_logit.stride(0), H,
                                            D ** -0.5 if scale is None else scale, lower_bound,
                                            D=D, BV=BV, num_warps=4)
    return out
