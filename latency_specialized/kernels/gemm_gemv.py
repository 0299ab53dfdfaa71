"""gemm.cutedsl_gemv: y[M, N] = x[M, K] @ W[N, K]^T (+ residual) for M = 1..4 on CUDA cores.

Decode at M = 1-2 is a pure weight stream: 2 bytes of weight per 2*M FLOP. The kernel therefore
only has to keep enough 16-byte weight loads in flight to saturate HBM and must not waste the
ramp/tail (cuBLAS loses 35-60% there, PERF.md):

* one warp per ``rows_per_warp`` output rows; lane ``l`` reads 16-byte vectors ``l, l+32, ...``
  of each row, so one warp instruction reads 512 contiguous bytes;
* loads are issued ``batch`` vectors per row at a time before any arithmetic (all fully
  unrolled: K is a compile-time constant), weights through the non-coherent path with no L1
  allocation; x (tiny, re-read by every warp) stays in L1;
* with PDL the first weight batch (``lookahead`` + 1 batches) is requested *before*
  ``griddepcontrol.wait``: weights do not depend on the previous kernel, so their DRAM latency
  overlaps the previous kernel's tail;
* ``lookahead`` L > 0 software-pipelines the stream: batches j+1..j+L are in flight while batch j
  is multiplied, so a warp never drains its loads between batches (costs L x batch x 4 registers
  per row);
* one warp-shuffle butterfly per (row, token) at the end, fp32 throughout, one rounding.

GLU mode (``compile_gemv(..., glu=variant)``): the weight is ``[gate (I) | up (I)]`` and output row
j needs weight rows j and I + j; one warp streams both, rounds each sum to bf16 (the gemm
contract's rounding) and stores ``act(gate) * lin(up)`` - the gate/up projection and the gated
activation of an MLP in one kernel (mlp_fused.py), bit-identical to the GEMV + activation kernel.

Split mode (``gemv_split``, ``moe.gate_down``): one weight ``[W_head; W_tail]`` streamed once, the
first rows stored as fp32 (router logits), the rest rounded to bf16 (the latent MoE's input).

Norm prologue (``gemm_gemv(norm_weight=)``, ``Implementation.norm_prologue``): every warp first reduces
the (possibly strided) x row to rsqrt(mean(x^2) + eps) in fp32, then multiplies each x vector by rstd
and the gain and rounds it to bf16 - the norm op's output - before the usual stream: MLA's q_a norm
and q_b projection in one kernel. With ``NORM_SMEM`` the CTA normalises the row once instead: its threads share the
sum of squares through shared memory, write the rounded row there, and the stream reads it from there (no x or gain
load and no scaling per weight vector).

Anatomy: config -> kernel class (built on first use; cutlass is imported lazily) -> cached
compile (static K, M, config; N dynamic) -> public wrapper with ``residual=``/``out=``.
"""


import functools
from dataclasses import asdict, dataclass, replace

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.kernels import compile_cache
from latency_specialized.kernels.gemm_common import (check_gemm_args, fp32_output, grid_cap, max_regs,
                                                     refuse_fp32_residual)

NAME = "gemm.cutedsl_gemv"
MAX_M = 4
NORM_SMEM = False
"""The norm prologue normalises x once per CTA into shared memory instead of in every warp for every weight vector
(an A/B switch, off until timed: step ``normsm`` of ``benchmarks/scripts/pending_measurements.sh``). Why: in GLM-5.3's
layer the q_b GEMV with the prologue took ~3 us over the o_proj GEMV of its shape, where a row a warp spends as
many x, gain and scaling instructions as weight ones (``models/glm53/NOTES.md``, session 53)."""
NORM_SMEM_MAX_BYTES = 32768
"""Largest normalised x (M x K bf16) the shared-memory norm holds; wider rows keep the per-warp prologue."""


def norm_smem_fits(m: int, k: int) -> bool:
    """Whether ``NORM_SMEM`` serves M rows of width K (their bf16 copy within ``NORM_SMEM_MAX_BYTES``)."""
    return m * k * 2 <= NORM_SMEM_MAX_BYTES


