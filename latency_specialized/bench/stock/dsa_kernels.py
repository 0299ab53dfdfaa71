"""Stock stand-in kernels (Triton) of a DSA decode layer (MLA + lightning indexer + sparse attention), written
the way stock vLLM 0.33 writes them for DeepSeek-V3.2-style models on Hopper (``vllm/models/deepseek_v32/``,
``model_executor/layers/sparse_attn_indexer.py``, ``v1/attention/backends/mla/``), one kernel where stock has one:

* ``norm_rope_cache`` - stand-in for vLLM's ``fused_norm_rope`` (its Triton ``_fused_norm_rope_kernel``,
  grid (tokens, parts)): the q_a RMSNorm, the kv_a RMSNorm + RoPE of k_pe + the latent write into the paged
  MLA cache, and on indexer layers the indexer key's LayerNorm + RoPE of its leading channels + fp8 e4m3
  quantisation with one power-of-two (ue8m0) scale per token + the write into the paged fp8 key cache;
* ``rope_q_index`` - stand-in for vLLM's ``fused_q`` (``_fused_q_kernel``, bf16-query path): RoPE of every
  head's q_pe (in place here; vLLM writes a copy), and on indexer layers RoPE + fp8 quantisation (ue8m0 scale
  per head) of the indexer queries, the head weights scaled by that scale, the softmax scale and heads^-0.5;
* ``indexer_logits`` - stand-in for DeepGEMM's ``fp8_paged_mqa_logits`` (a kernel of the vLLM wheel's deps):
  per sequence and cached token ``logit = sum_h w_h relu(q_h . k) * k_scale`` over the paged fp8 key cache,
  fp32, ``-inf`` past the sequence (the fp8 operands are widened to bf16 for the tensor-core dot: exact);
* ``topk_select`` - stand-in for vLLM's ``cooperative_topk`` CUDA op (one kernel there): ``torch.topk``, as it
  launches (H200, 2048 of a row, graphed: 1 kernel and 22-27 us at 4k positions, batch 1-64; 19 kernels and
  44 / 48 / 69 us at 32k, batch 1 / 8 / 64 - a two-level Triton radix select was slower still, 45-480 us);
* ``convert_topk`` - stand-in for vLLM's ``triton_convert_req_index_to_global_index`` (run once per index
  group of layers sharing a top-k): request-local positions -> physical cache rows and valid counts, valid
  rows first (what FlashAttention's sparse MLA path reads as a page-size-1 block table).

``*_reference`` functions are the torch oracles of the Triton ones (same roundings). Masks come from
comparisons of vectors only; ``tl.dot`` only in ``indexer_logits``, in fp32 under the Triton interpreter
(``TRITON_INTERPRET=1``: its bf16 dot is wrong), so the kernels run on the CPU as they are.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
"""Largest e4m3 value (vLLM's ``_FP8_MAX`` on OCP fp8)."""

__all__ = ["FP8_MAX", "convert_topk", "interpreting", "partner", "rope_reference", "rope_vec", "ue8m0_quantize", "convert_topk_reference", "fp8_quantize_reference", "indexer_logits",
           "indexer_logits_reference", "norm_rope_cache", "norm_rope_cache_reference", "rope_q_index",
           "rope_q_index_reference", "topk_rows_reference", "topk_select"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ------------------------------------------------------------------------------------------ device helpers
@triton.jit
def _rope_vec(x, xp, d, pos, inv_ptr, R: tl.constexpr, INTERLEAVED: tl.constexpr):
    """RoPE of the leading ``R`` channels of a vector ``x`` (``xp``: each channel's rotation partner, loaded
    by the caller at ``_partner(d)``); channels ``d >= R`` pass through."""
    rot = d < R
    if INTERLEAVED:
        fi = d // 2
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
    else:
        fi = d % (R // 2)
        sign = tl.where(d < R // 2, -1.0, 1.0)
    inv = tl.load(inv_ptr + fi, mask=rot, other=0.0)
    ang = pos.to(tl.float32) * inv
    return tl.where(rot, x * tl.cos(ang) + sign * xp * tl.sin(ang), x)


@triton.jit
def _partner(d, R: tl.constexpr, INTERLEAVED: tl.constexpr):
    if INTERLEAVED:
        p = d ^ 1
    else:
        p = tl.where(d < R // 2, d + R // 2, d - R // 2)
    return tl.where(d < R, p, d)


@triton.jit
def _ue8m0_quantize(x, FMAX: tl.constexpr, EXACT: tl.constexpr):
    """(fp8 e4m3 values, power-of-two scale) of an fp32 vector: vLLM's ``_fp8_ue8m0_quantize``. ``EXACT`` (the
    interpreter only, whose fp32 -> e4m3 cast is wrong where rounding carries into the exponent: 124.6 -> 64) rounds
    to the e4m3 grid first (to nearest, ties away), so the cast is exact."""
    scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-4) / FMAX
    scale = tl.math.exp2(tl.math.ceil(tl.math.log2(scale)))
    y = x / scale
    if EXACT:
        step = tl.math.exp2(tl.maximum(tl.math.floor(tl.math.log2(tl.abs(y))), -6.0) - 3.0)
        y = tl.where(y < 0, -1.0, 1.0) * tl.math.floor(tl.abs(y) / step + 0.5) * step
    return y.to(tl.float8e4nv), scale


# ------------------------------------------------------------------------------------------ norm + rope + caches
@triton.jit
def _norm_rope_cache_kernel(pos_ptr, y_ptr, s_y, qw_ptr, kvw_ptr, qc_ptr, eps, cache_ptr, slot_ptr, inv_ptr,
                            ik_ptr, s_ik, ikw_ptr, ikb_ptr, ik_eps, kc_ptr, ks_ptr, inv_i_ptr,
                            QL: tl.constexpr, BQ: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                            D: tl.constexpr, ROPE_IL: tl.constexpr, INDEX_IL: tl.constexpr, FMAX: tl.constexpr,
                            EXACT: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    pos = tl.load(pos_ptr + m)
    if part == 0:      # q_a RMSNorm -> q_c
        d = tl.arange(0, BQ)
        x = tl.load(y_ptr + m * s_y + d, mask=d < QL, other=0.0).to(tl.float32)
        w = tl.load(qw_ptr + d, mask=d < QL, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x, 0) / QL + eps) * w
        tl.store(qc_ptr + m * QL + d, y.to(qc_ptr.dtype.element_ty), mask=d < QL)
    elif part == 1:    # kv_a RMSNorm + k_pe RoPE -> the latent cache row
        slot = tl.load(slot_ptr + m).to(tl.int64)
        if slot >= 0:
            d = tl.arange(0, L)
            c = tl.load(y_ptr + m * s_y + QL + d).to(tl.float32)
            c = c * tl.rsqrt(tl.sum(c * c, 0) / L + eps) * tl.load(kvw_ptr + d).to(tl.float32)
            c = c.to(qc_ptr.dtype.element_ty)  # the norm's output rounding, then the cache's
            tl.store(cache_ptr + slot * (L + R) + d, c.to(cache_ptr.dtype.element_ty))
            r = tl.arange(0, R)
            kp = tl.load(y_ptr + m * s_y + QL + L + r).to(tl.float32)
            kpp = tl.load(y_ptr + m * s_y + QL + L + _partner(r, R, ROPE_IL)).to(tl.float32)
            kp = _rope_vec(kp, kpp, r, pos, inv_ptr, R, ROPE_IL)
            tl.store(cache_ptr + slot * (L + R) + L + r, kp.to(cache_ptr.dtype.element_ty))
    else:              # indexer key: LayerNorm + RoPE + fp8 quantisation -> the key cache row and its scale
        slot = tl.load(slot_ptr + m).to(tl.int64)
        if slot >= 0:
            d = tl.arange(0, D)
            x = tl.load(ik_ptr + m * s_ik + d).to(tl.float32)
            mean = tl.sum(x, 0) / D
            rstd = tl.rsqrt(tl.sum((x - mean) * (x - mean), 0) / D + ik_eps)
            p = _partner(d, R, INDEX_IL)
            xp = tl.load(ik_ptr + m * s_ik + p).to(tl.float32)
            k = (x - mean) * rstd * tl.load(ikw_ptr + d) + tl.load(ikb_ptr + d)
            kp = (xp - mean) * rstd * tl.load(ikw_ptr + p) + tl.load(ikb_ptr + p)
            k = _rope_vec(k, kp, d, pos, inv_i_ptr, R, INDEX_IL)
            q8, scale = _ue8m0_quantize(k, FMAX, EXACT)
            tl.store(kc_ptr + slot * D + d, q8)
            tl.store(ks_ptr + slot, scale)


def norm_rope_cache(positions: torch.Tensor, y: torch.Tensor, q_norm_w: torch.Tensor, kv_norm_w: torch.Tensor,
                    eps: float, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, inv_freq: torch.Tensor, *,
                    q_lora: int, rope_interleaved: bool, q_c: torch.Tensor,
                    index_k: torch.Tensor | None = None, index_k_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
                    index_k_eps: float = 1e-6, key_cache: torch.Tensor | None = None,
                    key_scales: torch.Tensor | None = None, index_inv_freq: torch.Tensor | None = None,
                    index_rope_interleaved: bool = False) -> torch.Tensor:
    """One launch (see the module docstring). ``y`` [M, q_lora + L + R] the fused q_a|kv_a projection (strided
    rows fine); ``kv_cache`` [blocks, block, L + R] written at ``slot_mapping`` (< 0: nothing); ``q_c`` [M, q_lora]
    out. Indexer layers: ``index_k`` [M, D] raw key (strided rows fine), LayerNorm (w, b) fp32, ``key_cache``
    [blocks, block, D] fp8 e4m3 and ``key_scales`` [blocks, block] fp32 written at the same slots."""
    M = y.shape[0]
    L = kv_cache.shape[-1] - inv_freq.shape[0] * 2
    R = inv_freq.shape[0] * 2
    has_index = index_k is not None
    if has_index:
        assert index_k_norm is not None and key_cache is not None and key_scales is not None
        assert index_inv_freq is not None and index_k.stride(-1) == 1
    ik = index_k if has_index else y
    ikw, ikb = index_k_norm if has_index else (inv_freq, inv_freq)
    D = key_cache.shape[-1] if has_index else 16
    _norm_rope_cache_kernel[(M, 3 if has_index else 2)](
        positions, y, y.stride(0), q_norm_w, kv_norm_w, q_c, eps, kv_cache, slot_mapping, inv_freq,
        ik, ik.stride(0), ikw, ikb, index_k_eps, key_cache if has_index else y,
        key_scales if has_index else y, index_inv_freq if has_index else inv_freq,
        QL=q_lora, BQ=triton.next_power_of_2(q_lora), L=L, R=R, D=D, ROPE_IL=rope_interleaved,
        INDEX_IL=index_rope_interleaved, FMAX=FP8_MAX, EXACT=_interpreting(), num_warps=4)
    return q_c


# ------------------------------------------------------------------------------------------ query rope + indexer q
@triton.jit
def _rope_q_index_kernel(pos_ptr, q_ptr, s_qm, s_qh, inv_ptr, iq_ptr, s_iqm, s_iqh, iw_ptr, s_iwm, iq8_ptr,
                         iwo_ptr, inv_i_ptr, w_scale, H, HI, NOPE: tl.constexpr, R: tl.constexpr,
                         D: tl.constexpr, ROPE_IL: tl.constexpr, INDEX_IL: tl.constexpr, FMAX: tl.constexpr,
                         EXACT: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    h = tl.program_id(2)
    pos = tl.load(pos_ptr + m)
    if part == 0:
        if h < H:      # q_pe RoPE, in place
            r = tl.arange(0, R)
            base = q_ptr + m * s_qm + h * s_qh + NOPE
            x = tl.load(base + r).to(tl.float32)
            xp = tl.load(base + _partner(r, R, ROPE_IL)).to(tl.float32)
            y = _rope_vec(x, xp, r, pos, inv_ptr, R, ROPE_IL)
            tl.debug_barrier()
            tl.store(base + r, y.to(q_ptr.dtype.element_ty))
    else:
        if h < HI:     # indexer query: RoPE of the leading channels, fp8 with one scale per head; weight scaled
            d = tl.arange(0, D)
            base = iq_ptr + m * s_iqm + h * s_iqh
            x = tl.load(base + d).to(tl.float32)
            xp = tl.load(base + _partner(d, R, INDEX_IL)).to(tl.float32)
            x = _rope_vec(x, xp, d, pos, inv_i_ptr, R, INDEX_IL)
            q8, scale = _ue8m0_quantize(x, FMAX, EXACT)
            tl.store(iq8_ptr + (m * HI + h) * D + d, q8)
            w = tl.load(iw_ptr + m * s_iwm + h).to(tl.float32)
            tl.store(iwo_ptr + m * HI + h, w * scale * w_scale)


def rope_q_index(positions: torch.Tensor, q: torch.Tensor, inv_freq: torch.Tensor, *, nope: int,
                 rope_interleaved: bool, index_q: torch.Tensor | None = None,
                 index_weights: torch.Tensor | None = None, index_inv_freq: torch.Tensor | None = None,
                 index_rope_interleaved: bool = False, weight_scale: float = 1.0,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """One launch. ``q`` [M, H, nope + R] (unit last stride): its rope part rotated in place. Indexer layers:
    ``index_q`` [M, h, D] raw (strided fine), ``index_weights`` [M, h] -> returns (fp8 queries [M, h, D], fp32
    weights [M, h] = w * q_scale * ``weight_scale``) (into ``out`` when given); else (None, None)."""
    M, H, _ = q.shape
    R = inv_freq.shape[0] * 2
    has_index = index_q is not None
    if has_index:
        HI, D = index_q.shape[1], index_q.shape[2]
        iq8, iwo = out if out is not None else (
            torch.empty(M, HI, D, device=q.device, dtype=torch.float8_e4m3fn),
            torch.empty(M, HI, device=q.device, dtype=torch.float32))
        iq, iw, inv_i = index_q, index_weights, index_inv_freq
    else:
        HI, D, iq8, iwo, iq, iw, inv_i = 0, 16, q, q, q.view(M, H, -1), q.view(M, -1), inv_freq
    _rope_q_index_kernel[(M, 2 if has_index else 1, max(H, HI))](
        positions, q, q.stride(0), q.stride(1), inv_freq, iq, iq.stride(0), iq.stride(1), iw, iw.stride(0), iq8, iwo,
        inv_i, weight_scale, H, HI, NOPE=nope, R=R, D=D, ROPE_IL=rope_interleaved, INDEX_IL=index_rope_interleaved,
        FMAX=FP8_MAX, EXACT=_interpreting(), num_warps=1)
    return (iq8, iwo) if has_index else (None, None)


# ------------------------------------------------------------------------------------------ indexer logits
@triton.jit
def _indexer_logits_kernel(q_ptr, w_ptr, kc_ptr, ks_ptr, bt_ptr, seq_ptr, out_ptr, s_bt, s_o, W, block_size,
                           H: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, F32: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1) * BN + tl.arange(0, BN)
    live = pos < tl.load(seq_ptr + b)
    blk = tl.load(bt_ptr + b * s_bt + pos // block_size, mask=live, other=0)
    row = blk.to(tl.int64) * block_size + pos % block_size
    d = tl.arange(0, D)
    h = tl.arange(0, H)
    k = tl.load(kc_ptr + row[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    q = tl.load(q_ptr + (b * H + h[:, None]) * D + d[None, :])
    if F32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))      # [H, BN], fp32 accumulation
    s = tl.maximum(s, 0.0) * tl.load(ks_ptr + row, mask=live, other=0.0)[None, :]
    logit = tl.sum(s * tl.load(w_ptr + b * H + h)[:, None], 0)
    tl.store(out_ptr + b * s_o + pos, tl.where(live, logit, float("-inf")), mask=pos < W)


def indexer_logits(q8: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, key_scales: torch.Tensor,
                   block_table: torch.Tensor, seq_lens: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """``out`` [B, W] fp32 (W >= the block table's positions is fine): the indexer logits of every cached token,
    ``-inf`` at positions >= ``seq_lens[b]``. q8 [B, h, D] fp8 contiguous; weights [B, h] fp32 (scales folded in);
    key_cache [blocks, block, D] fp8, key_scales [blocks, block] fp32; block_table [B, max_blocks] int32."""
    B, H, D = q8.shape
    W = out.shape[1]
    BN = 64
    _indexer_logits_kernel[(B, triton.cdiv(W, BN))](
        q8, weights, key_cache, key_scales, block_table, seq_lens, out, block_table.stride(0), out.stride(0), W,
        key_cache.shape[1], H=H, D=D, BN=BN, F32=_interpreting(), num_warps=4)
    return out


def topk_select(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-``k`` positions of each row (unsorted): ``torch.topk`` standing in for ``cooperative_topk``."""
    return torch.topk(logits, k, dim=-1, sorted=False)


# ------------------------------------------------------------------------------------------ top-k -> rows
@triton.jit
def _convert_kernel(idx_ptr, bt_ptr, seq_ptr, out_ptr, cnt_ptr, s_i, s_bt, s_o, block_size,
                    K: tl.constexpr, BK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BK)
    inb = j < K
    idx = tl.load(idx_ptr + b * s_i + j, mask=inb, other=-1).to(tl.int64)
    ok = (idx >= 0) & (idx < tl.load(seq_ptr + b)) & inb
    blk = tl.load(bt_ptr + b * s_bt + idx // block_size, mask=ok, other=0).to(tl.int64)
    rows = blk * block_size + idx % block_size
    n = tl.sum(ok.to(tl.int32), 0)
    dst = tl.cumsum(ok.to(tl.int32), 0) - 1                      # valid rows first, in selection order
    tl.store(out_ptr + b * s_o + dst, rows.to(tl.int32), mask=ok)
    tl.store(out_ptr + b * s_o + j, tl.full([BK], -1, tl.int32), mask=inb & (j >= n))
    tl.store(cnt_ptr + b, n)


def convert_topk(idx: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, *,
                 rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` [B, K] int32: the physical cache rows of the selected positions ``idx`` [B, K] (any int dtype;
    < 0 or >= seq_lens: none), valid ones first, -1 after; ``counts`` [B] int32 their number. One launch."""
    B, K = idx.shape
    _convert_kernel[(B,)](idx, block_table, seq_lens, rows, counts, idx.stride(0), block_table.stride(0),
                          rows.stride(0), block_size, K=K, BK=triton.next_power_of_2(K), num_warps=4)
    return rows, counts


# ------------------------------------------------------------------------------------------ torch oracles
def _rope_ref(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, interleaved: bool) -> torch.Tensor:
    from latency_specialized.ops.attention.sparse_mla import rotate_leading

    return rotate_leading(x, pos, inv, interleaved)


def fp8_quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, power-of-two scale per row of the last dim) of fp32 ``x``."""
    scale = (x.abs().amax(-1, keepdim=True).clamp(min=1e-4) / FP8_MAX).log2().ceil().exp2()
    return (x / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def norm_rope_cache_reference(positions, y, q_norm_w, kv_norm_w, eps, kv_cache, slot_mapping, inv_freq, *, q_lora,
                              rope_interleaved, index_k=None, index_k_norm=None, index_k_eps=1e-6, key_cache=None,
                              key_scales=None, index_inv_freq=None, index_rope_interleaved=False) -> torch.Tensor:
    """:func:`norm_rope_cache` in torch (writes the caches in place; returns q_c)."""
    from latency_specialized.ops.norm import rmsnorm_reference

    R = inv_freq.shape[0] * 2
    L = kv_cache.shape[-1] - R
    q_c = rmsnorm_reference(y[:, :q_lora], q_norm_w, eps)
    c = rmsnorm_reference(y[:, q_lora:q_lora + L], kv_norm_w, eps)
    kp = _rope_ref(y[:, None, q_lora + L:q_lora + L + R].float(), positions, inv_freq, rope_interleaved)[:, 0]
    live = slot_mapping >= 0
    slots = slot_mapping.long()[live]
    flat = kv_cache.view(-1, L + R)
    flat[slots] = torch.cat([c, kp.to(c.dtype)], -1)[live].to(kv_cache.dtype)
    if index_k is not None:
        w, b = index_k_norm
        k = torch.nn.functional.layer_norm(index_k.float(), (index_k.shape[-1],), w.float(), b.float(), index_k_eps)
        k = _rope_ref(k[:, None], positions, index_inv_freq, index_rope_interleaved)[:, 0]
        q8, s = fp8_quantize_reference(k)
        key_cache.view(torch.uint8).view(-1, k.shape[-1])[slots] = q8.view(torch.uint8)[live]  # fp8 index_put
        key_scales.view(-1)[slots] = s[live]
    return q_c


def rope_q_index_reference(positions, q, inv_freq, *, nope, rope_interleaved, index_q=None, index_weights=None,
                           index_inv_freq=None, index_rope_interleaved=False, weight_scale=1.0):
    """:func:`rope_q_index` in torch (rotates ``q`` in place)."""
    q[..., nope:] = _rope_ref(q[..., nope:].float(), positions, inv_freq, rope_interleaved).to(q.dtype)
    if index_q is None:
        return None, None
    iq = _rope_ref(index_q.float(), positions, index_inv_freq, index_rope_interleaved)
    q8, s = fp8_quantize_reference(iq)
    return q8, index_weights.float() * s * weight_scale


def indexer_logits_reference(q8, weights, key_cache, key_scales, block_table, seq_lens, width: int) -> torch.Tensor:
    """:func:`indexer_logits` in torch: [B, width] fp32."""
    B, bs = q8.shape[0], key_cache.shape[1]
    pos = torch.arange(width, device=q8.device)
    live = pos[None, :] < seq_lens.long()[:, None]
    blk = block_table.long().gather(1, (pos // bs).clamp(max=block_table.shape[1] - 1).expand(B, -1))
    rows = torch.where(live, blk * bs + pos % bs, 0)
    k = key_cache.view(-1, key_cache.shape[-1])[rows].float()                       # [B, W, D]
    s = torch.einsum("bhd,bwd->bhw", q8.float(), k).clamp(min=0) * key_scales.view(-1)[rows][:, None]
    return torch.einsum("bhw,bh->bw", s, weights.float()).masked_fill(~live, float("-inf"))


def convert_topk_reference(idx, block_table, seq_lens, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``idx`` [B, K] (< 0 or >= seq_lens: none) -> (physical rows [B, K] int32, valid first, -1 after;
    valid counts [B] int32), in torch."""
    idx = idx.long()
    ok = (idx >= 0) & (idx < seq_lens.long()[:, None])
    blk = block_table.long().gather(1, (idx.clamp(min=0) // block_size).clamp(max=block_table.shape[1] - 1))
    rows = torch.full_like(idx, -1, dtype=torch.int32)
    for b in range(idx.shape[0]):
        r = (blk[b] * block_size + idx[b] % block_size)[ok[b]]
        rows[b, :r.numel()] = r.to(torch.int32)
    return rows, ok.sum(-1).to(torch.int32)


def topk_rows_reference(logits, k: int, block_table, seq_lens, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_select` + :func:`convert_topk` in torch (``torch.topk`` over the valid positions, then the rows)."""
    pos = torch.arange(logits.shape[1], device=logits.device)
    masked = logits.masked_fill(pos[None, :] >= seq_lens.long()[:, None], float("-inf"))
    idx = torch.topk(masked, min(k, logits.shape[1]), dim=-1).indices
    return convert_topk_reference(idx, block_table, seq_lens, block_size)


# the device helpers and the RoPE oracle under public names (bench/stock/sparse_mqa_kernels.py calls them)
interpreting, partner, rope_vec, ue8m0_quantize, rope_reference = _interpreting, _partner, _rope_vec, _ue8m0_quantize, \
    _rope_ref
