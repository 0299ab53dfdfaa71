"""``residual.mhc.triton``: one mHC seam in one launch - contract ``ops.residual_mhc.mhc_seam_reference``.

Grid ``(S, RB)``: ``S = cdiv(H, CH)`` channel chunks times ``RB = cdiv(M, TM)`` row blocks. Program
``(c, rb)`` owns channels ``[c CH, (c + 1) CH)`` of every stream for the ``TM`` rows of block ``rb``:

1. loads its ``[2n + n^2, n, CH]`` slice of the fp32 projection ``fn`` first (the seam's dominant bytes at
   small M, read by ``S`` programs at once instead of by a few);
2. folds the previous sublayer in (``R'_j = sum_i comb[i, j] R_i + post_j y``, fp32, one rounding) and
   stores its channels of the streams in place (only this program reads or writes them);
3. collapses with the *carried* pre-mix (known before the seam starts, so no wait for the new
   coefficients): ``h = sum_i pre_i R'_i`` rounded to the streams' dtype, stored into ``out`` as is;
4. writes a partial record per row: the ``X = 2n + n^2`` partial projections ``R' . fn^T`` over its
   channels, then ``sum h^2`` and ``sum R'^2`` (fp32, workspace ``[M, S, PW]``, ``PW = pow2(X + 2)``: one
   128-byte line at n = 4, so that the tail reads whole records in one coalesced tile per step).

Then it arrives on its row block's counter (``atomic_add``, acq_rel, GPU scope, after a CTA barrier so
that every thread's stores come before the arrival). The arrivals on one counter form a chain of
read-modify-writes, each acquiring the releases before it, so the ``S``-th arriver sees every record and
every ``h`` of its row block. It alone does the row block's tail: sums the records in chunk order
(``[TM, BS, PW]`` tiles, deterministic, no float atomics), rescales its rows of ``out`` by
``rsqrt(mean h^2 + eps) * weight`` (the norm family's rounding: one rounding of ``h``, one of ``x``),
computes pre / post sigmoids and the Sinkhorn matrix in registers (``[TM, n, n]``), and resets the
counter to 0 for the next launch (graph replays included: a launch starts only after the previous one on
the stream has ended). The records and ``h`` are read with ``.cg`` (from L2; an L1 line of this SM cannot
be stale).

The counters are one persistent int32 buffer per device, zeroed once when allocated (``prepare`` or the
first eager call; never inside a graph capture, which would leave the zeroing to the replay). Seams run
in stream order; two seams running concurrently on two streams would share row-block counters and are not
supported. The partial records are ``torch.empty`` per call (from the graph pool under capture, as the
MLA split workspaces). No host sync. Triton is imported on the first call. Design: ``NOTES_mhc.md``.
"""

from __future__ import annotations

import functools
import os

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.kernels.triton_common import (cached_zeroed_int32, pdl_available, pdl_launch,
                                                       triton_gpu_refusal)

NAME = "residual.mhc.triton"
MAX_ROW_BLOCKS = 8192
"""Row-block counters per device (int32, 32 KiB): bounds M by ``MAX_ROW_BLOCKS x TM``."""
MAX_TOKENS = 8192
"""Largest M served (``supports``): at TM >= 1 every row block has its counter."""
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
RECORD_TILE = 8192
"""Record floats (rows x chunks x record width) the tail loads per step: 256 records of 32 at TM = 1 (one step
for H = 5120's 80 chunks of 64), 64 chunks a step at TM = 4; the last seam's 1-float records: one step."""
OUT_TILE = 4096
"""Elements of ``out`` (rows x channels) the tail rescales per step: two steps for a DeepSeek row at TM = 1,
five at TM = 4. Twice that holds more registers than the body needs (``NOTES_mhc.md``)."""

PDL = False
"""Launch the seam with programmatic dependent launch (sm_90+, compiled; ``pdl_enabled``): its programs may start
while the previous kernel drains, load their fn slice (a weight: the seam's dominant bytes at small M) and wait
(``gdc_wait``) before reading anything an earlier kernel wrote - streams, y, the coefficients, the counters - or
writing anything. Off until a layer A/B says otherwise (``NOTES_mhc.md``): early programs can hold SM room that the
previous kernel's last wave needs, as the MLA kernels' did (``mla_decode_triton.PDL``)."""

