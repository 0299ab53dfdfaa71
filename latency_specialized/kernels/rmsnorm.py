"""norm.cutedsl_rmsnorm / allreduce.cutedsl_local: residual add + RMSNorm (+ sigmoid gate, zero-centred
gains, weightless) in one pass.

One read of x (and residual, gate, weight), one write of y (and the new residual h): at batch 64
and hidden 7168 that is ~3.7 MB, about a microsecond of HBM time, so the kernel is all about latency: every
load a thread will ever make is issued up front (one or two 16-byte vectors per tensor per thread),
the weights even before ``griddepcontrol.wait`` (they do not depend on the previous kernel), and
a row is spread over up to 1024 threads - or over a *cluster* of 2-4 CTAs, whose partial sums of
squares meet in distributed shared memory - so that small batches still use many SMs.

Numerics follow ops/norm.py exactly: h = x + residual is rounded to the activation dtype first
(the new residual stream) and the norm is computed from that rounded h, in fp32, one rounding at
the end. Sums are reduced in a fixed order (deterministic).

Two layouts, chosen from N:
* block mode (N > 1024 bf16): one CTA (or cluster) per row, warp shuffles then shared memory;
* warp mode (N <= 1024 bf16, e.g. per-head norms of 128): one warp per row, 8 rows per CTA.

With one rank this kernel *is* the fused all-reduce + residual + RMSNorm (allreduce family,
world_size == 1).
"""

import functools
from dataclasses import asdict, dataclass

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.kernels import compile_cache

NAME = "norm.cutedsl_rmsnorm"
AR_NAME = "allreduce.cutedsl_local"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
WARP_MODE_MAX_VECS = 128   # rows of <= 128 16-byte vectors (N <= 1024 bf16) take one warp each
WARP_MODE_ROWS = 8         # rows (warps) per CTA in warp mode


@dataclass(frozen=True)
class NormConfig:
    """Static choices of the norm kernel (hashable: part of the compile key)."""

    cluster: int = 1
    """CTAs per row in block mode (1, 2 or 4): spreads small batches over more SMs."""
    pdl: bool = True
    """Programmatic dependent launch: weight loads start before the previous kernel ends."""


@dataclass(frozen=True)
class NormVariant:
    n: int
    dtype: str
    residual: bool
    weight: bool
    zero_centered: bool
    gate: bool
    norm: bool
    strided_x: bool = False
    """x rows sit ``x.stride(0)`` elements apart (a column slice of a wider tensor), a runtime value;
    every other tensor is contiguous. Only set for a non-contiguous x: the contiguous variants keep
    their compile key and PTX."""


