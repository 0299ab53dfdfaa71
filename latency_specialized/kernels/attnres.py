"""residual.cutedsl_attnres: Block AttnRes mixing in ONE CuTe DSL kernel.

Contract: the family reference (``ops/attnres.py``, ``attnres_mix_reference``)::

    logit_s = < RMSNorm(v_s) * norm_weight , query >      s < num_sources
    mixed   = sum_s softmax(logit)_s * v_s
    out     = RMSNorm(mixed) * out_norm_weight             (optional)

The reference expands into ~15 small torch kernels per call (three calls per Kimi layer); this is
one launch. One CTA - or one *cluster* of 2-8 CTAs (``AttnResConfig.cluster``) - per token row;
every thread owns the same 16-byte column vectors of all ``num_sources`` sources (at N = 7168 bf16:
896 threads in one CTA, 112 per CTA in a cluster of 8). With one 896-thread CTA, up to 4 vectors per
thread stay in registers between the two passes and more are re-read from L1 in the mix pass
(ptxas -v: no spills up to 9 sources, Kimi K3's maximum); CTAs of <= 256 threads keep up to 16.
Per source the thread's partial <v, w> and <v, v> are reduced by warp shuffles, then across warps
through shared memory in a fixed order; in a cluster each CTA then pushes its 2 x S partial sums
into slot [rank] of every CTA's shared memory (DSMEM) and every CTA adds the slots in rank order
(deterministic, identical in every thread of every CTA). The softmax is computed redundantly per
thread (S <= 16 scalars), the mix stays in fp32 and, with an output norm, one more (cluster)
reduction gives its rstd. fp32 math and one rounding, as the reference.

Why clusters: at batch 1 one CTA reads all S x N x 2 bytes (9 x 14 KB for Kimi K3) through one SM's
load path, and its block reductions run on 28 warps; a cluster of 8 spreads the reads over 8 SMs
(16 KB each) at the price of two cluster barriers: 10.0 -> 3.3 us per call at 9 sources (H200).

Weights (norm gain, query, output gain) are loaded before ``griddepcontrol.wait`` (PDL): they do
not depend on the previous kernel.
"""


import functools
from dataclasses import asdict, dataclass

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.kernels import compile_cache

NAME = "residual.cutedsl_attnres"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MAX_SOURCES = 16    # sources live in registers: S x vectors-per-thread x 8 floats
MAX_THREADS = 1024
CLUSTER_SIZES = (1, 2, 4, 8)   # 8: the portable cluster size limit
SMALL_CTA_THREADS = 256        # CTAs this small keep every source vector in registers


@dataclass(frozen=True)
class AttnResVariant:
    """Static choices (hashable: the compile key). M and the source stride are dynamic."""

    n: int
    dtype: str
    sources: int
    out_norm: bool
    pdl: bool = True
    cluster: int = 1
    """CTAs per row (``AttnResConfig.cluster``); 1 stays out of the compile key (older artifacts)."""


@dataclass(frozen=True)
class AttnResConfig:
    """Static launch choice of the AttnRes kernel."""

    cluster: int = 1
    """CTAs per token row (1, 2, 4 or 8; N's 16-byte vectors must split evenly)."""


CLUSTER_MAX = 8
"""Largest cluster the default config takes (1: one CTA per row everywhere; A/B runs override it)."""


def default_config(n: int, m: int, esize: int = 2) -> AttnResConfig:
    """CTAs per row by batch, measured on the H200 (``ops_norm.md``: Kimi K3 N = 7168, 2 and 9 sources
    with the output norm; us per call, one CTA -> the pick): 8 up to 8 rows (9 sources 10.0 -> 3.3 us at
    M=1, 10.3 -> 3.6 at M=8; 2 sources 3.2 -> 2.0), 4 up to 32 rows (M=16: 10.5 -> 4.0; M=32, 2 sources:
    2.87 vs 2.90 with 8), 2 beyond (M=64, 9 sources: 11.8 -> 7.3; 4 and 8 CTAs 8.9 and 10.1). Capped by
    ``CLUSTER_MAX``; one CTA wherever N does not split evenly."""
    want = 8 if m <= 8 else 4 if m <= 32 else 2
    want = min(want, CLUSTER_MAX)
    return AttnResConfig(cluster=want if fits(n, esize, want) else 1)


