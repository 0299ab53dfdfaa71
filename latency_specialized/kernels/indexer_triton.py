"""The DSA lightning indexer through Triton kernels: ``attention.indexer.triton``.

The contract is ``ops.attention.sparse_mla.indexer_topk_reference`` (its module docstring): key norm +
RoPE + key-cache write, relu-weighted scores of every cached token, the positions of the ``K`` largest.
The reference materialises the whole context in fp32 (``[B, capacity, D]``) and sorts with
``torch.topk``; this module reads the cache once, in its dtype, and selects on the device.

Steps of one call (three launches for ``selection="radix"``; ``"split"`` swaps the third for the two of
``topk_triton.topk_select``, ``"torch"`` for ``torch.topk``):

1. **key kernel**, grid ``(B,)``: the new key's norm in fp32 (``k_norm_kind``: LayerNorm with optional
   bias, or RMSNorm; none without a weight), the RoPE of its leading ``2 len(rope_inv_freq)`` channels
   (NeoX rotate-half or interleaved pairs), **rounded to the cache dtype** and stored at
   ``slot_mapping[b]`` (< 0: nothing). Its own launch, not fused into step 2: the scoring programs of
   row ``b`` read the new token's cache row, and nothing orders a store of one program before the loads
   of another in the same grid. Not launched for ``k=None`` (no key in this call);
2. **score kernel**, grid ``(B, num_splits)``: a program takes one contiguous chunk of one sequence's
   positions. The chunk comes from ``seq_lens[b]`` read *on the device* (``cdiv(seq_len, num_splits)``,
   at least ``MIN_CHUNK``, a multiple of ``BLOCK_T``), so a short sequence in a wide block table costs only
   its live tiles. A live program loads the ``h x D`` query tile once, rotates it in fp32 (the partner
   channel of each rotation pair is a second, permuted load: no register shuffles), **rounds it to the
   cache dtype** for the tensor-core dot, then per tile of ``BLOCK_T`` positions gathers the keys through
   ``block_table`` (ids past the end never read), ``s = q k^T`` (fp32 accumulation), and writes
   ``scale * sum_h w[b, h] relu(s)`` (fp32) to the logits workspace ``[B, capacity]``. For the torch
   selection (which reads the whole row) every program also writes -inf over its static
   ``cdiv(capacity, num_splits)`` slice of the row past ``seq_len``;
3. **select kernel**, grid ``(B,)``, one program per row: ``seq_len <= K`` (decided per row on the
   device) writes ``0 .. seq_len - 1`` then -1. Otherwise a radix select on order-preserving int32 keys
   of the fp32 logits: ``32 // SELECT_BITS`` histogram passes (4-bit digits: 8 passes of 16 bins) over the
   live logits (``tl.histogram``; rows of up to ``SELECT_RESIDENT_MAX`` positions loaded once and kept in
   registers, a row with at most half the resident tile live in a half-width tile: ``SELECT_NARROW_MIN_TILE``),
   each keeping only the keys whose higher digits equal the prefix found so far, give the ``K``-th largest key
   ``T`` and how many keys equal to ``T`` belong in the result (the passes stop once the keys sharing the prefix
   are exactly the ones still to take: ``SELECT_EARLY_EXIT``; ``T`` is then that prefix); a compaction pass
   writes the positions of the keys ``> T`` and the first of the ``== T`` (position order), with in-tile prefix
   sums (one program per row: no atomics, deterministic). Exactly ``K`` positions, so no -1.

``SELECT_FIRST_BYTE`` (on) lets step 2 count every live logit's leading key byte (a 256-bin histogram per program,
added to the row's counts with atomics) and step 3 start from those counts at bit 24 (the early-exit passes only):
the whole-row histogram passes that find the leading byte are not run; the select kernel resets the counts it read.

``SCORE_WRITES_KEY`` folds step 1 into step 2: the scoring program whose chunk holds a row's last position (the new
token's; only it reads that row) stores the new key, then a CTA barrier, then its tiles (verification calls,
``cross_row_reads``, keep the key launch). ``SCORE_SELECTS`` (radix only) folds step 3 into step 2: each scoring
program, done with its tiles, counts its arrival in a per-row counter (a CTA barrier, then one atomic add with
acquire-release semantics at GPU scope); the last of the row's programs to arrive resets the counter for the next call
and runs the same radix select on the row (its logits, stored by every program of the row, ordered before its reads by
that release / acquire). The scoring programs then launch with the select's warps.

``SELECTION`` = ``"split"`` (or the call's ``selection=``) replaces step 3 by ``topk_triton.topk_select``
over the live logits (``valid_lens = seq_lens``): each row cut over many programs, a split histogram and a
collect launch (that module's docstring); the same set as radix where values tie (the lowest positions).
``"torch"`` replaces it by ``torch.topk`` over the workspace (the -inf past ``seq_len`` map to -1).
``"auto"`` resolves by ``auto_selection`` from the block table's width.

So against the fp32 reference the scores carry a bf16 rounding of the rotated query (and the cache's own
dtype); near-ties may select differently, as any valid tie choice may. With fp32 tensors every step is
fp32 (``tl.dot`` in IEEE fp32), which is how the CPU tests check the kernels under the Triton interpreter.

``num_splits`` comes from static shapes only (batch, block-table capacity, SM count): nothing reads
``seq_lens`` on the host, nothing syncs, so the call captures into a CUDA graph and replays for any
``seq_lens`` / ``slot_mapping`` / cache contents. The logits workspace is ``torch.empty`` per call, as
``mla_decode_triton``'s split workspaces: under capture it comes from the graph's memory pool and keeps
its address across replays.

Triton is imported lazily (the kernels are built on the first call, per ``TRITON_INTERPRET`` setting), so
this module imports on machines without Triton and ``supports()`` names what is missing.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.hardware import sm_count
from latency_specialized.kernels.topk_triton import topk_select
from latency_specialized.kernels.triton_common import cached_zeroed_int32, pdl_available, triton_gpu_refusal

NAME = "attention.indexer.triton"

Selection = Literal["auto", "radix", "split", "torch"]
SELECTION: Selection = "auto"
"""Step 3: ``"radix"`` (the one-program-per-row select kernel), ``"split"`` (``topk_triton.topk_select``: two
launches, each row split over many programs), ``"torch"`` (``torch.topk`` over the logits workspace) or
``"auto"`` (``auto_selection``)."""
RADIX_MAX_CAPACITY = 8192
"""Largest block-table capacity (positions) the radix select serves under ``"auto"``: one program per row
is fastest while rows are short and latency-bound on long ones (``NOTES_indexer.md``)."""
SPLIT_ROWS = 8
"""Rows (tokens) up to which ``"auto"`` takes the split select above ``RADIX_MAX_CAPACITY`` and up to
``SPLIT_MAX_CAPACITY``; one row takes it at every capacity above radix's."""
SPLIT_MAX_CAPACITY = 16384
"""Largest capacity the split select serves under ``"auto"`` for 2..``SPLIT_ROWS`` rows; above it, and
for more rows, torch.topk (its row-parallel sort wins once rows x chunks fill the GPU)."""


def auto_selection(capacity: int, rows: int = 1) -> Selection:
    """What ``"auto"`` resolves to, from the block table's width in positions and the call's rows (both
    static: never seq_lens). The H200 crossovers behind the constants: ``NOTES_indexer.md``."""
    if capacity <= RADIX_MAX_CAPACITY:
        return "radix"
    if rows <= 1 or (rows <= SPLIT_ROWS and capacity <= SPLIT_MAX_CAPACITY):
        return "split"
    return "torch"


