"""Row-wise top-k selection split over many programs per row: ``topk_select`` (two Triton launches).

``topk_select(scores [M, N] fp32, valid_lens [M], k)`` -> ``[M, k]`` int32 positions of the ``k`` largest
scores of each row among its candidates, ``-1`` past the number of candidates. A position ``j`` is a
candidate of row ``m`` when ``j < valid_lens[m]`` and ``scores[m, j] != -inf`` (so ``-inf`` marks a masked
entry, as the indexer's torch.topk path maps it). The selected *set* is deterministic: all candidates
above the k-th largest value ``T`` and, of those equal to ``T``, the lowest positions - the first ``k`` of a
stable descending sort (``topk_select_reference``). The order within a row is unspecified (atomic slots).
Values compare as torch compares them: ``-0.0`` ties ``+0.0``, every NaN is above ``+inf``.

Why two launches and not one program per row (``indexer_triton``'s radix select): at batch 1 one row is
all the work, and one program walking it pass after pass is latency-bound on one SM. Here a row is cut into
``S`` chunks (``choose_splits``: about ``WAVES`` programs per SM over the batch), and each chunk is read twice:

1. **histogram** kernel, grid ``(M, S)``: the top ``FIRST_BITS`` bits of each candidate's order-preserving
   int32 key (``tl.histogram`` over the chunk), added with atomics into the row's global histogram. The
   program that takes the row's last ticket (an atomic counter) reads and zeroes the histogram (atomic
   exchange) and finds the bin ``d1`` that holds the k-th largest key, and how many keys of it are needed;
   fewer than ``k`` candidates: every candidate is taken (``d1 = -1``);
2. **collect** kernel, grid ``(M, S)``: each program writes its candidates with a digit above ``d1``
   straight to the output (slots from an atomic counter per row), and appends those with digit ``d1``
   (key and position) to a per-row candidate buffer. The last program of the row (ticket again) finishes
   alone on that buffer, which holds only one histogram bin of the row: two more radix passes (the
   remaining ``32 - FIRST_BITS`` key bits) give ``T`` and the ties it needs, a radix select on the tied
   positions picks the lowest ones (only when not every tie is taken), a compaction writes them, and
   ``-1`` fills the rest.

The last programs reset every counter they used, so the workspace (``[M, 2^FIRST_BITS + 8]`` int32, zeroed
once, cached per device and row count; ``make_workspace`` for callers that keep their own) is zero again
after each call: CUDA-graph replays need no memset. Shapes are static (``S`` from ``M``, ``N`` and the SM
count; chunk lengths from ``valid_lens`` on the device), nothing reads the device from the host, so a call
captures into a CUDA graph. The candidate buffer (``[2, M, N]`` int32, ``torch.empty``) comes from the graph
pool under capture. One workspace must not serve two calls running at once on different streams.

Memory ordering across the programs of one launch: each program's atomics and buffer stores come before a
CTA barrier (``tl.debug_barrier``) and then its ticket atomic (acq_rel, GPU scope), the split-k semaphore
pattern; the last program reads the histogram and counters with atomics and the buffer with ``.cg`` loads.

Cost grows with the size of the threshold bin, which the last program walks alone: for continuous scores
it is a small fraction of a row; for heavily quantised scores (most of a row in one bin) that program walks
most of the row, like the one-program radix select - correct, not fast.
"""

from __future__ import annotations

import functools
import os

import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels.triton_common import cached_zeroed_int32

