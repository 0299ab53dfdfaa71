"""Triton KDA verification step and accept (``attention.kda_verify`` / ``attention.kda_accept``).

Contracts: ``ops.attention.kda_verify.kda_verify_reference`` and ``kda_accept_reference`` (the same
arguments, keyword-only arguments and returns; the tape layout is that module's docstring).

Registered as ``attention.kda_verify.triton`` / ``attention.kda_accept.triton`` (CUDA GPUs, head_dim a
power of two in 16..128, conv width 2..4); tested under the Triton interpreter
(``tests/ops/test_kda_verify_triton.py``) and on the H200 (``tests/ops/test_kda_verify_triton_gpu.py``);
timings in ``NOTES_verify.md``.

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

Variants (``VerifyConfig``; ``kda_verify_triton_with`` / ``kda_accept_triton_with`` take one, the public
functions launch ``default_config``: the prologue form, measured fastest; ``candidate_configs`` lists
what ``benchmarks/scripts/kda_verify_bench.py`` sweeps per B, its timings and the pick go to NOTES_verify.md):

* **fused** (above): every program runs the whole token, so the serial chain per token holds the x loads, the
  conv, three cross-lane reductions for the norms, the f_b gemv (``D x Rk`` from L2 per token per program: 32 KiB
  at D = Rk = 128, bf16, read NV times per head) and the delta rule; at large B its ~240 registers a thread allow
  one 8-warp program per SM.
* **hoist_fb**: the gemm of all R rows first (``kda_fb_gemm_kernel``, grid ``(R / 16, H)``, one ``tl.dot`` of
  ``[16, Rk] x [Rk, D]`` per program into ``[R, H D]`` of f_a's dtype: the same fp32 accumulation and one
  rounding), then the fused kernel reads it as ``f``: no gemv in the token loop, one launch more.
* **prologue**: nothing of a token but the delta rule reads the state, so ``kda_verify_prep_kernel`` (grid
  ``(R / 16, H)``: 16 token rows of one head per program, all in parallel) does conv (the history of a row is the
  rows before it in its request, then the conv-state columns), SiLU, rounding, q / k norms, the gemm, the decay
  and beta, writes them to an fp32 workspace ``[R, H, 4, D]`` (+ beta ``[R, H]``) and writes the tape's k, exp(g)
  and conv inputs; ``kda_verify_rec_kernel`` (grid ``(B, H, NV)``) then runs only ``S *= exp(g)``,
  ``v' = beta (v - S k)``, ``S += v' k^T``, ``o = S q`` per token, loading token t+1's vectors before token t's
  math (they do not depend on the state: their L2 latency hides behind it), and stores v' and o. With 16-32 state
  floats a thread it needs ~100-200 registers (``PROLOGUE_BLOCKS``), so several programs share an SM.
  The same two state operations as the fused kernel and the accept (the accept's bit-exactness holds for every
  variant: it replays the tape that the variant wrote). The prologue's and the gemm's ``tl.dot`` runs on bf16 /
  fp16 operands as they are on the GPU; under the interpreter (whose bf16 ``tl.dot`` is wrong in Triton 3.9) and
  for fp32 operands both are upcast (``input_precision="ieee"``, never tf32).
* **prologue split** (``prep_split``, the default): the prologue's grid gains a third axis of 4, program
  ``(i, h, p)`` doing only q, k, v (conv, SiLU, rounding, norm) or the decay with beta: four times the programs
  where one per head leaves most SMs idle (12 at Kimi K3 TP8, batch 1), the same operations per element.
* **accept_unroll** (the default up to ``MAX_ACCEPT_UNROLL`` tape tokens): the accept's replay unrolled over the
  whole tape with the tokens past ``j`` masked, so no round of tape loads waits for the one before.
* the accept's blocks (``accept_block_v`` / ``accept_warps``) are chosen apart from the verify's: it streams the
  state once and replays, nothing serial but the rank-1 updates.

Layout: Triton lays a ``[BV, 128]`` slice out with the 32 lanes along keys and up to 4 warps along keys too
(TTGIR of the sm_90 build: ``threadsPerWarp [1, 32], warpsPerCTA [2, 4]`` at BV = 64, 8 warps), so ``S k`` and
``S q`` cross warps through shared memory once each per token; a program of one or two warps (the BV = 16
configs) keeps them within warps. Forcing warps along value rows needs an explicit layout (Gluon), not tried.

Registers (D = 128, sm_90 build, ptxas ``-v``; bench shapes H = 12, Rk = 128, bf16; none spills): fused BV 16 at
2 warps 247 (128 with hoist_fb), BV 64 at 8 warps 239 (199 with hoist_fb); prologue recurrence BV 16 / 2 warps
127, 16 / 4 96, 32 / 4 168, 32 / 8 110, 64 / 8 194; the prologue itself 226 at 8 warps (at 4 it spills; split 159), the
hoisted gemm 43; the accept 48 .. 128. Spills (not listed as candidates): the fused kernel at BV = 128 (8 or 16
warps), the recurrence at 64 state floats a thread and more (BV 64 / 4 warps, BV 128 / 8 or 16 warps).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.kernels.triton_common import head_dim_refusal, triton_gpu_refusal

NAME = "attention.kda_verify.triton"
ACCEPT_NAME = "attention.kda_accept.triton"
HEAD_DIMS = (16, 128)
"""Head dims served (powers of two): wider ones hold q and k of the whole head beside a state slice of at
least 16 rows, not built or measured."""
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
"""Most value rows per program of ``choose_blocks``: a [128, 128] slice (8 or 16 warps) spills registers in the
sm_90 build, of the fused kernel and of the prologue's recurrence alike."""
PREP_ROWS = 16
"""Token rows per program of the prologue and the hoisted f_b gemm: ``tl.dot``'s smallest M."""
PREP_WARPS = 8
"""Warps of a prologue program, split or not (split at 4 warps: 254 registers and a stack frame in the sm_90 build)."""
WARPS = (1, 2, 4, 8, 16)
MAX_ACCEPT_UNROLL = 16
"""Longest tape the accept unrolls (``VerifyConfig.accept_unroll``; 1 + k <= 8 in the verification steps); a
longer one runs the loop."""


