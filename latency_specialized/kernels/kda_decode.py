"""CuTe DSL fused KDA decode (``attention.kda``): conv + SiLU, L2 norm, decay, delta rule, gated RMSNorm.

One CTA per (head, sequence), 256 threads. The fp32 state of a head ([D_v, D_k] = 128x128, 64 KiB)
is the traffic that matters: it is read once and written once, in place. Every thread issues its 16
state loads (16-byte, 4 rows x 4 column blocks) *first*, then computes the per-token preamble
(depthwise conv over the rolling conv state, SiLU, q/k L2 norms, per-key decay) while those loads
are in flight. An 8-lane group owns a state row (512 B: 8 lanes x 16 B x 4 column blocks,
coalesced); ``S k`` and ``S q`` are 3-step shuffle reductions inside the group. The 128 outputs are
then RMS-normalised over the head and gated with sigmoid(g_out).

Shapes are those of ``ops.attention.kda.kda_decode_reference`` (head_dim 128; conv width static).
"""

from dataclasses import dataclass

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.kernels.compile_cache import cached_compile, compile_unit
from latency_specialized.kernels.dsl_common import compile_options as _compile_options, ptx_of  # noqa: F401
from latency_specialized.kernels.dsl_common import sm90_dsl_support
from latency_specialized.kernels.dsl_common import cutlass_dtype as _cutlass_dtype, dtype_name as _dtype_name

HEAD_DIM = 128
THREADS = 256


@dataclass(frozen=True)
class KDAConfig:
    """Static configuration (hashable compile-cache key)."""

    heads: int
    conv_width: int
    dtype: str
    """Activation dtype (mixed_qkv, conv_state, g_out, f, beta_logit, output)."""
    param_dtype: str
    """dtype of conv_weight, A_log, dt_bias, norm_weight."""
    idx_dtype: str
    eps: float
    gate_lower_bound: float
    scale: float
    row_split: int = 1
    """CTAs per (head, sequence): 2 splits the 128 state rows over a 2-CTA cluster (128 threads each),
    the RMSNorm's sum of squares crossing through distributed shared memory."""
    decay_rank: int = 0
    """0: ``f`` is the decay input [B, H*D] (f_b_proj's output). R > 0: ``f`` is the low-rank f_a [B, R]
    and the kernel computes the decay input ``round(f_a @ f_b^T)`` itself (f_b [H*D, R], the f_b_proj
    gemm fused: one kernel less per layer); thread d of a head reads f_b row d (R x 2 bytes)."""
    stage_smem: bool = False
    """Stage the state through shared memory: every thread requests its 64 KiB share with
    ``cp.async`` (no registers held while in flight) and reads it back row by row. 64 KiB of shared
    memory per CTA lets 3 CTAs share an SM (registers capped at 85) instead of 2 that hold the
    state in registers: more state in flight per SM and CTAs out of phase (one computes while
    others load). row_split 1 only."""
    pdl: bool = True
    """Programmatic dependent launch: the kernel starts while the projections before it drain and
    requests its recurrent state (written only by this kernel, a step earlier) before
    ``griddepcontrol.wait``; everything the projections wrote is read after the wait. So two KDA
    launches on the same state rows must never be adjacent in a stream (the second would read the
    state before the first writes it): in a decode step other kernels always sit between them."""


