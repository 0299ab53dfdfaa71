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
        T, M = 1 + k, batch * (1 + k)
        nb, bs = self.block_table.shape[1], spec.block_size
        if buffers.block_tables.shape[1] != nb:
            raise UserError(f"buffers with {buffers.block_tables.shape[1]} block-table columns, verification rows "
                            f"sized for {nb}: build both from one BufferSpec")
        act = buffers.active[:batch].unsqueeze(1)
        pos = buffers.positions[:batch].unsqueeze(1) + self._offsets
        bt = buffers.block_tables[:batch]
        # as DecodeBuffers.metadata, per row: a position past the table is clamped (the host refuses such a step)
        col = torch.clamp(pos // bs, max=nb - 1)
        slot = bt.gather(1, col).to(torch.int64) * bs + pos % bs
        self.tokens[:M].view(batch, T)[:, 0].copy_(buffers.tokens[:batch])
        self.tokens[:M].view(batch, T)[:, 1:].copy_(buffers.drafts[:batch])
        self.positions[:M].copy_(pos.reshape(M))
        self.slots[:M].copy_(torch.where(act, slot, torch.full_like(slot, -1)).reshape(M))
        self.seq_lens[:M].copy_(torch.where(act, pos + 1, torch.zeros_like(pos)).to(torch.int32).reshape(M))
        self.block_table[:M].view(batch, T, nb).copy_(bt.unsqueeze(1).expand(batch, T, nb))
        self.row_states[:M].view(batch, T).copy_(buffers.state_indices[:batch].unsqueeze(1).expand(batch, T))
        return {"tokens": self.tokens[:M], "positions": self.positions[:M], "slots": self.slots[:M],
                "seq_lens": self.seq_lens[:M], "block_table": self.block_table[:M], "row_states": self.row_states[:M],
                "rows": buffers.state_indices[:batch], "accepted": buffers.accepted[:batch]}


__all__ = ["VerifyRows"]
