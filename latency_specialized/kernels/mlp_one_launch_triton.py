"""``mlp.triton_one_launch``: a gated MLP at M <= 4 in one launch - gate/up GEMV, activation, a grid barrier,
down GEMV (contract: ``ops.mlp.mlp_reference``).

Why one launch: a decode layer's kernel count is a budget of its own (issue 21: <= 15 kernels a layer at batch 1),
and the shared experts' MLP is two to four kernels (``mlp.cutedsl_fused``: the GLU GEMV and the down gemm, or a
gate/up gemm, the activation kernel and the down gemm, whose cuBLAS calls may take two each) on the side stream, off
the critical path - so fewer kernels there cost no latency as long as the one ends before the routed experts read
its output (their join: several microseconds of slack at batch 1).

Grid: ``P`` programs, at most one per SM (the barrier needs them all resident at once; the side stream's other
work is the main stream's, which never waits for this kernel on the device, so a program that waits at the barrier
cannot deadlock it - it holds its SM slot meanwhile, a cost the layer A/Bs include). Stage 1: the programs take
blocks of ``R1`` intermediate rows in turn; each streams its gate and up rows over K in ``BK1`` chunks against the
token rows (fp32 sums), rounds each sum to the activation dtype (the gemm contract), applies the activation in fp32
and stores ``h`` rounded, into a scratch
``[M, I]``. Barrier: every program arrives on a counter (acq_rel, GPU scope); the last one to arrive resets it to 0
and bumps a generation word, which the others spin on (read before their arrival) - so every call leaves the
counter at 0 and needs no memset. Stage 2: blocks of ``R2`` output rows in turn, over I in ``BK2`` chunks, ``h``
read from L2 (``.cg``: written by other SMs in this launch).

The counter and generation word are kept per (device, stream): two calls on one stream run one after another;
calls on two streams at once never share them. A capture on a stream that has none yet records their zeroing in
the graph (``stream_workspace.zeroed_int32_per_stream``): the runtime's side stream persists from warm-up to
capture, so its shared experts' graphs hold no memset.

Under the Triton interpreter (programs run one after another, so a barrier would wait forever) a call with more
than one program runs the two stages as two launches (``STAGE`` 1 and 2); one program runs the one-launch path
with its barrier (trivially passed: it is its own last arriver).
"""

from __future__ import annotations

import functools

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.kernels.stream_workspace import zeroed_int32_per_stream
from latency_specialized.kernels.triton_common import interpreting, triton_gpu_refusal
from latency_specialized.spec import ActivationSpec

NAME = "mlp.triton_one_launch"
ENABLED = True
"""On (session 55: timed in the layers, ``models/glm53/NOTES.md`` and ``models/deepseek_v41_flash/NOTES.md``), the
planner prefers this implementation over ``mlp.cutedsl_fused`` where it serves; an A/B switch (off: the two- or
three-kernel MLP)."""
SIDE_STREAM_ONLY = True
"""Serve only ``side_stream`` sites (shared experts): there its time hides behind the routed experts; on the main
stream the barrier and the Triton GEMVs would have to beat a launch gap, not measured."""
MAX_M = 4
"""Most token rows: the rows are a padded tile dimension of every product (``M_PAD`` x rows x chunk in registers)."""
PRODUCT_ELEMS = 8192
"""fp32 products of one weight tile and the token rows per iteration (``M_PAD x R x BK``): 32 a thread at 8 warps."""
WARPS = 8
ACTIVATIONS = {"swiglu": 0, "situ_glu": 1}