BLOCK_T = 64
"""Positions per scoring tile (the N of the ``h x D`` by ``D x BLOCK_T`` dot)."""
MIN_CHUNK = 64
"""Fewest positions a scoring program takes (device side): each program first loads and rotates the whole
``h x D`` query tile, which a chunk of a few tiles should outweigh - yet at batch 1 the chunk's tiles run one after
another in one program, so one tile each (64) beat two (128) in the layer (``NOTES_indexer.md``, session 48)."""
SCORE_KEYS_AHEAD = False
"""The scoring programs load each tile's block ids and keys one step ahead, the first tile's before the query's load
and rotation (a program's round trips then overlap instead of following each other; at batch 1 a program scores one
tile). Off: no faster in the layer (session 50's A/B, NOTES_indexer.md)."""
WAVES = 2
"""Target scoring programs per SM (batch x splits ~ WAVES x SMs) when choosing num_splits."""
MAX_SPLITS = 512
FILL_BLOCK = 1024
"""Logits per store of the -inf fill past ``seq_len``."""
SELECT_TILE = 2048
"""Logits per step of the select kernel's passes."""
SCORE_WARPS = 4
SELECT_WARPS = 8
SELECT_WARPS_WIDE = 16
"""Warps of the select kernel when its resident row is wider than 4096 logits."""
SCORE_WRITES_KEY = True
"""The scoring program whose chunk holds a row's last position (the new token's) writes the row's new key first (a CTA
barrier, then its tiles), instead of the key launch before the score kernel: one launch fewer (GLM-5.3's index layers;
DeepSeek-V4.1-Flash's key owners unless their compressor writes the key). Sound where every row reads only its own
positions and ``slot_mapping[b]`` is the row of its last position (or < 0), as in every decode step; a call with
``cross_row_reads`` (verification rows) keeps the key launch. On since session 50 (A/B in NOTES_indexer.md)."""
SCORE_SELECTS = False
"""With the radix selection, the score kernel's last program of each row to finish (a per-row arrival count, acquire /
release at GPU scope) runs the radix select of that row: one launch fewer (DeepSeek-V4.1-Flash c2_idx and GLM-5.3's
index layers: the select's launch and the gap before it), the score programs launched with the select's warps. Off:
slower in the layer (session 50's A/B, NOTES_indexer.md)."""
SELECT_TRIGGER_START = False
"""The radix select triggers its dependents at its start (after waiting for its own prerequisites, so everything
launched before it has finished): a consumer launched behind it with PDL - the sparse MQA split kernel
(``sparse_mqa_triton.SELECTION_PDL``) - then runs what does not need the selection (its prologue, the window's
slots) while the select runs, and waits before it reads the selection or stores. Off: A/B switch with
``SELECTION_PDL`` (``NOTES_sparse_mqa.md``, session 47)."""
SELECT_EARLY_EXIT = True
"""The radix passes stop as soon as the keys sharing the digits fixed so far are exactly the ones still to take (the
K-th largest key's bucket holds no key that stays out): the same set, its positions in another order (the keys > T
and == T of a shorter prefix). A few thousand distinct fp32 logits mostly part within 20 leading bits (5 of the 8
four-bit passes); tied or near-tied rows run all of them. On since session 48 (``NOTES_indexer.md``: the select
alone and the layer A/B)."""
SELECT_FINE_WIDTHS = False
"""With the half-width path, the width a row holds steps through 1/4, 3/8, 1/2, 3/4 and all of the resident tile by
its live length, 3/8 and 3/4 as two tiles (``_resident_select_pair``): every pass costs the width held, and a row just
past a power of two paid for the next one - DeepSeek-V4.1-Flash's c2_idx at context 4096 (2,080 live in an 8,192
tile: 4,096 -> 3,072), GLM-5.3's indexer at 4,097 live (8,192 -> 6,144). Off until a whole GPU suite runs with it on:
faster on DeepSeek-V4.1-Flash's c2_idx, slower on GLM-5.3's moe layer (session 50's A/B, NOTES_indexer.md)."""
SELECT_FIRST_BYTE = True
"""With the radix selection in its own launch and the early exit: every scoring program also counts its logits' leading
key bytes (a 256-bin histogram, added to the row's counts with one atomic per bin it saw) and the select kernel starts
from those counts - its passes begin at bit 24, so the two 4-bit passes over the whole resident tile that find the
leading byte are not run (the first of them needs no mask, the second one with the top digit fixed). The counts live
in one zeroed buffer per device (``first_byte_counts``) that the select kernel resets per row as it reads it. The
same selection (the same set). On since session 53 (with ``SELECT_PACKED_SCAN``: the layer A/Bs in NOTES_indexer.md)."""
SELECT_PACKED_SCAN = True
"""The select's compaction ranks the keys > T and == T with one prefix sum of both (16-bit fields of one int32: a tile
holds fewer than 65,536 keys) instead of two, and counts them with one sum: the block-wide scans are about a fifth of
the select's instructions at GLM-5.3's 8,192 tile (offline sm_90a SASS, NOTES_indexer.md, session 51). The same
positions. On since session 53 (with ``SELECT_FIRST_BYTE``, NOTES_indexer.md)."""
SELECT_WIDE_LOOPS = False
"""With the half-width path, a row too long for it (more than half of the resident tile live) loops over
``SELECT_TILE``-wide tiles of its live logits in every pass, as a table wider than ``SELECT_RESIDENT_MAX`` does,
instead of holding the whole tile: GLM-5.3's indexer at context 4096 has one live position past the half of its tile,
where every row looped was faster in its layer and slower in DeepSeek-V4.1-Flash's c2_idx, whose rows fit the
half-width path (session 53, NOTES_indexer.md). The same set. Off until timed on top of the session-53 defaults (step
``pick54`` of ``pending_measurements.sh``). Only from ``SELECT_WIDE_LOOPS_MIN_TILE``."""
SELECT_WIDE_LOOPS_MIN_TILE = 8192
"""Smallest resident tile whose rows past the half loop with ``SELECT_WIDE_LOOPS``: the tiles held on
``SELECT_WARPS_WIDE``, the ones its A/B times; a 4,096 tile keeps its resident rows (its loop would take 1,024-wide
tiles, not measured)."""
MAX_FIRST_BYTE_ROWS = 1024
"""Rows one call may select with ``SELECT_FIRST_BYTE`` (its 256 int32 counts a row: 1 MiB a device)."""
SELECT_BITS = 4
"""Radix digit width of the select kernel: 32 // SELECT_BITS histogram passes of 2**SELECT_BITS bins.
H200, one row, relu-skewed logits (``benchmarks/results/h200/topk_radix_variants.md``): 4-bit digits in 8
passes beat 8-bit digits in 4 (a histogram pass costs ~bins/32 ballot + popcount steps per key in Triton's
lowering): 4096 logits looped over tiles 22.5 -> 19.3 us, resident 15.5 -> 12.9."""
SELECT_RESIDENT_MAX = 8192
"""Largest block-table capacity whose rows the select kernel loads once and keeps in registers across its
passes (one tile of the next power of two >= capacity; no spills at 8192 with 16 warps); wider tables loop
over SELECT_TILE tiles per pass. H200 (same file): 4096 logits 19.3 (looped) -> 12.9 us (resident, 8 warps),
8192 logits 36.0 -> 22.2 (resident, 16 warps; 8 warps 28.3); the select of the session-21 kernel 22.5 / 42.2."""
SELECT_NARROW_MIN_TILE = 2048
"""Smallest resident tile whose select kernel also holds a half-width resident path, taken per row at run time
when the row's live logits fit it (``NARROW``): a block table sized beyond the live lengths (a server's longest
context, the raw table of a compressed cache) no longer makes every pass cost its whole width. 0: never."""
MAX_TILE = 64 * 256
"""Most ``h_pad x d_pad`` elements of the query tile a scoring program holds (fp32 registers)."""