def _build_kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64
    from cutlass.memory import SmemAllocator

    D = HEAD_DIM

    def vec4(ptr, off):
        return cute.make_tensor((ptr + off).align(16), cute.make_layout(4))

    def vec8(ptr, off):
        """8 16-bit values at an element offset (16-byte aligned): one vector load."""
        return cute.make_tensor((ptr + off).align(16), cute.make_layout(8))

    def ld_peer_f32(smem_ptr, rank):
        """The f32 at the same shared-memory offset in CTA ``rank`` of this cluster (DSMEM load)."""
        from cutlass._mlir import ir
        from cutlass._mlir.dialects import llvm

        addr = Int32(llvm.ptrtoint(ir.IntegerType.get_signless(32), smem_ptr.to_llvm_ptr()))
        return Float32(llvm.inline_asm(
            ir.F32Type.get(), [addr.ir_value(), Int32(rank).ir_value()],
            "{\n .reg .b32 ra;\n mapa.shared::cluster.u32 ra, $1, $2;\n ld.shared::cluster.f32 $0, [ra];\n}",
            "=f,r,r,~{memory}", has_side_effects=True, asm_dialect=0))

    def cp_async16(smem_ptr, gaddr):
        """16 bytes global -> shared, asynchronous (L2 fetches 256 B: half a state row per request)."""
        from cutlass._mlir import ir
        from cutlass._mlir.dialects import llvm

        saddr = Int32(llvm.ptrtoint(ir.IntegerType.get_signless(32), smem_ptr.to_llvm_ptr()))
        llvm.inline_asm(None, [saddr.ir_value(), Int64(gaddr).ir_value()],
                        "cp.async.cg.shared.global.L2::256B [$0], [$1], 16;", "r,l",
                        has_side_effects=True, asm_dialect=0)

    def cp_async_commit():
        from cutlass._mlir.dialects import llvm

        llvm.inline_asm(None, [], "cp.async.commit_group;", "~{memory}", has_side_effects=True, asm_dialect=0)

    def cp_async_wait_all():
        """This thread's copies have landed (each thread reads back only what it copied: no barrier)."""
        from cutlass._mlir.dialects import llvm

        llvm.inline_asm(None, [], "cp.async.wait_group 0;", "~{memory}", has_side_effects=True, asm_dialect=0)

    class KDADecodeKernel:
        def __init__(self, cfg: KDAConfig):
            self.cfg = cfg
            self.dtype = _cutlass_dtype(cfg.dtype)

        @cute.jit
        def __call__(self, mixed_qkv: cute.Tensor, conv_state: cute.Tensor, conv_weight: cute.Tensor,
                     f: cute.Tensor, f_b: cute.Tensor, A_log: cute.Tensor, dt_bias: cute.Tensor,
                     beta_logit: cute.Tensor, g_out: cute.Tensor, norm_weight: cute.Tensor, state: cute.Tensor,
                     state_idx: cute.Tensor, out: cute.Tensor, stream):
            RS = self.cfg.row_split
            staged = self.cfg.stage_smem
            self.kernel(mixed_qkv, conv_state, conv_weight, f, f_b, A_log, dt_bias, beta_logit, g_out,
                        norm_weight, state, state_idx, out).launch(
                grid=[RS, self.cfg.heads, mixed_qkv.shape[0]], block=[THREADS // RS, 1, 1],
                cluster=[RS, 1, 1] if RS > 1 else None, stream=stream, use_pdl=self.cfg.pdl,
                # <= 128 registers: 64 KiB of state in flight per 256 threads of an SM (staged: 3 CTAs
                # of 64 KiB shared memory each, the whole carveout). An explicit carveout keeps the DSL
                # from querying a device at compile time (CPU compiles).
                min_blocks_per_mp=3 if staged else 2 * RS, preferred_smem_carveout=100 if staged else 50)

        @cute.jit
        def _decay_input(self, f: cute.Tensor, f_b: cute.Tensor, b, c) -> Float32:
            """Decay input of channel c: f[b, c], or round(f_a[b] . f_b[c]) with the gemm's one rounding
            (16-byte loads of the f_b row and of f_a; fp32 products and sums)."""
            R = self.cfg.decay_rank
            val = Float32(0.0)
            if cutlass.const_expr(R == 0):
                val = f[b, c].to(Float32)
            else:
                acc = cute.make_rmem_tensor(8, Float32)
                acc.fill(0.0)
                for i in cutlass.range_constexpr(R // 8):
                    wv = vec8(f_b.iterator, c * R + 8 * i).load().to(Float32)
                    xv = vec8(f.iterator, b * f.stride[0] + 8 * i).load().to(Float32)
                    acc.store(acc.load() + wv * xv)
                dot = Float32(acc.load().reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0))
                val = dot.to(self.dtype).to(Float32)
            return val

        @cute.jit
        def _sigmoid(self, z: Float32) -> Float32:
            return Float32(1.0) / (Float32(1.0) + cute.math.exp(-z))

        @cute.jit
        def _conv(self, mixed_qkv, conv_state, conv_weight, b, sidx, c, write: cutlass.Constexpr):
            """SiLU(conv) of channel c rounded to the activation dtype; shifts its window when ``write``."""
            W = self.cfg.conv_width
            xraw = mixed_qkv[b, c]
            acc = xraw.to(Float32) * conv_weight[c, W - 1].to(Float32)
            prev = []
            for tap in cutlass.range_constexpr(W - 1):
                prev.append(conv_state[sidx, c, tap])
            for tap in cutlass.range_constexpr(W - 1):
                acc = acc + prev[tap].to(Float32) * conv_weight[c, tap].to(Float32)
            if cutlass.const_expr(write):
                for tap in cutlass.range_constexpr(W - 2):
                    conv_state[sidx, c, tap] = prev[tap + 1]
                conv_state[sidx, c, W - 2] = xraw
            act = acc * self._sigmoid(acc)
            return act.to(self.dtype).to(Float32), prev, xraw  # the reference rounds the conv output

        @cute.kernel
        def kernel(self, mixed_qkv: cute.Tensor, conv_state: cute.Tensor, conv_weight: cute.Tensor,
                   f: cute.Tensor, f_b: cute.Tensor, A_log: cute.Tensor, dt_bias: cute.Tensor,
                   beta_logit: cute.Tensor, g_out: cute.Tensor, norm_weight: cute.Tensor, state: cute.Tensor,
                   state_idx: cute.Tensor, out: cute.Tensor):
            cfg = self.cfg
            H, W, RS = cfg.heads, cfg.conv_width, cfg.row_split
            HD = H * D
            ROWS = D // RS  # state rows of this CTA
            NW = THREADS // RS // 32  # warps; each owns 16 rows
            tidx, _, _ = cute.arch.thread_idx()
            rank, h, b = cute.arch.block_idx()
            lane = tidx % 32
            warp = tidx // 32
            grp = lane // 8
            sub = lane % 8
            r0 = rank * ROWS

            smem = SmemAllocator()
            sq = smem.allocate_tensor(Float32, cute.make_layout(D), byte_alignment=16)
            sk = smem.allocate_tensor(Float32, cute.make_layout(D), byte_alignment=16)
            sdec = smem.allocate_tensor(Float32, cute.make_layout(D), byte_alignment=16)
            sv = smem.allocate_tensor(Float32, cute.make_layout(ROWS), byte_alignment=16)
            so = smem.allocate_tensor(Float32, cute.make_layout(ROWS), byte_alignment=16)
            red = smem.allocate_tensor(Float32, cute.make_layout(16), byte_alignment=16)
            sS = None
            if cutlass.const_expr(cfg.stage_smem):  # the state rows, same layout as in global memory
                sS = smem.allocate_tensor(Float32, cute.make_layout(ROWS * D), byte_alignment=128)

            sidx = state_idx[b].to(Int32)
            sbase = state.iterator + (Int64(sidx) * Int64(H) + Int64(h)) * Int64(D * D)

            # 1. the state rows of this thread: in flight during the preamble (no L1 allocation: each
            #    byte is read once; 256 B L2 prefetch = half a row per request)
            ld_state = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Float32, num_bits_per_copy=128,
                                           l2_prefetch_size=cute.nvgpu.L2PrefetchSize.SIZE_256B,
                                           l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE)
            S = []
            for i in cutlass.range_constexpr(4):
                r = r0 + warp * 16 + 4 * i + grp
                row = []
                for j in cutlass.range_constexpr(4):
                    off = r * D + sub * 4 + 32 * j
                    if cutlass.const_expr(cfg.stage_smem):  # same offsets in shared memory (row split 1)
                        cp_async16(sS.iterator + off, (sbase + off).toint())
                    else:
                        frag = cute.make_rmem_tensor(4, Float32)
                        cute.copy(ld_state, vec4(sbase, off), frag)
                        row.append(frag)
                S.append(row)
            if cutlass.const_expr(cfg.stage_smem):
                cp_async_commit()
            if cutlass.const_expr(cfg.pdl):
                # state_idx and the state were written before the previous kernel started (the step's
                # inputs; this kernel one step ago); the projections' outputs are read after this
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()

            # 2. preamble. Threads [0, D): conv of q and k channel d (every CTA of a split needs all of
            #    q, k; with a split only rank 0 shifts their windows, after the cluster barrier below).
            #    v: the CTA's own rows. Decay of key d: threads [D, 2D) (no split) or every thread d.
            qv = Float32(0.0)
            kv = Float32(0.0)
            qk_prev = []
            qk_x = []
            if cutlass.const_expr(RS == 1):
                if tidx < D:
                    qv, _, _ = self._conv(mixed_qkv, conv_state, conv_weight, b, sidx, h * D + tidx, True)
                    kv, _, _ = self._conv(mixed_qkv, conv_state, conv_weight, b, sidx, HD + h * D + tidx, True)
            else:  # 128 threads: one q and one k channel each
                qv, qp, qx = self._conv(mixed_qkv, conv_state, conv_weight, b, sidx, h * D + tidx, False)
                kv, kp, kx = self._conv(mixed_qkv, conv_state, conv_weight, b, sidx, HD + h * D + tidx, False)
                qk_prev = qp + kp
                qk_x = [qx, kx]
            if tidx < ROWS:
                vv, _, _ = self._conv(mixed_qkv, conv_state, conv_weight, b, sidx, 2 * HD + h * D + r0 + tidx, True)
                sv[tidx] = vv
            dk = tidx
            if cutlass.const_expr(RS == 1):
                dk = tidx - D
            if cutlass.const_expr(RS == 1):
                if tidx >= D:
                    a = cute.math.exp(A_log[h].to(Float32))
                    z = a * (self._decay_input(f, f_b, b, h * D + dk) + dt_bias[h * D + dk].to(Float32))
                    sdec[dk] = cute.math.exp(Float32(cfg.gate_lower_bound) * self._sigmoid(z))
            else:
                a = cute.math.exp(A_log[h].to(Float32))
                z = a * (self._decay_input(f, f_b, b, h * D + dk) + dt_bias[h * D + dk].to(Float32))
                sdec[dk] = cute.math.exp(Float32(cfg.gate_lower_bound) * self._sigmoid(z))
            # L2 norms of q and k over the head (warps 0-3 hold the 128 channels)
            q2 = cute.arch.warp_reduction_sum(qv * qv)
            k2 = cute.arch.warp_reduction_sum(kv * kv)
            if lane == 0 and warp < 4:
                red[warp] = q2
                red[4 + warp] = k2
            cute.arch.barrier()
            if tidx < D:
                sq_sum = red[0] + red[1] + red[2] + red[3]
                sk_sum = red[4] + red[5] + red[6] + red[7]
                sq[tidx] = qv * cute.math.rsqrt(sq_sum + Float32(1e-6)) * Float32(cfg.scale)
                sk[tidx] = kv * cute.math.rsqrt(sk_sum + Float32(1e-6))
            cute.arch.barrier()
            beta = self._sigmoid(beta_logit[b, h].to(Float32))

            # 3. delta rule per row: S <- S*decay; v' = beta (v - S k); S <- S + v' k^T; o = S q
            # k, q and decay are re-read from shared memory per row (cheap) to keep registers for S
            if cutlass.const_expr(cfg.stage_smem):
                cp_async_wait_all()
            for i in cutlass.range_constexpr(4):
                rl = warp * 16 + 4 * i + grp  # row within this CTA's slice
                if cutlass.const_expr(cfg.stage_smem):  # this row's 4 vectors, back from shared memory
                    for j in cutlass.range_constexpr(4):
                        frag = cute.make_rmem_tensor(4, Float32)
                        frag.store(vec4(sS.iterator, rl * D + sub * 4 + 32 * j).load())
                        S[i].append(frag)
                kk = []
                acc4 = cute.make_rmem_tensor(4, Float32)
                acc4.fill(0.0)
                for j in cutlass.range_constexpr(4):
                    col = sub * 4 + 32 * j
                    kk.append(vec4(sk.iterator, col).load())
                    S[i][j].store(S[i][j].load() * vec4(sdec.iterator, col).load())
                    acc4.store(acc4.load() + S[i][j].load() * kk[j])
                skv = acc4.load().reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
                skv = cute.arch.warp_reduction_sum(skv, threads_in_group=8)
                vnew = beta * (sv[rl] - skv)
                acc4.fill(0.0)
                for j in cutlass.range_constexpr(4):
                    S[i][j].store(S[i][j].load() + kk[j] * vnew)
                    acc4.store(acc4.load() + S[i][j].load() * vec4(sq.iterator, sub * 4 + 32 * j).load())
                    cute.autovec_copy(S[i][j], vec4(sbase, (r0 + rl) * D + sub * 4 + 32 * j))
                o = acc4.load().reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
                o = cute.arch.warp_reduction_sum(o, threads_in_group=8)
                if sub == 0:
                    so[rl] = o
            cute.arch.barrier()

            # 4. gated RMSNorm over the head's D outputs (a split adds the peer CTA's partial sum of
            #    squares through distributed shared memory)
            ov = Float32(0.0)
            if tidx < ROWS:
                ov = so[tidx]
            o2 = cute.arch.warp_reduction_sum(ov * ov)
            if lane == 0 and warp < ROWS // 32:
                red[8 + warp] = o2
            cute.arch.barrier()
            total = Float32(0.0)
            for w in cutlass.range_constexpr(ROWS // 32):
                total = total + red[8 + w]
            if cutlass.const_expr(RS == 2):
                if tidx == 0:
                    red[12] = total
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()  # the peer's partial (and its reads of the q/k windows) are done
                total = total + ld_peer_f32(red.iterator + 12, 1 - rank)
                cute.arch.cluster_arrive()  # our read of the peer's smem is done
                if rank == 0:
                    for comp in cutlass.range_constexpr(2):
                        c = comp * HD + h * D + tidx
                        for tap in cutlass.range_constexpr(W - 2):
                            conv_state[sidx, c, tap] = qk_prev[comp * (W - 1) + tap + 1]
                        conv_state[sidx, c, W - 2] = qk_x[comp]
            if tidx < ROWS:
                ms = total * Float32(1.0 / D)
                r = r0 + tidx
                y = ov * cute.math.rsqrt(ms + Float32(cfg.eps)) * norm_weight[r].to(Float32)
                y = y * self._sigmoid(g_out[b, h * D + r].to(Float32))
                out[b, h * D + r] = y.to(self.dtype)
            if cutlass.const_expr(RS == 2):
                cute.arch.cluster_wait()  # keep our smem alive until the peer has read it

    return KDADecodeKernel


@compile_unit
def _compile(cfg: KDAConfig):
    def build(arch: str):
        import cutlass
        import cutlass.cute as cute

        dt, pdt = _cutlass_dtype(cfg.dtype), _cutlass_dtype(cfg.param_dtype)
        H, W, D = cfg.heads, cfg.conv_width, HEAD_DIM
        HD = H * D
        bsym, ssym = cute.sym_int(), cute.sym_int()

        def fake(dtype, shape, stride, align=4):
            return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)

        R = cfg.decay_rank
        if R:  # f_a [B, R] (16-byte aligned rows) and f_b [H*D, R]
            decay = (fake(dt, (bsym, R), (cute.sym_int64(), 1), 16), fake(dt, (HD, R), (R, 1), 16))
        else:  # f [B, H*D]; the f_b slot takes f again (unused)
            f = fake(dt, (bsym, HD), (cute.sym_int64(), 1), 2)
            decay = (f, f)
        args = (
            fake(dt, (bsym, 3 * HD), (cute.sym_int64(), 1), 2),  # mixed_qkv
            fake(dt, (ssym, 3 * HD, W - 1), (3 * HD * (W - 1), W - 1, 1), 2),  # conv_state
            fake(pdt, (3 * HD, W), (W, 1)),  # conv_weight
            *decay,  # f, f_b
            fake(pdt, (H,), (1,)),  # A_log
            fake(pdt, (HD,), (1,)),  # dt_bias
            fake(dt, (bsym, H), (cute.sym_int64(), 1), 2),  # beta_logit
            fake(dt, (bsym, HD), (cute.sym_int64(), 1), 2),  # g_out
            fake(pdt, (D,), (1,)),  # norm_weight
            fake(cutlass.Float32, (ssym, H, D, D), (H * D * D, D * D, D, 1), 16),  # state
            fake(_cutlass_dtype(cfg.idx_dtype), (bsym,), (1,)),  # state_idx
            fake(dt, (bsym, HD), (cute.sym_int64(), 1), 2),  # out
        )
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return cute.compile(_build_kernel_class()(cfg), *args, stream, options=_compile_options(arch))

    return cached_compile("kda_decode", (cfg,), build)


