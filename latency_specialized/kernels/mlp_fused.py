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

Which gemm serves each projection is the plan's choice: the implementation declares the two gemms
as inner op calls (:func:`inner_sites`), the planner resolves them from the gemm family like any site
(``explain`` prints them under the MLP site) and binds them (``inner=``), so graph capture and replay
see fixed kernels and no second planner exists here.
"""

import functools
from dataclasses import asdict
from typing import Mapping

import torch

from latency_specialized.contract import Implementation, OpContext, Support, make_context
from latency_specialized.errors import UserError
from latency_specialized.kernels import compile_cache
from latency_specialized.kernels.gated_act import ActVariant, gated_act_fn
from latency_specialized.spec import ActivationSpec

NAME = "mlp.cutedsl_fused"
ACT_NAME = "activation.cutedsl_gated"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
THREADS = 128


@functools.cache
def _act_kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    from latency_specialized.kernels.gemm_common import ptx

    P = ptx()

    class GatedActKernel:
        def __init__(self, var: ActVariant):
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


def _act_variant(inter: int, dtype: torch.dtype, act: ActivationSpec) -> ActVariant:
    name = {v: k for k, v in DTYPES.items()}.get(dtype)
    if name is None:
        raise UserError(f"fused MLP kernel supports bf16/fp16, got {dtype}: use mlp.reference")
    if inter % 8:
        raise UserError(f"fused MLP kernel needs the intermediate width % 8 == 0 (got {inter}): use mlp.reference")
    if act.kind == "situ_glu":
        return ActVariant(inter, name, "situ_glu", beta=float(act.beta), beta_lin=float(act.beta_lin))
    if act.kind == "swiglu":
        return ActVariant(inter, name, "swiglu", clamp=float(act.clamp or 0.0))
    raise UserError(f"fused MLP kernel: unknown activation {act.kind!r}: use mlp.reference")


@compile_cache.compile_unit
def compile_act(var: ActVariant):
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


def inner_sites(ctx: OpContext) -> list[tuple[str, OpContext]]:
    """The two gemms this implementation runs, for the planner to choose (``Implementation.inner``):
    ``gate_up`` (M, 2I, K) and ``down`` (M, N, I) of an ``mlp`` site (dims N = I, K = the hidden size;
    the output is [M, K]); the site's ``weight_format`` passes to both."""
    inter, hidden = ctx.dim("N"), ctx.dim("K")
    # weights kept in a stored format (block FP8): the gemms that read that format serve both projections
    fmt = {"weight_format": ctx.attr("weight_format")} if ctx.attr("weight_format") else {}

    def gemm(n: int, k: int) -> OpContext:
        return make_context("gemm", arch=ctx.arch, dtype=ctx.dtype, tokens=ctx.tokens, dims={"N": n, "K": k},
                            attrs={"residual": False, **fmt})

    return [("gate_up", gemm(2 * inter, hidden)), ("down", gemm(hidden, inter))]


GLU_PREFERRED_MAX_M = 0
"""Up to this many tokens gate/up always takes the GEMV with its GLU epilogue, even where the table
picks another gemm for the plain [2I, K] projection: the activation kernel (a launch and an [M, 2I]
round trip) is saved, at the price of the GEMV's time for that shape. 0: only where the table's
winner is the GEMV. H200, Kimi K3 TP8 layer A/B with 4 (``bench_kimi_k3_tp8_ab_session16.md``): the shared
expert's gate/up GEMV is slower than the small-M kernel by more than the activation kernel costs on its
side stream - KDA +0.5 / +2.2 / +2.3 us per layer at batch 1 / 2 / 4, MLA batch 4 +11.6 - hence 0."""


def glu_fused(gate_up_gemm: str, dtype: str, m: int = 0, k: int = 0) -> bool:
    """Whether gate/up runs as the GEMV with its GLU epilogue (replacing the activation kernel): where
    the table picks the GEMV, or up to ``GLU_PREFERRED_MAX_M`` tokens (bf16, K % 8 == 0; the GEMV serves
    M <= 4)."""
    from latency_specialized.kernels.gemm_gemv import MAX_M

    if dtype != "bfloat16":
        return False
    return gate_up_gemm == "gemm.cutedsl_gemv" or (1 <= m <= min(GLU_PREFERRED_MAX_M, MAX_M) and k % 8 == 0)


def mlp_fused(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, activation: ActivationSpec, *,
              out: torch.Tensor | None = None, inner: Mapping[str, Implementation] | None = None) -> torch.Tensor:
    """Gated MLP in 3 kernels (contract: ops/mlp.py ``mlp_reference``).

    Parameters
    ----------
    x : [M, K] bf16/fp16; w_gate_up : [2*I, K] (gate rows, then up rows); w_down : [N, I].
    inner : the gemm implementations of ``gate_up`` and ``down`` (:func:`inner_sites`), as the plan
        chose them: the plan binds them (``Plan.impl``); a direct caller takes them from
        ``ImplementationRegistry.inner_choices``. This kernel does not choose gemms itself.

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
    if inner is None or "gate_up" not in inner or "down" not in inner:
        raise UserError(f"{NAME} runs the gemms its plan chose (inner gate_up and down): call it through the plan "
                        "(Plan.impl) or pass inner= from ImplementationRegistry.inner_choices")
    gate_up = inner["gate_up"]
    if glu_fused(gate_up.name, dtype, m, k):
        # the GEMV streams gate and up rows of each output together: one kernel, same bits
        from latency_specialized.kernels.gemm_gemv import gemv_glu

        h = gemv_glu(x, w_gate_up, _act_variant(inter, x.dtype, activation))
    else:
        h = gated_activation_cute(gate_up.fn(x, w_gate_up).contiguous(), activation)
    y = inner["down"].fn(h, w_down)
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
    Implementation("mlp", NAME, mlp_fused, _supports, priority=20, inner=inner_sites,
                   description="best fast gemm (gate|up) + one CuTe DSL SwiGLU/SiTU-GLU kernel (in the GEMV epilogue at M<=4) + best fast gemm (down)"),
]