FIRST_BITS = 12
"""Key bits of the split histogram (pass 1; 11..15: every histogram a multiple of 32 bins, and 16 would
need 256 KB of shared memory); the last program resolves the other ``32 - FIRST_BITS``. More bits: a
smaller threshold bin for the last program to walk alone, a bigger histogram per program (``2^FIRST_BITS``
int32 of shared memory, zeroed and flushed by every program)."""
TILE = 1024
"""Scores per step of a chunk's loop (passes 1 and 2)."""
CAND_TILE = 2048
"""Candidates per step of the last program's passes over the threshold bin."""
MIN_CHUNK = 1024
"""Fewest scores a program takes (device side): each program pays a histogram's zeroing and flush."""
WAVES = 2
"""Target programs per SM (rows x splits ~ WAVES x SMs)."""
MAX_SPLITS = 256
WARPS = 8
_STATE = 8
"""int32 per row after the histogram: the tickets of the two launches, the output and buffer counters, the
threshold bin d1 and how many keys of it are needed (the rest unused)."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool) -> dict:
    """The jitted kernels, built on first use per ``TRITON_INTERPRET`` setting (see ``indexer_triton``)."""
    del interpret  # the cache key only
    global tl, _keys, _bin_pass, _low_pass
    import triton
    import triton.language as tl

    @triton.jit
    def _keys(x):
        # fp32 -> int32 with the same order (signed compare); -0.0 -> +0.0 and every NaN -> the largest key,
        # as torch orders values
        i = x.to(tl.int32, bitcast=True)
        key = tl.where(i < 0, i ^ 0x7FFFFFFF, i)
        key = tl.where(x == 0.0, 0, key)
        return tl.where(x != x, 0x7FFFFFFF, key)

    @triton.jit
    def _bin_pass(ckey, E, prefix, need, PSHIFT: tl.constexpr, DSHIFT: tl.constexpr, DBINS: tl.constexpr,
                  CT: tl.constexpr):
        # among the buffered keys with (key >> PSHIFT) == prefix: the digit (key >> DSHIFT) & (DBINS - 1) that
        # holds the need-th largest -> (prefix extended by it, keys of it still needed, keys of it)
        bins = tl.arange(0, DBINS)
        hist = tl.zeros([DBINS], dtype=tl.int32)
        for t0 in range(0, E, CT):
            offs = t0 + tl.arange(0, CT)
            ok = offs < E
            key = tl.load(ckey + offs, mask=ok, other=0, cache_modifier=".cg")
            hist += tl.histogram((key >> DSHIFT) & (DBINS - 1), DBINS, mask=ok & ((key >> PSHIFT) == prefix))
        gt = tl.sum(hist, 0) - tl.cumsum(hist, 0)
        hit = (gt < need) & (gt + hist >= need)
        d = tl.sum(tl.where(hit, bins, 0), 0)
        return (prefix * DBINS + d, need - tl.sum(tl.where(hit, gt, 0), 0),
                tl.sum(tl.where(hit, hist, 0), 0))

    @triton.jit
    def _low_pass(ckey, cidx, E, T, prefix, need, SHIFT: tl.constexpr, CT: tl.constexpr):
        # among the buffered positions with key == T and pos >> (SHIFT + 11) == prefix: the 11-bit digit
        # (pos >> SHIFT) that holds the need-th *smallest* -> (prefix extended, still needed)
        bins = tl.arange(0, 2048)
        hist = tl.zeros([2048], dtype=tl.int32)
        for t0 in range(0, E, CT):
            offs = t0 + tl.arange(0, CT)
            ok = offs < E
            key = tl.load(ckey + offs, mask=ok, other=0, cache_modifier=".cg")
            pos = tl.load(cidx + offs, mask=ok, other=0, cache_modifier=".cg")
            m = ok & (key == T) & (((pos >> SHIFT) >> 11) == prefix)   # two shifts: each below 32 bits
            hist += tl.histogram((pos >> SHIFT) & 2047, 2048, mask=m)
        lt = tl.cumsum(hist, 0) - hist
        hit = (lt < need) & (lt + hist >= need)
        d = tl.sum(tl.where(hit, bins, 0), 0)
        return prefix * 2048 + d, need - tl.sum(tl.where(hit, lt, 0), 0)

    @triton.jit
    def hist_kernel(scores, lens, ws, N, K, S, s_m, s_ws, TILE: tl.constexpr, MIN_CHUNK: tl.constexpr,
                    BINS: tl.constexpr, SHIFT: tl.constexpr):
        m = tl.program_id(0)
        c = tl.program_id(1)
        n = tl.maximum(tl.minimum(tl.load(lens + m).to(tl.int32), N), 0)
        row = scores + m.to(tl.int64) * s_m
        hrow = ws + m.to(tl.int64) * s_ws
        st = hrow + BINS
        # this program's chunk of the live scores, from the device-side length (the collect kernel agrees)
        chunk = tl.cdiv(tl.maximum(tl.cdiv(n, S), MIN_CHUNK), TILE) * TILE
        start = c * chunk
        end = tl.minimum(start + chunk, n)
        hist = tl.zeros([BINS], dtype=tl.int32)
        for t0 in range(start, end, TILE):
            offs = t0 + tl.arange(0, TILE)
            ok = offs < end
            x = tl.load(row + offs, mask=ok, other=float("-inf"))
            ok = ok & (x != float("-inf"))
            hist += tl.histogram((_keys(x) >> SHIFT) + BINS // 2, BINS, mask=ok)
        bins = tl.arange(0, BINS)
        tl.atomic_add(hrow + bins, hist, mask=hist > 0, sem="relaxed")
        tl.debug_barrier()   # every thread's histogram atomics before this program's ticket (release)
        ticket = tl.atomic_add(st + 0, 1, sem="acq_rel")
        if ticket == S - 1:  # the row's last program: every other one has added its histogram
            # read, and zero for the next call; relaxed: the ticket's acquire already ordered them after every add
            h = tl.atomic_xchg(hrow + bins, tl.zeros([BINS], dtype=tl.int32), sem="relaxed")
            total = tl.sum(h, 0)
            gt = total - tl.cumsum(h, 0)
            hit = (gt < K) & (gt + h >= K)
            d1 = tl.sum(tl.where(hit, bins, 0), 0)
            need = K - tl.sum(tl.where(hit, gt, 0), 0)
            take_all = total <= K
            tl.store(st + 4, tl.where(take_all, -1, d1))
            tl.store(st + 5, tl.where(take_all, 0, need))
            tl.atomic_xchg(st + 0, 0, sem="relaxed")

    @triton.jit
    def collect_kernel(scores, lens, ws, out, cand, N, K, S, s_m, s_ws, s_om, s_cm, plane,
                       TILE: tl.constexpr, MIN_CHUNK: tl.constexpr, BINS: tl.constexpr, SHIFT: tl.constexpr,
                       SHIFT2: tl.constexpr, IDX_PASSES: tl.constexpr, CT: tl.constexpr):
        m = tl.program_id(0)
        c = tl.program_id(1)
        n = tl.maximum(tl.minimum(tl.load(lens + m).to(tl.int32), N), 0)
        row = scores + m.to(tl.int64) * s_m
        st = ws + m.to(tl.int64) * s_ws + BINS
        orow = out + m.to(tl.int64) * s_om
        ckey = cand + m.to(tl.int64) * s_cm
        cidx = ckey + plane
        d1 = tl.load(st + 4)
        chunk = tl.cdiv(tl.maximum(tl.cdiv(n, S), MIN_CHUNK), TILE) * TILE
        start = c * chunk
        end = tl.minimum(start + chunk, n)
        for t0 in range(start, end, TILE):
            offs = t0 + tl.arange(0, TILE)
            ok = offs < end
            x = tl.load(row + offs, mask=ok, other=float("-inf"))
            ok = ok & (x != float("-inf"))
            key = _keys(x)
            dig = (key >> SHIFT) + BINS // 2
            gt = (ok & (dig > d1)).to(tl.int32)
            eq = (ok & (dig == d1)).to(tl.int32)
            b_gt = tl.atomic_add(st + 2, tl.sum(gt, 0), sem="relaxed")
            b_eq = tl.atomic_add(st + 3, tl.sum(eq, 0), sem="relaxed")
            tl.store(orow + b_gt + tl.cumsum(gt, 0) - 1, offs, mask=gt > 0)
            at = b_eq + tl.cumsum(eq, 0) - 1
            tl.store(ckey + at, key, mask=eq > 0)
            tl.store(cidx + at, offs, mask=eq > 0)
        tl.debug_barrier()   # every thread's output / buffer stores before this program's ticket (release)
        ticket = tl.atomic_add(st + 1, 1, sem="acq_rel")
        if ticket == S - 1:  # the row's last program: the threshold bin is all in the buffer
            n_out = tl.atomic_xchg(st + 2, 0, sem="relaxed")
            E = tl.atomic_xchg(st + 3, 0, sem="relaxed")
            need = tl.load(st + 5)
            # every other program of the row has read d1 (before its ticket): the whole state back to zero
            tl.store(st + 4, 0)
            tl.store(st + 5, 0)
            T = n_out * 0 - 2147483647 - 1     # below every candidate's key: take the whole buffer
            I = n_out * 0 + 2147483647         # ties: positions up to I
            if need < E:
                p2, need2, _ = _bin_pass(ckey, E, d1 - BINS // 2, need, SHIFT, SHIFT2, 1 << (SHIFT - SHIFT2), CT)
                T, ties, n_eq = _bin_pass(ckey, E, p2, need2, SHIFT2, 0, 1 << SHIFT2, CT)
                if ties < n_eq:  # not every key == T is taken: the lowest positions among them
                    ip = n_out * 0
                    r = ties
                    for p in tl.static_range(IDX_PASSES):
                        ip, r = _low_pass(ckey, cidx, E, T, ip, r, 11 * (IDX_PASSES - 1 - p), CT)
                    I = ip
            base = n_out
            for t0 in range(0, E, CT):
                offs = t0 + tl.arange(0, CT)
                ok = offs < E
                key = tl.load(ckey + offs, mask=ok, other=0, cache_modifier=".cg")
                pos = tl.load(cidx + offs, mask=ok, other=0, cache_modifier=".cg")
                take = (ok & ((key > T) | ((key == T) & (pos <= I)))).to(tl.int32)
                tl.store(orow + base + tl.cumsum(take, 0) - 1, pos, mask=take > 0)
                base += tl.sum(take, 0)
            for t0 in range(base, K, CT):   # fewer candidates than k: -1 for the rest
                offs = t0 + tl.arange(0, CT)
                tl.store(orow + offs, tl.full([CT], -1, tl.int32), mask=offs < K)
            tl.atomic_xchg(st + 1, 0, sem="relaxed")

    return dict(hist=hist_kernel, collect=collect_kernel)


def choose_splits(rows: int, n: int, sms: int) -> int:
    """Programs per row from static shapes: about ``WAVES`` programs per SM over the rows, no more than the
    row has ``MIN_CHUNK`` chunks (the device then cuts chunks by the live length)."""
    want = -(-WAVES * sms // max(rows, 1))
    return max(1, min(want, -(-n // MIN_CHUNK), MAX_SPLITS))


def make_workspace(rows: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed ``[rows, 2^FIRST_BITS + 8]`` int32 workspace; every call leaves it zeroed again."""
    return torch.zeros(rows, (1 << FIRST_BITS) + _STATE, device=device, dtype=torch.int32)


