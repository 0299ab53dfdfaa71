"""MLA decode (absorbed form) through a Triton split-KV kernel: ``attention.mla.triton_splitkv``.

The contract is ``ops.attention.mla.mla_decode_reference``; this is the GPU kernel for a decode step
captured into a CUDA graph (``attention.mla.torch_paged`` is the sync-free torch composition it
replaces: that one gathers and multiplies the whole block table per step, in fp32).

Steps of one call (one new token per sequence); ``fused=False`` swaps steps 1 and 3 for the torch
composition named in brackets (about 25 launches instead of 3: at batch 1 the launches, not the
bytes, are the time):

1. **prologue kernel**, grid ``(cdiv(B, PROLOGUE_B), H + 1, L / PROLOGUE_L)``: the programs of head
   ``h < H`` compute a tile of the absorbed query ``q_lat[h] = q_nope[h] @ W_UK[h]`` (``PROLOGUE_B``
   sequences x ``PROLOGUE_L`` latent columns; ``tl.dot``, fp32 accumulation, **rounding to the
   activation dtype**) into ``q_lat`` [H, B, L]; the programs of the extra head index ``H`` write the
   new latents ``[kv_c | k_pe]`` of their sequences into the paged cache at ``slot_mapping``
   (negative: nothing; each column tile writes its kv_c columns, the first one k_pe too); with
   ``kv_norm_weight`` (the model's kv_a RMSNorm fused) each of them first takes the sum of squares of
   its rows' whole raw latent in fp32 and writes ``kv_c * rstd * w`` rounded to the activation dtype,
   then to the cache dtype: the roundings of a norm kernel followed by the write
   [``kernels.mla_common.write_new_latents`` (after ``rmsnorm_reference``), then one torch ``bmm``
   over the heads in the activation dtype: the same roundings; no host sync either way]; with
   ``positions`` (the model's RoPE fused) the latent writers rotate ``k_pe`` in fp32 and round it to
   its dtype before the write, and the column-tile-0 program of each (row tile, head) writes the
   rotated query rope part into a ``q_pe`` [B, H, R] buffer (one rounding to the activation dtype)
   that the split kernel reads instead of q's own rope columns: ``apply_rope``'s math and roundings,
   no launch of its own [``kernels.mla_common.rotate_pairs`` on q's rope part and k_pe first];
2. **split kernel**, grid ``(B, head groups, num_splits)``: a program takes up to ``BLOCK_H`` (16,
   the smallest ``tl.dot`` tile) heads of one sequence and one contiguous chunk of its positions.
   The chunk length comes from ``seq_lens[b]`` read *on the device* (``cdiv(seq_len, num_splits)``,
   at least ``MIN_CHUNK``, a multiple of ``BLOCK_N``), so a short sequence in a long block table
   costs only its live tiles and the splits past its end do nothing. Per tile of ``BLOCK_N``
   positions it gathers the cache rows through ``block_table`` (ids past the end are never read),
   ``s = scale * (q_lat c^T + q_pe k_pe^T)`` (tensor cores, fp32 accumulation), online softmax in
   fp32 (base 2), and ``acc += p c`` with **p rounded to the cache dtype** for the tensor-core dot,
   fp32 accumulation. It writes ``(acc, m, l)`` of its split to an fp32 workspace. With ``SPARSE``
   (``attention.sparse_mla.triton_splitkv``, ``kernels/sparse_mla_triton.py``) the chunks cut the K slots
   of the row's ``topk_indices`` instead of its positions: a tile gathers the selected tokens' rows,
   invalid slots (-1, >= seq_len) masked; the merge then counts the splits of K, not of ``seq_lens``;
3. **merge kernel**: log-sum-exp weights over the splits that held positions (padding rows,
   ``seq_lens == 0``, give exact zeros), ``o_lat`` kept in fp32, ``o = W_UV[h] o_lat`` (fp32 FMAs over
   the bf16 weight), ``* sigmoid(gate)`` in fp32, **the one rounding** of ``o`` into ``out`` [merge to
   ``o_lat`` in the activation dtype (**rounding**; with one split the split kernel writes it), ``o =
   o_lat W_UV^T`` by a torch ``bmm`` (**rounding**), the reference's ``finish_output``]. Two grids: small
   batches (``merge_l_tiles``) ``(B, H, L / MERGE_L_TILE)``, a program per latent tile that reads only
   its tile of the partials and writes a partial ``o`` [v] in fp32, the last of a head's programs to
   arrive (arrival counters zeroed by the split kernel) adding the tiles' outputs in tile order;
   otherwise ``(B, H, v blocks)``, each program merging the whole latent (``merge_v_block``).
4. **PDL** (``PDL``, ``pdl_enabled``): where the split grid has at most one program per SM, the three
   kernels are launched with programmatic dependent launch.

So against the fp32 reference the tolerance is a bf16 one (about 2e-2 relative to the output
scale); with fp32 tensors every step is fp32 (``tl.dot`` in IEEE fp32), which is how the CPU tests
check the kernels under the Triton interpreter.

``num_splits`` is chosen on the host from static shapes only (batch, block-table capacity, SM
count): nothing reads ``seq_lens`` on the host, nothing syncs, so the call captures into a CUDA
graph and replays for any ``seq_lens``/``slot_mapping``/cache contents. Workspaces are
``torch.empty`` per call (the graph's memory pool under capture).

Triton is imported lazily (the kernels are built on the first call, per ``TRITON_INTERPRET``
setting), so this module imports on machines without Triton and ``supports()`` names what is missing.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, NamedTuple

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.hardware import sm_count
from latency_specialized.kernels.mla_common import (check_kv_norm, check_rope, finish_output, latent_widths,
                                                    normed_latent, rotate_pairs, write_new_latents)
from latency_specialized.kernels.triton_common import pdl_available, pdl_launch, triton_gpu_refusal

NAME = "attention.mla.triton_splitkv"

BLOCK_H = 16
"""Heads per program: the smallest M of a tensor-core ``tl.dot``; H = 12 (Kimi K3 TP8) pads to 16."""
BLOCK_N = 32
"""Positions per tile (bf16/fp16 cache; 16 for fp32 caches, whose tiles are twice the bytes)."""
MIN_CHUNK = 128
"""Fewest positions a split takes (device side): below this the fp32 partials a split writes and the
merge reads (H x L x 4 bytes) rival the cache bytes the split reads, and at small batch the merge's
serial walk over them is the call's time. H200, Kimi TP8 heads, context 4096 (mla_decode_sweep.md):
128 vs 64 gives 24.8 / 26.2 / 30.2 / 39.4 us vs 27.1 / 29.1 / 34.8 / 40.0 at batch 1 / 2 / 4 / 8 (32
instead of 64 splits); 256 is slower (31.2 us at batch 1: the split kernel then has too few programs).
From context ~16k (MAX_SPLITS) and from batch 16 (WAVES) the split count, so the time, is the same."""
MIN_CHUNK_SMALL_BATCH = 32
"""``MIN_CHUNK`` of the dense kernel for batches up to ``SMALL_BATCH`` (``min_chunk``): with one or two
sequences the split kernel has so few programs that shorter chunks (more splits) pay more than the larger merge
costs, now that the latent-tiled merge reads each partial once (with the older whole-latent merge 32 lost to 64).
Measured 32 / 64 / 128 at batch 1-4: ``benchmarks/results/h200/session29_gpu_tests.md``, ``mla_decode_sweep.md``;
batch 4 keeps ``MIN_CHUNK``."""
SPARSE_MIN_CHUNK_SMALL_BATCH = 32
"""The same for the sparse kernel (``attention.sparse_mla``, whose chunks cut the top-k slots): a separate
constant because the two kernels were measured apart (GLM-5.3 TP8, top-2048, batch 1 / 2: 32 vs 64 slots,
``session29_gpu_tests.md``)."""
SMALL_BATCH = 2
MAX_SPLITS = 256
"""Most splits of one sequence (the merge holds every split's m and l in one vector)."""
WAVES = 2
"""Target programs per SM (batch x head groups x splits ~ WAVES x SMs) when choosing num_splits."""
MERGE_L = 128
"""Latent columns per merge step (per program without the fused epilogue: more programs)."""
MERGE_S_TILE = 128
"""Most splits per merge step; a step takes the largest power of two <= num_splits up to this (a
tile wider than the live splits costs masked lanes: H200, batch 8, 33 splits: 16-wide 43 us per call,
64-wide 53; batch 1, 256 splits: 128-wide 47 us, 64-wide 75)."""
PROLOGUE_B = 16
"""Sequences per prologue program: the smallest M of a tensor-core ``tl.dot`` (batch 1 pads to 16, masked)."""
PROLOGUE_L = 64
"""Latent columns per prologue program: at batch 1 the prologue is a read of W_UK (Kimi K3 TP8: 12 heads x
128 x 512 bf16, 1.5 MB) by as many SMs as possible; 64 columns give 12 x 8 = 96 q_lat programs of 16 KB
(128: 48 programs of 32 KB), and at batch 64 (4 row tiles) 384, each W tile re-read from L2."""
PROLOGUE_K = 128
"""Most of nope per ``tl.dot`` step (a masked loop: any nope works): Kimi's 128 in one step, so a program
issues all its loads (a 128 x 64 W_UK tile, the q rows) before its one dot."""
MERGE_WARPS = 4
MERGE_L_FUSED = 512
"""Latent columns per step of the fused merge (merge + W_UV): a program walks L / MERGE_L_FUSED tiles,
each over all split tiles; wider tiles mean fewer serial L2 round trips per program. H200, Kimi TP8
heads (mla_decode_sweep.md), 512 (the whole latent) with MERGE_TILE 16384 vs 128: context 4096 batch
1 / 2 / 4 / 8 / 64 19.6 / 20.5 / 24.5 / 34.9 / 138.8 us vs 25.2 / 26.1 / 30.8 / 40.5 / 144.9; 32768
batch 4 / 8 / 64 73.0 / 123.9 / 795.5 vs 84.9 / 131.7 / 804.1, batch 1 43.8 vs 39.5 (256 splits in 8
tiles of 32)."""
MERGE_TILE = 16384
"""Most fp32 partials (split tile x latent tile) one fused-merge step loads: caps the split tile when
the latent tile is wide (64 KiB per step: 128 registers per thread at 4 warps)."""
MERGE_V_BLOCK = 0
"""Values of ``v`` per fused-merge program; 0: ``merge_v_block``'s rule capped by ``MERGE_W_TILE`` (sweeps override
it)."""
MERGE_W_TILE = 128 * 512
"""Most ``V_PAD x ML`` fp32 W_UV values one fused-merge program holds: Kimi K3's measured shape (v 128, the whole
512-wide latent: 255 registers + 72-80 bytes of stack in the sm_90 cubin, ``cuobjdump`` offline). GLM-5.3's v 256
in one program needed 5,608 bytes of stack at batch 64 (32 registers: the tile lives in local memory) - likely
why its batch-64 32K call took 1,274 us against Kimi's 784 (session 30); capped, it runs two 128-wide v blocks of
Kimi's shape. Set from offline register counts (session 32, no GPU); the H200 A/B is ``mla_gap_probe.sh``."""
MERGE_L_TILE = 64
"""Latent columns per program of the L-tiled fused merge at small batch (``merge_l_tiles``; 0: the v-blocked
merge everywhere). Each program reads only its columns of every split's partial (at batch 1, 64 splits: 16 KB
instead of the 128 KB each v-blocked program re-reads) and its W_UV columns; the last of a head's programs
adds their partial outputs."""
NUM_WARPS = 4
NUM_STAGES = 2
PDL = False
"""Off (session 17): the prologue kernel's ``gdc_wait`` sat inside its k loop, and Triton's software pipeliner
can issue a loop's first loads ahead of its body - i.e. read q before the q projection has written it. Symptom,
measured: the prologue alone launched with PDL (an A/B variant, session 17 call 6, since removed) changed the
Kimi MLA layer's routing at batch 2-4 (distinct experts 28 vs 56: different values), and launch order alone must
not change values. The layer bench never used this path (its 32k-wide block table gives every batch a split grid
wider than the SMs); narrow tables did. The wait now sits above the loop (a CPU test keeps every ``gdc_wait`` out
of loops), and the GPU suite runs the PDL path with a PDL-triggering producer of q
(``test_pdl_reads_q_after_a_producer_that_triggers_early``). Session 30's layer A/B at batch 1 (130 split
programs, so PDL taken) measured the Kimi K3 MLA layer slower with it (``kernels/NOTES.md``): it stays off.

Programmatic dependent launch for the three kernels (sm_90+, compiled, Triton with
``tl.extra.cuda.gdc_wait``) where the split kernel's grid fits one partial wave (``pdl_enabled``): each
kernel is launched while its predecessor runs, issues the loads that do not depend on it (the
prologue's W_UK tile) and then waits (``gdc_wait``) before touching its predecessor's outputs; each lets
its successor launch right after its own wait (``gdc_launch_dependents``), so the next projection's
weight stream can start early.

Why only small grids. H200, Kimi K3 TP8 MLA layer, same-machine A/B, us per layer, PDL vs none, block
table sized for 4096 tokens (68 splits): batch 1 107.9 vs 113.6, batch 2 (136 split programs) 164.5 vs
161.2, batch 4 219.0 vs 211.0; batch 64 even. Batch 1 with the table sized for 32768 tokens (256 split
programs, the full layer bench): 114.2 / 140.0 us at context 4096 / 32768 against 111.6 / 134.5 without
PDL the session before. The early-launched programs wait on SM slots the wider grid needs (the call
alone at batch 2, context 32768: 62.2 vs 50.4 us)."""
MERGE_PDL = True
"""Where ``PDL`` is off (a split grid wider than the SMs) the latent-tiled merge still launches with PDL,
triggered by the split programs at their end rather than their start (``late_merge_pdl``): its programs
can only take SM room the split kernel no longer needs. A/B: ``--ab name:...mla_decode_triton.MERGE_PDL=False``."""
FUSED = True
"""Default of ``fused``: Triton prologue (latent write + absorbed query) and merge epilogue (see
``mla_decode_triton``)."""
_POW2_RANGES = {"kv_lora": (16, 1024), "rope": (16, 256)}
"""Sizes the kernels take: powers of two (``tl.arange``) of at least 16 (``tl.dot``'s K)."""

_LOG2E = 1.4426950408889634


def shape_problems(L: int, R: int) -> list[str]:
    """Why the kernels cannot take latent width ``L`` / rope width ``R`` (empty: they can); shared with the
    sparse entry point (``kernels/sparse_mla_triton.py``)."""
    out = []
    for name, n in (("kv_lora", L), ("rope", R)):
        lo, hi = _POW2_RANGES[name]
        if n < lo or n > hi or n & (n - 1):
            out.append(f"{name} {n} is not a power of two in [{lo}, {hi}]")
    return out


@functools.cache
def _kernels(interpret: bool):
    """Build the jitted kernels (``triton.jit`` decides interpreter vs compiler when it decorates, from
    ``TRITON_INTERPRET``; hence one build per setting, on first use). Returns a dict by name."""
    del interpret  # the cache key only
    # the kernels are defined here, not at import (no triton import for machines without it), but
    # Triton resolves the names a kernel uses through its module globals: hence tl as a global
    global tl, tlc, _split_chunk, _used_splits, _split_weights, _merged_columns, _merged_one_tile, _rope_rows
    import triton
    import triton.language as tl
    import triton.language.extra.cuda as tlc

    @triton.jit
    def _rope_rows(rows, offs_r, mask, pos, inv_freq, RH: tl.constexpr, INTERLEAVED: tl.constexpr):
        # -> [rows, 2 RH] fp32: the rope part at row pointers ``rows`` [BB, 1] rotated by ``pos`` [BB] (fp32)
        # * inv_freq, as ops.rope.apply_rope: pair (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), NeoX pairs
        # (i, i + RH) or interleaved (2i, 2i + 1). Each channel loads itself and its partner (a second gather
        # of the same 2 RH values, from L1) rather than split the tile into halves: one tile shape for both
        # styles, stored with one contiguous store.
        if INTERLEAVED:
            partner = offs_r ^ 1
            j = offs_r // 2
            first = (offs_r % 2) == 0
        else:
            partner = tl.where(offs_r < RH, offs_r + RH, offs_r - RH)
            j = offs_r % RH
            first = offs_r < RH
        x = tl.load(rows + offs_r[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        ang = pos[:, None] * tl.load(inv_freq + j)[None, :]     # the fp32 product apply_rope takes cos/sin of
        c = tl.cos(ang)
        sn = tl.sin(ang)
        return tl.where(first[None, :], x * c - y * sn, x * c + y * sn)

    # the split kernel's and the two merges' shared steps (module globals too: kernels resolve the functions they
    # call there)
    @triton.jit
    def _split_chunk(n_len, num_splits, BN: tl.constexpr, MIN_CHUNK: tl.constexpr):
        # positions per split: an even share of n_len, at least MIN_CHUNK, rounded up to whole BN tiles
        chunk = tl.maximum(tl.cdiv(n_len, num_splits), MIN_CHUNK)
        return tl.cdiv(chunk, BN) * BN

    @triton.jit
    def _used_splits(seq_lens, b, num_splits, topk, BN: tl.constexpr, MIN_CHUNK: tl.constexpr,
                     SPARSE: tl.constexpr):
        # the splits of row b that held positions (the split kernel's rule); SPARSE: the splits cut the topk
        # selection slots, the same static count for every row
        if SPARSE:
            seq_len = topk
        else:
            seq_len = tl.load(seq_lens + b).to(tl.int32)
        return tl.cdiv(seq_len, _split_chunk(seq_len, num_splits, BN, MIN_CHUNK))

    @triton.jit
    def _split_weights(ws_m, ws_l, seq_lens, b, h, num_splits, s_mb, s_ms, topk,
                       BN: tl.constexpr, MIN_CHUNK: tl.constexpr, S_PAD: tl.constexpr, SPARSE: tl.constexpr):
        # -> (used, m_max, inv): the splits that held positions (the split kernel's rule), their common
        # max and 1 / the softmax denominator (0 for a padding row: no split, every weight 0).
        # SPARSE: the splits cut the topk selection slots (the same static count for every row), not the
        # context; a split whose slots are all invalid left m = -inf, l = 0, acc = 0 (weight 0 here), and a
        # row with no valid slot at all gets denom 0, so zeros, as a padding row does
        used = _used_splits(seq_lens, b, num_splits, topk, BN, MIN_CHUNK, SPARSE)
        offs_s = tl.arange(0, S_PAD)
        s_ok = offs_s < used
        m_s = tl.load(ws_m + b * s_mb + offs_s * s_ms + h, mask=s_ok, other=float("-inf"))
        l_s = tl.load(ws_l + b * s_mb + offs_s * s_ms + h, mask=s_ok, other=0.0)
        m_max = tl.max(m_s, 0)
        m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
        denom = tl.sum(tl.where(s_ok, tl.exp2(m_s - m_max), 0.0) * l_s, 0)
        inv = tl.where(denom > 0, 1.0 / tl.where(denom > 0, denom, 1.0), 0.0)
        return used, m_max, inv

    @triton.jit
    def _merged_one_tile(ws_acc, ws_m, ws_l, seq_lens, b, h, num_splits, offs_l, s_wb, s_ws, s_wh, s_mb, s_ms, topk,
                         BN: tl.constexpr, MIN_CHUNK: tl.constexpr, S_PAD: tl.constexpr, SPARSE: tl.constexpr):
        # -> (acc, inv) of ``_split_weights`` + ``_merged_columns`` where one tile holds every split (S_TILE >=
        # S_PAD): every split's m, l and partial columns are loaded at once, masked by the static split count
        # only, before any reduction - the two-step form loads the partials after the max / denominator
        # reductions (barriers no load is moved across): one more round trip, in series. Stale workspace past
        # the used splits is replaced, not multiplied, so it cannot leak NaN. Same sums, same order.
        offs_s = tl.arange(0, S_PAD)
        s_in = offs_s < num_splits
        m_s = tl.load(ws_m + b * s_mb + offs_s * s_ms + h, mask=s_in, other=float("-inf"))
        l_s = tl.load(ws_l + b * s_mb + offs_s * s_ms + h, mask=s_in, other=0.0)
        part = tl.load(ws_acc + b * s_wb + offs_s[:, None] * s_ws + h * s_wh + offs_l[None, :],
                       mask=s_in[:, None], other=0.0)
        s_ok = offs_s < _used_splits(seq_lens, b, num_splits, topk, BN, MIN_CHUNK, SPARSE)
        m_s = tl.where(s_ok, m_s, float("-inf"))
        l_s = tl.where(s_ok, l_s, 0.0)
        part = tl.where(s_ok[:, None], part, 0.0)
        m_max = tl.max(m_s, 0)
        m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
        w_s = tl.where(s_ok, tl.exp2(m_s - m_max), 0.0)
        denom = tl.sum(w_s * l_s, 0)
        inv = tl.where(denom > 0, 1.0 / tl.where(denom > 0, denom, 1.0), 0.0)
        acc = tl.sum(w_s[:, None] * part, 0)
        return acc, inv

    @triton.jit
    def _merged_columns(ws_acc, ws_m, b, h, used, m_max, offs_l, s_wb, s_ws, s_wh, s_mb, s_ms,
                        S_TILE: tl.constexpr, NL: tl.constexpr):
        # sum over the used splits of exp2(m_s - m_max) * partial_s[offs_l] (fp32, unnormalised), splits in order
        acc = tl.zeros([NL], dtype=tl.float32)
        for s0 in range(0, used, S_TILE):
            offs_t = s0 + tl.arange(0, S_TILE)
            t_ok = offs_t < used
            m_t = tl.load(ws_m + b * s_mb + offs_t * s_ms + h, mask=t_ok, other=float("-inf"))
            w_t = tl.where(t_ok, tl.exp2(m_t - m_max), 0.0)
            part = tl.load(ws_acc + b * s_wb + offs_t[:, None] * s_ws + h * s_wh + offs_l[None, :],
                           mask=t_ok[:, None], other=0.0)
            acc += tl.sum(w_t[:, None] * part, 0)
        return acc

    @triton.jit
    def prologue_kernel(q, w_uk, kv_c, k_pe, slots, cache, q_lat, kv_w, eps, B, H, NOPE,
                        s_qb, s_qh, s_wh, s_wk, s_lh, s_lb, s_c, s_p, s_row,
                        q_rope, q_pe, positions, inv_freq, s_rb, s_rh, s_eb, s_eh,
                        L: tl.constexpr, R: tl.constexpr, BB: tl.constexpr, BL: tl.constexpr,
                        BK: tl.constexpr, PREC: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr,
                        ROPE: tl.constexpr, INTERLEAVED: tl.constexpr):
        # grid (cdiv(B, BB), H + 1, L / BL): rows bt*BB.., latent columns lt*BL..; heads h < H compute
        # q_lat[h, rows, cols] = q_nope[rows, h] @ W_UK[h][:, cols], the extra head h == H writes the new
        # latents of its rows (its kv_c columns; column tile 0 also k_pe). HAS_NORM: kv_c is the raw
        # latent and kv_w [L] its RMSNorm weight (eps). ROPE: column tile 0 of head h also writes its
        # rows' rotated q rope part (q_rope [B, H, R] in, q_pe [B, H, R] out, rounded to q's dtype once),
        # and the latent writers rotate k_pe before the write, by positions [B] * inv_freq [R / 2]: the
        # model's RoPE rides on this launch. Masks from comparisons only (the interpreter mishandles & of
        # a vector and a scalar mask).
        bt = tl.program_id(0)
        h = tl.program_id(1)
        lt = tl.program_id(2)
        offs_b = bt * BB + tl.arange(0, BB)
        b_ok = offs_b < B
        offs_l = lt * BL + tl.arange(0, BL)
        if h < H:
            acc = tl.zeros([BB, BL], dtype=tl.float32)
            if PDL:
                # above the loop, never inside one: Triton's pipeliner issues a loop's first loads ahead of its
                # body, so a wait inside it let q be read before its producer wrote it (see ``PDL``)
                tlc.gdc_wait()  # q (and kv_c below) come from the previous kernels
                tlc.gdc_launch_dependents()
            for k0 in range(0, NOPE, BK):
                offs_k = k0 + tl.arange(0, BK)
                k_ok = offs_k < NOPE
                wt = tl.load(w_uk + h * s_wh + offs_k[:, None] * s_wk + offs_l[None, :],
                             mask=k_ok[:, None], other=0.0)                                # [BK, BL]
                a = tl.load(q + offs_b[:, None] * s_qb + h * s_qh + offs_k[None, :],
                            mask=b_ok[:, None] & k_ok[None, :], other=0.0)                 # [BB, BK]
                acc = tl.dot(a, wt, acc, input_precision=PREC)
            tl.store(q_lat + h * s_lh + offs_b[:, None] * s_lb + offs_l[None, :],
                     acc.to(q_lat.dtype.element_ty), mask=b_ok[:, None])
            if ROPE:
                if lt == 0:  # one program per (row tile, head) rotates that head's rope part
                    offs_r = tl.arange(0, R)
                    r_ok = b_ok[:, None] & (offs_r < R)[None, :]
                    pos = tl.load(positions + offs_b, mask=b_ok, other=0).to(tl.float32)
                    qr = _rope_rows(q_rope + offs_b[:, None] * s_rb + h * s_rh, offs_r, r_ok, pos, inv_freq,
                                    R // 2, INTERLEAVED)
                    tl.store(q_pe + offs_b[:, None] * s_eb + h * s_eh + offs_r[None, :],
                             qr.to(q_pe.dtype.element_ty), mask=r_ok)
        else:  # a negative slot (or a row past B) writes nothing
            if PDL:
                tlc.gdc_wait()
                tlc.gdc_launch_dependents()
            slot = tl.load(slots + offs_b, mask=b_ok, other=-1).to(tl.int64)
            ok = slot >= 0
            row = cache + tl.maximum(slot, 0)[:, None] * s_row
            c = tl.load(kv_c + offs_b[:, None] * s_c + offs_l[None, :], mask=ok[:, None], other=0.0)
            if HAS_NORM:
                # every column tile recomputes its rows' sum of squares over the whole latent (L <= 1024
                # values per row, from L1/L2) rather than share it across programs: no extra launch or
                # sync; masked rows load zeros, so rstd stays finite (1/sqrt(eps)) and is never stored
                offs_all = tl.arange(0, L)
                x = tl.load(kv_c + offs_b[:, None] * s_c + offs_all[None, :], mask=ok[:, None],
                            other=0.0).to(tl.float32)                                   # [BB, L]
                rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / L + eps)                       # [BB]
                wn = tl.load(kv_w + offs_l).to(tl.float32)                              # [BL]
                # (x * rstd) * w, as rmsnorm_reference; rounded to the activation dtype as a norm
                # kernel's output would be, then (below) to the cache dtype as the write would
                c = (c.to(tl.float32) * rstd[:, None] * wn[None, :]).to(q.dtype.element_ty)
            tl.store(row + offs_l[None, :], c.to(cache.dtype.element_ty), mask=ok[:, None])
            offs_r = tl.arange(0, R)
            r_ok = ok[:, None] & (offs_r < tl.where(lt == 0, R, 0))[None, :]
            if ROPE:  # rotated in fp32, rounded to k_pe's dtype (as apply_rope), then to the cache's
                pos = tl.load(positions + offs_b, mask=ok, other=0).to(tl.float32)
                p = _rope_rows(k_pe + offs_b[:, None] * s_p, offs_r, r_ok, pos, inv_freq, R // 2,
                               INTERLEAVED).to(k_pe.dtype.element_ty)
            else:
                p = tl.load(k_pe + offs_b[:, None] * s_p + offs_r[None, :], mask=r_ok, other=0.0)
            tl.store(row + L + offs_r[None, :], p.to(cache.dtype.element_ty), mask=r_ok)

    @triton.jit
    def split_kernel(q_lat, q_pe, cache, block_table, seq_lens, ws_acc, ws_m, ws_l, o_lat, count,
                     topk_idx, topk, H, num_splits, block_size, sm_scale_log2,
                     s_qb, s_qh, s_pb, s_ph, s_row, s_bt, s_tk,
                     s_wb, s_ws, s_wh, s_mb, s_ms, s_ob, s_oh,
                     L: tl.constexpr, R: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                     MIN_CHUNK: tl.constexpr, DIRECT: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
                     ZERO_COUNT: tl.constexpr, TRIGGER_END: tl.constexpr, SPARSE: tl.constexpr):
        # SPARSE (attention.sparse_mla): the splits cut the ``topk`` slots of the row's selection
        # ``topk_idx[b, :]`` (token positions; < 0 or >= seq_len: skipped) instead of the positions
        # [0, seq_len); a tile then gathers the selected tokens' rows. Else topk_idx / topk / s_tk are unused.
        b = tl.program_id(0)
        hg = tl.program_id(1)
        sp = tl.program_id(2)
        if PDL:  # every program (dead splits too): q_lat and the new latent come from the prologue
            tlc.gdc_wait()
            tlc.gdc_launch_dependents()
        if ZERO_COUNT:  # split 0 zeroes its heads' arrival counters of the L-tiled merge (ran before it)
            offs_c = hg * BH + tl.arange(0, BH)
            tl.store(count + b * H + offs_c, tl.zeros([BH], dtype=tl.int32), mask=offs_c < tl.where(sp == 0, H, 0))
        seq_len = tl.load(seq_lens + b).to(tl.int32)
        # this split's chunk, from the device-side length: no host read of seq_lens anywhere (sparse: of
        # the static selection width, so every row has the same live splits)
        if SPARSE:
            n_len = topk
        else:
            n_len = seq_len
        chunk = _split_chunk(n_len, num_splits, BN, MIN_CHUNK)
        start = sp * chunk
        end = tl.minimum(start + chunk, n_len)

        offs_h = hg * BH + tl.arange(0, BH)
        h_ok = offs_h < H
        offs_l = tl.arange(0, L)
        offs_r = tl.arange(0, R)
        q = tl.load(q_lat + b * s_qb + offs_h[:, None] * s_qh + offs_l[None, :], mask=h_ok[:, None], other=0.0)
        qp = tl.load(q_pe + b * s_pb + offs_h[:, None] * s_ph + offs_r[None, :], mask=h_ok[:, None], other=0.0)
        q = q.to(cache.dtype.element_ty)
        qp = qp.to(cache.dtype.element_ty)

        m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BH], dtype=tl.float32)
        acc = tl.zeros([BH, L], dtype=tl.float32)
        for n0 in range(start, end, BN):
            if SPARSE:
                # the tile's selection slots -> token positions; invalid slots (-1, or a position the
                # sequence does not hold: short contexts, padding rows) are masked like positions past the end
                slot = n0 + tl.arange(0, BN)
                pos = tl.load(topk_idx + b * s_tk + slot, mask=slot < end, other=-1).to(tl.int32)
                ok = (slot < end) & (pos >= 0) & (pos < seq_len)
                pos = tl.maximum(pos, 0)
            else:
                pos = n0 + tl.arange(0, BN)
                ok = pos < end
            # block ids past the end may be anything (-1, garbage): never loaded (masked), and a
            # negative id inside the live range is clamped rather than read out of bounds
            blk = tl.load(block_table + b * s_bt + pos // block_size, mask=ok, other=0)
            blk = tl.maximum(blk, 0)
            row = blk.to(tl.int64) * block_size + (pos % block_size)
            base = cache + row[:, None] * s_row
            c = tl.load(base + offs_l[None, :], mask=ok[:, None], other=0.0)        # [BN, L]
            kpe = tl.load(base + L + offs_r[None, :], mask=ok[:, None], other=0.0)  # [BN, R]
            s = tl.dot(q, tl.trans(c), input_precision=PREC)
            s = tl.dot(qp, tl.trans(kpe), s, input_precision=PREC)
            s = tl.where(ok[None, :], s * sm_scale_log2, float("-inf"))            # [BH, BN], log2 units
            m_new = tl.maximum(m_i, tl.max(s, 1))  # dense: finite, every tile holds >= 1 live position
            if SPARSE:
                # a tile (and all before it) may hold no valid slot: m_new = -inf, and -inf - -inf would
                # be NaN; exponents against 0 instead give exact zeros (acc, l stay 0) while m stays -inf,
                # so a later valid tile still takes its own max (no underflow of very negative scores)
                m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
            else:
                m_ref = m_new
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(cache.dtype.element_ty), c, acc, input_precision=PREC)
            m_i = m_new

        if DIRECT:  # one split: normalise here; l == 0 only for padding rows, which give zeros
            o = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
            tl.store(o_lat + b * s_ob + offs_h[:, None] * s_oh + offs_l[None, :],
                     o.to(o_lat.dtype.element_ty), mask=h_ok[:, None])
        else:  # splits with no position write nothing: the merge reads only splits < its live count
            live = offs_h < tl.where(start < n_len, H, 0)
            tl.store(ws_acc + b * s_wb + sp * s_ws + offs_h[:, None] * s_wh + offs_l[None, :], acc,
                     mask=live[:, None])
            tl.store(ws_m + b * s_mb + sp * s_ms + offs_h, m_i, mask=live)
            tl.store(ws_l + b * s_mb + sp * s_ms + offs_h, l_i, mask=live)
        if TRIGGER_END:  # the merge (launched with PDL) may start once every program got here (late_merge_pdl)
            tlc.gdc_launch_dependents()

    @triton.jit
    def merge_kernel(ws_acc, ws_m, ws_l, seq_lens, o_lat, w_uv, gate, out, num_splits, V, topk,
                     s_wb, s_ws, s_wh, s_mb, s_ms, s_ob, s_oh, s_uh, s_uv, s_g, s_o,
                     BN: tl.constexpr, MIN_CHUNK: tl.constexpr, S_PAD: tl.constexpr, S_TILE: tl.constexpr,
                     L: tl.constexpr, ML: tl.constexpr, V_PAD: tl.constexpr, EPILOGUE: tl.constexpr,
                     HAS_GATE: tl.constexpr, PDL: tl.constexpr, SPARSE: tl.constexpr):
        # EPILOGUE: grid (B, H, cdiv(V, V_PAD)), merge + o[v block] = W_UV[h, v block] o_lat (o_lat kept
        # fp32) + gate + the one rounding into out; every v block re-merges the whole o_lat (partials
        # from L2) so that a small batch still spreads the W_UV reads over many SMs.
        # Else grid (B, H, L / ML): merge only, o_lat rounded to its dtype.
        b = tl.program_id(0)
        h = tl.program_id(1)
        if PDL:  # the partials come from the split kernel
            tlc.gdc_wait()
            tlc.gdc_launch_dependents()
        used, m_max, inv = _split_weights(ws_m, ws_l, seq_lens, b, h, num_splits, s_mb, s_ms, topk, BN, MIN_CHUNK,
                                          S_PAD, SPARSE)
        if EPILOGUE:
            l_first = 0
            n_cols = L
            v_first = tl.program_id(2) * V_PAD
        else:
            l_first = tl.program_id(2) * ML
            n_cols = ML
            v_first = 0
        offs_v = v_first + tl.arange(0, V_PAD)
        v_ok = offs_v < V
        o = tl.zeros([V_PAD], dtype=tl.float32)
        for l0 in range(l_first, l_first + n_cols, ML):
            offs_l = l0 + tl.arange(0, ML)
            acc = _merged_columns(ws_acc, ws_m, b, h, used, m_max, offs_l, s_wb, s_ws, s_wh, s_mb, s_ms, S_TILE, ML)
            if EPILOGUE:
                w = tl.load(w_uv + h * s_uh + offs_v[:, None] * s_uv + offs_l[None, :], mask=v_ok[:, None],
                            other=0.0)
                o += tl.sum(w.to(tl.float32) * (acc * inv)[None, :], 1)
            else:
                tl.store(o_lat + b * s_ob + h * s_oh + offs_l, (acc * inv).to(o_lat.dtype.element_ty))
        if EPILOGUE:
            if HAS_GATE:
                g = tl.load(gate + b * s_g + h * V + offs_v, mask=v_ok, other=0.0).to(tl.float32)
                o = o * tl.sigmoid(g)
            tl.store(out + b * s_o + h * V + offs_v, o.to(out.dtype.element_ty), mask=v_ok)

    @triton.jit
    def merge_tiles_kernel(ws_acc, ws_m, ws_l, seq_lens, w_uv, gate, out, ws_o, count, num_splits, H, V, topk,
                           s_wb, s_ws, s_wh, s_mb, s_ms, s_uh, s_uv, s_g, s_o,
                           BN: tl.constexpr, MIN_CHUNK: tl.constexpr, S_PAD: tl.constexpr, S_TILE: tl.constexpr,
                           LT: tl.constexpr, NLT: tl.constexpr, NLT_PAD: tl.constexpr, V_PAD: tl.constexpr,
                           HAS_GATE: tl.constexpr, PDL: tl.constexpr, SPARSE: tl.constexpr):
        # grid (B, H, NLT): program lt merges the splits' partials of latent columns [lt*LT, (lt+1)*LT) only
        # and multiplies them by its columns of W_UV: a partial o [V] (fp32) into ws_o [B, H, NLT, V_PAD].
        # The last of a head's NLT programs to arrive (count[b, h], zeroed by the split kernel) adds the NLT
        # partials in tile order (deterministic), applies the gate and writes out: each partial is read once
        # (the v-blocked merge re-reads all of them per v block).
        b = tl.program_id(0)
        h = tl.program_id(1)
        lt = tl.program_id(2)
        offs_v = tl.arange(0, V_PAD)
        v_ok = offs_v < V
        offs_l = lt * LT + tl.arange(0, LT)
        # W_UV columns first: weights do not depend on the previous kernel (PDL)
        w = tl.load(w_uv + h * s_uh + offs_v[:, None] * s_uv + offs_l[None, :], mask=v_ok[:, None], other=0.0)
        if PDL:  # the partials come from the split kernel
            tlc.gdc_wait()
            tlc.gdc_launch_dependents()
        if S_TILE >= S_PAD:
            acc, inv = _merged_one_tile(ws_acc, ws_m, ws_l, seq_lens, b, h, num_splits, offs_l, s_wb, s_ws, s_wh,
                                        s_mb, s_ms, topk, BN, MIN_CHUNK, S_PAD, SPARSE)
        else:
            used, m_max, inv = _split_weights(ws_m, ws_l, seq_lens, b, h, num_splits, s_mb, s_ms, topk, BN,
                                              MIN_CHUNK, S_PAD, SPARSE)
            acc = _merged_columns(ws_acc, ws_m, b, h, used, m_max, offs_l, s_wb, s_ws, s_wh, s_mb, s_ms, S_TILE, LT)
        po = tl.sum(w.to(tl.float32) * (acc * inv)[None, :], 1)                  # [V_PAD] partial o
        row = ((b * H + h) * NLT_PAD) * V_PAD
        tl.store(ws_o + row + lt * V_PAD + offs_v, po)
        # every thread's store before the arrival; the arrival (acq_rel, GPU scope) releases them and
        # the last arriver's acquire makes the other programs' partials visible to it (read from L2: .cg)
        tl.debug_barrier()
        n = tl.atomic_add(count + b * H + h, 1, sem="acq_rel", scope="gpu")
        if n == NLT - 1:
            offs_k = tl.arange(0, NLT_PAD)
            parts = tl.load(ws_o + row + offs_k[:, None] * V_PAD + offs_v[None, :],
                            mask=offs_k[:, None] < NLT, other=0.0, cache_modifier=".cg")   # [NLT_PAD, V_PAD]
            o = tl.sum(parts, 0)
            if HAS_GATE:
                g = tl.load(gate + b * s_g + h * V + offs_v, mask=v_ok, other=0.0).to(tl.float32)
                o = o * tl.sigmoid(g)
            tl.store(out + b * s_o + h * V + offs_v, o.to(out.dtype.element_ty), mask=v_ok)

    return dict(prologue=prologue_kernel, split=split_kernel, merge=merge_kernel, merge_tiles=merge_tiles_kernel)


def choose_num_splits(batch: int, heads: int, capacity: int, sms: int, sparse: bool = False) -> int:
    """Splits per sequence from static shapes only (graph-safe): batch x head groups x splits at most
    ``WAVES`` x SMs programs (rounded *down*: two programs fit an SM at once, so e.g. 4 splits at
    batch 64 run as one wave of 256 programs where 5 would leave a tail wave of 56: H200, Kimi TP8,
    64 x 32k tokens, split kernel: 2.1 TB/s with 5 splits, 2.5 with 3 or 9, 3.2 with 4), no more
    splits than ``capacity``
    (block-table positions; sparse: selection slots) holds chunks of ``min_chunk(batch, sparse)``, at most
    ``MAX_SPLITS``. The live chunk of each split is then sized on the device from ``seq_lens`` (short sequences
    use fewer splits)."""
    groups = -(-heads // BLOCK_H)
    want = WAVES * sms // max(batch * groups, 1)
    return max(1, min(want, -(-capacity // min_chunk(batch, sparse)), MAX_SPLITS))


def min_chunk(batch: int, sparse: bool = False) -> int:
    """Fewest positions (sparse: selection slots) per split at this batch (a static choice: graph-safe):
    ``MIN_CHUNK``, or up to ``SMALL_BATCH`` sequences ``MIN_CHUNK_SMALL_BATCH`` (sparse:
    ``SPARSE_MIN_CHUNK_SMALL_BATCH``)."""
    if batch > SMALL_BATCH:
        return MIN_CHUNK
    return SPARSE_MIN_CHUNK_SMALL_BATCH if sparse else MIN_CHUNK_SMALL_BATCH


def choose_sparse_splits(batch: int, heads: int, topk: int, sms: int, block_n: int = BLOCK_N) -> int:
    """Splits per sequence of the sparse split kernel (``attention.sparse_mla``): ``choose_num_splits`` with
    the selection width ``topk`` as the capacity (every row has exactly ``topk`` slots, valid or not), then
    trimmed to the splits that the device-side chunk rule (``cdiv(topk, splits)``, at least
    ``min_chunk(batch, sparse=True)``, a multiple of ``block_n``) leaves a slot: no program without work, and the
    merge's live count is every split. Static shapes only (graph-safe)."""
    want = choose_num_splits(batch, heads, topk, sms, sparse=True)
    chunk = -(-max(-(-topk // want), min_chunk(batch, sparse=True)) // block_n) * block_n
    return max(1, -(-topk // chunk))


def merge_v_block(batch: int, heads: int, v: int, sms: int) -> int:
    """Values of ``v`` per fused-merge program (a power of two >= 16, or all of them).

    Small batches only (batch x heads <= half the SMs): halved until batch x heads x blocks reaches
    ``WAVES`` programs per SM. At batch 1 (12 heads, v 128) one program per head would read its 128 KB
    of W_UV and fp32 partials alone on 12 SMs; 16-wide blocks give 96 programs. Each v block re-merges
    the head's partials, which costs more than it spreads from about batch 8 (H200, Kimi TP8 MLA layer:
    -1.3 to -4 % per layer at batch 1-4, +1.2 to 2 % at batch 8-16 when split there too)."""
    vb = _next_pow2(v)
    if 2 * batch * heads > sms:
        return vb
    while vb > 16 and batch * heads * -(-v // vb) < WAVES * sms:
        vb //= 2
    return vb


def merge_l_tiles(batch: int, heads: int, L: int, sms: int) -> int:
    """Latent tiles per head of the fused merge; more than one selects the L-tiled merge
    (``merge_tiles_kernel``): small batches only (2 x batch x heads <= SMs, where the v-blocked merge
    would re-merge every partial once per v block), tiles of ``MERGE_L_TILE`` columns (0: off)."""
    if MERGE_L_TILE <= 0 or 2 * batch * heads > sms or L % MERGE_L_TILE or L // MERGE_L_TILE < 2:
        return 1
    return L // MERGE_L_TILE


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _prologue(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor,
              flat: torch.Tensor, w_uk: torch.Tensor, q_lat: torch.Tensor | None = None,
              kv_norm_weight: torch.Tensor | None = None, kv_norm_eps: float = 1e-6, pdl: bool = False,
              positions: torch.Tensor | None = None, rope_inv_freq: torch.Tensor | None = None,
              rope_interleaved: bool = False, q_pe: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the prologue kernel (one launch): ``flat[slot_mapping[b]] = [kv_c[b] | k_pe[b]]`` in the
    cache dtype for slots >= 0, and return ``q_lat`` [H, B, L] (contiguous, q.dtype) ``= q_nope[:, h] @
    w_uk[h]`` with fp32 accumulation and one rounding (as the torch ``bmm`` of the unfused path).
    q [B, H, nope + R]; w_uk [H, nope, L] in q.dtype; ``q_lat``: optional destination (tests poison it).
    ``kv_norm_weight`` [L] (q.dtype): kv_c is the raw latent, RMS-normalised (``kv_norm_eps``) before the
    write (fp32 math, rounded to q.dtype, then to the cache dtype). kv_c's rows may be strided (unit
    last stride): its row stride is passed, nothing is copied. ``positions`` [B] int with
    ``rope_inv_freq`` [R / 2] fp32: k_pe is rotated before the write and q's rope part into ``q_pe``
    [B, H, R] (q.dtype, unit last stride; required then), both as ``ops.rope.apply_rope`` (fp32 math, one
    rounding to the input's dtype). Static grid from shapes only (graph-safe)."""
    B, H, _ = q.shape
    _, nope, L = w_uk.shape
    R = k_pe.shape[-1]
    if w_uk.dtype != q.dtype:
        raise ValueError(f"w_uk dtype {w_uk.dtype} != q dtype {q.dtype}")
    rope = check_rope(q, k_pe, nope, positions, rope_inv_freq)
    if rope and (q_pe is None or q_pe.shape != (B, H, R) or q_pe.stride(-1) != 1 or q_pe.dtype != q.dtype):
        raise ValueError(f"RoPE in the prologue needs q_pe [B, H, R] = [{B}, {H}, {R}] in {q.dtype} "
                         f"(unit last stride) for the rotated query")
    if q_lat is None:
        q_lat = torch.empty(H, B, L, device=q.device, dtype=q.dtype)   # the layout bmm gave: [H, B, L]
    if rope:
        assert positions is not None and rope_inv_freq is not None and q_pe is not None
        qr, pos, inv = _last_dim_unit(q[..., nope:]), _last_dim_unit(positions), rope_inv_freq.contiguous()
        rope_args = (qr, q_pe, pos, inv, qr.stride(0), qr.stride(1), q_pe.stride(0), q_pe.stride(1))
    else:   # never read (constexpr branch)
        rope_args = (q_lat, q_lat, slot_mapping, q_lat, 0, 0, 0, 0)
    qn = _last_dim_unit(q[..., :nope])
    w_uk = _last_dim_unit(w_uk)
    kv_c, k_pe = _last_dim_unit(kv_c), _last_dim_unit(k_pe)
    has_norm = kv_norm_weight is not None
    if has_norm:
        check_kv_norm(q, kv_c, kv_norm_weight)
        kv_w = kv_norm_weight.contiguous()   # [L]: a no-op for a weight tensor
    else:
        kv_w = kv_c                          # never read (constexpr branch)
    bl = min(PROLOGUE_L, L)
    bk = min(max(_next_pow2(nope), 16), PROLOGUE_K)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"  # as the split kernel: IEEE fp32 for fp32 tensors
    _kernels(_interpreting())["prologue"][(-(-B // PROLOGUE_B), H + 1, L // bl)](
        qn, w_uk, kv_c, k_pe, slot_mapping, flat, q_lat, kv_w, float(kv_norm_eps), B, H, nope,
        qn.stride(0), qn.stride(1), w_uk.stride(0), w_uk.stride(1), q_lat.stride(0), q_lat.stride(1),
        kv_c.stride(0), k_pe.stride(0), flat.stride(0), *rope_args,
        L=L, R=R, BB=PROLOGUE_B, BL=bl, BK=bk, PREC=prec, HAS_NORM=has_norm, ROPE=rope,
        INTERLEAVED=bool(rope_interleaved), **_pdl_args(pdl))
    return q_lat


def _resolve_splits(B: int, H: int, block_table: torch.Tensor, block_size: int, num_splits: int | None,
                    device: torch.device, topk: int | None = None, block_n: int = BLOCK_N) -> int:
    if num_splits is None:
        if topk is None:
            num_splits = choose_num_splits(B, H, block_table.shape[1] * block_size, sm_count(device))
        else:  # sparse: the selection's width, not the table's, is what the splits cut
            num_splits = choose_sparse_splits(B, H, topk, sm_count(device), block_n)
    return max(1, min(int(num_splits), MAX_SPLITS))


def _block_n(flat: torch.Tensor) -> int:
    """Positions per split-kernel tile for this cache dtype (``BLOCK_N``; 16 for 4-byte elements)."""
    return BLOCK_N if flat.element_size() <= 2 else min(BLOCK_N, 16)


class _Split(NamedTuple):
    """What the split kernel left for the merge: fp32 partials, or o_lat itself (one split, unfused)."""
    ws_acc: torch.Tensor
    ws_m: torch.Tensor
    ws_l: torch.Tensor
    strides: tuple[int, ...]
    num_splits: int
    block_n: int


def _split_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, flat: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, block_size: int, scale: float, num_splits: int | None,
                     o_lat: torch.Tensor | None, pdl: bool = False, count: torch.Tensor | None = None,
                     trigger_end: bool = False, topk_indices: torch.Tensor | None = None) -> _Split:
    """Launch the split kernel. q_lat [H, B, L] (any strides, unit last), q_pe [B, H, R], flat
    [slots, L + R]; ``o_lat`` [H, B, L]: given with ``num_splits == 1``, the kernel writes it directly.
    ``count`` [B * H] int32: the L-tiled merge's arrival counters, zeroed by the split-0 programs.
    ``trigger_end``: every program lets the next kernel launch (PDL) after its last store (``late_merge_pdl``,
    which is never true together with ``pdl``). ``topk_indices`` [B, K] int (unit last stride): attend over
    those positions only (sparse MLA; the splits cut the K slots)."""
    H, B, L = q_lat.shape
    R = q_pe.shape[-1]
    block_n = _block_n(flat)
    sparse = topk_indices is not None
    topk = topk_indices.shape[1] if sparse else 0
    num_splits = _resolve_splits(B, H, block_table, block_size, num_splits, q_lat.device,
                                 topk if sparse else None, block_n)
    prec = "ieee" if flat.dtype == torch.float32 else "tf32"
    direct = num_splits == 1 and o_lat is not None
    if direct:
        ws_acc = ws_m = ws_l = o_lat  # unused (constexpr branch)
        sw = (0, 0, 0, 0, 0)
        so = (o_lat.stride(1), o_lat.stride(0))
    else:
        ws_acc = torch.empty(B, num_splits, H, L, device=q_lat.device, dtype=torch.float32)
        ws_m = torch.empty(B, num_splits, H, device=q_lat.device, dtype=torch.float32)
        ws_l = torch.empty_like(ws_m)
        sw = (ws_acc.stride(0), ws_acc.stride(1), ws_acc.stride(2), ws_m.stride(0), ws_m.stride(1))
        so = (0, 0)
    _kernels(_interpreting())["split"][(B, -(-H // BLOCK_H), num_splits)](
        q_lat, q_pe, flat, block_table, seq_lens, ws_acc, ws_m, ws_l, o_lat if direct else ws_acc,
        count if count is not None else ws_m, topk_indices if sparse else seq_lens, topk,
        H, num_splits, block_size, scale * _LOG2E,
        q_lat.stride(1), q_lat.stride(0), q_pe.stride(0), q_pe.stride(1), flat.stride(0), block_table.stride(0),
        topk_indices.stride(0) if sparse else 0, *sw, *so,
        L=L, R=R, BH=BLOCK_H, BN=block_n, MIN_CHUNK=min_chunk(B, sparse), DIRECT=direct, PREC=prec,
        ZERO_COUNT=count is not None, TRIGGER_END=trigger_end, SPARSE=sparse, num_stages=NUM_STAGES,
        **_pdl_args(pdl))
    return _Split(ws_acc, ws_m, ws_l, sw, 1 if direct else num_splits, block_n)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pdl_enabled(device: torch.device, split_programs: int) -> bool:
    """Whether the kernels launch with PDL: ``PDL``, a split grid of at most one program per SM
    (``split_programs`` = batch x head groups x splits), compiled (not the interpreter), an sm_90+ GPU and
    a Triton with grid dependency control (``tl.extra.cuda.gdc_wait``)."""
    return PDL and pdl_available(device) and split_programs <= sm_count(device)


def late_merge_pdl(device: torch.device, pdl: bool, tiled: bool) -> bool:
    """Whether the latent-tiled merge launches with PDL although the split kernel does not (``pdl`` False:
    its grid exceeds one program per SM): ``MERGE_PDL``, and the split programs trigger it at their end, so
    the merge's programs - a grid of at most the SMs - take only the SM room the split kernel's tail
    frees, load their W_UV columns and wait; the next kernel (o_proj) may then launch early in turn."""
    return not pdl and tiled and MERGE_PDL and pdl_available(device)


def _pdl_args(on: bool, num_warps: int | None = None) -> dict:
    """Launch keywords: warps (default ``NUM_WARPS``, read per call: sweeps override the module constant), the
    PDL constexpr and Triton's ``launch_pdl`` (only when on)."""
    return dict(num_warps=NUM_WARPS if num_warps is None else num_warps, PDL=on,
                **pdl_launch(on))


def mla_decode_triton(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      w_kv_b: torch.Tensor, *, qk_nope_head_dim: int, v_head_dim: int,
                      scale: float | None = None, gate: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, num_splits: int | None = None,
                      fused: bool | None = None, kv_norm_weight: torch.Tensor | None = None,
                      kv_norm_eps: float = 1e-6, positions: torch.Tensor | None = None,
                      rope_inv_freq: torch.Tensor | None = None, rope_interleaved: bool = False) -> torch.Tensor:
    """Absorbed MLA decode, one token per sequence (contract: ``ops.attention.mla.mla_decode_reference``).

    Parameters
    ----------
    q : [B, H, nope + R]; kv_c : [B, L] (rows may be strided, unit last stride); k_pe : [B, R];
    kv_cache : [num_blocks, block_size, L + R] paged latent cache (bf16/fp16/fp32, contiguous), written in place;
    slot_mapping : [B] int (< 0: write nothing); block_table : [B, max_blocks] int;
    seq_lens : [B] int (new token included; 0: padding row -> zeros);
    w_kv_b : [H * (nope + v), L]; scale : default (nope + R) ** -0.5;
    gate : optional [B, H * v] logits (output * sigmoid(gate)); out : optional [B, H * v];
    num_splits : splits per sequence; default from static shapes (``choose_num_splits``). Tests force it.
    fused : True (default, ``FUSED``): the latent write with the absorbed query (one prologue kernel)
        and the merge + W_UV + gate epilogue are Triton kernels (3 launches in all: prologue, split,
        merge); False: torch for those (``write_new_latents``, ``bmm``, ``bmm``, ``finish_output``: about 25
        launches, the composition the kernels are checked against).
    kv_norm_weight : optional [L] in q.dtype: kv_c is the raw latent, RMS-normalised first (``kv_norm_eps``;
        the contract's). Fused: inside the prologue's latent-writer programs (no extra launch);
        unfused: ``rmsnorm_reference`` before the torch write.
    positions : optional [B] int, with ``rope_inv_freq`` [R / 2] fp32 and ``rope_interleaved``: the contract's
        RoPE of q's rope part and k_pe. Fused: inside the prologue (its column-0 query programs write the
        rotated q_pe the split kernel reads, its latent writers rotate k_pe: no extra launch); unfused: a
        torch rotation (``mla_common.rotate_pairs``, apply_rope's operations) first.

    Returns
    -------
    [B, H * v] in q.dtype. Roundings (module docstring): q_lat and p (for the p.c dot) to the
    activation/cache dtype, fp32 accumulation and softmax everywhere, o rounded once (fused; the
    torch epilogue also rounds o_lat and o before the gate); a bf16 tolerance against the fp32
    reference. No host sync: CUDA-graph capturable.
    """
    return launch_mla_decode(q, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, w_kv_b,
                             qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, scale=scale, gate=gate,
                             out=out, num_splits=num_splits, fused=fused, kv_norm_weight=kv_norm_weight,
                             kv_norm_eps=kv_norm_eps, positions=positions, rope_inv_freq=rope_inv_freq,
                             rope_interleaved=rope_interleaved)


def launch_mla_decode(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      w_kv_b: torch.Tensor, *, qk_nope_head_dim: int, v_head_dim: int,
                      scale: float | None = None, gate: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, num_splits: int | None = None,
                      fused: bool | None = None, kv_norm_weight: torch.Tensor | None = None,
                      kv_norm_eps: float = 1e-6, topk_indices: torch.Tensor | None = None,
                      name: str = NAME, fallback: str = "attention.mla.torch_paged",
                      positions: torch.Tensor | None = None, rope_inv_freq: torch.Tensor | None = None,
                      rope_interleaved: bool = False, before_split: Callable[[], object] | None = None) -> torch.Tensor:
    """The three launches of :func:`mla_decode_triton` (same arguments and result), shared by the dense and
    the sparse entry points. ``topk_indices`` [B, K] int (unit last stride; ``None``: dense): the split kernel
    attends over those token positions only (< 0 or >= ``seq_lens[b]``: skipped; none left: zeros), its
    splits cutting the K slots (``choose_sparse_splits`` by default); prologue and merge are the same
    kernels. ``name`` / ``fallback``: the implementation named in errors and the one they point to.
    ``before_split``: called after the prologue's launch and before the split kernel's - e.g. the join of the side
    stream that writes ``topk_indices``, so the prologue (latent write, absorbed query) runs beside the indexer; the
    selection is then read only by the split kernel (it must have a unit last stride: no copy before the join)."""
    B, H, qk = q.shape
    nope, v = qk_nope_head_dim, v_head_dim
    L, R = latent_widths(q, kv_c, kv_cache, nope)
    problems = shape_problems(L, R)
    if problems:
        raise UserError(f"{name}: {'; '.join(problems)}: serve this MLA with {fallback} "
                        f"(force it in the plan) or pad the latent to a supported size")
    if kv_cache.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise UserError(f"{name}: kv cache dtype {kv_cache.dtype} (bf16/fp16/fp32 only): use {fallback}")
    if not kv_cache.is_contiguous():
        raise UserError(f"{name}: the kv cache must be contiguous (got strides {kv_cache.stride()})")
    if w_kv_b.shape != (H * (nope + v), L):
        raise ValueError(f"w_kv_b {tuple(w_kv_b.shape)} != [H * (nope + v), L] = [{H * (nope + v)}, {L}]")
    if kv_norm_weight is not None:  # before any kernel is built or launched
        check_kv_norm(q, kv_c, kv_norm_weight)
    rope = check_rope(q, k_pe, nope, positions, rope_inv_freq)
    if before_split is not None and (topk_indices is None or topk_indices.stride(-1) != 1):
        raise UserError(f"{name}: before_split defers the read of a selection written elsewhere; it needs "
                        "topk_indices with a unit last stride (a copy would read it before the join)")
    fused = FUSED if fused is None else fused
    dtype = q.dtype
    block = kv_cache.shape[1]
    flat = kv_cache.view(-1, L + R)
    kernels = _kernels(_interpreting())

    w = w_kv_b.view(H, nope + v, L)
    if w.dtype != dtype:
        w = w.to(dtype)
    bt = _last_dim_unit(block_table)
    if topk_indices is not None:
        topk_indices = _last_dim_unit(topk_indices)
    topk = 0 if topk_indices is None else topk_indices.shape[1]
    num_splits = _resolve_splits(B, H, bt, block, num_splits, q.device,
                                 topk if topk_indices is not None else None, _block_n(flat))
    # no PDL across before_split's stream wait: the split kernel must start after the other stream's writes
    pdl = before_split is None and pdl_enabled(q.device, B * -(-H // BLOCK_H) * num_splits)
    if fused:  # 1. one launch: the (normed) new latents into the cache and the absorbed query, no host sync
        # with RoPE the prologue also writes the rotated query rope part the split kernel reads
        q_pe = torch.empty(B, H, R, device=q.device, dtype=dtype) if rope else _last_dim_unit(q[..., nope:])
        q_lat = _prologue(q, kv_c, k_pe, slot_mapping, flat, w[:, :nope], kv_norm_weight=kv_norm_weight,
                          kv_norm_eps=kv_norm_eps, pdl=pdl, positions=positions, rope_inv_freq=rope_inv_freq,
                          rope_interleaved=rope_interleaved, q_pe=q_pe if rope else None)   # [H, B, L]
    else:      # torch rope, norm (rmsnorm_reference) and write, then one bmm over the heads in the activation dtype:
        if rope:
            assert positions is not None and rope_inv_freq is not None
            q_pe = rotate_pairs(q[..., nope:], positions, rope_inv_freq, rope_interleaved)      # [B, H, R]
            k_pe = rotate_pairs(k_pe.unsqueeze(1), positions, rope_inv_freq, rope_interleaved).squeeze(1)
        else:
            q_pe = _last_dim_unit(q[..., nope:])                                 # [B, H, R]
        kv_c = normed_latent(q, kv_c, kv_norm_weight, kv_norm_eps)            # [H, B, nope] x [H, nope, L]
        write_new_latents(flat, torch.cat([kv_c, k_pe], dim=-1).to(kv_cache.dtype), slot_mapping)
        q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w[:, :nope])         # [H, B, L]
    scale = qk ** -0.5 if scale is None else scale
    if before_split is not None:
        before_split()

    # 2. split kernel (it also zeroes the L-tiled merge's arrival counters)
    o_lat = None if fused else torch.empty(H, B, L, device=q.device, dtype=dtype)
    n_lt = merge_l_tiles(B, H, L, sm_count(q.device)) if fused else 1
    count = torch.empty(B * H, device=q.device, dtype=torch.int32) if n_lt > 1 else None
    late = late_merge_pdl(q.device, pdl, n_lt > 1)
    sp = _split_attention(q_lat, q_pe, flat, bt, seq_lens, block, scale, num_splits, o_lat, pdl=pdl, count=count,
                          trigger_end=late, topk_indices=topk_indices)
    s_pad = _next_pow2(sp.num_splits)
    # wide split tiles: at batch 1 (256 splits, 12 programs) the merge is a serial loop per program,
    # latency-bound with narrow tiles (H200: 85 us of a 109 us call at 32k tokens with 8-split tiles)
    s_tile = min(MERGE_S_TILE, 1 << (sp.num_splits.bit_length() - 1))
    merge_args = dict(BN=sp.block_n, MIN_CHUNK=min_chunk(B, topk_indices is not None), S_PAD=s_pad, S_TILE=s_tile,
                      SPARSE=topk_indices is not None, **_pdl_args(pdl, MERGE_WARPS))
    ml = min(MERGE_L, L)

    # 3. fused: merge + W_UV + gate + rounding into out
    w_uv = w[:, nope:]                                                      # [H, v, L]
    if fused:
        y = out if out is not None else torch.empty(B, H * v, device=q.device, dtype=dtype)
        if y.stride(-1) != 1:
            raise UserError(f"{name}: out must have a unit last stride (got {y.stride()})")
        g = _last_dim_unit(gate) if gate is not None else y
        if n_lt > 1:  # small batch: each program merges a latent tile, the last of a head adds the outputs
            lt, v_pad, n_pad = L // n_lt, _next_pow2(v), _next_pow2(n_lt)
            ws_o = torch.empty(B * H * n_pad * v_pad, device=q.device, dtype=torch.float32)
            # every split in one tile where that fits MERGE_TILE (all loads before the reductions:
            # ``_merged_one_tile``), else the largest power of two <= num_splits a step, as the fused merge
            one = s_pad * lt <= MERGE_TILE
            tile_args = dict(merge_args, S_TILE=s_pad if one else max(1, min(1 << (sp.num_splits.bit_length() - 1),
                                                                              MERGE_TILE // lt)),
                             **(_pdl_args(True, MERGE_WARPS) if late else {}))
            kernels["merge_tiles"][(B, H, n_lt)](
                sp.ws_acc, sp.ws_m, sp.ws_l, seq_lens, w_uv, g, y, ws_o, count, sp.num_splits, H, v, topk,
                *sp.strides,
                w_uv.stride(0), w_uv.stride(1), g.stride(0), y.stride(0),
                LT=lt, NLT=n_lt, NLT_PAD=n_pad, V_PAD=v_pad, HAS_GATE=gate is not None, **tile_args)
            return y
        ml_f = min(MERGE_L_FUSED, L)
        vb = MERGE_V_BLOCK or min(merge_v_block(B, H, v, sm_count(q.device)), max(16, MERGE_W_TILE // ml_f))
        fused_args = dict(merge_args, S_TILE=max(1, min(s_tile, MERGE_TILE // ml_f)))
        kernels["merge"][(B, H, -(-v // vb))](
            sp.ws_acc, sp.ws_m, sp.ws_l, seq_lens, y, w_uv, g, y, sp.num_splits, v, topk, *sp.strides, 0, 0,
            w_uv.stride(0), w_uv.stride(1), g.stride(0), y.stride(0),
            L=L, ML=ml_f, V_PAD=vb, EPILOGUE=True, HAS_GATE=gate is not None, **fused_args)
        return y
    # unfused: merge to o_lat (activation dtype), torch W_UV bmm, the reference's epilogue
    if sp.num_splits > 1:
        kernels["merge"][(B, H, L // ml)](
            sp.ws_acc, sp.ws_m, sp.ws_l, seq_lens, o_lat, o_lat, o_lat, o_lat, sp.num_splits, v, topk, *sp.strides,
            o_lat.stride(1), o_lat.stride(0), 0, 0, 0, 0,
            L=L, ML=ml, V_PAD=16, EPILOGUE=False, HAS_GATE=False, **merge_args)
    o = torch.bmm(o_lat, w_uv.transpose(1, 2)).transpose(0, 1).reshape(B, H * v)  # [H,B,L] x [H,L,v]
    return finish_output(o, gate, dtype, out)


def _supports(ctx: OpContext) -> Support:
    refusal = triton_gpu_refusal(ctx, "MLA", min_sm=80)
    if refusal:
        return refusal
    if ctx.attr("sparse_topk"):
        return f"sparse MLA (top-{ctx.attr('sparse_topk')} indexed tokens): this kernel attends to the whole context"
    try:
        L, R = ctx.dim("kv_lora"), ctx.dim("rope")
    except KeyError:  # a site without the dims: the call checks them and names the fix
        return True
    problems = shape_problems(L, R)
    return "; ".join(problems) if problems else True


IMPLEMENTATIONS = [
    Implementation("attention.mla", NAME, mla_decode_triton, _supports, priority=10,
                   description="Triton split-KV (flash-decoding) absorbed MLA over the paged latent cache: "
                               "no host sync (graph-capturable), live positions only; GPUs, pow2 kv_lora/rope >= 16"),
]
