"""Static decode inputs that CUDA graphs read, and the per-step bookkeeping as device ops.

A captured graph bakes in tensor addresses, so every per-step input lives in one preallocated
:class:`DecodeBuffers` of ``max_batch`` rows; a step of batch ``n`` uses rows ``[:bucket]`` and the
rows ``[n:bucket]`` are padding that points at a scratch state row (``pad_state``) and writes no KV
slot (``slot_mapping = -1``), so padded rows can never corrupt a live sequence.

What a CPU used to do per step - position + 1, sequence length, KV slot from the block table -
is :meth:`DecodeBuffers.metadata` and :meth:`DecodeBuffers.advance`: plain torch ops on device
tensors with no host reads, meant to be captured inside the step's graph. The host writes these
buffers only when the batch composition changes (:meth:`DecodeBuffers.load`) or when the KV
manager appends a block (:meth:`DecodeBuffers.set_block`).

Speculative decoding (``BufferSpec.spec_tokens = k > 0``): a verification step feeds each request
``1 + k`` tokens - ``tokens[b]`` (the last accepted one, at ``positions[b]``) then ``drafts[b]`` - and
``accepted[b]``, what the request's previous verification step accepted, which the step applies first
(``-1``: nothing pending). The program expands these per-request inputs to per-row metadata itself
(``runtime/step_meta.py``); the host writes the positions of every step (``load``), since only it knows
how many tokens were accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops import paged_slots


@dataclass(frozen=True)
class BufferSpec:
    """Sizes of the static decode inputs."""

    max_batch: int = 64
    """Rows of every per-sequence buffer (the largest graph bucket)."""
    max_blocks_per_seq: int = 1
    """Columns of the block table (context capacity = max_blocks_per_seq * block_size * dcp_world)."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    pad_state: int = 0
    """Recurrent-state row that padded rows read and write (reserve it: no live sequence may use it)."""
    spec_tokens: int = 0
    """Draft tokens per request of a verification step (speculative decoding); 0: plain decode steps."""
    dcp_world: int = 1
    """Ranks of a DCP group sharing the block table (decode context parallelism): one table block stands for
    ``block_size * dcp_world`` positions, so a sequence's capacity is ``dcp_world`` times the table's tokens
    (``slot_mapping`` stays the single-rank one: the DCP pieces derive their ranks' slots themselves)."""


