"""gemm.cutedsl_small_m: y[M, N] = x[M, K] @ W[N, K]^T (+ residual) for M <= 16 on tensor cores.

``mma.sync.m16n8k16`` with the *weights as the A operand* (16 output rows per warp tile) and the
tokens as B (8 per n-tile), so a decode batch of 1-16 wastes nothing on the weight side. Both
fragments are loaded straight from global memory into registers, with no shared-memory staging,
by permuting K - legal because a dot product does not care in which order K is summed:

    mma's thread (g = lane/4, t = lane%4) holds A[g][2t, 2t+1, 2t+8, 2t+9], A[g+8][same]
    and B[2t, 2t+1, 2t+8, 2t+9][g]. Map those 4 logical k of one mma, and the 4 of the next,
    onto the 8 *contiguous* physical k = 32c + 8t .. 32c + 8t + 7 of a 32-wide K chunk c.

So each thread issues one 16-byte load per weight row (rows g and g+8) and one per token row for
every 32 columns of K, feeds two mma's, and the weight stream is exactly the GEMV's. K is split
over the ``wk`` warps of a CTA (and, in gemm_splitk.py, over the ``sk`` CTAs of a cluster);
partial tiles are summed through shared memory (DSMEM across the cluster) in a fixed order, so
results are deterministic. Rows past N and tokens past M are masked, never written.

Anatomy: config -> kernel class (built on first use; cutlass imported lazily) -> cached compile
(static K and config; M and N dynamic) -> public wrapper with ``residual=``/``out=``.
"""

import functools
import math
from dataclasses import asdict, dataclass

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.kernels import compile_cache
from latency_specialized.kernels.gemm_common import (check_gemm_args, fp32_output, grid_cap, max_regs, mma_supports,
                                                     refuse_fp32_residual)
from latency_specialized.kernels.mma_quant_weights import QuantCoding

NAME = "gemm.cutedsl_small_m"
MAX_M = 16
TARGET_WARPS = 132 * 16  # enough independent 16-byte load streams to cover HBM latency on an H200


@dataclass(frozen=True)
class MmaConfig:
    """Static choices of the tensor-core kernel (hashable: part of the compile key)."""

    nt: int = 1
    """n-tiles of 8 tokens: the kernel serves M <= 8 * nt."""
    mt: int = 1
    """m-tiles of 16 weight rows per warp (2 halves the activation re-reads at large M)."""
    wk: int = 4
    """Warps per CTA, each on its own share of K."""
    sk: int = 1
    """CTAs per cluster along K (split-K across SMs, reduced through DSMEM); 1 = no cluster."""
    cb: int = 4
    """K chunks (32 bf16 / 64 e4m3 values: 64 bytes of a weight row) a warp requests before multiplying (2*mt
    weight loads of 16 B each)."""
    pdl: bool = True
    """Programmatic dependent launch: weight loads start before the previous kernel ends."""
    ctas_per_sm: int = 0
    """0: one CTA (cluster) per tile. k > 0: persistent - at most k CTAs per SM walk the tiles, with
    registers capped so 2k fit: room for the next kernel's PDL prologue."""

    prefetch: bool = True
    """The first batch of weight loads (before the PDL wait) through the coherent path: ptxas hoists the wait above
    non-coherent loads, so with them the weights are requested only once the previous kernel is done (offline SASS,
    ``tests/ops/test_pdl_load_order.py``). On by default since the H200 timed both (``NOTES.md``, session 35); only
    weights - constant over the step - are read before the wait."""

    lookahead: int = 0
    """L > 0: batches 0..L requested before the PDL wait, then batch j + L just before batch j is multiplied, all
    through the coherent path and each behind a ``griddepcontrol.wait`` that returns at once - a fence: without it
    ptxas sinks the later batches' loads into the math (offline SASS: one or two loads in flight after the first
    batch). L + 1 batches of registers. The experts' route-summing stage (``moe_experts_mma``'s down_sum) counts
    in routes instead: a warp's routes r + 1 .. r + L requested before route r's math."""

    fp8_pairs: str = "bytes"
    """FP8 weights only: how a lane's e4m3 words decode into bf16 pairs. "bytes": pairs of adjacent codes (two byte
    permutes per word); "split": codes 0, 2 | 1, 3 of each word (no permutes: fewer integer instructions per weight)
    with the activations permuted to match (2 permutes per word pair and n-tile)."""

    def label(self) -> str:
        cap = f"g{self.ctas_per_sm}" if self.ctas_per_sm else ""
        pairs = "x" if self.fp8_pairs == "split" else ""
        pre = "f" if self.prefetch else ""
        ahead = f"a{self.lookahead}" if self.lookahead else ""
        return (f"n{self.nt}m{self.mt}w{self.wk}s{self.sk}c{self.cb}{ahead}{cap}{pairs}{pre}"
                f"{'p' if self.pdl else ''}")

    def smem_bytes(self) -> int:
        """Shared memory of the cross-warp reduction (f32 [wk][4*mt*nt][32]); 0 without one."""
        return 0 if self.wk * self.sk == 1 else self.wk * 4 * self.mt * self.nt * 32 * 4


