"""Triton KDA verification step and accept (``attention.kda_verify`` / ``attention.kda_accept``).

Contracts: ``ops.attention.kda_verify.kda_verify_reference`` and ``kda_accept_reference`` (the same
arguments, keyword-only arguments and returns; the tape layout is that module's docstring).

**Not registered yet**: there is no ``IMPLEMENTATIONS`` list here and no entry in any registry. The
kernels have run only under the Triton interpreter (``tests/ops/test_kda_verify_triton.py``); they
are registered once they have been validated (and their blocks tuned) on a GPU.

Verify, grid ``(B, H, NV)``: program ``(b, h, s)`` owns value rows ``[s BV, (s + 1) BV)`` of head
``h``'s fp32 state ``S[state_idx[b], h]`` ([Dv, Dk], ``NV = D / BV``). It loads its ``[BV, D]`` slice
once, keeps it in registers over the ``T = R / B`` tokens of request ``b`` and never writes it back
(the live states stay as they were, the accept moves them on). Per token, in order:

1. the causal depthwise conv over ``[last W-1 inputs, current]`` (the history is three loop-carried
   vectors per channel group, started from the conv-state row and shifted per token: conv widths 2..4),
   SiLU, one rounding to the activation dtype (``conv.to(dtype).float()`` of the reference); q and k
   for the whole head (their L2 norms and ``S k``, ``S q`` need every key), v only for the owned rows;
2. the decay input: ``f`` [R, H D] as given, or with ``f_b_weight`` [H D, Rk] the head's
   ``round(f_a . f_b[h D + d, :])`` (fp32 accumulation, one rounding to f_a's dtype: the gemm
   contract), computed in ``RK_BLOCK``-wide chunks; ``g``, ``exp(g)``, ``beta``;
3. the gated delta rule on the slice: ``S *= exp(g)`` along keys, ``v' = beta (v - S k)``,
   ``S += v' k^T``, ``o = S q``;
4. NV = 1: the gated RMSNorm over the head's ``D`` outputs and ``sigmoid(g_out)``, stored to ``out``.
   NV > 1: the norm needs every value row of the head, so ``o`` goes to an fp32 workspace and a
   second small kernel (grid ``(R, H)``) does the norm and gate;
5. the tape: ``tape_state[state_idx[b], t, h]`` = (k, exp(g), v') and ``tape_conv[state_idx[b], t]`` =
   the token's conv input of the head's q|k|v channels (each program stores its ``1 / NV`` share).

Accept, grid ``(B, H, NV)``: nothing where ``accepted[b] < 0``; else the ``[BV, D]`` state slice is
loaded, the tape's tokens ``0..j`` replayed with the two fp32 operations of the reference in its order
(``S * decay`` then ``+ v' k^T``) and stored; the program also shifts channels
``[s BV, (s + 1) BV)`` of each of q, k, v of head ``h`` in the conv state: the last W-1 entries of
``[conv_state row, tape_conv 0..j]``.

Both launch with ``enable_fp_fusion=False``: with FMA contraction ``S + v' k^T`` would round once, not
twice as the reference replay does, and the accepted state would no longer be bit for bit the
reference's (nor the state the verification step's outputs were computed from). No host sync (no
``.item()``, shapes only): CUDA-graph capturable. Triton is imported on the first call.

Requests sharing a state row (padding on a scratch row) write its tape entries in an unspecified order,
as the reference's indexed stores do; the accept of such a row is a read-modify-write race (scratch
only: padding requests pass ``accepted = -1`` or do not care). An accept ``j`` past the tape (outside
the contract: the reference's gather fails there) replays the whole tape.

Each split program recomputes the head's f_b gemv per token (``D x Rk`` from L2: 32 KiB at D = Rk = 128,
bf16), and q, k whole: with NV = 8 that is 8 x the reads of one program per head; hoisting the gemv out
of the token loop (all T tokens at once) is the next thing to measure.

Registers (D = 128, sm_90 build of ``choose_blocks``' picks, ptxas ``-v``; the whole [128, 128] fp32
state is 64 KiB, 128 floats a thread at 4 warps): B = 1 / 3 take BV = 16 at 2 warps (verify 247
registers with the fused f_b gemv, 161 without), B = 8 BV = 32 at 4 warps (254 / 163), B >= 16 BV = 64 at
8 warps (234 / 192); none spills; the accept 48 .. 128. BV = 128 (one program per head, the norm in the
kernel) spills at 8 warps (64 state floats a thread plus the token loop's vectors) and at 16, so D = 128
always splits. Triton lays the [BV, 128] slice out with the 32 lanes *and* the warps along keys, so
``S k`` and ``S q`` reduce across warps (through shared memory) once per token: a layout with warps along
value rows is the first thing to try on the GPU.
"""