@dataclass(frozen=True)
class GemvConfig:
    """Static choices of the GEMV kernel (hashable: part of the compile key)."""

    rows_per_warp: int = 1
    """Output rows one warp computes (2 reuses each x vector for two rows)."""
    warps: int = 4
    """Warps per CTA."""
    batch: int = 8
    """16-byte vectors per row a lane requests before it starts multiplying."""
    pdl: bool = True
    """Programmatic dependent launch: weight loads start before the previous kernel ends."""
    ctas_per_sm: int = 0
    """0: one CTA per row group. k > 0: persistent - at most k CTAs per SM walk the row groups, and
    registers are capped so that 2k CTAs fit: the next kernel's CTAs start beside them and issue
    their weight loads early (PDL)."""
    lookahead: int = 0
    """Batches requested ahead of the one being multiplied (0: a warp waits for each batch in turn;
    L: L more batches in flight, and L + 1 issued before the PDL wait)."""

    prefetch: bool = True
    """The batches requested before the PDL wait through the coherent path: ptxas hoists the wait above non-coherent
    loads (offline SASS: without it the wait comes first and no weight is requested before it;
    ``tests/ops/test_pdl_load_order.py``). On by default since the H200 timed both (``NOTES.md``, session 35); only
    weights are read before the wait."""

    k_split: int = 1
    """Warps per output row group, each streaming 1/k_split of K (K a multiple of 256 x k_split): k_split x
    more loads in flight for projections with few rows (router, latent down/up: N <= ~1000 rows leave most
    of the GPU's load slots empty at one warp per row). Partial sums meet in shared memory, added in warp
    order (deterministic)."""

    def splits(self, k: int) -> bool:
        """K divides into k_split parts of whole 512-byte lane steps (K % (256 x k_split) == 0)."""
        return k % (256 * self.k_split) == 0

    def label(self) -> str:
        cap = f"g{self.ctas_per_sm}" if self.ctas_per_sm else ""
        ahead = f"a{self.lookahead}" if self.lookahead else ""
        ks = f"k{self.k_split}" if self.k_split > 1 else ""
        pre = "f" if self.prefetch else ""
        return f"r{self.rows_per_warp}w{self.warps}b{self.batch}{ahead}{cap}{ks}{pre}{'p' if self.pdl else ''}"


