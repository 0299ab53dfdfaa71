"""Sparse MQA attention piece: one K = V head over a sliding window of raw rows plus an indexer's top-k of
compressed rows, per-head attention sinks, inverse RoPE on the output, grouped low-rank output projection.

Per token (``D`` = head width, the last ``rope_dim`` channels rotated in interleaved pairs at the token's
position; every norm an RMSNorm with the model's eps)::

    qr = q_norm(q_a x);  q = rms(q_b qr) per head (weightless);  kv = kv_norm(kv_proj x)
    keys = the last ``window`` kv rows (this token's included) + the selected compressed rows
    o = softmax([q . keys / sqrt(D) | sink_h]) @ keys   (the sink only in the denominator)
    o = rope^-1(o);  out = o_b([o_a_g(o_g) for every output group g])        (a TP partial sum)

**Compressed rows** (``compress_ratio`` r > 0): a *KV-source* layer (``kv_source=True``) projects
``c = compressor.kv x`` (and, r > 1, ``g = compressor.gate x``); every r tokens form one row
``norm(sum_t softmax_t(g_t) * c_t)`` (r = 1: ``norm(c)``), roped at its last token's position. Layers that
are not sources read the latest source's rows (the source publishes its caches in ``StepContext.scratch``;
layers run in order, so a reader always follows its source in the step).

**Indexer** (layers whose spec has one: index sources): ``score_j = sum_h w_h relu(q_h . k_j)`` over the
compressed rows ``j`` that are complete, ``q = indexer.q_proj qr``, ``w = indexer.weights_proj x``, the key
``k_j = rope(rms(indexer.k_proj row_j))`` of the pre-rope row, top-``topk`` kept (``attention.indexer``, with
``k_norm_kind='rms'``; compressed-row positions are its positions, so its ``seq_lens`` are ``seq_lens // r``
and its slot is -1 unless this token completes a row). Only a layer that is both an index and a KV source
(``index_keys``) writes keys; other index layers score against the latest owner's key cache and reuse its row
counts (``sparse_mqa.seq_c``: the slot maths runs once per source per step). Layers without an indexer reuse
the latest selection (the static buffer ``sparse_mqa.topk [max_rows, topk]``).

Sites, per rank in call order: ``attn.in_proj`` (gemm: every projection of ``x`` in one, ``[q_a | kv |
compressor kv (| gate) | indexer weights]``, the last two only on KV sources / index layers; the checkpoint's
weights concatenated in ``arrange``, the outputs column slices), ``attn.q_norm`` (norm) and ``attn.q_b_proj``
(gemm, ``norm_site="attn.q_norm"``: where its implementation has ``norm_prologue`` it normalises the raw q_a
slice and the plan skips the norm site; on index layers its rows are ``[q_b | indexer.q_proj]``, both read qr);
KV sources ``attn.compressor`` (``attention.sparse_mqa_compress``: pending write, softmax-gated pool, norm, RoPE,
cache write); (key owners) ``attn.indexer.k_proj`` and ``attn.compressor_index``
(``attention.sparse_mqa_compress_index``, ``fuses="attn.compressor,attn.indexer.k_proj"``: where a kernel serves it,
the compressor writes the new key too, and the indexer is called with ``k=None``), index layers ``attn.indexer``
(``attention.indexer``; layers that own no keys call it with ``k=None``: no key step); the
attention ``attn.sparse_mqa.{window|c2|c1|c<r>}`` (``attention.sparse_mqa``: kv_norm of the raw kv slice, the raw
q's per-head weightless RMSNorm, q and kv RoPE, the window-ring write, attention over the ring and the selected
compressed rows read in place, sinks, the output's inverse RoPE - one op, so a fused kernel sees the whole of
it); ``attn.o_a_proj`` (gemm, called once per local output group: N = o_lora, K = the group's heads x D) and
``attn.o_b_proj`` (gemm, row-parallel). Column slices go to the ops as strided rows; ``step.contiguous_for``
copies only for an implementation that needs contiguous rows.

States (all replicated: one KV head): ``window`` rows ``[window + MAX_SPEC_TOKENS, D]`` (a ring: position p at
p % its length; a row sees the last ``window`` positions); KV sources ``compressed`` paged ``[D]`` (compressed row
j at the slot of position j of the sequence's block table) and, r > 1, ``pending`` rows ``[r + MAX_SPEC_TOKENS,
2D]`` (a ring of the compressor inputs ``[c | g]``; a group pools its r positions); key owners
``index_k`` paged ``[indexer head_dim]`` (row j's key at the slot of position j, its rope channels *leading*:
the indexer op rotates leading channels, so the indexer's q / k projections are permuted in ``arrange``).
Everything per step (which rows are visible, whether a row completes, slots) is computed on the device from
``positions`` / ``seq_lens`` / ``block_table``: no host sync in the piece.

Verification steps (1 + k rows per request, k <= ``MAX_SPEC_TOKENS``): both rings are ``MAX_SPEC_TOKENS`` rows
longer than what a row reads, so rows ``p .. p + k`` of a request write their slots without overwriting anything
row ``p`` reads, and a rejected row's entries sit where their position is written again (the next step's first
rows) before any row can see them - no rollback state. The ops then write every row before any row reads
(``cross_row_reads``); the compressed cache and the indexer keys are paged by position (their writes run in
launches of their own, before the reads). The extra rows exist in plain programs too, so a cache prefilled for one
k serves every k.

TP: query heads (q_b rows, sinks) and output groups (o_a rows, o_b columns) split; everything else, the caches
included, replicated (every rank runs the compressor and the indexer).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import ClassVar, Mapping, Sequence

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops import paged_slots
from latency_specialized.ops.attention.sparse_mqa import rope_tail
from latency_specialized.ops.sites import SiteBuilder, stored_bytes_per_value
from latency_specialized.pieces.attention.rope import rope_inv_freq
from latency_specialized.runtime.pieces_api import (StateDecl, StepContext, WeightDecl, fused_gemm, join, row_blocks,
                                                    split_plain, take_rows, with_stored)
from latency_specialized.spec import MAX_SPEC_TOKENS, ModelSpec, SparseMQAAttentionSpec

TOPK = "sparse_mqa.topk"
"""Static selection buffer ``[max_rows, topk]`` int32 (shared by every sparse MQA piece)."""
COMPRESSED = "sparse_mqa.compressed"
"""Scratch key under which the latest KV source publishes its compressed-row cache in a step."""
INDEX_K = "sparse_mqa.index_k"
"""Scratch key under which the latest key owner publishes its indexer key cache in a step."""
SEQ_C = "sparse_mqa.seq_c"
"""Scratch key: the latest key owner's complete compressed rows per sequence ``[M]`` int32, this step's."""
NO_SLOT = "sparse_mqa.no_slot"
"""Scratch key: ``[M]`` slots of -1 (the key slot of index layers that write no keys), this step's."""
COMPRESSED_SLOTS = "sparse_mqa.compressed_slots"
"""``StepContext.once`` key (with the ratio and the cache's block size) of ``compressed_slots``."""
COMPRESS_BESIDE_QUERY = True
"""On a GPU, a KV source layer's compressor - its step's compressed slots, the compressor kernel and, on key owners,
the indexer's key gemm - runs on the side stream (a graph branch forked after the input projection) beside the query's
norm and q_b gemm, which it does not read; the indexer and the attention join it. At DeepSeek-V4.1-Flash's c2_idx
layer, batch 1, those three launches (~6 us with their gaps on an H100) sat between the q_b gemm and the indexer's
score kernel. The compressor sites are marked ``side_stream`` so that the program makes the stream. On since
session 53 (DeepSeek-V4.1-Flash NOTES: the A/B)."""
INDEX_COMPRESSED_TABLE = False
"""The indexer of a compressed layer gets the block table cut to the blocks its rows can occupy
(:func:`compressed_table`) instead of the whole table: the op sizes its work by the table's width (the select
kernel's resident tile, the scoring split count, ``indexer_triton.auto_selection``), and the raw table is ``ratio``
times wider than the compressed rows it can hold. Off (the whole table): the layer timed slower with the cut
table although the select alone is faster on it (``kernels/NOTES_indexer.md``, session 46); an A/B switch."""


