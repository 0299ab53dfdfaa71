"""A decode step's paged-cache slots: every model's ``slot_mapping`` / ``seq_lens`` (``DecodeBuffers.metadata``), a
compression ratio's compressed rows and slots (sparse MQA's compressed layers, once per step and ratio), a
verification step's rows (``runtime.step_meta.VerifyRows``) and the step's end (``DecodeBuffers.advance``: positions
and input tokens).

The torch references, or on CUDA tensors with ``kernels.step_slots_triton.STEP_SLOTS_KERNEL`` on, one Triton launch
each instead of their chains of small kernels (``kernels/step_slots_triton.py``). Both are exact (integers).
"""

from __future__ import annotations

import torch

from latency_specialized.kernels import step_slots_triton as kernels


def decode_slots(positions: torch.Tensor, active: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                 slot_mapping: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """``slot_mapping [R]`` int64 <- the flat slot of each row's position (-1 where not ``active``), ``seq_lens [R]``
    int32 <- position + 1 (0 where not active); ``positions [R]`` int64, ``active [R]`` bool, ``block_tables [R, W]``
    int32 (``kernels.step_slots_triton.decode_slots_reference``)."""
    if kernels.use_kernel(positions):
        kernels.decode_slots_triton(positions, active, block_tables, block_size, slot_mapping, seq_lens)
        return
    slot, seq = kernels.decode_slots_reference(positions, active, block_tables, block_size)
    slot_mapping.copy_(slot)
    seq_lens.copy_(seq)


def advance(positions: torch.Tensor, active: torch.Tensor, tokens: torch.Tensor,
            next_tokens: torch.Tensor | None) -> None:
    """End of a step, in place: active rows' ``positions [R]`` + 1 and, with ``next_tokens [R]``, their ``tokens``
    replaced (``kernels.step_slots_triton.advance_reference``)."""
    if kernels.use_kernel(positions):
        kernels.advance_triton(positions, active, tokens, next_tokens)
    else:
        kernels.advance_reference(positions, active, tokens, next_tokens)


def verify_rows(tokens: torch.Tensor, drafts: torch.Tensor, positions: torch.Tensor, active: torch.Tensor,
                block_tables: torch.Tensor, state_indices: torch.Tensor, block_size: int,
                out: dict[str, torch.Tensor], offsets: torch.Tensor | None = None) -> None:
    """A verification step's per-row metadata into ``out`` (``kernels.step_slots_triton.verify_rows_reference``:
    request ``b``'s ``1 + k`` rows with their tokens, positions, slots, lengths, block-table rows and state rows;
    ``offsets``: the torch form's ``arange(1 + k)``)."""
    if kernels.use_kernel(positions):
        kernels.verify_rows_triton(tokens, drafts, positions, active, block_tables, state_indices, block_size, out)
    else:
        kernels.verify_rows_reference(tokens, drafts, positions, active, block_tables, state_indices, block_size,
                                      out, offsets)


def compressed_slots(seq_lens: torch.Tensor, block_table: torch.Tensor, ratio: int,
                     block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, from ``seq_lens [R]``: complete compressed rows ``seq_c`` (int64, and int32), the flat slot of the
    compressed cache this token's group completes (-1: none) and ``[R]`` slots of -1
    (``kernels.step_slots_triton.compressed_slots_reference``)."""
    if kernels.use_kernel(seq_lens):
        return kernels.compressed_slots_triton(seq_lens, block_table, ratio, block_size)
    return kernels.compressed_slots_reference(seq_lens, block_table, ratio, block_size)


__all__ = ["advance", "compressed_slots", "decode_slots", "verify_rows"]