_NORM_NONE, _NORM_LAYER, _NORM_RMS = 0, 1, 2
_SITE_NORMS = (None, "layer", "layer_norm", "rms", "rms_norm")
"""Values of the site attribute ``k_norm`` this kernel serves (the pieces write ``"layer_norm"``)."""


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool) -> dict:
    """Build the jitted kernels (``triton.jit`` decides interpreter vs compiler when it decorates, from
    ``TRITON_INTERPRET``; hence one build per setting, on first use). Returns a dict by name."""
    del interpret  # the cache key only
    # defined here, not at import (no triton import on machines without it); Triton resolves the names a
    # kernel uses through its module globals: hence tl and the helpers as globals
    global tl, tlc, _rope_coeffs, _score_tile_keys, _ordered_keys, _digit_hist, _digit_hist_at, _next_digit, \
        _byte_start, _ranks, _totals, _resident_select, _pair_hist, _resident_select_pair, _looped_select, \
        _select_row, _store_key
    import triton
    import triton.language as tl
    import triton.language.extra.cuda as tlc

    @triton.jit
    def _rope_coeffs(offs, pos, inv_freq, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
        # -> (partner, c, s) per channel: rotated = x * c + x[partner] * s (c = 1, s = 0 past the
        # rotated channels). Pair (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), as rotate_leading.
        rot = offs < 2 * HALF
        if INTERLEAVED:
            partner = offs ^ 1
            j = offs // 2
            first = (offs % 2) == 0
        else:
            partner = tl.where(offs < HALF, offs + HALF, offs - HALF)
            j = offs % HALF
            first = offs < HALF
        partner = tl.where(rot, partner, offs)
        f = tl.load(inv_freq + j, mask=rot, other=0.0).to(tl.float32)
        ang = pos * f
        c = tl.where(rot, tl.cos(ang), 1.0)
        s = tl.where(rot, tl.where(first, -tl.sin(ang), tl.sin(ang)), 0.0)
        return partner, c, s

    @triton.jit
    def _ordered_keys(x):
        # fp32 -> int32 with the same order (signed compare): negative floats have their magnitude bits
        # flipped, so a more negative float gets a smaller key
        i = x.to(tl.int32, bitcast=True)
        return tl.where(i < 0, i ^ 0x7FFFFFFF, i)

    @triton.jit
    def _store_key(k, k_w, k_b, inv_freq, positions, b, slot, cache, eps, s_k, s_row, D: tl.constexpr,
                   D_PAD: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                   ROPE: tl.constexpr, INTERLEAVED: tl.constexpr):
        # row b's new key: norm (NORM 1 LayerNorm, 2 RMSNorm), RoPE, rounded into the cache at slot (>= 0)
        offs = tl.arange(0, D_PAD)
        ok = offs < D
        if ROPE:
            pos = tl.load(positions + b).to(tl.float32)
            partner, c, s = _rope_coeffs(offs, pos, inv_freq, HALF, INTERLEAVED)
        else:
            partner = offs
        x = tl.load(k + b * s_k + offs, mask=ok, other=0.0).to(tl.float32)
        xp = tl.load(k + b * s_k + partner, mask=ok, other=0.0).to(tl.float32)
        # the norm is per channel once its statistics are known, so the partner channels (for the
        # rotation) are normalised with their own weight / bias
        if NORM == 1:
            mean = tl.sum(x, 0) / D
            xc = tl.where(ok, x - mean, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / D + eps)
            x = (x - mean) * rstd * tl.load(k_w + offs, mask=ok, other=0.0).to(tl.float32)
            xp = (xp - mean) * rstd * tl.load(k_w + partner, mask=ok, other=0.0).to(tl.float32)
            if HAS_BIAS:
                x += tl.load(k_b + offs, mask=ok, other=0.0).to(tl.float32)
                xp += tl.load(k_b + partner, mask=ok, other=0.0).to(tl.float32)
        elif NORM == 2:
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
            x = x * rstd * tl.load(k_w + offs, mask=ok, other=0.0).to(tl.float32)
            xp = xp * rstd * tl.load(k_w + partner, mask=ok, other=0.0).to(tl.float32)
        if ROPE:
            x = x * c + xp * s
        tl.store(cache + slot * s_row + offs, x.to(cache.dtype.element_ty), mask=ok)

    @triton.jit
    def key_kernel(k, k_w, k_b, inv_freq, positions, slots, cache, eps, s_k, s_row,
                   D: tl.constexpr, D_PAD: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
                   HAS_BIAS: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr):
        b = tl.program_id(0)
        slot = tl.load(slots + b).to(tl.int64)
        if slot >= 0:  # a negative slot (padding row) writes nothing
            _store_key(k, k_w, k_b, inv_freq, positions, b, slot, cache, eps, s_k, s_row, D, D_PAD, HALF, NORM,
                       HAS_BIAS, ROPE, INTERLEAVED)

    @triton.jit
    def _score_tile_keys(cache, block_table, b, s_bt, s_row, block_size, n0, end, offs_d, d_ok, BT: tl.constexpr):
        # the positions n0 .. n0 + BT of row b below end, their mask and their cached keys [BT, D_PAD] (negative
        # ids inside the live range are clamped, not read out of bounds)
        pos_t = n0 + tl.arange(0, BT)
        ok = pos_t < end
        blk = tl.maximum(tl.load(block_table + b * s_bt + pos_t // block_size, mask=ok, other=0), 0)
        crow = blk.to(tl.int64) * block_size + (pos_t % block_size)
        kt = tl.load(cache + crow[:, None] * s_row + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        return pos_t, ok, kt

    @triton.jit
    def score_kernel(q, w, inv_freq, positions, cache, block_table, seq_lens, logits,
                     H, num_splits, block_size, cap, fill_chunk, scale,
                     s_qb, s_qh, s_wb, s_row, s_bt, s_lb, arrivals, out, K, s_ob,
                     k, k_w, k_b, slots, k_eps, s_k, first_bytes,
                     D: tl.constexpr, D_PAD: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr,
                     ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, BT: tl.constexpr, MIN_CHUNK: tl.constexpr,
                     FILL: tl.constexpr, PREC: tl.constexpr, AHEAD: tl.constexpr, SELECT: tl.constexpr,
                     TILE: tl.constexpr, BITS: tl.constexpr, RESIDENT: tl.constexpr, NARROW: tl.constexpr,
                     EARLY: tl.constexpr, FINE: tl.constexpr, PACKED: tl.constexpr, LOOPS: tl.constexpr,
                     LOOP_TILE: tl.constexpr, KEY: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BYTES: tl.constexpr):
        # AHEAD: each tile's block ids and keys load one step ahead, the first before the query (SCORE_KEYS_AHEAD);
        # SELECT: the last program of a row to finish runs the radix select of it (SCORE_SELECTS; TILE .. LOOP_TILE as
        # select_kernel's), counted in arrivals[b] (zero between calls: that program resets it); KEY: the program
        # whose chunk holds the row's last position writes the row's new key first (SCORE_WRITES_KEY; NORM,
        # HAS_BIAS as key_kernel's); BYTES: the program adds its logits' leading key bytes to first_bytes[b] (256
        # counts, zero between calls: the select kernel reads and resets them - SELECT_FIRST_BYTE)
        b = tl.program_id(0)
        sp = tl.program_id(1)
        seq_len = tl.load(seq_lens + b).to(tl.int32)
        row = logits + b.to(tl.int64) * s_lb
        # this program's chunk of live positions, from the device-side length (no host read)
        chunk = tl.maximum(tl.cdiv(seq_len, num_splits), MIN_CHUNK)
        chunk = tl.cdiv(chunk, BT) * BT
        start = sp * chunk
        end = tl.minimum(start + chunk, seq_len)
        if KEY:
            # only this program reads the new key's row (the last position; rows read only their own positions: no
            # cross-row reads here), so its store, then the CTA barrier, orders it before its own tile loads
            slot = tl.load(slots + b).to(tl.int64)
            if (sp == tl.maximum(seq_len - 1, 0) // chunk) & (slot >= 0):
                _store_key(k, k_w, k_b, inv_freq, positions, b, slot, cache, k_eps, s_k, s_row, D, D_PAD, HALF, NORM,
                           HAS_BIAS, ROPE, INTERLEAVED)
            tl.debug_barrier()
        # -inf over this program's static slice of the row past seq_len (what torch.topk must not pick)
        f0 = tl.maximum(sp * fill_chunk, seq_len)
        f1 = tl.minimum((sp + 1) * fill_chunk, cap)
        for t0 in range(f0, f1, FILL):
            offs_f = t0 + tl.arange(0, FILL)
            tl.store(row + offs_f, tl.full([FILL], float("-inf"), tl.float32), mask=offs_f < f1)
        counts = tl.zeros([256], dtype=tl.int32)   # BYTES: this program's leading key bytes
        if start < end:
            offs_h = tl.arange(0, H_PAD)
            offs_d = tl.arange(0, D_PAD)
            h_ok = offs_h < H
            d_ok = offs_d < D
            if AHEAD:  # the first tile's block ids and keys before the query: their round trips overlap
                pos_t, ok, kt = _score_tile_keys(cache, block_table, b, s_bt, s_row, block_size, start, end, offs_d,
                                                 d_ok, BT)
            qm = h_ok[:, None] & d_ok[None, :]
            qrow = q + b * s_qb + offs_h[:, None] * s_qh
            qt = tl.load(qrow + offs_d[None, :], mask=qm, other=0.0).to(tl.float32)     # [H_PAD, D_PAD]
            if ROPE:
                pos = tl.load(positions + b).to(tl.float32)
                partner, c, s = _rope_coeffs(offs_d, pos, inv_freq, HALF, INTERLEAVED)
                qp = tl.load(qrow + partner[None, :], mask=qm, other=0.0).to(tl.float32)
                qt = qt * c[None, :] + qp * s[None, :]
            qt = qt.to(cache.dtype.element_ty)
            wv = tl.load(w + b * s_wb + offs_h, mask=h_ok, other=0.0).to(tl.float32) * scale   # [H_PAD]
            if AHEAD:
                for n0 in range(start, end, BT):
                    sc = tl.dot(qt, tl.trans(kt), input_precision=PREC)
                    lg = tl.sum(tl.maximum(sc, 0.0) * wv[:, None], 0)
                    tl.store(row + pos_t, lg, mask=ok)
                    if BYTES:
                        counts += tl.histogram((_ordered_keys(lg) >> 24) + 128, 256, mask=ok)
                    pos_t, ok, kt = _score_tile_keys(cache, block_table, b, s_bt, s_row, block_size, n0 + BT, end,
                                                     offs_d, d_ok, BT)     # the next tile's (past end: none read)
            else:
                for n0 in range(start, end, BT):
                    pos_t, ok, kt = _score_tile_keys(cache, block_table, b, s_bt, s_row, block_size, n0, end, offs_d,
                                                     d_ok, BT)
                    sc = tl.dot(qt, tl.trans(kt), input_precision=PREC)                    # [H_PAD, BT] fp32
                    lg = tl.sum(tl.maximum(sc, 0.0) * wv[:, None], 0)                       # [BT]
                    tl.store(row + pos_t, lg, mask=ok)
                    if BYTES:
                        counts += tl.histogram((_ordered_keys(lg) >> 24) + 128, 256, mask=ok)
        if BYTES:   # the counts only: the select kernel launches after this one ends
            tl.atomic_add(first_bytes + b * 256 + tl.arange(0, 256), counts, mask=counts > 0, sem="relaxed")
        if SELECT:
            # every thread's logits stored before the arrival (the CTA barrier, then one release at GPU scope); the
            # last to arrive acquires them all, and its threads read them after the barrier that hands out the count
            tl.debug_barrier()
            arrived = tl.atomic_add(arrivals + b, 1, sem="acq_rel", scope="gpu")
            tl.debug_barrier()
            if arrived == num_splits - 1:
                tl.store(arrivals + b, 0)   # for the next call: every program of this one has arrived
                _select_row(row, out + b.to(tl.int64) * s_ob, seq_len, K, TILE, BITS, RESIDENT, NARROW, EARLY, FINE,
                            ".cg", counts, False, PACKED, LOOPS, LOOP_TILE)

    @triton.jit
    def _digit_hist(key, ok, prefix, FIRST: tl.constexpr, SHIFT: tl.constexpr, BITS: tl.constexpr,
                    NB: tl.constexpr):
        # the histogram of one radix digit over the keys that match the digits fixed so far
        if FIRST:  # the top digit, signed (arithmetic shift) -> 0..NB-1 keeping the order
            digit = (key >> SHIFT) + NB // 2
            m = ok
        else:
            digit = (key >> SHIFT) & (NB - 1)
            m = ok & ((key >> (SHIFT + BITS)) == prefix)
        return tl.histogram(digit, NB, mask=m)

    @triton.jit
    def _next_digit(hist, bins, prefix, remaining, FIRST: tl.constexpr, NB: tl.constexpr):
        # the digit d where the count of larger digits is < remaining <= that count + hist[d]: the prefix with d
        # appended (the top digit signed, as _digit_hist counts it), what is left to take below it and how many
        # keys share the new prefix (the callers that do not stop early drop it)
        gt = tl.sum(hist, 0) - tl.cumsum(hist, 0)
        hit = (gt < remaining) & (gt + hist >= remaining)
        d = tl.sum(tl.where(hit, bins, 0), 0)
        remaining -= tl.sum(tl.where(hit, gt, 0), 0)
        if FIRST:
            prefix = d - NB // 2
        else:
            prefix = prefix * NB + d
        return prefix, remaining, tl.sum(tl.where(hit, hist, 0), 0)

    @triton.jit
    def _digit_hist_at(key, ok, prefix, shift, BITS: tl.constexpr, NB: tl.constexpr):
        # _digit_hist of a later digit at a run-time shift (the early-exit passes)
        digit = (key >> shift) & (NB - 1)
        return tl.histogram(digit, NB, mask=ok & ((key >> (shift + BITS)) == prefix))

    @triton.jit
    def _byte_start(bytes_hist, prefix, remaining, seq_len):
        # the early-exit passes' start from the score kernel's leading-byte counts (SELECT_FIRST_BYTE): the prefix
        # (the signed top byte), what is left to take, the keys sharing it, and its shift (24)
        prefix, remaining, shared = _next_digit(bytes_hist, tl.arange(0, 256), prefix, remaining, True, 256)
        return prefix, remaining, shared, seq_len * 0 + 24

    @triton.jit
    def _ranks(is_gt, is_eq, PACKED: tl.constexpr):
        # 0-based ranks in the tile of the keys > T and == T: one prefix sum of both (PACKED: 16-bit fields, a tile
        # holds fewer than 65,536 keys) or two
        if PACKED:
            c = tl.cumsum(is_gt + (is_eq << 16), 0)
            return (c & 0xFFFF) - 1, (c >> 16) - 1
        else:
            return tl.cumsum(is_gt, 0) - 1, tl.cumsum(is_eq, 0) - 1

    @triton.jit
    def _totals(is_gt, is_eq, PACKED: tl.constexpr):
        # how many keys of the tile are > T and == T (PACKED: one sum of both)
        if PACKED:
            c = tl.sum(is_gt + (is_eq << 16), 0)
            return c & 0xFFFF, c >> 16
        else:
            return tl.sum(is_gt, 0), tl.sum(is_eq, 0)

    @triton.jit
    def _resident_select(row, orow, seq_len, K, T: tl.constexpr, BITS: tl.constexpr, EARLY: tl.constexpr,
                         CM: tl.constexpr, bytes_hist, BYTES: tl.constexpr, PACKED: tl.constexpr):
        # the radix select of a row held in registers as one T-wide tile (K < seq_len <= T); EARLY: stop the
        # passes once the prefix's keys are exactly those still to take (SELECT_EARLY_EXIT); BYTES (with EARLY):
        # bytes_hist [256] counts the row's leading key bytes (the score kernel's), so the passes start at bit 24
        NB: tl.constexpr = 1 << BITS
        PASSES: tl.constexpr = 32 // BITS
        prefix = seq_len * 0            # int32: the key digits fixed so far (arithmetic-shift form)
        remaining = seq_len * 0 + K     # how many of the keys matching the prefix still belong in
        bins = tl.arange(0, NB)
        roffs = tl.arange(0, T)
        rok = roffs < seq_len
        rkey = _ordered_keys(tl.load(row + roffs, mask=rok, other=0.0, cache_modifier=CM))
        if EARLY:
            if BYTES:
                prefix, remaining, shared, shift = _byte_start(bytes_hist, prefix, remaining, seq_len)
            else:
                hist = _digit_hist(rkey, rok, prefix, True, 32 - BITS, BITS, NB)
                prefix, remaining, shared = _next_digit(hist, bins, prefix, remaining, True, NB)
                shift = seq_len * 0 + (32 - BITS)   # the prefix is rkey >> shift
            while (shared > remaining) & (shift > 0):
                shift -= BITS
                hist = _digit_hist_at(rkey, rok, prefix, shift, BITS, NB)
                prefix, remaining, shared = _next_digit(hist, bins, prefix, remaining, False, NB)
            rkey = rkey >> shift
        else:
            for p in tl.static_range(PASSES):
                hist = tl.zeros([NB], dtype=tl.int32)
                hist += _digit_hist(rkey, rok, prefix, p == 0, 32 - BITS * (p + 1), BITS, NB)
                prefix, remaining, _ = _next_digit(hist, bins, prefix, remaining, p == 0, NB)
        # prefix: the K-th largest key T (EARLY: its leading digits); K - remaining keys are > T, `remaining` of
        # the == T are taken (EARLY stopped early: all of them)
        n_gt = K - remaining
        is_gt = (rok & (rkey > prefix)).to(tl.int32)
        is_eq = (rok & (rkey == prefix)).to(tl.int32)
        at_gt, at_eq = _ranks(is_gt, is_eq, PACKED)
        tl.store(orow + at_gt, roffs, mask=is_gt > 0)
        tl.store(orow + n_gt + at_eq, roffs, mask=(is_eq > 0) & (at_eq < remaining))

    @triton.jit
    def _pair_hist(ka, oka, kb, okb, prefix, shift, FIRST: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr):
        # one digit's histogram over a row held as two tiles (FIRST: the top digit, its shift is 32 - BITS)
        if FIRST:
            return (_digit_hist(ka, oka, prefix, True, 32 - BITS, BITS, NB)
                    + _digit_hist(kb, okb, prefix, True, 32 - BITS, BITS, NB))
        return _digit_hist_at(ka, oka, prefix, shift, BITS, NB) + _digit_hist_at(kb, okb, prefix, shift, BITS, NB)

    @triton.jit
    def _resident_select_pair(row, orow, seq_len, K, TA: tl.constexpr, TB: tl.constexpr, BITS: tl.constexpr,
                              EARLY: tl.constexpr, CM: tl.constexpr, bytes_hist, BYTES: tl.constexpr,
                              PACKED: tl.constexpr):
        # _resident_select of a row held as two tiles, [0, TA) and [TA, TA + TB) (K < seq_len <= TA + TB): a
        # width between two powers of two costs its own width in every pass, not the next power's (BYTES as
        # _resident_select's)
        NB: tl.constexpr = 1 << BITS
        PASSES: tl.constexpr = 32 // BITS
        prefix = seq_len * 0
        remaining = seq_len * 0 + K
        bins = tl.arange(0, NB)
        offa = tl.arange(0, TA)
        offb = TA + tl.arange(0, TB)
        oka = offa < seq_len
        okb = offb < seq_len
        ka = _ordered_keys(tl.load(row + offa, mask=oka, other=0.0, cache_modifier=CM))
        kb = _ordered_keys(tl.load(row + offb, mask=okb, other=0.0, cache_modifier=CM))
        if BYTES:   # (with EARLY) the leading byte from the score kernel's counts
            prefix, remaining, shared, shift = _byte_start(bytes_hist, prefix, remaining, seq_len)
        else:
            shift = seq_len * 0 + (32 - BITS)   # the prefix is key >> shift
            hist = _pair_hist(ka, oka, kb, okb, prefix, shift, True, BITS, NB)
            prefix, remaining, shared = _next_digit(hist, bins, prefix, remaining, True, NB)
        if EARLY:
            while (shared > remaining) & (shift > 0):
                shift -= BITS
                hist = _pair_hist(ka, oka, kb, okb, prefix, shift, False, BITS, NB)
                prefix, remaining, shared = _next_digit(hist, bins, prefix, remaining, False, NB)
        else:
            for p in tl.static_range(1, PASSES):
                shift -= BITS
                hist = _pair_hist(ka, oka, kb, okb, prefix, shift, False, BITS, NB)
                prefix, remaining, shared = _next_digit(hist, bins, prefix, remaining, False, NB)
        ka = ka >> shift
        kb = kb >> shift
        n_gt = K - remaining
        gta = (oka & (ka > prefix)).to(tl.int32)
        eqa = (oka & (ka == prefix)).to(tl.int32)
        gtb = (okb & (kb > prefix)).to(tl.int32)
        eqb = (okb & (kb == prefix)).to(tl.int32)
        at_gta, at_eqa = _ranks(gta, eqa, PACKED)
        n_gta, n_eqa = _totals(gta, eqa, PACKED)
        at_gtb, at_eqb = _ranks(gtb, eqb, PACKED)
        at_gtb += n_gta
        at_eqb += n_eqa
        tl.store(orow + at_gta, offa, mask=gta > 0)
        tl.store(orow + n_gt + at_eqa, offa, mask=(eqa > 0) & (at_eqa < remaining))
        tl.store(orow + at_gtb, offb, mask=gtb > 0)
        tl.store(orow + n_gt + at_eqb, offb, mask=(eqb > 0) & (at_eqb < remaining))

    @triton.jit
    def _select_row(row, orow, seq_len, K, TILE: tl.constexpr, BITS: tl.constexpr, RESIDENT: tl.constexpr,
                    NARROW: tl.constexpr, EARLY: tl.constexpr, FINE: tl.constexpr, CM: tl.constexpr, bytes_hist,
                    BYTES: tl.constexpr, PACKED: tl.constexpr, LOOPS: tl.constexpr, LOOP_TILE: tl.constexpr):
        # the select of one row of logits into orow (select_kernel's program; the score kernel's last program of a
        # row with SELECT); CM: the logits loads' cache modifier (".cg" there: L2, never a stale L1 line); BYTES
        # (with EARLY): bytes_hist [256], the row's leading key bytes counted by the score kernel; LOOPS (with
        # NARROW): a row past the half-width path loops over LOOP_TILE tiles instead of holding the whole tile
        if seq_len <= K:  # every live position, then -1: no selection needed
            for k0 in range(0, K, TILE):
                offs = k0 + tl.arange(0, TILE)
                tl.store(orow + offs, tl.where(offs < seq_len, offs, -1), mask=offs < K)
        elif RESIDENT:
            if NARROW and FINE:    # the width held: TILE / 4, 3/8 (a pair), 1/2, 3/4 (a pair) or all of it
                if seq_len <= TILE // 4:
                    _resident_select(row, orow, seq_len, K, TILE // 4, BITS, EARLY, CM, bytes_hist, BYTES, PACKED)
                elif seq_len <= TILE // 4 + TILE // 8:
                    _resident_select_pair(row, orow, seq_len, K, TILE // 4, TILE // 8, BITS, EARLY, CM, bytes_hist,
                                          BYTES, PACKED)
                elif seq_len <= TILE // 2:
                    _resident_select(row, orow, seq_len, K, TILE // 2, BITS, EARLY, CM, bytes_hist, BYTES, PACKED)
                elif seq_len <= TILE // 2 + TILE // 4:
                    _resident_select_pair(row, orow, seq_len, K, TILE // 2, TILE // 4, BITS, EARLY, CM, bytes_hist,
                                          BYTES, PACKED)
                else:
                    _resident_select(row, orow, seq_len, K, TILE, BITS, EARLY, CM, bytes_hist, BYTES, PACKED)
            elif NARROW:
                if seq_len <= TILE // 2:
                    _resident_select(row, orow, seq_len, K, TILE // 2, BITS, EARLY, CM, bytes_hist, BYTES, PACKED)
                elif LOOPS:
                    _looped_select(row, orow, seq_len, K, LOOP_TILE, BITS, EARLY, CM, bytes_hist, BYTES, PACKED)
                else:
                    _resident_select(row, orow, seq_len, K, TILE, BITS, EARLY, CM, bytes_hist, BYTES, PACKED)
            else:
                _resident_select(row, orow, seq_len, K, TILE, BITS, EARLY, CM, bytes_hist, BYTES, PACKED)
        else:
            _looped_select(row, orow, seq_len, K, TILE, BITS, EARLY, CM, bytes_hist, BYTES, PACKED)

    @triton.jit
    def _looped_select(row, orow, seq_len, K, TILE: tl.constexpr, BITS: tl.constexpr, EARLY: tl.constexpr,
                       CM: tl.constexpr, bytes_hist, BYTES: tl.constexpr, PACKED: tl.constexpr):
        # the radix select of a row read in TILE-wide tiles of its live logits in every pass (K < seq_len; a block
        # table wider than SELECT_RESIDENT_MAX, or a row past the half-width path with SELECT_WIDE_LOOPS); BYTES
        # as _resident_select's
        NB: tl.constexpr = 1 << BITS
        PASSES: tl.constexpr = 32 // BITS
        prefix = seq_len * 0
        remaining = seq_len * 0 + K
        bins = tl.arange(0, NB)
        shift = seq_len * 0             # EARLY: the prefix is key >> shift
        if EARLY:
            if BYTES:   # the leading byte from the score kernel's counts
                prefix, remaining, shared, shift = _byte_start(bytes_hist, prefix, remaining, seq_len)
            else:
                hist = tl.zeros([NB], dtype=tl.int32)
                for t0 in range(0, seq_len, TILE):
                    offs = t0 + tl.arange(0, TILE)
                    ok = offs < seq_len
                    key = _ordered_keys(tl.load(row + offs, mask=ok, other=0.0, cache_modifier=CM))
                    hist += _digit_hist(key, ok, prefix, True, 32 - BITS, BITS, NB)
                prefix, remaining, shared = _next_digit(hist, bins, prefix, remaining, True, NB)
                shift += 32 - BITS
            while (shared > remaining) & (shift > 0):
                shift -= BITS
                hist = tl.zeros([NB], dtype=tl.int32)
                for t0 in range(0, seq_len, TILE):
                    offs = t0 + tl.arange(0, TILE)
                    ok = offs < seq_len
                    key = _ordered_keys(tl.load(row + offs, mask=ok, other=0.0, cache_modifier=CM))
                    hist += _digit_hist_at(key, ok, prefix, shift, BITS, NB)
                prefix, remaining, shared = _next_digit(hist, bins, prefix, remaining, False, NB)
        else:
            for p in tl.static_range(PASSES):
                hist = tl.zeros([NB], dtype=tl.int32)
                for t0 in range(0, seq_len, TILE):
                    offs = t0 + tl.arange(0, TILE)
                    ok = offs < seq_len
                    key = _ordered_keys(tl.load(row + offs, mask=ok, other=0.0, cache_modifier=CM))
                    hist += _digit_hist(key, ok, prefix, p == 0, 32 - BITS * (p + 1), BITS, NB)
                prefix, remaining, _ = _next_digit(hist, bins, prefix, remaining, p == 0, NB)
        n_gt = K - remaining
        base_gt = seq_len * 0
        base_eq = seq_len * 0
        for t0 in range(0, seq_len, TILE):
            offs = t0 + tl.arange(0, TILE)
            ok = offs < seq_len
            key = _ordered_keys(tl.load(row + offs, mask=ok, other=0.0, cache_modifier=CM))
            if EARLY:
                key = key >> shift
            is_gt = (ok & (key > prefix)).to(tl.int32)
            is_eq = (ok & (key == prefix)).to(tl.int32)
            at_gt, at_eq = _ranks(is_gt, is_eq, PACKED)
            at_gt += base_gt
            at_eq += base_eq
            tl.store(orow + at_gt, offs, mask=is_gt > 0)
            tl.store(orow + n_gt + at_eq, offs, mask=(is_eq > 0) & (at_eq < remaining))
            n_gt_tile, n_eq_tile = _totals(is_gt, is_eq, PACKED)
            base_gt += n_gt_tile
            base_eq += n_eq_tile

    @triton.jit
    def select_kernel(logits, seq_lens, out, K, s_lb, s_ob, first_bytes, TILE: tl.constexpr, BITS: tl.constexpr,
                      RESIDENT: tl.constexpr, NARROW: tl.constexpr, TRIGGER: tl.constexpr, EARLY: tl.constexpr,
                      FINE: tl.constexpr, PACKED: tl.constexpr, BYTES: tl.constexpr, LOOPS: tl.constexpr,
                      LOOP_TILE: tl.constexpr):
        # BITS: radix digit width (32 // BITS histogram passes of 2**BITS bins); RESIDENT: the row fits one
        # TILE (the caller's capacity <= TILE), loaded once and kept in registers across the passes; NARROW: a
        # row of at most TILE / 2 live logits takes a half-width resident select (the passes cost the tile's
        # width, not the row's); TRIGGER: the next launch (with PDL) may start now - it waits before it reads out
        # or writes memory this kernel reads (SELECT_TRIGGER_START); EARLY: the passes stop once the keys sharing
        # the digits fixed so far are exactly the ones still to take (SELECT_EARLY_EXIT); FINE (with NARROW): the
        # width held follows the live length in finer steps, two of them as a pair of tiles (SELECT_FINE_WIDTHS);
        # BYTES (with EARLY): first_bytes[b] holds the row's leading key bytes counted by the score kernel: read and
        # reset to zero for the next call (SELECT_FIRST_BYTE); LOOPS (with NARROW): a row past the half-width path
        # loops over LOOP_TILE tiles instead of holding all of TILE (SELECT_WIDE_LOOPS)
        if TRIGGER:
            tlc.gdc_wait()                  # a no-op unless this launch itself had PDL: what came before is done
            tlc.gdc_launch_dependents()
        b = tl.program_id(0)
        counts = tl.zeros([256], dtype=tl.int32)
        if BYTES:
            brow = first_bytes + b * 256 + tl.arange(0, 256)
            counts = tl.load(brow)
            tl.debug_barrier()
            tl.store(brow, tl.zeros([256], dtype=tl.int32))
        _select_row(logits + b.to(tl.int64) * s_lb, out + b.to(tl.int64) * s_ob,
                    tl.load(seq_lens + b).to(tl.int32), K, TILE, BITS, RESIDENT, NARROW, EARLY, FINE, "", counts,
                    BYTES, PACKED, LOOPS, LOOP_TILE)

    return dict(key=key_kernel, score=score_kernel, select=select_kernel)


def launch_select(kernel, logits: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, topk: int, capacity: int,
                  *, bits: int | None = None, resident_max: int | None = None, warps: int | None = None,
                  narrow_min: int | None = None, trigger: bool = False, early: bool | None = None,
                  fine: bool | None = None, first_bytes: torch.Tensor | None = None,
                  packed: bool | None = None, loops: bool | None = None) -> None:
    """The radix select over logits [B, >= capacity] fp32 into out [B, topk] int32 (one program per row);
    ``bits`` / ``resident_max`` / ``warps`` / ``narrow_min`` / ``early`` / ``fine`` / ``packed`` / ``loops`` default to
    SELECT_BITS / SELECT_RESIDENT_MAX / SELECT_WARPS / SELECT_NARROW_MIN_TILE / SELECT_EARLY_EXIT / SELECT_FINE_WIDTHS
    / SELECT_PACKED_SCAN / SELECT_WIDE_LOOPS. ``trigger``: let a PDL launch behind it start at once
    (``select_trigger``). ``first_bytes``:
    the rows' leading key bytes as the score kernel counted them (``first_byte_counts``; read and reset here; needs
    the early exit)."""
    consts, nw = select_config(capacity, bits=bits, resident_max=resident_max, warps=warps, narrow_min=narrow_min,
                               early=early, fine=fine, packed=packed, loops=loops)
    if first_bytes is not None and not consts["EARLY"]:
        raise UserError(f"{NAME}: the select from the leading-byte counts needs the early exit (SELECT_EARLY_EXIT); "
                        "switch SELECT_FIRST_BYTE off or the early exit on")
    kernel[(logits.shape[0],)](logits, seq_lens, out, topk, logits.stride(0), out.stride(0),
                               logits if first_bytes is None else first_bytes, TRIGGER=bool(trigger),
                               BYTES=first_bytes is not None, num_warps=nw, **consts)


def select_config(capacity: int, *, bits: int | None = None, resident_max: int | None = None,
                  warps: int | None = None, narrow_min: int | None = None, early: bool | None = None,
                  fine: bool | None = None, packed: bool | None = None,
                  loops: bool | None = None) -> tuple[dict[str, int | bool], int]:
    """The radix select's constexprs (TILE, BITS, RESIDENT, NARROW, EARLY, FINE, PACKED, LOOPS, LOOP_TILE) and warps
    for a block table of ``capacity`` positions (``launch_select``'s arguments; None: the module's settings)."""
    bits = SELECT_BITS if bits is None else int(bits)
    if bits not in (4, 8):
        raise UserError(f"indexer select: digit width {bits} bits unsupported (4 or 8)")
    resident = capacity <= (SELECT_RESIDENT_MAX if resident_max is None else resident_max)
    tile = max(_next_pow2(capacity), 16) if resident else SELECT_TILE
    if warps is None:
        warps = SELECT_WARPS_WIDE if resident and tile > 4096 else SELECT_WARPS
    narrow_min = SELECT_NARROW_MIN_TILE if narrow_min is None else int(narrow_min)
    narrow = resident and 0 < narrow_min <= tile
    fine = narrow and (SELECT_FINE_WIDTHS if fine is None else bool(fine))
    loops = narrow and tile >= SELECT_WIDE_LOOPS_MIN_TILE and (SELECT_WIDE_LOOPS if loops is None else bool(loops))
    if fine and loops:
        raise UserError("indexer select: SELECT_FINE_WIDTHS and SELECT_WIDE_LOOPS both choose the width of a row past "
                        "the half-width path; switch one of them off")
    # the looped rows' tile: SELECT_TILE, a quarter of the resident tile where that is narrower (the tests' tiles)
    return dict(TILE=tile, BITS=bits, RESIDENT=resident, NARROW=narrow,
                EARLY=SELECT_EARLY_EXIT if early is None else bool(early), FINE=fine,
                PACKED=SELECT_PACKED_SCAN if packed is None else bool(packed), LOOPS=loops,
                LOOP_TILE=min(SELECT_TILE, max(tile // 4, 16))), int(warps)


_NO_SELECT = dict(TILE=16, BITS=4, RESIDENT=True, NARROW=False, EARLY=False, FINE=False, PACKED=False, LOOPS=False,
                  LOOP_TILE=16)
"""The select constexprs of a score launch without SELECT (unused; fixed, so that they make no new variant)."""
MAX_SELECT_ROWS = 8192
"""Rows (tokens) one call may select inside the score kernel: its per-row arrival counters (int32, 32 KiB a device)."""


def _device_counts(what: str, switch: str, device: torch.device, rows: int, max_rows: int,
                   per_row: int) -> torch.Tensor:
    """A ``[max_rows * per_row]`` int32 buffer of per-row counts on ``device``, zero between calls (the kernel that
    reads a row's counts resets them), shared by the device's calls - one stream's calls run one after another. Zeroed
    once when made: outside a CUDA-graph capture (the implementation's ``prepare``, or an eager call first)."""
    limit = "MAX_SELECT_ROWS" if per_row == 1 else "MAX_FIRST_BYTE_ROWS"
    if rows > max_rows:
        raise UserError(f"{NAME}: {rows} rows > {limit}={max_rows} for {what}; split the call or switch {switch} off")
    return cached_zeroed_int32(f"{NAME} {what}", (max_rows * per_row,), device, refuse_in_capture=(
        f"{what} ({switch}) must be made before a CUDA-graph capture; call the implementation's prepare() (or one "
        "eager call) first"))


def arrival_counts(device: torch.device, rows: int = 1) -> torch.Tensor:
    """The int32 per-row arrival counters of the score kernel's select (``SCORE_SELECTS``; each call's last program of
    a row resets its counter): ``_device_counts``."""
    return _device_counts("the arrival counters of the select inside the score kernel", "SCORE_SELECTS", device,
                          rows, MAX_SELECT_ROWS, 1)


def first_byte_counts(device: torch.device, rows: int = 1) -> torch.Tensor:
    """The ``[MAX_FIRST_BYTE_ROWS * 256]`` int32 counts of the rows' leading key bytes (``SELECT_FIRST_BYTE``; the
    select kernel resets each row it reads): ``_device_counts``."""
    return _device_counts("the leading-byte counts", "SELECT_FIRST_BYTE", device, rows, MAX_FIRST_BYTE_ROWS, 256)


def _prepare(ctx: OpContext) -> None:
    """Before capture: the per-row count buffers of the switches that are on."""
    del ctx
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        if SCORE_SELECTS:
            arrival_counts(device)
        if SELECT_FIRST_BYTE:
            first_byte_counts(device)


def select_trigger(device: torch.device) -> bool:
    """Whether the radix select lets the launch after it start at once (``SELECT_TRIGGER_START``, compiled, an sm_90+
    GPU, Triton with grid dependency control)."""
    return SELECT_TRIGGER_START and pdl_available(device)


def choose_num_splits(batch: int, capacity: int, sms: int) -> int:
    """Scoring programs per sequence from static shapes: about ``WAVES`` programs per SM over the batch,
    no more than the capacity has ``MIN_CHUNK`` chunks (the device then shortens chunks to live lengths)."""
    want = -(-WAVES * sms // max(batch, 1))
    return max(1, min(want, -(-capacity // MIN_CHUNK), MAX_SPLITS))


def _shape_problems(heads: int, head_dim: int, rope: int) -> list[str]:
    problems = []
    if _next_pow2(max(heads, 16)) * _next_pow2(max(head_dim, 16)) > MAX_TILE:
        problems.append(f"heads {heads} x head_dim {head_dim} exceeds one program's query tile ({MAX_TILE} "
                        "elements, padded to powers of two)")
    if rope % 2 or rope > head_dim:
        problems.append(f"rope width {rope} (even, at most head_dim {head_dim})")
    return problems


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def indexer_topk_triton(q: torch.Tensor, k: torch.Tensor | None, weights: torch.Tensor, k_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                        topk: int, positions: torch.Tensor | None = None,
                        rope_inv_freq: torch.Tensor | None = None, rope_interleaved: bool = False,
                        k_norm_weight: torch.Tensor | None = None, k_norm_bias: torch.Tensor | None = None,
                        k_norm_eps: float = 1e-6, scale: float | None = None, out: torch.Tensor | None = None,
                        k_norm_kind: Literal["layer", "rms"] = "layer", cross_row_reads: bool = False,
                        selection: Selection | None = None, num_splits: int | None = None) -> torch.Tensor:
    """The indexer's top-k, one new token per sequence (contract: ``indexer_topk_reference``).

    Parameters
    ----------
    q : [B, h, D] raw indexer queries (rows may be strided; unit last stride, else copied).
    k : [B, D] raw key of the new token (a column slice is fine); None: no key kernel (the keys are in the cache
        already, or this layer scores against another layer's). weights : [B, h] per-head weights.
    k_cache : [num_blocks, block_size, D] paged key cache (bf16/fp16/fp32, contiguous), written in place.
    slot_mapping : [B] int (< 0: no write); block_table : [B, max_blocks] int; seq_lens : [B] int (the new
        token included; 0: padding row -> all -1).
    topk : K. positions : [B] int (with ``rope_inv_freq``). rope_inv_freq : [R/2] (None: no RoPE).
    k_norm_weight, k_norm_bias, k_norm_eps, k_norm_kind : the key norm (``"layer"`` / ``"rms"``; none
        without a weight). scale : default D^-0.5 h^-0.5. out : optional [B, K] int32 (unit last stride).
    cross_row_reads : rows of the call read each other's new keys (a verification step: 1 + k rows of a request):
        the keys then go in by their own launch (``SCORE_WRITES_KEY`` needs each row to read only its own).
    selection : ``"auto"`` / ``"radix"`` / ``"split"`` / ``"torch"``; default ``SELECTION``. num_splits :
        scoring programs per sequence; default from static shapes (``choose_num_splits``). Tests force both.

    Returns
    -------
    [B, K] int32 positions (a set, any order; -1 past ``seq_lens[b]``). No host sync: CUDA-graph capturable.
    """
    B, heads, D = q.shape
    if (k is not None and tuple(k.shape) != (B, D)) or tuple(weights.shape) != (B, heads) or k_cache.shape[-1] != D:
        raise UserError(f"{NAME}: q {tuple(q.shape)}, k {None if k is None else tuple(k.shape)}, weights "
                        f"{tuple(weights.shape)}, cache width {k_cache.shape[-1]} do not fit one another")
    if topk < 1:
        raise UserError(f"{NAME}: topk={topk}; use a positive width")
    if k_norm_kind not in ("layer", "rms"):
        raise UserError(f"{NAME}: k_norm_kind={k_norm_kind!r}; use 'layer' (LayerNorm) or 'rms' (RMSNorm)")
    if k_norm_kind == "rms" and k_norm_bias is not None:
        raise UserError(f"{NAME}: k_norm_kind='rms' is an RMSNorm (weight only); drop k_norm_bias or use 'layer'")
    half = 0 if rope_inv_freq is None else int(rope_inv_freq.shape[0])
    problems = _shape_problems(heads, D, 2 * half)
    if problems:
        raise UserError(f"{NAME}: {'; '.join(problems)}: serve it with attention.indexer.reference (force it in "
                        "the plan)")
    if rope_inv_freq is not None and positions is None:
        raise UserError(f"{NAME}: RoPE (rope_inv_freq) needs the tokens' positions")
    if k_cache.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise UserError(f"{NAME}: key cache dtype {k_cache.dtype} (bf16/fp16/fp32 only): use the reference")
    if not k_cache.is_contiguous():
        raise UserError(f"{NAME}: the key cache must be contiguous (got strides {k_cache.stride()})")
    selection = SELECTION if selection is None else selection
    if selection not in ("auto", "radix", "split", "torch"):
        raise UserError(f"{NAME}: selection={selection!r}; use 'auto', 'radix', 'split' or 'torch'")
    if selection == "auto":  # static: the block table's width, never seq_lens (no host sync)
        selection = auto_selection(block_table.shape[1] * k_cache.shape[1], B)
    if out is None:
        out = torch.empty(B, topk, device=q.device, dtype=torch.int32)
    elif tuple(out.shape) != (B, topk) or out.dtype != torch.int32 or out.stride(-1) != 1:
        raise UserError(f"{NAME}: out must be [B, K] = [{B}, {topk}] int32 with a unit last stride "
                        f"(got {tuple(out.shape)} {out.dtype}, strides {out.stride()})")
    if B == 0:
        return out
    kern = _kernels(_interpreting())
    block = k_cache.shape[1]
    flat = k_cache.view(-1, D)
    bt = _unit_last(block_table)
    q, weights = _unit_last(q), _unit_last(weights)
    cap = bt.shape[1] * block
    d_pad = _next_pow2(max(D, 16))
    rope = rope_inv_freq is not None
    inv = rope_inv_freq.float().contiguous() if rope else flat           # flat: never read (constexpr branch)
    pos = positions if rope else seq_lens
    norm = _NORM_NONE if k_norm_weight is None else (_NORM_RMS if k_norm_kind == "rms" else _NORM_LAYER)
    kw = k_norm_weight.contiguous() if k_norm_weight is not None else flat
    kb = k_norm_bias.contiguous() if (norm == _NORM_LAYER and k_norm_bias is not None) else flat

    # 1. the new keys into the cache (before any program of step 2 reads them: a launch boundary), or inside step 2
    key_in_score = k is not None and SCORE_WRITES_KEY and not cross_row_reads
    k = None if k is None else _unit_last(k)
    if k is not None and not key_in_score:
        kern["key"][(B,)](k, kw, kb, inv, pos, slot_mapping, flat, float(k_norm_eps), k.stride(0), flat.stride(0),
                          D=D, D_PAD=d_pad, HALF=max(half, 1), NORM=norm, HAS_BIAS=kb is not flat, ROPE=rope,
                          INTERLEAVED=bool(rope_interleaved), num_warps=1 if d_pad <= 256 else 4)
    key_args = (k, kw, kb, slot_mapping, float(k_norm_eps), k.stride(0)) if key_in_score else \
        (flat, flat, flat, seq_lens, 0.0, 0)   # (never read)

    # 2. logits [B, capacity] fp32 (-inf past seq_len)
    if num_splits is None:
        num_splits = choose_num_splits(B, cap, sm_count(q.device) if q.device.type == "cuda" else 1)
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    logits = torch.empty(B, max(cap, 1), device=q.device, dtype=torch.float32)
    s = (D ** -0.5) * (heads ** -0.5) if scale is None else float(scale)
    prec = "ieee" if k_cache.dtype == torch.float32 else "tf32"   # IEEE fp32 for fp32 caches (the CPU tests)
    fused = selection == "radix" and SCORE_SELECTS
    counted = selection == "radix" and not fused and SELECT_FIRST_BYTE
    if counted and not SELECT_EARLY_EXIT:
        raise UserError(f"{NAME}: SELECT_FIRST_BYTE starts the select's early-exit passes at bit 24 and needs "
                        "SELECT_EARLY_EXIT; switch one of them")
    first_bytes = first_byte_counts(q.device, B) if counted else None
    if fused:   # 3 in 2: the last scoring program of a row selects it
        consts, warps = select_config(cap)
        arrivals = arrival_counts(q.device, B)
    else:
        consts, warps, arrivals = _NO_SELECT, SCORE_WARPS, seq_lens   # (arrivals: never read)
    kern["score"][(B, num_splits)](
        q, weights, inv, pos, flat, bt, seq_lens, logits, heads, num_splits, block, cap,
        -(-cap // num_splits) if selection == "torch" else 0, s,   # radix / split never read past seq_len
        q.stride(0), q.stride(1), weights.stride(0), flat.stride(0), bt.stride(0), logits.stride(0),
        arrivals, out, topk, out.stride(0), *key_args, logits if first_bytes is None else first_bytes,
        D=D, D_PAD=d_pad, H_PAD=_next_pow2(max(heads, 16)), HALF=max(half, 1), ROPE=rope,
        INTERLEAVED=bool(rope_interleaved), BT=BLOCK_T, MIN_CHUNK=MIN_CHUNK, FILL=FILL_BLOCK, PREC=prec,
        AHEAD=SCORE_KEYS_AHEAD, SELECT=fused, **consts, KEY=key_in_score, NORM=norm if key_in_score else 0,
        HAS_BIAS=key_in_score and kb is not flat, BYTES=counted,
        num_warps=warps)
    if fused:
        return out

    # 3. selection
    if selection == "radix":
        launch_select(kern["select"], logits, seq_lens, out, topk, cap, trigger=select_trigger(q.device),
                      first_bytes=first_bytes)
        return out
    if selection == "split":
        return topk_select(logits[:, :cap], seq_lens, topk, out)
    kk = min(topk, cap)
    vals, idx = torch.topk(logits[:, :cap], kk, dim=-1) if cap > 0 else (logits[:, :0], logits[:, :0].long())
    idx = torch.where(vals > float("-inf"), idx, -1).to(torch.int32)
    out[:, :kk].copy_(idx)
    if kk < topk:  # a block table narrower than K: the rest is -1
        out[:, kk:].fill_(-1)
    return out


def _supports(ctx: OpContext) -> Support:
    refusal = triton_gpu_refusal(ctx, "the indexer", min_sm=80)
    if refusal:
        return refusal
    norm = ctx.attr("k_norm")
    if norm not in _SITE_NORMS:
        return f"key norm {norm!r} (LayerNorm or RMSNorm only)"
    try:
        heads, head_dim = ctx.dim("heads"), ctx.dim("head_dim")
    except KeyError:  # a site without the dims: the call checks them and names the fix
        return True
    try:
        rope = ctx.dim("rope")
    except KeyError:
        rope = 0
    problems = _shape_problems(heads, head_dim, rope)
    return "; ".join(problems) if problems else True


IMPLEMENTATIONS = [
    Implementation("attention.indexer", NAME, indexer_topk_triton, _supports, priority=10, prepare=_prepare,
                   description="Triton: key norm + RoPE + cache write, split relu-weighted scoring over the paged "
                               "key cache (fp32 logits workspace), a split top-k select over many programs per row "
                               "(per-row radix select, torch.topk as A/B switches); no host sync; GPUs (sm_80+)"),
]

__all__ = ["IMPLEMENTATIONS", "NAME", "SELECTION", "RADIX_MAX_CAPACITY", "SPLIT_MAX_CAPACITY", "SPLIT_ROWS",
           "arrival_counts", "auto_selection", "choose_num_splits", "indexer_topk_triton", "select_config"]
