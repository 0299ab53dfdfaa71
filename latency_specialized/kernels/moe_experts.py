"""CuTe DSL routed experts for the decode regime (``moe.experts``): each selected expert read once.

Two kernels, no host sync, fixed grids (graph capturable):

``gate_up`` grid (ceil(I / BI), M*top_k): CTA (ib, p) serves routing pair ``p = m*top_k + j``.
    It finds every pair routed to the same expert (ballot over the flat ids) and proceeds only if
    ``p`` is the first of them (the *leader*), so an expert chosen by several tokens is read once.
    Each warp streams a gate row and its up row (16-byte loads, K/256 per lane in flight), dots them
    with the leader's tokens staged in shared memory, applies SiTU-GLU / SwiGLU in fp32 and stores
    ``h[pair, i]`` (bf16, rounded as the reference rounds). The block-0 CTA of every pair also
    records the leader table (member count, member pairs) for the second kernel.
``down`` grid (ceil(N / BN),): CTA owns BN output rows of ``y`` for all tokens and loops over the
    leaders (warp w takes leaders w, w+WARPS, ...): BN rows of that expert's ``w_down`` (read once),
    dotted with each member's ``h``, rounded to bf16 (as the reference rounds each expert output),
    scaled by the routing weight and accumulated in fp32 in shared memory. The warps' partial sums
    are added in a fixed order: the result does not depend on timing (deterministic).

Batch 1 (``max_tokens == 1``) compiles a path without the leader search: the top-k ids of one token
are distinct, so every pair is its own leader.

``per_route`` (compile-time, ``ExpertsConfig.per_route``) changes only ``down``'s epilogue: each
pair's rounded expert output goes straight to row ``pair`` of a ``[M*top_k, N]`` output (the
``[M, top_k, N]`` result of ``experts(..., per_route=True)``), unweighted; the shared-memory
accumulators and the fixed-order combine are compiled out. ``gate_up`` is the same kernel.
"""

import dataclasses
from dataclasses import dataclass

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.hardware import sm_count
from latency_specialized.kernels.compile_cache import cached_compile, compile_unit
from latency_specialized.kernels.dsl_common import compile_options as _compile_options, ptx_of  # noqa: F401
from latency_specialized.kernels.dsl_common import sm90_dsl_support
from latency_specialized.kernels.dsl_common import cutlass_dtype as _cutlass_dtype, dtype_name as _dtype_name
from latency_specialized.kernels.moe_addend import Addend, accumulate_target, add_addend, check_addend_use
from latency_specialized.spec import ActivationSpec

MAX_TOKENS = 256
"""Largest token count per call (shared-memory accumulators of ``down`` scale with it)."""


