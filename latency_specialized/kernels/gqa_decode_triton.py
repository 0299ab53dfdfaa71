"""GQA paged decode attention through a Triton split-KV kernel: ``attention.gqa.triton_splitkv``.

The contract is ``ops.attention.gqa.gqa_decode_reference`` (one new token per sequence, paged
``k_cache``/``v_cache`` [num_blocks, block_size, KV, D], optional sliding window and per-head sinks,
the new token's k/v written at ``slot_mapping`` first); this is the GPU kernel a captured decode step
runs where ``attention.gqa.torch_paged`` (which gathers and multiplies the whole block table per
step, in fp32) would otherwise serve. Design, predictions and measurements: ``NOTES_gqa.md``.

One call, one new token per sequence (``M`` rows, ``Hq`` query heads, ``KV`` key/value heads,
``G = Hq / KV`` query heads per group):

1. **split kernel**, grid ``(M, KV, num_splits)``: a program takes the ``G`` query heads of one KV
   head (padded to ``BLOCK_G`` >= 16, the smallest ``tl.dot`` M) and one contiguous chunk of the
   sequence's live range ``[lo, n)`` (``n = seq_lens[b]``, ``lo = max(0, n - window)`` or 0, both read
   *on the device*: a window visits only its own blocks, a short sequence in a long table only its
   live tiles, and the splits past the end do nothing). Every KV row is read once per group. Per tile
   of ``BLOCK_N`` positions it gathers the rows through ``block_table`` (ids past the live range are
   never read; a negative id inside it is clamped), ``s = scale * q k^T`` (tensor cores, fp32
   accumulation), online softmax in fp32 (base 2) and ``acc += p v`` with **p rounded to the cache
   dtype** for the tensor-core dot. With one split it normalises (sinks in the denominator) and
   writes ``out``; otherwise ``(acc, m, l)`` go to an fp32 workspace (empty splits store ``m = -inf,
   l = 0``). Up to ``FUSED_MERGE_MAX_SPLITS`` splits each program then arrives on its ``(b, kv head)``
   counter and **the last to arrive merges** that group's splits (the merge below, whole heads, in split
   order) and writes ``out``: one launch (off by default: ``FUSED_MERGE_MAX_SPLITS``);
2. **merge kernel**, grid ``(M, Hq, D / MERGE_D_BLOCK)`` (only with more splits than the split kernel merges):
   log-sum-exp weights over the splits, the sink in the denominator, **the one rounding** into ``out``, each
   program its block of head-dim columns. Rows without a position (``seq_lens == 0``) give exact zeros.

**The fused merge's ordering.** A program's stores, then a CTA barrier, then its arrival (``atomic_add``,
acq_rel, GPU scope): the split-k semaphore pattern (``mhc_triton``, ``topk_triton``); the last arriver reads
the partials with ``.cg`` loads and resets the counter, so the cached counters (``arrival_counters``) are zero
after every call and replays need no memset.

**The log-sum-exp (optional, ``lse=``).** Both kernels already hold each row's running max and
denominator; with an ``lse`` destination the program that normalises (the split kernel with one split,
else the merge kernel) also stores ``ln(sum exp(scale q k) + exp(sink))`` per (row, head), -inf for a row
with neither position nor sink: what a cross-rank merge of partial outputs needs (``attention.dcp``).
Without it the stores are compiled out (constexpr).

**The KV write (fused, default).** The split-0 program of ``(b, kv head)`` stores the new ``k[b]``,
``v[b]`` of its head at ``slot_mapping[b]`` (negative: nothing) in the cache dtype. The other programs
run concurrently and may read that slot before the store lands, so no program takes the new token
from memory: every program compares the slot of each position it reads with ``slot_mapping[b]`` and
uses the new k/v (from the input, rounded to the cache dtype exactly as the store rounds it) where
they match. The result is the reference's whenever no row reads a slot that *another* row of the
same call writes - true of every decode step (a sequence's new slot lies in a block only it appends
to; vLLM shares only full, read-only blocks). For anything else ``fused_write=False`` runs a tiny
write kernel first (two launches, the reference's order exactly).

Roundings against the fp32 reference: q and p to the cache dtype for the dots (no-ops for a bf16 q
and cache), fp32 everywhere else, one rounding of the output: a bf16 tolerance; with fp32 tensors
every step is fp32 (``tl.dot`` in IEEE fp32), which is how the CPU tests check the kernels under the
Triton interpreter. The interpreter's bf16/fp16 ``tl.dot`` is wrong (garbage of order 1e10 on this CPU),
so under it the dots' operands - rounded to the cache dtype exactly as on the GPU - are widened to fp32
(``DOT_F32``): the bf16 interpreter cases check the roundings and the bf16 stores, the GPU tests the
bf16 tensor-core dots.

``num_splits`` is chosen on the host from static shapes only (``choose_num_splits``: batch, KV heads,
block-table capacity or window, SM count): nothing reads ``seq_lens`` on the host, nothing syncs, so
the call captures into a CUDA graph and replays for any ``seq_lens``/``slot_mapping``/cache contents.
Workspaces are ``torch.empty`` per call (the graph's pool under capture).

**The merge launched early (``MERGE_PDL``, sm_90+).** The split kernel itself launches as any kernel (its q comes
from the previous kernel). The merge launches with PDL: each split program lets it launch once it has stored
its partials (``gdc_launch_dependents`` after its last store), so the merge's programs take only the SM room the
split kernel's tail leaves, load the sinks and wait (``gdc_wait``) for the split kernel to finish before reading
a partial; the merge in turn lets the next kernel launch. What it saves is the merge's launch latency behind
the split kernel (``mla_decode_triton.MERGE_PDL``, the same pattern).

Triton is imported lazily (kernels built on first use, per ``TRITON_INTERPRET`` setting), so this
module imports on machines without Triton and ``supports()`` names what is missing.
"""

