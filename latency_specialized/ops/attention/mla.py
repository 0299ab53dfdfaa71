"""attention.mla: one decode token of multi-head latent attention, absorbed form, paged latent cache.

Per sequence ``b`` and head ``h``, with ``W_UK[h]`` ``[nope, L]`` and ``W_UV[h]`` ``[v, L]`` the
key and value rows of ``kv_b_proj`` (``w_kv_b.view(H, nope + v, L)``, key rows first):

1. the new token's latent ``[c | k_pe]`` (``L + R`` values) is written into the paged cache at
   ``slot_mapping[b]`` (``block * block_size + offset``; a negative slot writes nothing);
2. the query is absorbed into latent space: ``q_lat = q_nope @ W_UK[h]`` ``[L]``;
3. over the ``seq_lens[b]`` cached tokens ``t`` (read through ``block_table[b]``):
   ``s_t = scale * (q_lat . c_t + q_pe . k_pe_t)``, ``p = softmax(s)``, ``o_lat = sum_t p_t c_t``;
4. ``o = W_UV[h] @ o_lat`` ``[v]``; with ``gate``: ``o *= sigmoid(gate)`` (Kimi K3's output gate).

With ``kv_norm_weight``, ``kv_c`` is the *raw* latent (the kv_a projection's first L columns) and the op
first RMS-normalises it exactly as the norm family's reference does (``ops.norm.rmsnorm_reference``:
fp32 math, one rounding to the activation dtype), so a model's ``kv_a_layernorm`` needs no launch of
its own: its only consumer is this op (the normed latent goes into the cache and is attended).

With ``positions`` [B] (int) and ``rope_inv_freq`` [R/2] (fp32) the op applies the model's RoPE first:
the query's rope part ``q[..., nope:]`` of every head and the new ``k_pe`` are rotated by
``positions[b] * rope_inv_freq`` exactly as ``ops.rope.apply_rope`` does (fp32 math, one rounding to
their dtype; ``rope_interleaved``: GPT-J / GLM pairs ``2i, 2i + 1``, else NeoX rotate-half), so the
cache holds the rotated rope key and step 3 uses the rotated ``q_pe`` - a model's RoPE needs no glue
launches between its projections and this op. Without them nothing rotates (NoPE MLA: Kimi K3; or a
caller that rotated already).

This equals the expanded form (``k_t = [W_UK c_t | k_pe_t]``, ``v_t = W_UV c_t``) exactly in real
arithmetic; the absorbed form reads only the ``L + R`` cached values per token.
Rows with ``seq_lens == 0`` are batch padding: they write nothing and return zeros.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# helpers every MLA implementation shares (these torch ones and the Triton kernel): kernel layer, re-exported
from latency_specialized.kernels.mla_common import (check_kv_norm, check_rope, finish_output, latent_widths,
                                                    normed_latent, write_new_latents)
from latency_specialized.ops.registry import Implementation, always
from latency_specialized.ops.rope import apply_rope

__all__ = ["IMPLEMENTATIONS", "check_kv_norm", "check_rope", "latent_widths", "mla_decode_paged",
           "mla_decode_reference", "normed_latent", "roped"]


def roped(q: torch.Tensor, k_pe: torch.Tensor, nope: int, positions: torch.Tensor | None,
          rope_inv_freq: torch.Tensor | None, rope_interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, k_pe)`` with q's rope part and k_pe rotated by ``ops.rope.apply_rope`` (the contract's RoPE step,
    a torch composition shared by the torch implementations of ``attention.mla`` and ``attention.sparse_mla``);
    unchanged without ``positions``."""
    if not check_rope(q, k_pe, nope, positions, rope_inv_freq):
        return q, k_pe
    assert positions is not None and rope_inv_freq is not None
    style = "interleaved" if rope_interleaved else "neox"
    q = torch.cat([q[..., :nope], apply_rope(q[..., nope:], positions, rope_inv_freq, style)], dim=-1)
    return q, apply_rope(k_pe.unsqueeze(1), positions, rope_inv_freq, style).squeeze(1)


class _Absorbed(NamedTuple):
    L: int
    v: int
    flat: torch.Tensor   # [slots, L + R] view of the paged cache
    new: torch.Tensor    # [B, L + R] the new tokens' latents in the cache dtype
    q_lat: torch.Tensor  # [B, H, L] fp32 query absorbed into latent space
    q_pe: torch.Tensor   # [B, H, R] fp32 rope part of the query
    w_uv: torch.Tensor   # [H, v, L] fp32 value rows of kv_b_proj
    scale: float


