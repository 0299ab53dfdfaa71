"""One DCP rank's share of a model's decode states (decode context parallelism, ``ops/attention/dcp.py``).

A DCP group splits every sequence's paged KV cache by token: global position ``t`` lives on rank
``(t // I) % W`` at local index ``j = (t // (I W)) I + t % I``, stored where an ordinary paged cache of the
group's block table keeps its ``j``-th token. :func:`dcp_rank_states` makes that share from states holding whole
sequences (a reference's prefill): the paged states keep only this rank's tokens, in a cache ``W`` times
shorter per sequence; the 'rows' states (recurrences, rings, tapes) are per sequence, not per token, so every
rank keeps them whole.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.attention.dcp import DcpLayout, global_positions, local_seq_lens
from latency_specialized.runtime.states import ModelStates, SeqSlot, copy_slot_states


def dcp_capacity(max_len: int, layout: DcpLayout) -> int:
    """Tokens the fullest rank (rank 0) holds of a sequence of ``max_len`` (``local_seq_lens``)."""
    return int(local_seq_lens(torch.tensor([max_len]), DcpLayout(layout.world, 0, layout.interleave))[0])


def dcp_rank_states(model: Any, states: ModelStates, lengths: Sequence[int], layout: DcpLayout,
                    max_len: int) -> ModelStates:
    """This rank's states of ``states`` (whole sequences, one per slot, ``lengths[i]`` tokens cached in slot
    ``i``): fresh states for ``len(states.slots)`` sequences of up to ``max_len`` tokens each, with the same
    state rows, holding only this rank's tokens in the paged states (:func:`dcp_capacity` per sequence) and
    copies of the per-row states."""
    if states.block_size is None:
        raise UserError("DCP splits paged states by token: these states have none (nothing to split)")
    layout.check_block_size(states.block_size)
    if len(lengths) != len(states.slots):
        raise UserError(f"{len(lengths)} lengths for {len(states.slots)} sequences: give one per slot")
    paged = [t for i, by in states.by_layer.items() for n, t in by.items() if states.decls[i][n].kind == "paged"]
    dtype = paged[0].dtype if paged else torch.float32
    out = ModelStates.allocate(model, len(states.slots), dcp_capacity(max_len, layout), tp=states.tp,
                               block_size=states.block_size, dtype=dtype, device=states.device,
                               num_rows=max(s.row for s in states.slots) + 1)
    # the same state row per sequence: the step's rows address both alike
    out.slots = [SeqSlot(row=src.row, blocks=dst.blocks) for dst, src in zip(out.slots, states.slots)]
    bs = states.block_size
    for slot_src, slot_dst, n in zip(states.slots, out.slots, lengths):
        if n > len(slot_src.blocks) * bs:
            raise UserError(f"a sequence of {n} tokens in a slot of {len(slot_src.blocks) * bs}")
        j = torch.arange(int(local_seq_lens(torch.tensor([n]), layout)[0]))   # this rank's tokens, local order
        t = global_positions(j, layout)
        src_rows = _flat_slots(slot_src.blocks, t, bs).to(states.device)
        dst_rows = _flat_slots(slot_dst.blocks, j, bs).to(states.device)

        def tokens(a: torch.Tensor, b: torch.Tensor, dst_rows=dst_rows, src_rows=src_rows) -> None:
            a.view(-1, *a.shape[2:])[dst_rows] = b.view(-1, *b.shape[2:])[src_rows]

        copy_slot_states(out, states, slot_dst, slot_src, tokens)
    return out


def _flat_slots(blocks: Sequence[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots (``block * block_size + offset``) of a sequence's ``positions`` in its ``blocks``."""
    table = torch.tensor(blocks, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


__all__ = ["dcp_capacity", "dcp_rank_states"]