@dataclass(frozen=True)
class VerifyConfig:
    """How ``kda_verify_triton_with`` / ``kda_accept_triton_with`` launch (static: graph-safe).

    ``block_v`` value rows of a head's state per verify program (a power of two dividing D; D: one program
    per head, the gated norm in the kernel, no second launch), ``num_warps`` of those programs.
    ``hoist_fb``: the f_b gemm of all R rows runs first as its own launch (``kda_fb_gemm_kernel``, fp32
    ``tl.dot`` into an [R, H D] tensor of f_a's dtype) instead of once per token inside every program.
    ``prologue``: everything that does not read the recurrent state (conv, SiLU, norms, decay with the gemm,
    beta) runs for all R rows in one parallel launch; the verify programs then run only the delta rule.
    ``accept_block_v`` / ``accept_warps``: the accept's blocks (None: ``choose_blocks``).
    ``prep_split``: the prologue launch as four programs per (row block, head): q, k, v, and the decay with beta
    (for few rows, where one program per head leaves most SMs idle); the same operations per element.
    ``accept_unroll``: the accept's replay unrolled over the tape (every token's entries loaded at once, the
    tokens past the accepted one masked) up to ``MAX_ACCEPT_UNROLL`` tape tokens; False: a loop over the
    accepted tokens, one dependent round of loads each."""

    block_v: int
    num_warps: int
    hoist_fb: bool = False
    prologue: bool = False
    prep_split: bool = False
    accept_block_v: int | None = None
    accept_warps: int | None = None
    accept_unroll: bool = True

    @property
    def name(self) -> str:
        kind = ("prologue-split" if self.prep_split else "prologue") if self.prologue else \
            "hoist_fb" if self.hoist_fb else "fused"
        acc = "" if self.accept_block_v is None else f" accept bv{self.accept_block_v} w{self.accept_warps}"
        acc += "" if self.accept_unroll else " accept-loop"
        return f"{kind} bv{self.block_v} w{self.num_warps}{acc}"


