"""attention.mla: one decode token of multi-head latent attention, absorbed form, paged latent cache.

Per sequence ``b`` and head ``h``, with ``W_UK[h]`` ``[nope, L]`` and ``W_UV[h]`` ``[v, L]`` the
key and value rows of ``kv_b_proj`` (``w_kv_b.view(H, nope + v, L)``, key rows first):

1. the new token's latent ``[c | k_pe]`` (``L + R`` values) is written into the paged cache at
   ``slot_mapping[b]`` (``block * block_size + offset``; a negative slot writes nothing);
2. the query is absorbed into latent space: ``q_lat = q_nope @ W_UK[h]`` ``[L]``;
3. over the ``seq_lens[b]`` cached tokens ``t`` (read through ``block_table[b]``):
   ``s_t = scale * (q_lat . c_t + q_pe . k_pe_t)``, ``p = softmax(s)``, ``o_lat = sum_t p_t c_t``;
4. ``o = W_UV[h] @ o_lat`` ``[v]``; with ``gate``: ``o *= sigmoid(gate)`` (Kimi K3's output gate).

This equals the expanded form (``k_t = [W_UK c_t | k_pe_t]``, ``v_t = W_UV c_t``) exactly in real
arithmetic; the absorbed form reads only the ``L + R`` cached values per token. There is no
RoPE here: a model with RoPE rotates ``q_pe`` and ``k_pe`` before the call (Kimi K3 is NoPE).
Rows with ``seq_lens == 0`` are batch padding: they write nothing and return zeros.
"""

from __future__ import annotations

import torch

from latency_specialized.ops.registry import Implementation, always


def mla_decode_reference(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                         w_kv_b: torch.Tensor, *, qk_nope_head_dim: int, v_head_dim: int,
                         scale: float | None = None, gate: torch.Tensor | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA decode for one token per sequence over a paged latent cache.

    Parameters
    ----------
    q : [B, H, nope + R] queries (after q_b_proj; the last R values are the rope part).
    kv_c : [B, L] RMS-normed latent of the new token. k_pe : [B, R] its rope key.
    kv_cache : [num_blocks, block_size, L + R] paged latent cache, written in place.
    slot_mapping : [B] int flat slot of the new token (< 0: write nothing, e.g. padding).
    block_table : [B, max_blocks] int blocks of each sequence.
    seq_lens : [B] int tokens in the cache per sequence, the new one included (0: padding row).
    w_kv_b : [H * (nope + v), L] kv_b_proj weight of this rank's heads (per head: nope key rows, then v rows).
    scale : softmax scale; default (nope + R) ** -0.5.
    gate : optional [B, H * v] output-gate logits; the output is multiplied by sigmoid(gate).
    out : optional [B, H * v] destination.

    Returns
    -------
    [B, H * v] in q.dtype. fp32 math, one rounding at the end. The reference loops over
    sequences and reads ``seq_lens`` on the host (a sync); GPU kernels must not.
    """
    B, H, qk = q.shape
    nope, v = qk_nope_head_dim, v_head_dim
    L = kv_c.shape[-1]
    R = qk - nope
    if kv_cache.shape[-1] != L + R:
        raise ValueError(f"kv_cache width {kv_cache.shape[-1]} != kv_lora {L} + rope {R}")
    scale = qk ** -0.5 if scale is None else scale
    block = kv_cache.shape[1]
    flat = kv_cache.view(-1, L + R)
    slots = slot_mapping.long()
    live = slots >= 0
    new = torch.cat([kv_c, k_pe], dim=-1).to(kv_cache.dtype)
    flat[slots[live]] = new[live]

    w = w_kv_b.float().view(H, nope + v, L)
    w_uk, w_uv = w[:, :nope], w[:, nope:]                       # [H, nope, L], [H, v, L]
    q_lat = torch.einsum("bhn,hnl->bhl", q[..., :nope].float(), w_uk)  # [B, H, L]
    q_pe = q[..., nope:].float()
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
    o = o.reshape(B, H * v)
    if gate is not None:
        o = o * torch.sigmoid(gate.float())
    y = o.to(q.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


IMPLEMENTATIONS = [
    Implementation("attention.mla", "attention.mla.reference", mla_decode_reference, always, priority=-100,
                   is_reference=True, description="per-sequence torch absorbed MLA over the paged latent cache"),
]
