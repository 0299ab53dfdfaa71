"""Protocol-level emulation of the fused all-reduce kernels in plain torch.

Runs the exact protocol of ``kernels/allreduce_lamport.py`` and ``kernels/allreduce_two_stage.py``
- same slot rotation, same word layout, same sentinel, same -0.0 rewrite, same clearing of the
previous slot by its dirty extent, same rank-order fp32 sums and single rounding - with whole-row
torch ops instead of threads, over a :class:`SymmetricMemoryCommunicator` whose buffers are
``/dev/shm`` files (CPU) or peer-mapped CUDA memory. Ranks are real processes that never
synchronise except through the data, so CPU tests exercise the ordering argument of the design
(a rank may run several calls ahead of a slow peer's reads) without a GPU.

Spinning reads time out (``timeout`` seconds) with an error naming the call and slot, instead
of hanging a test.
"""

from __future__ import annotations

import time

import torch

from latency_specialized.comm import layout as L
from latency_specialized.kernels.norm_reference import rmsnorm_reference

_TORCH_DTYPE = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class LamportTimeout(RuntimeError):
    """A peer's data never arrived (a protocol bug or a dead peer)."""


def _lanes(words: torch.Tensor, dtype: str) -> torch.Tensor:
    """Integer view with one element per activation lane (int16 for bf16, int32 for fp32)."""
    return words.view(torch.int16) if dtype == "bfloat16" else words


def has_sentinel(words: torch.Tensor, dtype: str) -> bool:
    """True while any lane of ``words`` still holds -0.0 (bit pattern, not float compare)."""
    neg0 = -32768 if dtype == "bfloat16" else -2147483648
    return bool((_lanes(words, dtype) == neg0).any())


def rewrite_neg_zero(words: torch.Tensor, dtype: str) -> torch.Tensor:
    """Copy of ``words`` with every -0.0 lane replaced by +0.0."""
    out = words.clone()
    lanes = _lanes(out, dtype)
    neg0 = -32768 if dtype == "bfloat16" else -2147483648
    lanes[lanes == neg0] = 0
    return out


def _spin(view: torch.Tensor, dtype: str, deadline: float, what: str) -> torch.Tensor:
    polls = 0
    while True:
        snap = view.clone()
        if not has_sentinel(snap, dtype):
            return snap
        if time.monotonic() > deadline:
            raise LamportTimeout(f"no data for {what} after the timeout: a peer is dead or out of step")
        polls += 1
        # ranks are processes that may share few cores: back off so the writer gets to run
        time.sleep(0 if polls < 8 else 2e-4)


def _begin(comm) -> tuple[int, int]:
    """Clear the slot read by the previous call (its dirty extent); return (call, ping slot)."""
    flags, buf = comm.flags, comm.buffer
    call = int(flags[L.FLAG_CALL])
    prev = (call + L.SLOTS - 1) % L.SLOTS
    dirty = int(flags[L.FLAG_DIRTY0 + prev])
    base = prev * comm.slot_words
    buf[base:base + dirty] = L.SENTINEL_WORD[comm.dtype]
    return call, call % L.SLOTS


def _finish(comm, call: int, ping: int, written: int) -> None:
    comm.flags[L.FLAG_DIRTY0 + ping] = written
    comm.flags[L.FLAG_CALL] = call + 1


def _values(words: torch.Tensor, dtype: str) -> torch.Tensor:
    return words.view(_TORCH_DTYPE[dtype]).float()


def _norm(h: torch.Tensor, weight, eps: float, zero_centered: bool):
    return None if weight is None else rmsnorm_reference(h, weight, eps, zero_centered=zero_centered)


def _start(partial: torch.Tensor, residual: torch.Tensor, weight, comm, timeout: float):
    """What every emulated call starts with: checks, sizes, slot layout, deadline, the call's slot
    and this rank's words (-0.0 rewritten).

    Returns (dtype, world, rank, M, row words, layout, deadline, call, ping slot, slot base, words [M, NW])."""
    comm.check_call(partial, residual, weight)
    dt, W, me = comm.dtype, comm.world_size, comm.rank
    M, NW = partial.shape[0], comm.row_words
    lay = L.SlotLayout(W, M, NW)
    deadline = time.monotonic() + timeout
    call, ping = _begin(comm)
    base = ping * comm.slot_words
    mine = rewrite_neg_zero(partial.contiguous().view(torch.int32).reshape(M, NW), dt)
    return dt, W, me, M, NW, lay, deadline, call, ping, base, mine


