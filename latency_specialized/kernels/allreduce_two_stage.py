"""Two-stage (reduce-scatter, then all-gather) all-reduce fused with residual add and RMSNorm.

    normed, residual_out = allreduce_two_stage(partial, residual, weight, eps, comm=symm_comm)

Same contract as ``ops/allreduce.py::allreduce_residual_rmsnorm_reference``; ``comm`` must be a
:class:`~latency_specialized.comm.symmetric.SymmetricMemoryCommunicator`.

For large messages the one-shot kernel's (W - 1) x message of stores per rank dominates. Here the
row's 128-bit vectors are split into W contiguous column chunks; rank ``c`` owns chunk ``c``:

1. reduce-scatter: every rank stores each vector only into its owner's buffer (1 x message);
2. the owner spins until the W slices of its chunk arrived, sums them in rank order, adds the
   residual, rounds once, and stores the rounded chunk into every peer (1 x message);
3. every rank spins for the chunks it does not own, writes residual_out and applies RMSNorm.

Two Lamport exchanges in one kernel, no barrier (see ``allreduce_layout.py``). Every rank holds the
owner's rounded bits, so results are bit-identical on every rank.
"""

# No `from __future__ import annotations`: the DSL evaluates the kernel annotations, which name
# cute/Int32 imported inside _kernel_class.
from latency_specialized.contract import Implementation
from latency_specialized.kernels.allreduce_common import FusedAllReduceConfig, entry_points, launch, make_supports

KERNEL_NAME = "allreduce.two_stage"


def _kernel_class():
    """The kernel class, defined on first use so that cutlass is imported lazily."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32, const_expr, range_constexpr

    from latency_specialized.kernels import allreduce_layout as L
    from latency_specialized.kernels import allreduce_device as D

    class TwoStageAllReduce(D.FusedAllReduceKernel):
        def __init__(self, cfg: FusedAllReduceConfig):
            super().__init__(cfg)
            self.chunk_vecs = L.SlotLayout(cfg.world_size, 1, cfg.row_words).chunk_vecs

        @cute.kernel
        def kernel(self, partial: cute.Tensor, residual: cute.Tensor, weight: cute.Tensor, normed: cute.Tensor,
                   res_out: cute.Tensor, peers: cute.Tensor, flags: cute.Tensor, buf: cute.Tensor, rank: Int32,
                   slot_words: Int32, eps: Float32, gain_offset: Float32):
            cfg = self.cfg
            T, V, E, CV = self.threads, self.vpt, self.elems, self.chunk_vecs
            W, NW, VECS = cfg.world_size, cfg.row_words, cfg.vecs
            CW = CV * L.VEC_WORDS
            tidx, _, _ = cute.arch.thread_idx()
            row, _, _ = cute.arch.block_idx()
            M = partial.shape[0]
            red, call, ping, ping_base = self.begin_call(buf, flags, slot_words, tidx, row, M)
            ag_row = ping_base + W * M * CW + row * NW  # all-gather area, this row

            own = [cute.make_rmem_tensor((4,), Int32) for _ in range(V)]
            h = [cute.make_rmem_tensor((4,), Int32) for _ in range(V)]
            got = [cute.make_rmem_tensor((4,), Int32) for _ in range(W)]
            cur = cute.make_rmem_tensor((4,), Int32)
            acc = [cute.make_rmem_tensor((E,), Float32) for _ in range(V)]
            peer_ptr = [cute.make_ptr(Int32, peers[r], cute.AddressSpace.gmem, assumed_align=16)
                        for r in range(W)]

            # 1. reduce-scatter: each vector of my partial goes to its owner only
            for k in range_constexpr(V):
                j = tidx + k * T
                if const_expr(cfg.exact) or j < VECS:
                    owner = j // CV
                    D.load_v4(partial.iterator + row * NW + j * 4, own[k])
                    D.rewrite_neg_zero(own[k], self.is_bf16)
                    if owner != rank:
                        dst = cute.make_ptr(Int32, peers[owner], cute.AddressSpace.gmem, assumed_align=16)
                        D.store_v4_sys(dst + ping_base + (rank * M + row) * CW + (j - owner * CV) * 4, own[k])

            # 2. owners: reduce the chunk in rank order, residual, round, broadcast the rounded chunk
            for k in range_constexpr(V):
                j = tidx + k * T
                if const_expr(cfg.exact) or j < VECS:
                    if j // CV == rank:
                        for e in range_constexpr(E):
                            acc[k][e] = Float32(0.0)
                        rs_col = (j - rank * CV) * 4
                        for r in range_constexpr(W):  # all W loads in flight, then spin, then sum in order
                            if r == rank:
                                got[r].store(own[k].load())
                            else:
                                D.load_v4_sys(buf.iterator + ping_base + (r * M + row) * CW + rs_col, got[r])
                        for r in range_constexpr(W):
                            if r != rank:
                                D.spin_until_ready(buf.iterator + ping_base + (r * M + row) * CW + rs_col, got[r],
                                                   self.is_bf16)
                        for r in range_constexpr(W):
                            D.add_decoded(got[r], acc[k], self.is_bf16)
                        D.add_residual_round(acc[k], residual.iterator + row * NW + j * 4, h[k], self.is_bf16)
                        # a rounded sum can be -0.0 (tiny negative, FTZ): it must not look like the sentinel
                        D.rewrite_neg_zero(h[k], self.is_bf16)
                        for r in range_constexpr(W):
                            if r != rank:
                                D.store_v4_sys(peer_ptr[r] + ag_row + j * 4, h[k])

            # 3. everyone: the chunks owned by peers (all loads in flight first), residual_out,
            #    sum of squares
            for k in range_constexpr(V):
                j = tidx + k * T
                if const_expr(cfg.exact) or j < VECS:
                    if j // CV != rank:
                        D.load_v4_sys(buf.iterator + ag_row + j * 4, h[k])
            ssq = Float32(0.0)
            for k in range_constexpr(V):
                j = tidx + k * T
                if const_expr(cfg.exact) or j < VECS:
                    if j // CV != rank:
                        D.spin_until_ready(buf.iterator + ag_row + j * 4, h[k], self.is_bf16)
                    D.store_v4(res_out.iterator + row * NW + j * 4, h[k])
                    D.decode(h[k], acc[k], self.is_bf16)
                    ssq = ssq + D.sum_squares(acc[k], E)

            # 4. RMSNorm of the row (CTA reduction), gain, one rounding
            if const_expr(cfg.has_norm):
                self.norm_row(acc, ssq, red, tidx, row, weight, normed, cur, eps, gain_offset)

            D.finish_call(flags, tidx, call, ping, M, W * M * CW + M * NW)

    return TwoStageAllReduce


_build, compile_for, _prepare = entry_points(KERNEL_NAME, _kernel_class)


def allreduce_two_stage(partial, residual, weight, eps: float, *, comm=None, zero_centered: bool = False, out=None):
    """Two-stage all-reduce + residual + RMSNorm on the current CUDA stream.

    Arguments and result: ``allreduce_common.launch`` (the ``allreduce`` family contract of
    ``ops/allreduce.py``); ``comm`` is a SymmetricMemoryCommunicator.
    """
    return launch(KERNEL_NAME, _build, partial, residual, weight, eps, comm, zero_centered, out)


IMPLEMENTATIONS = [
    Implementation("allreduce", KERNEL_NAME, allreduce_two_stage, make_supports("two_stage"), priority=10,
                   description="reduce-scatter + all-gather over the symmetric-memory (CUDA IPC) communicator, "
                               "barrier-free, + residual + RMSNorm in one CuTe DSL kernel", prepare=_prepare),
]