def make_config(mixed_qkv: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor, state: torch.Tensor,
                state_idx: torch.Tensor, A_log: torch.Tensor, *, num_heads: int, eps: float, gate_lower_bound: float,
                scale: float | None, row_split: int | None = None, stage_smem: bool | None = None,
                decay_rank: int = 0) -> KDAConfig:
    """Validated compile key; UserError names the fix."""
    HD3 = mixed_qkv.shape[1]
    if HD3 % (3 * num_heads) != 0 or HD3 // (3 * num_heads) != HEAD_DIM:
        raise UserError(f"kda kernel: head_dim must be {HEAD_DIM} (mixed_qkv width {HD3}, {num_heads} heads); "
                        "use attention.kda.reference for other head sizes")
    W = conv_weight.shape[1]
    if W < 2 or tuple(conv_state.shape[1:]) != (HD3, W - 1):
        raise UserError(f"kda kernel: conv_state must be [S, {HD3}, {W - 1}], got {tuple(conv_state.shape)}")
    if state.dtype != torch.float32 or tuple(state.shape[1:]) != (num_heads, HEAD_DIM, HEAD_DIM):
        raise UserError(f"kda kernel: state must be fp32 [S, {num_heads}, {HEAD_DIM}, {HEAD_DIM}], "
                        f"got {state.dtype} {tuple(state.shape)}")
    if not (state.is_contiguous() and conv_state.is_contiguous() and conv_weight.is_contiguous()):
        raise UserError("kda kernel: state, conv_state and conv_weight must be contiguous (allocate them so)")
    if mixed_qkv.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise UserError(f"kda kernel: activation dtype {mixed_qkv.dtype} unsupported")
    if conv_state.dtype != mixed_qkv.dtype:
        raise UserError("kda kernel: conv_state dtype must equal the activation dtype")
    if row_split is None:
        row_split = default_row_split(mixed_qkv.shape[0], num_heads)
    if row_split not in (1, 2):
        raise UserError(f"kda kernel: row_split={row_split}; use 1 or 2")
    if stage_smem is None:
        stage_smem = default_stage_smem(mixed_qkv.shape[0], num_heads) and row_split == 1
    if stage_smem and row_split != 1:
        raise UserError("kda kernel: stage_smem needs row_split=1 (a split CTA holds half a state)")
    return KDAConfig(num_heads, W, _dtype_name(mixed_qkv.dtype), _dtype_name(A_log.dtype),
                     _dtype_name(state_idx.dtype), float(eps), float(gate_lower_bound),
                     float(HEAD_DIM ** -0.5 if scale is None else scale), row_split, int(decay_rank), bool(stage_smem))


