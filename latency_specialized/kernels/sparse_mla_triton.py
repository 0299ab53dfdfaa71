"""Sparse MLA decode (DSA-style) through the Triton split-KV MLA kernels: ``attention.sparse_mla.triton_splitkv``.

The contract is ``ops.attention.sparse_mla.sparse_mla_decode_reference``: the ``attention.mla`` call plus
``topk_indices [B, K]`` (int token positions chosen by the indexer; < 0 or >= ``seq_lens[b]``: skipped;
none left: zeros). ``attention.sparse_mla.torch_masked`` is the sync-free torch composition this replaces
(it gathers the K rows in fp32 and runs about 20 launches).

The three launches are ``kernels/mla_decode_triton.py``'s (``launch_mla_decode``), unchanged but for
the split kernel's ``SPARSE`` flag: the prologue (RoPE of q_pe and k_pe + kv_a RMSNorm + latent write +
absorbed query) and the merge (log-sum-exp over the splits + ``W_UV`` + gate + one rounding) are the
dense ones. In the split kernel a program takes a contiguous chunk of the K *selection slots* of its row
instead of a chunk of positions; per tile it loads ``BLOCK_N`` slots of ``topk_indices[b]``, masks the invalid ones, gathers
the rows ``block_table[b, idx // block_size] * block_size + idx % block_size`` and runs the same online
softmax. Every row has K slots whatever its length, so the split count is static and sized to K
(``choose_sparse_splits``), not to the block-table capacity, and the merge's live split count is K's,
not ``seq_lens``': a tile or a whole split without a valid slot contributes exact zeros (its max stays
-inf), a row without any (padding, ``seq_lens == 0``) gives exact zeros.

Same roundings as the dense kernel (q_lat and p to the activation/cache dtype for the tensor-core dots,
fp32 accumulation, one rounding of the output), so a bf16 tolerance against the fp32 reference; fp32
tensors give fp32 throughout (the CPU tests, under the Triton interpreter). No host sync: the call
captures into a CUDA graph and replays for any selection, ``seq_lens``, ``slot_mapping`` and cache.
Design and what has not run on a GPU yet: ``NOTES_sparse_mla.md``.
"""

from __future__ import annotations

from typing import Callable

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.kernels.mla_decode_triton import launch_mla_decode, shape_problems
from latency_specialized.kernels.triton_common import triton_gpu_refusal

NAME = "attention.sparse_mla.triton_splitkv"
FALLBACK = "attention.sparse_mla.torch_masked"
"""What the errors point to: the sync-free torch implementation of the same family."""


def sparse_mla_decode_triton(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                             slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                             w_kv_b: torch.Tensor, topk_indices: torch.Tensor, *, qk_nope_head_dim: int,
                             v_head_dim: int, scale: float | None = None, gate: torch.Tensor | None = None,
                             out: torch.Tensor | None = None, kv_norm_weight: torch.Tensor | None = None,
                             kv_norm_eps: float = 1e-6, num_splits: int | None = None,
                             fused: bool | None = None, positions: torch.Tensor | None = None,
                             rope_inv_freq: torch.Tensor | None = None, rope_interleaved: bool = False,
                             before_split: Callable[[], object] | None = None) -> torch.Tensor:
    """Absorbed MLA decode over the indexer's selection (contract:
    ``ops.attention.sparse_mla.sparse_mla_decode_reference``), one token per sequence.

    Parameters
    ----------
    q : [B, H, nope + R]; kv_c : [B, L] (rows may be strided, unit last stride); k_pe : [B, R];
    kv_cache : [num_blocks, block_size, L + R] paged latent cache (bf16/fp16/fp32, contiguous), written in place
        (the new token's latent, at ``slot_mapping``, before the attention reads the selection);
    slot_mapping : [B] int (< 0: write nothing); block_table : [B, max_blocks] int;
    seq_lens : [B] int (new token included; 0: padding row -> zeros);
    w_kv_b : [H * (nope + v), L];
    topk_indices : [B, K] int32/int64 token positions (order free; -1 or >= seq_lens[b]: skipped; a row with
        no valid entry -> zeros); rows may be strided (unit last stride, else copied);
    scale : default (nope + R) ** -0.5; gate : optional [B, H * v] logits; out : optional [B, H * v];
    kv_norm_weight : optional [L] in q.dtype (kv_c raw, RMS-normalised inside the prologue); kv_norm_eps;
    num_splits : splits of the K slots per sequence; default ``choose_sparse_splits`` (static). Tests force it.
    fused : as ``mla_decode_triton`` (False: the torch latent write and epilogue around the split kernel).
    positions, rope_inv_freq, rope_interleaved : the contract's optional RoPE of q's rope part and k_pe
        (``[B]`` int, ``[R / 2]`` fp32); fused, inside the shared prologue kernel (no extra launch).
    before_split : the contract's optional hook, called once the selection is needed - here after the prologue's
        launch (the latent write and the absorbed query do not read it), before the split kernel's: the join of the
        stream that writes ``topk_indices`` (then it must have a unit last stride).

    Returns
    -------
    [B, H * v] in q.dtype (``out`` when given). No host sync: CUDA-graph capturable.
    """
    B = q.shape[0]
    if topk_indices.dim() != 2 or topk_indices.shape[0] != B:
        raise UserError(f"{NAME}: topk_indices has shape {tuple(topk_indices.shape)}, needs [B={B}, K] "
                        "(the indexer's selection, one row per sequence)")
    if topk_indices.shape[1] < 1:
        raise UserError(f"{NAME}: topk_indices has no column (K=0); pass the indexer's [B, K] selection")
    if topk_indices.dtype not in (torch.int32, torch.int64):
        raise UserError(f"{NAME}: topk_indices dtype {topk_indices.dtype}; pass int32 (the indexer's) or int64 "
                        "token positions")
    if topk_indices.device != q.device:
        raise UserError(f"{NAME}: topk_indices is on {topk_indices.device}, q on {q.device}")
    return launch_mla_decode(q, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, w_kv_b,
                             qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, scale=scale, gate=gate,
                             out=out, num_splits=num_splits, fused=fused, kv_norm_weight=kv_norm_weight,
                             kv_norm_eps=kv_norm_eps, topk_indices=topk_indices, name=NAME, fallback=FALLBACK,
                             positions=positions, rope_inv_freq=rope_inv_freq, rope_interleaved=rope_interleaved,
                             before_split=before_split)


def _supports(ctx: OpContext) -> Support:
    refusal = triton_gpu_refusal(ctx, "sparse MLA", min_sm=80)
    if refusal:
        return refusal
    try:
        L, R = ctx.dim("kv_lora"), ctx.dim("rope")
    except KeyError:  # a site without the dims: the call checks them and names the fix
        return True
    problems = shape_problems(L, R)
    if problems:
        return "; ".join(problems) + f" (the MLA split kernel's tiles): {FALLBACK} serves it"
    try:
        topk = ctx.dim("topk")
    except KeyError:
        return True
    return True if topk >= 1 else f"topk {topk}: an empty selection (use a positive indexer width)"


IMPLEMENTATIONS = [
    Implementation("attention.sparse_mla", NAME, sparse_mla_decode_triton, _supports, priority=10,
                   description="Triton split-KV absorbed MLA over the indexer's top-k rows of the paged latent "
                               "cache (the MLA kernels, split kernel gathering the selection; splits sized to K): "
                               "no host sync (graph-capturable); GPUs sm_80+, pow2 kv_lora/rope >= 16"),
]

__all__ = ["FALLBACK", "IMPLEMENTATIONS", "NAME", "sparse_mla_decode_triton"]