def lamport_one_shot(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                     comm, zero_centered: bool = False, timeout: float = 60.0):
    """Emulated one-shot Lamport all-reduce + residual + RMSNorm (contract of the reference op).

    Returns (normed [M, N] or None, residual_out [M, N]) in partial.dtype.
    """
    dt, W, me, M, NW, lay, deadline, call, ping, base, mine = _start(partial, residual, weight, comm, timeout)
    lo, hi = base + lay.oneshot_offset(me), base + lay.oneshot_offset(me + 1)
    for r in range(W):
        if r != me:
            comm.peers[r][lo:hi] = mine.reshape(-1)
    acc = torch.zeros(M, partial.shape[1], dtype=torch.float32, device=partial.device)
    for r in range(W):  # rank order: the same fp32 rounding sequence on every rank
        if r == me:
            words = mine
        else:
            src = comm.buffer[base + lay.oneshot_offset(r):base + lay.oneshot_offset(r + 1)]
            words = _spin(src, dt, deadline, f"call {call} slot {ping} from rank {r}").reshape(M, NW)
        acc = acc + _values(words, dt)
    h = (acc + residual.float()).to(partial.dtype)
    _finish(comm, call, ping, lay.oneshot_words)
    return _norm(h, weight, eps, zero_centered), h


def two_stage(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
              comm, zero_centered: bool = False, timeout: float = 60.0):
    """Emulated two-stage (reduce-scatter + all-gather) all-reduce + residual + RMSNorm.

    Returns (normed [M, N] or None, residual_out [M, N]) in partial.dtype.
    """
    dt, W, me, M, NW, lay, deadline, call, ping, base, mine = _start(partial, residual, weight, comm, timeout)
    CW = lay.chunk_words

    def chunk_cols(c: int) -> slice:
        v0, v1 = lay.chunk_range(c)
        return slice(v0 * L.VEC_WORDS, v1 * L.VEC_WORDS)

    def rs_area(rank_buf: torch.Tensor, src: int) -> torch.Tensor:
        return rank_buf[base + lay.rs_offset(src):base + lay.rs_offset(src + 1)].view(M, CW)

    # 1. reduce-scatter: chunk c of my partial into rank c's area [me]
    for c in range(W):
        cols = chunk_cols(c)
        if c != me and cols.stop > cols.start:
            rs_area(comm.peers[c], me)[:, :cols.stop - cols.start] = mine[:, cols]
    # 2. own chunk: rank-order sum, residual, one rounding, -0.0 rewrite, broadcast
    cols = chunk_cols(me)
    width = cols.stop - cols.start
    ag = slice(base + lay.ag_base, base + lay.ag_base + M * NW)
    h_words = torch.empty(M, NW, dtype=torch.int32, device=partial.device)
    if width:
        acc = torch.zeros(M, width * 4 // L.DTYPE_BYTES[dt], dtype=torch.float32, device=partial.device)
        for r in range(W):
            if r == me:
                words = mine[:, cols]
            else:
                words = _spin(rs_area(comm.buffer, r)[:, :width], dt, deadline,
                              f"call {call} slot {ping} reduce-scatter from rank {r}")
            acc = acc + _values(words.contiguous(), dt)
        res = residual.contiguous().view(torch.int32).reshape(M, NW)[:, cols].contiguous()
        h_chunk = (acc + _values(res, dt)).to(partial.dtype).view(torch.int32)
        h_chunk = rewrite_neg_zero(h_chunk, dt)
        h_words[:, cols] = h_chunk
        for r in range(W):
            if r != me:
                comm.peers[r][ag].view(M, NW)[:, cols] = h_chunk
    # 3. the chunks owned by peers
    for c in range(W):
        cc = chunk_cols(c)
        if c != me and cc.stop > cc.start:
            h_words[:, cc] = _spin(comm.buffer[ag].view(M, NW)[:, cc], dt, deadline,
                                   f"call {call} slot {ping} all-gather from rank {c}")
    h = h_words.view(_TORCH_DTYPE[dt]).reshape(M, -1)
    _finish(comm, call, ping, lay.two_stage_words)
    return _norm(h, weight, eps, zero_centered), h
