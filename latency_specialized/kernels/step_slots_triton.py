"""A decode step's paged-cache slots, each set in one launch: the step's ``slot_mapping`` / ``seq_lens`` from its
positions and block tables, a compression ratio's complete rows and the slot its closing token writes, a verification
step's rows, and the step's end (positions forward, sampled tokens in).

The torch forms (``decode_slots_reference``, ``compressed_slots_reference``, ``advance_reference``,
``verify_rows_reference``; what ``runtime.buffers.DecodeBuffers.metadata`` / ``advance``,
``runtime.step_meta.VerifyRows.fill`` and ``pieces.attention.sparse_mqa.compressed_slots`` run) are chains of small
elementwise kernels inside the step's CUDA graph - a gather, integer divisions and remainders, compares, wheres, dtype
copies - each a launch and a gap on a path every step waits on, although the data is a few hundred integers. These
kernels compute the same values in one launch a set: one program over all rows (a decode step has at most 64 x 8
rows; the verification rows take a program each, for their block-table rows). Integers only, so they equal the
references exactly. No host sync: capturable, and a replay reads the buffers' current positions, tables and lengths.

``STEP_SLOTS_KERNEL`` (on since session 51's GPU suite) routes the callers here on CUDA tensors; on the CPU they keep
the torch forms. Where the time goes before and after: ``NOTES_step_slots.md``.
"""

from __future__ import annotations

import functools
import os

import torch

from latency_specialized.errors import UserError

STEP_SLOTS_KERNEL = True
"""Compute the step's slots (``DecodeBuffers.metadata``), a ratio's compressed slots (``compressed_slots``), a
verification step's rows (``VerifyRows.fill``) and the step's end (``DecodeBuffers.advance``) with the kernels below on
CUDA tensors instead of the torch chains. False: the torch chains everywhere (the references)."""
MAX_ROWS = 4096
"""Rows one launch takes (one program; a decode step has far fewer)."""