STAGE_SMEM_MIN_CTAS = 264
"""Smallest grid (sequences x heads) that stages the state through shared memory by default: two
CTAs per SM of the H200's 132, i.e. where the register variant no longer holds the whole grid at once.
Measured (H200, TP8 12 heads, NOTES_moe_kda.md): batch 64 34.2 vs 37.4 us (72 vs 66 % of the
roofline), TP16 batch 64 18.2 vs 21-22 us; batch 8 (96 CTAs) 7.60 vs 7.50 us, batch 1 even."""


def default_stage_smem(batch: int, heads: int) -> bool:
    """Stage the state through shared memory (3 CTAs per SM) where the grid fills the GPU many times."""
    return batch * heads >= STAGE_SMEM_MIN_CTAS


def _check_fused_decay(f_a: torch.Tensor, f_b: torch.Tensor, mixed_qkv: torch.Tensor, heads: int) -> int:
    """Rank R of a fused decay input (f_a [B, R], f_b [H*D, R]); UserError names the fix."""
    HD = heads * HEAD_DIM
    if f_b.dim() != 2 or f_b.shape[0] != HD or f_b.shape[1] % 8 or not 8 <= f_b.shape[1] <= 512:
        raise UserError(f"kda kernel: f_b_weight must be [{HD}, R] with R a multiple of 8 up to 512, got "
                        f"{tuple(f_b.shape)}: run f_b_proj as a gemm and pass its output as f")
    R = f_b.shape[1]
    if f_b.dtype != mixed_qkv.dtype or f_a.dtype != mixed_qkv.dtype:
        raise UserError(f"kda kernel: f_a ({f_a.dtype}) and f_b_weight ({f_b.dtype}) must be in the activation "
                        f"dtype {mixed_qkv.dtype}: cast the weight once at load")
    if not f_b.is_contiguous() or f_b.data_ptr() % 16:
        raise UserError("kda kernel: f_b_weight must be contiguous and 16-byte aligned (.contiguous() at load)")
    if (f_a.dim() != 2 or f_a.shape != (mixed_qkv.shape[0], R) or f_a.stride(1) != 1
            or (f_a.stride(0) * f_a.element_size()) % 16 or f_a.data_ptr() % 16):
        raise UserError(f"kda kernel: with f_b_weight, f must be f_a [{mixed_qkv.shape[0]}, {R}] with unit column "
                        f"stride and 16-byte aligned rows, got {tuple(f_a.shape)} stride {f_a.stride()}")
    return R


