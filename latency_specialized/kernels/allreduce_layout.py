"""Where things live in a symmetric all-reduce workspace (shared by the kernels and the emulation).

This is the fused all-reduce kernels' protocol, so it lives at the kernel layer: the kernels store
by it, ``comm/symmetric.py`` allocates workspaces by it and ``comm/emulation.py`` replays it in torch
(``comm/layout.py`` re-exports it for them).

Every rank owns one buffer of int32 *words* that every peer can store into (CUDA IPC on GPUs,
``/dev/shm`` files for the CPU emulation). Activations travel as raw words: a bf16 pair or one
fp32 per word, so the protocol never converts a value it forwards.

The buffer has :data:`SLOTS` = 3 slots used round-robin, one per call (call ``s`` uses slot
``s % 3``). Every word of an unused slot holds the *sentinel* (-0.0 in every lane); a reader spins
on its own buffer until no lane holds the sentinel any more (Lamport: the data is its own flag), so
no barrier is needed. Senders rewrite -0.0 to +0.0 so that a real value never equals the sentinel
(bit patterns are compared, never floats: a negative subnormal flushed to zero would otherwise
look like the sentinel and spin forever).

Why three slots and no fence: at call ``s`` a rank clears the slot it *read* in call ``s - 1``.
Peers store into that slot again only in call ``s + 2``, which they can start only after they
received this rank's data of call ``s + 1`` - sent after the clearing kernel of call ``s`` ended.
With two slots the clear of call ``s`` would race with peers' stores of call ``s + 1``.

Per-rank *flags* (local, never shared, :data:`FLAG_WORDS` int32): the call counter, the arrival
counter of the CTAs of the current call, and per slot the number of words the last call using it
wrote (so the next clear covers exactly that, whatever the token count of the next call).

Slot layouts, ``M`` tokens, ``Nw`` words per row, ``W`` ranks:

* one-shot: ``[W source ranks][M][Nw]`` - every rank stores its whole partial into every peer.
* two-stage: reduce-scatter area ``[W source ranks][M][chunk_words]`` (rank ``c`` owns the column
  chunk ``c`` and receives only that), then the all-gather area ``[M][Nw]`` at ``ag_base``
  (the owner of a chunk stores the reduced, residual-added row chunk into every peer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["DTYPE_BYTES", "FLAG_ARRIVALS", "FLAG_CALL", "FLAG_DIRTY0", "FLAG_WORDS", "PeerWorkspace", "SENTINEL_WORD",
           "SLOTS", "SlotLayout", "VEC_WORDS", "WORD_BYTES", "layout_problem", "message_bytes", "slot_words",
           "words_per_row"]

SLOTS = 3
"""Slots per buffer: one in use, one being cleared, one at rest."""

FLAG_WORDS = 8
"""Per-rank int32 flags: [call counter, CTA arrivals, dirty words of slot 0, 1, 2, unused x3]."""
FLAG_CALL, FLAG_ARRIVALS, FLAG_DIRTY0 = 0, 1, 2

WORD_BYTES = 4
VEC_WORDS = 4
"""Words per 128-bit vector: the unit every thread loads and stores."""

DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
"""Activation dtypes the protocol carries (fp16 is not supported: no model here uses it)."""

SENTINEL_WORD = {"bfloat16": -2147450880, "float32": -2147483648}
"""The sentinel word as a signed int32: 0x80008000 (two bf16 -0.0) or 0x80000000 (fp32 -0.0)."""


def words_per_row(n: int, dtype: str) -> int:
    """int32 words of one activation row of ``n`` elements."""
    return n * DTYPE_BYTES[dtype] // WORD_BYTES


def layout_problem(n: int, dtype: str, world_size: int) -> str | None:
    """Why rows of ``n`` ``dtype`` elements cannot use the protocol, or None."""
    if dtype not in DTYPE_BYTES:
        return f"dtype {dtype} not carried (use bfloat16 or float32)"
    per_vec = VEC_WORDS * WORD_BYTES // DTYPE_BYTES[dtype]
    if n % per_vec:
        return f"N={n} not a multiple of {per_vec} ({dtype} elements per 128-bit vector)"
    if n // per_vec < world_size:
        return f"N={n} gives {n // per_vec} vectors per row, fewer than {world_size} ranks"
    return None


@dataclass(frozen=True)
class SlotLayout:
    """Offsets (in words) inside one slot for a call of ``tokens`` rows."""

    world_size: int
    tokens: int
    row_words: int

    @property
    def vecs(self) -> int:
        """128-bit vectors per row."""
        return self.row_words // VEC_WORDS

    # one-shot -----------------------------------------------------------------------------
    def oneshot_offset(self, src: int, row: int = 0) -> int:
        return (src * self.tokens + row) * self.row_words

    @property
    def oneshot_words(self) -> int:
        """Words of a slot written by one one-shot call."""
        return self.world_size * self.tokens * self.row_words

    # two-stage ----------------------------------------------------------------------------
    @property
    def chunk_vecs(self) -> int:
        """Vectors of the column chunk each rank owns (the last chunk may be shorter)."""
        return -(-self.vecs // self.world_size)

    @property
    def chunk_words(self) -> int:
        return self.chunk_vecs * VEC_WORDS

    def owner(self, vec: int) -> int:
        """Rank that reduces column vector ``vec``."""
        return vec // self.chunk_vecs

    def chunk_range(self, rank: int) -> tuple[int, int]:
        """[start, end) vectors owned by ``rank`` (possibly empty for the last ranks)."""
        start = min(rank * self.chunk_vecs, self.vecs)
        return start, min(start + self.chunk_vecs, self.vecs)

    def rs_offset(self, src: int, row: int = 0) -> int:
        return (src * self.tokens + row) * self.chunk_words

    @property
    def ag_base(self) -> int:
        return self.world_size * self.tokens * self.chunk_words

    def ag_offset(self, row: int = 0) -> int:
        return self.ag_base + row * self.row_words

    @property
    def two_stage_words(self) -> int:
        """Words of a slot written by one two-stage call."""
        return self.ag_base + self.tokens * self.row_words


def slot_words(world_size: int, max_tokens: int, row_words: int) -> int:
    """Words one slot needs to serve every call of up to ``max_tokens`` rows, either algorithm."""
    lay = SlotLayout(world_size, max_tokens, row_words)
    words = max(lay.oneshot_words, lay.two_stage_words)
    return -(-words // VEC_WORDS) * VEC_WORDS


def message_bytes(tokens: int, n: int, dtype: str) -> int:
    """Bytes of one rank's partial: what the crossover is decided on."""
    return tokens * n * DTYPE_BYTES.get(dtype, 2)


@runtime_checkable
class PeerWorkspace(Protocol):
    """What a fused all-reduce kernel reads from the workspace it is handed: raw buffers and sizes.

    ``comm.symmetric.SymmetricMemoryCommunicator`` is one (the kernels never import it: kernels sit
    below comm). ``isinstance(x, PeerWorkspace)`` checks that ``x`` has these members.
    """

    rank: int
    world_size: int
    dtype: str
    """Activation dtype name the workspace carries ('bfloat16' or 'float32')."""
    hidden: int
    """Row width N (elements)."""
    slot_words: int
    """int32 words of one slot (:func:`slot_words`)."""
    device: Any
    """torch.device of the buffers."""
    buffer: Any
    """This rank's int32 buffer (``SLOTS * slot_words`` words), peers store into it."""
    flags: Any
    """This rank's local int32 flags (:data:`FLAG_WORDS`)."""
    peer_ptrs: Any
    """int64 device addresses of every rank's buffer, in rank order."""

    def check_call(self, partial: Any, residual: Any, weight: Any) -> None:
        """Raise a UserError naming the fix when the tensors do not fit the workspace."""
        ...