def _workspace(rows: int, device: torch.device) -> torch.Tensor:
    """``make_workspace(rows, device)``'s shape, zeroed once and cached per device and row count."""
    return cached_zeroed_int32("topk_select", (rows, (1 << FIRST_BITS) + _STATE), device)


def topk_select(scores: torch.Tensor, valid_lens: torch.Tensor, k: int, out: torch.Tensor | None = None, *,
                workspace: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """Positions of the ``k`` largest candidates of each row (module docstring: the rule, ties included).

    Parameters
    ----------
    scores : [M, N] fp32, unit last stride (rows may be strided).
    valid_lens : [M] int (int32 / int64): candidates are positions ``< valid_lens[m]`` (clamped to N) whose
        score is not -inf.
    k : the width. out : optional [M, k] int32, unit last stride.
    workspace : optional ``make_workspace(M, device)`` (zeroed; left zeroed); default one cached per device
        and M. splits : programs per row; default ``choose_splits`` (tests force it).

    Returns
    -------
    [M, k] int32: a set per row (any order), -1 past the candidate count. No host sync.
    """
    if scores.dim() != 2 or scores.dtype != torch.float32 or (scores.shape[1] > 1 and scores.stride(1) != 1):
        raise UserError(f"topk_select: scores must be [M, N] fp32 with a unit last stride (got "
                        f"{tuple(scores.shape)} {scores.dtype}, strides {scores.stride()})")
    M, N = scores.shape
    if k < 1:
        raise UserError(f"topk_select: k={k}; use a positive width")
    if tuple(valid_lens.shape) != (M,) or valid_lens.dtype not in (torch.int32, torch.int64):
        raise UserError(f"topk_select: valid_lens must be [M] = [{M}] int32/int64 (got {tuple(valid_lens.shape)} "
                        f"{valid_lens.dtype})")
    if out is None:
        out = torch.empty(M, k, device=scores.device, dtype=torch.int32)
    elif tuple(out.shape) != (M, k) or out.dtype != torch.int32 or out.stride(-1) != 1:
        raise UserError(f"topk_select: out must be [M, k] = [{M}, {k}] int32 with a unit last stride (got "
                        f"{tuple(out.shape)} {out.dtype}, strides {out.stride()})")
    if M == 0:
        return out
    if N == 0:
        return out.fill_(-1)
    if not 11 <= FIRST_BITS <= 15:
        raise UserError(f"topk_select: FIRST_BITS={FIRST_BITS}; use 11..15")
    width = (1 << FIRST_BITS) + _STATE
    if workspace is None:
        workspace = _workspace(M, scores.device)
    elif workspace.dtype != torch.int32 or workspace.shape[0] < M or workspace.shape[-1] != width \
            or not workspace.is_contiguous():
        raise UserError(f"topk_select: workspace must be a contiguous [>= {M}, {width}] int32 tensor from "
                        "make_workspace (zeroed)")
    if splits is None:
        splits = choose_splits(M, N, _sms(scores.device))
    S = max(1, min(int(splits), MAX_SPLITS))
    kern = _kernels(_interpreting())
    cand = torch.empty(2, M, N, device=scores.device, dtype=torch.int32)
    shift = 32 - FIRST_BITS
    shift2 = max(shift - 11, 0)
    idx_passes = max(1, -(-max(N - 1, 1).bit_length() // 11))
    common = dict(TILE=TILE, MIN_CHUNK=MIN_CHUNK, BINS=1 << FIRST_BITS, SHIFT=shift, num_warps=WARPS)
    kern["hist"][(M, S)](scores, valid_lens, workspace, N, k, S, scores.stride(0), workspace.stride(0), **common)
    kern["collect"][(M, S)](scores, valid_lens, workspace, out, cand, N, k, S, scores.stride(0),
                            workspace.stride(0), out.stride(0), cand.stride(1), cand.stride(0),
                            SHIFT2=shift2, IDX_PASSES=idx_passes, CT=CAND_TILE, **common)
    return out


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    from latency_specialized.hardware import sm_count

    return sm_count(device)


def topk_select_reference(scores: torch.Tensor, valid_lens: torch.Tensor, k: int) -> torch.Tensor:
    """The contract in torch: the first ``k`` of a stable descending sort of the candidates (lowest positions
    first among equal values), -1 past the candidate count. ``[M, k]`` int32, positions in that order."""
    M, N = scores.shape
    x = scores.float().masked_fill(torch.arange(N, device=scores.device)[None, :] >= valid_lens.long()[:, None],
                                   float("-inf"))
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    kk = min(k, N)
    sel = torch.where(vals[:, :kk] != float("-inf"), idx[:, :kk], -1).to(torch.int32)
    if kk < k:
        sel = torch.cat([sel, sel.new_full((M, k - kk), -1)], dim=1)
    return sel


__all__ = ["FIRST_BITS", "choose_splits", "make_workspace", "topk_select", "topk_select_reference"]
