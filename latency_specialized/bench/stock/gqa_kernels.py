"""Stock stand-in kernels (Triton) of a GQA + latent-MoE decode layer, written the way stock vLLM 0.33
writes them for Muse Spark on Hopper (``vllm/models/muse_spark/``), one kernel where stock has one:

* ``qk_norm_rope_kv`` - stand-in for vLLM's ``fused_muse_spark_qknorm_rope_kv_insert`` (a CUDA op of the
  vLLM wheel): per head of the fused q|k|v|gate projection, the weightless QK RMSNorm, RoPE (NeoX or
  interleaved pairs; none for NoPE layers) and the new token's k/v written into the paged caches, one
  launch; q comes out normed and rotated;
* ``norm_residual_norm`` - stand-in for a residual boundary (vLLM's ``fused_norm_residual_norm_fwd``, a
  Triton kernel of vLLM, or FlashInfer's ``gated_residual_next_rmsnorm``): the sublayer output's
  post-norm (none / weightless / weighted / input-scaled), the norm-preserving gated (or plain) add
  into the fp32 stream, and the next consumer's RMSNorm, one pass;
* ``silu_and_mul`` - stand-in for vLLM's ``silu_and_mul`` CUDA op (SwiGLU, optional clamp): the fused-MoE
  path's own kernel (``kernels/triton_moe.py``), which is written the same way;
* ``post_expert_finalize`` - stand-in for vLLM's ``fused_post_expert_finalize`` (Triton, the Hopper
  path of ``MusePostExpertFinalize``): per-route RMSNorm of the GEMM2 rows (input-scaled or weighted
  gain), times the routing weight, fp32 sum over the top-k, one rounding.

All math in fp32 with one rounding per stored tensor. No ``tl.dot``: the kernels run under the Triton
interpreter on the CPU as they are (``TRITON_INTERPRET=1``). Masks come from comparisons of vectors only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from latency_specialized.kernels.triton_moe import silu_and_mul

POST_CODES = {"none": 0, "weightless": 1, "weighted": 2, "input_scaled": 3}
"""Post-sublayer norm kinds (``ops.residual_gated.POST_KINDS``) as the boundary kernel's constexpr."""
ROPE_CODES = {"none": 0, "neox": 1, "interleaved": 2}


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