OUT_LOAD_FIRST = True
"""At one row (M = 1) of 2-byte channels, at most ``OUT_ROW_TILE`` of them, the tail loads the whole row of ``out``
(and the norm gain) right after the records' sums and rescales it after the coefficients: the rescale's L2 round
trips overlap the Sinkhorn rounds instead of following them in two steps. The held row costs registers (counts in
``NOTES_mhc.md``), so only where the grid is one program per SM anyway. On since session 42 (layer A/B in
``NOTES_mhc.md``, session 41)."""
OUT_ROW_TILE = 8192
"""Most channels of the one-tile rescale (``OUT_LOAD_FIRST``): 64 per thread at 4 warps."""

def out_load_first(M: int, tm: int, H: int, elsize: int) -> bool:
    """Whether a launch rescales ``out`` in one tile loaded before the coefficients (``OUT_LOAD_FIRST``)."""
    return OUT_LOAD_FIRST and M == 1 and tm == 1 and elsize == 2 and _pow2(H) <= OUT_ROW_TILE


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    del interpret  # one build per TRITON_INTERPRET setting
    global tl, tlc
    import triton
    import triton.language as tl
    import triton.language.extra.cuda as tlc

    @triton.jit
    def mhc_seam_kernel(st, y, s_y, post_in, comb_in, pre_in, fn, scale, base, w, out, s_o,
                        pre_out, post_out, comb_out, part, count, M, H, S,
                        rms_eps, hc_eps, post_mult, norm_eps, iters,
                        N: tl.constexpr, CH: tl.constexpr, TM: tl.constexpr, X: tl.constexpr, PW: tl.constexpr,
                        BS: tl.constexpr, BH: tl.constexpr, HAS_Y: tl.constexpr, HAS_PRE: tl.constexpr,
                        HAS_FN: tl.constexpr, HAS_W: tl.constexpr, PDL: tl.constexpr, OUT_FIRST: tl.constexpr):
        c = tl.program_id(0)
        rb = tl.program_id(1)
        i = tl.arange(0, N)
        m = (rb * TM + tl.arange(0, TM)).to(tl.int64)
        mm = m < M
        h = c * CH + tl.arange(0, CH)
        hm = h < H
        # the projection slice first: it depends on nothing, and a load after the streams' store could
        # not be hoisted above it (the compiler cannot tell the two buffers apart)
        if HAS_FN:
            k = tl.arange(0, N * CH)                      # flattened (stream, channel) of the chunk
            kcol = (k // CH) * H + c * CH + k % CH        # column of fn
            kmask = (c * CH + k % CH) < H
            xa = tl.arange(0, 2 * N)
            xb = tl.arange(0, N * N)
            fa = tl.load(fn + xa[:, None].to(tl.int64) * (N * H) + kcol[None, :], mask=kmask[None, :], other=0.0)
            fb = tl.load(fn + (2 * N + xb[:, None]).to(tl.int64) * (N * H) + kcol[None, :], mask=kmask[None, :],
                         other=0.0)
        if PDL:  # launched early (PDL): fn is a weight; everything below comes from earlier kernels
            tlc.gdc_wait()
        offs = m[:, None, None] * (N * H) + i[None, :, None] * H + h[None, None, :]          # [TM, N, CH]
        msk = mm[:, None, None] & hm[None, None, :]
        r = tl.load(st + offs, mask=msk, other=0.0).to(tl.float32)
        if HAS_Y:
            cm = tl.load(comb_in + m[:, None, None] * (N * N) + i[None, :, None] * N + i[None, None, :],
                         mask=mm[:, None, None], other=0.0)                                 # [TM, N(i), N(j)]
            rn = tl.sum(cm[:, :, :, None] * r[:, :, None, :], axis=1)                       # [TM, N(j), CH]
            yv = tl.load(y + m[:, None] * s_y + h[None, :], mask=mm[:, None] & hm[None, :], other=0.0)
            pv = tl.load(post_in + m[:, None] * N + i[None, :], mask=mm[:, None], other=0.0)
            rn = rn + pv[:, :, None] * yv.to(tl.float32)[:, None, :]
            rs_ = rn.to(st.dtype.element_ty)
            tl.store(st + offs, rs_, mask=msk)
            r = rs_.to(tl.float32)            # what the projection and the collapse read: the stored streams
        if HAS_PRE:
            pin = tl.load(pre_in + m[:, None] * N + i[None, :], mask=mm[:, None], other=0.0)
            hv = tl.sum(pin[:, :, None] * r, axis=1)                                        # [TM, CH]
        else:  # the first seam: stream 0
            hv = tl.sum(tl.where(i[None, :, None] == 0, r, 0.0), axis=1)
        hv = hv.to(out.dtype.element_ty)
        tl.store(out + m[:, None] * s_o + h[None, :], hv, mask=mm[:, None] & hm[None, :])
        hf = hv.to(tl.float32)
        # the row's record: columns [0, X) the partial projections, X sum h^2, X + 1 sum R'^2, padded to
        # PW (one 128-byte line at n = 4) so that the tail reads whole records in one coalesced load
        rec = part + (m * S + c) * PW                                                       # [TM] records
        tl.store(rec + X, tl.sum(hf * hf, axis=1), mask=mm)
        if HAS_FN:
            tl.store(rec + X + 1, tl.sum(tl.sum(r * r, axis=2), axis=1), mask=mm)
            rk = tl.reshape(r, [TM, N * CH])
            mix_a = tl.sum(rk[:, None, :] * fa[None, :, :], axis=2)                         # [TM, 2N]
            mix_b = tl.sum(rk[:, None, :] * fb[None, :, :], axis=2)                         # [TM, N*N]
            tl.store(rec[:, None] + xa[None, :], mix_a, mask=mm[:, None])
            tl.store(rec[:, None] + 2 * N + xb[None, :], mix_b, mask=mm[:, None])

        # every thread's stores before the arrival; acq_rel at GPU scope: the last arriver sees them all
        tl.debug_barrier()
        done = tl.atomic_add(count + rb, 1, sem="acq_rel", scope="gpu")
        if done == S - 1:
            sj = tl.arange(0, BS)
            col = tl.arange(0, PW)
            cij = i[:, None] * N + i[None, :]
            if HAS_FN:   # the coefficients' scales and biases, read with the records: not after the reductions
                sc0 = tl.load(scale)
                sc1 = tl.load(scale + 1)
                sc2 = tl.load(scale + 2)
                b_pre = tl.load(base + i)
                b_post = tl.load(base + N + i)
                b_comb = tl.load(base + 2 * N + cij)
            acc = tl.zeros([TM, PW], dtype=tl.float32)
            for s0 in range(0, S, BS):   # records in chunk order: the same sums on every run
                ss = s0 + sj
                ms = mm[:, None, None] & (ss < S)[None, :, None] & (col < X + 2)[None, None, :]
                recs = part + (m[:, None, None] * S + ss[None, :, None]) * PW + col[None, None, :]  # [TM, BS, PW]
                acc += tl.sum(tl.load(recs, mask=ms, other=0.0, cache_modifier=".cg"), axis=1)
            hsq = tl.sum(tl.where(col[None, :] == X, acc, 0.0), axis=1)
            if HAS_FN:
                sq = tl.sum(tl.where(col[None, :] == X + 1, acc, 0.0), axis=1)
                a3 = acc[:, None, :]
                pre_l = tl.sum(tl.where(col[None, None, :] == i[None, :, None], a3, 0.0), axis=2)       # [TM, N]
                post_l = tl.sum(tl.where(col[None, None, :] == N + i[None, :, None], a3, 0.0), axis=2)
                cij3 = 2 * N + i[:, None, None] * N + i[None, :, None]                                # [N, N, 1]
                comb_l = tl.sum(tl.where(col[None, None, None, :] == cij3[None, :, :, :], acc[:, None, None, :],
                                         0.0), axis=3)                                                 # [TM, N, N]
            # the collapse's RMSNorm: h as stored, one rounding of x
            rstd = tl.rsqrt(hsq / H + norm_eps)
            hb = tl.arange(0, BH)
            if OUT_FIRST:  # the row in one tile, loaded now: the loads are in flight across the coefficients' math
                hk1 = hb < H
                optr1 = out + m[:, None] * s_o + hb[None, :]
                om1 = mm[:, None] & hk1[None, :]
                xo = tl.load(optr1, mask=om1, other=0.0, cache_modifier=".cg")
                if HAS_W:
                    wv = tl.load(w + hb, mask=hk1, other=0.0)
            else:
                for h0 in range(0, H, BH):
                    hh = h0 + hb
                    hk = hh < H
                    optr = out + m[:, None] * s_o + hh[None, :]
                    om = mm[:, None] & hk[None, :]
                    xn = tl.load(optr, mask=om, other=0.0, cache_modifier=".cg").to(tl.float32) * rstd[:, None]
                    if HAS_W:
                        xn = xn * tl.load(w + hh, mask=hk, other=0.0).to(tl.float32)[None, :]
                    tl.store(optr, xn.to(out.dtype.element_ty), mask=om)
            if HAS_FN:
                rs = tl.rsqrt(sq / (N * H) + rms_eps)
                zp = pre_l * rs[:, None] * sc0 + b_pre[None, :]
                zq = post_l * rs[:, None] * sc1 + b_post[None, :]
                pm = mm[:, None]
                tl.store(pre_out + m[:, None] * N + i[None, :], 1.0 / (1.0 + tl.exp(-zp)) + hc_eps, mask=pm)
                tl.store(post_out + m[:, None] * N + i[None, :], post_mult / (1.0 + tl.exp(-zq)), mask=pm)
                z = comb_l * rs[:, None, None] * sc2 + b_comb[None, :, :]
                e = tl.exp(z - tl.max(z, axis=2)[:, :, None])
                cmx = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
                cmx = cmx / (tl.sum(cmx, axis=1)[:, None, :] + hc_eps)
                for _ in range(iters - 1):
                    cmx = cmx / (tl.sum(cmx, axis=2)[:, :, None] + hc_eps)
                    cmx = cmx / (tl.sum(cmx, axis=1)[:, None, :] + hc_eps)
                tl.store(comb_out + m[:, None, None] * (N * N) + cij[None, :, :], cmx, mask=mm[:, None, None])
            if OUT_FIRST:
                xn1 = xo.to(tl.float32) * rstd[:, None]
                if HAS_W:
                    xn1 = xn1 * wv.to(tl.float32)[None, :]
                tl.store(optr1, xn1.to(out.dtype.element_ty), mask=om1)
            # every other program of the row block has arrived: nobody else touches the counter this launch
            tl.store(count + rb, 0)

    return mhc_seam_kernel


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def pdl_enabled(device: torch.device) -> bool:
    """Whether the seam launches with PDL: ``PDL``, compiled (not the interpreter), an sm_90+ GPU and a Triton with
    grid dependency control."""
    return PDL and pdl_available(device)


def choose_blocks(M: int, H: int) -> tuple[int, int, int]:
    """``(TM, CH, num_warps)`` from static shapes (graph-safe); the one place with the shape rule.

    64-channel chunks (H = 5120: 80 programs per row block, each reading 24 KiB of fn), 4 warps; one row per
    program below 16 rows (every row its own block: its own tail, run in parallel with the others', each block
    reading fn again from L2), 4 rows from 16 (fewer fn re-reads, four rows per tail). Chosen from a sweep of
    every (TM, CH, warps) of ``mhc_bench.py`` at M = 1-64; the figures and the rule it replaced: ``NOTES_mhc.md``
    (session 40)."""
    tm = 1 if M < 16 else 4
    ch = min(64, _pow2(H))
    return tm, ch, 4


def counter(device: torch.device) -> torch.Tensor:
    """The row-block counters of ``device`` (zeroed once; each launch leaves them at 0)."""
    return cached_zeroed_int32(NAME, (MAX_ROW_BLOCKS,), device, refuse_in_capture=(
        "its counters are allocated outside a CUDA-graph capture; call the implementation's prepare() (or one eager "
        "seam) before capturing"))


def _prepare(ctx: OpContext) -> None:
    del ctx
    if torch.cuda.is_available():
        counter(torch.device("cuda", torch.cuda.current_device()))


def _f32(t: torch.Tensor | None, what: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    if tuple(t.shape) != shape:
        raise UserError(f"{NAME}: {what} has shape {tuple(t.shape)}, need {list(shape)}")
    if t.device != device:
        raise UserError(f"{NAME}: {what} is on {t.device}, the streams on {device}")
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def mhc_seam_triton(streams: torch.Tensor, fn: torch.Tensor | None, scale: torch.Tensor | None,
                    base: torch.Tensor | None, norm_weight: torch.Tensor | None, norm_eps: float, *,
                    pre: torch.Tensor | None = None, y: torch.Tensor | None = None,
                    post: torch.Tensor | None = None, comb: torch.Tensor | None = None,
                    rms_eps: float = 1e-6, hc_eps: float = 1e-6, post_mult: float = 2.0,
                    sinkhorn_iters: int = 20, out: torch.Tensor | None = None,
                    block_m: int | None = None, block_h: int | None = None, num_warps: int | None = None):
    """One mHC seam in one launch (see ``ops/residual_mhc.py`` for the four steps).

    Parameters
    ----------
    streams : [M, n, H] contiguous (bf16 / fp16 / fp32, n a power of two), updated in place by the post.
    fn : [(2 + n) n, n H] fp32 contiguous, or None (last seam); scale [3], base [(2 + n) n] fp32.
    norm_weight : [H] or None; norm_eps.
    pre : [M, n] carried pre-mix (None: stream 0); y : [M, H] (unit column stride) with post [M, n] and
        comb [M, n, n], or None (first seam). Coefficients not fp32 are converted (one copy each).
    out : optional [M, H] in streams.dtype, unit column stride.
    block_m, block_h, num_warps : rows per program, channels per chunk (powers of two), warps; default
        ``choose_blocks``. For sweeps.

    Returns
    -------
    (x [M, H], next_pre [M, n], post [M, n], comb [M, n, n]) - the coefficients fp32, None without ``fn``.
    No host sync: CUDA-graph capturable (after ``prepare`` or one eager call allocated the counters).
    """
    import triton

    if streams.dim() != 3 or not streams.is_contiguous():
        raise UserError(f"{NAME}: streams must be a contiguous [M, n, H] tensor, got {tuple(streams.shape)}")
    if streams.dtype not in ACT_DTYPES:
        raise UserError(f"{NAME}: streams dtype {streams.dtype}: bf16 / fp16 / fp32 (the reference serves others)")
    M, n, H = streams.shape
    if n < 1 or n & (n - 1):
        raise UserError(f"{NAME}: {n} streams: a power of two (tile widths); residual.mhc.reference serves it")
    dev = streams.device
    X = (2 + n) * n
    if fn is not None:
        if scale is None or base is None:
            raise UserError(f"{NAME}: a seam with fn needs its scale [3] and base too")
        if tuple(fn.shape) != (X, n * H) or fn.dtype != torch.float32 or not fn.is_contiguous():
            raise UserError(f"{NAME}: fn must be contiguous fp32 [{X}, {n * H}], got {tuple(fn.shape)} {fn.dtype}")
        if sinkhorn_iters < 1:
            raise UserError(f"residual.mhc: sinkhorn_iters={sinkhorn_iters}; use at least 1")
        scale = _f32(scale, "scale", (3,), dev)
        base = _f32(base, "base", (X,), dev)
    pre = _f32(pre, "carried pre-mix", (M, n), dev)
    if y is not None:
        if tuple(y.shape) != (M, H) or y.stride(1) != 1:
            raise UserError(f"{NAME}: sublayer output must be [{M}, {H}] with unit column stride, got "
                            f"{tuple(y.shape)} strides {y.stride()}")
        if post is None or comb is None:
            raise UserError("residual.mhc: a seam after a sublayer needs that sublayer's post [M, n] and comb "
                            "[M, n, n] (returned by the seam in front of it)")
        post = _f32(post, "post", (M, n), dev)
        comb = _f32(comb, "comb", (M, n, n), dev)
    if norm_weight is not None and (tuple(norm_weight.shape) != (H,) or not norm_weight.is_contiguous()):
        raise UserError(f"{NAME}: norm weight must be contiguous [{H}], got {tuple(norm_weight.shape)}")
    if out is None:
        out = torch.empty(M, H, dtype=streams.dtype, device=dev)
    elif tuple(out.shape) != (M, H) or out.dtype != streams.dtype or out.stride(1) != 1:
        raise UserError(f"{NAME}: out must be [{M}, {H}] {streams.dtype} with unit column stride, got "
                        f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if fn is not None:
        next_pre = torch.empty(M, n, dtype=torch.float32, device=dev)
        new_post = torch.empty(M, n, dtype=torch.float32, device=dev)
        new_comb = torch.empty(M, n, n, dtype=torch.float32, device=dev)
    else:
        next_pre = new_post = new_comb = None
    if M == 0:
        return out, next_pre, new_post, new_comb
    tm, ch, nw = choose_blocks(M, H)
    tm, ch, nw = block_m or tm, block_h or ch, num_warps or nw
    if tm & (tm - 1) or ch & (ch - 1):
        raise UserError(f"{NAME}: block_m={tm} / block_h={ch}: powers of two")
    S, RB = triton.cdiv(H, ch), triton.cdiv(M, tm)
    if RB > MAX_ROW_BLOCKS:
        raise UserError(f"{NAME}: {RB} row blocks > {MAX_ROW_BLOCKS} counters (M={M}); the reference serves it")
    xk = X if fn is not None else 0
    pw = _pow2(xk + 2) if fn is not None else 1   # a record per row and chunk: 32 floats at n = 4
    part = torch.empty(M * S * pw, dtype=torch.float32, device=dev)
    cnt = counter(dev)
    bs = min(_pow2(S), max(1, RECORD_TILE // (tm * pw)))
    out_first = out_load_first(M, tm, H, out.element_size())
    bh = _pow2(H) if out_first else min(_pow2(H), max(16, OUT_TILE // tm))
    dummy = part
    pdl = pdl_enabled(dev)
    _kernel(_interpreting())[(S, RB)](
        streams, y if y is not None else streams, y.stride(0) if y is not None else 0,
        post if post is not None else dummy, comb if comb is not None else dummy, pre if pre is not None else dummy,
        fn if fn is not None else dummy, scale if fn is not None else dummy, base if fn is not None else dummy,
        norm_weight if norm_weight is not None else streams, out, out.stride(0),
        next_pre if fn is not None else dummy, new_post if fn is not None else dummy,
        new_comb if fn is not None else dummy, part, cnt, M, H, S,
        float(rms_eps), float(hc_eps), float(post_mult), float(norm_eps), int(sinkhorn_iters),
        N=n, CH=ch, TM=tm, X=xk, PW=pw, BS=bs, BH=bh, HAS_Y=y is not None, HAS_PRE=pre is not None,
        HAS_FN=fn is not None, HAS_W=norm_weight is not None, PDL=pdl,
        OUT_FIRST=out_first, num_warps=nw,
        **pdl_launch(pdl))
    return out, next_pre, new_post, new_comb


def _supports(ctx: OpContext) -> Support:
    refusal = triton_gpu_refusal(ctx, "the seam")
    if refusal:
        return refusal
    try:
        n = ctx.dim("streams")
    except KeyError:  # a site without the dim: the call checks it and names the fix
        n = None
    if n is not None and (n < 1 or n & (n - 1)):
        return f"streams={n}: not a power of two (the kernel's tile widths)"
    if ctx.tokens > MAX_TOKENS:
        return f"M={ctx.tokens} > {MAX_TOKENS} rows (its row-block counters)"
    if ctx.attr("mix", True):
        try:
            iters = ctx.dim("iters")
        except KeyError:
            iters = None
        if iters is not None and iters < 1:
            return f"sinkhorn iters={iters}: a seam with a projection needs at least 1"
    return True


IMPLEMENTATIONS = [
    Implementation("residual.mhc", NAME, mhc_seam_triton, _supports, priority=10, prepare=_prepare,
                   description="Triton mHC seam in one launch: post fold-in, fn split over channel chunks, the "
                               "last program per row block sums the partials, Sinkhorn, carried-pre collapse + "
                               "RMSNorm (no host sync)"),
]

__all__ = ["IMPLEMENTATIONS", "MAX_TOKENS", "NAME", "PDL", "choose_blocks", "counter", "mhc_seam_triton", "pdl_enabled"]
