"""CuTe DSL device helpers of the fused all-reduce kernels (imported only when compiling).

Data moves as int32 words (a bf16 pair or one fp32), in 128-bit vectors of 4 words: loads and
stores of peers' buffers are ``ld/st.relaxed.sys.global.v4.b32`` so they bypass stale L1 lines
and are visible system-wide. Each 32-bit word is single-copy atomic, so a reader sees every bf16
half either as the sentinel or as the final value - never torn - and checks every half.

bf16 <-> fp32 conversions are done on bits (exact widening; round-to-nearest-even narrowing,
NaN kept a quiet NaN) so that the code is the same for every lane and matches torch's rounding.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, range_constexpr, select_
from cutlass._mlir import ir

from latency_specialized.kernels import allreduce_layout as L

SENTINEL_BF16 = L.SENTINEL_WORD["bfloat16"]
SENTINEL_F32 = L.SENTINEL_WORD["float32"]
HI_MASK = -65536  # 0xFFFF0000 as int32
NEG_ZERO_HI = -2147483648  # 0x80000000: -0.0 in the high half (or a whole fp32 -0.0)


def v4_type():
    """vector<4xi32>: one 128-bit access (needs the MLIR context of the kernel being traced)."""
    return ir.VectorType.get([4], Int32.mlir_type)


@cute.jit
def load_v4(ptr: cute.Pointer, frag: cute.Tensor):
    """Plain 128-bit load of local data (inputs, residual, weight) into ``frag`` (4 x Int32)."""
    frag.store(cute.TensorSSA(cute.arch.load(ptr, v4_type()), (4,), Int32))


@cute.jit
def load_v4_sys(ptr: cute.Pointer, frag: cute.Tensor):
    """Relaxed system-scope 128-bit load: sees peers' stores, never a stale L1 line."""
    frag.store(cute.TensorSSA(cute.arch.load(ptr, v4_type(), sem="relaxed", scope="sys"), (4,), Int32))


@cute.jit
def store_v4(ptr: cute.Pointer, frag: cute.Tensor):
    cute.arch.store(ptr, frag.load().ir_value())


@cute.jit
def store_v4_sys(ptr: cute.Pointer, frag: cute.Tensor):
    """Relaxed system-scope 128-bit store into a (possibly remote) peer buffer."""
    cute.arch.store(ptr, frag.load().ir_value(), sem="relaxed", scope="sys")


@cute.jit
def sentinel_count(frag: cute.Tensor, is_bf16: cutlass.Constexpr) -> Int32:
    """Lanes of the 4 words in ``frag`` that still hold the sentinel (bit compare, not float)."""
    n = Int32(0)
    for i in range_constexpr(4):
        w = frag[i]
        if const_expr(is_bf16):
            n = n + select_((w & 0xFFFF) == 0x8000, Int32(1), Int32(0))
            n = n + select_((w & HI_MASK) == NEG_ZERO_HI, Int32(1), Int32(0))
        else:
            n = n + select_(w == NEG_ZERO_HI, Int32(1), Int32(0))
    return n


@cute.jit
def spin_until_ready(ptr: cute.Pointer, frag: cute.Tensor, is_bf16: cutlass.Constexpr):
    """Re-read ``frag`` (already loaded once from ``ptr``) until no lane is the sentinel.

    Callers first issue the loads of every peer's slice and only then spin on each: W loads in
    flight at once instead of W dependent round trips.
    """
    while sentinel_count(frag, is_bf16) > 0:
        load_v4_sys(ptr, frag)


@cute.jit
def fill_sentinel(frag: cute.Tensor, is_bf16: cutlass.Constexpr):
    for i in range_constexpr(4):
        if const_expr(is_bf16):
            frag[i] = Int32(SENTINEL_BF16)
        else:
            frag[i] = Int32(SENTINEL_F32)


@cute.jit
def rewrite_neg_zero(frag: cute.Tensor, is_bf16: cutlass.Constexpr):
    """-0.0 -> +0.0 in every lane, so that no real value equals the sentinel."""
    for i in range_constexpr(4):
        w = frag[i]
        if const_expr(is_bf16):
            w = Int32(select_((w & 0xFFFF) == 0x8000, w & HI_MASK, w))
            w = Int32(select_((w & HI_MASK) == NEG_ZERO_HI, w & 0xFFFF, w))
        else:
            w = Int32(select_(w == NEG_ZERO_HI, Int32(0), w))
        frag[i] = w


