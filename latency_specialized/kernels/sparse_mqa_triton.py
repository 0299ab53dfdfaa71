"""Sparse MQA decode in two Triton launches: ``attention.sparse_mqa.triton``.

The contract is ``ops.attention.sparse_mqa.sparse_mqa_decode_reference`` (DeepSeek-V4.1-Flash's attention
between its projections: per-head weightless q RMSNorm, q / kv RoPE of the interleaved tail, the window-ring
write, one K = V head over the window ring plus the indexer's selected compressed rows, per-head sinks, the
output's inverse RoPE). One token per sequence: ``M`` rows, ``H`` local query heads, head width ``D``.

1. **split kernel**, grid ``(M, splits, head groups)``: a program takes every query head of its row (up to
   ``MAX_BLOCK_H`` of them, padded to 16 rows, the smallest ``tl.dot`` M: each KV row is read once for all
   heads) and one contiguous chunk of the row's ``T = W + topk`` key slots - ring slots first, then the
   selection's slots. Its prologue is the old ``qnorm_rope_kv_insert`` kernel, redone per program (a few
   KB of q, far less than the chunk's rows): q normed (fp32, rounded as the norm op rounds), roped, rounded;
   the new kv row normed with its gain (``kv_norm_weight``: the layer's kv_norm, rounded as the norm op
   rounds), roped and rounded to the ring's dtype. The program whose chunk holds the ring slot
   ``pos % W`` stores that row into the ring; every program substitutes it from registers where it reads
   that slot, and never loads the slot from memory, so no program can see the store half done (one launch
   fewer than a prologue kernel, and no ordering between launches to get right). Selected rows are gathered
   in place from the paged cache through ``block_table`` (no gather copy, no top-k -> rows conversion
   kernel); invalid slots (ring slots >= seq_len, selection -1 or >= seq_len // ratio) are masked, never
   read. Per tile of ``BLOCK_N`` slots: ``s = scale q k^T`` (tensor cores, fp32 accumulation), online
   softmax in base 2, ``acc += p v`` with p rounded to the cache dtype. Partials ``(acc, m, l)`` go to an
   fp32 workspace (an empty split stores ``m = -inf, l = 0, acc = 0``).
2. **combine kernel**, grid ``(M, H, D / BLOCK_D)``: log-sum-exp weights over the splits, the sink logit
   joins the denominator only, the attention output rounded to q's dtype (the reference's rounding), then
   the inverse RoPE of the tail channels (the interleaved partner of a channel lies in the same chunk) and
   the final rounding into ``out [M, H, D]``.

Splits are sized to the rows, not to a context: ``T <= W + topk`` slots, cut into chunks of whole tiles
(``choose_splits``: about ``WAVES`` programs per SM, at least one tile each), chosen on the host from static
shapes only - nothing reads ``seq_lens`` or the selection on the host, so the call captures into a CUDA
graph and replays for any positions, lengths, selections and cache contents. Workspaces are ``torch.empty``
per call (the graph's pool under capture).

Roundings against the fp32-math reference: the same roundings of q (norm, RoPE) and the ring row, p to the
cache dtype for the second dot, fp32 elsewhere, the output rounded twice as the reference rounds it: a bf16
tolerance. With fp32 tensors every step is fp32 (``tl.dot`` in IEEE fp32): how the CPU tests check the
kernels under the Triton interpreter, whose bf16 ``tl.dot`` is wrong (``DOT_F32`` widens the operands there,
after rounding them as the GPU would). Design notes: ``NOTES_sparse_mqa.md``.

The compressor of a KV-source layer, ``attention.sparse_mqa_compress.triton`` (contract:
``ops.attention.sparse_mqa.sparse_mqa_compress_reference``), is one more launch, grid ``(M,)``: the token's
``[kv | gate]`` stored into its pending slot, the group's other rows loaded (this token's from registers, so the
store and the pool need no ordering), the per-channel softmax-gated pool, the weighted RMSNorm (``lat``, the
indexer key's input, stored), the RoPE of ``lat`` (the partner channel read back from the stored row after a CTA
barrier) into the compressed cache at the row's slot (< 0: the token completes none). Its ``INDEX`` form serves
``attention.sparse_mqa_compress_index.triton``: a token that completes a row then projects ``lat`` (read back
after the barrier, in chunks) to the indexer's key, even and odd channels apart so that each interleaved RoPE pair
sits in one thread, norms, rotates and stores it at the same slot of the key cache (``COMPRESS_INDEX_KEY``).

Triton is imported lazily (kernels built on first use, per ``TRITON_INTERPRET`` setting), so this module
imports on machines without Triton and ``supports()`` names what is missing.
"""

from __future__ import annotations

import functools
import os

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.hardware import sm_count
from latency_specialized.kernels.ring_window import check_sliding_window
from latency_specialized.kernels.triton_common import (head_dim_refusal, pdl_available, pdl_launch,
                                                      triton_gpu_refusal)

NAME = "attention.sparse_mqa.triton"
FALLBACK = "attention.sparse_mqa.torch"
"""What the errors point to: the sync-free torch composition of the same family."""
COMPRESS_NAME = "attention.sparse_mqa_compress.triton"
COMPRESS_FALLBACK = "attention.sparse_mqa_compress.torch"
COMPRESS_INDEX_NAME = "attention.sparse_mqa_compress_index.triton"
COMPRESS_INDEX_FALLBACK = "the compressor, key gemm and indexer sites apart (their own kernels)"
COMPRESS_INDEX_KEY = False
"""The compressor of a layer that owns the indexer's keys also writes the new key (the family
``attention.sparse_mqa_compress_index`` served here, so the program skips the key gemm and calls the indexer with
``k=None``): two launches fewer per such layer, the key's ``Dk x D`` weight read by one program per token instead of a
gemm's grid. Off: slower in the layer at batch 1 and 8 (session 50's A/B, NOTES_sparse_mqa.md); off, the fused site
is refused and the three sites run apart."""
INDEX_KEY_TILE = 4096
"""Weight elements per operand of one step of the fused key projection (``[Dk / 2, BK]`` tiles, even and odd rows)."""

