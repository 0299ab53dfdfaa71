"""Stock norm kernels (Triton): fused AttnRes, RMSNorm, per-head gated RMSNorm.

``attn_res`` is what stock vLLM runs as Kimi K3's "fused residual-add + RMSNorm": the running
block prefix takes the previous sublayer's output (one bf16 rounding, as an unfused add), the
sublayer input is the softmax mix of the completed blocks and the prefix (logit of a source =
<RMSNorm(source) * norm_w, qk_w>), and the mix is RMS-normalised for the sublayer. One program per
token row; sources are visited one at a time with an online softmax so registers hold one row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _attn_res_kernel(prefix_ptr, delta_ptr, blocks_ptr, norm_w_ptr, qk_w_ptr, out_w_ptr, out_ptr,
                     stride_blk_m, stride_blk_r, N, num_blocks, write_idx, eps, out_eps,
                     HAS_DELTA: tl.constexpr, WRITE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    m = offs < N
    prefix = tl.load(prefix_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_DELTA:
        prefix += tl.load(delta_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
        prefix = prefix.to(prefix_ptr.dtype.element_ty)
        tl.store(prefix_ptr + row * N + offs, prefix, mask=m)
        prefix = prefix.to(tl.float32)
    if WRITE_BLOCK:
        tl.store(blocks_ptr + row * stride_blk_m + write_idx * stride_blk_r + offs,
                 prefix.to(blocks_ptr.dtype.element_ty), mask=m)
    qk = tl.load(norm_w_ptr + offs, mask=m, other=0.0).to(tl.float32) * \
        tl.load(qk_w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    # the prefix is the last source; start the online softmax with it
    best = tl.sum(prefix * qk, 0) * tl.rsqrt(tl.sum(prefix * prefix, 0) / N + eps)
    denom = 1.0
    mixed = prefix
    for i in range(num_blocks):
        v = tl.load(blocks_ptr + row * stride_blk_m + i * stride_blk_r + offs, mask=m, other=0.0).to(tl.float32)
        logit = tl.sum(v * qk, 0) * tl.rsqrt(tl.sum(v * v, 0) / N + eps)
        new_best = tl.maximum(best, logit)
        scale_old = tl.exp(best - new_best)
        p = tl.exp(logit - new_best)
        denom = denom * scale_old + p
        mixed = mixed * scale_old + p * v
        best = new_best
    mixed = mixed / denom
    rstd = tl.rsqrt(tl.sum(mixed * mixed, 0) / N + out_eps)
    y = mixed * rstd * tl.load(out_w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs, y.to(out_ptr.dtype.element_ty), mask=m)


def attn_res(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor, norm_w: torch.Tensor,
             qk_w: torch.Tensor, out_w: torch.Tensor, num_blocks: int, write_idx: int, eps: float,
             out_eps: float, *, out: torch.Tensor) -> torch.Tensor:
    """Fused AttnRes (see module docstring); ``prefix`` (and ``blocks`` at ``write_idx``) updated in place.

    Parameters
    ----------
    prefix : [M, N] running block prefix (activation dtype). delta : [M, N] previous sublayer output or None.
    blocks : [M, R, N] completed block outputs (the first ``num_blocks`` are mixed).
    norm_w, qk_w, out_w : [N] source-norm gain, pseudo-query, output-norm gain.
    write_idx : block slot the (updated) prefix is written to, -1 for none.
    out : [M, N] sublayer input.
    """
    M, N = prefix.shape
    _attn_res_kernel[(M,)](prefix, delta if delta is not None else prefix, blocks, norm_w, qk_w, out_w, out,
                           blocks.stride(0), blocks.stride(1), N, num_blocks, max(write_idx, 0), eps, out_eps,
                           HAS_DELTA=delta is not None, WRITE_BLOCK=write_idx >= 0,
                           BLOCK_N=triton.next_power_of_2(N), num_warps=8)
    return out


def attn_res_reference(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor, norm_w: torch.Tensor,
                       qk_w: torch.Tensor, out_w: torch.Tensor, num_blocks: int, write_idx: int, eps: float,
                       out_eps: float) -> torch.Tensor:
    """Plain-torch oracle of :func:`attn_res` (updates ``prefix``/``blocks`` in place too)."""
    if delta is not None:
        prefix.copy_((prefix.float() + delta.float()).to(prefix.dtype))
    if write_idx >= 0:
        blocks[:, write_idx] = prefix
    src = torch.cat([blocks[:, :num_blocks].float(), prefix.float().unsqueeze(1)], dim=1)  # [M, S, N]
    rstd = torch.rsqrt(src.pow(2).mean(-1) + eps)
    logits = (src * (norm_w.float() * qk_w.float())).sum(-1) * rstd
    mixed = (torch.softmax(logits, -1).unsqueeze(-1) * src).sum(1)
    y = mixed * torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + out_eps) * out_w.float()
    return y.to(prefix.dtype)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, stride_x, N, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    m = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    y = x * rstd * tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs, y.to(out_ptr.dtype.element_ty), mask=m)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, *, out: torch.Tensor) -> torch.Tensor:
    """y[M, N] = RMSNorm(x) * w (x rows may be strided; out contiguous)."""
    M, N = x.shape
    _rmsnorm_kernel[(M,)](x, w, out, x.stride(0), N, eps, BLOCK_N=triton.next_power_of_2(N),
                          num_warps=4 if N <= 4096 else 8)
    return out


@triton.jit
def _gated_rmsnorm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, stride_x, stride_g, H, eps,
                          D: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    m = (h < H)[:, None]
    idx = h[:, None] * D + d[None, :]
    x = tl.load(x_ptr + row * stride_x + idx, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + idx, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
    y = x * rstd[:, None] * tl.load(w_ptr + d).to(tl.float32)[None, :] * _sigmoid(g)
    tl.store(out_ptr + row * H * D + idx, y.to(out_ptr.dtype.element_ty), mask=m)


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, head_dim: int, eps: float, *,
                  out: torch.Tensor) -> torch.Tensor:
    """Per head of ``head_dim``: y = RMSNorm(x) * w * sigmoid(gate). x, gate: [M, H*D] (rows may be strided)."""
    M, HD = x.shape
    H = HD // head_dim
    _gated_rmsnorm_kernel[(M,)](x, gate, w, out, x.stride(0), gate.stride(0), H, eps, D=head_dim,
                                BLOCK_H=triton.next_power_of_2(H), num_warps=4)
    return out
