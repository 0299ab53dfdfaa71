"""residual.cutedsl_attnres: Block AttnRes mixing in ONE CuTe DSL kernel.

Contract: the family reference (``models/kimi_k3/attnres.py``, ``attnres_mix_reference``)::

    logit_s = < RMSNorm(v_s) * norm_weight , query >      s < num_sources
    mixed   = sum_s softmax(logit)_s * v_s
    out     = RMSNorm(mixed) * out_norm_weight             (optional)

The reference expands into ~15 small torch kernels per call (three calls per Kimi layer); this is
one launch. One CTA per token row; every thread owns the same 16-byte column vectors of all
``num_sources`` sources (at N = 7168 bf16: 896 threads); up to 4 vectors per thread stay in
registers between the two passes, more are re-read from L1 in the mix pass (ptxas -v: no spills up
to 9 sources, Kimi K3's maximum). Per source the thread's partial <v, w> and <v, v> are reduced by
warp shuffles, then across warps through shared memory in a fixed order (deterministic,
identical in every thread), the softmax is computed redundantly per thread (S <= 16 scalars), the
mix stays in fp32 and, with an output norm, one more block reduction gives its rstd. fp32 math and
one rounding, as the reference.

Weights (norm gain, query, output gain) are loaded before ``griddepcontrol.wait`` (PDL): they do
not depend on the previous kernel.
"""


import functools
from dataclasses import asdict, dataclass

import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels import compile_cache
from latency_specialized.ops.registry import Implementation, OpContext, Support

NAME = "residual.cutedsl_attnres"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MAX_SOURCES = 16    # sources live in registers: S x vectors-per-thread x 8 floats
MAX_THREADS = 1024


@dataclass(frozen=True)
class _Variant:
    """Static choices (hashable: the compile key). M and the source stride are dynamic."""

    n: int
    dtype: str
    sources: int
    out_norm: bool
    pdl: bool = True


@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    from latency_specialized.kernels.gemm_common import ptx

    P = ptx()

    class AttnResKernel:
        def __init__(self, var: _Variant):
            self.var = var
            self.esize = torch.empty(0, dtype=DTYPES[var.dtype]).element_size()
            vecs = var.n * self.esize // 16
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
            tid, _, _ = cute.arch.thread_idx()
            row, _, _ = cute.arch.block_idx()
            vidx = [tid + TR * i for i in range(VPT)]
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
            RELOAD: cutlass.Constexpr = S * VPT > 4

            smem = cutlass.memory.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout(2 * S * 32), byte_alignment=16)
            red2 = smem.allocate_tensor(Float32, cute.make_layout(32), byte_alignment=16)
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
            logits = []
            for s in cutlass.range_constexpr(S):
                dot, ss = Float32(0.0), Float32(0.0)
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
                rstd = cute.math.rsqrt(ss / Float32(var.n) + out_eps, fastmath=False)
                for i in cutlass.range_constexpr(VPT):
                    g = self.unpack(owv[i])
                    mixed[i] = [mixed[i][e] * rstd * g[e] for e in range(len(g))]
            yb = y.iterator.toint() + Int64(row) * RB
            for i in cutlass.range_constexpr(VPT):
                P.st_v4_if(yb + Int64(vidx[i]) * 16, self.pack(mixed[i]), vok[i])

    return AttnResKernel


def compile_attnres(var: _Variant):
    """Compiled kernel for one (N, dtype, sources, out_norm) variant; M and the source stride are dynamic."""

    def build(arch: str):
        import cutlass.cute as cute

        from latency_specialized.kernels.gemm_common import (compile_options, cute_dtype, fake_rows,
                                                             fake_stream, fake_vec)

        m = cute.sym_int()
        dt = cute_dtype(DTYPES[var.dtype])
        args = (fake_rows(dt, m, var.n), 0, fake_vec(dt, var.n), fake_vec(dt, var.n), fake_vec(dt, var.n),
                fake_rows(dt, m, var.n), 1e-5, 1e-5, fake_stream())
        return cute.compile(_kernel_class()(var), *args, options=compile_options(arch))

    return compile_cache.cached_compile(NAME, tuple(sorted(asdict(var).items())), build)


def _check_vec(t: torch.Tensor, name: str, n: int, dtype: torch.dtype) -> None:
    if t.shape != (n,) or t.dtype != dtype or not t.is_contiguous() or t.data_ptr() % 16:
        raise UserError(f"attnres kernel: {name} must be a contiguous, 16-byte aligned [{n}] {dtype} tensor "
                        f"(got {tuple(t.shape)} {t.dtype}): pass {name}.to(sources.dtype).contiguous()")


def attnres_cute(sources: torch.Tensor, num_sources: int, norm_weight: torch.Tensor, query: torch.Tensor,
                 eps: float, *, out_norm_weight: torch.Tensor | None = None, out_eps: float = 1e-5,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Block AttnRes mix in one kernel (contract: the ``residual.attnres`` family reference).

    Parameters
    ----------
    sources : [R, M, N] source-major, R >= num_sources; each source slab row-major with row stride N
        (the slab stride is free: a ``[:, :b]`` view of a larger buffer is fine), 16-byte aligned.
    num_sources : sources mixed, 1..16 (static: part of the compile key).
    norm_weight, query : [N] in sources.dtype. out_norm_weight : [N] or None.

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
    var = _Variant(n, dtype_name, int(num_sources), out_norm_weight is not None)
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
