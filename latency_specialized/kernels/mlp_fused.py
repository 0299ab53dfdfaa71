"""mlp.cutedsl_fused: gated MLP (dense layers, shared experts) as 2-3 kernels, no host syncs.

Contract: ``ops/mlp.py`` (``mlp_reference``): gate/up GEMM rounded to x.dtype, act(gate) * lin(up) in
fp32 rounded to x.dtype, down GEMM. The reference runs ~10 torch kernels (fp32 casts of both
weights included); this is

1. gate/up GEMM through the best *fast* gemm implementation for (M, 2I, K) (GEMV / small-M / cuBLAS,
   chosen by the gemm family's own ``supports()``, which reads the measured dispatch table);
2. one CuTe DSL elementwise kernel: SwiGLU (optionally clamped) or SiTU-GLU of [M, 2I] -> [M, I];
3. down GEMM, chosen the same way for (M, N, I).

Where step 1 is the GEMV (M <= 4, bf16), steps 1-2 are one kernel: the GEMV's GLU epilogue
(``gemm_gemv.gemv_glu``) streams the gate and up rows of each output together and applies the same
activation function (``gated_act_fn``) to the same bf16-rounded sums - bit-identical, one launch
and one [M, 2I] round trip fewer.

Which gemm serves each projection is decided once per (M, N, K, arch, dtype) and cached, so graph
capture and replay see fixed kernels.
"""

import functools
from dataclasses import asdict, dataclass

import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels import compile_cache
from latency_specialized.ops.registry import Implementation, OpContext, Support, make_context
from latency_specialized.spec import ActivationSpec

NAME = "mlp.cutedsl_fused"
ACT_NAME = "activation.cutedsl_gated"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
THREADS = 128


@dataclass(frozen=True)
class _ActVariant:
    inter: int          # I: output width; the input row is [gate (I) | up (I)]
    dtype: str
    kind: str
    beta: float = 0.0
    beta_lin: float = 0.0
    clamp: float = 0.0  # 0: no clamp (swiglu)
    pdl: bool = True