def _absorb(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, w_kv_b: torch.Tensor,
            nope: int, v: int, scale: float | None) -> _Absorbed:
    """Shape checks and the absorbed query, shared by the MLA implementations (steps 1-2 of the contract)."""
    H, qk = q.shape[1], q.shape[2]
    L, R = latent_widths(q, kv_c, kv_cache, nope)
    w = w_kv_b.float().view(H, nope + v, L)
    w_uk, w_uv = w[:, :nope], w[:, nope:]                                  # [H, nope, L], [H, v, L]
    q_lat = torch.einsum("bhn,hnl->bhl", q[..., :nope].float(), w_uk)      # [B, H, L]
    return _Absorbed(L, v, kv_cache.view(-1, L + R), torch.cat([kv_c, k_pe], dim=-1).to(kv_cache.dtype), q_lat,
                     q[..., nope:].float(), w_uv, qk ** -0.5 if scale is None else scale)


def mla_decode_reference(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                         w_kv_b: torch.Tensor, *, qk_nope_head_dim: int, v_head_dim: int,
                         scale: float | None = None, gate: torch.Tensor | None = None,
                         out: torch.Tensor | None = None, kv_norm_weight: torch.Tensor | None = None,
                         kv_norm_eps: float = 1e-6, positions: torch.Tensor | None = None,
                         rope_inv_freq: torch.Tensor | None = None, rope_interleaved: bool = False) -> torch.Tensor:
    """Absorbed MLA decode for one token per sequence over a paged latent cache.

    Parameters
    ----------
    q : [B, H, nope + R] queries (after q_b_proj; the last R values are the rope part).
    kv_c : [B, L] RMS-normed latent of the new token (raw, with ``kv_norm_weight``; rows may be strided,
        unit last stride: a column slice of the kv_a projection). k_pe : [B, R] its rope key.
    kv_cache : [num_blocks, block_size, L + R] paged latent cache, written in place.
    slot_mapping : [B] int flat slot of the new token (< 0: write nothing, e.g. padding).
    block_table : [B, max_blocks] int blocks of each sequence.
    seq_lens : [B] int tokens in the cache per sequence, the new one included (0: padding row).
    w_kv_b : [H * (nope + v), L] kv_b_proj weight of this rank's heads (per head: nope key rows, then v rows).
    scale : softmax scale; default (nope + R) ** -0.5.
    gate : optional [B, H * v] output-gate logits; the output is multiplied by sigmoid(gate).
    out : optional [B, H * v] destination.
    kv_norm_weight : optional [L] RMSNorm weight in q's dtype (kv_a_layernorm): ``kv_c`` is then the raw
        latent and is normalised first, ``rmsnorm_reference(kv_c, kv_norm_weight, kv_norm_eps)`` (fp32
        math, one rounding to q's dtype), before it is cached and attended. kv_c must be in q's dtype.
    kv_norm_eps : that norm's epsilon (the model's rms_norm_eps).
    positions : optional [B] int token positions (the new token's): with ``rope_inv_freq`` [R / 2] fp32 the
        rope parts of q and k_pe are rotated first (module docstring; ``rope_interleaved`` picks GLM's
        interleaved pairs over NeoX rotate-half). None: no rotation.

    Returns
    -------
    [B, H * v] in q.dtype. fp32 math, one rounding at the end. The reference loops over
    sequences and reads ``seq_lens`` on the host (a sync); GPU kernels must not.
    """
    B, H, _ = q.shape
    q, k_pe = roped(q, k_pe, qk_nope_head_dim, positions, rope_inv_freq, rope_interleaved)
    kv_c = normed_latent(q, kv_c, kv_norm_weight, kv_norm_eps)
    a = _absorb(q, kv_c, k_pe, kv_cache, w_kv_b, qk_nope_head_dim, v_head_dim, scale)
    L, v, flat, new, q_lat, q_pe, w_uv, scale = a.L, a.v, a.flat, a.new, a.q_lat, a.q_pe, a.w_uv, a.scale
    block = kv_cache.shape[1]
    slots = slot_mapping.long()
    live = slots >= 0
    flat[slots[live]] = new[live]
    o = torch.zeros(B, H, v, dtype=torch.float32, device=q.device)
    lens = seq_lens.tolist()
    for b in range(B):
        n = int(lens[b])
        if n <= 0:
            continue
        pos = torch.arange(n, device=q.device)
        rows = block_table[b, pos // block].long() * block + pos % block
        ctx = flat[rows].float()                                     # [n, L + R]
        s = (q_lat[b] @ ctx[:, :L].t() + q_pe[b] @ ctx[:, L:].t()) * scale  # [H, n]
        o_lat = torch.softmax(s, dim=-1) @ ctx[:, :L]                # [H, L]
        o[b] = torch.einsum("hl,hvl->hv", o_lat, w_uv)
    return finish_output(o.reshape(B, H * v), gate, q.dtype, out)


def mla_decode_paged(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     w_kv_b: torch.Tensor, *, qk_nope_head_dim: int, v_head_dim: int,
                     scale: float | None = None, gate: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, kv_norm_weight: torch.Tensor | None = None,
                     kv_norm_eps: float = 1e-6, positions: torch.Tensor | None = None,
                     rope_inv_freq: torch.Tensor | None = None, rope_interleaved: bool = False) -> torch.Tensor:
    """The reference's contract (same arguments and result) with no host sync: CUDA-graph capturable.

    Every sequence attends over all ``block_table.shape[1] * block_size`` positions of its block
    table with positions >= ``seq_lens[b]`` masked out (padding rows, ``seq_lens == 0``, give 0), so
    the work is O(max context) per step whatever the live lengths - a composition for capturing a
    whole decode step into one graph (Kimi K3's MLA layers), not a fast kernel. fp32 math, one
    rounding, like the reference; ``kv_norm_weight`` normalises the raw latent first and ``positions``
    rotate the rope parts (``apply_rope``), as there.
    """
    B, H, _ = q.shape
    q, k_pe = roped(q, k_pe, qk_nope_head_dim, positions, rope_inv_freq, rope_interleaved)
    kv_c = normed_latent(q, kv_c, kv_norm_weight, kv_norm_eps)   # no host sync: a torch composition
    a = _absorb(q, kv_c, k_pe, kv_cache, w_kv_b, qk_nope_head_dim, v_head_dim, scale)
    L, v, flat, q_lat, q_pe, w_uv, scale = a.L, a.v, a.flat, a.q_lat, a.q_pe, a.w_uv, a.scale
    block = kv_cache.shape[1]
    write_new_latents(flat, a.new, slot_mapping)
    n_max = block_table.shape[1] * block
    pos = torch.arange(n_max, device=q.device)
    # blocks past a sequence's end may hold any id (or -1): clamp to a valid row, masked below
    rows = block_table[:, pos // block].long().clamp(min=0) * block + pos % block   # [B, n_max]
    valid = pos.unsqueeze(0) < seq_lens.long().unsqueeze(1)                   # [B, n_max]
    # positions past the end may hold anything (NaN included): zero them so 0-weight * NaN cannot leak
    ctx = torch.where(valid.unsqueeze(-1), flat[rows].float(), 0.0)           # [B, n_max, L + R]
    s = (torch.einsum("bhl,btl->bht", q_lat, ctx[..., :L])
         + torch.einsum("bhr,btr->bht", q_pe, ctx[..., L:])) * scale          # [B, H, n_max]
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    # a padding row (seq_lens == 0) has no valid position: softmax is NaN there; its output is 0
    p = torch.where(valid.any(-1).view(B, 1, 1), torch.softmax(s, dim=-1), 0.0)
    o_lat = torch.einsum("bht,btl->bhl", p, ctx[..., :L])
    return finish_output(torch.einsum("bhl,hvl->bhv", o_lat, w_uv).reshape(B, H * v), gate, q.dtype, out)


def _paged_supports(ctx) -> bool | str:
    if not ctx.arch.startswith("sm_"):
        return ("for CUDA-graph capture on GPUs; on the CPU the reference serves MLA (it reads only the live "
                "context, this one the whole block table)")
    return True


IMPLEMENTATIONS = [
    Implementation("attention.mla", "attention.mla.reference", mla_decode_reference, always, priority=-100,
                   is_reference=True, description="per-sequence torch absorbed MLA over the paged latent cache"),
    Implementation("attention.mla", "attention.mla.torch_paged", mla_decode_paged, _paged_supports, priority=-50,
                   description="torch absorbed MLA masked over the whole block table: no host sync (graph-"
                               "capturable), O(max context) per step; GPUs only"),
]
