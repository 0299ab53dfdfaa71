"""One-shot Lamport all-reduce fused with residual add and RMSNorm (CuTe DSL, sm_90+).

    normed, residual_out = allreduce_lamport(partial, residual, weight, eps, comm=symm_comm)

Same contract as ``ops/allreduce.py::allreduce_residual_rmsnorm_reference``; ``comm`` must be a
:class:`~latency_specialized.comm.symmetric.SymmetricMemoryCommunicator`.

One CTA per row. Each thread owns 128-bit vectors of the row: it loads its slice of the partial,
rewrites -0.0 to +0.0, stores it into slot ``[this rank][row]`` of every peer's buffer (system
scope, unicast), then spins on its own buffer until no lane of any rank's slice is the sentinel
and sums the W slices in rank order (so every rank rounds identically: bit-identical results).
Residual add, rounding, and the RMSNorm (CTA reduction of the sum of squares) follow in the same
kernel. No barrier across ranks or CTAs: the data is the flag (see ``allreduce_layout.py``).

Traffic per rank: (W - 1) x message of stores, so it pays for small messages; above the one-shot
limit (``allreduce_common.ONE_SHOT_LIMIT_BYTES``: TP=2 never, TP<=4 512 KiB, TP<=8 256 KiB) the
two-stage kernel (``allreduce_two_stage.py``) serves.
"""

# No `from __future__ import annotations`: the DSL evaluates the kernel annotations, which name
# cute/Int32 imported inside _kernel_class.
from latency_specialized.contract import Implementation
from latency_specialized.kernels.allreduce_common import FusedAllReduceConfig, entry_points, launch, make_supports

KERNEL_NAME = "allreduce.lamport_one_shot"


def _kernel_class():
    """The kernel class, defined on first use so that cutlass is imported lazily."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32, const_expr, range_constexpr

    from latency_specialized.kernels import allreduce_layout as L
    from latency_specialized.kernels import allreduce_device as D

    class OneShotLamportAllReduce(D.FusedAllReduceKernel):
        @cute.kernel
        def kernel(self, partial: cute.Tensor, residual: cute.Tensor, weight: cute.Tensor, normed: cute.Tensor,
                   res_out: cute.Tensor, peers: cute.Tensor, flags: cute.Tensor, buf: cute.Tensor, rank: Int32,
                   slot_words: Int32, eps: Float32, gain_offset: Float32):
            cfg = self.cfg
            T, V, E = self.threads, self.vpt, self.elems
            W, NW, VECS = cfg.world_size, cfg.row_words, cfg.vecs
            tidx, _, _ = cute.arch.thread_idx()
            row, _, _ = cute.arch.block_idx()
            M = partial.shape[0]
            red, call, ping, ping_base = self.begin_call(buf, flags, slot_words, tidx, row, M)

            own = [cute.make_rmem_tensor((4,), Int32) for _ in range(V)]
            got = [cute.make_rmem_tensor((4,), Int32) for _ in range(W)]
            cur = cute.make_rmem_tensor((4,), Int32)
            acc = [cute.make_rmem_tensor((E,), Float32) for _ in range(V)]
            peer_ptr = [cute.make_ptr(Int32, peers[r], cute.AddressSpace.gmem, assumed_align=16)
                        for r in range(W)]

            # 1. publish: my slice of the partial into slot [rank][row] of every peer
            send_off = ping_base + (rank * M + row) * NW
            for k in range_constexpr(V):
                j = tidx + k * T
                if const_expr(cfg.exact) or j < VECS:
                    D.load_v4(partial.iterator + row * NW + j * 4, own[k])
                    D.rewrite_neg_zero(own[k], self.is_bf16)
                    for r in range_constexpr(W):
                        if r != rank:
                            D.store_v4_sys(peer_ptr[r] + send_off + j * 4, own[k])

            # 2. gather: load every rank's slice (W loads in flight), spin on those still
            #    holding the sentinel, then sum in rank order (same rounding on every rank)
            for k in range_constexpr(V):
                j = tidx + k * T
                for e in range_constexpr(E):
                    acc[k][e] = Float32(0.0)
                if const_expr(cfg.exact) or j < VECS:
                    for r in range_constexpr(W):
                        if r == rank:
                            got[r].store(own[k].load())
                        else:
                            D.load_v4_sys(buf.iterator + ping_base + (r * M + row) * NW + j * 4, got[r])
                    for r in range_constexpr(W):
                        if r != rank:
                            D.spin_until_ready(buf.iterator + ping_base + (r * M + row) * NW + j * 4, got[r],
                                               self.is_bf16)
                    for r in range_constexpr(W):
                        D.add_decoded(got[r], acc[k], self.is_bf16)

            # 3. residual add, one rounding, residual_out; sum of squares of the rounded row
            ssq = Float32(0.0)
            for k in range_constexpr(V):
                j = tidx + k * T
                if const_expr(cfg.exact) or j < VECS:
                    D.add_residual_round(acc[k], residual.iterator + row * NW + j * 4, cur, self.is_bf16)
                    D.store_v4(res_out.iterator + row * NW + j * 4, cur)
                    ssq = ssq + D.sum_squares(acc[k], E)

            # 4. RMSNorm of the row (CTA reduction), gain, one rounding
            if const_expr(cfg.has_norm):
                self.norm_row(acc, ssq, red, tidx, row, weight, normed, cur, eps, gain_offset)

            D.finish_call(flags, tidx, call, ping, M, W * M * NW)

    return OneShotLamportAllReduce


_build, compile_for, _prepare = entry_points(KERNEL_NAME, _kernel_class)


def allreduce_lamport(partial, residual, weight, eps: float, *, comm=None, zero_centered: bool = False, out=None):
    """One-shot Lamport all-reduce + residual + RMSNorm on the current CUDA stream.

    Arguments and result: ``allreduce_common.launch`` (the ``allreduce`` family contract of
    ``ops/allreduce.py``); ``comm`` is a SymmetricMemoryCommunicator.
    """
    return launch(KERNEL_NAME, _build, partial, residual, weight, eps, comm, zero_centered, out)


IMPLEMENTATIONS = [
    Implementation("allreduce", KERNEL_NAME, allreduce_lamport, make_supports("one_shot"), priority=20,
                   description="one-shot Lamport over the symmetric-memory (CUDA IPC) communicator, "
                               "barrier-free, + residual + RMSNorm in one CuTe DSL kernel", prepare=_prepare),
]