SMEM_LIMIT = 48 * 1024  # stay under the default dynamic shared-memory limit (no opt-in attribute)


@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    from latency_specialized.kernels.gemm_common import ptx

    P = ptx()

    class MmaGemmKernel:
        def __init__(self, k: int, cfg: MmaConfig, residual: bool, coding: QuantCoding | None = None):
            self.k, self.cfg, self.residual = k, cfg, residual
            self.coding = coding                              # None: bf16 weights; else codes + block scales
            self.kc = coding.chunk if coding is not None else 32  # K per chunk: one 16-byte load per row and lane
            self.split_pairs = coding is not None and cfg.fp8_pairs == "split"
            self.chunks = k // self.kc
            self.parts = cfg.wk * cfg.sk
            self.per_part = -(-self.chunks // self.parts)    # chunks each warp walks
            self.ragged = self.chunks % self.parts != 0       # last round has idle warps
            self.frag = 4 * cfg.mt * cfg.nt                   # f32 accumulators per thread

        @cute.jit
        def __call__(self, x: cute.Tensor, w: cute.Tensor, res: cute.Tensor, y: cute.Tensor, scl: cute.Tensor,
                     cap: Int32, stream):
            n = w.shape[0]
            m = x.shape[0]
            rows = 16 * self.cfg.mt
            tiles = (n + rows - 1) // rows
            grid = [cutlass.min(tiles, cap), self.cfg.sk, 1]
            if cutlass.const_expr(self.cfg.sk > 1):
                self.kernel(x, w, res, y, scl, n, m, tiles).launch(grid=grid, block=[32 * self.cfg.wk, 1, 1],
                                                                 cluster=[1, self.cfg.sk, 1], stream=stream,
                                                                 use_pdl=self.cfg.pdl)
            else:
                self.kernel(x, w, res, y, scl, n, m, tiles).launch(grid=grid, block=[32 * self.cfg.wk, 1, 1],
                                                                 stream=stream, use_pdl=self.cfg.pdl)

        @cute.kernel
        def kernel(self, x: cute.Tensor, w: cute.Tensor, res: cute.Tensor, y: cute.Tensor, scl: cute.Tensor, n: Int32,
                   m: Int32, tiles: Int32):
            # grid.x = min(tiles, cap): with a cap (ctas_per_sm) CTAs (clusters) walk several tiles
            bx, _, _ = cute.arch.block_idx()
            gx, _, _ = cute.arch.grid_dim()
            buf = None
            if cutlass.const_expr(self.cfg.wk * self.cfg.sk > 1):
                smem = cutlass.memory.SmemAllocator()
                buf = smem.allocate_tensor(Float32, cute.make_layout(self.cfg.wk * self.frag * 32), byte_alignment=16)
            if cutlass.const_expr(self.cfg.ctas_per_sm > 0):
                # one loop, not a peeled first tile: the body is large (fully unrolled K), and
                # griddepcontrol.wait is a no-op once the previous grid has completed
                for tile in range(bx, tiles, gx):
                    self.tile_body(x, w, res, y, scl, n, m, buf, tile, tile != bx)
            else:
                self.tile_body(x, w, res, y, scl, n, m, buf, bx, False)

        @cute.jit
        def tile_body(self, x: cute.Tensor, w: cute.Tensor, res: cute.Tensor, y: cute.Tensor, scl: cute.Tensor,
                      n: Int32, m: Int32, buf, tile: Int32, again: cutlass.Boolean):
            cfg = self.cfg
            K: cutlass.Constexpr = self.k
            MT: cutlass.Constexpr = cfg.mt
            NT: cutlass.Constexpr = cfg.nt
            WK: cutlass.Constexpr = cfg.wk
            SK: cutlass.Constexpr = cfg.sk
            F: cutlass.Constexpr = self.frag
            tid, _, _ = cute.arch.thread_idx()
            _, srank, _ = cute.arch.block_idx()
            lane = tid % 32
            warp = tid // 32
            g = lane // 4
            t4 = lane % 4
            part = srank * WK + warp
            row_base = tile * (16 * MT)

            # Row addresses (clamped: rows past N re-read row N-1 and are never stored). A chunk is 64 bytes of
            # every weight row (32 bf16, 64 e4m3 or 128 e2m1 values of K) and 2 x KC bytes of every token row.
            QW: cutlass.Constexpr = self.coding is not None
            KC: cutlass.Constexpr = self.kc
            XL: cutlass.Constexpr = KC // 32                 # 16-byte activation loads per token and chunk
            ROW_BYTES: cutlass.Constexpr = self.coding.row_bytes(K) if QW else 2 * K
            w_rows = []
            w_row_idx = []
            for mt in cutlass.range_constexpr(MT):
                for half in cutlass.range_constexpr(2):
                    row = cutlass.min(row_base + 16 * mt + 8 * half + g, n - 1)
                    w_row_idx.append(row)
                    w_rows.append(w.iterator.toint() + Int64(row) * ROW_BYTES + Int64(t4) * 16)
            x_rows = []
            x_ok = []
            for nt in cutlass.range_constexpr(NT):
                tok = 8 * nt + g
                x_ok.append(Int32(tok < m))
                x_rows.append(x.iterator.toint() + Int64(cutlass.min(tok, m - 1)) * (2 * K) + Int64(t4) * (16 * XL))

            acc = accumulate_chunks(self, P, scl, w_rows, w_row_idx, x_rows, x_ok, part, t4, cfg.pdl)

            if cutlass.const_expr(WK * SK == 1):
                for f in cutlass.range_constexpr(F):
                    self.store(y, res, n, m, row_base, g, t4, Int32(f), acc[f])
            else:
                # Partial tiles through shared memory: slot [warp][f][lane] (lane-contiguous: no bank
                # conflicts), summed in a fixed (cta, warp) order -> deterministic.
                if cutlass.const_expr(SK == 1):
                    if again:
                        cute.arch.sync_threads()  # the previous tile's readers are done with the buffer
                for f in cutlass.range_constexpr(F):
                    buf[(warp * F + f) * 32 + lane] = acc[f]
                if cutlass.const_expr(SK == 1):
                    cute.arch.sync_threads()
                else:
                    P.cluster_sync()
                # Thread (part, lane) finishes fragment slots f = part, part + WK*SK, ...
                for i in cutlass.range_constexpr(-(-F // (WK * SK))):
                    f = part + i * (WK * SK)
                    if f < F:
                        s = Float32(0.0)
                        for src in cutlass.range_constexpr(SK):
                            for wsrc in cutlass.range_constexpr(WK):
                                idx = (wsrc * F + f) * 32 + lane
                                if cutlass.const_expr(SK == 1):
                                    s = s + buf[idx]
                                else:
                                    addr = P.smem_addr(buf.iterator) + idx * 4
                                    s = s + P.ld_cluster_f32(addr, Int32(src))
                        self.store(y, res, n, m, row_base, g, t4, f, s)
                if cutlass.const_expr(SK > 1):
                    P.cluster_sync()  # peers keep their shared memory until every read is done

        @cute.jit
        def store(self, y: cute.Tensor, res: cute.Tensor, n: Int32, m: Int32, row_base: Int32, g: Int32,
                  t4: Int32, f: Int32, v: Float32):
            # accumulator slot f = (mt*NT + nt)*4 + q: q>>1 picks row g or g+8, q&1 the token pair
            q = f % 4
            nt = (f // 4) % self.cfg.nt
            mt = f // (4 * self.cfg.nt)
            row = row_base + 16 * mt + g + 8 * (q // 2)
            tok = 8 * nt + 2 * t4 + (q % 2)
            if row < n and tok < m:
                out = v
                if cutlass.const_expr(self.residual):
                    out = out + res[tok, row].to(Float32)
                y[tok, row] = out.to(y.element_type)

    return MmaGemmKernel



def issue_chunks(kern, P, scl, w_rows: list, w_row_idx: list, part, t4, js: list, early: bool, wv: dict,
                 sv: dict) -> None:
    """Request the weight words (into ``wv[(j, row)]``) and block scales (``sv[j]``) of this warp's chunks ``js``
    (trace time): :func:`accumulate_chunks`'s loads, apart so that a kernel can request several rows' chunks before
    any of their math (``early``: the coherent path, which ptxas keeps ahead of a fence or the PDL wait)."""
    import cutlass
    from cutlass import Int32, Int64

    from latency_specialized.kernels.mma_quant_weights import chunk_scales

    for j in js:
        chunk = part + kern.parts * j
        off = Int64(chunk) * 64
        last = kern.ragged and j == kern.per_part - 1
        ok = Int32(chunk < kern.chunks)
        for r in range(2 * kern.cfg.mt):
            if last:
                wv[(j, r)] = P.ld_weight_if(w_rows[r] + off, ok, early)
            elif early:
                wv[(j, r)] = P.ld_weight_coherent(w_rows[r] + off)
            else:
                wv[(j, r)] = P.ld_weight(w_rows[r] + off)
        if kern.coding is not None:
            # the chunk's block scales (static data, like the weights: requested before the PDL wait)
            sv[j] = chunk_scales(P, kern.coding, scl, w_row_idx, cutlass.min(chunk, kern.chunks - 1), t4)


def accumulate_chunks(kern, P, scl, w_rows: list, w_row_idx: list, x_rows: list, x_ok: list, part, t4,
                      pdl_wait: bool, issued: tuple[dict, dict] | None = None) -> list:
    """The K loop of one warp (trace time; plain Python, unrolled): its share of the chunks (``part``, ``part +
    parts``, ...) of every weight row address in ``w_rows`` (2 per m-tile: rows g, g + 8, already offset by the lane's
    16 bytes; ``t4`` = lane % 4) against the token rows ``x_rows`` (one per n-tile, masked by ``x_ok``), in batches of
    ``cb`` chunks of weight loads. ``w_row_idx``: the rows' indices into the block scales (quantized weights).
    ``pdl_wait``: issue the PDL wait (and release the dependents) after the first batch of weight loads - where
    nothing before it reads what the previous kernel writes. ``cfg.lookahead`` = L > 0: batches 0..L are requested
    before the wait, then batch j + L just before batch j is multiplied, each behind a fence (see ``MmaConfig``).
    ``issued``: (words, scales) of every chunk, already requested by the caller (:func:`issue_chunks`; no wait
    here then, nor lookahead). Returns the fp32 accumulators (slot (mt x NT + nt) x 4 + q)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    from latency_specialized.kernels.mma_quant_weights import activation_pairs, chunk_mma

    cfg = kern.cfg
    MT, NT = cfg.mt, cfg.nt
    QW = kern.coding is not None
    KC = kern.kc
    XL = KC // 32                 # 16-byte activation loads per token and chunk
    L = cfg.lookahead
    acc = [Float32(0.0) for _ in range(kern.frag)]
    wv, sv = issued if issued is not None else ({}, {})

    def issue(js: list, early: bool) -> None:
        issue_chunks(kern, P, scl, w_rows, w_row_idx, part, t4, js, early, wv, sv)

    def compute(js: list) -> None:
        for j in js:
            chunk = part + kern.parts * j
            off = Int64(chunk) * (2 * KC)
            last = kern.ragged and j == kern.per_part - 1
            xv = []
            for nt in range(NT):
                pred = x_ok[nt]
                if last:
                    pred = pred & Int32(chunk < kern.chunks)
                words = []
                for i in range(XL):
                    words += P.ld_act_if(x_rows[nt] + off + 16 * i, pred)
                xv.append(words)
            xb = activation_pairs(P, kern.coding, xv, kern.split_pairs) if QW else []
            for mt in range(MT):
                lo = wv[(j, 2 * mt)]
                hi = wv[(j, 2 * mt + 1)]
                if QW:
                    chunk_mma(P, kern.coding, acc, lo, hi, xb, sv[j], mt, NT, kern.split_pairs)
                else:
                    for nt in range(NT):
                        base = (mt * NT + nt) * 4
                        c = acc[base:base + 4]
                        c = P.mma_bf16_16816([lo[0], hi[0], lo[1], hi[1]], [xv[nt][0], xv[nt][1]], c)
                        c = P.mma_bf16_16816([lo[2], hi[2], lo[3], hi[3]], [xv[nt][2], xv[nt][3]], c)
                        for q in range(4):
                            acc[base + q] = c[q]

    batches = [list(range(j0, min(j0 + cfg.cb, kern.per_part))) for j0 in range(0, kern.per_part, cfg.cb)]
    if issued is not None:
        compute(list(range(kern.per_part)))
        return acc
    if L == 0:
        for b, js in enumerate(batches):
            # the first batch kept ahead of the wait by ptxas only through the coherent path (MmaConfig.prefetch)
            issue(js, b == 0 and pdl_wait and cfg.prefetch)
            if b == 0 and pdl_wait:
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            compute(js)
        return acc
    # lookahead: coherent loads, each later batch behind a fence (a wait that returns at once: ptxas keeps coherent
    # loads ahead of it instead of sinking them into the math)
    for b in range(min(L + 1, len(batches))):
        issue(batches[b], True)
    if pdl_wait:
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
    for b, js in enumerate(batches):
        if b >= 1 and b + L < len(batches):
            issue(batches[b + L], True)
            cute.arch.griddepcontrol_wait()
        compute(js)
        for j in js:  # let the registers go
            for r in range(2 * MT):
                wv.pop((j, r))
    return acc


@compile_cache.compile_unit
def compile_mma(k: int, cfg: MmaConfig, residual: bool, out_fp32: bool = False, coding: QuantCoding | None = None):
    """Compiled kernel for (K, config, residual, output dtype, weight coding); M and N are dynamic. ``out_fp32``:
    the fp32 sums are stored unrounded (router logits); the unused residual operand then has the output's type,
    so the output buffer stands in for it. ``coding``: the weight is codes [N, coding.row_bytes(K)] (uint8) with
    block scales (the ``s`` operand, [ceil(N / rows), ceil(K / cols)] fp32 or uint8); bf16 weights take x as an
    unused ``s``."""
    refuse_fp32_residual(out_fp32, residual)
    why = coding.refusal(k) if coding is not None else None
    if why:
        raise ValueError(f"quantized mma kernel: {why}: not compiled")

    def build(arch: str):
        import cutlass
        import cutlass.cute as cute

        from latency_specialized.kernels.gemm_common import compile_options, fake_rows, fake_stream, fake_strided_rows

        m, n = cute.sym_int(), cute.sym_int()
        bf = cutlass.BFloat16
        yt = cutlass.Float32 if out_fp32 else bf
        if coding is None:
            w, scales = fake_rows(bf, n, k), fake_rows(bf, m, k)
        else:
            w = fake_rows(cutlass.Uint8, n, coding.row_bytes(k))
            byte_scales = coding.ue8m0 or coding.nvfp4
            scales = fake_rows(cutlass.Uint8 if byte_scales else cutlass.Float32, cute.sym_int(), cute.sym_int(),
                               align=1 if byte_scales else 4)
        args = (fake_rows(bf, m, k), w, fake_strided_rows(yt, m, n), fake_strided_rows(yt, m, n), scales, 1,
                fake_stream())
        return cute.compile(_kernel_class()(k, cfg, residual, coding), *args,
                            options=compile_options(arch, max_regs(32 * cfg.wk, cfg.ctas_per_sm)))

    # "strided_out": residual/out take a dynamic row stride (artifacts cached before that differ); "s": the scale
    # operand (a dummy for bf16 weights)
    key = (k, residual, "strided_out", "s") + (("out_fp32",) if out_fp32 else ()) + tuple(sorted(asdict(cfg).items()))
    if coding is not None:
        key += (("coding", coding.element, coding.ue8m0, coding.block) + (("paired",) if coding.paired else ()),)
    return compile_cache.cached_compile("gemm.cutedsl_mma", key, build)


def pow2_at_most(x: float, cap: int) -> int:
    p = 1
    while p * 2 <= min(x, cap):
        p *= 2
    return p


def default_config(n: int, k: int, m: int, *, sk_max: int = 1) -> MmaConfig:
    """Heuristic: enough warps for HBM (TARGET_WARPS), every warp at least 2 chunks of K.

    ``sk_max`` > 1 allows cluster split-K (gemm_splitk).
    """
    nt = max(1, math.ceil(m / 8))
    mt = 2 if nt >= 4 else 1
    chunks = k // 32
    tiles = math.ceil(n / (16 * mt))
    need = max(1.0, TARGET_WARPS / tiles)
    wk = pow2_at_most(min(need, max(1, chunks // 2)), min(8, SMEM_LIMIT // (4 * mt * nt * 32 * 4)))
    sk = pow2_at_most(min(need / wk, max(1, chunks // (2 * wk))), sk_max) if sk_max > 1 else 1
    per = math.ceil(chunks / (wk * sk))
    cb = min(4 if mt == 1 else 2, per)
    return MmaConfig(nt=nt, mt=mt, wk=wk, sk=sk, cb=max(1, cb))


def run_mma(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor | None,
            config: MmaConfig, name: str, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    from latency_specialized.errors import UserError

    fp32 = fp32_output(name, x, out_dtype, residual)
    m, n, k = check_gemm_args(x, weight, residual, out, kmult=32, out_dtype=out_dtype)
    if m > 8 * config.nt:
        raise UserError(f"{name}: config {config.label()} serves M<={8 * config.nt}, got M={m}")
    if config.smem_bytes() > SMEM_LIMIT or config.sk > 8:
        raise UserError(f"{name}: config {config.label()} needs {config.smem_bytes()} B of shared memory / "
                        f"cluster {config.sk}: use wk*mt*nt <= 96 and sk <= 8")
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32 if fp32 else x.dtype, device=x.device)
    fn = compile_mma(k, config, residual is not None, out_fp32=fp32)
    fn(x, weight, residual if residual is not None else out, out, x, grid_cap(x.device, config.ctas_per_sm))
    return out


def quantized_config(n: int, chunks: int, m: int) -> MmaConfig:
    """Launch heuristic of the quantized variants (FP8, MXFP4) for ``chunks`` 64-byte chunks per row: the bf16 rule
    (enough warps in flight for HBM, at least 2 chunks per warp) with twice its warp target at one m-tile, K split
    over warps only (a cluster split lost in every cell measured on the H200, session 33) and 4 chunks per batch."""
    nt = max(1, math.ceil(m / 8))
    mt = 2 if nt >= 4 else 1
    tiles = math.ceil(n / (16 * mt))
    need = max(1.0, TARGET_WARPS * (2 if mt == 1 else 1) / tiles)
    wk = pow2_at_most(min(need, max(1, chunks // 2)), min(8, SMEM_LIMIT // (4 * mt * nt * 32 * 4)))
    return MmaConfig(nt=nt, mt=mt, wk=wk, sk=1, cb=max(1, min(4, math.ceil(chunks / wk))))


def run_quantized_mma(name: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, coding: QuantCoding,
                      residual: torch.Tensor | None, out: torch.Tensor | None, out_dtype: torch.dtype | None,
                      config: MmaConfig, max_m: int, max_cluster: int = 8) -> torch.Tensor:
    """The quantized variants' call (``gemm_fp8_mma``, ``gemm_q4_mma``): the bf16 kernels' argument checks over the
    logical [N, K] of ``codes`` ([N, coding.row_bytes(K)] uint8, contiguous, 16-byte aligned), the config's limits,
    then the kernel. ``config``: already chosen for (N, K, M)."""
    from latency_specialized.errors import UserError

    fp32 = fp32_output(name, x, out_dtype, residual)
    k = x.shape[-1]
    if codes.dim() != 2 or not codes.is_contiguous() or codes.data_ptr() % 16 or codes.shape[1] != coding.row_bytes(k):
        raise UserError(f"{name}: the codes must be a contiguous, 16-byte aligned [N, {coding.row_bytes(k)}] for "
                        f"x {tuple(x.shape)} (got {tuple(codes.shape)})")
    m, n, k = check_gemm_args(x, torch.empty(codes.shape[0], k, dtype=torch.bfloat16, device="meta"), residual, out,
                              kmult=coding.chunk, out_dtype=out_dtype)
    if m > max_m:
        raise UserError(f"{name} serves M<={max_m} (got M={m}): use gemm.reference")
    if m > 8 * config.nt or config.smem_bytes() > SMEM_LIMIT or config.sk > max_cluster:
        raise UserError(f"{name}: config {config.label()} cannot serve M={m} (serves M<={8 * config.nt}, needs "
                        f"{config.smem_bytes()} B of shared memory, cluster {config.sk} <= {max_cluster})")
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32 if fp32 else x.dtype, device=x.device)
    fn = compile_mma(k, config, residual is not None, out_fp32=fp32, coding=coding)
    fn(x, codes, residual if residual is not None else out, out, scales, grid_cap(x.device, config.ctas_per_sm))
    return out


def gemm_small_m(x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, config: MmaConfig | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ residual) on tensor cores, M <= 16 (gemm contract, ops/gemm.py).

    Parameters
    ----------
    x : [M, K] bf16, M <= 16, K % 32 == 0.
    weight : [N, K] bf16.
    residual : optional [M, N] bf16 added before the single rounding.
    out : optional [M, N] destination (bf16, or fp32 with ``out_dtype=torch.float32``).
    config : kernel choices; default: the tuning table's, else a heuristic (no cluster).
    out_dtype : torch.float32 stores the fp32 sums unrounded (router logits, no residual).
    """
    from latency_specialized.errors import UserError

    m, n, k = x.shape[0], weight.shape[0], x.shape[-1]
    if m > MAX_M:
        raise UserError(f"{NAME} serves M<={MAX_M} (got M={m}): use gemm.cutedsl_splitk or gemm.cublas")
    if config is None:
        from latency_specialized.kernels import tuning

        config = tuning.config_for(NAME, n, k, m, MmaConfig) or default_config(n, k, m)
    return run_mma(x, weight, residual, out, config, NAME, out_dtype)


def _supports(ctx: OpContext) -> Support:
    return mma_supports(NAME, "small-M", MAX_M, ctx)


IMPLEMENTATIONS = [
    Implementation("gemm", NAME, gemm_small_m, _supports, priority=20, strided_out=True,
                   description="CuTe DSL mma.sync m16n8k16, weights as A loaded straight to registers, M<=16"),
]