MIN_BLOCK_H = 16
"""Fewest query-head rows of a program's tiles: the smallest M of a tensor-core ``tl.dot`` (8 heads at TP8 pad
to 16 with masked rows: the kernel is bound by its row reads and latency, not by the MMAs)."""
MAX_BLOCK_H = 32
"""Most heads one program takes (its fp32 accumulator is ``heads x D``: 64 KB at 32 x 512); more heads split
into head groups that each read the rows again (TP1 / TP2 only)."""
TILE_BYTES = 32768
"""Bytes of one key tile: ``BLOCK_N = TILE_BYTES / (D x element size)`` slots, clamped to [16, 64] - 32 slots
of a 512-wide bf16 row (the stock stand-in's tile)."""
SINGLE_ROW_TILE_BYTES = 16384
"""``TILE_BYTES`` of a call with one row (batch 1): 16 slots of a 512-wide bf16 row, twice the split programs over
the row's few slots (a window-only row has 128); at batch 8 the shorter tiles lost (``NOTES_sparse_mqa.md``,
session 40)."""
WAVES = 2
"""Target programs per SM when choosing the splits (M x splits x head groups ~ WAVES x SMs, >= 1 tile each)."""
MAX_SPLITS = 64
"""Most splits of one row (the combine holds every split's m and l in one vector)."""
COMBINE_TILE = 4096
"""fp32 partial elements one combine program loads per operand (``splits x BLOCK_D``)."""
NUM_STAGES = 2
COMBINE_PDL = False
"""Launch the combine with PDL (``combine_pdl``) behind split programs that trigger it after their last store: its
programs load the RoPE angles' inputs and the sinks, then wait (``gdc_wait``) for the split kernel before reading a
partial - the MLA and GQA merges' pattern (``mla_decode_triton.MERGE_PDL``, ``gqa_decode_triton.MERGE_PDL``). Off
until a layer A/B on a GPU says it helps (``NOTES_sparse_mqa.md``)."""
SELECTION_PDL = False
"""A call told that the launch right before it produced its ``selection`` (``after_selection``: the indexer's last
kernel) launches its split kernel with PDL: every program runs its prologue (query norm and RoPE, the new row, the
ring store) and the window's slots while that kernel still runs, and waits (``gdc_wait``) before it reads the
selection or stores a partial - the workspaces may reuse memory the selection's producer still reads. Pays with
``indexer_triton.SELECT_TRIGGER_START`` (the select lets it start at once; without, it starts as the select's
programs exit). Off: A/B switch (``NOTES_sparse_mqa.md``, session 47)."""
_STORE_NEW = True
"""Tests only: False leaves out the ring store, which shows that no program reads the new row from memory
(the interpreter runs programs one after another, so it cannot show a race)."""
_LOG2E = 1.4426950408889634
_HEAD_DIMS = (16, 1024)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _kernels(interpret: bool):
    """Build the jitted kernels (``triton.jit`` decides interpreter vs compiler when it decorates, from
    ``TRITON_INTERPRET``: one build per setting, on first use). Returns a dict by name."""
    del interpret  # the cache key only
    # defined here, not at import (no triton import on machines without it); Triton resolves the names a
    # kernel uses through its module globals: hence tl as a global
    global tl, tlc, _tile_rows, _attend_tile
    import triton
    import triton.language as tl
    import triton.language.extra.cuda as tlc

    @triton.jit
    def _tile_rows(t0, slot, seq, vis, seq_c, w_base, s_ws, m, selection, s_sel, block_table, s_bt, block_size, cache,
                   W, T, d, D: tl.constexpr, BN: tl.constexpr, HAS_SEL: tl.constexpr):
        """Slots ``t0 .. t0 + BN`` of a row (window ring, then the selection's compressed rows) as stored: ``(rows
        [BN, D] in the ring's dtype, live [BN], the new row's slot [BN])`` - that slot is never loaded (0 here)."""
        t = t0 + tl.arange(0, BN)
        ok = (t < W) & ((seq - 1 - t + W) % W < vis)    # slot t holds one of the last vis positions
        is_new = ok & (t == slot)
        kt = tl.load(w_base + t[:, None] * s_ws + d[None, :], mask=(ok & (t != slot))[:, None], other=0.0)
        if HAS_SEL:
            j = t - W
            in_c = (t >= W) & (t < T)
            idx = tl.load(selection + m * s_sel + j, mask=in_c, other=-1).to(tl.int32)
            ok_c = in_c & (idx >= 0) & (idx < seq_c)
            ic = tl.maximum(idx, 0)
            blk = tl.load(block_table + m * s_bt + ic // block_size, mask=ok_c, other=0).to(tl.int64)
            crow = blk * block_size + (ic % block_size)
            kc = tl.load(cache + crow[:, None] * D + d[None, :], mask=ok_c[:, None], other=0.0)
            kt = tl.where(ok_c[:, None], kc.to(w_base.dtype.element_ty), kt)
            ok = ok | ok_c
        return kt, ok, is_new

    @triton.jit
    def _attend_tile(kt, ok, is_new, kn, qt, m_i, l_i, acc, qk_scale_log2, PREC: tl.constexpr, DOT_F32: tl.constexpr):
        """One tile of the online softmax: the new row from registers at its slot, scores in log2 units, ``p``
        rounded to the ring's dtype for the second dot. Returns ``(m_i, l_i, acc)``."""
        cdt = kt.dtype
        kt = tl.where(is_new[:, None], kn[None, :], kt)                                # never from memory
        if DOT_F32:
            kt = kt.to(tl.float32)
        sc = tl.dot(qt, tl.trans(kt), input_precision=PREC)                            # [BH, BN]
        sc = tl.where(ok[None, :], sc * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                          # a tile with no live slot
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pc = p.to(cdt)
        if DOT_F32:
            pc = pc.to(tl.float32)
        acc = tl.dot(pc, kt, acc * alpha[:, None], input_precision=PREC)
        return m_new, l_i, acc

    @triton.jit
    def split_kernel(q, kv, positions, rows, seq_lens, window, cache, block_table, selection, inv_freq, kv_w,
                     ws_acc, ws_m, ws_l, num_splits, chunk, T, W, SW, ratio, block_size, H, q_eps, kv_eps,
                     qk_scale_log2,
                     s_qm, s_qh, s_kv, s_wr, s_ws, s_bt, s_sel,
                     D: tl.constexpr, R: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                     NORM_Q: tl.constexpr, NORM_KV: tl.constexpr, HAS_SEL: tl.constexpr, PREC: tl.constexpr,
                     DOT_F32: tl.constexpr,
                     STORE_NEW: tl.constexpr, WRITE_ONLY: tl.constexpr, TRIGGER_END: tl.constexpr,
                     WAIT_SEL: tl.constexpr):
        # grid (M, num_splits, head groups). Masks from comparisons only (the interpreter mishandles & of a
        # vector and a scalar mask): a scalar condition becomes a bound (offs < where(cond, D, 0)).
        m = tl.program_id(0).to(tl.int64)
        sp = tl.program_id(1)
        hg = tl.program_id(2)
        offs_h = hg * BH + tl.arange(0, BH)
        h_ok = offs_h < H
        d = tl.arange(0, D)
        t_rot = d - (D - R)
        rot = t_rot >= 0
        dp = tl.where(rot, d ^ 1, d)                    # interleaved partner (itself outside the tail)
        pos = tl.load(positions + m)
        seq = tl.load(seq_lens + m).to(tl.int32)
        srow = tl.load(rows + m).to(tl.int64)
        # RoPE as x * c + x[partner] * s: outside the tail inv = 0 gives c = 1, s = 0 exactly
        inv = tl.load(inv_freq + tl.maximum(t_rot, 0) // 2, mask=rot, other=0.0)
        ang = pos.to(tl.float32) * inv
        c = tl.cos(ang)
        s_ = tl.sin(ang) * tl.where(t_rot % 2 == 0, -1.0, 1.0)
        qdt = q.dtype.element_ty
        cdt = window.dtype.element_ty

        slot = (pos % W).to(tl.int32)
        seq_c = seq // ratio
        vis = tl.minimum(SW, seq)                                                      # positions a row sees
        start = sp * chunk
        end = tl.minimum(start + chunk, T)
        w_base = window + srow * s_wr

        # the query: weightless RMSNorm and RoPE, each rounded to q's dtype as the unfused ops round them
        q_ptr = q + m * s_qm + offs_h[:, None] * s_qh
        qx = tl.load(q_ptr + d[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
        qp = tl.load(q_ptr + dp[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
        if NORM_Q:
            r = tl.rsqrt(tl.sum(qx * qx, 1) / D + q_eps)
            qx = (qx * r[:, None]).to(qdt).to(tl.float32)
            qp = (qp * r[:, None]).to(qdt).to(tl.float32)
        qt = (qx * c[None, :] + qp * s_[None, :]).to(qdt).to(cdt)                     # [BH, D]
        if DOT_F32:
            qt = qt.to(tl.float32)

        # the new row (normed with its gain, rounded as the norm op rounds: the whole row is here already),
        # roped and rounded as the ring stores it; the program holding its slot stores it
        kx = tl.load(kv + m * s_kv + d).to(tl.float32)
        kp = tl.load(kv + m * s_kv + dp).to(tl.float32)
        if NORM_KV:
            kdt = kv.dtype.element_ty
            rk = tl.rsqrt(tl.sum(kx * kx, 0) / D + kv_eps)
            kx = (kx * rk * tl.load(kv_w + d).to(tl.float32)).to(kdt).to(tl.float32)
            kp = (kp * rk * tl.load(kv_w + dp).to(tl.float32)).to(kdt).to(tl.float32)
        kn = (kx * c + kp * s_).to(kv.dtype.element_ty).to(cdt)                        # [D]
        if STORE_NEW:
            own = (slot // chunk == sp) & (hg == 0)
            tl.store(window + srow * s_wr + slot * s_ws + d, kn, mask=d < tl.where(own, D, 0))
        if WRITE_ONLY:   # the write-first launch of a call whose rows read each other's new slots
            return

        m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BH], dtype=tl.float32)
        acc = tl.zeros([BH, D], dtype=tl.float32)
        if WAIT_SEL:   # launched with PDL behind the selection's producer (SELECTION_PDL)
            if end > W:    # this program's slots include selected rows
                tlc.gdc_wait()
        for t0 in range(start, end, BN):
            kt, ok, is_new = _tile_rows(t0, slot, seq, vis, seq_c, w_base, s_ws, m, selection, s_sel, block_table,
                                        s_bt, block_size, cache, W, T, d, D, BN, HAS_SEL)
            m_i, l_i, acc = _attend_tile(kt, ok, is_new, kn, qt, m_i, l_i, acc, qk_scale_log2, PREC, DOT_F32)

        if WAIT_SEL:
            if end <= W:   # window slots only: no wait so far, but the partials may reuse the producer's memory
                tlc.gdc_wait()
        base = (m * num_splits + sp) * H + offs_h
        tl.store(ws_m + base, m_i, mask=h_ok)
        tl.store(ws_l + base, l_i, mask=h_ok)
        tl.store(ws_acc + base[:, None] * D + d[None, :], acc, mask=h_ok[:, None])
        if TRIGGER_END:  # the combine (launched with PDL) may start once every program got here
            tlc.gdc_launch_dependents()

    @triton.jit
    def combine_kernel(ws_acc, ws_m, ws_l, sinks, positions, inv_freq, out, num_splits, H, s_om, s_oh,
                       D: tl.constexpr, R: tl.constexpr, S_PAD: tl.constexpr, BD: tl.constexpr,
                       HAS_SINKS: tl.constexpr, PDL: tl.constexpr):
        # grid (M, H, D / BD): channels [c BD, (c + 1) BD) of head h of row m
        m = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        cb = tl.program_id(2)
        offs_s = tl.arange(0, S_PAD)
        s_ok = offs_s < num_splits
        base = (m * num_splits + offs_s) * H + h
        d = cb * BD + tl.arange(0, BD)
        t_rot = d - (D - R)
        rot = t_rot >= 0
        dp = tl.where(rot, d ^ 1, d)
        # every load before the first reduction (a barrier no load is moved across: the partials and the angle
        # inputs read after it waited a round trip of their own); the angle inputs and the sinks first: nothing
        # the split kernel writes, so a combine launched early (PDL) reads them before its wait
        inv = tl.load(inv_freq + tl.maximum(t_rot, 0) // 2, mask=rot, other=0.0)
        ang = -(tl.load(positions + m).to(tl.float32)) * inv                    # the inverse rotation
        if HAS_SINKS:
            snk = tl.load(sinks + h).to(tl.float32) * 1.4426950408889634
        if PDL:  # the partials come from the split kernel
            tlc.gdc_wait()
        m_s = tl.load(ws_m + base, mask=s_ok, other=float("-inf"))
        l_s = tl.load(ws_l + base, mask=s_ok, other=0.0)
        part = tl.load(ws_acc + base[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
        partp = tl.load(ws_acc + base[:, None] * D + dp[None, :], mask=s_ok[:, None], other=0.0)
        g = tl.max(m_s, 0)
        if HAS_SINKS:
            g = tl.maximum(g, snk)
        g = tl.where(g == float("-inf"), 0.0, g)
        w = tl.exp2(m_s - g)                                   # 0 for empty and padded splits
        denom = tl.sum(w * l_s, 0)
        if HAS_SINKS:
            denom += tl.exp2(snk - g)                          # the sink: the denominator only
        rcp = tl.where(denom > 0, 1.0 / tl.where(denom > 0, denom, 1.0), 0.0)
        odt = out.dtype.element_ty
        o = (tl.sum(w[:, None] * part, 0) * rcp).to(odt).to(tl.float32)       # the attention's rounding
        op = (tl.sum(w[:, None] * partp, 0) * rcp).to(odt).to(tl.float32)
        y = o * tl.cos(ang) + op * tl.sin(ang) * tl.where(t_rot % 2 == 0, -1.0, 1.0)
        tl.store(out + m * s_om + h * s_oh + d, y.to(odt))

    @triton.jit
    def compress_kernel(c, pending, rows, positions, norm_w, inv_freq, cache, slots, lat, eps, s_c, s_pr, s_pk, P,
                        idx_w, idx_nw, idx_cache, idx_eps, s_iw,
                        D: tl.constexpr, R: tl.constexpr, RATIO: tl.constexpr, BR: tl.constexpr,
                        WRITE_ONLY: tl.constexpr, INDEX: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr):
        # grid (M,): one token's compressor, pending write -> pool -> norm -> lat -> RoPE -> cache write
        m = tl.program_id(0).to(tl.int64)
        pos = tl.load(positions + m)
        d = tl.arange(0, D)
        cdt = c.dtype.element_ty
        # what the norm and the RoPE read, loaded first: a load written after a block reduction waits for it
        nw = tl.load(norm_w + d).to(tl.float32)
        t_rot = d - (D - R)
        rot = t_rot >= 0
        inv = tl.load(inv_freq + tl.maximum(t_rot, 0) // 2, mask=rot, other=0.0)
        slot = tl.load(slots + m).to(tl.int64)
        if RATIO > 1:
            pdt = pending.dtype.element_ty
            srow = tl.load(rows + m).to(tl.int64)
            cur = (pos % P).to(tl.int32)                                                # pending is a ring of P
            cv = tl.load(c + m * s_c + d).to(pdt)                                       # the pending rounding
            cg = tl.load(c + m * s_c + D + d).to(pdt)
            if RATIO == 2:   # the previous token's row as two [D] vectors: the pool is elementwise (no barrier)
                # (read in the write-first launch too: Triton generates the code after its return)
                prev = pending + srow * s_pr + (((pos - 1) % P + P) % P) * s_pk
                pv0 = tl.load(prev + d).to(tl.float32)
                pg0 = tl.load(prev + D + d).to(tl.float32)
            tl.store(pending + srow * s_pr + cur * s_pk + d, cv)
            tl.store(pending + srow * s_pr + cur * s_pk + D + d, cg)
            if WRITE_ONLY:   # the write-first launch of a call whose rows pool each other's pending rows
                return
            if RATIO == 2:
                # the [RATIO, D] tile's form below, unrolled: same terms, same order (oldest first)
                pv1 = cv.to(tl.float32)
                pg1 = cg.to(tl.float32)
                g_max = tl.maximum(pg0, pg1)
                e0 = tl.exp(pg0 - g_max)
                e1 = tl.exp(pg1 - g_max)
                den = e0 + e1
                x = (e0 / den * pv0 + e1 / den * pv1).to(pdt).to(cdt).to(tl.float32)
            else:
                # the group: positions pos - RATIO + 1 .. pos, oldest first (the reference's summation order)
                k = tl.arange(0, BR)
                gslot = ((pos - (RATIO - 1) + k) % P + P) % P
                prow = pending + srow * s_pr + gslot[:, None] * s_pk + d[None, :]
                old = k < RATIO - 1                                                     # the group's earlier tokens
                pv = tl.load(prow, mask=old[:, None], other=0.0).to(tl.float32)
                pg = tl.load(prow + D, mask=old[:, None], other=0.0).to(tl.float32)
                now = (k == RATIO - 1)[:, None]                                         # this token, from registers
                pv = tl.where(now, cv.to(tl.float32)[None, :], pv)
                pg = tl.where(now, cg.to(tl.float32)[None, :], pg)
                pg = tl.where((k < RATIO)[:, None], pg, float("-inf"))
                e = tl.exp(pg - tl.max(pg, 0)[None, :])
                x = tl.sum(e / tl.sum(e, 0)[None, :] * pv, 0).to(pdt).to(cdt).to(tl.float32)
        else:
            x = tl.load(c + m * s_c + d).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        y = (x * r * nw).to(lat.dtype.element_ty)
        tl.store(lat + m * D + d, y)
        # the RoPE partner lives in another thread's registers: read it back from the row just stored
        tl.debug_barrier()
        yp = tl.load(lat + m * D + tl.where(rot, d ^ 1, d)).to(tl.float32)
        ang = pos.to(tl.float32) * inv
        z = y.to(tl.float32) * tl.cos(ang) + yp * tl.sin(ang) * tl.where(t_rot % 2 == 0, -1.0, 1.0)
        tl.store(cache + tl.maximum(slot, 0) * D + d, z.to(lat.dtype.element_ty).to(cache.dtype.element_ty),
                 mask=d < tl.where(slot >= 0, D, 0))
        if INDEX:
            if slot >= 0:   # the indexer's key of the completed row: lat @ idx_w^T, RMSNorm, leading RoPE
                # even and odd output channels apart: an interleaved RoPE pair is then (ke[j], ko[j]), in one
                # thread, and lat is read back in chunks from the row stored before the barrier above
                j = tl.arange(0, DK // 2)
                acc_e = tl.zeros([DK // 2], dtype=tl.float32)
                acc_o = tl.zeros([DK // 2], dtype=tl.float32)
                for k0 in tl.static_range(0, D, BK):
                    kk = k0 + tl.arange(0, BK)
                    lv = tl.load(lat + m * D + kk).to(tl.float32)[None, :]
                    acc_e += tl.sum(tl.load(idx_w + (2 * j)[:, None] * s_iw + kk[None, :]).to(tl.float32) * lv, 1)
                    acc_o += tl.sum(tl.load(idx_w + (2 * j + 1)[:, None] * s_iw + kk[None, :]).to(tl.float32) * lv, 1)
                ldt = lat.dtype.element_ty
                ke = acc_e.to(ldt).to(tl.float32)                                       # the gemm's rounding
                ko = acc_o.to(ldt).to(tl.float32)
                rk = tl.rsqrt((tl.sum(ke * ke, 0) + tl.sum(ko * ko, 0)) / DK + idx_eps)
                ke = ke * rk * tl.load(idx_nw + 2 * j).to(tl.float32)
                ko = ko * rk * tl.load(idx_nw + 2 * j + 1).to(tl.float32)
                rot_k = j < R // 2
                ang_k = pos.to(tl.float32) * tl.load(inv_freq + j, mask=rot_k, other=0.0)
                ck = tl.where(rot_k, tl.cos(ang_k), 1.0)
                sk = tl.where(rot_k, tl.sin(ang_k), 0.0)
                icdt = idx_cache.dtype.element_ty
                tl.store(idx_cache + slot * DK + 2 * j, (ke * ck - ko * sk).to(icdt))
                tl.store(idx_cache + slot * DK + 2 * j + 1, (ko * ck + ke * sk).to(icdt))

    return {"split": split_kernel, "combine": combine_kernel, "compress": compress_kernel}


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def block_h(heads: int) -> int:
    """Head rows of one program's tiles (a power of two in [MIN_BLOCK_H, MAX_BLOCK_H])."""
    return min(max(MIN_BLOCK_H, _next_pow2(heads)), MAX_BLOCK_H)


def block_n(head_dim: int, element_size: int, rows: int) -> int:
    """Key slots per tile of a call with ``rows`` rows (``TILE_BYTES``, ``SINGLE_ROW_TILE_BYTES`` for one row;
    clamped to [16, 64])."""
    tile = SINGLE_ROW_TILE_BYTES if rows == 1 else TILE_BYTES
    return min(max(16, _next_pow2(tile // (head_dim * element_size))), 64)


def choose_splits(rows: int, slots: int, head_groups: int, sms: int, block: int) -> int:
    """Splits of a row's ``slots`` key slots: about ``WAVES x sms`` programs over the ``rows x head_groups``
    (row, head group) pairs, at least one tile (``block`` slots) per split, at most ``MAX_SPLITS``."""
    tiles = -(-slots // block)
    want = max(1, (WAVES * sms) // max(rows * head_groups, 1))
    return max(1, min(tiles, want, MAX_SPLITS))


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def sparse_mqa_decode_triton(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                             seq_lens: torch.Tensor, window: torch.Tensor, cache: torch.Tensor | None,
                             block_table: torch.Tensor | None, selection: torch.Tensor | None,
                             sinks: torch.Tensor | None, rope_inv_freq: torch.Tensor, *, scale: float,
                             compress_ratio: int = 1, q_norm_eps: float | None = None,
                             kv_norm_weight: torch.Tensor | None = None, kv_norm_eps: float = 1e-6,
                             out: torch.Tensor | None = None, sliding_window: int | None = None,
                             cross_row_reads: bool = False, num_splits: int | None = None,
                             after_selection: bool = False) -> torch.Tensor:
    """Sparse MQA decode (contract: ``ops.attention.sparse_mqa.sparse_mqa_decode_reference``), two launches
    (three with ``cross_row_reads``: the split kernel's prologue alone first, writing every row's ring slot).

    Parameters
    ----------
    q : [M, H, D] raw (``q_norm_eps`` given) or normed query, pre-RoPE (unit last stride; rows / heads strided ok).
    kv : [M, D] the new token's row, pre-RoPE (unit last stride; strided rows ok): raw where ``kv_norm_weight``
        ([D], the RMSNorm gain, eps ``kv_norm_eps``) is given - normed in the split kernel's prologue - else
        normed. positions, rows, seq_lens : [M] ints.
    window : [rows_max, W, D] ring (unit last stride), written in place at (rows, positions % W).
    cache : [blocks, block_size, D] contiguous paged compressed rows, or None (window-only);
    block_table : [M, max_blocks] ints; selection : [M, topk] ints (-1: none; >= seq_lens // compress_ratio:
        skipped), or None. sinks : [H] fp32 or None. rope_inv_freq : [R/2] fp32.
    out : optional [M, H, D] in q.dtype (unit last stride). sliding_window : positions a row sees (default W).
    cross_row_reads : rows read slots other rows of the call write (verification steps): a write-first launch,
        and the split kernel then stores nothing (each program still takes its own row's slot from registers).
    num_splits : splits of the ``W + topk`` slots per row; default ``choose_splits`` (static shapes only). Tests
        force it.
    after_selection : the launch right before this call on the stream wrote ``selection`` and nothing else this
        call reads (the indexer's last kernel): with ``SELECTION_PDL`` the split kernel starts behind it
        (``selection_pdl``).

    Returns
    -------
    [M, H, D] in q.dtype, the inverse RoPE applied (``out`` when given). No host sync: CUDA-graph capturable.
    """
    _check(q, kv, positions, rows, seq_lens, window, cache, block_table, selection, sinks, rope_inv_freq)
    M, H, D = q.shape
    if kv_norm_weight is not None and (tuple(kv_norm_weight.shape) != (D,) or not kv_norm_weight.is_contiguous()):
        raise UserError(f"{NAME}: kv_norm_weight must be contiguous [D={D}], got {tuple(kv_norm_weight.shape)}")
    W = window.shape[1]
    SW = check_sliding_window(sliding_window, W, NAME)
    K = 0 if selection is None else selection.shape[1]
    T = W + K
    R = 2 * rope_inv_freq.shape[0]
    if out is None:
        out = torch.empty(M, H, D, device=q.device, dtype=q.dtype)
    elif tuple(out.shape) != (M, H, D) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise UserError(f"{NAME}: out must be [M, H, D] = [{M}, {H}, {D}] in {q.dtype} with unit last stride, "
                        f"got {tuple(out.shape)} {out.dtype}")
    if M == 0:
        return out
    q, kv, window = _unit_last(q), _unit_last(kv), window
    bh = block_h(H)
    groups = -(-H // bh)
    bn = block_n(D, window.element_size(), M)
    if num_splits is None:
        num_splits = choose_splits(M, T, groups, sm_count(q.device), bn)
    if num_splits < 1:
        raise UserError(f"{NAME}: num_splits={num_splits}; use a positive split count (or None)")
    tiles = -(-T // bn)
    chunk = -(-tiles // min(num_splits, tiles)) * bn        # whole tiles per split
    ns = -(-T // chunk)
    if ns > MAX_SPLITS:
        raise UserError(f"{NAME}: {ns} splits of {T} slots exceed MAX_SPLITS={MAX_SPLITS}; ask for fewer")
    ws_acc = torch.empty(M, ns, H, D, device=q.device, dtype=torch.float32)
    ws_m = torch.empty(M, ns, H, device=q.device, dtype=torch.float32)
    ws_l = torch.empty_like(ws_m)
    has_sel = selection is not None
    if has_sel:
        sel, bt, cc, bs = _unit_last(selection), _unit_last(block_table), cache, cache.shape[1]
    else:  # unused pointers (constexpr branch)
        sel, bt, cc, bs = seq_lens, seq_lens, window, 1
    interp = _interpreting()
    dot_f32 = interp and window.dtype != torch.float32   # the interpreter's bf16/fp16 tl.dot is wrong
    prec = "ieee" if window.dtype == torch.float32 or dot_f32 else "tf32"
    kernels = _kernels(interp)

    pdl = combine_pdl(q.device)
    wait_sel = after_selection and has_sel and not cross_row_reads and selection_pdl(q.device)

    def split(grid: tuple[int, int, int], chunk_: int, store: bool, write_only: bool) -> None:
        kernels["split"][grid](
            q, kv, positions, rows, seq_lens, window, cc, bt, sel, rope_inv_freq,
            kv_norm_weight if kv_norm_weight is not None else rope_inv_freq, ws_acc, ws_m, ws_l,
            ns, chunk_, T, W, SW, max(int(compress_ratio), 1), bs, H, float(q_norm_eps or 0.0), float(kv_norm_eps),
            float(scale) * _LOG2E,
            q.stride(0), q.stride(1), kv.stride(0), window.stride(0), window.stride(1),
            bt.stride(0) if has_sel else 0, sel.stride(0) if has_sel else 0,
            D=D, R=R, BH=bh, BN=bn, NORM_Q=q_norm_eps is not None, NORM_KV=kv_norm_weight is not None,
            HAS_SEL=has_sel, PREC=prec, DOT_F32=dot_f32,
            STORE_NEW=store, WRITE_ONLY=write_only, TRIGGER_END=pdl and not write_only,
            WAIT_SEL=wait_sel and not write_only, num_warps=8 if D >= 256 else 4, num_stages=NUM_STAGES,
            **pdl_launch(wait_sel and not write_only))

    if cross_row_reads:   # every row's ring slot stored (one program per row) before any program reads
        split((M, 1, 1), T, _STORE_NEW, True)
    split((M, ns, groups), chunk, _STORE_NEW and not cross_row_reads, False)
    s_pad = max(2, _next_pow2(ns))
    bd = max(16, min(D, COMBINE_TILE // s_pad))
    kernels["combine"][(M, H, D // bd)](
        ws_acc, ws_m, ws_l, sinks if sinks is not None else ws_m, positions, rope_inv_freq, out, ns, H,
        out.stride(0), out.stride(1), D=D, R=R, S_PAD=s_pad, BD=bd, HAS_SINKS=sinks is not None, PDL=pdl,
        num_warps=4, **pdl_launch(pdl))
    return out


def selection_pdl(device: torch.device) -> bool:
    """Whether a call behind its selection's producer (``after_selection``) launches the split kernel with PDL:
    ``SELECTION_PDL``, compiled (not the interpreter), an sm_90+ GPU and a Triton with grid dependency control."""
    return SELECTION_PDL and pdl_available(device)


def combine_pdl(device: torch.device) -> bool:
    """Whether the combine launches with PDL: ``COMBINE_PDL``, compiled (not the interpreter), an sm_90+ GPU and a
    Triton with grid dependency control."""
    return COMBINE_PDL and pdl_available(device)


def _check(q, kv, positions, rows, seq_lens, window, cache, block_table, selection, sinks, rope_inv_freq) -> None:
    """UserError naming the fix for arguments that do not fit together or that the kernels cannot take."""
    if q.dim() != 3:
        raise UserError(f"{NAME}: q has shape {tuple(q.shape)}; pass [M, H, D] (the q_b output viewed per head)")
    M, H, D = q.shape
    R = 2 * rope_inv_freq.shape[0]
    if tuple(kv.shape) != (M, D):
        raise UserError(f"{NAME}: kv has shape {tuple(kv.shape)}, needs [M={M}, D={D}] (the new token's row)")
    if any(tuple(t.shape) != (M,) for t in (positions, rows, seq_lens)):
        raise UserError(f"{NAME}: positions / rows / seq_lens need shape [M={M}]")
    if window.dim() != 3 or window.shape[2] != D or window.stride(-1) != 1:
        raise UserError(f"{NAME}: window has shape {tuple(window.shape)}, needs [rows, W, D={D}] with a unit last "
                        "stride (it is written in place)")
    lo, hi = _HEAD_DIMS
    if D < lo or D > hi or D & (D - 1):
        raise UserError(f"{NAME}: head_dim {D} is not a power of two in [{lo}, {hi}]; {FALLBACK} serves it")
    if R <= 0 or R > D or rope_inv_freq.dtype != torch.float32:
        raise UserError(f"{NAME}: rope_inv_freq must be fp32 with 2 len(rope_inv_freq) = {R} in [2, D={D}]")
    if sinks is not None and (tuple(sinks.shape) != (H,) or sinks.dtype != torch.float32 or not sinks.is_contiguous()):
        raise UserError(f"{NAME}: sinks must be contiguous fp32 [H={H}], got {tuple(sinks.shape)} {sinks.dtype}")
    if (selection is None) != (cache is None) or (selection is not None and block_table is None):
        raise UserError(f"{NAME}: pass cache, block_table and selection together (compressed layers) or none of "
                        "them (window-only layers)")
    if selection is not None:
        if selection.dim() != 2 or selection.shape[0] != M or selection.shape[1] < 1:
            raise UserError(f"{NAME}: selection has shape {tuple(selection.shape)}, needs [M={M}, topk >= 1]")
        if cache.dim() != 3 or cache.shape[2] != D or not cache.is_contiguous() or cache.dtype != window.dtype:
            raise UserError(f"{NAME}: cache must be contiguous paged [blocks, block_size, D={D}] in the ring's dtype "
                            f"{window.dtype}, got {tuple(cache.shape)} {cache.dtype}; {FALLBACK} serves others")
    for name, t in (("positions", positions), ("rows", rows), ("seq_lens", seq_lens), ("selection", selection),
                    ("block_table", block_table)):
        if t is not None and t.dtype not in (torch.int32, torch.int64):
            raise UserError(f"{NAME}: {name} is {t.dtype}; pass int32 or int64")


def sparse_mqa_compress_triton(c: torch.Tensor, pending: torch.Tensor | None, rows: torch.Tensor,
                               positions: torch.Tensor, norm_weight: torch.Tensor, rope_inv_freq: torch.Tensor,
                               cache: torch.Tensor, slots: torch.Tensor, *, eps: float, ratio: int,
                               out: torch.Tensor | None = None, cross_row_reads: bool = False) -> torch.Tensor:
    """A KV source's compressor in one launch (contract: ``ops.attention.sparse_mqa.sparse_mqa_compress_reference``):
    the token's ``[kv | gate]`` into ``pending`` at ``positions % ratio``, the softmax-gated pool of the group,
    the RMSNorm (``lat [M, D]``, returned), its RoPE into the paged ``cache`` at ``slots`` (< 0: nothing). One
    program per token; the pool reads the group's other rows from memory and this token's from registers.
    ``pending`` is a ring ``[rows, P >= ratio, 2D]`` (position p at p % P). ``cross_row_reads`` (verification
    steps: a row pools pending rows earlier rows of the call write): one launch writes every row first."""
    return _compress(c, pending, rows, positions, norm_weight, rope_inv_freq, cache, slots, None, eps=eps,
                     ratio=ratio, out=out, cross_row_reads=cross_row_reads)


def sparse_mqa_compress_index_triton(c: torch.Tensor, pending: torch.Tensor | None, rows: torch.Tensor,
                                     positions: torch.Tensor, norm_weight: torch.Tensor, rope_inv_freq: torch.Tensor,
                                     cache: torch.Tensor, slots: torch.Tensor, index_weight: torch.Tensor,
                                     index_norm_weight: torch.Tensor, index_cache: torch.Tensor, *, eps: float,
                                     ratio: int, index_eps: float, out: torch.Tensor | None = None,
                                     cross_row_reads: bool = False) -> torch.Tensor:
    """The compressor with the indexer's new key in the same launch (contract:
    ``ops.attention.sparse_mqa.sparse_mqa_compress_index_reference``): after the compressed-cache write, the program
    of a token that completes a row projects its ``lat`` by ``index_weight [Dk, D]`` (read whole by that one program:
    Dk x D elements), norms it and rotates its leading channels into ``index_cache`` at the same slot - the key
    gemm's launch and the indexer's key launch left out (call the indexer with ``k=None`` after it)."""
    Dk = index_weight.shape[0] if index_weight.dim() == 2 else -1
    if index_weight.dim() != 2 or index_weight.shape[1] != cache.shape[-1] or index_weight.stride(-1) != 1 \
            or tuple(index_norm_weight.shape) != (Dk,) or index_cache.shape[-1] != Dk \
            or not index_cache.is_contiguous() or Dk < 2 * rope_inv_freq.shape[0] or Dk & (Dk - 1) or Dk < 16:
        raise UserError(f"{COMPRESS_INDEX_NAME}: index_weight {tuple(index_weight.shape)} (unit last stride), "
                        f"index_norm_weight {tuple(index_norm_weight.shape)}, index_cache {tuple(index_cache.shape)} "
                        f"(contiguous) must be [Dk, D={cache.shape[-1]}], [Dk], [blocks, block_size, Dk] with Dk a "
                        f"power of two >= 16 and >= the {2 * rope_inv_freq.shape[0]} rotated channels; "
                        f"{COMPRESS_INDEX_FALLBACK} serves others")
    return _compress(c, pending, rows, positions, norm_weight, rope_inv_freq, cache, slots,
                     (index_weight, index_norm_weight.contiguous(), index_cache, float(index_eps)), eps=eps,
                     ratio=ratio, out=out, cross_row_reads=cross_row_reads)


def _compress(c: torch.Tensor, pending: torch.Tensor | None, rows: torch.Tensor, positions: torch.Tensor,
              norm_weight: torch.Tensor, rope_inv_freq: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
              index: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None, *, eps: float, ratio: int,
              out: torch.Tensor | None, cross_row_reads: bool) -> torch.Tensor:
    """The compressor's launch(es), with the indexer key's operands ``(weight, norm weight, cache, eps)`` or None."""
    M = c.shape[0]
    D = cache.shape[-1]
    if c.dim() != 2 or c.shape[1] != (2 * D if ratio > 1 else D) or (ratio > 1) != (pending is not None):
        raise UserError(f"{COMPRESS_NAME}: c {tuple(c.shape)} / pending "
                        f"{None if pending is None else tuple(pending.shape)} do not fit ratio {ratio} and D {D}")
    lo, hi = _HEAD_DIMS
    if D < lo or D > hi or D & (D - 1) or not cache.is_contiguous():
        raise UserError(f"{COMPRESS_NAME}: needs a contiguous cache of power-of-two width in [{lo}, {hi}], got "
                        f"{tuple(cache.shape)}; {COMPRESS_FALLBACK} serves it")
    if pending is not None and (pending.dim() != 3 or pending.shape[1] < ratio or pending.stride(-1) != 1):
        raise UserError(f"{COMPRESS_NAME}: pending has shape {tuple(pending.shape)}, needs a ring "
                        f"[rows, P >= {ratio}, {2 * D}] with a unit last stride")
    if out is None:
        out = torch.empty(M, D, device=c.device, dtype=c.dtype)
    if M == 0:
        return out
    c = _unit_last(c)
    pend = pending if pending is not None else c
    kernel = _kernels(_interpreting())["compress"]
    iw, inw, icache, ieps = index if index is not None else (norm_weight, norm_weight, cache, 0.0)  # unread if None
    dk = iw.shape[0] if index is not None else 2
    for write_only in ((True, False) if cross_row_reads and pending is not None else (False,)):
        kernel[(M,)](c, pend, rows, positions, norm_weight, rope_inv_freq, cache, slots, out, float(eps), c.stride(0),
                     pend.stride(0) if pending is not None else 0, pend.stride(1) if pending is not None else 0,
                     pend.shape[1] if pending is not None else 1, iw, inw, icache, ieps, iw.stride(0),
                     D=D, R=2 * rope_inv_freq.shape[0], RATIO=int(ratio), BR=max(2, _next_pow2(int(ratio))),
                     WRITE_ONLY=write_only, INDEX=index is not None, DK=dk,
                     BK=min(D, max(16, INDEX_KEY_TILE // max(dk // 2, 1))), num_warps=4 if D >= 256 else 1)
    return out


# ----------------------------------------------------------------------------------- support
def _supports(ctx: OpContext) -> Support:
    refusal = triton_gpu_refusal(ctx, "sparse MQA", min_sm=80)
    if refusal:
        return refusal
    try:
        D = ctx.dim("head_dim")
    except KeyError:  # a site without the dims: the call checks them and names the fix
        return True
    if why := head_dim_refusal(D, *_HEAD_DIMS):
        return f"{why}: {FALLBACK} serves it"
    try:
        rope = ctx.dim("rope")
    except KeyError:
        return True
    if rope <= 0 or rope % 2 or rope > D:
        return f"rope {rope} must be even and in [2, head_dim {D}]"
    if ctx.attr("rope_interleaved", True) is False:
        return "rotate-half RoPE: the kernels rotate interleaved pairs"
    return True


def _compress_supports(ctx: OpContext) -> Support:
    refusal = triton_gpu_refusal(ctx, "the sparse MQA compressor")
    if refusal:
        return refusal
    try:
        D = ctx.dim("head_dim")
    except KeyError:
        return True
    if why := head_dim_refusal(D, *_HEAD_DIMS):
        return f"{why}: {COMPRESS_FALLBACK} serves it"
    return True


def _compress_index_supports(ctx: OpContext) -> Support:
    if not COMPRESS_INDEX_KEY:
        return f"off (sparse_mqa_triton.COMPRESS_INDEX_KEY, an A/B switch): {COMPRESS_INDEX_FALLBACK}"
    if ctx.attr("weight_format"):
        return f"key projection stored {ctx.attr('weight_format')}: plain weights only; {COMPRESS_INDEX_FALLBACK}"
    refusal = _compress_supports(ctx)
    if refusal is not True:
        return refusal
    try:
        dk = ctx.dim("index_head_dim")
    except KeyError:
        return True
    if dk < 16 or dk & (dk - 1):
        return f"index head_dim {dk} is not a power of two >= 16: {COMPRESS_INDEX_FALLBACK}"
    return True


IMPLEMENTATIONS = [
    Implementation("attention.sparse_mqa", NAME, sparse_mqa_decode_triton, _supports, priority=10,
                   strided_rows=True,
                   description="Triton split + combine: q head norm, kv norm / RoPE, the ring write in the split "
                               "kernel (all heads per program), selected rows read in place through the block "
                               "table, sinks and inverse RoPE in the combine: no host sync; GPUs sm_80+, pow2 D"),
    Implementation("attention.sparse_mqa_compress", COMPRESS_NAME, sparse_mqa_compress_triton, _compress_supports,
                   priority=10, strided_rows=True,
                   description="Triton, one program per token: pending write, softmax-gated pool, RMSNorm, RoPE, "
                               "compressed-cache write in one launch; pow2 D"),
    Implementation("attention.sparse_mqa_compress_index", COMPRESS_INDEX_NAME, sparse_mqa_compress_index_triton,
                   _compress_index_supports, priority=10, strided_rows=True,
                   description="Triton, one program per token: the compressor's launch, then the indexer's new key "
                               "(key projection, RMSNorm, leading RoPE, key-cache write) in it; pow2 D and Dk"),
]

__all__ = ["COMBINE_PDL", "COMPRESS_INDEX_KEY", "COMPRESS_INDEX_NAME", "COMPRESS_NAME", "FALLBACK", "IMPLEMENTATIONS",
           "NAME", "SELECTION_PDL", "block_h", "block_n",
           "choose_splits", "combine_pdl", "selection_pdl", "sparse_mqa_compress_index_triton",
           "sparse_mqa_compress_triton", "sparse_mqa_decode_triton"]
