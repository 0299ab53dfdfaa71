"""moe.experts.mma: routed experts over quantized weights (MXFP4, NVFP4, block FP8) on the mma.sync kernel (issue 24;
``NOTES_q4.md``).

The weight stream is the quantized gemms' (``gemm_q4_mma``, ``gemm_fp8_mma``): each lane's 16-byte load of a weight
row is decoded to bf16 in registers (32 e2m1 values of one or two scale blocks, or 16 e4m3 values) and fed to
``m16n8k16`` MMAs with the weights as the A operand (16 rows per m-tile) and up to 8 routing pairs as B - the K loop
is ``gemm_small_m.accumulate_chunks`` itself. What differs is where rows and tokens come from, and the epilogues:

``gate_up`` grid (I / 16, groups): CTA (tile, group) reads 16 gate rows and the same 16 rows of up (I further down
    the expert's [2I, K]) as its two m-tiles, so a lane holds gate and up sums of the same (row, pair) and applies
    the GLU in registers (``gated_act.gated_act_fn``, the dense kernels' definition); h[pair, i] in bf16.
``down_sum`` grid (N / 16, tokens), single-route groups and the combined output: a warp per route (more routes take
    turns), each route's sums rounded to bf16 and weighted in fp32, the warps added in order - batch 1 is two
    launches.
``down`` grid (N / (16 mt), groups): the expert's down rows against the group's h rows; each route's output, rounded
    to bf16 (as the reference rounds it), to row ``pair`` of a [M x top_k, N] result, weighted and summed by
    ``triton_q4.route_sum`` (fp32, routes in order) unless ``per_route``.

A group is one expert and up to 8 of its (token, route) pairs:
  * "route" mode: group = pair (B column 0; the others masked). Every selected expert read once per route - at
    batch 1 each expert once, with no routing kernel before it;
  * "aligned" mode (from ``MIN_TOKENS_ALIGNED`` tokens): ``triton_moe.moe_align``'s runs of 8 pairs per expert
    (groups past ``num_padded`` return at once), so an expert chosen by several tokens is read once per 8.

Numerics are the reference's (``ops.moe.experts_reference``): gate / up sums rounded to bf16, the activation in
fp32, h rounded, each route's output rounded, routing weights applied in fp32. Scales are checked once per weight,
eagerly: MXFP4 bytes 2..128 (the gemm's exact range); NVFP4 (Muse Spark) - each e4m3 scale (per 16 values, two per
lane load) rides in its words' decode multiplier as scale x 2^62, so the sums come out x 2^-64 and the expert's fp32
global scale x 2^64 multiplies them before any rounding (``mma_quant_weights.NVFP4_LOG2_OFFSET``), NaN scale bytes
refused; block FP8 (GLM-5.3) - the FP8 gemm's decode and per-chunk fp32 scales, NaN codes refused, an expert's rows
a whole number of scale blocks. No host sync after that first call, fixed grids: graph capturable. PDL is off by
default (``MmaConfig.pdl``): ``gate_up`` then waits before reading the ids, the down stages after their first weight
loads (which go through the coherent path, ``MmaConfig.prefetch``, so that ptxas keeps them ahead of the wait).
"""


import functools
import math
from dataclasses import dataclass, replace

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.kernels.compile_cache import compile_unit
from latency_specialized.kernels.gemm_common import check_once
from latency_specialized.kernels.gemm_q4_mma import CODING, mxfp4_parts
from latency_specialized.kernels.moe_addend import Addend, add_addend, check_addend_use
from latency_specialized.kernels.mma_quant_weights import NVFP4_UNDO, QuantCoding
from latency_specialized.kernels.gemm_small_m import SMEM_LIMIT, TARGET_WARPS, MmaConfig, pow2_at_most
from latency_specialized.quant.checkpoint_io import QuantizedWeight
from latency_specialized.spec import ActivationSpec

NAME = "moe.experts.mma"
NAME_FP8 = "moe.experts.mma_fp8"
"""The same kernels registered for block-FP8 experts apart: timed on the H200 for the 4-bit formats only, so the FP8
registration stays below ``moe.experts.fp8_triton`` until it is."""
ENABLED = True
"""A/B switch: ``bench --ab triton:latency_specialized.kernels.moe_experts_mma.ENABLED=False`` runs the layers on the
Triton experts kernels this one outranks."""
FORMATS_Q4 = ("mxfp4", "mxfp4-deepseek", "nvfp4", "mxfp4/pairs", "mxfp4-deepseek/pairs", "nvfp4/pairs")
FORMATS = (*FORMATS_Q4, "fp8-block-128")
"""``weight_format`` values served: the 4-bit ones (as checkpoints pack them, or in the paired layout:
``quant.layout.paired_nibbles``) and GLM-5.3's block FP8 (also its "/rows" layout: one scale row per weight row,
where a joined gate | up put a 128-row block across the seam)."""
NVFP4_CODING = QuantCoding(ue8m0=False, block=(1, 16), element="e2m1")
"""NVFP4 in the mma decode: e4m3 scale per 16 values (two per lane load), the fp32 global scale on the sums."""
COLS = 8
"""Routing pairs per group: one n-tile of the MMA."""
MIN_TOKENS_ALIGNED = 16
"""Tokens per step from which groups are ``moe_align``'s runs (an align launch, fewer expert reads) instead of single
routes. Not yet measured: at Kimi K3's 896 experts and top-16, 16 tokens' 256 routes share ~13% of their experts."""
MAX_TOKENS = 64
"""The decode regime this kernel is built for (``moe.experts.q4_grouped_triton`` serves larger steps)."""
MAX_SUM_WARPS = 8
"""``down_sum``'s warps per CTA at most (a warp per route; more routes take turns). Offline sm_90a SASS, Kimi K3 TP8
batch 1 (a route's 3 chunks of loads at once): 16 warps take 91 registers - one 512-thread CTA per SM, 1.7 waves of
the 224 CTAs; 8 warps take 80 - three CTAs per SM, one wave."""
SUM_ROUTES_AHEAD = 0
"""``down_sum``'s routes requested ahead (its ``MmaConfig.lookahead``): 1 requests every route of a warp before the
first MMA (offline SASS: otherwise the second route's loads go out late in the first's math; 128 registers instead of
80). 0 until an H200 times it: ``bench --ab ahead:latency_specialized.kernels.moe_experts_mma.SUM_ROUTES_AHEAD=1``,
or the experts bench's ``dn_a1`` variant."""