@functools.cache
def _kernel():
    global sigmoid, tanh, tl   # a jit function resolves the names it calls in its module's globals
    import triton
    import triton.language as tl

    from latency_specialized.kernels.triton_moe import sigmoid, tanh

    @triton.jit
    def one_launch_mlp_kernel(x, s_x, wgu, s_wgu, wd, s_wd, h, out, s_o, count, gen, M, I, K, N,
                              clamp, beta, beta_lin,
                              M_PAD: tl.constexpr, ACT: tl.constexpr, CLAMP: tl.constexpr, R1: tl.constexpr,
                              BK1: tl.constexpr, R2: tl.constexpr, BK2: tl.constexpr, STAGE: tl.constexpr):
        pid = tl.program_id(0)
        P = tl.num_programs(0)
        offs_m = tl.arange(0, M_PAD)
        m_ok = offs_m < M
        if STAGE != 2:
            # stage 1: h[:, r] = act(round(x @ w_gate[r]), round(x @ w_up[r])) for blocks of R1 rows of I
            for blk in range(pid, tl.cdiv(I, R1), P):
                r = blk * R1 + tl.arange(0, R1)
                r_ok = r < I
                acc_g = tl.zeros([M_PAD, R1], dtype=tl.float32)
                acc_u = tl.zeros([M_PAD, R1], dtype=tl.float32)
                for k0 in range(0, K, BK1):
                    k = k0 + tl.arange(0, BK1)
                    k_ok = k < K
                    w_ok = r_ok[:, None] & k_ok[None, :]
                    wg = tl.load(wgu + r.to(tl.int64)[:, None] * s_wgu + k[None, :], mask=w_ok, other=0.0)
                    wu = tl.load(wgu + (r + I).to(tl.int64)[:, None] * s_wgu + k[None, :], mask=w_ok, other=0.0)
                    xv = tl.load(x + offs_m[:, None] * s_x + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                                 other=0.0).to(tl.float32)
                    acc_g += tl.sum(xv[:, None, :] * wg.to(tl.float32)[None, :, :], 2)
                    acc_u += tl.sum(xv[:, None, :] * wu.to(tl.float32)[None, :, :], 2)
                # the contract rounds gate and up to the activation dtype before the activation
                g = acc_g.to(x.dtype.element_ty).to(tl.float32)
                u = acc_u.to(x.dtype.element_ty).to(tl.float32)
                if ACT == 0:
                    if CLAMP:  # DeepSeek-V4's SwiGLU clamp (ops.activation): g <= c, |u| <= c
                        g = tl.minimum(g, clamp)
                        u = tl.minimum(tl.maximum(u, -clamp), clamp)
                    y = g * sigmoid(g) * u
                else:
                    y = beta * tanh(g / beta) * sigmoid(g) * (beta_lin * tanh(u / beta_lin))
                tl.store(h + offs_m[:, None] * I + r[None, :], y.to(h.dtype.element_ty),
                         mask=m_ok[:, None] & r_ok[None, :])
        if STAGE == 0:
            # grid barrier: every thread's h stores before the arrival (bar.sync), released by it (acq_rel, GPU
            # scope); the generation word is read before arriving, so the last arriver's bump is the one awaited
            tl.debug_barrier()
            g0 = tl.atomic_add(gen, 0, sem="acquire", scope="gpu")
            n = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
            if n == P - 1:
                tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")     # the next call starts from 0
                tl.atomic_add(gen, 1, sem="release", scope="gpu")
            else:
                now = tl.atomic_add(gen, 0, sem="acquire", scope="gpu")
                while now == g0:
                    now = tl.atomic_add(gen, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()
        if STAGE != 1:
            # stage 2: out[:, n] = round(h @ w_down[n]) for blocks of R2 rows of N
            for blk in range(pid, tl.cdiv(N, R2), P):
                n_rows = blk * R2 + tl.arange(0, R2)
                n_ok = n_rows < N
                acc = tl.zeros([M_PAD, R2], dtype=tl.float32)
                for k0 in range(0, I, BK2):
                    k = k0 + tl.arange(0, BK2)
                    k_ok = k < I
                    wv = tl.load(wd + n_rows.to(tl.int64)[:, None] * s_wd + k[None, :],
                                 mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                    hv = tl.load(h + offs_m[:, None] * I + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                                 other=0.0, cache_modifier=".cg").to(tl.float32)
                    acc += tl.sum(hv[:, None, :] * wv.to(tl.float32)[None, :, :], 2)
                tl.store(out + offs_m[:, None] * s_o + n_rows[None, :], acc.to(out.dtype.element_ty),
                         mask=m_ok[:, None] & n_ok[None, :])

    return one_launch_mlp_kernel


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def tiles(m: int, rows: int, width: int, programs: int) -> tuple[int, int]:
    """``(R, BK)`` of one stage: ``R`` rows a block (a power of two: about ``rows / programs``, so one block a
    program), ``BK`` columns a chunk (``PRODUCT_ELEMS`` products a tile at ``M_PAD`` rows, at most the width's
    power of two, at least 16)."""
    r = min(_pow2_at_least(-(-rows // max(programs, 1))), 64)
    bk = max(16, min(_pow2_at_least(width), PRODUCT_ELEMS // (_pow2_at_least(m) * r)))
    return r, bk


def _barrier_words(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The barrier's (count, generation) int32 words for calls on the current stream of ``device``."""
    words = zeroed_int32_per_stream(NAME, (2,), device)
    return words[0:1], words[1:2]


def mlp_one_launch(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, activation: ActivationSpec, *,
                   out: torch.Tensor | None = None, programs: int | None = None) -> torch.Tensor:
    """Gated MLP in one kernel (contract: ``ops.mlp.mlp_reference``).

    Parameters
    ----------
    x : [M, K], M in 1..``MAX_M``, unit column stride (rows may be strided); w_gate_up : [2*I, K] (gate rows, then
        up rows); w_down : [N, I]; both with unit column stride, in x's dtype (bf16 / fp16; fp32 under the
        interpreter's tests). out : optional [M, N] in x.dtype, unit column stride.
    programs : the grid (default: one per SM, no more than the larger stage has blocks).

    Returns
    -------
    [M, N] in x.dtype.
    """
    if x.dim() != 2 or w_gate_up.dim() != 2 or w_down.dim() != 2 or w_gate_up.shape[1] != x.shape[1] \
            or w_down.shape[1] * 2 != w_gate_up.shape[0]:
        raise UserError(f"{NAME}: shapes x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)}, w_down "
                        f"{tuple(w_down.shape)} do not chain ([M,K], [2I,K], [N,I])")
    m, k = x.shape
    inter, n = w_down.shape[1], w_down.shape[0]
    if not 1 <= m <= MAX_M:
        raise UserError(f"{NAME}: {m} token rows; it serves 1..{MAX_M} (mlp.cutedsl_fused serves more)")
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise UserError(f"{NAME}: weights {w_gate_up.dtype} / {w_down.dtype} must be x's dtype {x.dtype} (weights kept "
                        "in a stored format take mlp.cutedsl_fused's gemms)")
    if x.stride(1) != 1 or w_gate_up.stride(1) != 1 or w_down.stride(1) != 1:
        raise UserError(f"{NAME}: x and the weights need unit column stride: call .contiguous() first")
    if activation.kind not in ACTIVATIONS:
        raise UserError(f"{NAME}: activation {activation.kind} (swiglu or situ_glu)")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise UserError(f"{NAME}: out must be [{m}, {n}] {x.dtype} with unit column stride, got "
                        f"{tuple(out.shape)} {out.dtype}")
    h = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    if programs is None:
        from latency_specialized.hardware import sm_count

        sms = sm_count(x.device) if x.device.type == "cuda" else 1
        programs = max(1, min(sms, max(-(-inter // tiles(m, inter, k, sms)[0]), -(-n // tiles(m, n, inter, sms)[0]))))
    r1, bk1 = tiles(m, inter, k, programs)
    r2, bk2 = tiles(m, n, inter, programs)
    count, gen = _barrier_words(x.device)
    act = ACTIVATIONS[activation.kind]
    args = (x, x.stride(0), w_gate_up, w_gate_up.stride(0), w_down, w_down.stride(0), h, out, out.stride(0),
            count, gen, m, inter, k, n, float(activation.clamp or 0.0), float(activation.beta or 1.0),
            float(activation.beta_lin or 1.0))
    meta = dict(M_PAD=_pow2_at_least(m), ACT=act, CLAMP=activation.clamp is not None, R1=r1, BK1=bk1, R2=r2,
                BK2=bk2, num_warps=WARPS)
    kernel = _kernel()
    if interpreting() and programs > 1:
        # programs run one after another under the interpreter: a barrier would never open
        kernel[(programs,)](*args, STAGE=1, **meta)
        kernel[(programs,)](*args, STAGE=2, **meta)
    else:
        kernel[(programs,)](*args, STAGE=0, **meta)
    return out


def _supports(ctx: OpContext) -> Support:
    why = triton_gpu_refusal(ctx, "the MLP")
    if why:
        return why
    if not ENABLED:
        return f"{NAME}: switched off (mlp_one_launch_triton.ENABLED = False, an A/B switch)"
    if SIDE_STREAM_ONLY and not ctx.attr("side_stream"):
        return "main-stream MLP: served on side streams only (mlp_one_launch_triton.SIDE_STREAM_ONLY)"
    if ctx.tokens > MAX_M:
        return f"{ctx.tokens} token rows (1..{MAX_M})"
    if ctx.dtype not in ("bfloat16", "float16"):
        return f"dtype {ctx.dtype} (bf16 / fp16)"
    if ctx.attr("weight_format"):
        return f"weights {ctx.attr('weight_format')}: reads weights in the activation dtype only"
    if ctx.attr("activation") not in ACTIVATIONS:
        return f"activation {ctx.attr('activation')} (swiglu or situ_glu)"
    return True


IMPLEMENTATIONS = [
    Implementation("mlp", NAME, mlp_one_launch, _supports, priority=25,
                   description="one Triton launch at M<=4: gate/up GEMV + activation, grid barrier, down GEMV"),
]