@dataclass(frozen=True)
class ExpertsConfig:
    """Static shape/config of one routed-expert site (hashable compile-cache key)."""

    K: int
    """Input width (latent or hidden)."""
    I: int
    """Expert intermediate width (per rank)."""
    N: int
    """Output width of the down projection."""
    top_k: int
    dtype: str
    ids_dtype: str
    act: str
    beta: float
    beta_lin: float
    clamp: float
    """SwiGLU clamp; <= 0 means none."""
    max_tokens: int
    """Token bucket (power of two): shared-memory sizes; 1 compiles the leader-free batch-1 path."""
    gu_warps: int = 4
    gu_rows: int = 8
    """Intermediate rows (gate+up pairs) per gate_up CTA."""
    gu_kvec: int = 0
    """16-byte weight vectors per lane per row that gate_up holds in registers at once (0: all K / 256).
    Below K / 256 a row's K runs in ``gu_passes`` passes, each loading its slice of the gate and up rows
    and adding its partial dots (fp32), so wide rows keep under the 3-CTA register budget instead of
    spilling (ptxas at K 6144: 492 bytes of spill stores with every vector held)."""
    dn_warps: int = 4
    dn_rows: int = 16
    """Output rows per down CTA."""
    stream_hint: bool = True
    """Weight loads as ld.global.L1::no_allocate.L2::256B (read once: skip L1, long DRAM bursts)."""
    pdl: bool = False
    """Programmatic dependent launch: ``down`` starts while ``gate_up`` drains and, at batch 1, loads
    its first expert's weights before ``griddepcontrol.wait`` (nothing it loads then depends on gate_up)."""
    per_route: bool = False
    """``down`` writes every routing pair's expert output (rounded, not weighted) to its own output row
    instead of combining the pairs of a token (``experts(..., per_route=True)``)."""
    dn_trigger: bool = False
    """``down`` lets the next kernel (the latent all-reduce / norm, launched with PDL) launch as soon as every
    ``down`` CTA has started (``griddepcontrol.launch_dependents``); that kernel still waits for ``down``
    to complete before it reads the output."""
    accumulate: bool = False
    """``down`` adds its combination into ``y``'s contents, ``y = round(round(sum) + y)`` (``experts(...,
    addend=...)``: the shared experts' output, no add kernel after the experts; ``kernels/moe_addend.py``)."""

    @property
    def gu_passes(self) -> int:
        kv = self.K // 256
        return 1 if self.gu_kvec <= 0 else -(-kv // self.gu_kvec)

    @property
    def token_chunk(self) -> int:
        # tokens staged in smem at once: <= 64 KiB so three CTAs fit an SM
        return max(1, min(self.max_tokens, (64 * 1024) // (2 * self.K)))


def _vec8(cute, ptr, offset):
    """16-byte view of 8 consecutive 2-byte elements at ``ptr + offset`` (offset multiple of 8)."""
    return cute.make_tensor((ptr + offset).align(16), cute.make_layout(8))


def _opaque_i32(v):
    """``v`` through a volatile ``mov``: LLVM cannot hoist what depends on it out of a loop.

    Inside the per-token loops the bf16 -> fp32 conversion of the register-resident weights is
    loop-invariant; hoisted, 28 vectors become 224 fp32 registers and the kernel spills. Converting
    per token costs 2 ALU ops per weight pair, which the memory-bound loop hides."""
    from cutlass import Int32
    from cutlass._mlir import ir
    from cutlass._mlir.dialects import llvm

    return Int32(llvm.inline_asm(ir.IntegerType.get_signless(32), [v.ir_value()], "mov.b32 $0, $1;", "=r,r",
                                 has_side_effects=True, asm_dialect=0))


def _bf16x8_f32(cute, frag, opaque: bool) -> list:
    """8 Float32 from an 8 x bf16 register fragment (bf16 -> f32 is a 16-bit shift)."""
    from cutlass import Float32, Int32

    words = cute.recast_tensor(frag, Int32)
    out = []
    for k in range(4):
        w = words[k]
        if opaque:
            w = _opaque_i32(w)
        out += [(w << 16).bitcast(Float32), (w & Int32(-65536)).bitcast(Float32)]
    return out


def _smem_bf16x8_f32(cute, view) -> list:
    """8 Float32 from 8 bf16 in shared memory (one ld.shared.v4)."""
    from cutlass import Int32

    r = cute.make_rmem_tensor(4, Int32)
    cute.autovec_copy(cute.recast_tensor(view, Int32), r)
    return _bf16x8_f32(cute, cute.recast_tensor(r, _bf16()), False)


def _bf16():
    import cutlass

    return cutlass.BFloat16


def _weight_loader(cute, dtype, stream_hint: bool):
    """``load(src_view, dst_rmem)`` for weights: streamed once, so no L1 allocation + 256 B L2 prefetch."""
    if not stream_hint:
        return cute.autovec_copy
    atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), dtype, num_bits_per_copy=128,
                               l2_prefetch_size=cute.nvgpu.L2PrefetchSize.SIZE_256B,
                               l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE)
    return lambda src, dst: cute.copy(atom, src, dst)


def _build_gate_up_class():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64
    from cutlass.memory import SmemAllocator

    class GateUpKernel:
        def __init__(self, cfg: ExpertsConfig):
            self.cfg = cfg
            self.kv = cfg.K // 256  # 16-byte vectors per lane per row
            per = -(-self.kv // cfg.gu_passes)
            self.passes = [(j0, min(j0 + per, self.kv)) for j0 in range(0, self.kv, per)]  # [j0, j1) per pass
            self.rpw = cfg.gu_rows // cfg.gu_warps
            self.maxmk = cfg.max_tokens * cfg.top_k
            self.nwords = (self.maxmk + 31) // 32
            self.dtype = _cutlass_dtype(cfg.dtype)

        @cute.jit
        def __call__(self, x: cute.Tensor, ids: cute.Tensor, w_gu: cute.Tensor, h_ws: cute.Tensor,
                     lead_count: cute.Tensor, members: cute.Tensor, stream):
            cfg = self.cfg
            self.kernel(x, ids, w_gu, h_ws, lead_count, members).launch(
                grid=[(cfg.I + cfg.gu_rows - 1) // cfg.gu_rows, ids.shape[0], 1],
                block=[32 * cfg.gu_warps, 1, 1], stream=stream,
                # three 128-thread CTAs per SM (<= 170 registers): otherwise ptxas front-loads the token
                # loop's shared-memory reads next to the 28 weight vectors and needs ~220 registers
                min_blocks_per_mp=max(1, 12 // cfg.gu_warps),
                preferred_smem_carveout=100 if cfg.max_tokens > 1 else 50)

        @cute.jit
        def _act(self, g: Float32, u: Float32) -> Float32:
            cfg = self.cfg
            h = Float32(0.0)
            if cutlass.const_expr(cfg.act == "situ_glu"):
                b = Float32(cfg.beta)
                bl = Float32(cfg.beta_lin)
                sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-g))
                h = b * cute.math.tanh(g / b) * sig * (bl * cute.math.tanh(u / bl))
            else:
                gg = g
                uu = u
                if cutlass.const_expr(cfg.clamp > 0):
                    gg = cutlass.min(gg, Float32(cfg.clamp))
                    uu = cutlass.max(cutlass.min(uu, Float32(cfg.clamp)), Float32(-cfg.clamp))
                h = gg / (Float32(1.0) + cute.math.exp(-gg)) * uu
            return h

        def _load_rows(self, load_w, wrow, i, lane, j0, j1):
            """The gate and up rows of intermediate index i, vectors [j0, j1) of K/256: 2 x (j1 - j0)
            16-byte loads per lane (``wg[j - j0]``).

            Plain Python (no staged control flow): the loop unrolls at trace time."""
            K, I = self.cfg.K, self.cfg.I
            ic = cutlass.min(i, Int32(I - 1))
            wg = []
            wu = []
            for j in range(j0, j1):
                col = (j * 32 + lane) * 8
                rg = cute.make_rmem_tensor(8, self.dtype)
                load_w(_vec8(cute, wrow, ic * K + col), rg)
                wg.append(rg)
                ru = cute.make_rmem_tensor(8, self.dtype)
                load_w(_vec8(cute, wrow, (ic + I) * K + col), ru)
                wu.append(ru)
            return wg, wu

        @cute.jit
        def _stage(self, x: cute.Tensor, sx: cute.Tensor, s_mem: cute.Tensor, p: Int32, c0: Int32, nt: Int32,
                   tidx: Int32):
            """The chunk's token rows into shared memory (all threads), then a barrier."""
            cfg = self.cfg
            K = cfg.K
            for t in cutlass.range(nt, unroll=1):
                qs = Int32(p)
                if cutlass.const_expr(cfg.max_tokens > 1):
                    qs = s_mem[c0 + t]
                xrow = x[qs // cfg.top_k, None]
                for v in range(tidx, K // 8, 32 * cfg.gu_warps):
                    cute.autovec_copy(_vec8(cute, xrow.iterator, v * 8), _vec8(cute, sx.iterator, t * K + v * 8))
            cute.arch.barrier()

        @cute.jit
        def _chunk(self, x: cute.Tensor, sx: cute.Tensor, s_mem: cute.Tensor, h_ws: cute.Tensor, s_part: cute.Tensor,
                   load_w, wrow, p: Int32, i0: Int32, c0: Int32, nt: Int32, tidx: Int32, lane: Int32, warp: Int32):
            """This warp's rows of h for one chunk of (at most token_chunk) tokens."""
            if cutlass.const_expr(self.rpw <= 2):
                # unrolled rows; the first row's loads are in flight while the tokens are staged
                for rr in cutlass.range_constexpr(self.rpw):
                    self._row(x, sx, s_mem, h_ws, s_part, load_w, wrow, p, i0 + rr, c0, nt, tidx, lane, warp,
                              rr == 0)
            else:
                # many rows per CTA (amortises the leader search at large batch): rolled loop
                self._stage(x, sx, s_mem, p, c0, nt, tidx)
                for rr in cutlass.range(self.rpw, unroll=1):
                    self._row(x, sx, s_mem, h_ws, s_part, load_w, wrow, p, i0 + rr, c0, nt, tidx, lane, warp,
                              False)

        @cute.jit
        def _row(self, x: cute.Tensor, sx: cute.Tensor, s_mem: cute.Tensor, h_ws: cute.Tensor, s_part: cute.Tensor,
                 load_w, wrow, p: Int32, i: Int32, c0: Int32, nt: Int32, tidx: Int32, lane: Int32, warp: Int32,
                 stage: cutlass.Constexpr):
            """One intermediate row: its K in ``passes`` (each: load the slice, add its partial dots)."""
            accg = cute.make_rmem_tensor(8, Float32)
            accu = cute.make_rmem_tensor(8, Float32)
            accg.fill(0.0)
            accu.fill(0.0)
            npass = len(self.passes)
            for pi in cutlass.range_constexpr(npass):
                j0, j1 = self.passes[pi]
                wg, wu = self._load_rows(load_w, wrow, i, lane, j0, j1)
                if cutlass.const_expr(stage and pi == 0):
                    self._stage(x, sx, s_mem, p, c0, nt, tidx)
                if cutlass.const_expr(self.cfg.max_tokens == 1):
                    self._dot_one(sx, wg, wu, accg, accu, j0, j1, lane)
                    if cutlass.const_expr(pi == npass - 1):
                        g = accg.load().reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
                        u = accu.load().reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
                        self._finish(s_mem, h_ws, p, i, c0, Int32(0), lane, g, u)
                else:
                    for t in cutlass.range(nt, unroll=1):
                        self._dot_token(sx, s_mem, h_ws, s_part, wg, wu, p, i, c0, t, lane, warp, j0, j1,
                                        pi == 0, pi == npass - 1)

        @cute.jit
        def _dot_one(self, sx: cute.Tensor, wg, wu, accg, accu, j0: cutlass.Constexpr, j1: cutlass.Constexpr,
                     lane: Int32):
            """Batch 1: the lane's partial gate / up dots over vectors [j0, j1), added to accg / accu."""
            for j in cutlass.range_constexpr(j1 - j0):
                xv = _vec8(cute, sx.iterator, (( j0 + j) * 32 + lane) * 8).load().to(Float32)
                accg.store(accg.load() + wg[j].load().to(Float32) * xv)
                accu.store(accu.load() + wu[j].load().to(Float32) * xv)

        @cute.jit
        def _dot_token(self, sx: cute.Tensor, s_mem: cute.Tensor, h_ws: cute.Tensor, s_part: cute.Tensor, wg, wu,
                       p: Int32, i: Int32, c0: Int32, t: Int32, lane: Int32, warp: Int32, j0: cutlass.Constexpr,
                       j1: cutlass.Constexpr, first: cutlass.Constexpr, last: cutlass.Constexpr):
            """Token t of the chunk, vectors [j0, j1): convert the weights per token (see _opaque_i32); the
            pass's warp-reduced dots add to the earlier passes' (``s_part``, lane 0's own slots)."""
            K = self.cfg.K
            g = Float32(0.0)
            u = Float32(0.0)
            ag = [Float32(0.0)] * 8
            au = [Float32(0.0)] * 8
            for j in cutlass.range_constexpr(j1 - j0):
                xf = _smem_bf16x8_f32(cute, _vec8(cute, sx.iterator, t * K + ((j0 + j) * 32 + lane) * 8))
                gf = _bf16x8_f32(cute, wg[j], True)
                uf = _bf16x8_f32(cute, wu[j], True)
                for v in cutlass.range_constexpr(8):
                    ag[v] = ag[v] + gf[v] * xf[v]
                    au[v] = au[v] + uf[v] * xf[v]
            for v in cutlass.range_constexpr(8):
                g = g + ag[v]
                u = u + au[v]
            if cutlass.const_expr(first and last):
                self._finish(s_mem, h_ws, p, i, c0, t, lane, g, u)
            else:
                g = cute.arch.warp_reduction_sum(g)
                u = cute.arch.warp_reduction_sum(u)
                if cutlass.const_expr(not first):
                    g = g + s_part[warp, t, 0]
                    u = u + s_part[warp, t, 1]
                if cutlass.const_expr(last):
                    self._store(s_mem, h_ws, p, i, c0, t, lane, g, u)
                else:
                    if lane == 0:
                        s_part[warp, t, 0] = g
                        s_part[warp, t, 1] = u

        @cute.jit
        def _finish(self, s_mem: cute.Tensor, h_ws: cute.Tensor, p: Int32, i: Int32, c0: Int32, t: Int32,
                    lane: Int32, g: Float32, u: Float32):
            """The lane partials of one (row, token) summed over the warp, then stored."""
            g = cute.arch.warp_reduction_sum(g)
            u = cute.arch.warp_reduction_sum(u)
            self._store(s_mem, h_ws, p, i, c0, t, lane, g, u)

        @cute.jit
        def _store(self, s_mem: cute.Tensor, h_ws: cute.Tensor, p: Int32, i: Int32, c0: Int32, t: Int32,
                   lane: Int32, g: Float32, u: Float32):
            cfg = self.cfg
            if lane == 0 and i < cfg.I:
                qo = Int32(p)
                if cutlass.const_expr(cfg.max_tokens > 1):
                    qo = s_mem[c0 + t]
                # the reference rounds gate/up and h to the activation dtype
                gr = g.to(self.dtype).to(Float32)
                ur = u.to(self.dtype).to(Float32)
                h_ws[qo, i] = self._act(gr, ur).to(self.dtype)

        @cute.kernel
        def kernel(self, x: cute.Tensor, ids: cute.Tensor, w_gu: cute.Tensor, h_ws: cute.Tensor,
                   lead_count: cute.Tensor, members: cute.Tensor):
            cfg = self.cfg
            K, I, KV, TC = cfg.K, cfg.I, self.kv, cfg.token_chunk
            threads = 32 * cfg.gu_warps
            tidx, _, _ = cute.arch.thread_idx()
            ib, p, _ = cute.arch.block_idx()
            lane = tidx % 32
            warp = tidx // 32
            mk = ids.shape[0]

            smem = SmemAllocator()
            sx = smem.allocate_tensor(self.dtype, cute.make_layout((TC, K), stride=(K, 1)), byte_alignment=16)
            s_mem = smem.allocate_tensor(Int32, cute.make_layout(cfg.max_tokens), byte_alignment=16)
            s_words = smem.allocate_tensor(Int32, cute.make_layout(self.nwords), byte_alignment=16)
            s_info = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
            # the partial dots of a multi-pass row (lane 0 of each warp, its own slots): [warp, token, g/u]
            s_part = smem.allocate_tensor(Float32, cute.make_layout((cfg.gu_warps, TC, 2), stride=(TC * 2, 2, 1)),
                                          byte_alignment=16)

            if cutlass.const_expr(cfg.pdl):
                cute.arch.griddepcontrol_launch_dependents()  # let ``down`` be scheduled as SMs free up
            e = ids[p].to(Int32)
            count = Int32(1)
            leader = Int32(1)
            if cutlass.const_expr(cfg.max_tokens > 1):
                # 1. which pairs chose expert e: one ballot word per 32 pairs
                for j in cutlass.range_constexpr((self.maxmk + threads - 1) // threads):
                    q = tidx + j * threads
                    match = False
                    if q < mk:
                        match = ids[q].to(Int32) == e
                    bal = cute.arch.vote_ballot_sync(match)
                    if cutlass.const_expr((j + 1) * threads > self.maxmk):
                        if lane == 0 and q // 32 < self.nwords:
                            s_words[q // 32] = bal
                    else:
                        if lane == 0:
                            s_words[q // 32] = bal
                cute.arch.barrier()
                # 2. warp 0 lists the matching pairs in ascending order (prefix sum of popcounts)
                if warp == 0:
                    base = Int32(0)
                    for wg in cutlass.range_constexpr((self.nwords + 31) // 32):
                        widx = wg * 32 + lane
                        word = Int32(0)
                        if widx < self.nwords:
                            word = s_words[widx]
                        c = cute.arch.popc(word)
                        incl = c
                        for off in cutlass.range_constexpr(5):
                            t = cute.arch.shuffle_sync_up(incl, 1 << off)
                            if lane >= (1 << off):
                                incl = incl + t
                        pos = base + incl - c
                        for b in cutlass.range_constexpr(32):
                            # top-k ids of a token are distinct, so at most max_tokens pairs match;
                            # the bound only keeps malformed routing inside shared memory
                            if (word >> b) & 1 != 0 and pos < cfg.max_tokens:
                                s_mem[pos] = widx * 32 + b
                                pos = pos + 1
                        base = base + cute.arch.shuffle_sync(incl, 31)
                    if lane == 0:
                        s_info[0] = cutlass.min(base, Int32(cfg.max_tokens))
                cute.arch.barrier()
                count = s_info[0]
                leader = Int32(0)
                if s_mem[0] == p:
                    leader = Int32(1)
                # 3. the leader table for the down kernel
                if ib == 0:
                    if tidx == 0:
                        lead_count[p] = count * leader
                    if leader != 0:
                        for c2 in range(tidx, count, threads):
                            members[p, c2] = s_mem[c2]

            if leader != 0:
                load_w = _weight_loader(cute, self.dtype, cfg.stream_hint)
                wrow = w_gu.iterator + Int64(e) * Int64(2 * I * K)

                i0 = ib * cfg.gu_rows + warp * self.rpw
                if cutlass.const_expr(cfg.max_tokens == 1):
                    self._chunk(x, sx, s_mem, h_ws, s_part, load_w, wrow, p, i0, Int32(0), Int32(1), tidx, lane,
                                warp)
                else:
                    for c0 in cutlass.range(0, count, TC, unroll=1):
                        nt = cutlass.min(count - c0, Int32(TC))
                        self._chunk(x, sx, s_mem, h_ws, s_part, load_w, wrow, p, i0, c0, nt, tidx, lane, warp)
                        cute.arch.barrier()  # sx is restaged by the next chunk

    return GateUpKernel


def _build_down_class():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64
    from cutlass.memory import SmemAllocator

    class DownKernel:
        def __init__(self, cfg: ExpertsConfig):
            self.cfg = cfg
            vecs = cfg.I // 8
            self.lpr = next(l for l in (16, 8, 4, 2, 1) if vecs % l == 0)  # lanes per row
            self.vpl = vecs // self.lpr  # 16-byte vectors per lane per row
            self.rps = 32 // self.lpr  # rows per warp step
            self.nstep = (cfg.dn_rows + self.rps - 1) // self.rps
            self.dtype = _cutlass_dtype(cfg.dtype)

        @cute.jit
        def __call__(self, h_ws: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor, lead_count: cute.Tensor,
                     members: cute.Tensor, w_down: cute.Tensor, y: cute.Tensor, stream):
            cfg = self.cfg
            self.kernel(h_ws, ids, weights, lead_count, members, w_down, y).launch(
                grid=[(cfg.N + cfg.dn_rows - 1) // cfg.dn_rows, 1, 1], block=[32 * cfg.dn_warps, 1, 1],
                stream=stream, use_pdl=cfg.pdl,
                # batch 1: <= 128 registers (4 CTAs/SM); the member loop needs more: <= 170 (3 CTAs/SM)
                min_blocks_per_mp=max(1, (16 if cfg.max_tokens == 1 else 12) // cfg.dn_warps),
                preferred_smem_carveout=50)

        @cute.kernel
        def kernel(self, h_ws: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor, lead_count: cute.Tensor,
                   members: cute.Tensor, w_down: cute.Tensor, y: cute.Tensor):
            cfg = self.cfg
            N, I, BN, W = cfg.N, cfg.I, cfg.dn_rows, cfg.dn_warps
            LPR, VPL, RPS = self.lpr, self.vpl, self.rps
            MT = cfg.max_tokens
            threads = 32 * W
            tidx, _, _ = cute.arch.thread_idx()
            nb, _, _ = cute.arch.block_idx()
            lane = tidx % 32
            warp = tidx // 32
            grp = lane // LPR
            sub = lane % LPR
            n0 = nb * BN
            mk = ids.shape[0]

            PR = cfg.per_route
            acc = None
            if cutlass.const_expr(not PR):
                smem = SmemAllocator()
                acc = smem.allocate_tensor(Float32, cute.make_layout((W, MT, BN), stride=(MT * BN, BN, 1)),
                                           byte_alignment=16)
                for idx in range(tidx, W * MT * BN, threads):
                    acc[idx // (MT * BN), (idx // BN) % MT, idx % BN] = Float32(0.0)
                cute.arch.barrier()
            if cutlass.const_expr(cfg.pdl and MT > 1):
                cute.arch.griddepcontrol_wait()  # the leader table comes from gate_up
            if cutlass.const_expr(cfg.dn_trigger):
                cute.arch.griddepcontrol_launch_dependents()

            # the next slot's (count, expert, first member) are loaded one iteration ahead: the
            # loop is a chain of dependent loads otherwise (count -> expert -> weights -> members)
            cnt_nx = Int32(1)
            e_nx = Int32(0)
            q0_nx = Int32(warp)
            if warp < mk:
                e_nx = ids[warp].to(Int32)
                if cutlass.const_expr(MT > 1):
                    cnt_nx = lead_count[warp]
                    q0_nx = members[warp, 0]
            for p in cutlass.range(warp, mk, W, unroll=1):
                cnt = cnt_nx
                e = e_nx
                q0 = q0_nx
                if p + W < mk:
                    e_nx = ids[p + W].to(Int32)
                    if cutlass.const_expr(MT > 1):
                        cnt_nx = lead_count[p + W]
                        q0_nx = members[p + W, 0]  # garbage for non-leaders: used only if count > 0
                    else:
                        q0_nx = p + W
                if cnt > 0:
                    load_w = _weight_loader(cute, self.dtype, cfg.stream_hint)
                    wbase = w_down.iterator + Int64(e) * Int64(N * I)
                    wv = []
                    for s in cutlass.range_constexpr(self.nstep):
                        r = cutlass.min(n0 + s * RPS + grp, Int32(N - 1))
                        row = []
                        for t in cutlass.range_constexpr(VPL):
                            rv = cute.make_rmem_tensor(8, self.dtype)
                            load_w(_vec8(cute, wbase, r * I + (sub + LPR * t) * 8), rv)
                            row.append(rv)
                        wv.append(row)
                    for c in cutlass.range(cnt, unroll=1):  # unrolled, members' h would pile up in registers
                        q = q0
                        if cutlass.const_expr(MT > 1):
                            if c > 0:
                                q = members[p, c]
                        m = q // cfg.top_k
                        wt = Float32(0.0)
                        if cutlass.const_expr(not PR):
                            wt = weights[q].to(Float32)
                        if cutlass.const_expr(cfg.pdl and MT == 1):
                            cute.arch.griddepcontrol_wait()  # h comes from gate_up; weights already in flight
                        hrow = h_ws[q, None]
                        hv = []
                        for t in cutlass.range_constexpr(VPL):
                            hv.append(_vec8(cute, hrow.iterator, (sub + LPR * t) * 8).load().to(Float32))
                        hs = []
                        if cutlass.const_expr(MT > 1):
                            for t in cutlass.range_constexpr(VPL):
                                hr = cute.make_rmem_tensor(8, self.dtype)
                                cute.autovec_copy(_vec8(cute, hrow.iterator, (sub + LPR * t) * 8), hr)
                                hs.append(_bf16x8_f32(cute, hr, False))
                        for s in cutlass.range_constexpr(self.nstep):
                            a = Float32(0.0)
                            if cutlass.const_expr(MT == 1):
                                a8 = cute.make_rmem_tensor(8, Float32)
                                a8.fill(0.0)
                                for t in cutlass.range_constexpr(VPL):
                                    a8.store(a8.load() + wv[s][t].load().to(Float32) * hv[t])
                                a = a8.load().reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
                            else:  # member loop: convert the weights per member (see _opaque_i32)
                                a8s = [Float32(0.0)] * 8
                                for t in cutlass.range_constexpr(VPL):
                                    wf = _bf16x8_f32(cute, wv[s][t], True)
                                    for v in cutlass.range_constexpr(8):
                                        a8s[v] = a8s[v] + wf[v] * hs[t][v]
                                for v in cutlass.range_constexpr(8):
                                    a = a + a8s[v]
                            a = cute.arch.warp_reduction_sum(a, threads_in_group=LPR)
                            r = s * RPS + grp
                            if sub == 0 and r < BN and n0 + r < N:
                                if cutlass.const_expr(PR):
                                    y[q, n0 + r] = a.to(self.dtype)  # the pair's own row, unweighted
                                else:
                                    ye = a.to(self.dtype).to(Float32)  # the reference rounds each expert output
                                    acc[warp, m, r] = acc[warp, m, r] + wt * ye
            if cutlass.const_expr(not PR):
                cute.arch.barrier()
                m_tokens = y.shape[0]
                for idx in range(tidx, MT * BN, threads):
                    m = idx // BN
                    r = idx % BN
                    if m < m_tokens and n0 + r < N:
                        tot = Float32(0.0)
                        for w in cutlass.range_constexpr(W):
                            tot = tot + acc[w, m, r]
                        val = tot.to(self.dtype)
                        if cutlass.const_expr(cfg.accumulate):  # y holds the addend: one more rounding, as y + a
                            val = (val.to(Float32) + y[m, n0 + r].to(Float32)).to(self.dtype)
                        y[m, n0 + r] = val

    return DownKernel


def _fake(cute, dtype, shape, stride, align=16):
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


@compile_unit
def compile_gate_up(cfg: ExpertsConfig):
    # the down kernel's fields do not shape gate_up: one compile (and key) serves every down variant
    cfg = dataclasses.replace(cfg, dn_rows=0, dn_warps=0, dn_trigger=False, per_route=False, accumulate=False)

    def build(arch: str):
        import cutlass
        import cutlass.cute as cute

        dt = _cutlass_dtype(cfg.dtype)
        m, mk, e = cute.sym_int(), cute.sym_int(), cute.sym_int()
        x = _fake(cute, dt, (m, cfg.K), (cute.sym_int64(divisibility=8), 1))
        ids = _fake(cute, _cutlass_dtype(cfg.ids_dtype), (mk,), (1,), 4)
        w_gu = _fake(cute, dt, (e, 2 * cfg.I, cfg.K), (2 * cfg.I * cfg.K, cfg.K, 1))
        h_ws = _fake(cute, dt, (mk, cfg.I), (cfg.I, 1))
        lead = _fake(cute, cutlass.Int32, (mk,), (1,), 4)
        mem = _fake(cute, cutlass.Int32, (mk, cfg.max_tokens), (cfg.max_tokens, 1), 4)
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return cute.compile(_build_gate_up_class()(cfg), x, ids, w_gu, h_ws, lead, mem, stream,
                            options=_compile_options(arch))

    return cached_compile("moe_experts.gate_up", (cfg,), build)


@compile_unit
def compile_down(cfg: ExpertsConfig):
    def build(arch: str):
        import cutlass
        import cutlass.cute as cute

        dt = _cutlass_dtype(cfg.dtype)
        m, mk, e = cute.sym_int(), cute.sym_int(), cute.sym_int()
        h_ws = _fake(cute, dt, (mk, cfg.I), (cfg.I, 1))
        ids = _fake(cute, _cutlass_dtype(cfg.ids_dtype), (mk,), (1,), 4)
        wts = _fake(cute, cutlass.Float32, (mk,), (1,), 4)
        lead = _fake(cute, cutlass.Int32, (mk,), (1,), 4)
        mem = _fake(cute, cutlass.Int32, (mk, cfg.max_tokens), (cfg.max_tokens, 1), 4)
        w_down = _fake(cute, dt, (e, cfg.N, cfg.I), (cfg.N * cfg.I, cfg.I, 1))
        y = _fake(cute, dt, (m, cfg.N), (cute.sym_int64(), 1), 2)
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return cute.compile(_build_down_class()(cfg), h_ws, ids, wts, lead, mem, w_down, y, stream,
                            options=_compile_options(arch))

    return cached_compile("moe_experts.down", (cfg,), build)


def token_bucket(m: int) -> int:
    """Smallest power of two >= m (the compile bucket of ``max_tokens``)."""
    b = 1
    while b < m:
        b *= 2
    return b


DOWN_TRIGGER = True
"""Default of ``ExpertsConfig.dn_trigger``, read at config time (A/B: ``--ab name:...moe_experts.DOWN_TRIGGER=False``).
H200, Kimi K3 TP8 layer, same-machine A/B (``bench_kimi_k3_tp8_ab_session17.md``, call 6): KDA batch 1 98.7 -> 98.0
us, batch 2 / 4 -0.2 / -0.6 (within noise), MLA even."""

DOWN_CTAS_PER_SM = 3
"""Resident ``down`` CTAs per SM with several tokens (4 warps, <= 170 registers: ``min_blocks_per_mp``)."""


def one_wave_down_rows(n: int, sms: int, ctas_per_sm: int = DOWN_CTAS_PER_SM) -> int:
    """Output rows per ``down`` CTA so that the whole grid is resident at once (one wave).

    Every ``down`` CTA walks *all* routing pairs (its rows of every selected expert), so a CTA's
    time is the serial chain of its leaders, not its bytes: a grid one CTA over the resident
    slots runs a second wave that costs a whole CTA time while the DRAM idles (Kimi K3 TP8, N 3584,
    8 rows: 448 CTAs on 396 slots of an H200, the 52 left over ran a second wave; down at batch 64
    649 us = 61% of its roofline). The smallest row count whose grid fits the slots keeps the
    most CTAs (bytes in flight) in that one wave: ``ceil(n / (sms * ctas_per_sm))``, at least 1."""
    return max(1, -(-n // (sms * ctas_per_sm)))


def default_tuning(max_tokens: int, n: int | None = None, sms: int = 132, k: int | None = None) -> dict[str, int | bool]:
    """Tuning per token bucket, from the H200 measurements in NOTES_moe_kda.md.

    Batch 1: PDL (``down`` starts while ``gate_up`` drains), 4-row gate_up CTAs and 8-row down CTAs
    (finer tails), plain loads (the L2::256B hint did not help here): 37.5 us for K3 TP8 = 82% of the
    selected experts' roofline (v1 default 40.4 us). Several tokens: 32 intermediate rows per
    gate_up CTA (rolled loop) amortise the per-CTA leader search and keep 3 CTAs/SM without spills;
    ``down`` rows from ``one_wave_down_rows`` (``n``, the output width, given; else 8, the old default:
    8 rows keep the member loop under 170 registers); PDL measured no gain.
    ``k`` (the input width) given: its gate_up passes (``default_kvec``), and for rows wider than one pass
    at several tokens ``WIDE_DOWN_ROWS`` down rows instead of the one-wave count."""
    kvec = {} if k is None else {"gu_kvec": default_kvec(k, max_tokens)}
    if max_tokens == 1:
        return dict(pdl=True, gu_rows=4, dn_rows=8, stream_hint=False, dn_trigger=DOWN_TRIGGER, **kvec)
    wide = k is not None and k // 256 > GU_MAX_KVEC
    rows = 8 if n is None else (WIDE_DOWN_ROWS if wide else max(8, one_wave_down_rows(n, sms)))
    return dict(gu_rows=32, dn_rows=rows, dn_trigger=DOWN_TRIGGER, **kvec)


GU_MAX_KVEC = 14
"""Most 16-byte weight vectors per lane per row gate_up holds at once: K 3584 (Kimi K3's latent, 14 vectors)
compiles without spills at 160-164 registers; K 5120 / 6144 (DeepSeek-V4.1-Flash / GLM-5.3 hidden) spilled
84-492 bytes at batch 1 (ptxas -v, sm_90a) and run in passes instead (``ExpertsConfig.gu_kvec``). H200, TP8
rank shapes, batch 1 (``benchmarks/results/h200/experts_shape_sweep.json``): GLM-5.3 45.5 -> 26.0 us,
DeepSeek-V4.1-Flash 25.5 -> 22.1; Muse Spark (K 4096, no spill either way) 32.7 -> 31.4."""
GU_MAX_KVEC_MULTI = 6
"""The same bound at several tokens (the token loop converts the weights per token and needs more
registers): GLM-5.3 / DeepSeek-V4.1-Flash gate_up at 8 tokens with 12 vectors per pass still spilled (308 /
172 bytes), with 6 not; GLM-5.3 TP8 at 8 tokens 193.8 -> 162.5 us (the same sweep)."""
WIDE_DOWN_ROWS = 8
"""``down`` rows per CTA at several tokens when the input width takes more than one gate_up pass. H200, 8
tokens, TP8 rank shapes (the same sweep), 8 rows against the one-wave count: GLM-5.3 (N 6144: 16 rows,
ptxas spilled 160 bytes) 156.6 vs 162.5 us, DeepSeek-V4.1-Flash (N 5120: 13 rows, 292 bytes) 132.5 vs
172.3, Muse Spark (N 4096: 11 rows, 420 bytes; K 4096 = 16 vectors, in passes) 233.2 vs 270.8; Kimi K3
(K 3584, one pass) stays on its one-wave 10 rows (266.4 vs 271.8 with 8)."""


def default_kvec(K: int, max_tokens: int = 1) -> int:
    """``gu_kvec`` for width K: 0 (one pass) up to ``GU_MAX_KVEC`` vectors, else the even split into the
    fewest passes of at most that many (``GU_MAX_KVEC_MULTI`` at several tokens)."""
    kv = K // 256
    if kv <= GU_MAX_KVEC:
        return 0
    most = GU_MAX_KVEC if max_tokens == 1 else GU_MAX_KVEC_MULTI
    passes = -(-kv // most)
    return -(-kv // passes)


def make_config(M: int, K: int, I: int, N: int, top_k: int, dtype: torch.dtype, ids_dtype: torch.dtype,
                activation: ActivationSpec, sms: int = 132, per_route: bool = False, accumulate: bool = False,
                **tuning: int) -> ExpertsConfig:
    """Validated compile key; UserError names what to change. ``sms``: SMs of the GPU (the ``down``
    grid is sized to one wave of them; 132, an H200's, where there is no GPU). ``per_route``, ``accumulate``:
    see ``ExpertsConfig``."""
    if dtype != torch.bfloat16:
        raise UserError(f"moe experts kernel: dtype {dtype} unsupported (bf16 only); use moe.experts.reference")
    if K % 256 != 0:
        raise UserError(f"moe experts kernel: K={K} must be a multiple of 256; use moe.experts.reference")
    if I % 8 != 0:
        raise UserError(f"moe experts kernel: I={I} must be a multiple of 8; use moe.experts.reference")
    if M > MAX_TOKENS:
        raise UserError(f"moe experts kernel: {M} tokens > {MAX_TOKENS}; split the batch or use the reference")
    if ids_dtype not in (torch.int32, torch.int64):
        raise UserError(f"moe experts kernel: ids must be int32/int64, got {ids_dtype}")
    clamp = float(activation.clamp) if (activation.kind == "swiglu" and activation.clamp) else -1.0
    bucket = token_bucket(max(M, 1))
    cfg = ExpertsConfig(K, I, N, top_k, _dtype_name(dtype), _dtype_name(ids_dtype), activation.kind,
                        float(activation.beta or 0.0), float(activation.beta_lin or 0.0), clamp,
                        bucket, **{**default_tuning(bucket, N, sms, K), "per_route": bool(per_route),
                                   "accumulate": bool(accumulate), **tuning})
    if cfg.gu_rows % cfg.gu_warps != 0:
        raise UserError("moe experts kernel: gu_rows must be a multiple of gu_warps")
    if not cfg.per_route and cfg.dn_warps * cfg.max_tokens * cfg.dn_rows * 4 > 160 * 1024:
        raise UserError(f"moe experts kernel: {cfg.max_tokens} tokens x dn_rows {cfg.dn_rows} x dn_warps "
                        f"{cfg.dn_warps} exceed shared memory; use fewer dn_rows/dn_warps")
    return cfg


def experts(x: torch.Tensor, weights: torch.Tensor | None, ids: torch.Tensor, w_gate_up: torch.Tensor,
            w_down: torch.Tensor, activation: ActivationSpec, *, per_route: bool = False,
            out: torch.Tensor | None = None, workspace: dict | None = None, addend: Addend = None,
            **tuning: int) -> torch.Tensor:
    """Routed experts (same contract as ``ops.moe.experts_reference``), two kernels on the current stream.

    Parameters
    ----------
    x : [M, K] activations (bf16/fp16, unit stride, rows 16-byte aligned).
    weights : [M, top_k] routing weights (fp32; ignored, may be None, with ``per_route``).
    ids : [M, top_k] expert ids (int64/int32).
    w_gate_up : [E, 2*I, K] (gate rows, then up rows). w_down : [E, N, I]. Both contiguous.
    per_route : every route's expert output, unweighted, instead of the combination.
    out : optional [M, N] ([M, top_k, N] with ``per_route``) destination, unit stride in N.
    workspace : optional dict reused across calls (static buffers
    for CUDA graphs; filled on first use). addend : [M, N] (or a callable returning it, called after ``gate_up``)
    that ``down`` adds to the combination (``kernels/moe_addend.py``; the result may go into its memory).
    tuning : gu_warps, gu_rows, dn_warps, dn_rows.

    Returns
    -------
    [M, N] in x.dtype: sum_j weights[m, j] * expert_{ids[m, j]}(x[m]), fp32 accumulation in a fixed order.
    ``per_route``: [M, top_k, N] in x.dtype, row (m, j) = expert_{ids[m, j]}(x[m]) rounded once.
    """
    M, K = x.shape
    top_k = ids.shape[1]
    E, two_i, K2 = w_gate_up.shape
    I = two_i // 2
    N = w_down.shape[1]
    if per_route:
        weights = None  # never read by the per-route kernel
    w_shape = None if weights is None else tuple(weights.shape)
    if K2 != K or tuple(w_down.shape) != (E, N, I) or (weights is not None and w_shape != tuple(ids.shape)):
        raise UserError(f"moe experts: shapes x{tuple(x.shape)} w_gate_up{tuple(w_gate_up.shape)} "
                        f"w_down{tuple(w_down.shape)} weights{w_shape} ids{tuple(ids.shape)} "
                        "do not match the [M,K], [E,2I,K], [E,N,I], [M,top_k] contract")
    if not (w_gate_up.is_contiguous() and w_down.is_contiguous()):
        raise UserError("moe experts: expert weights must be contiguous; call .contiguous() once at load time")
    if x.stride(1) != 1 or x.stride(0) % 8 != 0 or x.data_ptr() % 16 != 0:
        x = x.contiguous()
    check_addend_use(addend, per_route, "moe.experts.cutedsl")
    cfg = make_config(M, K, I, N, top_k, x.dtype, ids.dtype, activation, sms=sm_count(x.device),
                      per_route=per_route, accumulate=addend is not None, **tuning)
    gate_up, down = compile_gate_up(cfg), compile_down(cfg)
    ids_flat = ids.reshape(-1)
    ws = workspace if workspace is not None else {}
    mk = M * top_k
    key = (mk, cfg.max_tokens, I, x.dtype)
    if ws.get("key") != key:
        ws.update(key=key, h=torch.empty(mk, I, dtype=x.dtype, device=x.device),
                  lead=torch.empty(mk, dtype=torch.int32, device=x.device),
                  members=torch.empty(mk, cfg.max_tokens, dtype=torch.int32, device=x.device))
        ws.pop("no_weights", None)
    if weights is None:
        # per_route: the kernel's weights operand is compiled out, but the call still checks its [mk] shape.
        # Never read, so empty: zeros were a fill kernel per call inside the captured step (programs pass no
        # workspace), one launch per latent-MoE layer (``models/muse_spark/NOTES.md``, session 41)
        if "no_weights" not in ws:
            ws["no_weights"] = torch.empty(mk, dtype=torch.float32, device=x.device)
        w_flat = ws["no_weights"]
    else:
        w_flat = weights.reshape(-1)
        if w_flat.dtype != torch.float32:
            w_flat = w_flat.float()
    if not per_route:
        if M == 0:
            return add_addend(out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device),
                              addend, "moe.experts.cutedsl")
        gate_up(x, ids_flat, w_gate_up, ws["h"], ws["lead"], ws["members"])
        # the addend (a side stream's join) is resolved only now: the shared experts overlap gate_up
        y = accumulate_target(addend, out, M, N, x.dtype, "moe.experts.cutedsl")
        if y is None:
            y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
        down(ws["h"], ids_flat, w_flat, ws["lead"], ws["members"], w_down, y)
        return y
    y = out if out is not None else torch.empty(M, top_k, N, dtype=x.dtype, device=x.device)
    if tuple(y.shape) != (M, top_k, N):
        raise UserError(f"moe experts: per_route out {tuple(y.shape)} must be [{M}, {top_k}, {N}]")
    if M == 0:
        return y
    # pair p = m * top_k + j is row p of a [M*top_k, N] view (row stride taken), if (m, j) collapse
    direct = y.stride(2) == 1 and (M == 1 or y.stride(0) == top_k * y.stride(1))
    rows = y.as_strided((mk, N), (y.stride(1), 1)) if direct else torch.empty(mk, N, dtype=x.dtype, device=x.device)
    gate_up(x, ids_flat, w_gate_up, ws["h"], ws["lead"], ws["members"])
    down(ws["h"], ids_flat, w_flat, ws["lead"], ws["members"], w_down, rows)
    if not direct:
        y.copy_(rows.view(M, top_k, N))
    return y


def _supports(ctx: OpContext) -> Support:
    ok = sm90_dsl_support(ctx)
    if ok is not True:
        return ok
    if ctx.attr("weight_format"):
        return f"weights {ctx.attr('weight_format')}: bf16 expert weights only (the 4-bit experts serve these)"
    if ctx.dtype != "bfloat16":
        return f"dtype {ctx.dtype} (bf16 only)"
    if ctx.dim("K") % 256 != 0:
        return f"K={ctx.dim('K')} not a multiple of 256"
    if ctx.dim("N") % 8 != 0:
        return f"I={ctx.dim('N')} not a multiple of 8"
    if ctx.tokens > MAX_TOKENS:
        return f"{ctx.tokens} tokens > {MAX_TOKENS}"
    return True


IMPLEMENTATIONS = [
    Implementation("moe.experts", "moe.experts.cutedsl", experts, _supports, priority=10,
                   description="selected experts read once: gate/up+act kernel, down+weighted-combine kernel "
                               "(per_route: down writes each route's row, no combine)"),
]

__all__ = ["experts", "ExpertsConfig", "make_config", "token_bucket", "IMPLEMENTATIONS", "MAX_TOKENS"]
