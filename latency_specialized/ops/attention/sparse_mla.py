"""Sparse MLA decode (DSA-style): an indexer picks ``topk`` cached tokens, absorbed MLA attends to them.

Two families, one call each per layer:

``attention.indexer`` - the token selector (a "lightning indexer")::

    topk = indexer_topk(q, k, weights, k_cache, slot_mapping, block_table, seq_lens, topk=K, ...)

0. the new token's key ``k [B, D]`` (raw: a column slice of a projection) is normalised in fp32 when a
   norm weight is given: ``k_norm_kind="layer"`` (default; GLM-5.3) a LayerNorm (``k_norm_weight`` /
   ``k_norm_bias``, biased variance), ``"rms"`` (DeepSeek-V4.1-Flash) an RMSNorm
   ``k * rsqrt(mean(k^2) + eps) * k_norm_weight`` (no bias); the first
   ``2 len(rope_inv_freq)`` channels of it and of every query head ``q [B, h, D]`` are rotated by
   ``positions`` (NeoX rotate-half, or interleaved pairs); the key is rounded to the cache's dtype and
   written into the paged key cache ``k_cache [blocks, block_size, D]`` at ``slot_mapping`` (< 0: no
   write). ``k=None``: this call writes no key (a layer scoring against another layer's keys, or keys an
   earlier op of the step wrote: ``attention.sparse_mqa_compress_index``) - ``index_key_rows`` is step 0
   alone, for such ops;
1. every cached token ``t < seq_lens[b]`` (the new one included) is scored
   ``logit_t = scale * sum_h weights[b, h] relu(q[b, h] . k_t)`` (fp32; ``scale`` default
   ``D^-0.5 h^-0.5``: the softmax scale and the head-count scale vLLM folds into the weights - a
   positive scale does not change the selection, it matters to implementations with quantised scores);
2. ``topk [B, K]`` int32: the positions of the ``K`` largest logits (a set: the order is unspecified,
   ties broken arbitrarily); slots past ``seq_lens[b]`` hold -1 (short contexts, padding rows).

``attention.sparse_mla`` - absorbed MLA over the selected tokens: the ``attention.mla`` contract
(``ops/attention/mla.py``: optional RoPE of q's rope part and k_pe, kv_a norm, latent write, absorbed
query, ``W_UV`` up-projection, sigmoid gate) with one more argument, ``topk_indices [B, K]``: step 3
attends over the cached tokens at those positions only (entries < 0 or >= ``seq_lens[b]`` are skipped; none left: zeros). The softmax
over the gathered entries is the ``attention.sparse`` family's reference (``sparse_decode_reference``:
one shared KV head, the absorbed query ``[q_lat | q_pe]`` against the cached ``[c | k_pe]``, values the
first ``kv_lora`` columns), so the two families agree by construction.

Shapes are static (``K`` fixed, -1 masks short contexts). The indexer reference and
``attention.sparse_mla.torch_masked`` make no host sync (graph-capturable); the sparse MLA reference
reads the selection on the host through ``sparse_decode_reference``.

Semantics from vLLM 0.33 (``models/deepseek_v32/attention.py``: ``DeepseekV32Indexer``,
``DeepseekV32Attention.forward``; ``models/deepseek_v32/common/kernels.py``: ``_fused_norm_rope_kernel``
(the key's LayerNorm + RoPE of the first ``rope`` channels), ``_fused_q_kernel`` (query RoPE, the weights'
scales); DeepGEMM's paged MQA logits: ``max(q.k, 0) * w`` summed over heads). vLLM stores the key cache
and the query in fp8 with per-block scales; this contract is unquantised.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels.mla_common import finish_output, write_new_latents
from latency_specialized.ops.attention.mla import latent_widths, normed_latent, roped
from latency_specialized.ops.attention.sparse import sparse_decode_reference
from latency_specialized.ops.registry import Implementation, OpContext, always

__all__ = ["IMPLEMENTATIONS", "index_key_rows", "indexer_topk_reference", "rotate_leading", "sparse_mla_decode_masked",
           "sparse_mla_decode_reference"]


# ---------------------------------------------------------------------------------------------- indexer
def rotate_leading(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``x [B, heads, D]`` (fp32) with its first ``2 len(inv_freq)`` channels rotated at ``positions [B]``."""
    half = inv_freq.shape[0]
    rot = 2 * half
    ang = positions.float().view(-1, 1, 1) * inv_freq.float().view(1, 1, -1)          # [B, 1, rot/2]
    cos, sin = ang.cos(), ang.sin()
    r = x[..., :rot]
    if interleaved:
        x1, x2 = r[..., 0::2], r[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:
        x1, x2 = r[..., :half], r[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([out, x[..., rot:]], dim=-1)


def _check_k_norm_kind(k_norm_kind: str, k_norm_bias: torch.Tensor | None) -> None:
    """The indexer's key-norm kind is one the contract names, and an RMSNorm comes without a bias."""
    if k_norm_kind not in ("layer", "rms"):
        raise UserError(f"attention.indexer: k_norm_kind={k_norm_kind!r}; use 'layer' (LayerNorm) or 'rms' (RMSNorm)")
    if k_norm_kind == "rms" and k_norm_bias is not None:
        raise UserError("attention.indexer: k_norm_kind='rms' is an RMSNorm (weight only); drop k_norm_bias or "
                        "use k_norm_kind='layer'")


def index_key_rows(k: torch.Tensor, positions: torch.Tensor | None, rope_inv_freq: torch.Tensor | None,
                   rope_interleaved: bool, k_norm_weight: torch.Tensor | None, k_norm_bias: torch.Tensor | None,
                   k_norm_eps: float, k_norm_kind: Literal["layer", "rms"]) -> torch.Tensor:
    """Step 0 of the indexer contract: the new keys ``k [B, D]`` normed and rotated, fp32 ``[B, D]`` (the caller
    rounds them to the cache's dtype and writes them)."""
    _check_k_norm_kind(k_norm_kind, k_norm_bias)
    kf = k.float()
    if k_norm_weight is not None and k_norm_kind == "rms":
        kf = kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + k_norm_eps) * k_norm_weight.float()
    elif k_norm_weight is not None:
        mean = kf.mean(-1, keepdim=True)
        var = (kf - mean).pow(2).mean(-1, keepdim=True)
        kf = (kf - mean) * torch.rsqrt(var + k_norm_eps) * k_norm_weight.float()
        if k_norm_bias is not None:
            kf = kf + k_norm_bias.float()
    if rope_inv_freq is not None:
        if positions is None:
            raise UserError("attention.indexer: RoPE (rope_inv_freq) needs the tokens' positions")
        kf = rotate_leading(kf.unsqueeze(1), positions, rope_inv_freq, rope_interleaved).squeeze(1)
    return kf


def _context(flat: torch.Tensor, block_table: torch.Tensor, block: int, seq_lens: torch.Tensor):
    """(rows [B, n], valid [B, n]) of every position of every block table (no host sync)."""
    n_max = block_table.shape[1] * block
    pos = torch.arange(n_max, device=flat.device)
    rows = block_table[:, pos // block].long().clamp(min=0) * block + pos % block
    valid = pos.unsqueeze(0) < seq_lens.long().unsqueeze(1)
    return rows, valid


def indexer_topk_reference(q: torch.Tensor, k: torch.Tensor | None, weights: torch.Tensor, k_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                           topk: int, positions: torch.Tensor | None = None,
                           rope_inv_freq: torch.Tensor | None = None, rope_interleaved: bool = False,
                           k_norm_weight: torch.Tensor | None = None, k_norm_bias: torch.Tensor | None = None,
                           k_norm_eps: float = 1e-6, scale: float | None = None,
                           out: torch.Tensor | None = None,
                           k_norm_kind: Literal["layer", "rms"] = "layer",
                           cross_row_reads: bool = False) -> torch.Tensor:
    """The indexer's top-k (see the module docstring).

    Parameters
    ----------
    q : [B, h, D] raw indexer queries (rows may be strided). k : [B, D] raw key of the new token (None: no key
        written by this call; ``slot_mapping`` and the key norm are then not read).
    weights : [B, h] per-head weights (a projection of the hidden state; strided rows fine).
    k_cache : [num_blocks, block_size, D] paged key cache, written in place.
    slot_mapping, block_table, seq_lens : as ``attention.mla`` (seq_lens count the new token).
    topk : K, the static width of the result.
    positions : [B] token positions (needed with ``rope_inv_freq``).
    rope_inv_freq : [R/2] fp32 inverse frequencies of the rotated leading channels (None: no RoPE).
    k_norm_weight, k_norm_bias : [D] norm of the key (None: no norm); k_norm_eps its epsilon.
    scale : logit scale (default D^-0.5 h^-0.5). out : optional [B, K] int32 destination.
    k_norm_kind : ``"layer"`` (LayerNorm, optional bias) or ``"rms"`` (RMSNorm: weight only, a bias is an
        error), both in fp32 (module docstring, step 0).
    cross_row_reads : rows of the call read keys other rows write (a verification step): implementations then write
        every key before any row reads; the reference always does.

    Returns
    -------
    [B, K] int32 positions (-1: none). No host sync.
    """
    del cross_row_reads   # every key is written before any score below
    B, heads, D = q.shape
    if (k is not None and tuple(k.shape) != (B, D)) or tuple(weights.shape) != (B, heads) or k_cache.shape[-1] != D:
        raise UserError(f"attention.indexer: q {tuple(q.shape)}, k {None if k is None else tuple(k.shape)}, weights "
                        f"{tuple(weights.shape)}, cache width {k_cache.shape[-1]} do not fit one another")
    if topk < 1:
        raise UserError(f"attention.indexer: topk={topk}; use a positive width")
    _check_k_norm_kind(k_norm_kind, k_norm_bias)
    qf = q.float()
    if rope_inv_freq is not None:
        if positions is None:
            raise UserError("attention.indexer: RoPE (rope_inv_freq) needs the tokens' positions")
        qf = rotate_leading(qf, positions, rope_inv_freq, rope_interleaved)
    flat = k_cache.view(-1, D)
    if k is not None:
        kf = index_key_rows(k, positions, rope_inv_freq, rope_interleaved, k_norm_weight, k_norm_bias, k_norm_eps,
                            k_norm_kind)
        write_new_latents(flat, kf.to(k_cache.dtype), slot_mapping)
    rows, valid = _context(flat, block_table, k_cache.shape[1], seq_lens)
    ctx = torch.where(valid.unsqueeze(-1), flat[rows].float(), 0.0)                   # [B, n, D]
    dots = torch.einsum("bhd,btd->bht", qf, ctx).clamp(min=0)                          # relu(q . k)
    s = (D ** -0.5) * (heads ** -0.5) if scale is None else scale
    logits = torch.einsum("bht,bh->bt", dots, weights.float()) * s
    logits = logits.masked_fill(~valid, float("-inf"))
    kk = min(topk, logits.shape[1])
    vals, idx = torch.topk(logits, kk, dim=-1)
    idx = torch.where(vals > float("-inf"), idx, -1).to(torch.int32)
    if kk < topk:   # a block table shorter than K: the rest is -1
        idx = torch.cat([idx, idx.new_full((B, topk - kk), -1)], dim=-1)
    if out is not None:
        out.copy_(idx)
        return out
    return idx


# ---------------------------------------------------------------------------------------------- sparse MLA
def _absorbed(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, w_kv_b: torch.Tensor, nope: int, v: int, kv_norm_weight, kv_norm_eps,
              positions, rope_inv_freq, rope_interleaved):
    """RoPE and steps 0-2 of the MLA contract: (flat cache, absorbed query [B, H, L + R] fp32, w_uv [H, v, L], L)."""
    H, qk = q.shape[1], q.shape[2]
    q, k_pe = roped(q, k_pe, nope, positions, rope_inv_freq, rope_interleaved)
    kv_c = normed_latent(q, kv_c, kv_norm_weight, kv_norm_eps)
    L, R = latent_widths(q, kv_c, kv_cache, nope)
    flat = kv_cache.view(-1, L + R)
    write_new_latents(flat, torch.cat([kv_c, k_pe], dim=-1).to(kv_cache.dtype), slot_mapping)
    w = w_kv_b.float().view(H, nope + v, L)
    q_lat = torch.einsum("bhn,hnl->bhl", q[..., :nope].float(), w[:, :nope])
    return flat, torch.cat([q_lat, q[..., nope:].float()], dim=-1), w[:, nope:], L, qk


def _selected(flat: torch.Tensor, block_table: torch.Tensor, block: int, seq_lens: torch.Tensor,
              topk_indices: torch.Tensor):
    """(gathered entries [B, K, L + R] fp32 - zeros where invalid -, valid [B, K]) of the selection."""
    idx = topk_indices.long()
    valid = (idx >= 0) & (idx < seq_lens.long().unsqueeze(1))
    pos = idx.clamp(min=0)
    blk = block_table.long().gather(1, (pos // block).clamp(max=block_table.shape[1] - 1)).clamp(min=0)
    rows = blk * block + pos % block
    return torch.where(valid.unsqueeze(-1), flat[rows].float(), 0.0), valid


def sparse_mla_decode_reference(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                                slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                                w_kv_b: torch.Tensor, topk_indices: torch.Tensor, *, qk_nope_head_dim: int,
                                v_head_dim: int, scale: float | None = None, gate: torch.Tensor | None = None,
                                out: torch.Tensor | None = None, kv_norm_weight: torch.Tensor | None = None,
                                kv_norm_eps: float = 1e-6, positions: torch.Tensor | None = None,
                                rope_inv_freq: torch.Tensor | None = None, rope_interleaved: bool = False,
                                before_split: Callable[[], object] | None = None) -> torch.Tensor:
    """Absorbed MLA over the indexer's selection (the ``attention.mla`` arguments, RoPE ones included,
    plus ``topk_indices [B, K]`` int positions, -1 none). Returns [B, H * v] in q.dtype (fp32 math, one rounding). The
    softmax over the gathered entries is ``attention.sparse``'s reference (a host sync per call).
    ``before_split``: called before ``topk_indices`` is read (the join of the stream writing it; implementations may
    run what does not read the selection first - the latent write, the absorbed query)."""
    B, H, _ = q.shape
    flat, q_abs, w_uv, L, qk = _absorbed(q, kv_c, k_pe, kv_cache, slot_mapping, w_kv_b, qk_nope_head_dim,
                                         v_head_dim, kv_norm_weight, kv_norm_eps, positions, rope_inv_freq,
                                         rope_interleaved)
    if before_split is not None:
        before_split()
    ctx, valid = _selected(flat, block_table, kv_cache.shape[1], seq_lens, topk_indices)
    local = torch.where(valid, torch.arange(ctx.shape[1], device=q.device).unsqueeze(0), -1)
    o_lat = sparse_decode_reference(q_abs, ctx, local, scale=qk ** -0.5 if scale is None else scale, v_dim=L)
    o = torch.einsum("bhl,hvl->bhv", o_lat.float(), w_uv).reshape(B, H * v_head_dim)
    return finish_output(o, gate, q.dtype, out)


def sparse_mla_decode_masked(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                             slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                             w_kv_b: torch.Tensor, topk_indices: torch.Tensor, *, qk_nope_head_dim: int,
                             v_head_dim: int, scale: float | None = None, gate: torch.Tensor | None = None,
                             out: torch.Tensor | None = None, kv_norm_weight: torch.Tensor | None = None,
                             kv_norm_eps: float = 1e-6, positions: torch.Tensor | None = None,
                             rope_inv_freq: torch.Tensor | None = None, rope_interleaved: bool = False,
                             before_split: Callable[[], object] | None = None) -> torch.Tensor:
    """The reference's contract with masks instead of host-side selection: no host sync (graph-capturable),
    O(K) per sequence. Rows with no valid selection (padding) give 0."""
    B, H, _ = q.shape
    flat, q_abs, w_uv, L, qk = _absorbed(q, kv_c, k_pe, kv_cache, slot_mapping, w_kv_b, qk_nope_head_dim,
                                         v_head_dim, kv_norm_weight, kv_norm_eps, positions, rope_inv_freq,
                                         rope_interleaved)
    if before_split is not None:
        before_split()
    ctx, valid = _selected(flat, block_table, kv_cache.shape[1], seq_lens, topk_indices)
    s = torch.einsum("bhd,bkd->bhk", q_abs, ctx) * (qk ** -0.5 if scale is None else scale)
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    p = torch.where(valid.any(-1).view(B, 1, 1), torch.softmax(s, dim=-1), 0.0)
    o_lat = torch.einsum("bhk,bkl->bhl", p, ctx[..., :L])
    o = torch.einsum("bhl,hvl->bhv", o_lat, w_uv).reshape(B, H * v_head_dim)
    return finish_output(o, gate, q.dtype, out)


def _masked_supports(ctx: OpContext) -> bool | str:
    if not ctx.arch.startswith("sm_"):
        return "for CUDA-graph capture on GPUs; on the CPU the reference serves sparse MLA"
    return True


IMPLEMENTATIONS = [
    Implementation("attention.indexer", "attention.indexer.reference", indexer_topk_reference, always,
                   priority=-100, is_reference=True,
                   description="torch LayerNorm + RoPE + key write, relu-weighted scores over the block table, "
                               "torch.topk (no host sync)"),
    Implementation("attention.sparse_mla", "attention.sparse_mla.reference", sparse_mla_decode_reference, always,
                   priority=-100, is_reference=True,
                   description="absorbed MLA over the gathered top-k entries via attention.sparse's reference"),
    Implementation("attention.sparse_mla", "attention.sparse_mla.torch_masked", sparse_mla_decode_masked,
                   _masked_supports, priority=-50,
                   description="absorbed MLA over the gathered top-k entries, masked: no host sync; GPUs only"),
]