@cute.jit
def add_decoded(frag: cute.Tensor, acc: cute.Tensor, is_bf16: cutlass.Constexpr):
    """acc[e] += value e of the 4 words in ``frag`` (8 bf16 or 4 fp32 lanes), in fp32."""
    for i in range_constexpr(4):
        w = frag[i]
        if const_expr(is_bf16):
            acc[2 * i] = acc[2 * i] + (w << 16).bitcast(Float32)
            acc[2 * i + 1] = acc[2 * i + 1] + (w & HI_MASK).bitcast(Float32)
        else:
            acc[i] = acc[i] + w.bitcast(Float32)


@cute.jit
def decode(frag: cute.Tensor, out: cute.Tensor, is_bf16: cutlass.Constexpr):
    """out[e] = value e of the 4 words in ``frag`` as fp32."""
    for i in range_constexpr(4):
        w = frag[i]
        if const_expr(is_bf16):
            out[2 * i] = (w << 16).bitcast(Float32)
            out[2 * i + 1] = (w & HI_MASK).bitcast(Float32)
        else:
            out[i] = w.bitcast(Float32)


@cute.jit
def bf16_bits(f: Float32) -> Int32:
    """fp32 -> bf16 bits (low 16) with round-to-nearest-even; NaN -> 0x7FC0 (never the sentinel)."""
    u = f.bitcast(Int32)
    r = ((u + Int32(0x7FFF) + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return Int32(select_(f != f, Int32(0x7FC0), r))


@cute.jit
def encode(vals: cute.Tensor, frag: cute.Tensor, is_bf16: cutlass.Constexpr):
    """frag = the fp32 ``vals`` rounded to the activation dtype, packed as 4 words."""
    for i in range_constexpr(4):
        if const_expr(is_bf16):
            frag[i] = bf16_bits(vals[2 * i]) | (bf16_bits(vals[2 * i + 1]) << 16)
        else:
            frag[i] = vals[i].bitcast(Int32)


@cute.jit
def round_trip(vals: cute.Tensor, is_bf16: cutlass.Constexpr):
    """vals = fp32(dtype(vals)): the value a consumer of the rounded tensor sees."""
    if const_expr(is_bf16):
        for e in range_constexpr(8):
            vals[e] = (bf16_bits(vals[e]) << 16).bitcast(Float32)


@cute.jit
def sum_squares(vals: cute.Tensor, n: cutlass.Constexpr) -> Float32:
    s = Float32(0.0)
    for e in range_constexpr(n):
        s = s + vals[e] * vals[e]
    return s


@cute.jit
def block_sum(val: Float32, red: cute.Tensor, tidx: Int32, nwarps: cutlass.Constexpr) -> Float32:
    """Sum of ``val`` over the CTA, identical in every thread (fixed order: deterministic)."""
    val = cute.arch.warp_reduction_sum(val)
    if tidx % 32 == 0:
        red[tidx // 32] = val
    cute.arch.barrier()
    total = Float32(0.0)
    for w in range_constexpr(nwarps):
        total = total + red[w]
    return total


@cute.jit
def finish_call(flags: cute.Tensor, tidx: Int32, call: Int32, ping: Int32, ctas: Int32, written: Int32):
    """Last CTA to arrive advances the call counter and records the words written into slot ``ping``.

    Every CTA read the counter at its start, before arriving, so none of this call sees the update.
    """
    cute.arch.barrier()
    if tidx == 0:
        old = cute.arch.atomic_add(flags.iterator + L.FLAG_ARRIVALS, Int32(1), sem="acq_rel", scope="gpu")
        if old == ctas - 1:
            flags[L.FLAG_ARRIVALS] = Int32(0)
            flags[L.FLAG_DIRTY0 + ping] = written
            flags[L.FLAG_CALL] = call + 1


@cute.jit
def clear_previous_slot(buf: cute.Tensor, flags: cute.Tensor, prev: Int32, slot_words: Int32, tidx: Int32,
                        bidx: Int32, ctas: Int32, threads: cutlass.Constexpr, is_bf16: cutlass.Constexpr):
    """Re-arm the slot this rank read in the previous call: sentinel over the words it wrote."""
    dirty = flags[L.FLAG_DIRTY0 + prev]
    sentinel = cute.make_rmem_tensor((4,), Int32)
    fill_sentinel(sentinel, is_bf16)
    base = prev * slot_words
    for i in range((bidx * threads + tidx) * 4, dirty, ctas * threads * 4):
        store_v4(buf.iterator + base + i, sentinel)


@cute.jit
def add_residual_round(acc: cute.Tensor, residual_ptr: cute.Pointer, words: cute.Tensor,
                       is_bf16: cutlass.Constexpr):
    """acc += residual; words = dtype(acc) packed; acc = fp32(dtype(acc)) (what the norm reads)."""
    load_v4(residual_ptr, words)
    add_decoded(words, acc, is_bf16)
    encode(acc, words, is_bf16)
    round_trip(acc, is_bf16)


@cute.jit
def norm_store(acc: cute.Tensor, weight_ptr: cute.Pointer, out_ptr: cute.Pointer, rstd: Float32,
               words: cute.Tensor, gain: cute.Tensor, gain_offset: Float32, is_bf16: cutlass.Constexpr):
    """out = dtype(acc * rstd * (weight + gain_offset)) for one vector (offset 1: zero-centred gain)."""
    load_v4(weight_ptr, words)
    decode(words, gain, is_bf16)
    for e in range_constexpr(8 if is_bf16 else 4):
        acc[e] = acc[e] * rstd * (gain[e] + gain_offset)
    encode(acc, words, is_bf16)
    store_v4(out_ptr, words)


class FusedAllReduceKernel:
    """What the fused all-reduce kernels share: one CTA per row, the launch, the slot prologue and the
    closing RMSNorm; a variant (one-shot, two-stage) defines ``kernel`` - how the row is exchanged."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.threads, self.vpt = cfg.threads_and_vpt
        self.is_bf16 = cfg.is_bf16
        self.elems = 8 if cfg.is_bf16 else 4  # values per 128-bit vector

    @cute.jit
    def __call__(self, partial: cute.Tensor, residual: cute.Tensor, weight: cute.Tensor, normed: cute.Tensor,
                 res_out: cute.Tensor, peers: cute.Tensor, flags: cute.Tensor, buf: cute.Tensor, rank: Int32,
                 slot_words: Int32, eps: Float32, gain_offset: Float32, stream):
        self.kernel(partial, residual, weight, normed, res_out, peers, flags, buf, rank, slot_words,
                    eps, gain_offset).launch(grid=[partial.shape[0], 1, 1], block=[self.threads, 1, 1], stream=stream)

    def begin_call(self, buf: cute.Tensor, flags: cute.Tensor, slot_words: Int32, tidx: Int32, row: Int32,
                   ctas: Int32):
        """Trace-time prologue: (reduction scratch, call number, ping slot, its first word); re-arms the
        slot this rank read in the previous call."""
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout(32), byte_alignment=16)
        call = flags[L.FLAG_CALL]
        ping = call % L.SLOTS
        clear_previous_slot(buf, flags, (call + L.SLOTS - 1) % L.SLOTS, slot_words, tidx, row, ctas, self.threads,
                            self.is_bf16)
        return red, call, ping, ping * slot_words

    @cute.jit
    def norm_row(self, acc: list, ssq: Float32, red: cute.Tensor, tidx: Int32, row: Int32, weight: cute.Tensor,
                 normed: cute.Tensor, cur: cute.Tensor, eps: Float32, gain_offset: Float32):
        """RMSNorm of the row from its rounded values ``acc`` (CTA reduction of ``ssq``), gain, one rounding."""
        cfg = self.cfg
        T, V, E = self.threads, self.vpt, self.elems
        total = block_sum(ssq, red, tidx, T // 32)
        rstd = cute.math.rsqrt(total / Float32(cfg.n) + eps)
        gain = cute.make_rmem_tensor((E,), Float32)
        for k in range_constexpr(V):
            j = tidx + k * T
            if const_expr(cfg.exact) or j < cfg.vecs:
                norm_store(acc[k], weight.iterator + j * 4, normed.iterator + row * cfg.row_words + j * 4, rstd, cur,
                           gain, gain_offset, self.is_bf16)
