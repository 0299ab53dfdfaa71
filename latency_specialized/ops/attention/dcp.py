"""attention.dcp: decode context parallelism - every sequence's KV cache split across W ranks by token.

Layout (vLLM's DCP convention, ``cp_kv_cache_interleave_size`` = ``interleave``, default 1): global
position ``t`` of a sequence lives on rank ``(t // interleave) % W``. Every rank holds the *same*
block table; one table block stands for ``block_size * W`` consecutive positions (a "virtual" block),
of which each rank stores its ``block_size`` in its own physical block of that id. Hence:

* rank ``r``'s local length is ``(n // (I W)) I + clamp(n % (I W) - r I, 0, I)`` (``local_seq_lens``);
* its ``j``-th local token is global position ``(j // I) I W + r I + j % I`` (``global_positions``) and
  sits at ``block_table[j // block_size]``, offset ``j % block_size`` - an ordinary paged cache of
  ``block_size``, so every single-rank attention op reads it unchanged, given the local lengths;
* the new token (position ``seq_lens - 1``) goes to its owner's slot, ``-1`` elsewhere
  (``local_slot_mapping``): the ops' "negative slot writes nothing" makes only the owner write it.

Every layout function is torch arithmetic on device tensors (no host read): CUDA-graph capturable.

One step on rank ``r`` (``dcp_gqa_decode`` / ``dcp_mla_decode``): local lengths and slots -> the
partial attention over the rank's slice, returning ``(o, lse)`` (``gqa_partial_reference``,
``gqa_partial_triton``, ``mla_partial_reference``) -> the merge across ranks
(``ops.attention.dcp_merge.dcp_merge_across``). Per-head sinks join the softmax denominator on rank
0 only: a sink counted on one rank is counted once after the merge. The MLA output gate and the
``W_UV`` up-projection are linear per head, so they commute with the LSE-weighted merge: each rank
projects its partial latent output first (fewer bytes to exchange when ``v_head_dim < kv_lora``) and
the gate is applied once, after the merge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels.mla_common import write_new_latents
from latency_specialized.ops.attention.dcp_merge import dcp_merge_across
from latency_specialized.ops.attention.gqa import write_kv_paged
from latency_specialized.ops.attention.mla import latent_widths, normed_latent, roped

__all__ = ["DcpGroup", "DcpLayout", "dcp_gqa_decode", "dcp_mla_decode", "global_positions", "gqa_partial_reference",
           "gqa_partial_triton", "local_seq_lens", "local_slot_mapping", "mla_partial_reference", "token_owner"]


@dataclass(frozen=True)
class DcpLayout:
    """Which rank of a DCP group this is, and how tokens are dealt to ranks."""

    world: int
    """DCP ranks that share every sequence's KV cache."""
    rank: int
    """This rank, in [0, world)."""
    interleave: int = 1
    """Consecutive positions dealt to one rank before the next (vLLM's ``cp_kv_cache_interleave_size``)."""

    def __post_init__(self):
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise UserError(f"DCP rank {self.rank} of a world of {self.world}: need 0 <= rank < world, world >= 1")
        if self.interleave < 1:
            raise UserError(f"DCP interleave {self.interleave}: use a positive number of positions (1: by token)")

    def check_block_size(self, block_size: int) -> None:
        """A physical block must hold whole interleave runs, else a run would straddle two table blocks."""
        if block_size % self.interleave:
            raise UserError(f"DCP: block_size {block_size} is not a multiple of interleave {self.interleave}: "
                            "pick an interleave that divides the cache's block size")


# ----------------------------------------------------------------------------------- layout math
def token_owner(positions: torch.Tensor, world: int, interleave: int = 1) -> torch.Tensor:
    """Rank that stores each global position (``positions`` >= 0)."""
    return torch.div(positions, interleave, rounding_mode="floor") % world


def local_seq_lens(seq_lens: torch.Tensor, layout: DcpLayout) -> torch.Tensor:
    """[B] tokens of each sequence on ``layout.rank`` (same dtype as ``seq_lens``; 0 stays 0)."""
    run = layout.world * layout.interleave
    rounds = torch.div(seq_lens, run, rounding_mode="floor")
    rest = (seq_lens % run - layout.rank * layout.interleave).clamp(min=0, max=layout.interleave)
    return rounds * layout.interleave + rest


def global_positions(local_index: torch.Tensor, layout: DcpLayout) -> torch.Tensor:
    """Global position of the ``local_index``-th token stored on ``layout.rank``."""
    I, W = layout.interleave, layout.world
    return torch.div(local_index, I, rounding_mode="floor") * (I * W) + layout.rank * I + local_index % I