@functools.cache
def gated_act_fn(var: _ActVariant):
    """Device function ``(g, u) -> act(g) * lin(up)`` in fp32 for a kernel body (the activation
    kernel's and the GLU GEMV's epilogue; one definition so the two stay bit-identical)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32

    def act(g, u):
        one = Float32(1.0)
        if cutlass.const_expr(var.kind == "swiglu"):
            if cutlass.const_expr(var.clamp > 0.0):
                g = cutlass.min(g, Float32(var.clamp))
                u = cutlass.max(cutlass.min(u, Float32(var.clamp)), Float32(-var.clamp))
            return g / (one + cute.math.exp(-g, fastmath=False)) * u
        b, bl = Float32(var.beta), Float32(var.beta_lin)
        sig = one / (one + cute.math.exp(-g, fastmath=False))
        return b * cute.math.tanh(g / b, fastmath=False) * sig * (bl * cute.math.tanh(u / bl, fastmath=False))

    return act


@functools.cache
def _act_kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    from latency_specialized.kernels.gemm_common import ptx

    P = ptx()

    class GatedActKernel:
        def __init__(self, var: _ActVariant):
            self.var = var
            self.act = gated_act_fn(var)        # (g, u) -> fp32, shared with the GLU GEMV epilogue
            self.vecs = var.inter // 8          # 16-byte vectors of one output row (bf16/fp16)
            self.blocks = -(-self.vecs // THREADS)

        def unpack(self, words):
            return P.unpack_words(self.var.dtype, words)

        def pack(self, vals):
            return P.pack_words(self.var.dtype, vals)

        @cute.jit
        def __call__(self, gu: cute.Tensor, h: cute.Tensor, stream):
            m = gu.shape[0]
            self.kernel(gu, h, m).launch(grid=[self.blocks, m, 1], block=[THREADS, 1, 1], stream=stream,
                                         use_pdl=self.var.pdl)

        @cute.kernel
        def kernel(self, gu: cute.Tensor, h: cute.Tensor, m: Int32):
            tid, _, _ = cute.arch.thread_idx()
            bx, row, _ = cute.arch.block_idx()
            v = bx * THREADS + tid
            ok = Int32(v < self.vecs)
            ib = self.var.inter * 2    # bytes of I elements
            if cutlass.const_expr(self.var.pdl):
                cute.arch.griddepcontrol_wait()
            rb = gu.iterator.toint() + Int64(row) * (2 * ib)
            gw = P.ld_act_if(rb + Int64(v) * 16, ok)
            uw = P.ld_act_if(rb + ib + Int64(v) * 16, ok)
            if cutlass.const_expr(self.var.pdl):
                cute.arch.griddepcontrol_launch_dependents()
            g, u = self.unpack(gw), self.unpack(uw)
            out = [self.act(g[e], u[e]) for e in range(8)]
            P.st_v4_if(h.iterator.toint() + Int64(row) * ib + Int64(v) * 16, self.pack(out), ok)

    return GatedActKernel


def _act_variant(inter: int, dtype: torch.dtype, act: ActivationSpec) -> _ActVariant:
    name = {v: k for k, v in DTYPES.items()}.get(dtype)
    if name is None:
        raise UserError(f"fused MLP kernel supports bf16/fp16, got {dtype}: use mlp.reference")
    if inter % 8:
        raise UserError(f"fused MLP kernel needs the intermediate width % 8 == 0 (got {inter}): use mlp.reference")
    if act.kind == "situ_glu":
        return _ActVariant(inter, name, "situ_glu", beta=float(act.beta), beta_lin=float(act.beta_lin))
    if act.kind == "swiglu":
        return _ActVariant(inter, name, "swiglu", clamp=float(act.clamp or 0.0))
    raise UserError(f"fused MLP kernel: unknown activation {act.kind!r}: use mlp.reference")


def compile_act(var: _ActVariant):
    """Compiled gated-activation kernel for one (I, dtype, activation); M is dynamic."""

    def build(arch: str):
        import cutlass.cute as cute

        from latency_specialized.kernels.gemm_common import compile_options, cute_dtype, fake_rows, fake_stream

        m = cute.sym_int()
        dt = cute_dtype(DTYPES[var.dtype])
        return cute.compile(_act_kernel_class()(var), fake_rows(dt, m, 2 * var.inter), fake_rows(dt, m, var.inter),
                            fake_stream(), options=compile_options(arch))

    return compile_cache.cached_compile(ACT_NAME, tuple(sorted(asdict(var).items())), build)


def gated_activation_cute(gate_up: torch.Tensor, act: ActivationSpec, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """act(gate) * lin(up) of a [M, 2I] ``[gate | up]`` tensor in one kernel -> [M, I] (x.dtype, one rounding)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous() or gate_up.data_ptr() % 16:
        raise UserError(f"gated activation kernel needs a contiguous [M, 2I] tensor (got {tuple(gate_up.shape)}): "
                        "call .contiguous() first")
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    var = _act_variant(inter, gate_up.dtype, act)
    h = out if out is not None else torch.empty(m, inter, dtype=gate_up.dtype, device=gate_up.device)
    if m:
        compile_act(var)(gate_up, h)
    return h


@functools.cache
def _gemm_for(m: int, n: int, k: int, arch: str, dtype: str):
    """The highest-priority fast gemm implementation that supports (M, N, K) - never the reference."""
    from latency_specialized.kernels import registry as kreg
    from latency_specialized.ops import gemm as ogemm

    ctx = make_context("gemm", arch=arch, dtype=dtype, tokens=m, dims={"N": n, "K": k},
                       attrs={"residual": False})
    cands = [i for i in list(kreg.IMPLEMENTATIONS) + list(ogemm.IMPLEMENTATIONS)
             if i.family == "gemm" and not i.is_reference]
    for impl in sorted(cands, key=lambda i: (-i.priority, i.name)):
        if impl.supports(ctx) is True:
            return impl
    raise UserError(f"no fast gemm serves M={m} N={n} K={k} on {arch}: use mlp.reference")


def _arch(device: torch.device) -> str:
    from latency_specialized.hardware import capability

    major, minor = capability(device)
    return f"sm_{major}{minor}"


