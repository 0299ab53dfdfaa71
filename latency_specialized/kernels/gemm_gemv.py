"""gemm.cutedsl_gemv: y[M, N] = x[M, K] @ W[N, K]^T (+ residual) for M = 1..4 on CUDA cores.

Decode at M = 1-2 is a pure weight stream: 2 bytes of weight per 2*M FLOP. The kernel therefore
only has to keep enough 16-byte weight loads in flight to saturate HBM and must not waste the
ramp/tail (cuBLAS loses 35-60% there, PERF.md):

* one warp per ``rows_per_warp`` output rows; lane ``l`` reads 16-byte vectors ``l, l+32, ...``
  of each row, so one warp instruction reads 512 contiguous bytes;
* loads are issued ``batch`` vectors per row at a time before any arithmetic (all fully
  unrolled: K is a compile-time constant), weights through the non-coherent path with no L1
  allocation; x (tiny, re-read by every warp) stays in L1;
* with PDL the first weight batch is requested *before* ``griddepcontrol.wait``: weights do not
  depend on the previous kernel, so their DRAM latency overlaps the previous kernel's tail;
* one warp-shuffle butterfly per (row, token) at the end, fp32 throughout, one rounding.

Anatomy: config -> kernel class (built on first use; cutlass is imported lazily) -> cached
compile (static K, M, config; N dynamic) -> public wrapper with ``residual=``/``out=``.
"""


import functools
from dataclasses import asdict, dataclass

import torch

from latency_specialized.kernels import compile_cache
from latency_specialized.kernels.gemm_common import check_gemm_args, grid_cap, max_regs
from latency_specialized.ops.registry import Implementation, OpContext, Support

NAME = "gemm.cutedsl_gemv"
MAX_M = 4


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

    def label(self) -> str:
        cap = f"g{self.ctas_per_sm}" if self.ctas_per_sm else ""
        return f"r{self.rows_per_warp}w{self.warps}b{self.batch}{cap}{'p' if self.pdl else ''}"


