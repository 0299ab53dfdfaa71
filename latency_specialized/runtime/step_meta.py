"""Per-row metadata of a speculative-decoding verification step, from the per-request static buffers.

A verification step with ``B`` requests and ``k`` draft tokens has ``M = B * (1 + k)`` query rows,
request-major: row ``b*T + t`` (``T = 1 + k``) is token ``t`` of request ``b`` - ``tokens[b]`` for
``t = 0``, ``drafts[b, t-1]`` after it. Paged attention (MLA, GQA, sparse MLA and its indexer) treats
each row as a request of its own:

    position  p_b + t          seq_len  p_b + t + 1 (0 on padding)
    slot      the KV slot of position p_b + t in request b's blocks (-1 on padding)
    block table row            request b's

so row t attends over the cached context and the rows ``0 .. t`` of its own request, whose KV the same
op call writes first: the causal mask within the block comes from the sequence lengths alone, and the
attention ops need no change (each op's write-before-read order: ``ops/attention/NOTES_verify.md``).
Recurrent pieces (KDA) get the state rows per request (``meta['rows']`` ``[B]``) and ``meta['accepted']``;
pieces that index a per-request ring by position (sparse MQA's window) get each query row's state row as
``meta['row_states']`` ``[M]`` (request b's row for its 1 + k rows; plain steps: ``meta['rows']`` itself).

All of it is device ops into static buffers sized once for the largest bucket (no host read):
capturable into the bucket's CUDA graph.
"""

from __future__ import annotations

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops import paged_slots
from latency_specialized.runtime.buffers import DecodeBuffers


class VerifyRows:
    """Static per-row buffers of verification steps for up to ``max_batch`` requests of ``1 + spec_tokens`` rows.

    Attributes (``[max_batch * (1 + spec_tokens)]`` unless noted): ``tokens`` int64, ``positions`` int64,
    ``seq_lens`` int32, ``slots`` int64, ``block_table`` int32 ``[rows, max_blocks_per_seq]``, ``row_states``
    (the state row of each query row, in the state indices' dtype).
    """

    def __init__(self, max_batch: int, spec_tokens: int, max_blocks_per_seq: int, device: torch.device | str,
                 state_index_dtype: torch.dtype = torch.int32):
        if spec_tokens < 1:
            raise UserError(f"verification rows for {spec_tokens} draft tokens: a verification step has k >= 1")
        self.max_batch, self.spec_tokens = max_batch, spec_tokens
        T = 1 + spec_tokens
        rows = max_batch * T
        kw = {"device": device}
        self.tokens = torch.zeros(rows, dtype=torch.int64, **kw)
        self.positions = torch.zeros(rows, dtype=torch.int64, **kw)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, **kw)
        self.slots = torch.full((rows,), -1, dtype=torch.int64, **kw)
        self.block_table = torch.zeros(rows, max_blocks_per_seq, dtype=torch.int32, **kw)
        self.row_states = torch.zeros(rows, dtype=state_index_dtype, **kw)
        self._offsets = torch.arange(T, dtype=torch.int64, **kw)
        """0 .. k: a row's offset from its request's position (made once: no allocation per step)."""

    def fill(self, buffers: DecodeBuffers, batch: int) -> dict[str, torch.Tensor]:
        """Expand rows ``[:batch]`` of ``buffers`` (a DecodeBuffers with ``spec_tokens`` drafts) into this
        step's meta: per-row 'tokens', 'positions', 'slots', 'seq_lens', 'block_table', 'row_states' (``[:M]``),
        and per request 'rows' (state rows) and 'accepted' (``[:batch]``)."""
        k = self.spec_tokens
        spec = buffers.spec
        if spec.spec_tokens != k or batch > self.max_batch:
            raise UserError(f"verification step of {batch} requests x {spec.spec_tokens} drafts over rows sized for "
                            f"{self.max_batch} x {k}: give the buffers BufferSpec(spec_tokens={k})")
        M = batch * (1 + k)
        nb, bs = self.block_table.shape[1], spec.block_size
        if buffers.block_tables.shape[1] != nb:
            raise UserError(f"buffers with {buffers.block_tables.shape[1]} block-table columns, verification rows "
                            f"sized for {nb}: build both from one BufferSpec")
        out = {"tokens": self.tokens[:M], "positions": self.positions[:M], "slots": self.slots[:M],
               "seq_lens": self.seq_lens[:M], "block_table": self.block_table[:M], "row_states": self.row_states[:M]}
        paged_slots.verify_rows(buffers.tokens[:batch], buffers.drafts[:batch], buffers.positions[:batch],
                                buffers.active[:batch], buffers.block_tables[:batch], buffers.state_indices[:batch],
                                bs, out, self._offsets)
        return {**out, "rows": buffers.state_indices[:batch], "accepted": buffers.accepted[:batch]}


__all__ = ["VerifyRows"]