def fits(n: int, esize: int, cluster: int) -> bool:
    """Whether a row of N elements splits into ``cluster`` equal runs of 16-byte vectors."""
    vecs = n * esize // 16
    return cluster in CLUSTER_SIZES and vecs % cluster == 0 and -(-vecs // cluster // MAX_THREADS) <= 4


@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    from latency_specialized.kernels.gemm_common import ptx

    P = ptx()

    class AttnResKernel:
        def __init__(self, var: AttnResVariant):
            self.var = var
            self.esize = torch.empty(0, dtype=DTYPES[var.dtype]).element_size()
            self.cs = var.cluster
            vecs = var.n * self.esize // 16 // self.cs     # vectors of a row this CTA owns
            self.vecs = vecs
            self.vpt = -(-vecs // MAX_THREADS)
            tr = -(-vecs // self.vpt)
            self.threads = -(-tr // 32) * 32
            self.warps = self.threads // 32

        # trace-time helpers (plain Python: they only emit IR)
        def unpack(self, words):
            return P.unpack_words(self.var.dtype, words)

        def pack(self, vals):
            return P.pack_words(self.var.dtype, vals)

        @cute.jit
        def __call__(self, src: cute.Tensor, src_stride: Int64, nw: cute.Tensor, q: cute.Tensor,
                     ow: cute.Tensor, y: cute.Tensor, eps: Float32, out_eps: Float32, stream):
            m = src.shape[0]
            if cutlass.const_expr(self.cs > 1):
                self.kernel(src, src_stride, nw, q, ow, y, eps, out_eps, m).launch(
                    grid=[m, self.cs, 1], block=[self.threads, 1, 1], cluster=[1, self.cs, 1],
                    stream=stream, use_pdl=self.var.pdl)
            else:
                self.kernel(src, src_stride, nw, q, ow, y, eps, out_eps, m).launch(
                    grid=[m, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=self.var.pdl)

        @cute.kernel
        def kernel(self, src: cute.Tensor, src_stride: Int64, nw: cute.Tensor, q: cute.Tensor,
                   ow: cute.Tensor, y: cute.Tensor, eps: Float32, out_eps: Float32, m: Int32):
            var = self.var
            S: cutlass.Constexpr = var.sources
            VPT: cutlass.Constexpr = self.vpt
            TR: cutlass.Constexpr = self.threads
            NW: cutlass.Constexpr = self.warps
            RB: cutlass.Constexpr = var.n * self.esize
            CS: cutlass.Constexpr = self.cs
            tid, _, _ = cute.arch.thread_idx()
            row, rank, _ = cute.arch.block_idx()      # rank: this CTA's column run (cluster [1, CS, 1])
            if cutlass.const_expr(CS > 1):
                P.cluster_arrive_relaxed()            # announce "started": peers may write our smem
            vidx = [rank * self.vecs + tid + TR * i for i in range(VPT)]
            vok = [Int32(tid + TR * i < self.vecs) for i in range(VPT)]
            # weights first (independent of the previous kernel), then wait for its outputs
            nwv, qv, owv = [], [], []
            for i in cutlass.range_constexpr(VPT):
                off = Int64(vidx[i]) * 16
                nwv.append(P.ld_weight_if(nw.iterator.toint() + off, vok[i]))
                qv.append(P.ld_weight_if(q.iterator.toint() + off, vok[i]))
                if cutlass.const_expr(var.out_norm):
                    owv.append(P.ld_weight_if(ow.iterator.toint() + off, vok[i]))
            if cutlass.const_expr(var.pdl):
                cute.arch.griddepcontrol_wait()
            base = src.iterator.toint() + Int64(row) * RB
            vs = []   # vs[s][i]: words of source s, vector i
            for s in cutlass.range_constexpr(S):
                vs.append([P.ld_act_if(base + Int64(s) * src_stride + Int64(vidx[i]) * 16, vok[i])
                           for i in range(VPT)])
            if cutlass.const_expr(var.pdl):
                cute.arch.griddepcontrol_launch_dependents()

            # Sources stay packed (4 words per vector) and are unpacked where used. Beyond 4 vectors
            # per thread the mix re-reads them (L1 hits: ld.global.nc allocates in L1) instead of
            # keeping them live across the reduction: 9 sources would exceed the 72 registers a
            # 896-thread CTA allows and spill (checked with ptxas -v).
            RELOAD: cutlass.Constexpr = S * VPT > (16 if TR <= SMALL_CTA_THREADS else 4)

            smem = cutlass.memory.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout(2 * S * 32), byte_alignment=16)
            red2 = smem.allocate_tensor(Float32, cute.make_layout(32), byte_alignment=16)
            # cluster slots: [rank][2 S] partial (dot, ss) per source, [rank] output-norm partial
            slots = smem.allocate_tensor(Float32, cute.make_layout(2 * S * CS), byte_alignment=16)
            slots2 = smem.allocate_tensor(Float32, cute.make_layout(CS), byte_alignment=16)
            lane, warp = tid % 32, tid // 32
            for s in cutlass.range_constexpr(S):
                dot, ss = Float32(0.0), Float32(0.0)
                for i in cutlass.range_constexpr(VPT):
                    v, a, b = self.unpack(vs[s][i]), self.unpack(nwv[i]), self.unpack(qv[i])
                    for e in cutlass.range_constexpr(len(v)):
                        dot = v[e] * (a[e] * b[e]) + dot      # w = norm_weight * query, fp32
                        ss = v[e] * v[e] + ss
                dot = cute.arch.warp_reduction_sum(dot)
                ss = cute.arch.warp_reduction_sum(ss)
                if lane == 0:
                    red[(2 * s) * 32 + warp] = dot
                    red[(2 * s + 1) * 32 + warp] = ss
            cute.arch.sync_threads()
            if cutlass.const_expr(CS > 1):
                # thread j < 2 S owns partial j of this CTA and pushes it into slot [rank][j] of every
                # CTA of the cluster (its own included); then every CTA adds the slots in rank order
                P.cluster_wait()  # every CTA of the cluster has started (its shared memory exists)
                if tid < 2 * S:
                    part = Float32(0.0)
                    for wi in cutlass.range_constexpr(NW):
                        part = part + red[tid * 32 + wi]
                    dst = P.smem_addr(slots.iterator) + (rank * (2 * S) + tid) * 4
                    for ci in cutlass.range_constexpr(CS):
                        P.st_cluster_f32(dst, ci, part)
                P.cluster_sync()
            logits = []
            for s in cutlass.range_constexpr(S):
                dot, ss = Float32(0.0), Float32(0.0)
                if cutlass.const_expr(CS > 1):
                    for ci in cutlass.range_constexpr(CS):
                        dot = dot + slots[ci * (2 * S) + 2 * s]
                        ss = ss + slots[ci * (2 * S) + 2 * s + 1]
                else:
                    for wi in cutlass.range_constexpr(NW):
                        dot = dot + red[(2 * s) * 32 + wi]
                        ss = ss + red[(2 * s + 1) * 32 + wi]
                logits.append(dot * cute.math.rsqrt(ss / Float32(var.n) + eps, fastmath=False))
            mx = logits[0]
            for s in cutlass.range_constexpr(1, S):
                mx = cutlass.max(mx, logits[s])
            ex = [cute.math.exp(logits[s] - mx, fastmath=False) for s in range(S)]
            tot = ex[0]
            for s in cutlass.range_constexpr(1, S):
                tot = tot + ex[s]
            p = [ex[s] / tot for s in range(S)]

            mixed = []
            for i in cutlass.range_constexpr(VPT):
                if cutlass.const_expr(RELOAD):
                    words = [P.ld_act_if(base + Int64(s) * src_stride + Int64(vidx[i]) * 16, vok[i])
                             for s in range(S)]
                else:
                    words = [vs[s][i] for s in range(S)]
                v = self.unpack(words[0])
                acc = [v[e] * p[0] for e in range(len(v))]
                for s in cutlass.range_constexpr(1, S):
                    v = self.unpack(words[s])
                    acc = [v[e] * p[s] + acc[e] for e in range(len(acc))]
                mixed.append(acc)
            if cutlass.const_expr(var.out_norm):
                ss = Float32(0.0)
                for i in cutlass.range_constexpr(VPT):
                    for e in cutlass.range_constexpr(len(mixed[i])):
                        ss = mixed[i][e] * mixed[i][e] + ss
                ss = cute.arch.warp_reduction_sum(ss)
                if lane == 0:
                    red2[warp] = ss
                cute.arch.sync_threads()
                ss = Float32(0.0)
                for wi in cutlass.range_constexpr(NW):
                    ss = ss + red2[wi]
                if cutlass.const_expr(CS > 1):
                    if tid < CS:
                        P.st_cluster_f32(P.smem_addr(slots2.iterator) + rank * 4, tid, ss)
                    P.cluster_sync()
                    ss = Float32(0.0)
                    for ci in cutlass.range_constexpr(CS):
                        ss = ss + slots2[ci]
                rstd = cute.math.rsqrt(ss / Float32(var.n) + out_eps, fastmath=False)
                for i in cutlass.range_constexpr(VPT):
                    g = self.unpack(owv[i])
                    mixed[i] = [mixed[i][e] * rstd * g[e] for e in range(len(g))]
            yb = y.iterator.toint() + Int64(row) * RB
            for i in cutlass.range_constexpr(VPT):
                P.st_v4_if(yb + Int64(vidx[i]) * 16, self.pack(mixed[i]), vok[i])

    return AttnResKernel


@compile_cache.compile_unit
def compile_attnres(var: AttnResVariant):
    """Compiled kernel for one (N, dtype, sources, out_norm, cluster) variant; M and the source stride are
    dynamic."""

    def build(arch: str):
        import cutlass.cute as cute

        from latency_specialized.kernels.gemm_common import (compile_options, cute_dtype, fake_rows,
                                                             fake_stream, fake_vec)

        m = cute.sym_int()
        dt = cute_dtype(DTYPES[var.dtype])
        args = (fake_rows(dt, m, var.n), 0, fake_vec(dt, var.n), fake_vec(dt, var.n), fake_vec(dt, var.n),
                fake_rows(dt, m, var.n), 1e-5, 1e-5, fake_stream())
        return cute.compile(_kernel_class()(var), *args, options=compile_options(arch))

    # cluster enters the key only when > 1: the one-CTA variants keep their keys (and disk artifacts)
    key = tuple(sorted((k, v) for k, v in asdict(var).items() if k != "cluster" or v > 1))
    return compile_cache.cached_compile(NAME, key, build)


def _check_vec(t: torch.Tensor, name: str, n: int, dtype: torch.dtype) -> None:
    if t.shape != (n,) or t.dtype != dtype or not t.is_contiguous() or t.data_ptr() % 16:
        raise UserError(f"attnres kernel: {name} must be a contiguous, 16-byte aligned [{n}] {dtype} tensor "
                        f"(got {tuple(t.shape)} {t.dtype}): pass {name}.to(sources.dtype).contiguous()")


def attnres_cute(sources: torch.Tensor, num_sources: int, norm_weight: torch.Tensor, query: torch.Tensor,
                 eps: float, *, out_norm_weight: torch.Tensor | None = None, out_eps: float = 1e-5,
                 out: torch.Tensor | None = None, config: AttnResConfig | None = None) -> torch.Tensor:
    """Block AttnRes mix in one kernel (contract: the ``residual.attnres`` family reference).

    Parameters
    ----------
    sources : [R, M, N] source-major, R >= num_sources; each source slab row-major with row stride N
        (the slab stride is free: a ``[:, :b]`` view of a larger buffer is fine), 16-byte aligned.
    num_sources : sources mixed, 1..16 (static: part of the compile key).
    norm_weight, query : [N] in sources.dtype. out_norm_weight : [N] or None.
    config : CTAs per row; default ``default_config(N, M)`` (one CTA where N does not split evenly).

    Returns
    -------
    [M, N] in sources.dtype (``out`` when given).
    """
    if sources.dtype not in DTYPES.values():
        raise UserError(f"attnres kernel supports bf16/fp16/fp32, got {sources.dtype}: use residual.attnres.reference")
    if sources.dim() != 3 or not 1 <= num_sources <= min(MAX_SOURCES, sources.shape[0]):
        raise UserError(f"attnres kernel: sources must be [R, M, N] with 1 <= num_sources <= min(R, {MAX_SOURCES}) "
                        f"(got {tuple(sources.shape)}, num_sources={num_sources}): use residual.attnres.reference")
    _, m, n = sources.shape
    es = sources.element_size()
    if sources.stride(2) != 1 or (m > 1 and sources.stride(1) != n) or (n * es) % 16 \
            or (sources.stride(0) * es) % 16 or sources.data_ptr() % 16:
        raise UserError("attnres kernel needs each source slab row-major (row stride N), 16-byte aligned rows and "
                        "slabs: pass a [R, M, N] buffer (or a [:, :M] view of one)")
    for t, nm in ((norm_weight, "norm_weight"), (query, "query")):
        _check_vec(t, nm, n, sources.dtype)
    if out_norm_weight is not None:
        _check_vec(out_norm_weight, "out_norm_weight", n, sources.dtype)
    y = out if out is not None else torch.empty(m, n, dtype=sources.dtype, device=sources.device)
    if tuple(y.shape) != (m, n) or y.dtype != sources.dtype or not y.is_contiguous() or y.data_ptr() % 16:
        raise UserError(f"attnres kernel: out must be a contiguous [{m}, {n}] {sources.dtype} tensor")
    if m == 0:
        return y
    dtype_name = {v: k for k, v in DTYPES.items()}[sources.dtype]
    cfg = config or default_config(n, m, es)
    if not fits(n, es, cfg.cluster):
        raise UserError(f"attnres kernel: a row of N={n} ({n * es // 16} 16-byte vectors) does not split over a "
                        f"cluster of {cfg.cluster} (sizes {CLUSTER_SIZES}, equal runs of <= {4 * MAX_THREADS} "
                        f"vectors): pass AttnResConfig(cluster=1)")
    var = AttnResVariant(n, dtype_name, int(num_sources), out_norm_weight is not None, cluster=cfg.cluster)
    ow = out_norm_weight if out_norm_weight is not None else norm_weight
    compile_attnres(var)(sources[0], sources.stride(0) * es, norm_weight, query, ow, y, float(eps), float(out_eps))
    return y


def _supports(ctx: OpContext) -> Support:
    if not ctx.arch.startswith("sm_90"):
        return f"verified on sm_90 (H200) only, not {ctx.arch}"
    if ctx.dtype not in DTYPES:
        return f"dtype {ctx.dtype} not supported (bf16/fp16/fp32)"
    n = ctx.dim("N")
    es = torch.empty(0, dtype=DTYPES[ctx.dtype]).element_size()
    if (n * es) % 16:
        return f"needs N * {es} bytes % 16 == 0 (N={n})"
    if -(-(n * es // 16) // MAX_THREADS) > 4:
        return f"N={n} too long for one CTA per row"
    try:
        rows = ctx.dim("R")
    except KeyError:
        rows = None
    if rows is not None and rows > MAX_SOURCES:
        return f"{rows} sources > {MAX_SOURCES} (kept in registers)"
    return compile_cache.cute_available()


IMPLEMENTATIONS = [
    Implementation("residual.attnres", NAME, attnres_cute, _supports, priority=20,
                   description="CuTe DSL one-kernel AttnRes: sources in registers, block softmax, fused RMSNorm, PDL"),
]
