"""The gated activation of an MLP as a CuTe DSL device function: ``act(gate) * lin(up)`` in fp32.

One definition shared by the activation kernel (``mlp_fused.py``) and the GLU epilogue of the GEMV
(``gemm_gemv.gemv_glu``), so that the two stay bit-identical; neither kernel module imports the other
for it.
"""

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class ActVariant:
    inter: int          # I: output width; the input row is [gate (I) | up (I)]
    dtype: str
    kind: str
    beta: float = 0.0
    beta_lin: float = 0.0
    clamp: float = 0.0  # 0: no clamp (swiglu)
    pdl: bool = True


@functools.cache
def gated_act_fn(var: ActVariant):
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