@dataclass(frozen=True)
class ExpertsStage:
    """One of the two kernels, statically (part of the compile key)."""

    stage: str
    """"gate_up", "down" (each route's row) or "down_sum" (route mode: a CTA per token and row tile, a warp per route,
    the routes weighted and summed in the kernel)."""
    k: int
    """Reduction width: K (gate_up) or I (down); a multiple of 128."""
    rows: int
    """Weight rows per expert: 2I (gate_up) or N (down); multiples of 16."""
    top_k: int
    aligned: bool
    """Groups are ``moe_align`` runs of ``COLS`` pairs (else one route each)."""
    ids64: bool = False
    """The routing ids are int64 (else int32)."""
    act: str = ""
    """gate_up's GLU: "situ_glu" or "swiglu"."""
    beta: float = 0.0
    beta_lin: float = 0.0
    clamp: float = 0.0
    """SwiGLU clamp (0: none)."""
    weights: str = "mxfp4"
    """"mxfp4" (ue8m0 per 32), "nvfp4" (e4m3 per 16 and an fp32 global scale per expert) or "fp8" (e4m3 codes,
    fp32 block scales of ``fp8_block``)."""
    fp8_block: tuple[int, int] = (128, 128)
    paired: bool = False
    """4-bit codes in the paired-nibble layout (``quant.layout.paired_nibbles``)."""

    @property
    def nvfp4(self) -> bool:
        return self.weights == "nvfp4"

    @property
    def coding(self) -> QuantCoding:
        if self.weights == "fp8":
            return QuantCoding(ue8m0=False, block=self.fp8_block)
        return replace(NVFP4_CODING if self.nvfp4 else CODING, paired=self.paired)

    @property
    def out_width(self) -> int:
        return self.rows // 2 if self.stage == "gate_up" else self.rows

    def refusal(self) -> str | None:
        if self.stage not in ("gate_up", "down", "down_sum"):
            return f"stage {self.stage!r}"
        if self.stage == "down_sum" and self.aligned:
            return "down_sum serves route groups (a CTA per token), not aligned ones"
        if self.weights not in ("mxfp4", "nvfp4", "fp8"):
            return f"weights {self.weights!r}"
        if self.rows % self.coding.block[0]:
            return f"{self.rows} rows per expert cut a {self.coding.block[0]}-row scale block"
        return self.coding.refusal(self.k)