from __future__ import annotations

import functools
import os

import torch

from latency_specialized.errors import UserError

NAME = "attention.kda_verify.triton"
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_CONV = 4
"""Widest conv served: the history is three loop-carried vectors per channel group (Kimi: W = 4)."""
RK_BLOCK = 16
"""f_a columns per step of the fused f_b gemv: a [D, 16] tile of f_b (2K elements at D = 128) next to
the state slice, instead of the whole [D, Rk] (16K at Rk = 128: as many registers as the state); 32
spills registers in the sm_90 build at BV = 16 (2 warps)."""
TARGET_PROGRAMS = 128
"""Programs the verify grid aims for (H200: 132 SMs): value-row splits are added while ``B H NV`` is
below it (and a slice keeps at least ``MIN_BLOCK_V`` rows)."""
MIN_BLOCK_V = 16
MAX_BLOCK_V = 64
"""Most value rows per program: a [128, 128] slice (8 warps) spills registers in the sm_90 build."""


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    del interpret  # one build per TRITON_INTERPRET setting
    # the jit functions resolve names through this module's globals (not the closure): the helpers and
    # ``tl`` are bound there on the first build
    global tl, _conv3, _hist, _silu_round
    import triton
    import triton.language as tl

    @triton.jit
    def _conv3(w, c, x0, h1, h2, h3, W: tl.constexpr):
        """One channel group's conv over [h3, h2, h1, x0], summed oldest first (taps past W are absent)."""
        acc = tl.zeros(x0.shape, tl.float32)
        if W >= 4:
            acc = tl.load(w + c * W + (W - 4)).to(tl.float32) * h3
        if W >= 3:
            acc = acc + tl.load(w + c * W + (W - 3)).to(tl.float32) * h2
        acc = acc + tl.load(w + c * W + (W - 2)).to(tl.float32) * h1
        return acc + tl.load(w + c * W + (W - 1)).to(tl.float32) * x0

    @triton.jit
    def _hist(conv_state, base, c, j: tl.constexpr, W: tl.constexpr):
        """The input ``j`` tokens back from the conv-state row (column W-1-j, fp32); 0 past the window."""
        if j <= W - 1:
            return tl.load(conv_state + base + c * (W - 1) + (W - 1 - j)).to(tl.float32)
        else:
            return tl.zeros(c.shape, tl.float32)

    @triton.jit
    def _silu_round(z, dt: tl.constexpr):
        # SiLU in fp32, then the reference's one rounding to the activation dtype
        return (z * tl.sigmoid(z)).to(dt).to(tl.float32)

    @triton.jit
    def kda_verify_kernel(x, s_x, conv_state, conv_w, f, s_f, fb, A_log, dt_bias, beta_logit, s_beta,
                          g_out, s_g, norm_w, state, state_idx, tape_state, tape_conv, out, o_ws,
                          T, TMAX, RK, eps, lower_bound, scale,
                          H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BV: tl.constexpr,
                          NV: tl.constexpr, HAS_FB: tl.constexpr, RKB: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        vs = tl.program_id(2)
        HD: tl.constexpr = H * D
        C: tl.constexpr = 3 * HD
        row = tl.load(state_idx + b).to(tl.int64)
        dk = tl.arange(0, D)
        dv = vs * BV + tl.arange(0, BV)
        own_k = (dk // BV) == vs             # this program's share of the whole-head tape entries
        # the state slice first: the dominant bytes, depending on nothing else
        sbase = (row * H + h) * (D * D)
        S = tl.load(state + sbase + dv[:, None] * D + dk[None, :])              # [BV, D] fp32
        cq = h * D + dk
        ck = HD + h * D + dk
        cv = 2 * HD + h * D + dv
        cbase = row * (C * (W - 1))
        q1 = _hist(conv_state, cbase, cq, 1, W)
        q2 = _hist(conv_state, cbase, cq, 2, W)
        q3 = _hist(conv_state, cbase, cq, 3, W)
        k1 = _hist(conv_state, cbase, ck, 1, W)
        k2 = _hist(conv_state, cbase, ck, 2, W)
        k3 = _hist(conv_state, cbase, ck, 3, W)
        v1 = _hist(conv_state, cbase, cv, 1, W)
        v2 = _hist(conv_state, cbase, cv, 2, W)
        v3 = _hist(conv_state, cbase, cv, 3, W)
        a = tl.exp(tl.load(A_log + h).to(tl.float32))
        dtb = tl.load(dt_bias + h * D + dk).to(tl.float32)
        nw = tl.load(norm_w + dv).to(tl.float32)
        tsb = row * TMAX * (H * 3 * D) + h * (3 * D)       # tape_state[row, 0, h, 0, 0]
        tcb = row * TMAX * C                                 # tape_conv[row, 0, 0]
        act = x.dtype.element_ty
        cdt = conv_state.dtype.element_ty
        for t in range(T):
            r = (b * T + t).to(tl.int64)
            xq = tl.load(x + r * s_x + cq).to(tl.float32)
            xk = tl.load(x + r * s_x + ck).to(tl.float32)
            xv = tl.load(x + r * s_x + cv).to(tl.float32)
            q = _silu_round(_conv3(conv_w, cq, xq, q1, q2, q3, W), act)
            k = _silu_round(_conv3(conv_w, ck, xk, k1, k2, k3, W), act)
            v = _silu_round(_conv3(conv_w, cv, xv, v1, v2, v3, W), act)
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
            if HAS_FB:
                # the f_b_proj gemv of this head, fused: fp32 accumulation, one rounding to f_a's dtype
                facc = tl.zeros([D], tl.float32)
                rr = tl.arange(0, RKB)
                for r0 in range(0, RK, RKB):
                    rm = (r0 + rr) < RK
                    fa = tl.load(f + r * s_f + r0 + rr, mask=rm, other=0.0).to(tl.float32)
                    fbw = tl.load(fb + (h * D + dk)[:, None] * RK + (r0 + rr)[None, :], mask=rm[None, :], other=0.0)
                    facc += tl.sum(fbw.to(tl.float32) * fa[None, :], axis=1)
                fv = facc.to(f.dtype.element_ty).to(tl.float32)
            else:
                fv = tl.load(f + r * s_f + h * D + dk).to(tl.float32)
            g = lower_bound * tl.sigmoid(a * (fv + dtb))
            decay = tl.exp(g)
            beta = tl.sigmoid(tl.load(beta_logit + r * s_beta + h).to(tl.float32))
            # the gated delta rule on the owned value rows (the accept replays exactly these two updates)
            S = S * decay[None, :]
            vn = beta * (v - tl.sum(S * k[None, :], axis=1))
            S = S + vn[:, None] * k[None, :]
            o = tl.sum(S * q[None, :], axis=1)                                  # [BV]
            if NV == 1:
                o = o * tl.rsqrt(tl.sum(o * o, axis=0) / D + eps) * nw
                o = o * tl.sigmoid(tl.load(g_out + r * s_g + h * D + dv).to(tl.float32))
                tl.store(out + r * HD + h * D + dv, o.to(out.dtype.element_ty))
            else:  # the norm needs all D rows of the head: the second kernel finishes it
                tl.store(o_ws + (r * H + h) * D + dv, o)
            ts = tsb + t * (H * 3 * D)
            tl.store(tape_state + ts + dk, k, mask=own_k)
            tl.store(tape_state + ts + D + dk, decay, mask=own_k)
            tl.store(tape_state + ts + 2 * D + dv, vn)
            tc = tcb + t * C
            tdt = tape_conv.dtype.element_ty
            tl.store(tape_conv + tc + cq, xq.to(tdt), mask=own_k)
            tl.store(tape_conv + tc + ck, xk.to(tdt), mask=own_k)
            tl.store(tape_conv + tc + cv, xv.to(tdt))
            # shift the conv history: the reference keeps past inputs in the conv state's dtype
            q3 = q2
            q2 = q1
            q1 = xq.to(cdt).to(tl.float32)
            k3 = k2
            k2 = k1
            k1 = xk.to(cdt).to(tl.float32)
            v3 = v2
            v2 = v1
            v1 = xv.to(cdt).to(tl.float32)

    @triton.jit
    def kda_out_norm_kernel(o_ws, g_out, s_g, norm_w, out, eps, H: tl.constexpr, D: tl.constexpr):
        """Row ``r``, head ``h``: the gated RMSNorm of the split verify's fp32 ``o``."""
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, D)
        o = tl.load(o_ws + (r * H + h) * D + d)
        o = o * tl.rsqrt(tl.sum(o * o, axis=0) / D + eps) * tl.load(norm_w + d).to(tl.float32)
        o = o * tl.sigmoid(tl.load(g_out + r * s_g + h * D + d).to(tl.float32))
        tl.store(out + r * (H * D) + h * D + d, o.to(out.dtype.element_ty))

    @triton.jit
    def kda_accept_kernel(conv_state, state, state_idx, accepted, tape_state, tape_conv, TMAX,
                          H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BV: tl.constexpr,
                          WP: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        vs = tl.program_id(2)
        j = tl.load(accepted + b).to(tl.int32)
        if j >= 0:
            HD: tl.constexpr = H * D
            C: tl.constexpr = 3 * HD
            row = tl.load(state_idx + b).to(tl.int64)
            dk = tl.arange(0, D)
            dv = vs * BV + tl.arange(0, BV)
            n = tl.minimum(j + 1, TMAX)      # a j past the tape is outside the contract; never read past it
            # conv first (its loads are independent of the replay): channels dv of each of q, k, v
            i = tl.arange(0, WP)
            im = i < (W - 1)
            p = n + i                                          # column of [conv_state row, tape 0..]
            cbase = row * (C * (W - 1))
            tbase = row * TMAX * C
            for g3 in tl.static_range(3):
                c = g3 * HD + h * D + dv                                          # [BV]
                from_conv = p[None, :] < (W - 1)
                old = tl.load(conv_state + cbase + c[:, None] * (W - 1) + p[None, :],
                              mask=im[None, :] & from_conv, other=0.0)
                new = tl.load(tape_conv + tbase + (p[None, :] - (W - 1)) * C + c[:, None],
                              mask=im[None, :] & (p[None, :] >= (W - 1)), other=0.0)
                val = tl.where(from_conv, old, new.to(conv_state.dtype.element_ty))
                tl.store(conv_state + cbase + c[:, None] * (W - 1) + i[None, :], val, mask=im[None, :])
            sp = state + (row * H + h) * (D * D) + dv[:, None] * D + dk[None, :]
            S = tl.load(sp)
            tb = tape_state + row * TMAX * (H * 3 * D) + h * (3 * D)
            for t in range(0, n):
                kt = tl.load(tb + t * (H * 3 * D) + dk)
                dec = tl.load(tb + t * (H * 3 * D) + D + dk)
                vn = tl.load(tb + t * (H * 3 * D) + 2 * D + dv)
                # the reference replay's two fp32 operations, in its order (no FMA: enable_fp_fusion=False)
                S = S * dec[None, :]
                S = S + vn[:, None] * kt[None, :]
            tl.store(sp, S)

    return kda_verify_kernel, kda_out_norm_kernel, kda_accept_kernel


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def choose_blocks(B: int, H: int, D: int) -> tuple[int, int]:
    """``(BV, num_warps)`` for B requests of H heads of head dim D (static shapes only: graph-safe).

    Value rows per program: at most ``MAX_BLOCK_V``, halved while ``B H NV`` stays below
    ``TARGET_PROGRAMS`` and a slice keeps ``MIN_BLOCK_V`` rows. D = 128, H = 4: B = 1 gives NV = 8 (32
    programs of [16, 128]), B = 8 NV = 4, B >= 16 NV = 2. Warps: ``BV / 8`` (a [BV, 128] slice at 32 fp32
    per thread; 8 at most). The sm_90 build of these spills no registers; BV = 128 (8 warps: 64 state
    floats per thread) spills, so D = 128 always splits and takes the second (norm) launch."""
    nv = max(1, D // MAX_BLOCK_V)
    while B * H * nv * 2 <= TARGET_PROGRAMS and D // (nv * 2) >= MIN_BLOCK_V:
        nv *= 2
    bv = D // nv
    return bv, max(1, min(8, bv // 8))


def _check_rows(t: torch.Tensor, what: str, rows: int, cols: int) -> None:
    if t.dim() != 2 or tuple(t.shape) != (rows, cols) or t.stride(1) != 1:
        raise UserError(f"{NAME}: {what} is {list(t.shape)} strides {t.stride()}; pass [{rows}, {cols}] with unit "
                        "column stride (a column slice of a wider projection is fine)")


def _check_contig(t: torch.Tensor, what: str, shape: tuple[int, ...], device: torch.device) -> None:
    if tuple(t.shape) != shape or not t.is_contiguous():
        raise UserError(f"{NAME}: {what} is {list(t.shape)} (contiguous: {t.is_contiguous()}); pass a contiguous "
                        f"{list(shape)} tensor")
    if t.device != device:
        raise UserError(f"{NAME}: {what} is on {t.device}, the states on {device}: move it there")


def _check_states(conv_state: torch.Tensor, state: torch.Tensor, tape_state: torch.Tensor,
                  tape_conv: torch.Tensor) -> tuple[int, int, int, int]:
    """(H, D, W, Tmax) of the live states and tapes; the reference's tape checks plus this kernel's own
    (the verify checks the step's tokens against Tmax itself)."""
    if (state.dim() != 4 or state.dtype != torch.float32 or state.shape[2] != state.shape[3]
            or not state.is_contiguous()):
        raise UserError(f"{NAME}: state is {state.dtype} {list(state.shape)}; pass the contiguous fp32 "
                        "[rows, H, D, D] states")
    rows, H, D = state.shape[0], state.shape[1], state.shape[3]
    if D & (D - 1) or D < 16:
        raise UserError(f"{NAME}: head_dim {D}: a power of two >= 16 (tile widths); the reference serves it")
    if conv_state.dim() != 3 or conv_state.shape[:2] != (rows, 3 * H * D) or not conv_state.is_contiguous():
        raise UserError(f"{NAME}: conv_state is {list(conv_state.shape)}; pass a contiguous [{rows}, {3 * H * D}, W-1]")
    W = conv_state.shape[2] + 1
    if not 2 <= W <= MAX_CONV:
        raise UserError(f"{NAME}: conv width {W}: 2..{MAX_CONV} served (the history is 3 vectors per channel); "
                        "the reference serves others")
    if conv_state.dtype not in ACT_DTYPES:
        raise UserError(f"{NAME}: conv_state dtype {conv_state.dtype}: bf16 / fp16 / fp32")
    if tape_state.dtype != torch.float32 or tape_state.dim() != 5 or tuple(tape_state.shape[2:]) != (H, 3, D):
        raise UserError(f"{NAME}: tape_state is {tape_state.dtype} {list(tape_state.shape)}; allocate it as fp32 "
                        f"[rows, 1 + k, {H}, 3, {D}] (ops.attention.kda_verify.tape_shapes)")
    if tape_conv.dtype != conv_state.dtype or tape_conv.dim() != 3 or tape_conv.shape[2] != conv_state.shape[1]:
        raise UserError(f"{NAME}: tape_conv is {tape_conv.dtype} {list(tape_conv.shape)}; allocate it as "
                        f"{conv_state.dtype} [rows, 1 + k, {conv_state.shape[1]}] like the conv state")
    if tape_state.shape[0] != rows or tape_conv.shape[0] != rows:
        raise UserError(f"{NAME}: the tapes have {tape_state.shape[0]} / {tape_conv.shape[0]} rows but the state "
                        f"has {rows}: give the tapes one row per state row")
    if tape_state.shape[1] != tape_conv.shape[1]:
        raise UserError(f"{NAME}: tape_state holds {tape_state.shape[1]} tokens, tape_conv {tape_conv.shape[1]}: "
                        "allocate both for 1 + the most speculative tokens per step")
    if not (tape_state.is_contiguous() and tape_conv.is_contiguous()):
        raise UserError(f"{NAME}: the tapes must be contiguous (allocate them with torch.empty / full)")
    for t, what in ((conv_state, "conv_state"), (tape_state, "tape_state"), (tape_conv, "tape_conv")):
        if t.device != state.device:
            raise UserError(f"{NAME}: {what} is on {t.device}, the state on {state.device}: keep the states together")
    return H, D, W, tape_state.shape[1]


def _check_idx(t: torch.Tensor, what: str, device: torch.device) -> int:
    if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64) or not t.is_contiguous():
        raise UserError(f"{NAME}: {what} is {t.dtype} {list(t.shape)}; pass a contiguous int32 [B] tensor")
    if t.device != device:
        raise UserError(f"{NAME}: {what} is on {t.device}, the states on {device}: move it there")
    return t.shape[0]


def kda_verify_triton(mixed_qkv: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
                      f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, beta_logit: torch.Tensor,
                      g_out: torch.Tensor, norm_weight: torch.Tensor, state: torch.Tensor,
                      state_idx: torch.Tensor, tape_state: torch.Tensor, tape_conv: torch.Tensor, *,
                      num_heads: int, eps: float = 1e-5, gate_lower_bound: float = -5.0,
                      scale: float | None = None, f_b_weight: torch.Tensor | None = None) -> torch.Tensor:
    """KDA over ``T = R / B`` tokens per request, in order; the live states are read, not written.

    Parameters
    ----------
    mixed_qkv : [R, 3*H*D] q|k|v before the conv (bf16 / fp16 / fp32), unit column stride; R = B*T rows,
        request-major.
    conv_state : [S, 3*H*D, W-1] contiguous conv inputs before the step (read only), W in 2..4.
    conv_weight : [3*H*D, W] contiguous taps. A_log : [H]. dt_bias : [H*D]. norm_weight : [D] (contiguous).
    f : [R, H*D] decay input, or with ``f_b_weight`` [H*D, Rk] (contiguous) the low-rank f_a [R, Rk];
        unit column stride.
    beta_logit : [R, H], g_out : [R, H*D], unit column stride.
    state : [S, H, D, D] contiguous fp32 states before the step (read only), D a power of two >= 16.
    state_idx : [B] int32 / int64 state row of each request.
    tape_state : [S, Tmax, H, 3, D] fp32, tape_conv : [S, Tmax, 3*H*D] in conv_state's dtype, both
        contiguous, ``Tmax >= T``: entries ``[state_idx[b], :T]`` are written.

    Returns
    -------
    [R, H*D] in mixed_qkv.dtype: every token's output. No host sync (CUDA-graph capturable).
    """
    H, D, W, Tmax = _check_states(conv_state, state, tape_state, tape_conv)
    dev = state.device
    if num_heads != H:
        raise UserError(f"{NAME}: num_heads={num_heads} but the state has {H} heads; pass the rank's heads")
    B = _check_idx(state_idx, "state_idx", dev)
    R = mixed_qkv.shape[0] if mixed_qkv.dim() == 2 else -1
    if B == 0 or R < 0 or R % B:
        raise UserError(f"{NAME}: {R} token rows for {B} requests; pass 1 + k rows per request, request-major")
    T = R // B
    if T > Tmax:
        raise UserError(f"{NAME}: {T} tokens per request but the tapes hold {Tmax}: allocate them for 1 + the "
                        "most speculative tokens per step")
    HD = H * D
    if mixed_qkv.dtype not in ACT_DTYPES:
        raise UserError(f"{NAME}: activation dtype {mixed_qkv.dtype}: bf16 / fp16 / fp32 (the reference serves others)")
    _check_rows(mixed_qkv, "mixed_qkv", R, 3 * HD)
    _check_rows(beta_logit, "beta_logit", R, H)
    _check_rows(g_out, "g_out", R, HD)
    _check_contig(conv_weight, "conv_weight", (3 * HD, W), dev)
    _check_contig(A_log, "A_log", (H,), dev)
    _check_contig(dt_bias, "dt_bias", (HD,), dev)
    _check_contig(norm_weight, "norm_weight", (D,), dev)
    if f_b_weight is not None:
        if f_b_weight.dim() != 2 or f_b_weight.shape[0] != HD:
            raise UserError(f"{NAME}: f_b_weight is {list(f_b_weight.shape)}; pass f_b_proj's [{HD}, Rk] weight")
        rk = f_b_weight.shape[1]
        _check_contig(f_b_weight, "f_b_weight", (HD, rk), dev)
        if f_b_weight.dtype == torch.float64 or f.dtype == torch.float64:
            raise UserError(f"{NAME}: an fp64 f_a / f_b_weight (the gemm would accumulate in fp64); the reference "
                            "serves it")
        _check_rows(f, "f (the low-rank f_a)", R, rk)
    else:
        rk = 0
        _check_rows(f, "f", R, HD)
    for t, what in ((mixed_qkv, "mixed_qkv"), (f, "f"), (beta_logit, "beta_logit"), (g_out, "g_out")):
        if t.device != dev:
            raise UserError(f"{NAME}: {what} is on {t.device}, the states on {dev}: move it there")
    out = torch.empty(R, HD, dtype=mixed_qkv.dtype, device=dev)
    bv, nw = choose_blocks(B, H, D)
    nv = D // bv
    o_ws = torch.empty(R, H, D, dtype=torch.float32, device=dev) if nv > 1 else out
    verify, norm, _ = _kernels(_interpreting())
    verify[(B, H, nv)](
        mixed_qkv, mixed_qkv.stride(0), conv_state, conv_weight, f, f.stride(0),
        f_b_weight if f_b_weight is not None else f, A_log, dt_bias, beta_logit, beta_logit.stride(0),
        g_out, g_out.stride(0), norm_weight, state, state_idx, tape_state, tape_conv, out, o_ws,
        T, Tmax, rk, float(eps), float(gate_lower_bound), float(D ** -0.5 if scale is None else scale),
        H=H, D=D, W=W, BV=bv, NV=nv, HAS_FB=f_b_weight is not None, RKB=min(RK_BLOCK, _pow2(max(rk, 1))),
        num_warps=nw, enable_fp_fusion=False)
    if nv > 1:
        norm[(R, H)](o_ws, g_out, g_out.stride(0), norm_weight, out, float(eps), H=H, D=D,
                     num_warps=max(1, min(4, D // 32)), enable_fp_fusion=False)
    return out


def kda_accept_triton(conv_state: torch.Tensor, state: torch.Tensor, state_idx: torch.Tensor,
                      accepted: torch.Tensor, tape_state: torch.Tensor, tape_conv: torch.Tensor) -> None:
    """Move each request's live states on to the end of its accepted prefix (in place, no host sync).

    Parameters
    ----------
    conv_state : [S, 3*H*D, W-1], state : [S, H, D, D] fp32 (contiguous): the live states, the state before
        the verification step; updated in place at ``state_idx``.
    state_idx : [B] int32 / int64 state row of each request.
    accepted : [B] int32 / int64 ``j`` in ``-1 .. Tmax-1``: the state becomes the one after tokens ``0..j``
        of the last verification step; ``-1`` leaves the row as it is.
    tape_state [S, Tmax, H, 3, D] fp32, tape_conv [S, Tmax, 3*H*D]: the tapes that step wrote; only
        entries ``<= j`` are read.
    """
    H, D, W, Tmax = _check_states(conv_state, state, tape_state, tape_conv)
    dev = state.device
    B = _check_idx(state_idx, "state_idx", dev)
    if _check_idx(accepted, "accepted", dev) != B:
        raise UserError(f"{NAME}: accepted has {accepted.shape[0]} entries for {B} requests; pass one per request")
    if B == 0:
        return
    bv, nw = choose_blocks(B, H, D)
    _, _, accept = _kernels(_interpreting())
    accept[(B, H, D // bv)](conv_state, state, state_idx, accepted, tape_state, tape_conv, Tmax,
                            H=H, D=D, W=W, BV=bv, WP=_pow2(W - 1), num_warps=nw, enable_fp_fusion=False)


__all__ = ["MAX_CONV", "NAME", "choose_blocks", "kda_accept_triton", "kda_verify_triton"]