class _Kernels(NamedTuple):
    verify: Any
    out_norm: Any
    accept: Any
    fb_gemm: Any
    prep: Any
    rec: Any


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    del interpret  # one build per TRITON_INTERPRET setting
    # the jit functions resolve names through this module's globals (not the closure): the helpers and
    # ``tl`` are bound there on the first build
    global tl, _conv3, _hist, _silu_round, _delta_rule, _store_out, _fb_rows, _conv_rows, _ws_token
    global _prep_channels, _prep_decay, _replay_token
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
    def _delta_rule(S, q, k, decay, v, beta):
        """One token of the gated delta rule on the owned value rows [BV, D]: (new S, the delta vn [BV], the
        output o [BV]). The accept replays exactly the decay and the vn update, so both kernels call this."""
        S = S * decay[None, :]
        vn = beta * (v - tl.sum(S * k[None, :], axis=1))
        S = S + vn[:, None] * k[None, :]
        return S, vn, tl.sum(S * q[None, :], axis=1)

    @triton.jit
    def _store_out(o, out, o_ws, g_out, s_g, nw, eps, r, h, dv, H: tl.constexpr, D: tl.constexpr,
                   NV: tl.constexpr):
        """Row r's output of head h: normed and gated into ``out`` when the program owns all D value rows,
        else fp32 into ``o_ws`` (the norm needs the whole head: kda_out_norm_kernel finishes it)."""
        if NV == 1:
            o = o * tl.rsqrt(tl.sum(o * o, axis=0) / D + eps) * nw
            o = o * tl.sigmoid(tl.load(g_out + r * s_g + h * D + dv).to(tl.float32))
            tl.store(out + r * (H * D) + h * D + dv, o.to(out.dtype.element_ty))
        else:
            tl.store(o_ws + (r * H + h) * D + dv, o)

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
            S, vn, o = _delta_rule(S, q, k, decay, v, beta)
            _store_out(o, out, o_ws, g_out, s_g, nw, eps, r, h, dv, H, D, NV)
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
    def _replay_token(S, kt, dec, vn):
        """One tape token of the accept: the reference replay's two fp32 operations, in its order (no FMA:
        the launches pass enable_fp_fusion=False)."""
        S = S * dec[None, :]
        return S + vn[:, None] * kt[None, :]

    @triton.jit
    def kda_accept_kernel(conv_state, state, state_idx, accepted, tape_state, tape_conv, TMAX,
                          H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BV: tl.constexpr,
                          WP: tl.constexpr, TU: tl.constexpr):
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
            sp = state + (row * H + h) * (D * D) + dv[:, None] * D + dk[None, :]
            S = tl.load(sp)
            tb = tape_state + row * TMAX * (H * 3 * D) + h * (3 * D)
            if TU > 0:
                # unrolled over the whole tape (TU = Tmax): no load depends on the state or on an earlier
                # token, and nothing is stored before them, so every token's tape entries are in flight at
                # once instead of one memory latency per accepted token; tokens past j are masked loads
                # and a select that keeps S (never read, never applied)
                for t in tl.static_range(TU):
                    live = (dk * 0 + t) < n
                    kt = tl.load(tb + t * (H * 3 * D) + dk, mask=live, other=0.0)
                    dec = tl.load(tb + t * (H * 3 * D) + D + dk, mask=live, other=1.0)
                    vn = tl.load(tb + t * (H * 3 * D) + 2 * D + dv, mask=(dv * 0 + t) < n, other=0.0)
                    S = tl.where(t < n, _replay_token(S, kt, dec, vn), S)
            else:
                for t in range(0, n):
                    kt = tl.load(tb + t * (H * 3 * D) + dk)
                    dec = tl.load(tb + t * (H * 3 * D) + D + dk)
                    vn = tl.load(tb + t * (H * 3 * D) + 2 * D + dv)
                    S = _replay_token(S, kt, dec, vn)
            tl.store(sp, S)
            # the conv state: channels dv of each of q, k, v (after the replay, so no store precedes its loads)
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

    @triton.jit
    def _fb_rows(f, s_f, fb, r64, rm, h, RK, D: tl.constexpr, RKP: tl.constexpr, DOT_F32: tl.constexpr):
        """``round(f_a[r] . f_b[h D + d, :])`` for a block of rows ``r`` ([RB, D] fp32, the gemm contract:
        fp32 accumulation, one rounding to f_a's dtype); ``tl.dot`` over the whole (padded) rank at once."""
        dk = tl.arange(0, D)
        kr = tl.arange(0, RKP)
        km = kr < RK
        fa = tl.load(f + r64[:, None] * s_f + kr[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        fbw = tl.load(fb + (h * D + dk)[None, :] * RK + kr[:, None], mask=km[:, None], other=0.0)   # [RKP, D]
        if DOT_F32:  # fp32 (or mixed) operands: full fp32 products, never tf32
            acc = tl.dot(fa.to(tl.float32), fbw.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(fa, fbw)
        return acc.to(f.dtype.element_ty).to(tl.float32)

    @triton.jit
    def kda_fb_gemm_kernel(f, s_f, fb, f_full, R, RK, H: tl.constexpr, D: tl.constexpr, RB: tl.constexpr,
                           RKP: tl.constexpr, DOT_F32: tl.constexpr):
        """``hoist_fb``: the decay input ``f_a f_b^T`` of RB rows x one head, rounded to f_a's dtype."""
        r = tl.program_id(0) * RB + tl.arange(0, RB)
        h = tl.program_id(1)
        rm = r < R
        r64 = r.to(tl.int64)
        fv = _fb_rows(f, s_f, fb, r64, rm, h, RK, D, RKP, DOT_F32)
        dk = tl.arange(0, D)
        tl.store(f_full + r64[:, None] * (H * D) + h * D + dk[None, :], fv.to(f_full.dtype.element_ty),
                 mask=rm[:, None])

    @triton.jit
    def _conv_rows(x, s_x, conv_state, conv_w, r64, t, srow, c, rm, W: tl.constexpr, C: tl.constexpr):
        """The causal conv of a block of token rows over channels ``c`` ([RB, D] fp32) and the rows' own
        inputs (fp32): the input ``j`` tokens back is row ``r - j`` of ``x`` (rounded to the conv state's
        dtype, as the reference keeps it) while ``t >= j``, else column ``W-1-(j-t)`` of the conv-state row;
        summed oldest first like ``_conv3``."""
        m2 = rm[:, None]
        x0 = tl.load(x + r64[:, None] * s_x + c[None, :], mask=m2, other=0.0).to(tl.float32)
        cdt = conv_state.dtype.element_ty
        acc = tl.zeros(x0.shape, tl.float32)
        for i in tl.static_range(W - 1):
            j = W - 1 - i                                                 # oldest first
            from_x = (t >= j)[:, None]
            hx = tl.load(x + (r64 - j)[:, None] * s_x + c[None, :], mask=m2 & from_x, other=0.0)
            hc = tl.load(conv_state + srow[:, None] * (C * (W - 1)) + c[None, :] * (W - 1) + (W - 1 - j + t)[:, None],
                         mask=m2 & (t < j)[:, None], other=0.0)
            hv = tl.where(from_x, hx.to(cdt).to(tl.float32), hc.to(tl.float32))
            wj = tl.load(conv_w + c * W + (W - 1 - j)).to(tl.float32)
            acc = acc + wj[None, :] * hv
        return acc + tl.load(conv_w + c * W + (W - 1)).to(tl.float32)[None, :] * x0, x0

    @triton.jit
    def _prep_channels(x, s_x, conv_state, conv_w, tape_state, tape_conv, ws, g3, r64, t, srow, h, rm, TMAX, scale,
                       H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, C: tl.constexpr):
        """Channel group ``g3`` (0 q, 1 k, 2 v) of head ``h`` for a block of rows: conv + SiLU + rounding, the L2
        norm of q (times ``scale``) and k, into ``ws`` slot 0 / 1 / 3; the tape's conv inputs, and k."""
        dk = tl.arange(0, D)
        c = g3 * (H * D) + h * D + dk
        z, xin = _conv_rows(x, s_x, conv_state, conv_w, r64, t, srow, c, rm, W, C)
        y = _silu_round(z, x.dtype.element_ty)
        if g3 < 2:
            y = y * tl.rsqrt(tl.sum(y * y, axis=1) + 1e-6)[:, None]
            if g3 == 0:
                y = y * scale
        m2 = rm[:, None]
        slot = g3 + g3 // 2                                 # ws holds (q, k, exp(g), v): 0, 1, 3
        tl.store(ws + (r64 * H + h)[:, None] * (4 * D) + slot * D + dk[None, :], y, mask=m2)
        ts = ((srow * TMAX + t) * (H * 3 * D) + h * (3 * D))[:, None] + dk[None, :]
        if g3 == 1:
            tl.store(tape_state + ts, y, mask=m2)
        tl.store(tape_conv + ((srow * TMAX + t) * C)[:, None] + c[None, :], xin.to(tape_conv.dtype.element_ty),
                 mask=m2)

    @triton.jit
    def _prep_decay(f, s_f, fb, A_log, dt_bias, beta_logit, s_beta, tape_state, ws, ws_beta, r64, t, srow, h, rm,
                    TMAX, RK, lower_bound, H: tl.constexpr, D: tl.constexpr, HAS_FB: tl.constexpr,
                    RKP: tl.constexpr, DOT_F32: tl.constexpr):
        """The decay (the f_b gemm fused) into ``ws`` slot 2 and the tape, beta into ``ws_beta``."""
        dk = tl.arange(0, D)
        if HAS_FB:
            fv = _fb_rows(f, s_f, fb, r64, rm, h, RK, D, RKP, DOT_F32)
        else:
            fv = tl.load(f + r64[:, None] * s_f + (h * D + dk)[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
        a = tl.exp(tl.load(A_log + h).to(tl.float32))
        dtb = tl.load(dt_bias + h * D + dk).to(tl.float32)
        decay = tl.exp(lower_bound * tl.sigmoid(a * (fv + dtb[None, :])))
        beta = tl.sigmoid(tl.load(beta_logit + r64 * s_beta + h, mask=rm, other=0.0).to(tl.float32))
        m2 = rm[:, None]
        tl.store(ws + (r64 * H + h)[:, None] * (4 * D) + 2 * D + dk[None, :], decay, mask=m2)
        tl.store(ws_beta + r64 * H + h, beta, mask=rm)
        ts = ((srow * TMAX + t) * (H * 3 * D) + h * (3 * D))[:, None] + dk[None, :]
        tl.store(tape_state + ts + D, decay, mask=m2)

    @triton.jit
    def kda_verify_prep_kernel(x, s_x, conv_state, conv_w, f, s_f, fb, A_log, dt_bias, beta_logit, s_beta,
                               state_idx, tape_state, tape_conv, ws, ws_beta, R, T, TMAX, RK, lower_bound, scale,
                               H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, RB: tl.constexpr,
                               HAS_FB: tl.constexpr, RKP: tl.constexpr, DOT_F32: tl.constexpr,
                               SPLIT: tl.constexpr):
        """``prologue``, grid (cdiv(R, RB), H, 4 if SPLIT else 1): everything of a token that does not read the
        recurrent state, for RB rows x one head: conv + SiLU + rounding, q / k L2 norms, the decay (gemm fused),
        beta. Writes ``ws[r, h]`` = (q, k, exp(g), v) fp32, ``ws_beta[r, h]``, and the tape's k, exp(g) and
        conv inputs (the recurrence adds v'). SPLIT: program ``(i, h, p)`` does only part ``p`` (q, k, v, or
        the decay and beta), four times the programs for few rows; the same operations per element."""
        r = tl.program_id(0) * RB + tl.arange(0, RB)
        h = tl.program_id(1)
        C: tl.constexpr = 3 * H * D
        rm = r < R
        r64 = r.to(tl.int64)
        t = r % T
        srow = tl.load(state_idx + r // T, mask=rm, other=0).to(tl.int64)
        if SPLIT:
            part = tl.program_id(2)
            if part < 3:
                _prep_channels(x, s_x, conv_state, conv_w, tape_state, tape_conv, ws, part, r64, t, srow, h, rm,
                               TMAX, scale, H, D, W, C)
            else:
                _prep_decay(f, s_f, fb, A_log, dt_bias, beta_logit, s_beta, tape_state, ws, ws_beta, r64, t, srow, h,
                            rm, TMAX, RK, lower_bound, H, D, HAS_FB, RKP, DOT_F32)
        else:
            for g3 in tl.static_range(3):
                _prep_channels(x, s_x, conv_state, conv_w, tape_state, tape_conv, ws, g3, r64, t, srow, h, rm,
                               TMAX, scale, H, D, W, C)
            _prep_decay(f, s_f, fb, A_log, dt_bias, beta_logit, s_beta, tape_state, ws, ws_beta, r64, t, srow, h, rm,
                        TMAX, RK, lower_bound, H, D, HAS_FB, RKP, DOT_F32)

    @triton.jit
    def _ws_token(ws, ws_beta, r, r_last, h, dk, dv, H: tl.constexpr, D: tl.constexpr):
        """Token row ``min(r, r_last)``'s prologue outputs for head ``h``: clamped, not masked, so the
        look-ahead past the request's last token re-reads that token (an L2 hit) instead of leaving it."""
        r = tl.minimum(r, r_last)
        wb = (r * H + h) * (4 * D)
        return (tl.load(ws + wb + dk), tl.load(ws + wb + D + dk), tl.load(ws + wb + 2 * D + dk),
                tl.load(ws + wb + 3 * D + dv), tl.load(ws_beta + r * H + h))

    @triton.jit
    def kda_verify_rec_kernel(ws, ws_beta, g_out, s_g, norm_w, state, state_idx, tape_state, out, o_ws,
                              T, TMAX, eps, H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr):
        """``prologue``, grid (B, H, NV): only the serial part, the gated delta rule on the state slice, from
        the prologue's per-token vectors; the next token's vectors are loaded before this token's math (they
        do not depend on the state), so their L2 latency hides behind it."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        vs = tl.program_id(2)
        row = tl.load(state_idx + b).to(tl.int64)
        dk = tl.arange(0, D)
        dv = vs * BV + tl.arange(0, BV)
        S = tl.load(state + (row * H + h) * (D * D) + dv[:, None] * D + dk[None, :])              # [BV, D] fp32
        nw = tl.load(norm_w + dv).to(tl.float32)
        tsb = row * TMAX * (H * 3 * D) + h * (3 * D)
        r0 = (b * T).to(tl.int64)
        q, k, decay, v, beta = _ws_token(ws, ws_beta, r0, r0 + T - 1, h, dk, dv, H, D)
        for t in range(T):
            r = r0 + t
            qn, kn, dn, vn_in, bn = _ws_token(ws, ws_beta, r + 1, r0 + T - 1, h, dk, dv, H, D)
            S, vn, o = _delta_rule(S, q, k, decay, v, beta)     # the accept replays its decay and vn update
            _store_out(o, out, o_ws, g_out, s_g, nw, eps, r, h, dv, H, D, NV)
            tl.store(tape_state + tsb + t * (H * 3 * D) + 2 * D + dv, vn)
            q, k, decay, v, beta = qn, kn, dn, vn_in, bn

    return _Kernels(kda_verify_kernel, kda_out_norm_kernel, kda_accept_kernel, kda_fb_gemm_kernel,
                    kda_verify_prep_kernel, kda_verify_rec_kernel)


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


DEFAULT_SMALL_BATCH = 2
"""Requests up to which the default prologue recurrence takes 16 value rows per program (more programs for few
requests), above it 32 with the accept at ``ACCEPT_ALT``."""


def default_config(B: int, H: int, D: int) -> VerifyConfig:
    """What ``kda_verify_triton`` / ``kda_accept_triton`` launch: the prologue form (the state-free work of all rows
    in one parallel launch, then only the delta rule per token) - the fastest of ``candidate_configs`` at every
    batch of the H200 sweep at Kimi K3 TP8 shapes (``NOTES_verify.md``) - at 16 value rows x 4 warps per program
    up to ``DEFAULT_SMALL_BATCH`` requests with the accept at ``choose_blocks``, else 32 x 4 with the accept at
    ``ACCEPT_ALT``; never wider than the head. The prologue split four ways (``prep_split``; H200 session 28, k = 7:
    14.6 vs 18.9 us at batch 1, 27.6 vs 33.2 at batch 8) and the accept unrolled over the tape (in the layer 4.5-5.0
    us against the loop's 7.4-7.6 of session 27's profile; alone, on a tape just written, the loop is 0.1-0.75 us
    faster)."""
    if B <= DEFAULT_SMALL_BATCH:
        return VerifyConfig(min(16, D), 4, prologue=True, prep_split=True)
    bv, (abv, anw) = min(32, D), ACCEPT_ALT
    return VerifyConfig(bv, 4, prologue=True, prep_split=True, accept_block_v=min(abv, D), accept_warps=anw)


def _resolve(config: VerifyConfig | None, B: int, H: int, D: int) -> VerifyConfig:
    """``config`` checked against head dim D (None: ``default_config``)."""
    if config is None:
        return default_config(B, H, D)
    for bv, nw, what in ((config.block_v, config.num_warps, "block_v / num_warps"),
                         (config.accept_block_v, config.accept_warps, "accept_block_v / accept_warps")):
        if bv is None and nw is None and what.startswith("accept"):
            continue
        if bv is None or nw is None or bv < 1 or bv & (bv - 1) or D % bv or nw not in WARPS:
            raise UserError(f"{NAME}: {config} {what} = {bv} / {nw}: block_v a power of two dividing head_dim {D}, "
                            f"num_warps in {WARPS} (both or neither for the accept)")
    return config


PROLOGUE_BLOCKS = ((16, 2), (16, 4), (32, 4), (32, 8), (64, 8))
"""(block_v, num_warps) of the prologue recurrence worth timing: 16 or 32 state floats a thread at D = 128,
spill-free in the sm_90 build; 64 a thread ([64, 128] at 4 warps, [128, 128] at 8 or 16) spills."""
ACCEPT_ALT = (32, 4)
"""One accept shape beside ``choose_blocks``' (twice its programs at B >= 16, half at B = 1)."""


def candidate_configs(B: int, H: int, D: int) -> list[VerifyConfig]:
    """At most 10 configs worth timing for B requests of H heads of head dim D (the bench sweeps them; numbers in
    NOTES_verify.md): the default first, the fused kernel at ``choose_blocks`` and the same with the gemm hoisted, the prologue at each of ``PROLOGUE_BLOCKS`` that fits D, and the prologue at 32 rows
    with the accept at ``ACCEPT_ALT``."""
    bv, nw = choose_blocks(B, H, D)
    out = [default_config(B, H, D), VerifyConfig(bv, nw), VerifyConfig(bv, nw, hoist_fb=True)]
    out += [VerifyConfig(b, w, prologue=True) for b, w in PROLOGUE_BLOCKS if D % b == 0]
    abv, anw = ACCEPT_ALT
    if D % abv == 0 and (abv, anw) != (bv, nw):
        out.append(VerifyConfig(abv, anw, prologue=True, accept_block_v=abv, accept_warps=anw))
    # the default's accept loop beside its unrolled replay, its prologue unsplit / split
    out[1:1] = [dataclasses.replace(out[0], accept_unroll=False),
                dataclasses.replace(out[0], prep_split=not out[0].prep_split)]
    seen: set[VerifyConfig] = set()
    return [c for c in out if not (c in seen or seen.add(c))][:10]


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
    return kda_verify_triton_with(None, mixed_qkv, conv_state, conv_weight, f, A_log, dt_bias, beta_logit, g_out,
                                  norm_weight, state, state_idx, tape_state, tape_conv, num_heads=num_heads, eps=eps,
                                  gate_lower_bound=gate_lower_bound, scale=scale, f_b_weight=f_b_weight)


def kda_verify_triton_with(config: VerifyConfig | None, mixed_qkv: torch.Tensor, conv_state: torch.Tensor,
                           conv_weight: torch.Tensor, f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                           beta_logit: torch.Tensor, g_out: torch.Tensor, norm_weight: torch.Tensor,
                           state: torch.Tensor, state_idx: torch.Tensor, tape_state: torch.Tensor,
                           tape_conv: torch.Tensor, *, num_heads: int, eps: float = 1e-5,
                           gate_lower_bound: float = -5.0, scale: float | None = None,
                           f_b_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``kda_verify_triton`` launched as ``config`` says (None: ``default_config``); same results within
    the verify's tolerances, the same tape contract."""
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
    return _launch_verify(_resolve(config, B, H, D), mixed_qkv, conv_state, conv_weight, f, A_log, dt_bias,
                          beta_logit, g_out, norm_weight, state, state_idx, tape_state, tape_conv, H=H, D=D, W=W,
                          T=T, Tmax=Tmax, rk=rk, eps=float(eps), lower_bound=float(gate_lower_bound),
                          scale=float(D ** -0.5 if scale is None else scale), f_b_weight=f_b_weight)


def _launch_verify(cfg: VerifyConfig, x: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
                   f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, beta_logit: torch.Tensor,
                   g_out: torch.Tensor, norm_weight: torch.Tensor, state: torch.Tensor, state_idx: torch.Tensor,
                   tape_state: torch.Tensor, tape_conv: torch.Tensor, *, H: int, D: int, W: int, T: int, Tmax: int,
                   rk: int, eps: float, lower_bound: float, scale: float,
                   f_b_weight: torch.Tensor | None) -> torch.Tensor:
    """The launches of one checked verification step under ``cfg``."""
    dev = state.device
    B, R, HD = state_idx.shape[0], x.shape[0], H * D
    k = _kernels(_interpreting())
    fb = f_b_weight if f_b_weight is not None else f
    rkp = max(16, _pow2(max(rk, 1)))  # tl.dot's smallest K; the padding columns load as 0
    # 16-bit operands go to the tensor cores as they are (their products are exact in fp32); the interpreter's
    # tl.dot garbles bf16 operands (Triton 3.9), so there both are upcast, which rounds the same products
    dot_f32 = (f_b_weight is None or _interpreting()
               or not (f.dtype == f_b_weight.dtype and f.dtype in (torch.bfloat16, torch.float16)))
    prep_grid = (-(-R // PREP_ROWS), H)
    prologue_grid = (*prep_grid, 4 if cfg.prep_split else 1)
    if cfg.hoist_fb and f_b_weight is not None:
        f_full = torch.empty(R, HD, dtype=f.dtype, device=dev)
        k.fb_gemm[prep_grid](f, f.stride(0), f_b_weight, f_full, R, rk, H=H, D=D, RB=PREP_ROWS, RKP=rkp,
                             DOT_F32=dot_f32, num_warps=PREP_WARPS, enable_fp_fusion=False)
        f, fb, f_b_weight, rk = f_full, f_full, None, 0
    out = torch.empty(R, HD, dtype=x.dtype, device=dev)
    if R == 0:  # no tokens: nothing to launch (the prologue's look-ahead needs a first token)
        return out
    bv, nw = cfg.block_v, cfg.num_warps
    nv = D // bv
    o_ws = torch.empty(R, H, D, dtype=torch.float32, device=dev) if nv > 1 else out
    if cfg.prologue:
        ws = torch.empty(R, H, 4, D, dtype=torch.float32, device=dev)
        ws_beta = torch.empty(R, H, dtype=torch.float32, device=dev)
        k.prep[prologue_grid](x, x.stride(0), conv_state, conv_weight, f, f.stride(0), fb, A_log, dt_bias, beta_logit,
                          beta_logit.stride(0), state_idx, tape_state, tape_conv, ws, ws_beta, R, T, Tmax, rk,
                          lower_bound, scale, H=H, D=D, W=W, RB=PREP_ROWS, HAS_FB=f_b_weight is not None, RKP=rkp,
                          DOT_F32=dot_f32, SPLIT=cfg.prep_split, num_warps=PREP_WARPS, enable_fp_fusion=False)
        k.rec[(B, H, nv)](ws, ws_beta, g_out, g_out.stride(0), norm_weight, state, state_idx, tape_state, out, o_ws,
                          T, Tmax, eps, H=H, D=D, BV=bv, NV=nv, num_warps=nw, enable_fp_fusion=False)
    else:
        k.verify[(B, H, nv)](
            x, x.stride(0), conv_state, conv_weight, f, f.stride(0), fb, A_log, dt_bias, beta_logit,
            beta_logit.stride(0), g_out, g_out.stride(0), norm_weight, state, state_idx, tape_state, tape_conv, out,
            o_ws, T, Tmax, rk, eps, lower_bound, scale, H=H, D=D, W=W, BV=bv, NV=nv, HAS_FB=f_b_weight is not None,
            RKB=min(RK_BLOCK, _pow2(max(rk, 1))), num_warps=nw, enable_fp_fusion=False)
    if nv > 1:
        k.out_norm[(R, H)](o_ws, g_out, g_out.stride(0), norm_weight, out, eps, H=H, D=D,
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
    kda_accept_triton_with(None, conv_state, state, state_idx, accepted, tape_state, tape_conv)


def kda_accept_triton_with(config: VerifyConfig | None, conv_state: torch.Tensor, state: torch.Tensor,
                           state_idx: torch.Tensor, accepted: torch.Tensor, tape_state: torch.Tensor,
                           tape_conv: torch.Tensor) -> None:
    """``kda_accept_triton`` with ``config``'s accept blocks (None, or its ``accept_block_v`` None:
    ``choose_blocks``); bit for bit the reference replay whatever the blocks (each element's two operations
    do not depend on them)."""
    H, D, W, Tmax = _check_states(conv_state, state, tape_state, tape_conv)
    dev = state.device
    B = _check_idx(state_idx, "state_idx", dev)
    if _check_idx(accepted, "accepted", dev) != B:
        raise UserError(f"{NAME}: accepted has {accepted.shape[0]} entries for {B} requests; pass one per request")
    if B == 0:
        return
    cfg = _resolve(config, B, H, D)
    if cfg.accept_block_v is None:
        bv, nw = choose_blocks(B, H, D)
    else:
        bv, nw = cfg.accept_block_v, cfg.accept_warps
    tu = Tmax if cfg.accept_unroll and Tmax <= MAX_ACCEPT_UNROLL else 0
    _kernels(_interpreting()).accept[(B, H, D // bv)](
        conv_state, state, state_idx, accepted, tape_state, tape_conv, Tmax, H=H, D=D, W=W, BV=bv, WP=_pow2(W - 1),
        TU=tu, num_warps=nw, enable_fp_fusion=False)


def _supports(ctx: OpContext) -> Support:
    refusal = triton_gpu_refusal(ctx, "KDA verification steps")
    if refusal:
        return refusal
    dims = dict(ctx.dims)
    D, W = dims.get("head_dim"), dims.get("conv")
    if D is not None and (why := head_dim_refusal(D, *HEAD_DIMS)):
        return why
    if W is not None and not 2 <= W <= MAX_CONV:
        return f"conv width {W}: 2..{MAX_CONV} served (the history is 3 vectors per channel)"
    return True


IMPLEMENTATIONS = [
    Implementation("attention.kda_verify", NAME, kda_verify_triton, _supports, priority=10,
                   description="Triton: per (request, head, value-row slice) the state slice in registers over "
                               "the 1 + k tokens in order, conv + decay gemv fused, tape written, states untouched; "
                               "no host sync (graph-capturable)"),
    Implementation("attention.kda_accept", ACCEPT_NAME, kda_accept_triton, _supports, priority=10,
                   description="Triton: replay the tape's rank-1 updates up to the accepted token in the "
                               "reference's order (no FMA contraction: bit-exact), shift the conv state"),
]

__all__ = ["ACCEPT_NAME", "HEAD_DIMS", "IMPLEMENTATIONS", "MAX_CONV", "NAME", "VerifyConfig", "candidate_configs",
           "choose_blocks", "default_config", "kda_accept_triton", "kda_accept_triton_with", "kda_verify_triton",
           "kda_verify_triton_with"]