def default_row_split(batch: int, heads: int) -> int:
    """CTAs per (head, sequence): 1. Measured on the H200 (NOTES_moe_kda.md), the 2-CTA cluster split
    gains 4% at batch 1 (5.03 vs 5.23 us, TP8) and loses 5-8% from batch 8 on."""
    return 1


def kda_decode(mixed_qkv: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor, f: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, beta_logit: torch.Tensor, g_out: torch.Tensor,
               norm_weight: torch.Tensor, state: torch.Tensor, state_idx: torch.Tensor, *, num_heads: int,
               eps: float = 1e-5, gate_lower_bound: float = -5.0, scale: float | None = None,
               out: torch.Tensor | None = None, row_split: int | None = None,
               stage_smem: bool | None = None, f_b_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Fused KDA decode on the GPU; same contract as ``ops.attention.kda.kda_decode_reference``.

    ``conv_weight``, ``A_log``, ``dt_bias`` and ``norm_weight`` share one dtype (fp32 or the activation
    dtype). ``state`` / ``conv_state`` rows named by ``state_idx`` are updated in place. Returns
    [B, H*D] in mixed_qkv.dtype (or writes ``out``). ``row_split`` (1 or 2 CTAs per head and
    sequence) defaults to :func:`default_row_split`; ``stage_smem`` (state through shared memory, see
    KDAConfig) to :func:`default_stage_smem`. ``f_b_weight`` [H*D, R] (activation dtype): ``f`` is then
    the low-rank f_a [B, R] (rows may be strided, 16-byte aligned) and the kernel computes the decay
    input itself (the f_b_proj gemm fused, see KDAConfig.decay_rank).
    """
    rank = _check_fused_decay(f, f_b_weight, mixed_qkv, num_heads) if f_b_weight is not None else 0
    cfg = make_config(mixed_qkv, conv_state, conv_weight, state, state_idx, A_log, num_heads=num_heads, eps=eps,
                      gate_lower_bound=gate_lower_bound, scale=scale, row_split=row_split, stage_smem=stage_smem,
                      decay_rank=rank)
    pdt = A_log.dtype
    for name, t in (("conv_weight", conv_weight), ("dt_bias", dt_bias), ("norm_weight", norm_weight)):
        if t.dtype != pdt:
            raise UserError(f"kda kernel: {name} is {t.dtype} but A_log is {pdt}; cast the parameters to one dtype")
    fn = _compile(cfg)
    B = mixed_qkv.shape[0]
    y = out if out is not None else torch.empty(B, num_heads * HEAD_DIM, dtype=mixed_qkv.dtype,
                                                 device=mixed_qkv.device)
    if B > 0:
        fn(mixed_qkv, conv_state, conv_weight, f, f_b_weight if rank else f, A_log, dt_bias, beta_logit, g_out,
           norm_weight, state, state_idx, y)
    return y


def _supports(ctx: OpContext) -> Support:
    ok = sm90_dsl_support(ctx)
    if ok is not True:
        return ok
    if ctx.dim("head_dim") != HEAD_DIM:
        return f"head_dim {ctx.dim('head_dim')} != {HEAD_DIM}"
    rank = dict(ctx.dims).get("decay_rank")
    if rank is not None and (rank % 8 or not 8 <= rank <= 512):
        return f"fused decay input needs decay_rank % 8 == 0 and <= 512 (decay_rank={rank})"
    return True


IMPLEMENTATIONS = [
    Implementation("attention.kda", "attention.kda.cutedsl", kda_decode, _supports, priority=10,
                   description="one CTA per (head, seq): state streamed once through registers, in place"),
]

__all__ = ["kda_decode", "KDAConfig", "make_config", "IMPLEMENTATIONS", "HEAD_DIM"]