@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64
    from cutlass.memory import SmemAllocator

    from latency_specialized.kernels.gemm_common import ptx
    from latency_specialized.kernels.gated_act import gated_act_fn

    P = ptx()

    class GemvKernel:
        def __init__(self, k: int, m: int, cfg: GemvConfig, residual: bool, glu=None, split: bool = False,
                     norm: bool = False, norm_smem: bool = False):
            self.k, self.m, self.cfg, self.residual = k, m, cfg, residual
            self.norm = norm                        # x -> round(rmsnorm(x) * g) first; x rows strided
            self.norm_smem = norm and norm_smem     # ... once per CTA, into shared memory
            self.split = split                      # rows < y.shape[1] -> y (fp32), the rest -> res (bf16)
            self.vecs = k // 8                      # 16-byte vectors per row
            self.full, self.tail = divmod(self.vecs, 32)
            self.iters = self.full + (1 if self.tail else 0)
            self.glu = glu                          # gated_act.ActVariant: [gate | up] rows -> act
            self.parts = 2 if glu is not None else 1
            self.act = gated_act_fn(glu) if glu is not None else None
            assert not (split and (residual or glu is not None))

        @cute.jit
        def __call__(self, x: cute.Tensor, w: cute.Tensor, res: cute.Tensor, y: cute.Tensor, cap: Int32,
                     gain: cute.Tensor, eps: Float32, stream):
            n = w.shape[0] // self.parts           # output rows
            rows_per_cta = self.cfg.warps // self.cfg.k_split * self.cfg.rows_per_warp
            groups = (n + rows_per_cta - 1) // rows_per_cta
            self.kernel(x, w, res, y, n, groups, gain, eps).launch(
                grid=[cutlass.min(groups, cap), 1, 1], block=[32 * self.cfg.warps, 1, 1],
                stream=stream, use_pdl=self.cfg.pdl)

        @cute.kernel
        def kernel(self, x: cute.Tensor, w: cute.Tensor, res: cute.Tensor, y: cute.Tensor, n: Int32,
                   groups: Int32, gain: cute.Tensor, eps: Float32):
            # grid = min(row groups, cap): with a cap (ctas_per_sm) the CTAs stay resident and walk
            # the row groups, leaving SM room for the next kernel's PDL prologue
            bid, _, _ = cute.arch.block_idx()
            grid, _, _ = cute.arch.grid_dim()
            if cutlass.const_expr(self.cfg.ctas_per_sm > 0):
                # one loop, no peeled first group (the body is large: K is fully unrolled);
                # griddepcontrol.wait is a no-op once the previous grid has completed
                for gi in range(bid, groups, grid):
                    self.group(x, w, res, y, n, gi, gain, eps)
            else:
                self.group(x, w, res, y, n, bid, gain, eps)

        @cute.jit
        def group(self, x: cute.Tensor, w: cute.Tensor, res: cute.Tensor, y: cute.Tensor, n: Int32, gi: Int32,
                  gain: cute.Tensor, eps: Float32):
            R: cutlass.Constexpr = self.cfg.rows_per_warp
            M: cutlass.Constexpr = self.m
            K: cutlass.Constexpr = self.k
            B: cutlass.Constexpr = self.cfg.batch
            L: cutlass.Constexpr = self.cfg.lookahead
            S: cutlass.Constexpr = self.parts
            KS: cutlass.Constexpr = self.cfg.k_split
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            warp = tid // 32
            kp = warp % KS                          # this warp's part of K (k_split > 1)
            row0 = (gi * (self.cfg.warps // KS) + warp // KS) * R
            tail_ok = Int32(lane < self.tail)
            k_off = Int64(kp) * (self.iters // KS * 512) if KS > 1 else 0  # bytes into the row
            # Rows past N re-read row N-1 (always valid memory) and are never stored: no predicate
            # on the hot loads. Stream (r, s) is part s (GLU: 0 gate, 1 up) of output row row0 + r.
            streams = [(r, s) for r in range(R) for s in range(S)]
            w_base = {}
            for r, s in streams:
                row = cutlass.min(row0 + r, n - 1) + s * n
                w_base[(r, s)] = w.iterator.toint() + Int64(row) * (2 * K) + Int64(lane) * 16 + k_off
            if cutlass.const_expr(self.norm_smem):
                # the CTA's threads normalise the rows into shared memory (xs); the stream reads its part there
                W: cutlass.Constexpr = self.cfg.warps
                smem = SmemAllocator()
                xs = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout(M * K), byte_alignment=16)
                part = smem.allocate_tensor(Float32, cute.make_layout(W * M), byte_alignment=16)
                xs0 = P.smem_addr(xs.iterator)
                ks_off = Int32(kp) * (self.iters // KS * 512) if KS > 1 else 0
                x_base = [xs0 + Int32(m * 2 * K) + lane * 16 + ks_off for m in range(M)]
                x_row0 = [x.iterator.toint() + Int64(m) * Int64(x.stride[0]) * 2 for m in range(M)]
                g0 = gain.iterator.toint()
            elif cutlass.const_expr(self.norm):   # x: a column slice of a wider row (dynamic row stride)
                # the norm reads the whole row (x_row); the stream reads this warp's part (x_base, g_base)
                x_row = [x.iterator.toint() + Int64(m) * Int64(x.stride[0]) * 2 + Int64(lane) * 16 for m in range(M)]
                x_base = [xr + k_off for xr in x_row]
                g_base = gain.iterator.toint() + Int64(lane) * 16 + k_off
            else:
                x_base = [x.iterator.toint() + Int64(m * 2 * K) + Int64(lane) * 16 + k_off for m in range(M)]
            acc = {(rs, m): Float32(0.0) for rs in streams for m in range(M)}
            its_here = self.iters // KS            # 16-byte vectors per lane in this warp's part of K
            batches = [list(range(b0, min(b0 + B, its_here))) for b0 in range(0, its_here, B)]

            def issue(its, early=False):
                wv = {}
                for rs in streams:
                    for i in its:
                        addr = w_base[rs] + Int64(i * 512)
                        if cutlass.const_expr(i == self.full):
                            wv[(rs, i)] = P.ld_weight_if(addr, tail_ok, early)
                        elif cutlass.const_expr(early):
                            wv[(rs, i)] = P.ld_weight_coherent(addr)
                        else:
                            wv[(rs, i)] = P.ld_weight(addr)
                return wv

            # batches 0..L are requested before the PDL wait; then batch j + L is requested just
            # before batch j is multiplied (program order is kept: the loads are side-effecting asm;
            # ptxas keeps the early ones ahead of the wait only if coherent: GemvConfig.prefetch)
            early = self.cfg.pdl and self.cfg.prefetch
            pending = {j: issue(batches[j], early) for j in range(min(L + 1, len(batches)))}
            if cutlass.const_expr(self.cfg.pdl):
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            rstd = []
            if cutlass.const_expr(self.norm_smem):
                # RMSNorm once per CTA: thread t takes the row's 16-byte vectors t, t + T, ...; per-thread sums,
                # then warp sums, then the warps' sums in warp order (fixed: no dependence on timing); the rows
                # are re-read (L1) to scale, round and store them
                T: cutlass.Constexpr = 32 * W
                NV: cutlass.Constexpr = K // 8
                PER: cutlass.Constexpr = (NV + T - 1) // T
                for m in cutlass.range_constexpr(M):
                    ss = Float32(0.0)
                    for j in cutlass.range_constexpr(PER):
                        vi = tid + j * T
                        xv = P.unpack_bf16x8(P.ld_act_if(x_row0[m] + Int64(vi) * 16, Int32(vi < NV)))
                        for e in cutlass.range_constexpr(8):
                            ss = xv[e] * xv[e] + ss
                    ss = cute.arch.warp_reduction_sum(ss)
                    if lane == 0:
                        part[m * W + warp] = ss
                cute.arch.barrier()
                for m in cutlass.range_constexpr(M):
                    tot = Float32(0.0)
                    for wi in cutlass.range_constexpr(W):
                        tot = tot + part[m * W + wi]
                    rs = cute.math.rsqrt(tot / Float32(K) + eps, fastmath=False)
                    for j in cutlass.range_constexpr(PER):
                        vi = tid + j * T
                        ok = Int32(vi < NV)
                        xv = P.unpack_bf16x8(P.ld_act_if(x_row0[m] + Int64(vi) * 16, ok))
                        gv = P.unpack_bf16x8(P.ld_act_if(g0 + Int64(vi) * 16, ok))
                        packed = [P.pack_bf16x2(xv[2 * e] * rs * gv[2 * e], xv[2 * e + 1] * rs * gv[2 * e + 1])
                                  for e in range(4)]
                        P.st_shared_v4_if(xs0 + Int32(m * 2 * K) + vi * 16, packed, ok)
                cute.arch.barrier()
            elif cutlass.const_expr(self.norm):
                # RMSNorm prologue (ops/norm.py order): every warp reduces the whole x row itself (K/256
                # vectors per lane from L1/L2): rstd = rsqrt(mean(x^2) + eps) in fp32
                for m in cutlass.range_constexpr(M):
                    ss = Float32(0.0)
                    for i in cutlass.range_constexpr(self.iters):
                        addr = x_row[m] + Int64(i * 512)
                        if cutlass.const_expr(i == self.full):
                            xv = P.unpack_bf16x8(P.ld_act_if(addr, tail_ok))
                        else:
                            xv = P.unpack_bf16x8(P.ld_act(addr))
                        for e in cutlass.range_constexpr(8):
                            ss = xv[e] * xv[e] + ss
                    ss = cute.arch.warp_reduction_sum(ss)
                    rstd.append(cute.math.rsqrt(ss / Float32(K) + eps, fastmath=False))
            for j in cutlass.range_constexpr(len(batches)):
                if cutlass.const_expr(j + L < len(batches) and (j + L) not in pending):
                    pending[j + L] = issue(batches[j + L])
                wv = pending.pop(j)
                for i in batches[j]:
                    wf = {rs: P.unpack_bf16x8(wv[(rs, i)]) for rs in streams}
                    for m in cutlass.range_constexpr(M):
                        if cutlass.const_expr(self.norm_smem):
                            saddr = x_base[m] + Int32(i * 512)
                            if cutlass.const_expr(i == self.full):
                                xw = P.ld_shared_v4_if(saddr, tail_ok)
                            else:
                                xw = P.ld_shared_v4(saddr)
                        else:
                            addr = x_base[m] + Int64(i * 512)
                            if cutlass.const_expr(i == self.full):
                                xw = P.ld_act_if(addr, tail_ok)
                            else:
                                xw = P.ld_act(addr)
                        xf = P.unpack_bf16x8(xw)
                        if cutlass.const_expr(self.norm and not self.norm_smem):
                            # x * rstd * g in fp32, rounded to bf16 as the norm op's output would be
                            gaddr = g_base + Int64(i * 512)
                            if cutlass.const_expr(i == self.full):
                                gf = P.unpack_bf16x8(P.ld_act_if(gaddr, tail_ok))
                            else:
                                gf = P.unpack_bf16x8(P.ld_act(gaddr))
                            packed = [P.pack_bf16x2(xf[2 * e] * rstd[m] * gf[2 * e],
                                                    xf[2 * e + 1] * rstd[m] * gf[2 * e + 1]) for e in range(4)]
                            xf = P.unpack_bf16x8(packed)
                        for rs in streams:
                            # a short per-vector chain, then one add: iterations stay independent
                            t = wf[rs][0] * xf[0]
                            for e in cutlass.range_constexpr(1, 8):
                                t = wf[rs][e] * xf[e] + t
                            acc[(rs, m)] = acc[(rs, m)] + t
            for key in acc:
                acc[key] = cute.arch.warp_reduction_sum(acc[key])
            if cutlass.const_expr(KS > 1):
                # parts 1..KS-1 of each row group hand their sums to part 0 through shared memory; part 0
                # adds them in part order (fixed: the result does not depend on warp timing)
                keys = list(acc.keys())
                nv = len(keys)
                # (beside the normalised rows where they are in shared memory: one allocator, no overlap)
                alloc = smem if cutlass.const_expr(self.norm_smem) else SmemAllocator()
                red = alloc.allocate_tensor(Float32, cute.make_layout(self.cfg.warps * nv), byte_alignment=16)
                if kp > 0:
                    if lane == 0:
                        for v in cutlass.range_constexpr(nv):
                            red[warp * nv + v] = acc[keys[v]]
                cute.arch.barrier()
                for j in cutlass.range_constexpr(1, KS):
                    # part 0 reads parts 1..KS-1 of its group; the other parts (their sums unused) read
                    # inside their group too, so no read leaves the buffer
                    src = warp - kp + (kp + j) % KS
                    for v in cutlass.range_constexpr(nv):
                        acc[keys[v]] = acc[keys[v]] + red[src * nv + v]
            if lane + kp == 0:                      # lane 0 of part 0 stores
                for r in cutlass.range_constexpr(R):
                    row = row0 + r
                    if row < n:
                        for m in cutlass.range_constexpr(M):
                            v = acc[((r, 0), m)]
                            if cutlass.const_expr(S == 2):
                                # the contract rounds gate/up to bf16 before the activation
                                g = P.bf16_lo(P.pack_bf16x2(v, v))
                                u = acc[((r, 1), m)]
                                v = self.act(g, P.bf16_lo(P.pack_bf16x2(u, u)))
                            if cutlass.const_expr(self.residual):
                                v = v + res[m, row].to(Float32)
                            if cutlass.const_expr(self.split):
                                # two outputs of one weight stream: fp32 head rows, rounded tail rows
                                n_head = y.shape[1]
                                if row < n_head:
                                    y[m, row] = v
                                else:
                                    res[m, row - n_head] = v.to(res.element_type)
                            else:
                                y[m, row] = v.to(y.element_type)

    return GemvKernel


@compile_cache.compile_unit
def compile_gemv(k: int, m: int, cfg: GemvConfig, residual: bool, out_fp32: bool = False, glu=None,
                 split: bool = False, norm: bool = False, norm_smem: bool = False):
    """Compiled kernel for (K, M, config, residual, output dtype, GLU, split); N is dynamic (one compile per K and M).

    ``out_fp32``: the accumulator is stored as fp32 (router logits) instead of rounded to bf16;
    the (unused) residual operand then has the output's type, so the output buffer can stand in.
    ``glu``: a ``gated_act.ActVariant`` (bf16): the weight is [gate | up] (2I rows) and the kernel
    stores act(gate) * lin(up) [M, I]; no residual.
    ``split``: two outputs from one weight stream (``gemv_split``): rows ``< out.shape[1]`` go to the
    fp32 ``out``, the rest (rounded) to the bf16 tensor passed as the residual operand.
    ``norm``: x is RMS-normalised first (``gemm_gemv(norm_weight=)``): x rows may be strided; ``norm_smem``: once
    per CTA, into shared memory (``NORM_SMEM``)."""
    refuse_fp32_residual(out_fp32, residual)
    if glu is not None and (residual or out_fp32 or glu.dtype != "bfloat16"):
        raise ValueError("the GLU epilogue writes bf16 act(gate) * lin(up) without a residual: not compiled")
    if split and (residual or glu is not None or not out_fp32):
        raise ValueError("the split epilogue writes fp32 head rows and bf16 tail rows, no residual: not compiled")
    if norm and (glu is not None or split):
        raise ValueError("the norm prologue is for plain projections (no GLU, no split): not compiled")
    if norm_smem and not (norm and norm_smem_fits(m, k)):
        raise ValueError(f"the shared-memory norm needs the norm prologue and M x K x 2 <= {NORM_SMEM_MAX_BYTES} bytes "
                         f"(M={m}, K={k}): not compiled")
    if cfg.k_split > 1 and (cfg.ctas_per_sm or cfg.warps % cfg.k_split or not cfg.splits(k)):
        raise ValueError(f"k_split={cfg.k_split} needs K % (256 x k_split) == 0 (K={k}), warps % k_split == 0 "
                         "and one CTA per row group: not compiled")

    def build(arch: str):
        import cutlass
        import cutlass.cute as cute

        from latency_specialized.kernels.gemm_common import compile_options, fake_rows, fake_stream, fake_strided_rows

        n = cute.sym_int()
        bf = cutlass.BFloat16
        yt = cutlass.Float32 if out_fp32 else bf
        wn = cute.sym_int() if glu is not None else n   # GLU: 2I weight rows, I outputs
        from latency_specialized.kernels.gemm_common import fake_vec

        xf = fake_strided_rows(bf, m, k) if norm else fake_rows(bf, m, k)
        if split:  # weight rows = head + tail: all three counts dynamic
            args = (xf, fake_rows(bf, cute.sym_int(), k), fake_strided_rows(bf, m, cute.sym_int()),
                    fake_strided_rows(yt, m, n), 1)
        else:
            args = (xf, fake_rows(bf, wn, k), fake_strided_rows(yt, m, n), fake_strided_rows(yt, m, n), 1)
        args += (fake_vec(bf, k), 1e-6, fake_stream())
        return cute.compile(_kernel_class()(k, m, cfg, residual, glu, split, norm, norm_smem), *args,
                            options=compile_options(arch, max_regs(32 * cfg.warps, cfg.ctas_per_sm)))

    # "strided_out": residual/out take a dynamic row stride (artifacts cached before that differ)
    key = (k, m, residual, "strided_out") + (("out_fp32",) if out_fp32 else ()) + tuple(sorted(asdict(cfg).items()))
    if glu is not None:
        key += (("glu",) + tuple(sorted(asdict(glu).items())),)
    if split:
        key += ("split",)
    if norm:
        key += ("norm",)
    if norm_smem:
        key += ("norm_smem",)
    return compile_cache.cached_compile(NAME, key, build)


SMALL_N_ROWS = 1024
"""Up to this many output rows the heuristic splits K over warps (``GemvConfig.k_split``): one warp per
row leaves most load slots of the GPU empty there (e.g. the 560-row router + latent down-projection)."""


def default_config(n: int, k: int, m: int) -> GemvConfig:
    """Heuristic used where the tuning table has no entry (tests, shapes off the model, moe.gate_down)."""
    cfg = GemvConfig(rows_per_warp=2 if m == 1 and n >= 4096 else 1)
    if n <= SMALL_N_ROWS:   # the widest split K allows
        cfg = next((c for c in (replace(cfg, k_split=4), replace(cfg, k_split=2)) if c.splits(k)), cfg)
    return cfg


def gemm_gemv(x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
              out: torch.Tensor | None = None, config: GemvConfig | None = None,
              out_dtype: torch.dtype | None = None, norm_weight: torch.Tensor | None = None,
              norm_eps: float = 1e-6) -> torch.Tensor:
    """y = x @ weight.T (+ residual) with the CUDA-core GEMV kernel (gemm contract, ops/gemm.py).

    Parameters
    ----------
    x : [M, K] bf16, M in 1..4, K % 8 == 0 (with ``norm_weight``: rows may be strided, e.g. a column
        slice of a fused projection's output).
    weight : [N, K] bf16.
    residual : optional [M, N] bf16 added before the single rounding.
    out : optional [M, N] destination (bf16, or fp32 with ``out_dtype=torch.float32``).
    config : kernel choices; default: the tuning table's, else a heuristic.
    out_dtype : torch.float32 stores the fp32 accumulator unrounded (router logits, no residual).
    norm_weight : optional [K] bf16 RMSNorm gain: y = rmsnorm(x, norm_weight, norm_eps) @ weight.T, the
        norm computed by every warp in fp32 and rounded to bf16 as the norm op rounds it (one kernel
        instead of a norm kernel and a GEMV).
    """
    from latency_specialized.errors import UserError

    fp32 = fp32_output(NAME, x, out_dtype, residual)
    norm = norm_weight is not None
    m, n, k = check_gemm_args(x, weight, residual, out, kmult=8, out_dtype=out_dtype, strided_x=norm)
    if norm and (tuple(norm_weight.shape) != (k,) or norm_weight.dtype != x.dtype
                 or norm_weight.data_ptr() % 16 or fp32 or residual is not None):
        raise UserError(f"{NAME}: norm_weight must be a 16-byte aligned [{k}] {x.dtype} gain (got "
                        f"{tuple(norm_weight.shape)} {norm_weight.dtype}), for a bf16 output without residual")
    if not 1 <= m <= MAX_M:
        raise UserError(f"{NAME} serves M=1..{MAX_M} (got M={m}): use gemm.cutedsl_small_m or gemm.cublas")
    if config is None:
        from latency_specialized.kernels import tuning

        config = tuning.config_for(NAME, n, k, m, GemvConfig) or default_config(n, k, m)
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32 if fp32 else x.dtype, device=x.device)
    fn = compile_gemv(k, m, config, residual is not None, out_fp32=fp32, norm=norm,
                      norm_smem=norm and NORM_SMEM and norm_smem_fits(m, k))
    fn(x, weight, residual if residual is not None else out, out, grid_cap(x.device, config.ctas_per_sm),
       *_norm_args(x, norm_weight, norm_eps))
    return out


def _norm_args(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, float]:
    """The kernel's (gain, eps) operands; variants without the norm prologue get x's first row (unused)."""
    return (norm_weight, float(eps)) if norm_weight is not None else (x[0], 0.0)


def glu_config(n_gate_up: int, k: int, m: int) -> GemvConfig:
    """GLU config from the plain GEMV's measured cell of the same [2I, K] weight: each output row
    streams two weight rows, so half the rows per warp keeps the loads in flight (and registers) equal."""
    from latency_specialized.kernels import tuning

    cfg = tuning.config_for(NAME, n_gate_up, k, m, GemvConfig) or default_config(n_gate_up, k, m)
    return replace(cfg, rows_per_warp=max(1, cfg.rows_per_warp // 2))


def gemv_glu(x: torch.Tensor, w_gate_up: torch.Tensor, variant, *, out: torch.Tensor | None = None,
             config: GemvConfig | None = None) -> torch.Tensor:
    """h = act(round(x @ gate.T)) * lin(round(x @ up.T)) in one kernel (mlp_fused's first two steps).

    Parameters
    ----------
    x : [M, K] bf16, M in 1..4, K % 8 == 0.
    w_gate_up : [2I, K] bf16, gate rows then up rows.
    variant : ``gated_act.ActVariant`` of the activation (bf16).
    out : optional [M, I] bf16 destination.
    config : kernel choices; default: :func:`glu_config`.
    """
    from latency_specialized.errors import UserError

    m, n2, k = check_gemm_args(x, w_gate_up, None, None, kmult=8)
    if n2 % 2 or not 1 <= m <= MAX_M:
        raise UserError(f"{NAME} GLU: needs M in 1..{MAX_M} and an even [gate | up] row count (got M={m}, "
                        f"rows={n2}): use mlp_fused's unfused path")
    inter = n2 // 2
    check_gemm_args(x, w_gate_up[:inter], None, out, kmult=8)
    config = config or glu_config(n2, k, m)
    if out is None:
        out = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    compile_gemv(k, m, config, False, glu=variant)(x, w_gate_up, out, out, grid_cap(x.device, config.ctas_per_sm),
                                                   *_norm_args(x, None, 0.0))
    return out


def gemv_split(x: torch.Tensor, weight: torch.Tensor, n_head: int, *, head_out: torch.Tensor | None = None,
               tail_out: torch.Tensor | None = None, config: GemvConfig | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two projections of one x in one weight stream: ``[head | tail] = x @ weight.T`` with the first
    ``n_head`` rows stored as fp32 (unrounded) and the rest rounded to x.dtype.

    The latent MoE's router logits (fp32, vLLM's GateLinear) and latent down-projection read the same
    normed hidden state: one kernel instead of two, one launch and ramp less.

    Parameters
    ----------
    x : [M, K] bf16, M in 1..4, K % 8 == 0.
    weight : [n_head + n_tail, K] bf16 (e.g. ``cat([router weight, latent down weight])``).
    head_out : optional [M, n_head] fp32 destination; tail_out : optional [M, n_tail] bf16 (unit
        column stride, any row stride).
    config : kernel choices; default: the tuning table's entry of the whole weight, else the heuristic.

    Returns
    -------
    (head [M, n_head] fp32, tail [M, n_tail] x.dtype).
    """
    from latency_specialized.errors import UserError

    m, n, k = check_gemm_args(x, weight, None, None, kmult=8)
    if not 1 <= m <= MAX_M or x.dtype != torch.bfloat16:
        raise UserError(f"{NAME} split: serves bf16 M=1..{MAX_M} (got M={m}, {x.dtype}): use the two gemm sites")
    if not 0 < n_head < n:
        raise UserError(f"{NAME} split: n_head={n_head} must be inside the {n} weight rows")
    if head_out is None:
        head_out = torch.empty(m, n_head, dtype=torch.float32, device=x.device)
    if tail_out is None:
        tail_out = torch.empty(m, n - n_head, dtype=x.dtype, device=x.device)
    check_gemm_args(x, weight[:n_head], None, head_out, kmult=8, out_dtype=torch.float32)
    check_gemm_args(x, weight[n_head:], None, tail_out, kmult=8)
    if config is None:
        from latency_specialized.kernels import tuning

        config = tuning.config_for(NAME, n, k, m, GemvConfig) or default_config(n, k, m)
    compile_gemv(k, m, config, False, out_fp32=True, split=True)(x, weight, tail_out, head_out,
                                                                 grid_cap(x.device, config.ctas_per_sm),
                                                                 *_norm_args(x, None, 0.0))
    return head_out, tail_out


def _supports(ctx: OpContext) -> Support:
    from latency_specialized.kernels import tuning

    if ctx.tokens > MAX_M:
        return f"GEMV kernel serves M<={MAX_M} (M={ctx.tokens})"
    if ctx.dim("K") % 8:
        return f"needs K % 8 == 0 (K={ctx.dim('K')})"
    if ctx.attr("out_dtype") not in (None, ctx.dtype, "float32") or (ctx.attr("out_dtype") == "float32"
                                                                     and ctx.attr("residual")):
        return f"writes bf16, or fp32 without a residual (out_dtype={ctx.attr('out_dtype')})"
    return tuning.gemm_supports(NAME, ctx, fp32_out=True)


GATE_DOWN_NAME = "moe.gate_down.cutedsl_gemv"
GATE_DOWN_MAX_M = 4
"""Tokens up to which the fused router + latent GEMV serves (the GEMV's MAX_M). H200, Kimi K3 TP8 layer bench,
same-machine A/B (two repeats each, us per layer, KDA / MLA at context 4096). First session: batch 1 fused 115.3-115.4 /
123.8-124.3 vs two gemm sites 115.0-116.2 / 123.8-124.0 - even, one kernel less; batch 2 then lost
(150.7-151.1 / 173.9-174.1 vs 147.6-148.2 / 168.9-169.9, measured together with the GEMV+GLU shared
expert). Re-measured with the K-split GEMV config (``bench_kimi_k3_tp8_ab_session16.md``): batch 2
142.0-142.3 / 161.0-162.4 vs 142.0-142.2 / 160.7-165.2 - even, one kernel less (KDA batch 2: 13 kernels
without communication). Batch 4 (session 17, ``bench_kimi_k3_tp8_ab_session17.md``): KDA 196.9-197.8 vs
199.8-200.6 us, one kernel less (13 without communication); MLA 158.3-179.0 vs 176.3-179.6 (noisy, not slower)."""


def gate_down_gemv(x: torch.Tensor, weight: torch.Tensor, n_gate: int, *, logits_out: torch.Tensor | None = None,
                   latent_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe.gate_down`` (contract: ``ops.moe.gate_down_reference``) as one split GEMV (``gemv_split``)."""
    return gemv_split(x, weight, n_gate, head_out=logits_out, tail_out=latent_out)


def _gate_down_supports(ctx: OpContext) -> Support:
    from latency_specialized.kernels.compile_cache import cute_available

    if not ctx.arch.startswith("sm_90"):
        return f"GEMV kernels are verified on sm_90 (H200) only, not {ctx.arch}"
    if ctx.dtype != "bfloat16":
        return f"bf16 kernel (dtype={ctx.dtype})"
    if ctx.tokens > GATE_DOWN_MAX_M:
        return f"serves M<={GATE_DOWN_MAX_M} (M={ctx.tokens}): the router and latent gemm sites take larger batches"
    if ctx.dim("K") % 8:
        return f"needs K % 8 == 0 (K={ctx.dim('K')})"
    return cute_available()


IMPLEMENTATIONS = [
    Implementation("gemm", NAME, gemm_gemv, _supports, priority=30, norm_prologue=True, strided_out=True,
                   description="CuTe DSL CUDA-core GEMV, M<=4: 16-B weight stream, warp shuffle, PDL prologue, "
                               "optional RMSNorm prologue"),
    Implementation("moe.gate_down", GATE_DOWN_NAME, gate_down_gemv, _gate_down_supports, priority=30, strided_out=True,
                   description=f"router logits (fp32) + latent down-projection (bf16) in one GEMV, "
                               f"M<={GATE_DOWN_MAX_M}"),
]