# ------------------------------------------------------------------------- QK norm + RoPE + KV write
@triton.jit
def _qk_norm_rope_kv_kernel(qkv_ptr, pos_ptr, inv_freq_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, q_out_ptr,
                            stride_qkv, Hq, KV, block_size, s_cb, s_cs, s_ch, eps,
                            D: tl.constexpr, QK_NORM: tl.constexpr, ROPE: tl.constexpr):
    # grid (M, Hq + KV): program h < Hq handles query head h, the others one KV head (k normed, rotated and
    # written, v written)
    m = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, HALF)
    if ROPE == 2:  # interleaved pairs (GPT-J; vLLM is_neox_style=False): channel 2i with 2i + 1
        o1 = 2 * i
        o2 = 2 * i + 1
    else:          # rotate-half (NeoX) pairs, or no rotation: channel i with i + D/2
        o1 = i
        o2 = i + HALF
    is_q = h < Hq
    kh = h - Hq
    col = tl.where(is_q, h * D, Hq * D + kh * D)
    base = qkv_ptr + m * stride_qkv + col
    x1 = tl.load(base + o1).to(tl.float32)
    x2 = tl.load(base + o2).to(tl.float32)
    if QK_NORM:  # weightless per-head RMSNorm
        r = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
        x1 = x1 * r
        x2 = x2 * r
    if ROPE != 0:
        ang = tl.load(pos_ptr + m).to(tl.float32) * tl.load(inv_freq_ptr + i)
        c = tl.cos(ang)
        s = tl.sin(ang)
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
    else:
        y1 = x1
        y2 = x2
    if is_q:
        q_base = q_out_ptr + m * Hq * D + h * D
        tl.store(q_base + o1, y1.to(q_out_ptr.dtype.element_ty))
        tl.store(q_base + o2, y2.to(q_out_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_ptr + m).to(tl.int64)
        ok_half = i < tl.where(slot >= 0, HALF, 0)          # a negative slot (padding row) writes nothing
        safe = tl.maximum(slot, 0)
        dst = (safe // block_size) * s_cb + (safe % block_size) * s_cs + kh * s_ch
        tl.store(k_cache_ptr + dst + o1, y1.to(k_cache_ptr.dtype.element_ty), mask=ok_half)
        tl.store(k_cache_ptr + dst + o2, y2.to(k_cache_ptr.dtype.element_ty), mask=ok_half)
        v_base = qkv_ptr + m * stride_qkv + Hq * D + KV * D + kh * D
        tl.store(v_cache_ptr + dst + o1, tl.load(v_base + o1), mask=ok_half)
        tl.store(v_cache_ptr + dst + o2, tl.load(v_base + o2), mask=ok_half)


def qk_norm_rope_kv(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor | None,
                    slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, num_heads: int,
                    num_kv_heads: int, qk_norm: bool, eps: float, rope_style: str, q_out: torch.Tensor) -> torch.Tensor:
    """QK-norm + RoPE + KV-cache write in one launch (stand-in for vLLM's fused_qk_norm_rope_kv_insert).

    Parameters
    ----------
    qkv : [M, (Hq + 2 KV) D + ...] the fused projection, columns q | k | v (| gate), rows may be strided.
    positions : [M] int positions of the new tokens. inv_freq : [D/2] fp32 RoPE inverse frequencies, or
        None (NoPE: no rotation). slot_mapping : [M] int flat cache slots (< 0: no write).
    k_cache, v_cache : [num_blocks, block_size, KV, D] paged caches (written at the slots).
    qk_norm : weightless per-head RMSNorm of q and k (eps ``eps``) before the rotation.
    rope_style : 'neox' or 'interleaved' (ignored without inv_freq). q_out : [M, Hq, D].
    """
    M = qkv.shape[0]
    D = k_cache.shape[-1]
    assert k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride(), "k/v caches: one contiguous layout"
    rope = ROPE_CODES[rope_style] if inv_freq is not None else 0
    _qk_norm_rope_kv_kernel[(M, num_heads + num_kv_heads)](
        qkv, positions, inv_freq if inv_freq is not None else qkv, slot_mapping, k_cache, v_cache, q_out,
        qkv.stride(0), num_heads, num_kv_heads, k_cache.shape[1], k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), eps, D=D, QK_NORM=qk_norm, ROPE=rope, num_warps=1)
    return q_out


# ------------------------------------------------------------------------- residual boundary
@triton.jit
def _norm_residual_norm_kernel(branch_ptr, stream_ptr, out_ptr, post_w_ptr, pre_w_ptr, alpha_ptr, beta_ptr,
                               stride_b, N, post_eps, pre_eps,
                               POST: tl.constexpr, POST_ZC: tl.constexpr, GATED: tl.constexpr,
                               PRE_W: tl.constexpr, PRE_ZC: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_N)
    dm = d < N
    # every load before the first reduction (latency-bound at decode)
    x = tl.load(branch_ptr + row * stride_b + d, mask=dm, other=0.0).to(tl.float32)
    s = tl.load(stream_ptr + row * N + d, mask=dm, other=0.0).to(tl.float32)
    if GATED:
        alpha = tl.load(alpha_ptr + d, mask=dm, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + d, mask=dm, other=0.0).to(tl.float32)
    if POST >= 2:
        pw = tl.load(post_w_ptr + d, mask=dm, other=0.0).to(tl.float32)
        if POST_ZC:
            pw = pw + 1.0
    if PRE_W:
        w = tl.load(pre_w_ptr + d, mask=dm, other=0.0).to(tl.float32)
        if PRE_ZC:
            w = w + 1.0
    if POST == 3:  # input-scaled: the gain before normalising
        x = x * pw
    if POST >= 1:
        x = x * tl.rsqrt(tl.sum(x * x, 0) / N + post_eps)
    if POST == 2:
        x = x * pw
    if GATED:
        s = alpha * s + beta * x
    else:
        s = s + x
    s = s.to(stream_ptr.dtype.element_ty)
    tl.store(stream_ptr + row * N + d, s, mask=dm)
    z = s.to(tl.float32)
    z = z * tl.rsqrt(tl.sum(z * z, 0) / N + pre_eps)
    if PRE_W:
        z = z * w
    tl.store(out_ptr + row * N + d, z.to(out_ptr.dtype.element_ty), mask=dm)


def norm_residual_norm(branch: torch.Tensor, stream: torch.Tensor, pre_weight: torch.Tensor | None, pre_eps: float, *,
                       pre_zero_centered: bool, post: str, post_weight: torch.Tensor | None, post_eps: float,
                       post_zero_centered: bool, alpha: torch.Tensor | None, beta: torch.Tensor | None,
                       out: torch.Tensor) -> torch.Tensor:
    """One residual boundary (``ops.residual_gated.gated_join_reference``'s contract with precomputed gate
    coefficients): ``b = post_norm(branch)``; ``stream = alpha * stream + beta * b`` (plain ``+`` without
    ``alpha``/``beta``), stored in the stream's dtype in place; ``out = rmsnorm(stream) * gain``.

    branch : [M, N] (rows may be strided); stream : [M, N] contiguous; alpha, beta : [N] fp32 or None.
    """
    M, N = branch.shape
    assert stream.is_contiguous() and out.is_contiguous() and branch.stride(1) == 1
    code = POST_CODES[post]
    if code >= 2:
        assert post_weight is not None, f"post norm {post!r} needs a weight"
    gated = alpha is not None
    BLOCK_N = triton.next_power_of_2(N)
    _norm_residual_norm_kernel[(M,)](
        branch, stream, out, post_weight if post_weight is not None else branch,
        pre_weight if pre_weight is not None else branch, alpha if gated else stream, beta if gated else stream,
        branch.stride(0), N, post_eps, pre_eps, POST=code, POST_ZC=post_zero_centered, GATED=gated,
        PRE_W=pre_weight is not None, PRE_ZC=pre_zero_centered, BLOCK_N=BLOCK_N,
        num_warps=16 if BLOCK_N >= 8192 else (8 if BLOCK_N >= 4096 else 4))
    return out


# ------------------------------------------------------------------------- post-expert finalize
@triton.jit
def _post_expert_finalize_kernel(rows_ptr, w_ptr, tw_ptr, out_ptr, L, eps,
                                 TOPK: tl.constexpr, GAIN: tl.constexpr, ZC: tl.constexpr, BLOCK_L: tl.constexpr):
    # GAIN: 0 weightless, 1 input-scaled (gain before the norm), 2 weighted (gain after)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_L)
    dm = d < L
    if GAIN != 0:
        g = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
        if ZC:
            g = g + 1.0
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        x = tl.load(rows_ptr + (t * TOPK + j) * L + d, mask=dm, other=0.0).to(tl.float32)
        if GAIN == 1:
            x = x * g
        scale = tl.rsqrt(tl.sum(x * x, 0) / L + eps) * tl.load(tw_ptr + t * TOPK + j).to(tl.float32)
        acc += x * scale
    if GAIN == 2:
        acc = acc * g
    tl.store(out_ptr + t * L + d, acc.to(out_ptr.dtype.element_ty), mask=dm)


def post_expert_finalize(rows: torch.Tensor, topk_weights: torch.Tensor, gain: torch.Tensor | None, eps: float, *,
                         gain_before_norm: bool, zero_centered: bool, out: torch.Tensor) -> torch.Tensor:
    """Per-route RMSNorm + routing weight + fp32 top-k sum (stand-in for vLLM's fused_post_expert_finalize).

    rows : [M * k, L] route-major GEMM2 rows (row ``m * k + j`` = route j of token m, contiguous).
    topk_weights : [M, k] fp32. gain : [L] or None (weightless); ``gain_before_norm``: input-scaled.
    out : [M, L].
    """
    M, k = topk_weights.shape
    L = rows.shape[1]
    assert rows.is_contiguous() and rows.shape[0] == M * k and topk_weights.is_contiguous()
    code = 0 if gain is None else (1 if gain_before_norm else 2)
    BLOCK_L = triton.next_power_of_2(L)
    _post_expert_finalize_kernel[(M,)](rows, gain if gain is not None else rows, topk_weights, out, L, eps,
                                       TOPK=k, GAIN=code, ZC=zero_centered, BLOCK_L=BLOCK_L,
                                       num_warps=8 if BLOCK_L >= 4096 else 4)
    return out


__all__ = ["POST_CODES", "ROPE_CODES", "norm_residual_norm", "post_expert_finalize", "qk_norm_rope_kv",
           "silu_and_mul"]