@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    from latency_specialized.kernels.gated_act import ActVariant, gated_act_fn
    from latency_specialized.kernels.gemm_common import ptx
    from latency_specialized.kernels.gemm_small_m import accumulate_chunks, issue_chunks

    P = ptx()

    class MmaExpertsKernel:
        def __init__(self, st: ExpertsStage, cfg: MmaConfig):
            self.st, self.cfg = st, cfg
            # what accumulate_chunks reads of a kernel
            self.k, self.coding, self.kc, self.split_pairs = st.k, st.coding, st.coding.chunk, False
            self.chunks = st.k // st.coding.chunk
            self.summed = st.stage == "down_sum"
            # down_sum: each warp takes whole routes (routes w, w + wk, ...), every chunk of each
            self.parts = 1 if self.summed else cfg.wk
            self.routes_per_warp = -(-st.top_k // cfg.wk)
            self.per_part = -(-self.chunks // self.parts)
            self.ragged = self.chunks % self.parts != 0
            self.frag = 4 * cfg.mt * cfg.nt
            self.glu = st.stage == "gate_up"
            # gate_up: one 16-row tile of the intermediate width, its gate and up rows as the two m-tiles
            self.tiles = st.rows // 2 // 16 if self.glu else -(-st.rows // (16 * cfg.mt))
            if self.glu:
                self.act = gated_act_fn(ActVariant(st.rows // 2, "bf16", st.act, st.beta, st.beta_lin, st.clamp))

        @cute.jit
        def __call__(self, x: cute.Tensor, w: cute.Tensor, scl: cute.Tensor, out: cute.Tensor, ids: cute.Tensor,
                     sorted_ids: cute.Tensor, block_expert: cute.Tensor, num_padded: cute.Tensor,
                     route_weights: cute.Tensor, global_scale: cute.Tensor, groups: Int32, stream):
            self.kernel(x, w, scl, out, ids, sorted_ids, block_expert, num_padded, route_weights, global_scale).launch(
                grid=[self.tiles, groups, 1], block=[32 * self.cfg.wk, 1, 1], stream=stream, use_pdl=self.cfg.pdl)

        @cute.kernel
        def kernel(self, x: cute.Tensor, w: cute.Tensor, scl: cute.Tensor, out: cute.Tensor, ids: cute.Tensor,
                   sorted_ids: cute.Tensor, block_expert: cute.Tensor, num_padded: cute.Tensor,
                   route_weights: cute.Tensor, global_scale: cute.Tensor):
            tile, group, _ = cute.arch.block_idx()
            buf = None
            if cutlass.const_expr(self.cfg.wk > 1):
                smem = cutlass.memory.SmemAllocator()
                buf = smem.allocate_tensor(Float32, cute.make_layout(self.cfg.wk * self.frag * 32), byte_alignment=16)
            if cutlass.const_expr(self.cfg.pdl and self.glu):
                # the ids (and the align tables) are the previous kernels' output: nothing is read before them
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            pairs = ids.shape[0]
            if cutlass.const_expr(self.summed):
                self.token_body(x, w, scl, out, ids, route_weights, global_scale, tile, group, buf)
            elif cutlass.const_expr(self.st.aligned):
                if group * (COLS * self.cfg.nt) < num_padded[0]:
                    self.group_body(x, w, scl, out, sorted_ids, global_scale, block_expert[group], pairs, tile, group,
                                    buf)
            else:
                self.group_body(x, w, scl, out, sorted_ids, global_scale, ids[group].to(Int32), pairs, tile, group,
                                buf)

        @cute.jit
        def pair_of(self, sorted_ids: cute.Tensor, group: Int32, pairs: Int32, col: Int32):
            """(pair, 1/0 valid) of B column ``col`` of the group; an invalid column names pair 0 (never stored,
            its loads masked)."""
            pair = Int32(0)
            ok = Int32(0)
            if cutlass.const_expr(self.st.aligned):
                p = sorted_ids[group * (COLS * self.cfg.nt) + col]
                ok = Int32(p < pairs)
                pair = cutlass.min(p, pairs - 1)
            else:
                ok = Int32(col == 0)
                pair = group
            return pair, ok

        @cute.jit
        def group_body(self, x: cute.Tensor, w: cute.Tensor, scl: cute.Tensor, out: cute.Tensor,
                       sorted_ids: cute.Tensor, global_scale: cute.Tensor, expert: Int32, pairs: Int32, tile: Int32,
                       group: Int32, buf):
            cfg = self.cfg
            st = self.st
            NT: cutlass.Constexpr = cfg.nt
            WK: cutlass.Constexpr = cfg.wk
            F: cutlass.Constexpr = self.frag
            K: cutlass.Constexpr = st.k
            XL: cutlass.Constexpr = self.kc // 32
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            warp = tid // 32
            g = lane // 4
            t4 = lane % 4

            w_rows, w_row_idx = self.expert_rows(w, expert, tile, g, t4)
            # B column g of each n-tile: its pair's activation row (gate_up: the token's x; down: the pair's h)
            x_rows = []
            x_ok = []
            for nt in cutlass.range_constexpr(NT):
                pair, ok = self.pair_of(sorted_ids, group, pairs, 8 * nt + g)
                row = pair
                if cutlass.const_expr(self.glu):
                    row = pair // st.top_k
                x_ok.append(ok)
                x_rows.append(x.iterator.toint() + Int64(row) * (2 * K) + Int64(t4) * (16 * XL))

            # the wait after the first batch of weight loads: PDL's (down), and a fence that keeps ptxas from sinking
            # those loads into the math (it returns at once in a grid launched without PDL); with
            # MmaConfig.prefetch (the default here) ptxas keeps them ahead of it
            acc = accumulate_chunks(self, P, scl, w_rows, w_row_idx, x_rows, x_ok, warp, t4, True)
            acc = self.undo_offset(acc, global_scale, expert)

            # slots finished together: gate and up of one (row, pair), or one down sum
            G: cutlass.Constexpr = F // 2 if self.glu else F
            if cutlass.const_expr(WK == 1):
                for f in cutlass.range_constexpr(G):
                    up = acc[f + G] if self.glu else acc[f]
                    self.store(out, sorted_ids, group, pairs, tile, g, t4, Int32(f), acc[f], up)
            else:
                # partial tiles through shared memory ([warp][slot][lane]), summed in warp order: deterministic
                for f in cutlass.range_constexpr(F):
                    buf[(warp * F + f) * 32 + lane] = acc[f]
                cute.arch.sync_threads()
                for i in cutlass.range_constexpr(-(-G // WK)):
                    f = warp + i * WK
                    if f < G:
                        s = Float32(0.0)
                        u = Float32(0.0)
                        for src in cutlass.range_constexpr(WK):
                            s = s + buf[(src * F + f) * 32 + lane]
                            if cutlass.const_expr(self.glu):
                                u = u + buf[(src * F + f + G) * 32 + lane]
                        self.store(out, sorted_ids, group, pairs, tile, g, t4, f, s, u)

        def undo_offset(self, acc: list, global_scale, expert) -> list:
            """NVFP4: the sums x the expert's fp32 global scale x 2^64 (``NVFP4_LOG2_OFFSET``); MXFP4: as they are."""
            if not self.st.nvfp4:
                return acc
            gsm = global_scale[expert] * Float32(NVFP4_UNDO)
            return [a * gsm for a in acc]

        def expert_rows(self, w: cute.Tensor, expert, tile, g, t4) -> tuple[list, list]:
            """(addresses of this lane's 16 bytes of the weight rows, their indices into the scales): rows g, g + 8 of
            every m-tile, within the expert's [rows, K / 2] of the stacked codes (trace time)."""
            w_rows = []
            w_row_idx = []
            for mt in range(self.cfg.mt):
                for half in range(2):
                    row = expert * self.st.rows + self.local_row(tile, mt, half, g)
                    w_row_idx.append(row)
                    w_rows.append(w.iterator.toint() + Int64(row) * self.coding.row_bytes(self.st.k)
                                  + Int64(t4) * 16)
            return w_rows, w_row_idx

        @cute.jit
        def token_body(self, x: cute.Tensor, w: cute.Tensor, scl: cute.Tensor, out: cute.Tensor, ids: cute.Tensor,
                       route_weights: cute.Tensor, global_scale: cute.Tensor, tile: Int32, token: Int32, buf):
            """down_sum: out[token, rows of the tile] = sum over the token's routes of weight x bf16(h @ W_down^T).
            Warp w takes routes w, w + WK, ... (all their chunks: one batch of loads per route); each route's sums
            are rounded to bf16 (as the reference rounds each expert output) and weighted in fp32; the warps' sums
            are added in warp order (deterministic). Only B column 0 (the route's own h row) is live.
            ``cfg.lookahead`` = L > 0: the weights of routes r + 1 .. r + L are requested before route r's math
            (coherent loads behind fences, as the gemm's batches ahead): without it, ptxas issues a warp's next
            route's loads late in the current route's math (offline SASS, session 36) - a second DRAM round trip."""
            cfg = self.cfg
            TOPK: cutlass.Constexpr = self.st.top_k
            WK: cutlass.Constexpr = cfg.wk
            F: cutlass.Constexpr = self.frag
            K: cutlass.Constexpr = self.st.k
            R: cutlass.Constexpr = self.routes_per_warp
            L: cutlass.Constexpr = min(cfg.lookahead, R - 1)
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            warp = tid // 32
            g = lane // 4
            t4 = lane % 4
            sums = [Float32(0.0) for _ in range(F)]
            routes = []   # per route: (pair, live, expert, weight rows, their scale rows, requested words / scales)

            def request(r: int) -> None:
                j = warp + r * WK
                live = Int32(j < TOPK)
                pair = token * TOPK + cutlass.min(j, TOPK - 1)
                expert = ids[pair].to(Int32)
                w_rows, w_row_idx = self.expert_rows(w, expert, tile, g, t4)
                issued = None
                if cutlass.const_expr(L > 0):
                    issued = ({}, {})
                    issue_chunks(self, P, scl, w_rows, w_row_idx, Int32(0), t4, list(range(self.per_part)), True,
                                 *issued)
                routes.append((pair, live, expert, w_rows, w_row_idx, issued))

            for r in cutlass.range_constexpr(L + 1):
                request(r)
            if cutlass.const_expr(L > 0):  # the wait: PDL's, and a fence (see group_body)
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            for r in cutlass.range_constexpr(R):
                if cutlass.const_expr(r >= 1 and r + L < R):
                    request(r + L)
                    if cutlass.const_expr(L > 0):
                        cute.arch.griddepcontrol_wait()   # a fence: keeps the coherent loads ahead of the math
                pair, live, expert, w_rows, w_row_idx, issued = routes[r]
                x_rows = [x.iterator.toint() + Int64(pair) * (2 * K) + Int64(t4) * (16 * (self.kc // 32))]
                acc = accumulate_chunks(self, P, scl, w_rows, w_row_idx, x_rows, [Int32(g == 0) & live], Int32(0),
                                        t4, r == 0, issued)  # without lookahead the wait: PDL's, and a fence
                acc = self.undo_offset(acc, global_scale, expert)
                wt = route_weights[pair] * live.to(Float32)
                for f in cutlass.range_constexpr(F):
                    sums[f] = sums[f] + acc[f].to(cutlass.BFloat16).to(Float32) * wt
            if cutlass.const_expr(WK == 1):
                for f in cutlass.range_constexpr(F):
                    self.store_sum(out, token, tile, g, t4, Int32(f), sums[f])
            else:
                for f in cutlass.range_constexpr(F):
                    buf[(warp * F + f) * 32 + lane] = sums[f]
                cute.arch.sync_threads()
                for i in cutlass.range_constexpr(-(-F // WK)):
                    f = warp + i * WK
                    if f < F:
                        s = Float32(0.0)
                        for src in cutlass.range_constexpr(WK):
                            s = s + buf[(src * F + f) * 32 + lane]
                        self.store_sum(out, token, tile, g, t4, f, s)

        @cute.jit
        def store_sum(self, out: cute.Tensor, token: Int32, tile: Int32, g: Int32, t4: Int32, f: Int32, v: Float32):
            # slot f = mt*4 + q (NT = 1): q>>1 picks row g or g+8, q&1 the column; column 0 is the route's
            q = f % 4
            row = tile * (16 * self.cfg.mt) + 16 * (f // 4) + g + 8 * (q // 2)
            if t4 == 0 and q % 2 == 0 and row < self.st.rows:
                out[token, row] = v.to(out.element_type)

        def local_row(self, tile, mt: int, half: int, g):
            """Row (within the expert) of m-tile ``mt``'s half ``half`` for lane group ``g``."""
            if self.glu:  # gate rows, then the same rows of up
                return mt * (self.st.rows // 2) + tile * 16 + 8 * half + g
            return cutlass.min(tile * (16 * self.cfg.mt) + 16 * mt + 8 * half + g, Int32(self.st.rows - 1))

        @cute.jit
        def store(self, out: cute.Tensor, sorted_ids: cute.Tensor, group: Int32, pairs: Int32, tile: Int32,
                  g: Int32, t4: Int32, f: Int32, v: Float32, up: Float32):
            # accumulator slot f = (mt*NT + nt)*4 + q: q>>1 picks row g or g+8, q&1 the column pair
            q = f % 4
            nt = (f // 4) % self.cfg.nt
            mt = f // (4 * self.cfg.nt)
            pair, ok = self.pair_of(sorted_ids, group, pairs, 8 * nt + 2 * t4 + (q % 2))
            if cutlass.const_expr(self.glu):
                i = tile * 16 + g + 8 * (q // 2)
                if ok != 0:
                    gate = v.to(cutlass.BFloat16).to(Float32)
                    lin = up.to(cutlass.BFloat16).to(Float32)
                    out[pair, i] = self.act(gate, lin).to(out.element_type)
            else:
                row = tile * (16 * self.cfg.mt) + 16 * mt + g + 8 * (q // 2)
                if ok != 0 and row < self.st.rows:
                    out[pair, row] = v.to(out.element_type)

    return MmaExpertsKernel


@compile_unit
def compile_stage(st: ExpertsStage, cfg: MmaConfig):
    """The compiled kernel of one stage; the pair count, expert count and group count are dynamic."""
    from latency_specialized.kernels import compile_cache

    why = st.refusal()
    if why:
        raise ValueError(f"{NAME}: {why}: not compiled")

    def build(arch: str):
        import cutlass
        import cutlass.cute as cute

        from latency_specialized.kernels.gemm_common import (compile_options, fake_rows, fake_stream,
                                                             fake_strided_rows, fake_vec, max_regs)

        bf, u8, i32 = cutlass.BFloat16, cutlass.Uint8, cutlass.Int32
        rows = cute.sym_int()
        coding = st.coding
        byte_scales = coding.ue8m0 or coding.nvfp4
        args = (fake_rows(bf, cute.sym_int(), st.k), fake_rows(u8, rows, coding.row_bytes(st.k)),
                fake_rows(u8 if byte_scales else cutlass.Float32, cute.sym_int(), st.k // coding.block[1],
                          align=1 if byte_scales else 4), fake_strided_rows(bf, cute.sym_int(), st.out_width),
                fake_vec(cutlass.Int64 if st.ids64 else i32, cute.sym_int(), align=4),
                fake_vec(i32, cute.sym_int(), align=4), fake_vec(i32, cute.sym_int(), align=4),
                fake_vec(i32, 1, align=4), fake_vec(cutlass.Float32, cute.sym_int(), align=4),
                fake_vec(cutlass.Float32, cute.sym_int(), align=4), 1, fake_stream())
        return cute.compile(_kernel_class()(st, cfg), *args, options=compile_options(arch, max_regs(32 * cfg.wk, 0)))

    key = tuple(sorted(vars(st).items())) + tuple(sorted(vars(cfg).items()))
    return compile_cache.cached_compile(NAME, key, build)


def stage_config(tiles: int, groups: int, chunks: int, mt: int) -> MmaConfig:
    """Launch heuristic (``gemm_small_m.quantized_config``'s rule over the tiles of every group): enough warps in
    flight for HBM, at least 2 chunks per warp, 4 chunks of loads per batch - at most 4 warps along K with two m-tiles
    (offline sm_90a SASS, Kimi K3 TP8 batch 1: 8 warps x 2 m-tiles x 4 chunks of loads take 127 registers, two CTAs
    per SM and 1.45 waves; 4 warps take 168, three CTAs per SM of 128 threads, one wave). The ``down`` stage's
    (aligned groups); on the H200 it lost to :func:`gate_up_config` for ``gate_up``."""
    need = max(1.0, TARGET_WARPS * 2 / max(1, tiles * groups))
    cap = min(4 if mt == 2 else 8, SMEM_LIMIT // (4 * mt * 32 * 4))
    wk = pow2_at_most(min(need, max(1, chunks // 2)), cap)
    return MmaConfig(nt=1, mt=mt, wk=wk, sk=1, cb=max(1, min(4, math.ceil(chunks / wk))), pdl=False, prefetch=True)


GATE_UP_WARPS_K = 4
GATE_UP_BATCH = 2


def gate_up_config(chunks: int) -> MmaConfig:
    """``gate_up``'s launch at any batch: ``GATE_UP_WARPS_K`` warps along K (fewer where a warp would get under 2
    chunks), ``GATE_UP_BATCH`` chunks of loads a batch. Chosen on the H200 over :func:`stage_config`'s occupancy rule
    (which drops to one warp along K once the groups alone fill the GPU): faster at every batch measured, 1-64 tokens
    (``NOTES_q4.md``). Why, as read from the offline SASS rather than measured: more warps per group keep more of a
    group's rows in flight at once, and 2 chunks of loads a batch instead of 4 take fewer registers, leaving room for
    more CTAs per SM."""
    wk = pow2_at_most(max(1, chunks // 2), GATE_UP_WARPS_K)
    return MmaConfig(nt=1, mt=2, wk=wk, sk=1, cb=max(1, min(GATE_UP_BATCH, -(-chunks // wk))), pdl=False,
                     prefetch=True)


def groups_of(M: int, top_k: int, experts: int, aligned: bool) -> int:
    """Grid groups: one per route, or ``moe_align``'s block bound (runs of ``COLS`` pairs; unused ones return)."""
    from latency_specialized.kernels.triton_moe import AlignSizes

    return AlignSizes(M * top_k, experts, COLS).max_blocks if aligned else M * top_k


def summed(aligned: bool, per_route: bool) -> bool:
    """Whether the down stage is ``down_sum`` (route groups, combined output)."""
    return not aligned and not per_route


def default_configs(M: int, top_k: int, experts: int, K: int, I: int, N: int, aligned: bool,
                    per_route: bool = False, chunk: int = 128) -> tuple[MmaConfig, MmaConfig]:
    """(gate_up, down) launch choices for a step of M tokens: :func:`gate_up_config`; :func:`stage_config`'s for
    ``down``, while ``down_sum`` takes a warp per route up to ``MAX_SUM_WARPS`` (more routes take turns), all of a
    route's chunks in one batch of loads (at most 4). The down choices held against the variants tried on the H200
    (``bench.ops_bench_q4.MMA_VARIANTS``). ``chunk``: K per 64-byte chunk of a row (128 for 4-bit codes, 64 for FP8)."""
    groups = groups_of(M, top_k, experts, aligned)
    gate_up = gate_up_config(K // chunk)
    if summed(aligned, per_route):
        return gate_up, MmaConfig(nt=1, mt=1, wk=min(top_k, MAX_SUM_WARPS), cb=min(4, I // chunk), pdl=False,
                                  prefetch=True, lookahead=SUM_ROUTES_AHEAD)
    # down: two m-tiles (32 rows) a warp - offline SASS at 64 tokens: 10% fewer issue slots than one, half the CTAs
    return gate_up, stage_config(-(-N // 32), groups, I // chunk, 2)


def expert_parts(w: QuantizedWeight, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int,
                                                         dict]:
    """(codes [E x rows, bytes per row], scales [E x rows / block rows, K / block cols] (bytes, or fp32 for FP8),
    fp32 global scales [E] (NVFP4) or None, E, rows, the ``ExpertsStage`` fields of the format) of stacked experts;
    checked once per weight (MXFP4: ``gemm_q4_mma.mxfp4_parts``'s exact ue8m0 range; NVFP4: no NaN scale byte, one
    finite global scale per expert; FP8: ``gemm_fp8_mma.fp8_parts``, no NaN code)."""
    from latency_specialized.kernels.gemm_fp8_mma import fp8_parts
    from latency_specialized.quant.codecs import as_bytes

    if not isinstance(w, QuantizedWeight) or w.weight.dim() != 3:
        raise UserError(f"{what}: takes experts stacked as a [E, rows, K] QuantizedWeight (got "
                        f"{type(w).__name__}{'' if not isinstance(w, QuantizedWeight) else tuple(w.weight.shape)})")
    E, rows = w.weight.shape[:2]
    paired = w.fmt.packing == "paired"
    if w.fmt.name.split("/")[0] == "fp8-block-128":
        q, s, coding = fp8_parts(w, what, stacked=True)
        return (q.reshape(E * rows, -1), s.reshape(-1, s.shape[-1]), None, E, rows,
                dict(weights="fp8", fp8_block=tuple(coding.block)))
    if w.fmt.name.removesuffix("/pairs") != "nvfp4":
        q, s = mxfp4_parts(w, what, stacked=True, paired=paired)
        return q.view(E * rows, -1), s.view(E * rows, -1), None, E, rows, dict(weights="mxfp4", paired=paired)
    q, s = as_bytes(w.weight).contiguous(), as_bytes(w.scale).contiguous()
    gs = w.global_scale
    if gs is None or gs.numel() != E:
        raise UserError(f"{what} ({w.name}): NVFP4 experts need one fp32 global scale per expert ([{E}]), got "
                        f"{None if gs is None else tuple(gs.shape)}: gate and up joined with differing global scales "
                        "are refused at load (quant.layout)")
    gs = gs.float().contiguous()

    def check() -> None:
        if bool(((s & 0x7F) == 0x7F).any()):
            raise UserError(f"{what} ({w.name}): NaN e4m3 scale bytes: the checkpoint is damaged - requantize it")
        if not bool(torch.isfinite(gs).all()):
            raise UserError(f"{what} ({w.name}): a non-finite global scale: requantize the checkpoint")

    check_once(w.weight, (NAME, s.data_ptr()), check)
    return q.view(E * rows, -1), s.view(E * rows, -1), gs, E, rows, dict(weights="nvfp4", paired=paired)


_dummies: dict = {}


def _no_table(device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A one-element tensor for an operand a stage does not read (the align tables in "route" mode, the routing
    weights outside ``down_sum``)."""
    t = _dummies.get((device, dtype))
    if t is None:
        t = _dummies[(device, dtype)] = torch.zeros(1, dtype=dtype, device=device)
    return t


_align: dict = {}


def _align_buffers(pairs: int, experts: int, device: torch.device):
    from latency_specialized.kernels import triton_moe as moe_k

    key = (pairs, experts, device)
    if key not in _align:
        _align[key] = moe_k.AlignBuffers.allocate(moe_k.AlignSizes(pairs, experts, COLS), device)
    return _align[key]


def _stage_args(activation: ActivationSpec) -> dict:
    """gate_up's GLU (``ActivationSpec`` kinds: SwiGLU with an optional clamp, SiTU-GLU)."""
    if activation.kind == "swiglu":
        return dict(act="swiglu", clamp=float(activation.clamp or 0.0))
    return dict(act="situ_glu", beta=float(activation.beta), beta_lin=float(activation.beta_lin))


def experts_mma(x: torch.Tensor, weights: torch.Tensor | None, ids: torch.Tensor, w_gate_up: QuantizedWeight,
                      w_down: QuantizedWeight, activation: ActivationSpec, *, per_route: bool = False,
                      out: torch.Tensor | None = None, configs: tuple[MmaConfig, MmaConfig] | None = None,
                      aligned: bool | None = None, addend: Addend = None) -> torch.Tensor:
    """Routed experts (contract: ``ops.moe.experts_reference``) over MXFP4 / NVFP4 weights on tensor cores.

    Parameters
    ----------
    x : [M, K] bf16, M <= ``MAX_TOKENS``, K % 128 == 0.
    weights : [M, top_k] routing weights (fp32 or bf16; ignored with ``per_route``).
    ids : [M, top_k] int32 / int64 expert ids.
    w_gate_up : QuantizedWeight [E, 2I, K] (gate rows, then up rows), mxfp4 / mxfp4-deepseek / nvfp4 (one global
        scale per expert); I % 128 == 0.
    w_down : QuantizedWeight [E, N, I], the same format; N % 16 == 0.
    per_route : every route's expert output, unweighted ([M, top_k, N]), instead of the combination.
    out : optional [M, N] ([M, top_k, N]) destination, unit stride in N.
    configs : (gate_up, down) launch choices; default :func:`default_configs`.
    aligned : groups from ``moe_align`` (True) or one per route (False); default: from ``MIN_TOKENS_ALIGNED`` tokens.
    addend : [M, N] (or a callable returning it) added after the last stage (``kernels/moe_addend.py``: one add
        kernel; the latent MoE, this kernel's main user, takes its shared experts in ``moe.latent_up``).
    """
    from latency_specialized.kernels import triton_moe as moe_k
    from latency_specialized.kernels import triton_q4
    from latency_specialized.kernels.moe_experts_triton import route_rows

    q13, s13, g13, E, two_i, fmt13 = expert_parts(w_gate_up, NAME)
    q2, s2, g2, E2, N, fmt2 = expert_parts(w_down, NAME)
    if (fmt13["weights"], fmt13.get("paired")) != (fmt2["weights"], fmt2.get("paired")):
        raise UserError(f"{NAME}: w_gate_up is {w_gate_up.fmt.name} but w_down is {w_down.fmt.name}")
    check_addend_use(addend, per_route, NAME)
    M, K = x.shape
    I = two_i // 2
    top_k = ids.shape[-1]
    if x.dtype != torch.bfloat16 or ids.shape[0] != M or E2 != E:
        raise UserError(f"{NAME}: x [M, K] bf16, ids [M, top_k], one expert count (x {tuple(x.shape)} {x.dtype}, "
                        f"ids {tuple(ids.shape)}, experts {E} / {E2})")
    if K % 128 or I % 128 or N % 16 or w_down.shape[1:] != (N, I) or w_gate_up.shape[2] != K:
        raise UserError(f"{NAME}: needs K, I multiples of 128 and N of 16 with w_gate_up [E, 2I, K], w_down [E, N, I] "
                        f"(x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)})")
    if M > MAX_TOKENS:
        raise UserError(f"{NAME} serves up to {MAX_TOKENS} tokens (got {M}): use moe.experts.q4_grouped_triton "
                        "(4-bit weights) or moe.experts.fp8_triton (block FP8)")
    T = M * top_k
    x = x.contiguous()
    flat = ids.reshape(-1).contiguous()
    if flat.dtype not in (torch.int32, torch.int64):
        raise UserError(f"{NAME}: ids must be int32 or int64 (got {flat.dtype})")
    aligned = M >= MIN_TOKENS_ALIGNED if aligned is None else aligned
    groups = groups_of(M, top_k, E, aligned)
    if aligned:
        buf = moe_k.moe_align(ids, _align_buffers(T, E, x.device))
        tables = (buf.sorted_ids, buf.expert_ids, buf.num_padded)
    else:
        tables = (_no_table(x.device),) * 3
    common = dict(top_k=top_k, aligned=aligned, ids64=flat.dtype == torch.int64)
    st13 = ExpertsStage("gate_up", K, two_i, **common, **fmt13, **_stage_args(activation))
    st2 = ExpertsStage("down_sum" if summed(aligned, per_route) else "down", I, N, **common, **fmt2)
    for st in (st13, st2):
        why = st.refusal()
        if why:
            raise UserError(f"{NAME}: {st.stage} cannot take these weights ({why}): use moe.experts.reference")
    cfg13, cfg2 = configs or default_configs(M, top_k, E, K, I, N, aligned, per_route, st13.coding.chunk)
    if cfg13.mt != 2 or cfg13.nt != 1 or cfg2.nt != 1 or cfg13.sk != 1 or cfg2.sk != 1 or cfg2.wk > 32:
        raise UserError(f"{NAME}: configs need nt = 1, sk = 1, mt = 2 for gate_up and at most 32 warps (got "
                        f"{cfg13.label()}, {cfg2.label()})")
    h = torch.empty(T, I, device=x.device, dtype=x.dtype)
    no_weights = _no_table(x.device, torch.float32)
    g13 = no_weights if g13 is None else g13
    g2 = no_weights if g2 is None else g2
    # (no stream argument: the compiled call takes torch's current stream, gemm_common.fake_stream)
    compile_stage(st13, cfg13)(x, q13, s13, h, flat, *tables, no_weights, g13, groups)
    shape = (M, top_k, N) if per_route else (M, N)
    y = out if out is not None else torch.empty(shape, device=x.device, dtype=x.dtype)
    if tuple(y.shape) != shape or y.stride(-1) != 1:
        raise UserError(f"{NAME}: out {tuple(y.shape)} must be {list(shape)} with unit stride in N")
    if st2.stage == "down_sum":
        w = weights.reshape(-1)
        w = w.contiguous() if w.dtype == torch.float32 else w.float().contiguous()
        compile_stage(st2, cfg2)(h, q2, s2, y, flat, *tables, w, g2, M)
        return add_addend(y, addend, NAME)
    yp, direct = route_rows(y) if per_route else (torch.empty(T, N, device=x.device, dtype=x.dtype), False)
    compile_stage(st2, cfg2)(h, q2, s2, yp, flat, *tables, no_weights, g2, groups)
    if per_route:
        if not direct:
            y.copy_(yp.view(M, top_k, N))
        return y
    w = weights.reshape(M, top_k)
    triton_q4.route_sum(yp, w.contiguous() if w.dtype == torch.float32 else w.float().contiguous(), y)  # aligned
    return add_addend(y, addend, NAME)


def _refusal(ctx: OpContext, name: str, formats: tuple[str, ...], what: str) -> Support:
    from latency_specialized.kernels.compile_cache import cute_available
    from latency_specialized.kernels.triton_common import quantized_experts_refusal

    if not ENABLED:
        return f"{name}: switched off (moe_experts_mma.ENABLED = False)"
    why = quantized_experts_refusal(ctx, name, formats, what, min_sm=90)
    if why:
        return why
    if ctx.dim("K") % 128 or ctx.dim("N") % 128:
        return f"K={ctx.dim('K')} and I={ctx.dim('N')} must be multiples of 128 (one 16-byte load: 32 codes a lane)"
    if ctx.tokens > MAX_TOKENS:
        return f"{ctx.tokens} tokens: serves up to {MAX_TOKENS} (the Triton experts kernels beyond)"
    return cute_available()


def _supports_q4(ctx: OpContext) -> Support:
    return _refusal(ctx, NAME, FORMATS_Q4, "4-bit e2m1 (MXFP4 / NVFP4)")


def _supports_fp8(ctx: OpContext) -> Support:
    return _refusal(ctx, NAME_FP8, ("fp8-block-128",), "block FP8 (128 x 128)")


IMPLEMENTATIONS = [
    Implementation("moe.experts", NAME, experts_mma, _supports_q4, priority=25,
                   description="MXFP4 / NVFP4 experts decoded to bf16 in registers on mma.sync (gemm_q4_mma's stream):"
                               " gate|up with the GLU epilogue, down per route, weighted route sum; above the Triton"
                               " 4-bit kernels, which it beats on the H200 at 1-64 tokens"),
    Implementation("moe.experts", NAME_FP8, experts_mma, _supports_fp8, priority=15,
                   description="block-FP8 experts on the same mma.sync kernels (gemm_fp8_mma's decode); not yet timed"
                               " on a GPU for FP8, so below moe.experts.fp8_triton"),
]

__all__ = ["COLS", "ENABLED", "ExpertsStage", "FORMATS", "FORMATS_Q4", "GATE_UP_BATCH", "GATE_UP_WARPS_K",
           "IMPLEMENTATIONS", "MAX_TOKENS", "MIN_TOKENS_ALIGNED", "NAME", "NAME_FP8", "SUM_ROUTES_AHEAD",
           "compile_stage", "default_configs", "experts_mma", "expert_parts", "gate_up_config", "groups_of",
           "stage_config"]
