"""One-shot Lamport all-reduce fused with residual add and RMSNorm (CuTe DSL, sm_90+).

    normed, residual_out = allreduce_lamport(partial, residual, weight, eps, comm=symm_comm)

Same contract as ``ops/allreduce.py::allreduce_residual_rmsnorm_reference``; ``comm`` must be a
:class:`~latency_specialized.comm.symmetric.SymmetricMemoryCommunicator`.

One CTA per row. Each thread owns 128-bit vectors of the row: it loads its slice of the partial,
rewrites -0.0 to +0.0, stores it into slot ``[this rank][row]`` of every peer's buffer (system
scope, unicast), then spins on its own buffer until no lane of any rank's slice is the sentinel
and sums the W slices in rank order (so every rank rounds identically: bit-identical results).
Residual add, rounding, and the RMSNorm (CTA reduction of the sum of squares) follow in the same
kernel. No barrier across ranks or CTAs: the data is the flag (see ``comm/layout.py``).

Traffic per rank: (W - 1) x message of stores, so it pays for small messages; above the one-shot
limit (``allreduce_common.ONE_SHOT_LIMIT_BYTES``: TP=2 never, TP<=4 512 KiB, TP<=8 256 KiB) the
two-stage kernel (``allreduce_two_stage.py``) serves.
"""

# No `from __future__ import annotations`: the DSL evaluates the kernel annotations, which name
# cute/Int32 imported inside _kernel_class.
from latency_specialized.kernels.allreduce_common import (
    FusedAllReduceConfig,
    compile_with,
    get_kernel,
    launch,
    make_supports,
)
from latency_specialized.ops.registry import Implementation

KERNEL_NAME = "allreduce.lamport_one_shot"


def _kernel_class():
    """The kernel class, defined on first use so that cutlass is imported lazily."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, const_expr, range_constexpr

    from latency_specialized.comm import layout as L
    from latency_specialized.kernels import allreduce_device as D

    class OneShotLamportAllReduce:
        def __init__(self, cfg: FusedAllReduceConfig):
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
            smem = cutlass.memory.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout(32), byte_alignment=16)

            call = flags[L.FLAG_CALL]
            ping = call % L.SLOTS
            D.clear_previous_slot(buf, flags, (call + L.SLOTS - 1) % L.SLOTS, slot_words, tidx, row, M, T,
                                  self.is_bf16)
            ping_base = ping * slot_words

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
                total = D.block_sum(ssq, red, tidx, T // 32)
                rstd = cute.math.rsqrt(total / Float32(cfg.n) + eps)
                gain = cute.make_rmem_tensor((E,), Float32)
                for k in range_constexpr(V):
                    j = tidx + k * T
                    if const_expr(cfg.exact) or j < VECS:
                        D.norm_store(acc[k], weight.iterator + j * 4, normed.iterator + row * NW + j * 4, rstd, cur,
                                     gain, gain_offset, self.is_bf16)

            D.finish_call(flags, tidx, call, ping, M, W * M * NW)

    return OneShotLamportAllReduce


def _build(cfg: FusedAllReduceConfig, arch: str):
    return compile_with(_kernel_class()(cfg), cfg, arch)


def allreduce_lamport(partial, residual, weight, eps: float, *, comm=None, zero_centered: bool = False, out=None):
    """One-shot Lamport all-reduce + residual + RMSNorm on the current CUDA stream.

    Parameters
    ----------
    partial : [M, N] this rank's partial sum (bf16 or fp32, CUDA).
    residual : [M, N] residual stream (same on every rank).
    weight : [N] norm gain, or None for residual add only (returns (None, residual_out)).
    comm : SymmetricMemoryCommunicator built for (N, dtype, max_tokens >= M).
    out : optional (normed, residual_out) destinations [M, N] (normed ignored without weight).

    Returns
    -------
    (normed [M, N], residual_out [M, N]) in partial.dtype, bit-identical on every rank.
    """
    return launch(KERNEL_NAME, _build, partial, residual, weight, eps, comm, zero_centered, out)


def compile_for(cfg: FusedAllReduceConfig, arch: str = "sm_90a", extra_options: str = ""):
    """Compile without a GPU (CPU CI), uncached: returns the TVM-FFI function
    (``extra_options="--keep-ptx"`` keeps its PTX in ``__ptx__``)."""
    return compile_with(_kernel_class()(cfg), cfg, arch, extra_options)


def _prepare(ctx):
    """Compile (or load) the kernel of a plan site before graph capture."""
    return get_kernel(KERNEL_NAME, _build, FusedAllReduceConfig(ctx.dtype, ctx.dim("N"), ctx.world_size,
                                                               bool(ctx.attr("norm", True))))


IMPLEMENTATIONS = [
    Implementation("allreduce", KERNEL_NAME, allreduce_lamport, make_supports("one_shot"), priority=20,
                   description="one-shot Lamport over the symmetric-memory (CUDA IPC) communicator, "
                               "barrier-free, + residual + RMSNorm in one CuTe DSL kernel", prepare=_prepare),
]