def decode_slots_reference(positions: torch.Tensor, active: torch.Tensor, block_tables: torch.Tensor,
                           block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the flat slot of ``positions[r]`` in row ``r``'s blocks (``[R]`` int64; -1 where not ``active``) and
    the sequence length with that token (``[R]`` int32; 0 where not active). A position past the table is clamped to
    its last column (the host appends blocks in time). ``positions`` ``[R]`` int64, ``active`` ``[R]`` bool,
    ``block_tables`` ``[R, W]`` int32."""
    slot, seq = _position_slots(positions.unsqueeze(1), active.unsqueeze(1), block_tables, block_size)
    return slot.squeeze(1), seq.squeeze(1)


def _position_slots(pos: torch.Tensor, active: torch.Tensor, block_tables: torch.Tensor,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, T]`` positions of row ``r`` (``active`` broadcast to them) -> their flat slots in row ``r``'s blocks
    (int64, -1 where not active; the column clamped to the table) and the sequence lengths with them (int32, 0)."""
    col = torch.clamp(pos // block_size, max=block_tables.shape[1] - 1)
    slot = block_tables.gather(1, col).to(torch.int64) * block_size + pos % block_size
    return (torch.where(active, slot, torch.full_like(slot, -1)),
            torch.where(active, pos + 1, torch.zeros_like(pos)).to(torch.int32))


def slot_of(block_table: torch.Tensor, index: torch.Tensor, block_size: int, live: torch.Tensor) -> torch.Tensor:
    """Flat paged-cache slot of entry ``index [B]`` of each sequence's block table (``-1`` where not ``live``)."""
    idx = index.long().clamp(min=0)
    col = (idx // block_size).clamp(max=block_table.shape[1] - 1)
    blk = block_table.long().gather(1, col.unsqueeze(1)).squeeze(1)
    return torch.where(live, blk * block_size + idx % block_size, -1)


def compressed_slots_reference(seq_lens: torch.Tensor, block_table: torch.Tensor, ratio: int,
                               block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, from its sequence length: the complete compressed rows ``seq_c`` ``[R]`` int64 (and as int32), the
    flat slot of the compressed cache this token's group completes (``-1``: it completes none) and ``[R]`` slots of
    -1 (the key slot of layers that write no keys). Compressed row ``j`` sits at the slot of position ``j``."""
    seq = seq_lens.long()
    seq_c = seq // ratio
    done = (seq % ratio == 0) & (seq > 0)
    slot_c = slot_of(block_table, seq_c - 1, block_size, done)
    return seq_c, seq_c.to(torch.int32), slot_c, torch.full_like(slot_c, -1)


def advance_reference(positions: torch.Tensor, active: torch.Tensor, tokens: torch.Tensor,
                      next_tokens: torch.Tensor | None) -> None:
    """End of a step, in place: active rows move to the next position and take ``next_tokens`` (when given) as
    their input token; padding rows stay. ``positions`` / ``tokens`` ``[R]`` int64, ``active`` ``[R]`` bool,
    ``next_tokens`` ``[R]`` int."""
    positions.add_(active.to(torch.int64))
    if next_tokens is not None:
        tokens.copy_(torch.where(active, next_tokens.to(torch.int64), tokens))


def verify_rows_reference(tokens: torch.Tensor, drafts: torch.Tensor, positions: torch.Tensor, active: torch.Tensor,
                          block_tables: torch.Tensor, state_indices: torch.Tensor, block_size: int,
                          out: dict[str, torch.Tensor], offsets: torch.Tensor | None = None) -> None:
    """A verification step's per-row metadata (``runtime.step_meta``): request ``b``'s ``1 + k`` rows ``b * T + t``
    (``T = 1 + k``) get token ``tokens[b]`` then ``drafts[b, t - 1]``, position ``positions[b] + t``, its slot and
    ``seq_len`` (-1 / 0 where not active), request ``b``'s block-table row and state row. Inputs ``[B]`` (``drafts``
    ``[B, k]``, ``block_tables`` ``[B, W]``); ``out`` holds ``[B * T]`` tensors 'tokens', 'positions', 'slots',
    'seq_lens', 'row_states' and ``[B * T, W]`` 'block_table', written in place. ``offsets``: ``arange(T)`` int64
    on the device, made once by the caller (else one more launch per step)."""
    B, k = drafts.shape
    T = 1 + k
    pos = positions.unsqueeze(1) + (torch.arange(T, device=positions.device) if offsets is None else offsets)
    nb = block_tables.shape[1]
    slot, seq = _position_slots(pos, active.unsqueeze(1), block_tables, block_size)
    out["tokens"].view(B, T)[:, 0].copy_(tokens)
    out["tokens"].view(B, T)[:, 1:].copy_(drafts)
    out["positions"].copy_(pos.reshape(-1))
    out["slots"].copy_(slot.reshape(-1))
    out["seq_lens"].copy_(seq.reshape(-1))
    out["block_table"].view(B, T, nb).copy_(block_tables.unsqueeze(1).expand(B, T, nb))
    out["row_states"].view(B, T).copy_(state_indices.unsqueeze(1).expand(B, T))


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """The jitted kernels (one build per ``TRITON_INTERPRET`` setting)."""
    del interpret
    global tl, _table_slot
    import triton
    import triton.language as tl

    @triton.jit
    def _table_slot(block_table, r, ok, s_bt, index, block_size, W):
        # the flat slot of entry index (>= 0) of row r's blocks, the column clamped to the table
        col = tl.minimum(index // block_size, W - 1)
        blk = tl.load(block_table + r.to(tl.int64) * s_bt + col, mask=ok, other=0).to(tl.int64)
        return blk * block_size + index % block_size

    @triton.jit
    def decode_slots_kernel(positions, active, block_tables, slot_mapping, seq_lens, rows, s_bt, block_size, W,
                            BLOCK: tl.constexpr):
        r = tl.arange(0, BLOCK)
        ok = r < rows
        pos = tl.maximum(tl.load(positions + r, mask=ok, other=0).to(tl.int64), 0)
        act = tl.load(active + r, mask=ok, other=0) != 0
        slot = _table_slot(block_tables, r, ok, s_bt, pos, block_size, W)
        tl.store(slot_mapping + r, tl.where(act, slot, -1), mask=ok)
        tl.store(seq_lens + r, tl.where(act, pos + 1, 0).to(tl.int32), mask=ok)

    @triton.jit
    def compressed_slots_kernel(seq_lens, block_table, seq_c, seq_c32, slot_c, no_slot, rows, s_bt, ratio,
                                block_size, W, BLOCK: tl.constexpr):
        r = tl.arange(0, BLOCK)
        ok = r < rows
        seq = tl.maximum(tl.load(seq_lens + r, mask=ok, other=0).to(tl.int64), 0)
        n = seq // ratio
        done = (seq % ratio == 0) & (seq > 0)
        slot = _table_slot(block_table, r, ok, s_bt, tl.maximum(n - 1, 0), block_size, W)
        tl.store(seq_c + r, n, mask=ok)
        tl.store(seq_c32 + r, n.to(tl.int32), mask=ok)
        tl.store(slot_c + r, tl.where(done, slot, -1), mask=ok)
        tl.store(no_slot + r, tl.full([BLOCK], -1, tl.int64), mask=ok)

    @triton.jit
    def advance_kernel(positions, active, tokens, next_tokens, rows, HAS_NEXT: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.arange(0, BLOCK)
        ok = r < rows
        act = tl.load(active + r, mask=ok, other=0) != 0
        pos = tl.load(positions + r, mask=ok, other=0)
        tl.store(positions + r, pos + act.to(tl.int64), mask=ok)
        if HAS_NEXT:
            nxt = tl.load(next_tokens + r, mask=ok & act, other=0).to(tl.int64)
            tl.store(tokens + r, nxt, mask=ok & act)

    @triton.jit
    def verify_rows_kernel(tokens, drafts, positions, active, block_tables, state_indices, o_tokens, o_positions,
                           o_slots, o_seq_lens, o_table, o_states, s_dr, s_bt, block_size, W, T: tl.constexpr,
                           BLOCK_W: tl.constexpr):
        # one program per row b * T + t: its token, position, slot, length, state row and block-table row
        row = tl.program_id(0)
        b = row // T
        t = row % T
        pos = tl.maximum(tl.load(positions + b).to(tl.int64), 0) + t
        act = tl.load(active + b) != 0
        if t == 0:
            tok = tl.load(tokens + b)
        else:
            tok = tl.load(drafts + b.to(tl.int64) * s_dr + t - 1)
        tl.store(o_tokens + row, tok.to(tl.int64))
        tl.store(o_positions + row, pos)
        slot = _table_slot(block_tables, b, b >= 0, s_bt, pos, block_size, W)
        tl.store(o_slots + row, tl.where(act, slot, -1))
        tl.store(o_seq_lens + row, tl.where(act, pos + 1, 0).to(tl.int32))
        tl.store(o_states + row, tl.load(state_indices + b))
        for c0 in range(0, W, BLOCK_W):
            c = c0 + tl.arange(0, BLOCK_W)
            blocks = tl.load(block_tables + b.to(tl.int64) * s_bt + c, mask=c < W)
            tl.store(o_table + row.to(tl.int64) * W + c, blocks, mask=c < W)

    return {"decode": decode_slots_kernel, "compressed": compressed_slots_kernel, "advance": advance_kernel,
            "verify": verify_rows_kernel}


def _rows_block(rows: int, what: str) -> int:
    """The one program's row block for ``rows`` rows (UserError past ``MAX_ROWS``)."""
    if rows > MAX_ROWS:
        raise UserError(f"{what}: {rows} rows in one step; the kernel takes at most {MAX_ROWS} (MAX_ROWS)")
    return max(16, 1 << max(rows - 1, 0).bit_length())


def _launch_checks(rows: int, table: torch.Tensor, what: str) -> int:
    block = _rows_block(rows, what)
    if table.dim() != 2 or table.stride(1) != 1:
        raise UserError(f"{what}: the block table must be [rows, W] with unit column stride, got shape "
                        f"{tuple(table.shape)} strides {table.stride()}")
    return block


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def decode_slots_triton(positions: torch.Tensor, active: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                        slot_mapping: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """``decode_slots_reference`` into ``slot_mapping`` ``[R]`` int64 and ``seq_lens`` ``[R]`` int32 (contiguous),
    one launch."""
    rows = positions.shape[0]
    block = _launch_checks(rows, block_tables, "decode slots")
    if rows:
        _kernels(_interpret())["decode"][(1,)](positions, active, block_tables, slot_mapping, seq_lens, rows,
                                               block_tables.stride(0), block_size, block_tables.shape[1], BLOCK=block)


def compressed_slots_triton(seq_lens: torch.Tensor, block_table: torch.Tensor, ratio: int,
                            block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``compressed_slots_reference`` in one launch (new tensors: inside a graph they come from its pool)."""
    rows = seq_lens.shape[0]
    block = _launch_checks(rows, block_table, "compressed slots")
    if ratio < 1:
        raise UserError(f"compressed slots: ratio {ratio}; a compressed layer has a ratio of 1 or more")
    kw = {"device": seq_lens.device}
    seq_c, slot_c, no_slot = (torch.empty(rows, dtype=torch.int64, **kw) for _ in range(3))
    seq_c32 = torch.empty(rows, dtype=torch.int32, **kw)
    if rows:
        _kernels(_interpret())["compressed"][(1,)](seq_lens, block_table, seq_c, seq_c32, slot_c, no_slot, rows,
                                                   block_table.stride(0), ratio, block_size, block_table.shape[1],
                                                   BLOCK=block)
    return seq_c, seq_c32, slot_c, no_slot


def advance_triton(positions: torch.Tensor, active: torch.Tensor, tokens: torch.Tensor,
                   next_tokens: torch.Tensor | None) -> None:
    """``advance_reference`` in one launch (contiguous ``[R]`` tensors)."""
    rows = positions.shape[0]
    block = _rows_block(rows, "advance")
    if rows:
        nxt = tokens if next_tokens is None else next_tokens.contiguous()   # a view of the sampler's output
        _kernels(_interpret())["advance"][(1,)](positions, active, tokens, nxt, rows,
                                                HAS_NEXT=next_tokens is not None, BLOCK=block)


def verify_rows_triton(tokens: torch.Tensor, drafts: torch.Tensor, positions: torch.Tensor, active: torch.Tensor,
                       block_tables: torch.Tensor, state_indices: torch.Tensor, block_size: int,
                       out: dict[str, torch.Tensor]) -> None:
    """``verify_rows_reference`` in one launch (a program per row); ``out``'s tensors contiguous, 'block_table'
    ``[B * T, W]`` row-major."""
    B, k = drafts.shape
    rows = B * (1 + k)
    _launch_checks(rows, block_tables, "verification rows")
    if drafts.stride(1) != 1 or out["block_table"].stride() != (block_tables.shape[1], 1):
        raise UserError(f"verification rows: drafts {drafts.stride()} and the rows' block table "
                        f"{out['block_table'].stride()} must be row-major (unit column stride, no row padding)")
    if rows:
        W = block_tables.shape[1]
        _kernels(_interpret())["verify"][(rows,)](
            tokens, drafts, positions, active, block_tables, state_indices, out["tokens"], out["positions"],
            out["slots"], out["seq_lens"], out["block_table"], out["row_states"], drafts.stride(0),
            block_tables.stride(0), block_size, W, T=1 + k, BLOCK_W=min(1024, max(16, 1 << (W - 1).bit_length())))


def use_kernel(t: torch.Tensor) -> bool:
    """Whether the callers run the kernels for tensors on ``t``'s device (``STEP_SLOTS_KERNEL``, CUDA only)."""
    return STEP_SLOTS_KERNEL and t.is_cuda


__all__ = ["STEP_SLOTS_KERNEL", "advance_reference", "advance_triton", "compressed_slots_reference",
           "compressed_slots_triton", "decode_slots_reference", "decode_slots_triton", "slot_of", "use_kernel",
           "verify_rows_reference", "verify_rows_triton"]