@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    from latency_specialized.kernels.gemm_common import ptx

    P = ptx()

    class GemvKernel:
        def __init__(self, k: int, m: int, cfg: GemvConfig, residual: bool):
            self.k, self.m, self.cfg, self.residual = k, m, cfg, residual
            self.vecs = k // 8                      # 16-byte vectors per row
            self.full, self.tail = divmod(self.vecs, 32)
            self.iters = self.full + (1 if self.tail else 0)

        @cute.jit
        def __call__(self, x: cute.Tensor, w: cute.Tensor, res: cute.Tensor, y: cute.Tensor, cap: Int32, stream):
            n = w.shape[0]
            rows_per_cta = self.cfg.warps * self.cfg.rows_per_warp
            groups = (n + rows_per_cta - 1) // rows_per_cta
            self.kernel(x, w, res, y, n, groups).launch(
                grid=[cutlass.min(groups, cap), 1, 1], block=[32 * self.cfg.warps, 1, 1],
                stream=stream, use_pdl=self.cfg.pdl)

        @cute.kernel
        def kernel(self, x: cute.Tensor, w: cute.Tensor, res: cute.Tensor, y: cute.Tensor, n: Int32,
                   groups: Int32):
            # grid = min(row groups, cap): with a cap (ctas_per_sm) the CTAs stay resident and walk
            # the row groups, leaving SM room for the next kernel's PDL prologue
            bid, _, _ = cute.arch.block_idx()
            grid, _, _ = cute.arch.grid_dim()
            if cutlass.const_expr(self.cfg.ctas_per_sm > 0):
                # one loop, no peeled first group (the body is large: K is fully unrolled);
                # griddepcontrol.wait is a no-op once the previous grid has completed
                for gi in range(bid, groups, grid):
                    self.group(x, w, res, y, n, gi)
            else:
                self.group(x, w, res, y, n, bid)

        @cute.jit
        def group(self, x: cute.Tensor, w: cute.Tensor, res: cute.Tensor, y: cute.Tensor, n: Int32, gi: Int32):
            R: cutlass.Constexpr = self.cfg.rows_per_warp
            M: cutlass.Constexpr = self.m
            K: cutlass.Constexpr = self.k
            B: cutlass.Constexpr = self.cfg.batch
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            row0 = (gi * self.cfg.warps + tid // 32) * R
            tail_ok = Int32(lane < self.tail)
            # Rows past N re-read row N-1 (always valid memory) and are never stored: no predicate
            # on the hot loads.
            w_base = []
            for r in cutlass.range_constexpr(R):
                row = cutlass.min(row0 + r, n - 1)
                w_base.append(w.iterator.toint() + Int64(row) * (2 * K) + Int64(lane) * 16)
            x_base = [x.iterator.toint() + Int64(m * 2 * K) + Int64(lane) * 16 for m in range(M)]
            acc = [[Float32(0.0) for _ in range(M)] for _ in range(R)]
            for b0 in cutlass.range_constexpr(0, self.iters, B):
                its = list(range(b0, min(b0 + B, self.iters)))
                wv = {}
                for r in cutlass.range_constexpr(R):
                    for i in its:
                        addr = w_base[r] + Int64(i * 512)
                        if cutlass.const_expr(i == self.full):
                            wv[(r, i)] = P.ld_weight_if(addr, tail_ok)
                        else:
                            wv[(r, i)] = P.ld_weight(addr)
                if cutlass.const_expr(b0 == 0 and self.cfg.pdl):
                    cute.arch.griddepcontrol_wait()
                    cute.arch.griddepcontrol_launch_dependents()
                for i in its:
                    wf = [P.unpack_bf16x8(wv[(r, i)]) for r in range(R)]
                    for m in cutlass.range_constexpr(M):
                        addr = x_base[m] + Int64(i * 512)
                        if cutlass.const_expr(i == self.full):
                            xw = P.ld_act_if(addr, tail_ok)
                        else:
                            xw = P.ld_act(addr)
                        xf = P.unpack_bf16x8(xw)
                        for r in cutlass.range_constexpr(R):
                            # a short per-vector chain, then one add: iterations stay independent
                            t = wf[r][0] * xf[0]
                            for j in cutlass.range_constexpr(1, 8):
                                t = wf[r][j] * xf[j] + t
                            acc[r][m] = acc[r][m] + t
            for r in cutlass.range_constexpr(R):
                for m in cutlass.range_constexpr(M):
                    acc[r][m] = cute.arch.warp_reduction_sum(acc[r][m])
            if lane == 0:
                for r in cutlass.range_constexpr(R):
                    row = row0 + r
                    if row < n:
                        for m in cutlass.range_constexpr(M):
                            v = acc[r][m]
                            if cutlass.const_expr(self.residual):
                                v = v + res[m, row].to(Float32)
                            y[m, row] = v.to(y.element_type)

    return GemvKernel


def compile_gemv(k: int, m: int, cfg: GemvConfig, residual: bool, out_fp32: bool = False):
    """Compiled kernel for (K, M, config, residual, output dtype); N is dynamic (one compile per K and M).

    ``out_fp32``: the accumulator is stored as fp32 (router logits) instead of rounded to bf16;
    the (unused) residual operand then has the output's type, so the output buffer can stand in."""
    if out_fp32 and residual:
        raise ValueError("fp32 output with a residual is not a gemm site of any model: not compiled")

    def build(arch: str):
        import cutlass
        import cutlass.cute as cute

        from latency_specialized.kernels.gemm_common import compile_options, fake_rows, fake_stream, fake_strided_rows

        n = cute.sym_int()
        bf = cutlass.BFloat16
        yt = cutlass.Float32 if out_fp32 else bf
        args = (fake_rows(bf, m, k), fake_rows(bf, n, k), fake_strided_rows(yt, m, n), fake_strided_rows(yt, m, n), 1,
                fake_stream())
        return cute.compile(_kernel_class()(k, m, cfg, residual), *args,
                            options=compile_options(arch, max_regs(32 * cfg.warps, cfg.ctas_per_sm)))

    # "strided_out": residual/out take a dynamic row stride (artifacts cached before that differ)
    key = (k, m, residual, "strided_out") + (("out_fp32",) if out_fp32 else ()) + tuple(sorted(asdict(cfg).items()))
    return compile_cache.cached_compile(NAME, key, build)


def default_config(n: int, k: int, m: int) -> GemvConfig:
    """Heuristic used where the tuning table has no entry (tests, shapes off the model)."""
    return GemvConfig(rows_per_warp=2 if m == 1 and n >= 4096 else 1)


def gemm_gemv(x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
              out: torch.Tensor | None = None, config: GemvConfig | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ residual) with the CUDA-core GEMV kernel (gemm contract, ops/gemm.py).

    Parameters
    ----------
    x : [M, K] bf16, M in 1..4, K % 8 == 0.
    weight : [N, K] bf16.
    residual : optional [M, N] bf16 added before the single rounding.
    out : optional [M, N] destination (bf16, or fp32 with ``out_dtype=torch.float32``).
    config : kernel choices; default: the tuning table's, else a heuristic.
    out_dtype : torch.float32 stores the fp32 accumulator unrounded (router logits, no residual).
    """
    from latency_specialized.errors import UserError

    fp32 = out_dtype is not None and out_dtype != x.dtype
    if fp32 and (out_dtype != torch.float32 or residual is not None):
        raise UserError(f"{NAME}: out_dtype={out_dtype} (with residual={residual is not None}): the kernel writes "
                        "bf16, or fp32 without a residual; use gemm.cublas")
    m, n, k = check_gemm_args(x, weight, residual, out, kmult=8, out_dtype=out_dtype)
    if not 1 <= m <= MAX_M:
        raise UserError(f"{NAME} serves M=1..{MAX_M} (got M={m}): use gemm.cutedsl_small_m or gemm.cublas")
    if config is None:
        from latency_specialized.kernels import tuning

        config = tuning.config_for(NAME, n, k, m, GemvConfig) or default_config(n, k, m)
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32 if fp32 else x.dtype, device=x.device)
    fn = compile_gemv(k, m, config, residual is not None, out_fp32=fp32)
    fn(x, weight, residual if residual is not None else out, out, grid_cap(x.device, config.ctas_per_sm))
    return out


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


IMPLEMENTATIONS = [
    Implementation("gemm", NAME, gemm_gemv, _supports, priority=30,
                   description="CuTe DSL CUDA-core GEMV, M<=4: 16-B weight stream, warp shuffle, PDL prologue"),
]