GLU_PREFERRED_MAX_M = 0
"""Up to this many tokens gate/up always takes the GEMV with its GLU epilogue, even where the table
picks another gemm for the plain [2I, K] projection: the activation kernel (a launch and an [M, 2I]
round trip) is saved, at the price of the GEMV's time for that shape. 0: only where the table's
winner is the GEMV. H200, Kimi K3 TP8 layer A/B with 4 (``bench_kimi_k3_tp8_ab_session16.md``): the shared
expert's gate/up GEMV is slower than the small-M kernel by more than the activation kernel costs on its
side stream - KDA +0.5 / +2.2 / +2.3 us per layer at batch 1 / 2 / 4, MLA batch 4 +11.6 - hence 0."""


def _glu_fused(gate_up_gemm: str, dtype: str, m: int = 0, k: int = 0) -> bool:
    """Whether gate/up runs as the GEMV with its GLU epilogue (replacing the activation kernel): where
    the table picks the GEMV, or up to ``GLU_PREFERRED_MAX_M`` tokens (bf16, K % 8 == 0; the GEMV serves
    M <= 4)."""
    from latency_specialized.kernels.gemm_gemv import MAX_M

    if dtype != "bfloat16":
        return False
    return gate_up_gemm == "gemm.cutedsl_gemv" or (1 <= m <= min(GLU_PREFERRED_MAX_M, MAX_M) and k % 8 == 0)


def chosen_gemms(m: int, n: int, inter: int, k: int, arch: str, dtype: str) -> tuple[str, str]:
    """Names of the gemm implementations serving (gate/up, down) - for plans, notes and tests.
    A gate/up GEMV carries the activation in its epilogue ("gemm.cutedsl_gemv+glu")."""
    gu = _gemm_for(m, 2 * inter, k, arch, dtype).name
    if _glu_fused(gu, dtype, m, k):
        gu = "gemm.cutedsl_gemv+glu"
    return gu, _gemm_for(m, n, inter, arch, dtype).name


def mlp_fused(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, activation: ActivationSpec, *,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Gated MLP in 3 kernels (contract: ops/mlp.py ``mlp_reference``).

    Parameters
    ----------
    x : [M, K] bf16/fp16; w_gate_up : [2*I, K] (gate rows, then up rows); w_down : [N, I].

    Returns
    -------
    [M, N] in x.dtype.
    """
    if x.dim() != 2 or w_gate_up.shape[1] != x.shape[1] or w_down.shape[1] * 2 != w_gate_up.shape[0]:
        raise UserError(f"fused MLP: shapes x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)}, w_down "
                        f"{tuple(w_down.shape)} do not chain ([M,K], [2I,K], [N,I])")
    m, k = x.shape
    inter, n = w_down.shape[1], w_down.shape[0]
    dtype = {v: k_ for k_, v in DTYPES.items()}.get(x.dtype)
    if dtype is None:
        raise UserError(f"fused MLP kernel supports bf16/fp16, got {x.dtype}: use mlp.reference")
    arch = _arch(x.device)
    gate_up = _gemm_for(m, 2 * inter, k, arch, dtype)
    if _glu_fused(gate_up.name, dtype, m, k):
        # the GEMV streams gate and up rows of each output together: one kernel, same bits
        from latency_specialized.kernels.gemm_gemv import gemv_glu

        h = gemv_glu(x, w_gate_up, _act_variant(inter, x.dtype, activation))
    else:
        h = gated_activation_cute(gate_up.fn(x, w_gate_up).contiguous(), activation)
    y = _gemm_for(m, n, inter, arch, dtype).fn(h, w_down)
    if out is not None:
        out.copy_(y)
        return out
    return y


def _supports(ctx: OpContext) -> Support:
    if not ctx.arch.startswith("sm_90"):
        return f"verified on sm_90 (H200) only, not {ctx.arch}"
    if ctx.dtype not in DTYPES:
        return f"dtype {ctx.dtype} not supported (bf16/fp16)"
    if ctx.dim("N") % 8:
        return f"needs intermediate % 8 == 0 (N={ctx.dim('N')})"
    if ctx.attr("activation") not in (None, "swiglu", "situ_glu"):
        return f"activation {ctx.attr('activation')} not supported"
    return compile_cache.cute_available()


IMPLEMENTATIONS = [
    Implementation("mlp", NAME, mlp_fused, _supports, priority=20,
                   description="best fast gemm (gate|up) + one CuTe DSL SwiGLU/SiTU-GLU kernel (in the GEMV epilogue at M<=4) + best fast gemm (down)"),
]