class DecodeBuffers:
    """The static inputs of one decode step (one set per model runner).

    Attributes (all ``[max_batch]`` unless noted, on ``device``)
    ----------
    tokens : int64, input token of each sequence for this step.
    positions : int64, position of that token (0-based).
    seq_lens : int32, context length including this token (positions + 1; 0 on padding).
    slot_mapping : int64, KV-cache slot this token writes (-1 on padding).
    block_tables : int32 ``[max_batch, max_blocks_per_seq]``, KV blocks of each sequence.
    state_indices : int32, recurrent-state row of each sequence (``pad_state`` on padding).
    active : bool, True for live rows.
    drafts : int64 ``[max_batch, spec_tokens]``, the draft tokens a verification step checks after ``tokens``.
    accepted : int32, draft tokens the request's previous verification step accepted (vLLM's
        ``num_accepted_tokens - 1``); -1 where nothing is pending (fresh from prefill, padding).
    """

    def __init__(self, spec: BufferSpec, device: torch.device | str = "cpu"):
        if spec.max_batch < 1 or spec.max_blocks_per_seq < 1 or spec.block_size < 1:
            raise UserError(f"invalid buffer sizes {spec}: use positive max_batch, max_blocks_per_seq, block_size")
        self.spec = spec
        self.device = torch.device(device)
        B, nb = spec.max_batch, spec.max_blocks_per_seq
        kw = {"device": self.device}
        self.tokens = torch.zeros(B, dtype=torch.int64, **kw)
        self.positions = torch.zeros(B, dtype=torch.int64, **kw)
        self.seq_lens = torch.zeros(B, dtype=torch.int32, **kw)
        self.slot_mapping = torch.full((B,), -1, dtype=torch.int64, **kw)
        self.block_tables = torch.zeros(B, nb, dtype=torch.int32, **kw)
        self.state_indices = torch.full((B,), spec.pad_state, dtype=torch.int32, **kw)
        self.active = torch.zeros(B, dtype=torch.bool, **kw)
        self.drafts = torch.zeros(B, spec.spec_tokens, dtype=torch.int64, **kw)
        self.accepted = torch.full((B,), -1, dtype=torch.int32, **kw)
        self.num_active = 0
        """Live rows (host-side; set by :meth:`load`)."""
        self.host_max_position = -1
        """The largest live position of the next step, tracked on the host without reading the device:
        set by :meth:`load`, +1 per step the runner counts (:meth:`count_step`); -1 with no live row."""

    @property
    def capacity(self) -> int:
        """Tokens a sequence can hold: ``max_blocks_per_seq * block_size`` (times ``dcp_world``)."""
        return self.spec.max_blocks_per_seq * self.spec.block_size * self.spec.dcp_world

    def capacity_problem(self) -> str | None:
        """Why the next step cannot run (a live position - the last draft's, in a verification step - reaches
        the block-table capacity), or None.

        In-graph steps advance the positions themselves; past the capacity ``metadata`` would clamp the
        slot into the last block and the attention would read block-table columns that do not exist,
        so the runner refuses such a step instead (the host must finish or move those sequences)."""
        last = self.host_max_position + self.spec.spec_tokens
        if self.host_max_position >= 0 and last >= self.capacity:
            return (f"a sequence reached position {last}, the block-table capacity is "
                    f"{self.capacity} tokens ({self.spec.max_blocks_per_seq} blocks of {self.spec.block_size}): "
                    "finish it or load() the batch into larger buffers (raise max_blocks_per_seq)")
        return None

    def count_step(self) -> None:
        """Host bookkeeping of one decode step (the device advanced every live position by one)."""
        if self.num_active:
            self.host_max_position += 1

    # ------------------------------------------------------------------ host side (between steps)
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every static buffer by name (for snapshots around graph warm-up)."""
        return {"tokens": self.tokens, "positions": self.positions, "seq_lens": self.seq_lens,
                "slot_mapping": self.slot_mapping, "block_tables": self.block_tables,
                "state_indices": self.state_indices, "active": self.active, "drafts": self.drafts,
                "accepted": self.accepted}

    def load(self, tokens: Sequence[int] | torch.Tensor, positions: Sequence[int] | torch.Tensor,
             state_indices: Sequence[int] | torch.Tensor, block_tables: torch.Tensor | None = None) -> None:
        """Host write when the batch composition changes: rows ``[:n]`` live, the rest padding. Nothing is
        pending afterwards (``accepted`` -1 everywhere): :meth:`set_accepted` for requests that carry on.

        Parameters
        ----------
        tokens, positions, state_indices : ``n`` values each (input token, its position, state row).
        block_tables : optional ``[n, <= max_blocks_per_seq]`` int block ids (missing columns keep 0).
        """
        t = torch.as_tensor(tokens, dtype=torch.int64).flatten()
        p = torch.as_tensor(positions, dtype=torch.int64).flatten()
        s = torch.as_tensor(state_indices, dtype=torch.int32).flatten()
        n = t.numel()
        if not (p.numel() == n == s.numel()):
            raise UserError(f"load: tokens ({n}), positions ({p.numel()}) and state_indices ({s.numel()}) "
                            "must have one value per sequence")
        if n > self.spec.max_batch:
            raise UserError(f"load: batch {n} exceeds the static buffers ({self.spec.max_batch}); "
                            "larger batches run the stock path")
        if n and bool((s == self.spec.pad_state).any()):
            raise UserError(f"load: state row {self.spec.pad_state} is reserved for padding; "
                            "give live sequences other rows")
        if n and int(p.min()) < 0:
            raise UserError("load: positions must be >= 0")
        cap = self.capacity
        if n and int(p.max()) + self.spec.spec_tokens >= cap:  # a verification step's last draft included
            raise UserError(f"load: position {int(p.max()) + self.spec.spec_tokens} beyond the block-table capacity {cap}; "
                            "raise max_blocks_per_seq")
        B = self.spec.max_batch
        pad = B - n
        self.tokens.copy_(torch.cat([t, t.new_zeros(pad)]))
        self.positions.copy_(torch.cat([p, p.new_zeros(pad)]))
        self.state_indices.copy_(torch.cat([s, s.new_full((pad,), self.spec.pad_state)]))
        self.active.copy_(torch.arange(B) < n)
        self.accepted.fill_(-1)
        bt = torch.zeros(B, self.spec.max_blocks_per_seq, dtype=torch.int32)
        if block_tables is not None:
            bt_in = torch.as_tensor(block_tables, dtype=torch.int32)
            if bt_in.dim() != 2 or bt_in.shape[0] != n or bt_in.shape[1] > self.spec.max_blocks_per_seq:
                raise UserError(f"load: block_tables must be [{n}, <= {self.spec.max_blocks_per_seq}], "
                                f"got {list(bt_in.shape)}")
            bt[:n, : bt_in.shape[1]] = bt_in
        self.block_tables.copy_(bt)
        self.num_active = n
        self.host_max_position = int(p.max()) if n else -1
        self.metadata(B)  # seq_lens / slot_mapping consistent with the new rows

    def set_block(self, row: int, column: int, block: int) -> None:
        """Host write of one new KV block (the KV manager appended one for sequence ``row``)."""
        if not 0 <= row < self.spec.max_batch or not 0 <= column < self.spec.max_blocks_per_seq:
            raise UserError(f"set_block: row {row} / column {column} outside the block table "
                            f"[{self.spec.max_batch}, {self.spec.max_blocks_per_seq}]")
        self.block_tables[row, column] = block

    def set_tokens(self, tokens: torch.Tensor) -> None:
        """Copy externally sampled tokens (``[num_active]``) into the static input (no sync)."""
        n = tokens.numel()
        if n != self.num_active:
            raise UserError(f"set_tokens: got {n} tokens for {self.num_active} live sequences")
        self.tokens[:n].copy_(tokens.reshape(-1), non_blocking=True)

    def set_drafts(self, drafts: torch.Tensor) -> None:
        """Copy the draft tokens of the next verification step (``[num_active, spec_tokens]``; no sync)."""
        if tuple(drafts.shape) != (self.num_active, self.spec.spec_tokens):
            raise UserError(f"set_drafts: got {list(drafts.shape)}, the buffers take [{self.num_active}, "
                            f"{self.spec.spec_tokens}] (live sequences, BufferSpec.spec_tokens)")
        self.drafts[:self.num_active].copy_(drafts, non_blocking=True)

    def set_accepted(self, accepted: torch.Tensor | Sequence[int]) -> None:
        """Copy what each live request's previous verification step accepted (``[num_active]``, -1 ..
        spec_tokens; no sync for a device tensor). Padding rows keep -1."""
        a = torch.as_tensor(accepted, dtype=torch.int32).reshape(-1)
        if a.numel() != self.num_active:
            raise UserError(f"set_accepted: got {a.numel()} values for {self.num_active} live sequences")
        self.accepted[:self.num_active].copy_(a, non_blocking=True)

    # ------------------------------------------------------------------ device side (inside the graph)
    def metadata(self, rows: int) -> None:
        """Derive ``seq_lens`` and ``slot_mapping`` of rows ``[:rows]`` from positions and block tables.

        Device ops only (capturable). Padding gets seq_len 0 and slot -1. A position past the
        block-table capacity is clamped to the last column; the host must append blocks in time
        (:meth:`needs_block` tells it when).
        """
        paged_slots.decode_slots(self.positions[:rows], self.active[:rows], self.block_tables[:rows],
                                 self.spec.block_size, self.slot_mapping[:rows], self.seq_lens[:rows])

    def advance(self, rows: int, next_tokens: torch.Tensor | None = None) -> None:
        """End of a step: live rows move to the next position (and take ``next_tokens`` as input).

        Device ops only (capturable); padding rows stay where they are.

        Parameters
        ----------
        rows : bucket size of the step.
        next_tokens : optional ``[rows]`` int tokens sampled inside the graph (e.g. greedy argmax).
        """
        paged_slots.advance(self.positions[:rows], self.active[:rows], self.tokens[:rows],
                            None if next_tokens is None else next_tokens[:rows])
        # seq_lens / slot_mapping are derived at the start of the next step (``metadata``), after
        # any block the host appended in between.

    # ------------------------------------------------------------------ host helpers
    def needs_block(self, host_positions: Sequence[int]) -> list[int]:
        """Rows whose next position starts a block the table does not have yet (host bookkeeping).

        ``host_positions`` are the scheduler's own positions for the live rows (the host tracks
        them without reading the device); a row listed here needs :meth:`set_block` before the step.
        """
        bs = self.spec.block_size
        return [i for i, p in enumerate(host_positions) if p % bs == 0 and p > 0]