def local_slot_mapping(positions: torch.Tensor, block_table: torch.Tensor, block_size: int,
                       layout: DcpLayout) -> torch.Tensor:
    """[B] flat slot (``block * block_size + offset``) of each row's token on ``layout.rank``, -1 where
    another rank owns it or the position is negative (batch padding). ``block_table`` is the group's
    shared table ([B, max_blocks], one entry per ``block_size * world`` positions)."""
    layout.check_block_size(block_size)
    I, W = layout.interleave, layout.world
    virtual = block_size * W
    pos = positions.long()
    live = pos >= 0
    p = pos.clamp(min=0)
    # a padding row may index past its table: clamp the column, the row is masked below
    col = torch.div(p, virtual, rounding_mode="floor").clamp(max=block_table.shape[1] - 1)
    blk = block_table.gather(1, col.unsqueeze(1)).squeeze(1).long()   # one id per row, not a copy of the table
    off = p % virtual
    mine = (torch.div(off, I, rounding_mode="floor") % W) == layout.rank
    local_off = torch.div(off, I * W, rounding_mode="floor") * I + off % I
    slot = blk * block_size + local_off
    return torch.where(live & mine, slot, torch.full_like(slot, -1))


# ----------------------------------------------------------------------------------- partial attention
def _lse_and_weights(s: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse [...], p [..., n]) of masked scores ``s`` [..., n] (``valid`` broadcastable), the optional sink
    [...] in the denominator only. No position and no sink: lse = -inf, p = 0 (not NaN)."""
    s = s.masked_fill(~valid, float("-inf"))
    full = s if sink is None else torch.cat([s, sink.unsqueeze(-1)], dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    finite = torch.isfinite(lse)
    p = torch.exp(s - torch.where(finite, lse, 0.0).unsqueeze(-1))
    return lse, torch.where(finite.unsqueeze(-1), p, 0.0)


def gqa_partial_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_table: torch.Tensor, seq_lens: torch.Tensor, *, scale: float | None = None,
                          sinks: torch.Tensor | None = None, k: torch.Tensor | None = None,
                          v: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                          window: int | None = None, layout: DcpLayout | None = None,
                          global_seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA decode over this rank's slice, unnormalised across ranks: ``(o, lse)``.

    Parameters
    ----------
    q : [B, H, D]; k_cache, v_cache : [num_blocks, block_size, KV, D] this rank's paged caches.
    block_table : [B, max_blocks]; seq_lens : [B] *local* lengths (``local_seq_lens``), 0: nothing here.
    sinks : optional [H] logits in the denominator (pass them on one rank of the group only).
    k, v : optional [B, KV, D] the new token, written at slot_mapping : [B] (< 0: not written here).
    window : attend to the last ``window`` *global* positions only; a local token's global position comes
        from ``layout`` and the window's end from ``global_seq_lens`` [B] (both required with a window).

    Returns
    -------
    o [B, H, D] fp32, softmax-normalised over the local keys (0 where there are none);
    lse [B, H] fp32, natural log-sum-exp of the local scores (+ sink), -inf with neither.
    The attention of ``gqa_decode_paged`` (masked over the whole table: no host sync, O(max context)).
    """
    if (k is None) != (slot_mapping is None) or (k is None) != (v is None):
        raise ValueError("attention.dcp: k, v and slot_mapping come together (the new token's KV write)")
    if k is not None:
        write_kv_paged(k_cache, v_cache, k, v, slot_mapping)
    B, H, D = q.shape
    kv_heads, block = k_cache.shape[2], k_cache.shape[1]
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    pos = torch.arange(block_table.shape[1] * block, device=q.device)
    rows = block_table[:, pos // block].long().clamp(min=0) * block + pos % block          # [B, n_max]
    valid = pos.unsqueeze(0) < seq_lens.long().unsqueeze(1)
    if window:
        if layout is None or global_seq_lens is None:
            raise ValueError("attention.dcp: a window over a DCP slice needs layout= and global_seq_lens=")
        valid &= global_positions(pos, layout).unsqueeze(0) >= global_seq_lens.long().unsqueeze(1) - window
    kf = torch.where(valid[..., None, None], k_cache.view(-1, kv_heads, D)[rows].float(), 0.0)
    vf = torch.where(valid[..., None, None], v_cache.view(-1, kv_heads, D)[rows].float(), 0.0)
    g = H // kv_heads
    s = torch.einsum("bkgd,btkd->bkgt", q.float().view(B, kv_heads, g, D), kf) * scale     # [B, KV, g, n_max]
    sink = None if sinks is None else sinks.float().view(1, kv_heads, g).expand(B, kv_heads, g)
    lse, p = _lse_and_weights(s, valid[:, None, None, :], sink)
    o = torch.einsum("bkgt,btkd->bkgd", p, vf).reshape(B, H, D)
    return o, lse.reshape(B, H)


def gqa_partial_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                       seq_lens: torch.Tensor, *, scale: float | None = None, sinks: torch.Tensor | None = None,
                       k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                       slot_mapping: torch.Tensor | None = None, num_splits: int | None = None,
                       window: int | None = None, layout: DcpLayout | None = None,
                       global_seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``gqa_partial_reference``'s contract on the Triton split-KV kernel (``attention.gqa.triton_splitkv``),
    which already forms the log-sum-exp for its own split merge and stores it on request. ``o`` is written
    in fp32 (the partial is rounded once, after the cross-rank merge). GPUs, or the Triton interpreter.
    No window: the kernel's window starts at ``seq_lens - window`` of the *local* positions, which on a
    DCP slice are not contiguous global positions."""
    from latency_specialized.kernels.gqa_decode_triton import gqa_decode_triton

    del layout, global_seq_lens   # the reference's window arguments: a window is refused below
    if window:
        raise UserError("attention.dcp: the Triton partial has no sliding window over a DCP slice: use "
                        "partial=gqa_partial_reference")
    B, H, D = q.shape
    o = torch.empty(B, H, D, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, H, device=q.device, dtype=torch.float32)
    gqa_decode_triton(q, k_cache, v_cache, block_table, seq_lens, scale=scale, sinks=sinks, k=k, v=v,
                      slot_mapping=slot_mapping, out=o, lse=lse, num_splits=num_splits)
    return o, lse


def mla_partial_reference(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                          w_kv_b: torch.Tensor, *, qk_nope_head_dim: int, v_head_dim: int,
                          scale: float | None = None, kv_norm_weight: torch.Tensor | None = None,
                          kv_norm_eps: float = 1e-6, project: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode over this rank's slice of the latent cache, unnormalised across ranks.

    Arguments as ``ops.attention.mla.mla_decode_reference`` (no gate, no ``out``: the gate is applied after
    the merge), with ``seq_lens`` the *local* lengths and ``slot_mapping`` the local slots (-1 on every
    rank but the new token's owner: only the owner writes its latent).

    Returns
    -------
    o : [B, H, v_head_dim] fp32 (``project``: the up-projected output) or [B, H, kv_lora] (the latent
        output, for a merge before ``W_UV``), softmax-normalised over the local keys (0 where none);
    lse : [B, H] fp32 natural log-sum-exp of the local scores, -inf where there are none.
    Masked over the whole block table: no host sync, O(max context), like ``mla_decode_paged``.
    """
    B, H, _ = q.shape
    nope, v = qk_nope_head_dim, v_head_dim
    kv_c = normed_latent(q, kv_c, kv_norm_weight, kv_norm_eps)
    L, R = latent_widths(q, kv_c, kv_cache, nope)
    w = w_kv_b.float().view(H, nope + v, L)
    q_lat = torch.einsum("bhn,hnl->bhl", q[..., :nope].float(), w[:, :nope])          # absorbed query [B, H, L]
    q_pe = q[..., nope:].float()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    flat = kv_cache.view(-1, L + R)
    write_new_latents(flat, torch.cat([kv_c, k_pe], dim=-1).to(kv_cache.dtype), slot_mapping)
    block = kv_cache.shape[1]
    pos = torch.arange(block_table.shape[1] * block, device=q.device)
    rows = block_table[:, pos // block].long().clamp(min=0) * block + pos % block
    valid = pos.unsqueeze(0) < seq_lens.long().unsqueeze(1)                            # [B, n_max]
    ctx = torch.where(valid.unsqueeze(-1), flat[rows].float(), 0.0)                    # [B, n_max, L + R]
    s = (torch.einsum("bhl,btl->bht", q_lat, ctx[..., :L])
         + torch.einsum("bhr,btr->bht", q_pe, ctx[..., L:])) * scale
    lse, p = _lse_and_weights(s, valid.unsqueeze(1), None)
    o_lat = torch.einsum("bht,btl->bhl", p, ctx[..., :L])
    if not project:
        return o_lat, lse
    return torch.einsum("bhl,hvl->bhv", o_lat, w[:, nope:]), lse


# ----------------------------------------------------------------------------------- one DCP step
Partial = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class DcpGroup:
    """What a decode program needs to run its paged attention split across a DCP group (``ComposedProgram(...,
    dcp=)``, ``StepContext.dcp``): this rank's layout, the group's communicator (``all_gather`` / ``all_reduce``),
    the merge method and the partial-attention implementations (the torch references by default;
    ``gqa_partial_triton`` is the GPU kernel for GQA without a window)."""

    layout: DcpLayout
    comm: Any
    merge: str = "allgather"
    gqa_partial: Partial = gqa_partial_reference
    mla_partial: Partial = mla_partial_reference

    def __post_init__(self):
        world = getattr(self.comm, "world_size", None)
        if world != self.layout.world:
            raise UserError(f"DCP group: the layout is for {self.layout.world} ranks but the communicator has "
                            f"{world}: give the DCP group's own communicator")
        if self.merge not in ("allgather", "rescale"):
            raise UserError(f"DCP merge {self.merge!r}: choose 'allgather' or 'rescale' (dcp_merge_across)")


def dcp_gqa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, *, layout: DcpLayout, comm, scale: float | None = None,
                   sinks: torch.Tensor | None = None, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                   window: int | None = None, merge: str = "allgather", partial: Partial = gqa_partial_reference,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``gqa_decode_reference`` over a KV cache split across a DCP group: every rank calls it alike.

    Parameters
    ----------
    q : [B, H, D] this step's queries, the same on every rank of the group.
    k_cache, v_cache : this rank's caches; block_table : [B, max_blocks] the group's shared table.
    seq_lens : [B] *global* lengths, the new token included (0: padding row).
    k, v : optional [B, KV, D] the new token (the same on every rank): only its owner stores it.
    layout : this rank's ``DcpLayout``; comm : the group's communicator (``all_gather``/``all_reduce``).
    window : the last ``window`` global positions only (``gqa_partial_reference``).
    merge : ``dcp_merge_across`` method. partial : ``gqa_partial_reference`` or ``gqa_partial_triton``.

    Returns
    -------
    [B, H, D] in q.dtype, equal on every rank to single-rank attention over the whole sequence.
    """
    lens = local_seq_lens(seq_lens, layout)
    write = {}
    if k is not None:
        write = dict(k=k, v=v, slot_mapping=local_slot_mapping(seq_lens.long() - 1, block_table,
                                                               k_cache.shape[1], layout))
    if window:
        write.update(window=window, layout=layout, global_seq_lens=seq_lens)
    o, lse = partial(q, k_cache, v_cache, block_table, lens, scale=scale,
                     sinks=sinks if layout.rank == 0 else None, **write)
    y, _ = dcp_merge_across(o, lse, comm, method=merge)
    y = y.to(q.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


def dcp_mla_decode(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                   block_table: torch.Tensor, seq_lens: torch.Tensor, w_kv_b: torch.Tensor, *, layout: DcpLayout,
                   comm, qk_nope_head_dim: int, v_head_dim: int, scale: float | None = None,
                   gate: torch.Tensor | None = None, kv_norm_weight: torch.Tensor | None = None,
                   kv_norm_eps: float = 1e-6, merge: str = "allgather", partial: Partial = mla_partial_reference,
                   positions: torch.Tensor | None = None, rope_inv_freq: torch.Tensor | None = None,
                   rope_interleaved: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``mla_decode_reference`` over a latent cache split across a DCP group: every rank calls it alike.

    Arguments as there, except: ``seq_lens`` are the *global* lengths; the slots are derived here
    (``local_slot_mapping`` of position ``seq_lens - 1``), so only the new token's owner writes its latent;
    ``block_table`` is the group's shared table; ``layout``/``comm``/``merge`` as ``dcp_gqa_decode``.
    ``positions`` / ``rope_inv_freq`` / ``rope_interleaved``: the RoPE of ``attention.mla`` (q's rope part and
    ``k_pe`` rotated first, ``ops.attention.mla.roped``: the reference's math and rounding).

    Returns
    -------
    [B, H * v_head_dim] in q.dtype, equal on every rank to single-rank MLA over the whole sequence.
    """
    q, k_pe = roped(q, k_pe, qk_nope_head_dim, positions, rope_inv_freq, rope_interleaved)
    slots = local_slot_mapping(seq_lens.long() - 1, block_table, kv_cache.shape[1], layout)
    o, lse = partial(q, kv_c, k_pe, kv_cache, slots, block_table, local_seq_lens(seq_lens, layout), w_kv_b,
                     qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, scale=scale,
                     kv_norm_weight=kv_norm_weight, kv_norm_eps=kv_norm_eps)
    y, _ = dcp_merge_across(o, lse, comm, method=merge)
    y = y.reshape(y.shape[0], -1)
    if gate is not None:  # after the merge: the gate is per output element, it commutes with the merge
        y = y * torch.sigmoid(gate.float())
    y = y.to(q.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y