@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    from latency_specialized.kernels.gemm_common import ptx

    P = ptx()

    class RMSNormKernel:
        def __init__(self, var: NormVariant, cfg: NormConfig):
            self.var, self.cfg = var, cfg
            self.esize = torch.empty(0, dtype=DTYPES[var.dtype]).element_size()
            self.vec_elems = 16 // self.esize
            vecs = var.n // self.vec_elems
            self.warp_mode = vecs <= WARP_MODE_MAX_VECS
            cs = 1 if self.warp_mode or not var.norm else cfg.cluster  # add-only needs no reduction
            self.cs = cs
            self.vecs_cta = vecs // cs                       # vectors of a row this CTA owns
            if self.warp_mode:
                self.threads_row = 32
                self.vpt = -(-self.vecs_cta // 32)
                self.block = 32 * WARP_MODE_ROWS
            else:
                self.vpt = -(-self.vecs_cta // 1024)
                self.threads_row = -(-self.vecs_cta // self.vpt)
                self.threads_row = -(-self.threads_row // 32) * 32
                self.block = self.threads_row

        @cute.jit
        def __call__(self, x: cute.Tensor, res: cute.Tensor, w: cute.Tensor, gate: cute.Tensor,
                     y: cute.Tensor, h: cute.Tensor, eps: Float32, stream):
            m = x.shape[0]
            if cutlass.const_expr(self.warp_mode):
                self.kernel(x, res, w, gate, y, h, eps, m).launch(
                    grid=[(m + WARP_MODE_ROWS - 1) // WARP_MODE_ROWS, 1, 1], block=[self.block, 1, 1],
                    stream=stream, use_pdl=self.cfg.pdl)
            elif cutlass.const_expr(self.cs > 1):
                self.kernel(x, res, w, gate, y, h, eps, m).launch(
                    grid=[m, self.cs, 1], block=[self.block, 1, 1], cluster=[1, self.cs, 1],
                    stream=stream, use_pdl=self.cfg.pdl)
            else:
                self.kernel(x, res, w, gate, y, h, eps, m).launch(
                    grid=[m, 1, 1], block=[self.block, 1, 1], stream=stream, use_pdl=self.cfg.pdl)

        # trace-time helpers (plain Python: they only emit IR)
        def unpack(self, words):
            return P.unpack_words(self.var.dtype, words)

        def pack(self, vals):
            return P.pack_words(self.var.dtype, vals)

        @cute.kernel
        def kernel(self, x: cute.Tensor, res: cute.Tensor, w: cute.Tensor, gate: cute.Tensor,
                   y: cute.Tensor, h: cute.Tensor, eps: Float32, m: Int32):
            var = self.var
            VPT: cutlass.Constexpr = self.vpt
            TR: cutlass.Constexpr = self.threads_row
            RB: cutlass.Constexpr = var.n * self.esize            # row bytes
            tid, _, _ = cute.arch.thread_idx()
            bx, rank, _ = cute.arch.block_idx()
            if cutlass.const_expr(self.warp_mode):
                row = bx * WARP_MODE_ROWS + tid // 32
                t = tid % 32
                rank = Int32(0)
            else:
                row = bx
                t = tid
            if cutlass.const_expr(self.cs > 1):
                P.cluster_arrive_relaxed()  # announce "started": peers may write our shared memory
            row_ok = Int32(row < m)
            row_c = cutlass.min(row, m - 1)
            # vector v of this thread: column block of this CTA, then t + TR*i
            vidx = [rank * self.vecs_cta + t + TR * i for i in range(VPT)]
            vok = [Int32(t + TR * i < self.vecs_cta) for i in range(VPT)]
            roff = Int64(row_c) * RB
            if cutlass.const_expr(var.strided_x):
                xroff = Int64(row_c) * Int64(x.stride[0]) * self.esize  # dynamic row stride (elements)
            wv = []
            if cutlass.const_expr(var.weight and var.norm):
                for i in cutlass.range_constexpr(VPT):
                    wv.append(P.ld_weight_if(w.iterator.toint() + Int64(vidx[i]) * 16, vok[i]))
            if cutlass.const_expr(self.cfg.pdl):
                cute.arch.griddepcontrol_wait()
            xs, rs, gs = [], [], []
            for i in cutlass.range_constexpr(VPT):
                ok = vok[i] & row_ok
                off = roff + Int64(vidx[i]) * 16
                if cutlass.const_expr(var.strided_x):
                    xs.append(P.ld_act_if(x.iterator.toint() + (xroff + Int64(vidx[i]) * 16), ok))
                else:
                    xs.append(P.ld_act_if(x.iterator.toint() + off, ok))
                if cutlass.const_expr(var.residual):
                    rs.append(P.ld_act_if(res.iterator.toint() + off, ok))
                if cutlass.const_expr(var.gate and var.norm):
                    gs.append(P.ld_act_if(gate.iterator.toint() + off, ok))
            if cutlass.const_expr(self.cfg.pdl):
                cute.arch.griddepcontrol_launch_dependents()

            # h = round(x + residual): the new residual stream, and what the norm sees
            hf = []
            for i in cutlass.range_constexpr(VPT):
                xf = self.unpack(xs[i])
                if cutlass.const_expr(var.residual):
                    rf = self.unpack(rs[i])
                    hw = self.pack([xf[e] + rf[e] for e in range(len(xf))])
                    off = roff + Int64(vidx[i]) * 16
                    P.st_v4_if(h.iterator.toint() + off, hw, vok[i] & row_ok)
                    hf.append(self.unpack(hw))
                else:
                    hf.append(xf)

            if cutlass.const_expr(var.norm):
                ss = Float32(0.0)
                for i in cutlass.range_constexpr(VPT):
                    for e in cutlass.range_constexpr(len(hf[i])):
                        ss = hf[i][e] * hf[i][e] + ss
                ss = cute.arch.warp_reduction_sum(ss)
                if cutlass.const_expr(not self.warp_mode):
                    nw = TR // 32
                    smem = cutlass.memory.SmemAllocator()
                    part = smem.allocate_tensor(Float32, cute.make_layout(32), byte_alignment=16)
                    slots = smem.allocate_tensor(Float32, cute.make_layout(4), byte_alignment=16)
                    if tid % 32 == 0:
                        part[tid // 32] = ss
                    cute.arch.sync_threads()
                    ss = Float32(0.0)
                    for wi in cutlass.range_constexpr(nw):
                        ss = ss + part[wi]
                    if cutlass.const_expr(self.cs > 1):
                        # push this CTA's sum into slot [rank] of every CTA of the cluster, then each
                        # CTA adds the slots in rank order (same order everywhere: identical rstd)
                        P.cluster_wait()  # every CTA of the cluster has started
                        if tid < self.cs:
                            P.st_cluster_f32(P.smem_addr(slots.iterator) + rank * 4, tid, ss)
                        P.cluster_sync()
                        ss = Float32(0.0)
                        for ci in cutlass.range_constexpr(self.cs):
                            ss = ss + slots[ci]
                rstd = cute.math.rsqrt(ss / Float32(var.n) + eps, fastmath=True)
                for i in cutlass.range_constexpr(VPT):
                    yv = [v * rstd for v in hf[i]]
                    if cutlass.const_expr(var.weight):
                        wf = self.unpack(wv[i])
                        if cutlass.const_expr(var.zero_centered):
                            yv = [yv[e] * (Float32(1.0) + wf[e]) for e in range(len(yv))]
                        else:
                            yv = [yv[e] * wf[e] for e in range(len(yv))]
                    if cutlass.const_expr(var.gate):
                        gf = self.unpack(gs[i])
                        yv = [yv[e] / (Float32(1.0) + cute.math.exp(-gf[e], fastmath=True))
                              for e in range(len(yv))]
                    off = roff + Int64(vidx[i]) * 16
                    P.st_v4_if(y.iterator.toint() + off, self.pack(yv), vok[i] & row_ok)

    return RMSNormKernel


@compile_cache.compile_unit
def compile_norm(var: NormVariant, cfg: NormConfig):
    """Compiled kernel for one (N, dtype, flags) variant; the row count M is dynamic."""

    def build(arch: str):
        import cutlass.cute as cute

        from latency_specialized.kernels.gemm_common import (compile_options, cute_dtype, fake_rows,
                                                             fake_stream, fake_strided_rows, fake_vec)

        m = cute.sym_int()
        dt = cute_dtype(DTYPES[var.dtype])
        row = lambda: fake_rows(dt, m, var.n)  # noqa: E731 - one fresh fake tensor per argument
        xf = fake_strided_rows(dt, m, var.n) if var.strided_x else row()
        args = (xf, row(), fake_vec(dt, var.n), row(), row(), row(), 1e-5, fake_stream())
        return cute.compile(_kernel_class()(var, cfg), *args, options=compile_options(arch))

    # strided_x enters the key only when set: the contiguous variants keep their keys (and disk artifacts)
    key = tuple(sorted((k, v) for k, v in asdict(var).items() if k != "strided_x" or v))
    key += tuple(sorted(asdict(cfg).items()))
    return compile_cache.cached_compile(NAME, key, build)


def default_config(n: int, m: int) -> NormConfig:
    """Clusters only pay when the batch leaves most SMs idle and a row is long."""
    if n >= 4096 and m <= 32:
        return NormConfig(cluster=2)
    return NormConfig()


def _check(x: torch.Tensor, name: str, like: torch.Tensor) -> torch.Tensor:
    if tuple(x.shape) != tuple(like.shape) or x.dtype != like.dtype:
        raise UserError(f"rmsnorm: {name} must match x ({tuple(like.shape)} {like.dtype}), got "
                        f"{tuple(x.shape)} {x.dtype}")
    if not x.is_contiguous() or x.data_ptr() % 16:
        raise UserError(f"rmsnorm kernel needs a contiguous, 16-byte aligned {name}: call .contiguous() first")
    return x


def _rows(x: torch.Tensor, n: int) -> tuple[torch.Tensor, bool]:
    """x as [M, N] rows for the kernel, and whether they are strided (``NormVariant.strided_x``).

    A contiguous x is viewed as is. Otherwise x must view as [-1, N] (2-D x, or N-D x whose leading
    dims merge, e.g. a column slice of a [B, S, W] tensor) with unit column stride, non-overlapping
    rows and 16-byte aligned row starts: a column slice ``t[:, a:b]`` of a wider row-major ``t``.
    """
    fix = "call x.contiguous() first (x.clone() for a contiguous but misaligned x)"
    if x.is_contiguous():
        if x.data_ptr() % 16:
            raise UserError(f"rmsnorm kernel needs a 16-byte aligned x (data_ptr % 16 = {x.data_ptr() % 16}): {fix}")
        return x.view(-1, n), False
    try:
        x2 = x.view(-1, n)
    except RuntimeError:
        raise UserError(f"rmsnorm kernel: a strided x of shape {tuple(x.shape)} stride {x.stride()} does not view "
                        f"as [-1, {n}] rows (strided rows are supported for 2-D x, or N-D x whose leading dims "
                        f"merge): {fix}") from None
    if x2.is_contiguous():
        return x2, False
    es = x.element_size()
    rs, cs = x2.stride()
    if cs != 1 or rs < n or (rs * es) % 16 or x2.data_ptr() % 16:
        raise UserError(f"rmsnorm kernel needs x with unit column stride and non-overlapping, 16-byte aligned rows "
                        f"(row stride >= N, row stride * {es} bytes % 16 == 0, data_ptr % 16 == 0), got shape "
                        f"{tuple(x.shape)} stride {x.stride()} data_ptr % 16 = {x2.data_ptr() % 16}: {fix}")
    return x2, True


def _run(x, weight, eps, residual, gate, zero_centered, out, norm, config, residual_out=None):
    if x.dtype not in DTYPES.values():
        raise UserError(f"rmsnorm kernel supports bf16/fp16/fp32, got {x.dtype}: use norm.reference")
    n = x.shape[-1]
    vec = 16 // x.element_size()
    if n % vec:
        raise UserError(f"rmsnorm kernel needs N % {vec} == 0 (N={n}): use norm.reference")
    x2, strided = _rows(x, n)  # x may have strided rows; every other tensor is contiguous
    m = x2.shape[0]
    dtype_name = {v: k for k, v in DTYPES.items()}[x.dtype]
    if weight is not None and (weight.shape != (n,) or weight.dtype != x.dtype or weight.data_ptr() % 16):
        raise UserError(f"rmsnorm: weight must be a 16-byte aligned [{n}] {x.dtype} tensor "
                        f"(got {tuple(weight.shape)} {weight.dtype}): use weight.to(x.dtype)")
    cfg = config or default_config(n, m)
    if n // vec // max(1, cfg.cluster) * max(1, cfg.cluster) != n // vec:
        cfg = NormConfig(cluster=1, pdl=cfg.pdl)  # N not divisible over the cluster: one CTA per row
    var = NormVariant(n, dtype_name, residual is not None, weight is not None, zero_centered, gate is not None, norm,
                   strided_x=strided)
    y = out if out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if out is not None:
        _check(out, "out", x)
    if residual_out is not None:  # may alias residual: each thread reads its elements before writing them
        _check(residual_out, "residual_out", x)
    h = ((residual_out if residual_out is not None else torch.empty_like(x, memory_format=torch.contiguous_format))
         if residual is not None else y)
    y2 = y.view(-1, n)
    ph = y2 if strided else x2  # placeholder of an absent residual/gate: any compact [M, N] tensor
    r2 = _check(residual, "residual", x).view(-1, n) if residual is not None else ph
    g2 = _check(gate, "gate", x).view(-1, n) if gate is not None else ph
    w1 = weight if weight is not None else x2[0]
    if m:
        compile_norm(var, cfg)(x2, r2, w1, g2, y2, h.view(-1, n), float(eps))
    return y, h


def rmsnorm_cute(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, residual: torch.Tensor | None = None,
                 zero_centered: bool = False, gate: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 config: NormConfig | None = None):
    """RMSNorm (+ residual, + sigmoid gate, zero-centred gains) in one kernel (contract: ops/norm.py).

    Parameters
    ----------
    x : [..., N] bf16/fp16/fp32, N a multiple of 16 bytes; contiguous, or with strided rows: unit
        column stride, row stride >= N, 16-byte aligned row starts (a column slice ``t[:, a:b]`` of a
        wider row-major tensor, e.g. q_a_norm / kv_a_norm on the fused MLA projection; no copy).
        Strided rows are for 2-D x (or N-D x whose leading dims merge into one row dim).
    weight : [N] in x.dtype, or None (weightless).
    residual, gate, out : optional, same shape/dtype as x, contiguous (y is always contiguous).

    Returns
    -------
    y [..., N], or (y, x + residual) when residual is given.
    """
    y, h = _run(x, weight, eps, residual, gate, zero_centered, out, True, config)
    return (y, h) if residual is not None else y


def allreduce_residual_rmsnorm_local(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                                     eps: float, *, comm=None, zero_centered: bool = False,
                                     config: NormConfig | None = None, out=None):
    """The one-rank fused all-reduce + residual + RMSNorm (contract: ops/allreduce.py).

    ``out``: optional (normed, residual_out) destinations; residual_out may be ``residual`` itself.
    Returns (normed, residual_out); normed is None when weight is None (add only).
    """
    ws = getattr(comm, "world_size", 1) if comm is not None else 1
    if ws != 1:
        raise UserError(f"{AR_NAME} is the one-rank case (world_size={ws}): use a multi-rank allreduce "
                        "implementation")
    y_out, h_out = out if out is not None else (None, None)
    if weight is None:
        _, h = _run(partial, None, eps, residual, None, False, None, False, config, residual_out=h_out)
        return None, h
    y, h = _run(partial, weight, eps, residual, None, zero_centered, y_out, True, config, residual_out=h_out)
    return y, h


def _common_supports(ctx: OpContext) -> Support:
    if not ctx.arch.startswith("sm_90"):
        return f"verified on sm_90 (H200) only, not {ctx.arch}"
    if ctx.dtype not in DTYPES:
        return f"dtype {ctx.dtype} not supported (bf16/fp16/fp32)"
    n = ctx.dim("N")
    vec = 16 // torch.empty(0, dtype=DTYPES[ctx.dtype]).element_size()
    if n % vec:
        return f"needs N % {vec} == 0 (N={n})"
    if n // vec > 1024 * 4:
        return f"N={n} too long for one CTA cluster row"
    return compile_cache.cute_available()


def _norm_supports(ctx: OpContext) -> Support:
    return _common_supports(ctx)


def _ar_supports(ctx: OpContext) -> Support:
    if ctx.world_size != 1:
        return f"one-rank kernel (world_size={ctx.world_size}): needs a cross-rank all-reduce"
    return _common_supports(ctx)


IMPLEMENTATIONS = [
    Implementation("norm", NAME, rmsnorm_cute, _norm_supports, priority=20,
                   description="CuTe DSL fused residual+RMSNorm(+gate, zero-centred), all loads up front, PDL",
                   strided_rows=True),  # x only: a column slice compiles a strided-x variant (no copy)
    Implementation("allreduce", AR_NAME, allreduce_residual_rmsnorm_local, _ar_supports, priority=20,
                   description="one rank: fused residual add + RMSNorm in one CuTe DSL kernel"),
]