def compressed_slots(meta: Mapping[str, torch.Tensor], ratio: int,
                     block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of the step, from its sequence length: complete compressed rows ``seq_c`` [M] int64 (and as
    int32), the flat slot of the compressed cache this token's group completes (``-1``: it completes none)
    and ``[M]`` slots of -1 (the key slot of layers that write no keys)."""
    return paged_slots.compressed_slots(meta["seq_lens"], meta["block_table"], ratio, block_size)


def compressed_table(block_table: torch.Tensor, ratio: int) -> torch.Tensor:
    """``block_table [M, W]`` cut to its first ``ceil(W / ratio)`` columns (a view): compressed row j sits at the slot
    of position j and a sequence of at most ``W * block`` positions has fewer than ``W * block / ratio`` rows, so
    every row lives in those blocks."""
    return block_table[:, :-(-block_table.shape[1] // max(ratio, 1))]


def rope_leading(x: torch.Tensor, rope_dim: int, dim: int = -1) -> torch.Tensor:
    """``x`` with its last ``rope_dim`` channels along ``dim`` moved to the front (the indexer key cache's layout)."""
    n = x.shape[dim]
    perm = torch.cat([torch.arange(n - rope_dim, n), torch.arange(n - rope_dim)]).to(x.device)
    return x.index_select(dim, perm)


@functools.lru_cache(maxsize=64)
def _local(a: SparseMQAAttentionSpec, tp: int) -> SparseMQAAttentionSpec:
    return a.shard(tp) if tp > 1 else a


@dataclass(frozen=True)
class SparseMQAAttention:
    """Sparse MQA of every layer of one kind (see the module docstring)."""

    role: ClassVar[str] = "attn"
    spec: SparseMQAAttentionSpec
    """The unsharded attention (heads, head_dim, rope_dim, q_lora, output groups, window, ratio, indexer)."""
    topk: int = 0
    """Compressed rows each query attends to (the model's index top-k; 0 on window-only layers)."""
    kv_source: bool = False
    """This layer's compressor writes the compressed rows (later layers of its ratio read them)."""
    rope_theta: float = 10_000.0
    """RoPE base of this layer (queries, window keys, compressed rows, indexer)."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm of the piece."""

    def __post_init__(self) -> None:
        a = self.spec
        if a.rope_dim <= 0 or a.rope_dim % 2 or a.rope_dim > a.head_dim:
            raise UserError(f"sparse MQA: rope_dim {a.rope_dim} must be even and <= head_dim {a.head_dim}")
        if a.num_heads % a.o_groups:
            raise UserError(f"sparse MQA: {a.num_heads} heads do not split into {a.o_groups} output groups")
        if a.compress_ratio == 0 and (self.kv_source or a.indexer is not None or self.topk):
            raise UserError("sparse MQA: a window-only layer (compress_ratio 0) has no compressor, indexer or top-k")
        if a.compress_ratio > 0 and self.topk < 1:
            raise UserError("sparse MQA: a compressed layer needs topk >= 1 (the model's index top-k)")
        if a.indexer is not None and (a.indexer.topk != self.topk or a.indexer.head_dim < a.rope_dim):
            raise UserError(f"sparse MQA: the indexer's topk {a.indexer.topk} / head_dim {a.indexer.head_dim} must "
                            f"be the piece's topk {self.topk} / at least rope_dim {a.rope_dim}")

    @property
    def spec_tokens(self) -> int:
        """Draft tokens a verification step may carry (``runtime.composed.verification_problems``): the rings'
        extra rows (module docstring)."""
        return MAX_SPEC_TOKENS

    @property
    def index_keys(self) -> bool:
        """This layer writes the indexer keys (it is an index source and a KV source)."""
        return self.kv_source and self.spec.indexer is not None

    def attention_role(self) -> str:
        r = self.spec.compress_ratio
        return "attn.sparse_mqa." + ("window" if r == 0 else f"c{r}")

    def _in_widths(self, a: SparseMQAAttentionSpec) -> tuple[int, int, int, int]:
        """Column widths of the fused input projection ``attn.in_proj``: ``[q_a | kv | compressor | indexer
        weights]`` (every projection that reads h; 0 where the layer has none): :meth:`_fused_in`'s rows grouped."""
        rows = self._fused_in(a)
        return (rows["q_a_proj"], rows["kv_proj"], rows.get("compressor.kv", 0) + rows.get("compressor.gate", 0),
                rows.get("indexer.weights_proj", 0))

    def _fused_in(self, a: SparseMQAAttentionSpec) -> dict[str, int]:
        """The weights of the fused input projection in its column order, with their rows at ``a``'s shapes."""
        D, ix = a.head_dim, self.spec.indexer
        rows = {"q_a_proj": a.q_lora_rank, "kv_proj": D}
        if self.kv_source:
            rows["compressor.kv"] = D
            if self.spec.compress_ratio > 1:
                rows["compressor.gate"] = D
        if ix is not None:
            rows["indexer.weights_proj"] = ix.num_heads
        return rows

    # ------------------------------------------------------------------ declarations
    def projections(self, spec: ModelSpec) -> dict[str, tuple[str, ...]]:
        """Gemm site role -> the weights it joins (kept in a stored format where all are: ``ModelSpec.kept_linear``;
        the fused input projection split where its trailing parts are plain: ``pieces_api.split_plain``); the
        grouped ``o_a`` is one gemm per group over its rows of one weight."""
        head, tail = split_plain(tuple(self._fused_in(self.spec)), spec)
        out = {"attn.in_proj": head, **({"attn.in_proj.plain": tail} if tail else {}),
               "attn.q_b_proj": ("q_b_proj",) + (("indexer.q_proj",) if self.spec.indexer is not None else ()),
               "attn.o_a_proj": ("o_a_proj",), "attn.o_b_proj": ("o_b_proj",)}
        if self.index_keys:
            out["attn.indexer.k_proj"] = ("indexer.k_proj",)
        return out

    def sites(self, b: SiteBuilder, rank_spec: ModelSpec) -> None:
        a, H, ix = _local(self.spec, rank_spec.tp), rank_spec.hidden_size, self.spec.indexer
        r, D = self.spec.compress_ratio, a.head_dim
        fmt = {role: rank_spec.kept_linear(*parts) for role, parts in self.projections(rank_spec).items()}
        rows = self._fused_in(a)
        head, tail = split_plain(tuple(rows), rank_spec)
        b.gemm("attn.in_proj", sum(rows[p] for p in head), H, weight_format=fmt["attn.in_proj"])
        if tail:  # the plain tail of the fused input projection: a second gemm into the same output
            b.gemm("attn.in_proj.plain", sum(rows[p] for p in tail), H)
        b.add("attn.q_norm", "norm", N=a.q_lora_rank)
        # the indexer's q_proj reads qr too: its rows join q_b's (one gemm, one norm prologue for both)
        iq_n = ix.num_heads * ix.head_dim if ix is not None else 0
        b.gemm("attn.q_b_proj", a.num_heads * D + iq_n, a.q_lora_rank, norm_site="attn.q_norm",
               weight_format=fmt["attn.q_b_proj"])
        side = {"side_stream": True} if COMPRESS_BESIDE_QUERY else {}
        if self.kv_source:
            b.add("attn.compressor", "attention.sparse_mqa_compress", head_dim=D, compress_ratio=r, rope=a.rope_dim,
                  attrs={"rope_interleaved": True, **side})
        if ix is not None:
            if self.index_keys:
                kf = fmt["attn.indexer.k_proj"]
                b.gemm("attn.indexer.k_proj", ix.head_dim, D, weight_format=kf)
                b.add("attn.compressor_index", "attention.sparse_mqa_compress_index", weight_bytes=ix.head_dim * D * 2,
                      head_dim=D, index_head_dim=ix.head_dim, compress_ratio=r, rope=a.rope_dim,
                      attrs={"rope_interleaved": True, "fuses": "attn.compressor,attn.indexer.k_proj",
                             **({"weight_format": kf} if kf else {}), **side})
            b.add("attn.indexer", "attention.indexer", heads=ix.num_heads, head_dim=ix.head_dim, topk=ix.topk,
                  rope=a.rope_dim, attrs={"rope_interleaved": True, "k_norm": "rms", "compressed": True,
                                          "key_write": self.index_keys})
        b.add(self.attention_role(), "attention.sparse_mqa", heads=a.num_heads, head_dim=D, topk=self.topk,
              window=a.sliding_window, compress_ratio=r, rope=a.rope_dim,
              attrs={"sinks": True, "q_norm": True, "kv_norm": True, "rope_interleaved": True})
        K = a.num_heads * D // a.o_groups
        oa = fmt["attn.o_a_proj"]
        b.add("attn.o_a_proj", "gemm", N=a.o_lora_rank, K=K, attrs={"residual": False, "groups": a.o_groups,
                                                                   **({"weight_format": oa} if oa else {})},
              weight_bytes=int(a.o_groups * a.o_lora_rank * K * (stored_bytes_per_value(oa) if oa else 2)))
        b.gemm("attn.o_b_proj", H, a.o_groups * a.o_lora_rank, weight_format=fmt["attn.o_b_proj"])

    def weights(self, spec: ModelSpec, tp: int) -> Sequence[WeightDecl]:
        a, H, ix = self.spec, spec.hidden_size, self.spec.indexer
        _local(a, tp)  # UserError naming the fix
        D, ql = a.head_dim, a.q_lora_rank
        out = [WeightDecl("q_a_proj", (ql, H)), WeightDecl("q_norm", (ql,)),
               WeightDecl("q_b_proj", (a.num_heads * D, ql), split=0), WeightDecl("kv_proj", (D, H)),
               WeightDecl("kv_norm", (D,)), WeightDecl("sinks", (a.num_heads,), split=0, dtype="float32"),
               WeightDecl("o_a_proj", (a.o_groups * a.o_lora_rank, a.num_heads * D // a.o_groups), split=0),
               WeightDecl("o_b_proj", (H, a.o_groups * a.o_lora_rank), split=1)]
        if self.kv_source:
            out += [WeightDecl("compressor.kv", (D, H)), WeightDecl("compressor.norm", (D,))]
            if a.compress_ratio > 1:
                out.append(WeightDecl("compressor.gate", (D, H)))
        if ix is not None:
            out += [WeightDecl("indexer.q_proj", (ix.num_heads * ix.head_dim, ql)),
                    WeightDecl("indexer.weights_proj", (ix.num_heads, H))]
            if self.index_keys:
                out += [WeightDecl("indexer.k_proj", (ix.head_dim, D)), WeightDecl("indexer.k_norm", (ix.head_dim,))]
        return with_stored(out, spec, self.projections(spec))

    def states(self, spec: ModelSpec, tp: int) -> Sequence[StateDecl]:
        a, r = self.spec, self.spec.compress_ratio
        out = [StateDecl("window", "rows", (a.sliding_window + MAX_SPEC_TOKENS, a.head_dim))]
        if self.kv_source:
            out.append(StateDecl("compressed", "paged", (a.head_dim,)))
            if r > 1:
                out.append(StateDecl("pending", "rows", (r + MAX_SPEC_TOKENS, 2 * a.head_dim)))
        if self.index_keys:
            out.append(StateDecl("index_k", "paged", (a.indexer.head_dim,)))  # type: ignore[union-attr]
        return out

    def buffers(self, spec: ModelSpec, max_rows: int, dtype: torch.dtype,
                device: torch.device) -> dict[str, torch.Tensor]:
        if not self.topk:
            return {}
        return {TOPK: torch.full((max_rows, self.topk), -1, dtype=torch.int32, device=device)}

    def arrange(self, w: Mapping[str, torch.Tensor], rank_spec: ModelSpec) -> dict[str, torch.Tensor]:
        a, ix = _local(self.spec, rank_spec.tp), self.spec.indexer
        dev = w["q_norm"].device
        # one gemm for every projection of h: [q_a | kv | compressor kv (| gate) | indexer weights] (_in_widths)
        fused = self._fused_in(a)
        head, tail = split_plain(tuple(fused), rank_spec)
        out = {k: v.contiguous() for k, v in w.items() if not k.startswith("indexer.") and k not in fused}
        out["in_proj"] = join([w[k] for k in head]).contiguous()
        if tail:
            out["in_proj.plain"] = join([w[k] for k in tail]).contiguous()
        out["o_a_proj"] = row_blocks(w["o_a_proj"], a.o_groups)   # [o_lora, K] per group
        out["rope_inv_freq"] = rope_inv_freq(self.rope_theta, a.rope_dim, device=dev)
        if ix is not None:   # the indexer op rotates leading channels: its heads' rope channels go first
            heads = torch.arange(ix.num_heads * ix.head_dim).view(ix.num_heads, ix.head_dim)
            iq = take_rows(w["indexer.q_proj"], rope_leading(heads, a.rope_dim, dim=1).flatten().to(dev))
            out["q_b_proj"] = join([w["q_b_proj"], iq])
            if self.index_keys:
                keys = rope_leading(torch.arange(ix.head_dim), a.rope_dim, dim=0).to(dev)
                out["indexer.k_proj"] = take_rows(w["indexer.k_proj"], keys).contiguous()
                out["indexer.k_norm"] = rope_leading(w["indexer.k_norm"], a.rope_dim, dim=0)
        return out

    def fill(self, state: Mapping[str, torch.Tensor], row: int, blocks: Sequence[int], start: int, rows: torch.Tensor,
             compressed: torch.Tensor | None = None, inputs: torch.Tensor | None = None,
             keys: torch.Tensor | None = None) -> None:
        """One sequence's states after its tokens ``start..n`` from whole-sequence tensors (a reference's prefill;
        host-side indices): ``rows [n, D]`` roped kv rows; KV sources ``compressed [n // r, D]`` roped rows and
        (r > 1) ``inputs [n, 2D]`` the compressor's ``[kv | gate]``; key owners ``keys [n // r, D_i]`` roped, rope
        channels last (the model's layout: stored rope-leading)."""
        a, r, n, dev = self.spec, self.spec.compress_ratio, rows.shape[0], rows.device
        ps = torch.arange(max(start, n - a.sliding_window), n, device=dev)
        state["window"][row, ps % state["window"].shape[1]] = rows[ps].to(state["window"].dtype)
        if not self.kv_source:
            return
        assert compressed is not None
        bs, j = state["compressed"].shape[1], torch.arange(compressed.shape[0], device=dev)
        flat = torch.tensor(list(blocks), dtype=torch.long, device=dev)[j // bs] * bs + j % bs
        state["compressed"].view(-1, a.head_dim)[flat] = compressed.to(state["compressed"].dtype)
        if r > 1 and inputs is not None:       # the tokens of the group not complete yet, at p % r
            ps = torch.arange(compressed.shape[0] * r, n, device=dev)
            state["pending"][row, ps % state["pending"].shape[1]] = inputs[ps].to(state["pending"].dtype)
        if self.index_keys and keys is not None:
            k = rope_leading(keys, a.rope_dim)
            state["index_k"].view(-1, k.shape[-1])[flat] = k.to(state["index_k"].dtype)

    # ------------------------------------------------------------------ computation
    def _published(self, step: StepContext, name: str) -> torch.Tensor:
        t = step.scratch.get(name)
        if t is None:
            raise UserError(f"sparse MQA: layer {step.layer} reads {name!r} but no source layer ran before it in "
                            "this step: the first compressed layer must be a KV / index source")
        return t

    def forward(self, step: StepContext, w: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
                h: torch.Tensor) -> torch.Tensor:
        a, eps, r, ix = _local(self.spec, step.tp), self.norm_eps, self.spec.compress_ratio, self.spec.indexer
        M, Hl, D = h.shape[0], a.num_heads, a.head_dim
        meta, inv = step.meta, w["rope_inv_freq"]
        pos, bt = meta["positions"], meta["block_table"]
        y = fused_gemm(step, "attn.in_proj", h, w, "in_proj")
        # column slices of the fused projection (strided rows; a copy only where a site needs one)
        ends = list(itertools.accumulate(self._in_widths(a)))
        q_a, kv = y[:, :ends[0]], y[:, ends[0]:ends[1]]
        c, iw = y[:, ends[1]:ends[2]], y[:, ends[2]:ends[3]]
        key_fused = self.index_keys and step.skipped("attn.compressor")   # the compressor writes the new key
        side = step.streams.get("side") if COMPRESS_BESIDE_QUERY and r and self.kv_source else None
        # the compressor reads only the input projection: beside the query's norm and gemm (joined below)
        source = side.run(self._source, step, w, state, c, pos, meta["row_states"], key_fused) if side else None
        if step.skipped("attn.q_norm"):   # the q_b gemm normalises q_a itself
            qb = step.op("attn.q_b_proj")(q_a, w["q_b_proj"], norm_weight=w["q_norm"], norm_eps=eps)
        else:
            qr = step.op("attn.q_norm")(step.contiguous_for("attn.q_norm", q_a), w["q_norm"], eps)
            qb = step.op("attn.q_b_proj")(qr, w["q_b_proj"])
        q = qb[:, :Hl * D].view(M, Hl, D)                    # raw: the op norms it; [q | indexer q] on index layers
        role = self.attention_role()
        kv = step.contiguous_for(role, kv)   # any copy before the indexer: the op may start behind the selection
        cache = sel = k = None
        if r:
            cache = state["compressed"] if self.kv_source else self._published(step, COMPRESSED)
            if self.kv_source:   # a reader of both runs no glue at all: the op masks by length
                seq_c, seq_c32, slot_c, no_slot, k = source.join() if source is not None else \
                    self._source(step, w, state, c, pos, meta["row_states"], key_fused)
                step.scratch[COMPRESSED] = cache
                if self.index_keys:   # the index layers reading these keys share them
                    seq_c = step.scratch[SEQ_C] = seq_c32
                    step.scratch[NO_SLOT] = no_slot
            elif ix is not None:      # the key owner's row counts (same lengths, same ratio); this layer writes none
                seq_c, slot_c = self._published(step, SEQ_C), self._published(step, NO_SLOT)
            if ix is not None:
                self._index(step, w, state, iw, qb[:, Hl * D:], pos, seq_c, slot_c, k)
            sel = step.scratch[TOPK][:M]
        # the ring write happens inside the op: nothing before it (compressor, indexer) reads the window
        # kv_norm is part of the op: the raw kv slice goes in (the kernel norms the row it loads anyway)
        o = step.op(role)(q, kv, pos, meta["row_states"], meta["seq_lens"], state["window"], cache,
                          bt, sel, w["sinks"], inv, scale=D ** -0.5, compress_ratio=max(r, 1), q_norm_eps=eps,
                          kv_norm_weight=w["kv_norm"], kv_norm_eps=eps, sliding_window=a.sliding_window,
                          cross_row_reads=step.spec_tokens > 0, after_selection=ix is not None)
        o = o.reshape(M, a.o_groups, Hl * D // a.o_groups)
        if a.o_groups == 1:   # one group per rank (TP8): its slice is contiguous, and a cat of one would copy
            og = step.op("attn.o_a_proj")(o[:, 0], w["o_a_proj"][0])
        else:
            og = torch.cat([step.op("attn.o_a_proj")(o[:, g].contiguous(), w["o_a_proj"][g])
                            for g in range(a.o_groups)], dim=-1)
        return step.op("attn.o_b_proj")(og, w["o_b_proj"])

    def _source(self, step: StepContext, w: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
                c: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor,
                key_fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A KV source layer's own work before its indexer and attention (what ``COMPRESS_BESIDE_QUERY`` runs on the
        side stream): the step's compressed slots of this ratio (made by the first source layer of the ratio and
        cache block, shared by the others), the compressor, and on key owners the indexer's new key. Returns
        ``compressed_slots``' four tensors and the key ``[M, index head_dim]`` (None: the compressor wrote it, or the
        layer owns no keys)."""
        r, cache = self.spec.compress_ratio, state["compressed"]
        seq_c, seq_c32, slot_c, no_slot = step.once((COMPRESSED_SLOTS, r, cache.shape[1]),
                                                    lambda: compressed_slots(step.meta, r, cache.shape[1]))
        lat = self._compress(step, w, state, c, pos, rows, slot_c, key_fused)
        k = step.op("attn.indexer.k_proj")(lat, w["indexer.k_proj"]) if self.index_keys and not key_fused else None
        return seq_c, seq_c32, slot_c, no_slot, k

    def _compress(self, step: StepContext, w: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
                  c: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, slot_c: torch.Tensor,
                  key_fused: bool) -> torch.Tensor:
        """Pool the group this token closes (if any) into the compressed cache; returns the pre-rope rows [M, D].
        ``c``: the compressor's ``[kv | gate]`` columns of the fused input projection. ``key_fused``: the indexer's
        new key written too (``attn.compressor_index``)."""
        r = self.spec.compress_ratio
        role = "attn.compressor_index" if key_fused else "attn.compressor"
        key = {"index_weight": w["indexer.k_proj"], "index_norm_weight": w["indexer.k_norm"],
               "index_cache": state["index_k"], "index_eps": self.norm_eps} if key_fused else {}
        lat = step.op(role)(step.contiguous_for(role, c), state["pending"] if r > 1 else None, rows, pos,
                            w["compressor.norm"], w["rope_inv_freq"], state["compressed"], slot_c, eps=self.norm_eps,
                            ratio=r, cross_row_reads=step.spec_tokens > 0, **key)
        return lat

    def _index(self, step: StepContext, w: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
               iw: torch.Tensor, iq: torch.Tensor, pos: torch.Tensor, seq_c: torch.Tensor, slot_c: torch.Tensor,
               k: torch.Tensor | None) -> None:
        """This layer's top-k of the compressed rows into the shared selection buffer. ``iw [M, heads]`` and ``iq
        [M, heads * head_dim]``: column slices of the input projection and of the q_b gemm; ``seq_c [M]`` int32
        complete rows, ``slot_c [M]`` the key's slot (-1: none; every row -1 on layers that own no keys); ``k``:
        the key owner's new key rows (:meth:`_source`; None where the compressor wrote them or the layer owns none)."""
        ix, M = self.spec.indexer, iw.shape[0]
        assert ix is not None
        iw = step.contiguous_for("attn.indexer", iw)
        iq = step.contiguous_for("attn.indexer", iq).view(M, ix.num_heads, ix.head_dim)
        if self.index_keys:   # the key owner: this token's key (if it completes a row) goes into its cache
            cache, norm = state["index_k"], w["indexer.k_norm"]
            step.scratch[INDEX_K] = cache
        else:                 # scores against the owner's keys; writes none
            cache, norm = self._published(step, INDEX_K), None
        bt = step.meta["block_table"]
        bt = compressed_table(bt, self.spec.compress_ratio) if INDEX_COMPRESSED_TABLE else bt
        step.op("attn.indexer")(iq, k, iw, cache, slot_c, bt, seq_c,
                                topk=ix.topk, positions=pos, rope_inv_freq=w["rope_inv_freq"], rope_interleaved=True,
                                k_norm_weight=norm, k_norm_eps=self.norm_eps, k_norm_kind="rms",
                                cross_row_reads=step.spec_tokens > 0, out=step.scratch[TOPK][:M])


__all__ = ["COMPRESSED", "INDEX_K", "NO_SLOT", "SEQ_C", "SparseMQAAttention", "TOPK", "compressed_table",
           "rope_leading", "rope_tail"]