from __future__ import annotations

import functools
import os

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.hardware import sm_count
from latency_specialized.kernels.triton_common import (cached_zeroed_int32, head_dim_refusal, pdl_available, pdl_launch,
                                                       triton_gpu_refusal)

NAME = "attention.gqa.triton_splitkv"

MIN_BLOCK_G = 16
"""Fewest query-head rows of a program's tiles: the smallest M of a tensor-core ``tl.dot`` (G = 8, Muse
Spark TP8 and Qwen3-30B, pads to 16 with masked rows: the kernel is bound by its KV reads, not the MMAs)."""
TILE_BYTES = 16384
"""Bytes of one K (or V) tile of a program: ``BLOCK_N = TILE_BYTES / (D x element size)`` positions,
clamped to [16, 128] - 128 positions at D = 64 bf16, 64 at D = 128: 32 KB of K+V per pipeline stage.
H200 sweep (benchmarks/results/h200/gqa_decode_sweep.md): 16 KB tiles with 3 stages and 4 warps beat 8 KB
/ 2 stages (the first version) by 1.2-1.7x at batch 8-64, context 32768."""
MIN_CHUNK = 128
"""Fewest positions a split takes (device side): a split's fp32 partials (G x D x 4 bytes, 2 KB at G 8,
D 64) stay ~1/16 of the KV bytes it reads (128 x D x 4 bytes of k+v per head), and each program runs
at least a couple of tiles against its fixed cost (q load, prologue, stores)."""
MAX_SPLITS = 256
"""Most splits of one sequence (the merge holds every split's m and l in one vector)."""
WAVES = 2
"""Target programs per SM (M x KV x splits ~ WAVES x SMs, rounded down) when choosing num_splits."""
MERGE_S_TILE = 64
"""Most splits one merge step loads ([S_TILE, D] fp32 partials per step)."""
NUM_WARPS = 4
NUM_STAGES = 3
MERGE_WARPS = 4
MERGE_PDL = True
"""The merge launched with PDL behind split programs that trigger it at their end (``late_merge_pdl``)."""
EARLY_TRIGGER = False
"""With ``MERGE_PDL``: the split programs trigger the merge's launch as they start instead of after their stores,
so its programs are resident and waiting when the last split ends. Safe either way (the merge's ``gdc_wait``
waits for the whole split grid); off: session 36's A/B (NOTES_gqa.md) was faster with it at batch 1, slower at
batch 8 with a window - not yet decided."""
MERGE_D_BLOCK = 16
"""Head-dim columns per merge program (0: the whole head): grid (M, Hq, D / MERGE_D_BLOCK), each program reading
``MERGE_S_TILE x D / MERGE_D_BLOCK`` splits a step, so a merge over many splits (batch 1: 132) takes fewer
dependent rounds of L2 reads on more SMs (NOTES_gqa.md, session 36: faster at batch 1, even from batch 8)."""
FUSED_MERGE_MAX_SPLITS = 0
"""Up to this many splits the split kernel merges them itself (0: never, the default): each program arrives on its
(row, KV head)'s counter after its stores and the last to arrive merges that head group's splits and writes ``out``,
so no merge kernel launches. Off because timed slower than the merge kernel wherever it changes the path (the one
program merging a group is a serial tail the column-blocked merge kernel spreads over programs; figures in
``NOTES_gqa.md``, session 46): an A/B switch, tested on the GPU, kept for other shapes."""
FUSED_MERGE_UNROLL = 4
"""Splits the last program loads per round of its merge ([FUSED_MERGE_UNROLL, BLOCK_G, D] fp32 partials)."""
_STORE_NEW = True
"""Tests only: False leaves the fused write's stores out, which shows that no program reads the new
token from memory (the interpreter runs programs one after another, so it cannot show a race)."""
_POW2_HEAD_DIM = (16, 256)
_LOG2E = 1.4426950408889634


@functools.cache
def _kernels(interpret: bool):
    """Build the jitted kernels (``triton.jit`` decides interpreter vs compiler when it decorates, from
    ``TRITON_INTERPRET``; hence one build per setting, on first use). Returns a dict by name."""
    del interpret  # the cache key only
    # defined here, not at import (no triton import on machines without it); Triton resolves the
    # names a kernel uses through its module globals: hence tl as a global
    global tl, tlc
    import triton
    import triton.language as tl
    import triton.language.extra.cuda as tlc

    @triton.jit
    def split_kernel(q, k_cache, v_cache, k_new, v_new, slots, block_table, seq_lens, sinks, out, lse_out,
                     ws_acc, ws_m, ws_l, counters, num_splits, window, block_size, qk_scale_log2,
                     s_qb, s_qh, s_cb, s_cs, s_ch, s_knb, s_knh, s_vnb, s_vnh, s_bt, s_ob, s_oh, s_lb,
                     s_wb, s_wh, s_ws,
                     G: tl.constexpr, D: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr,
                     MIN_CHUNK: tl.constexpr, FUSED_WRITE: tl.constexpr, DIRECT: tl.constexpr,
                     HAS_SINKS: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr,
                     STORE_NEW: tl.constexpr, HAS_LSE: tl.constexpr, TRIGGER_START: tl.constexpr,
                     TRIGGER_END: tl.constexpr, FUSED_MERGE: tl.constexpr, S_PAD: tl.constexpr,
                     SU: tl.constexpr):
        # grid (M, KV, num_splits). DOT_F32 (the interpreter only, whose bf16 tl.dot is wrong): the dots'
        # operands, rounded to the cache dtype as on the GPU, are widened to fp32 for an IEEE dot.
        # Masks from comparisons only (the interpreter mishandles & of a vector and a scalar mask): a
        # scalar condition becomes a bound (offs < where(cond, D, 0)).
        b = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        if TRIGGER_START:  # the merge (launched with PDL) may launch once every program has started
            tlc.gdc_launch_dependents()
        offs_g = tl.arange(0, BG)
        g_ok = offs_g < G
        offs_d = tl.arange(0, D)
        heads = kh * G + offs_g
        cdt = k_cache.dtype.element_ty

        if FUSED_WRITE:
            slot = tl.load(slots + b).to(tl.int64)   # < 0: no write, nothing to substitute
            kn = tl.load(k_new + b * s_knb + kh * s_knh + offs_d).to(cdt)            # [D], the cache rounding
            vn = tl.load(v_new + b * s_vnb + kh * s_vnh + offs_d).to(cdt)
            # split 0 stores the new token of its KV head; the other programs never read it from memory
            if STORE_NEW:
                w_ok = offs_d < tl.where((sp == 0) & (slot >= 0), D, 0)
                s_blk = tl.maximum(slot, 0) // block_size
                dst = s_blk * s_cb + (tl.maximum(slot, 0) % block_size) * s_cs + kh * s_ch + offs_d
                tl.store(k_cache + dst, kn, mask=w_ok)
                tl.store(v_cache + dst, vn, mask=w_ok)

        n = tl.load(seq_lens + b).to(tl.int32)
        n = tl.maximum(n, 0)
        lo = tl.where(window > 0, tl.maximum(n - window, 0), 0)
        # this split's chunk of [lo, n), from the device-side length: no host read of seq_lens anywhere
        chunk = tl.maximum(tl.cdiv(n - lo, num_splits), MIN_CHUNK)
        chunk = tl.cdiv(chunk, BN) * BN
        start = lo + sp * chunk
        end = tl.minimum(start + chunk, n)

        qt = tl.load(q + b * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=g_ok[:, None], other=0.0)
        qt = qt.to(cdt)                                                              # [BG, D]
        if DOT_F32:
            qt = qt.to(tl.float32)
        m_i = tl.full([BG], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BG], dtype=tl.float32)
        acc = tl.zeros([BG, D], dtype=tl.float32)
        for n0 in range(start, end, BN):
            pos = n0 + tl.arange(0, BN)
            ok = pos < end
            blk = tl.load(block_table + b * s_bt + pos // block_size, mask=ok, other=0)
            blk = tl.maximum(blk, 0).to(tl.int64)
            off = pos % block_size
            row = blk * s_cb + off * s_cs + kh * s_ch                                  # [BN] elements
            kt = tl.load(k_cache + row[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)   # [BN, D]
            vt = tl.load(v_cache + row[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
            if FUSED_WRITE:  # the slot being written this call: the new token from registers
                is_new = (blk * block_size + off) == slot
                kt = tl.where(is_new[:, None], kn[None, :], kt)
                vt = tl.where(is_new[:, None], vn[None, :], vt)
            if DOT_F32:
                kt = kt.to(tl.float32)
                vt = vt.to(tl.float32)
            s = tl.dot(qt, tl.trans(kt), input_precision=PREC)                          # [BG, BN]
            s = tl.where(ok[None, :], s * qk_scale_log2, float("-inf"))                 # log2 units
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds >= 1 live position
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            pc = p.to(cdt)
            if DOT_F32:
                pc = pc.to(tl.float32)
            acc = tl.dot(pc, vt, acc, input_precision=PREC)
            m_i = m_new

        if DIRECT:  # one split: normalise here (the sink in the denominator); no position -> zeros
            live = l_i > 0
            m_f = tl.where(live, m_i, 0.0)
            if HAS_SINKS:
                snk = tl.load(sinks + heads, mask=g_ok, other=0.0).to(tl.float32) * 1.4426950408889634
                m_t = tl.maximum(m_f, snk)
                denom = l_i * tl.exp2(m_f - m_t) + tl.exp2(snk - m_t)
                w = tl.exp2(m_f - m_t) / denom
                lse2 = m_t + tl.log2(denom)   # the sink alone keeps it finite
            else:
                w = 1.0 / tl.where(live, l_i, 1.0)
                lse2 = tl.where(live, m_f + tl.log2(tl.where(live, l_i, 1.0)), float("-inf"))
            o = tl.where(live[:, None], acc * w[:, None], 0.0)
            tl.store(out + b * s_ob + heads[:, None] * s_oh + offs_d[None, :], o.to(out.dtype.element_ty),
                     mask=g_ok[:, None])
            if HAS_LSE:  # natural log: the scores ran in log2 units
                tl.store(lse_out + b * s_lb + heads, lse2 * 0.6931471805599453, mask=g_ok)
        else:  # every split stores m and l (an empty one: -inf, 0); acc only where it held positions
            base = b * s_wb + kh * s_wh + sp * s_ws
            tl.store(ws_m + base + offs_g, m_i)
            tl.store(ws_l + base + offs_g, l_i)
            a_ok = offs_g < tl.where(start < end, G, 0)
            tl.store(ws_acc + (base + offs_g[:, None]) * D + offs_d[None, :], acc, mask=a_ok[:, None])
            if FUSED_MERGE:  # the program that stores last merges its (row, KV head): no merge launch
                # every thread's stores before the arrival; acq_rel at GPU scope: the last arriver sees them all
                tl.debug_barrier()
                cnt = counters + b * tl.num_programs(1) + kh
                ticket = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
                if ticket == num_splits - 1:
                    tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")   # zero again for the next call / replay
                    rows = b * s_wb + kh * s_wh
                    offs_s = tl.arange(0, S_PAD)
                    sg_ok = (offs_s[:, None] < num_splits) & g_ok[None, :]                  # [S_PAD, BG]
                    at = rows + offs_s[:, None] * s_ws + offs_g[None, :]
                    m_s = tl.load(ws_m + at, mask=sg_ok, other=float("-inf"), cache_modifier=".cg")
                    l_s = tl.load(ws_l + at, mask=sg_ok, other=0.0, cache_modifier=".cg")
                    used = l_s > 0
                    m_max = tl.max(tl.where(used, m_s, float("-inf")), 0)                   # [BG]
                    any_used = m_max > float("-inf")
                    m_max = tl.where(any_used, m_max, 0.0)
                    denom = tl.sum(tl.where(used, tl.exp2(m_s - m_max[None, :]) * l_s, 0.0), 0)
                    if HAS_SINKS:
                        snk = tl.load(sinks + heads, mask=g_ok, other=0.0).to(tl.float32) * 1.4426950408889634
                        m_t = tl.maximum(m_max, snk)
                        denom = denom * tl.exp2(m_max - m_t) + tl.exp2(snk - m_t)
                        m_max = m_t
                    inv = tl.where(any_used, 1.0 / tl.where(denom > 0, denom, 1.0), 0.0)
                    o = tl.zeros([BG, D], dtype=tl.float32)
                    offs_u = tl.arange(0, SU)
                    for s0 in range(0, num_splits, SU):   # splits in order: deterministic
                        su = s0 + offs_u
                        ug = (su[:, None] < num_splits) & g_ok[None, :]                       # [SU, BG]
                        au = rows + su[:, None] * s_ws + offs_g[None, :]
                        m_u = tl.load(ws_m + au, mask=ug, other=float("-inf"), cache_modifier=".cg")
                        l_u = tl.load(ws_l + au, mask=ug, other=0.0, cache_modifier=".cg")
                        u_used = l_u > 0
                        w_u = tl.where(u_used, tl.exp2(m_u - m_max[None, :]), 0.0)
                        part = tl.load(ws_acc + au[:, :, None] * D + offs_d[None, None, :],
                                       mask=u_used[:, :, None], other=0.0, cache_modifier=".cg")  # [SU, BG, D]
                        o += tl.sum(w_u[:, :, None] * part, 0)
                    tl.store(out + b * s_ob + heads[:, None] * s_oh + offs_d[None, :],
                             (o * inv[:, None]).to(out.dtype.element_ty), mask=g_ok[:, None])
                    if HAS_LSE:  # natural log of the denominator (sink included); no position and no sink: -inf
                        lse2 = tl.where(denom > 0, m_max + tl.log2(tl.where(denom > 0, denom, 1.0)), float("-inf"))
                        tl.store(lse_out + b * s_lb + heads, lse2 * 0.6931471805599453, mask=g_ok)
        if TRIGGER_END:  # the merge (launched with PDL) may start once every program got here
            tlc.gdc_launch_dependents()

    @triton.jit
    def merge_kernel(ws_acc, ws_m, ws_l, sinks, out, lse_out, num_splits, s_wb, s_wh, s_ws, s_ob, s_oh, s_lb,
                     G: tl.constexpr, D: tl.constexpr, DB: tl.constexpr, S_PAD: tl.constexpr,
                     S_TILE: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr, PDL: tl.constexpr):
        # grid (M, Hq, D / DB): columns [d0, d0 + DB) of head h of row b from the splits of its KV head's programs
        b = tl.program_id(0)
        h = tl.program_id(1)
        d0 = tl.program_id(2) * DB
        if HAS_SINKS:  # a weight: read before the wait (PDL)
            snk = tl.load(sinks + h).to(tl.float32) * 1.4426950408889634
        if PDL:  # the partials come from the split kernel
            tlc.gdc_wait()
            tlc.gdc_launch_dependents()
        kh = h // G
        g = h % G
        base = b * s_wb + kh * s_wh + g
        offs_s = tl.arange(0, S_PAD)
        s_ok = offs_s < num_splits
        m_s = tl.load(ws_m + base + offs_s * s_ws, mask=s_ok, other=float("-inf"))
        l_s = tl.load(ws_l + base + offs_s * s_ws, mask=s_ok, other=0.0)
        used = l_s > 0
        m_max = tl.max(tl.where(used, m_s, float("-inf")), 0)
        any_used = m_max > float("-inf")
        m_max = tl.where(any_used, m_max, 0.0)
        denom = tl.sum(tl.where(used, tl.exp2(m_s - m_max) * l_s, 0.0), 0)
        if HAS_SINKS:
            m_t = tl.maximum(m_max, snk)
            denom = denom * tl.exp2(m_max - m_t) + tl.exp2(snk - m_t)
            m_max = m_t
        inv = tl.where(any_used, 1.0 / tl.where(denom > 0, denom, 1.0), 0.0)
        offs_d = d0 + tl.arange(0, DB)
        acc = tl.zeros([DB], dtype=tl.float32)
        for s0 in range(0, num_splits, S_TILE):   # splits in order: deterministic
            offs_t = s0 + tl.arange(0, S_TILE)
            t_ok = offs_t < num_splits
            m_t2 = tl.load(ws_m + base + offs_t * s_ws, mask=t_ok, other=float("-inf"))
            l_t = tl.load(ws_l + base + offs_t * s_ws, mask=t_ok, other=0.0)
            t_used = l_t > 0
            w_t = tl.where(t_used, tl.exp2(m_t2 - m_max), 0.0)
            part = tl.load(ws_acc + (base + offs_t[:, None] * s_ws) * D + offs_d[None, :],
                           mask=t_used[:, None], other=0.0)                               # [S_TILE, D]
            acc += tl.sum(w_t[:, None] * part, 0)
        tl.store(out + b * s_ob + h * s_oh + offs_d, (acc * inv).to(out.dtype.element_ty))
        if HAS_LSE:  # natural log of the denominator (sink included); no position and no sink: -inf
            if d0 == 0:
                lse2 = tl.where(denom > 0, m_max + tl.log2(tl.where(denom > 0, denom, 1.0)), float("-inf"))
                tl.store(lse_out + b * s_lb + h, lse2 * 0.6931471805599453)

    @triton.jit
    def write_kernel(k_cache, v_cache, k_new, v_new, slots, block_size, s_cb, s_cs, s_ch,
                     s_knb, s_knh, s_vnb, s_vnh, D: tl.constexpr):
        # grid (M, KV): cache[slot, kh] = new[b, kh] in the cache dtype (slot < 0: nothing)
        b = tl.program_id(0)
        kh = tl.program_id(1)
        offs_d = tl.arange(0, D)
        slot = tl.load(slots + b).to(tl.int64)
        w_ok = offs_d < tl.where(slot >= 0, D, 0)
        sl = tl.maximum(slot, 0)
        dst = (sl // block_size) * s_cb + (sl % block_size) * s_cs + kh * s_ch + offs_d
        cdt = k_cache.dtype.element_ty
        kn = tl.load(k_new + b * s_knb + kh * s_knh + offs_d, mask=w_ok, other=0.0)
        vn = tl.load(v_new + b * s_vnb + kh * s_vnh + offs_d, mask=w_ok, other=0.0)
        tl.store(k_cache + dst, kn.to(cdt), mask=w_ok)
        tl.store(v_cache + dst, vn.to(cdt), mask=w_ok)

    return dict(split=split_kernel, merge=merge_kernel, write=write_kernel)


# ----------------------------------------------------------------------------------- static choices
def block_n(head_dim: int, element_size: int) -> int:
    """Positions per tile: ``TILE_BYTES`` of K per tile, a power of two in [16, 128]."""
    n = TILE_BYTES // max(head_dim * element_size, 1)
    return max(16, min(128, 1 << max(n.bit_length() - 1, 0)))


def block_g(group: int) -> int:
    """Query-head rows of a program's tiles: the group padded to a power of two >= ``MIN_BLOCK_G``."""
    return max(MIN_BLOCK_G, _next_pow2(group))


def span(capacity: int, window: int | None) -> int:
    """Most positions one sequence can attend: the block table's capacity, or the window if smaller."""
    return min(capacity, window) if window else capacity


def choose_num_splits(batch: int, kv_heads: int, span_positions: int, sms: int) -> int:
    """Splits per sequence from static shapes only (graph-safe): batch x KV heads x splits at most
    ``WAVES`` x SMs programs (rounded *down*: a partial tail wave would leave SMs idle while it runs), no
    more splits than ``span_positions`` (block-table capacity, or the window) holds chunks of
    ``MIN_CHUNK``, at most ``MAX_SPLITS``. Each split's live chunk is sized on the device from
    ``seq_lens`` (short sequences use fewer of them). H200 (132 SMs), Muse Spark TP8 (KV 2), 32k
    table: 132 / 16 / 8 / 4 / 2 splits at batch 1 / 8 / 16 / 32 / 64 (264 / 256 / 256 / 256 / 256
    programs); window 2048: at most 16."""
    programs = max(batch * kv_heads, 1)
    want = WAVES * sms // programs
    return max(1, min(want, -(-max(span_positions, 1) // MIN_CHUNK), MAX_SPLITS))


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def merge_d_block(head_dim: int) -> int:
    """Head-dim columns per merge program: ``MERGE_D_BLOCK`` where it is a power of two below ``head_dim``,
    else the whole head."""
    db = MERGE_D_BLOCK
    return db if 0 < db < head_dim and db & (db - 1) == 0 else head_dim


def late_merge_pdl(device: torch.device, num_splits: int) -> bool:
    """Whether the merge launches with PDL, triggered by the split programs at their end (at their start with
    ``EARLY_TRIGGER``): ``MERGE_PDL``, a merge at all (more than one split), compiled (not the interpreter), an sm_90+
    GPU, a Triton with grid dependency control. (No merge launches where the split kernel merges: ``fused_merge``.)"""
    return MERGE_PDL and num_splits > 1 and pdl_available(device)


def fused_merge(num_splits: int) -> bool:
    """Whether the split kernel merges its own splits (``FUSED_MERGE_MAX_SPLITS``): more than one, not too many."""
    return 1 < num_splits <= FUSED_MERGE_MAX_SPLITS


def arrival_counters(slots: int, device: torch.device) -> torch.Tensor:
    """``[slots]`` int32 arrival counters of the fused merge, zeroed once and cached per device and size; every call
    leaves them at zero (the last program of a group resets its counter). ``cached_zeroed_int32``: not cached when
    made under capture; one set must not serve two calls running at once on different streams."""
    return cached_zeroed_int32(NAME, (slots,), device)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
           seq_lens: torch.Tensor, k, v, slot_mapping) -> bool:
    """Shape/dtype/layout problems as errors naming the fix; returns whether the KV write is given."""
    given = [x is not None for x in (k, v, slot_mapping)]
    if any(given) and not all(given):
        raise ValueError(f"{NAME}: k, v and slot_mapping come together (the new token's KV write)")
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"{NAME}: q [M, Hq, D] and caches [num_blocks, block_size, KV, D] expected, got "
                         f"{tuple(q.shape)} and {tuple(k_cache.shape)}")
    M, Hq, D = q.shape
    KV = k_cache.shape[2]
    if v_cache.shape != k_cache.shape or k_cache.shape[3] != D:
        raise ValueError(f"{NAME}: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit "
                         f"q {tuple(q.shape)}")
    if Hq % KV:
        raise ValueError(f"{NAME}: {Hq} query heads are not a multiple of {KV} KV heads")
    lo, hi = _POW2_HEAD_DIM
    if D < lo or D > hi or D & (D - 1):
        raise UserError(f"{NAME}: head_dim {D} is not a power of two in [{lo}, {hi}]: serve it with "
                        "attention.gqa.torch_paged (force it in the plan)")
    if k_cache.dtype not in (torch.bfloat16, torch.float16, torch.float32) or v_cache.dtype != k_cache.dtype:
        raise UserError(f"{NAME}: cache dtypes {k_cache.dtype} / {v_cache.dtype} (one of bf16/fp16/fp32 for "
                        "both): use attention.gqa.torch_paged")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise UserError(f"{NAME}: k and v caches need the same strides and a unit last stride (got "
                        f"{k_cache.stride()} / {v_cache.stride()}); the caches are written in place, so "
                        "they cannot be copied to fix it")
    if block_table.dim() != 2 or block_table.shape[0] != M or seq_lens.shape != (M,):
        raise ValueError(f"{NAME}: block_table [M, max_blocks] and seq_lens [M] expected for M = {M}, got "
                         f"{tuple(block_table.shape)} and {tuple(seq_lens.shape)}")
    if all(given):
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != (M, KV, D):
                raise ValueError(f"{NAME}: {name} of shape {tuple(t.shape)} != [M, KV, D] = [{M}, {KV}, {D}]")
        if slot_mapping.shape != (M,):
            raise ValueError(f"{NAME}: slot_mapping of shape {tuple(slot_mapping.shape)} != [{M}]")
    return all(given)


def gqa_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, *, scale: float | None = None, window: int | None = None,
                      sinks: torch.Tensor | None = None, k: torch.Tensor | None = None,
                      v: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, num_splits: int | None = None,
                      fused_write: bool = True, lse: torch.Tensor | None = None,
                      cross_row_reads: bool = False) -> torch.Tensor:
    """GQA decode over a paged KV cache, one token per sequence (contract: ``gqa_decode_reference``).

    Parameters
    ----------
    q : [M, Hq, D] queries (any strides, unit last); D a power of two in [16, 256].
    k_cache, v_cache : [num_blocks, block_size, KV, D] paged caches (bf16/fp16/fp32, same strides, unit
        last stride), written in place with ``k``/``v``.
    block_table : [M, max_blocks] int32; seq_lens : [M] int, tokens per sequence including the new one
        (0: padding row -> zeros).
    scale : default D ** -0.5. window : None/0 full attention, else the last ``window`` positions (the
        new one included). sinks : optional [Hq] fp32 per-head logits in the softmax denominator.
    k, v : optional [M, KV, D] the new token's key and value (strided views fine), written at
    slot_mapping : [M] int flat slots (``block * block_size + offset``; < 0: no write) before attending.
    out : optional [M, Hq, D] destination (unit last stride).
    num_splits : splits per sequence; default from static shapes (``choose_num_splits``). Tests force it.
    fused_write : True (default): the split-0 programs store the new k/v and every program takes the
        written slot's values from registers (module docstring: exact whenever no row reads a slot that
        another row writes this call - every decode step); False: a write kernel runs first.
    cross_row_reads : True where a row may read a slot another row of this call writes (a verification step,
        the contract's flag): the write kernel then runs first, whatever ``fused_write`` says.
    lse : optional [M, Hq] fp32 destination of each row's natural log-sum-exp of the scaled scores (the
        sink included; -inf for a row with neither position nor sink), which the kernel forms anyway for
        its own split merge: what a cross-rank merge (``attention.dcp_merge``) needs. No extra launch.

    Returns
    -------
    [M, Hq, D] in q.dtype: fp32 softmax and accumulation, q and p rounded to the cache dtype for the
    dots, one rounding of the output. No host sync: CUDA-graph capturable. Launches: 1 (one split, or up to
    ``FUSED_MERGE_MAX_SPLITS`` merged by the split kernel) or 2 (split + merge), +1 with ``fused_write=False``.
    """
    write = _check(q, k_cache, v_cache, block_table, seq_lens, k, v, slot_mapping)
    fused_write = fused_write and not cross_row_reads   # another program may read a slot before its store lands
    M, Hq, D = q.shape
    _, bs, KV, _ = k_cache.shape
    G = Hq // KV
    y = out if out is not None else torch.empty(M, Hq, D, device=q.device, dtype=q.dtype)
    if tuple(y.shape) != (M, Hq, D) or y.stride(-1) != 1:
        raise UserError(f"{NAME}: out must be [M, Hq, D] = [{M}, {Hq}, {D}] with a unit last stride "
                        f"(got {tuple(y.shape)}, strides {y.stride()})")
    if lse is not None and (tuple(lse.shape) != (M, Hq) or lse.dtype != torch.float32 or lse.stride(-1) != 1):
        raise UserError(f"{NAME}: lse must be [M, Hq] = [{M}, {Hq}] fp32 with a unit last stride (got "
                        f"{tuple(lse.shape)} {lse.dtype}, strides {lse.stride()})")
    if M == 0:
        return y
    kernels = _kernels(_interpreting())
    q = _unit_last(q)
    bt = _unit_last(block_table)
    seq_lens = _unit_last(seq_lens)          # 1-D: a no-op for the step's contiguous buffers
    scale = D ** -0.5 if scale is None else float(scale)
    win = int(window) if window else 0
    if num_splits is None:
        num_splits = choose_num_splits(M, KV, span(bt.shape[1] * bs, win), sm_count(q.device))
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    s_cb, s_cs, s_ch, _ = k_cache.stride()
    if write:
        kn, vn = _unit_last(k), _unit_last(v)
        slots = _unit_last(slot_mapping)
        if not fused_write:
            kernels["write"][(M, KV)](k_cache, v_cache, kn, vn, slots, bs, s_cb, s_cs, s_ch,
                                      kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), D=D, num_warps=1)
    else:  # nothing to write: unused pointers (constexpr branch)
        kn, vn, slots = q, q, seq_lens
    fused = write and fused_write
    if sinks is not None and tuple(sinks.shape) != (Hq,):
        raise ValueError(f"{NAME}: sinks of shape {tuple(sinks.shape)} != [Hq] = [{Hq}]")
    sk = _unit_last(sinks) if sinks is not None else q
    dot_f32 = _interpreting() and k_cache.dtype != torch.float32   # the interpreter's bf16/fp16 tl.dot is wrong
    prec = "ieee" if k_cache.dtype == torch.float32 or dot_f32 else "tf32"
    direct = num_splits == 1
    fused_merge_ = fused_merge(num_splits)
    bg = block_g(G)
    late = late_merge_pdl(q.device, num_splits) and not fused_merge_
    lse_t, s_lb = (lse, lse.stride(0)) if lse is not None else (y, 0)   # unused pointer without lse (constexpr)
    if direct:
        ws_acc = ws_m = ws_l = y   # unused (constexpr branch)
        sw = (0, 0, 0)
    else:
        ws_m = torch.empty(M, KV, num_splits, bg, device=q.device, dtype=torch.float32)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty(M, KV, num_splits, bg, D, device=q.device, dtype=torch.float32)
        sw = (ws_m.stride(0), ws_m.stride(1), ws_m.stride(2))
    counters = arrival_counters(M * KV, q.device) if fused_merge_ else seq_lens   # unused pointer (constexpr)
    kernels["split"][(M, KV, num_splits)](
        q, k_cache, v_cache, kn, vn, slots, bt, seq_lens, sk, y, lse_t, ws_acc, ws_m, ws_l, counters,
        num_splits, win, bs, scale * _LOG2E,
        q.stride(0), q.stride(1), s_cb, s_cs, s_ch, kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        bt.stride(0), y.stride(0), y.stride(1), s_lb, *sw,
        G=G, D=D, BG=bg, BN=block_n(D, k_cache.element_size()), MIN_CHUNK=MIN_CHUNK, FUSED_WRITE=fused,
        DIRECT=direct, HAS_SINKS=sinks is not None, PREC=prec, DOT_F32=dot_f32, STORE_NEW=_STORE_NEW,
        HAS_LSE=lse is not None, TRIGGER_START=late and EARLY_TRIGGER, TRIGGER_END=late and not EARLY_TRIGGER,
        FUSED_MERGE=fused_merge_, S_PAD=_next_pow2(num_splits) if fused_merge_ else 1,
        SU=min(FUSED_MERGE_UNROLL, _next_pow2(num_splits)) if fused_merge_ else 1,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if not (direct or fused_merge_):
        s_pad = _next_pow2(num_splits)
        db = merge_d_block(D)
        kernels["merge"][(M, Hq, D // db)](
            ws_acc, ws_m, ws_l, sk, y, lse_t, num_splits, *sw, y.stride(0), y.stride(1), s_lb,
            G=G, D=D, DB=db, S_PAD=s_pad, S_TILE=min(MERGE_S_TILE * (D // db), s_pad), HAS_SINKS=sinks is not None,
            HAS_LSE=lse is not None, PDL=late, num_warps=MERGE_WARPS, **pdl_launch(late))
    return y


def kv_bytes(batch: int, context: int, kv_heads: int, head_dim: int, element_size: int = 2) -> int:
    """HBM bytes one call must read at least: every live position's k and v of every KV head once."""
    return batch * context * kv_heads * head_dim * 2 * element_size


# ----------------------------------------------------------------------------------- support
def _supports(ctx: OpContext) -> Support:
    refusal = triton_gpu_refusal(ctx, "GQA", min_sm=80)
    if refusal:
        return refusal
    try:
        D = ctx.dim("head_dim")
    except KeyError:  # a site without the dims: the call checks them and names the fix
        return True
    if why := head_dim_refusal(D, *_POW2_HEAD_DIM):
        return why
    try:
        Hq, KV = ctx.dim("heads"), ctx.dim("kv_heads")
    except KeyError:
        return True
    if KV <= 0 or Hq % KV:
        return f"{Hq} query heads are not a multiple of {KV} KV heads"
    if Hq // KV > 128:
        return f"GQA group of {Hq // KV} query heads per KV head (at most 128: one program's tile rows)"
    return True


IMPLEMENTATIONS = [
    Implementation("attention.gqa", NAME, gqa_decode_triton, _supports, priority=10,
                   description="Triton split-KV (flash-decoding) GQA over the paged KV cache, one program per "
                               "(sequence, KV head, split), fused KV write, window and sinks: no host sync "
                               "(graph-capturable), live positions only; GPUs sm_80+, pow2 head_dim 16-256"),
]

__all__ = ["IMPLEMENTATIONS", "NAME", "arrival_counters", "block_g", "block_n", "choose_num_splits", "fused_merge",
           "gqa_decode_triton", "kv_bytes", "span"]
