"""PTX building blocks and host-side plumbing shared by the gemm, norm and prefetch kernels.

Two halves:

* host side (importable anywhere, no cutlass): shape checks that raise UserError, the fake-tensor
  builders used at compile time, the dtype map;
* device side (``ptx`` namespace, built on first use because it imports cutlass): inline-PTX
  helpers that must be called inside a ``@cute.kernel`` body.

Why inline PTX: the decode GEMMs are pure streaming, and what decides their speed is exactly which
load instruction is emitted - 16 bytes wide, non-coherent, no L1 allocation for weights that are
read once - and that tensor-core fragments are filled straight from those registers, without a
shared-memory round trip (see gemm_small_m.py for the K permutation that makes this legal). CuTe's
copy atoms give the first only indirectly and have no form of the second.
"""

from __future__ import annotations

import functools
import weakref
from types import SimpleNamespace
from typing import Any, Callable

import torch

from latency_specialized.errors import UserError
from latency_specialized.hardware import sm_count
from latency_specialized.kernels.dsl_common import compile_options, ptx_of  # noqa: F401 (re-exported)

VEC_BYTES = 16
"""Every kernel here moves 16 bytes per thread per load (ld.global.v4.b32)."""


def check_gemm_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None,
                    out: torch.Tensor | None, *, kmult: int, out_dtype: torch.dtype | None = None,
                    strided_x: bool = False) -> tuple[int, int, int]:
    """Validate the gemm contract for the kernels; returns (M, N, K).

    The kernels read rows with 16-byte loads, so both operands must be contiguous bf16 rows whose
    length K is a multiple of ``kmult`` and whose base is 16-byte aligned (``strided_x``: x rows may
    sit apart - unit column stride, 16-byte aligned row starts - for kernels that read a row stride).
    """
    if x.dim() != 2 or weight.dim() != 2:
        raise UserError(f"gemm kernels take x[M,K] and weight[N,K]; got x{tuple(x.shape)} weight{tuple(weight.shape)}:"
                        " reshape to 2-D first")
    m, k = x.shape
    n, k2 = weight.shape
    if k != k2:
        raise UserError(f"gemm: x has K={k} but weight has K={k2}: pass weight as [N, K] (nn.Linear layout)")
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise UserError(f"gemm kernels are bf16-only (got {x.dtype}/{weight.dtype}): use gemm.cublas for other dtypes")
    if k % kmult:
        raise UserError(f"gemm kernel needs K % {kmult} == 0 (K={k}): use gemm.cublas for this shape")
    for name, t in (("x", x), ("weight", weight)):
        if strided_x and name == "x" and m > 1 and t.stride(1) == 1 and t.stride(0) >= k \
                and (t.stride(0) * t.element_size()) % VEC_BYTES == 0 and t.data_ptr() % VEC_BYTES == 0:
            continue  # rows apart, each 16-byte aligned: the kernel reads x's row stride
        if not t.is_contiguous() or t.data_ptr() % VEC_BYTES:
            raise UserError(f"gemm kernel needs a contiguous, 16-byte aligned {name}: call .contiguous() first")
    for name, t in (("residual", residual), ("out", out)):
        want = (out_dtype or x.dtype) if name == "out" else x.dtype
        # rows may be strided (a column slice of a wider tensor): unit column stride, row stride >= N,
        # 16-byte aligned base
        if t is not None and (tuple(t.shape) != (m, n) or t.dtype != want or (m > 0 and t.stride(1) != 1)
                              or (m > 1 and t.stride(0) < n) or t.data_ptr() % VEC_BYTES):
            raise UserError(f"gemm: {name} must be a [{m}, {n}] {want} tensor with unit column stride and a "
                            f"16-byte aligned base, got {tuple(t.shape)} {t.dtype} stride {tuple(t.stride())}")
    return m, n, k


_CHECKED: dict[int, set] = {}
"""id(codes tensor) -> tags checked; an entry leaves with its tensor (``weakref.finalize``), before the id can be
reused (tensors compare elementwise, so a WeakKeyDictionary cannot hold them)."""


def check_once(codes: torch.Tensor, tag: tuple, check: Callable[[], None]) -> None:
    """Run ``check`` (which raises on a bad weight) the first time ``codes`` - the stored tensor object of a quantized
    weight - is seen with ``tag`` (the kernel, its scales' address, the range checked: one weight may serve several
    kernels). Keyed weakly on the tensor object, not its address: a freed weight's entries go with it, so a new
    weight allocated at the same address is checked again. The checks read the weight on the host: call once
    eagerly, before a graph capture."""
    seen = _CHECKED.get(id(codes))
    if seen is None:
        seen = _CHECKED[id(codes)] = set()
        weakref.finalize(codes, _CHECKED.pop, id(codes), None)
    if tag not in seen:
        check()
        seen.add(tag)


def fp32_output(name: str, x: torch.Tensor, out_dtype: torch.dtype | None, residual: torch.Tensor | None) -> bool:
    """Whether a gemm kernel call stores its fp32 sums unrounded (router logits, vLLM's GateLinear):
    ``out_dtype=torch.float32`` on bf16 x. Other output dtypes, or fp32 with a residual, raise."""
    fp32 = out_dtype is not None and out_dtype != x.dtype
    if fp32 and (out_dtype != torch.float32 or residual is not None):
        raise UserError(f"{name}: out_dtype={out_dtype} (with residual={residual is not None}): the kernel writes "
                        "bf16, or fp32 without a residual; use gemm.cublas")
    return fp32


def refuse_fp32_residual(out_fp32: bool, residual: bool) -> None:
    """Compile-time twin of ``fp32_output``'s check: no model has an fp32-output gemm with a residual."""
    if out_fp32 and residual:
        raise ValueError("fp32 output with a residual is not a gemm site of any model: not compiled")


def grid_cap(device: torch.device, ctas_per_sm: int) -> int:
    """Launch-time grid cap of the persistent kernels: ctas_per_sm x SMs (0 = no cap)."""
    if ctas_per_sm <= 0:
        return 1 << 30
    return ctas_per_sm * sm_count(device)


def cute_dtype(dtype: torch.dtype) -> Any:
    import cutlass

    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
            torch.float32: cutlass.Float32}[dtype]


def fake_rows(dtype: Any, rows: Any, cols: Any, align: int = 16) -> Any:
    """A row-major fake tensor [rows, cols] for cute.compile (either dim may be a sym_int)."""
    import cutlass.cute as cute

    return cute.runtime.make_fake_compact_tensor(dtype, (rows, cols), stride_order=(1, 0), assumed_align=align)


def fake_strided_rows(dtype: Any, rows: Any, cols: Any, align: int = 16) -> Any:
    """[rows, cols] with unit column stride and a dynamic row stride (>= cols): outputs/residuals that
    may be a column slice of a wider tensor (e.g. the rank's hidden slice of the latent up-projection)."""
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(dtype, (rows, cols), stride=(cute.sym_int64(), 1), assumed_align=align)


def fake_vec(dtype: Any, n: Any, align: int = 16) -> Any:
    import cutlass.cute as cute

    return cute.runtime.make_fake_compact_tensor(dtype, (n,), assumed_align=align)


def fake_stream() -> Any:
    """The TVM-FFI stream placeholder: the compiled call picks up torch's current stream."""
    import cutlass.cute as cute

    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def max_regs(threads: int, ctas_per_sm: int) -> int:
    """Register cap that lets 2 x ctas_per_sm CTAs of ``threads`` share an SM (0: no cap)."""
    if ctas_per_sm <= 0:
        return 0
    return max(32, min(255, 65536 // (threads * 2 * ctas_per_sm)) // 8 * 8)


@functools.cache
def ptx() -> SimpleNamespace:
    """The device-side helpers (imports cutlass on first use)."""
    import cutlass
    from cutlass import Float32, Int32, Int64
    from cutlass._mlir import ir
    from cutlass._mlir.dialects import llvm

    def i32t():
        return ir.IntegerType.get_signless(32)

    def struct(n: int, t):
        return llvm.StructType.get_literal([t] * n)

    def _v(x, cls):
        return cls(x).ir_value()

    def _asm4(ptx_str: str, operands: list, constraints: str, pure: bool = False) -> list:
        """Four 32-bit words out; side-effecting (program order kept: the loads) unless ``pure`` (the decodes)."""
        st = llvm.inline_asm(struct(4, i32t()), operands, ptx_str, constraints,
                             has_side_effects=not pure, asm_dialect=0)
        return [Int32(llvm.extractvalue(i32t(), st, [i])) for i in range(4)]

    # Weights are streamed exactly once per call: non-coherent path, no L1 allocation (keeps L1 for
    # the activations that every warp re-reads), 256-byte L2 prefetch so DRAM sees long bursts.
    # The asm is marked side-effecting so LLVM keeps program order: weight loads stay ahead of
    # griddepcontrol.wait and activation loads stay behind it - in PTX; ptxas may still hoist the wait above
    # non-coherent loads (see ld_weight_coherent).
    def ld_weight(addr) -> list:
        return _asm4("ld.global.nc.L1::no_allocate.L2::256B.v4.b32 {$0,$1,$2,$3}, [$4];",
                     [_v(addr, Int64)], "=r,=r,=r,=r,l")

    def ld_act(addr) -> list:
        """16 bytes of an activation row: L1-cached (re-read by every warp of the SM)."""
        return _asm4("ld.global.nc.v4.b32 {$0,$1,$2,$3}, [$4];", [_v(addr, Int64)], "=r,=r,=r,=r,l")

    def ld_act_if(addr, pred) -> list:
        """ld_act when ``pred`` (Int32) is non-zero, else four zero words (masked rows)."""
        return _asm4("{\n .reg .pred p;\n setp.ne.b32 p, $5, 0;\n mov.b32 $0, 0;\n mov.b32 $1, 0;\n"
                     " mov.b32 $2, 0;\n mov.b32 $3, 0;\n @p ld.global.nc.v4.b32 {$0,$1,$2,$3}, [$4];\n}",
                     [_v(addr, Int64), _v(pred, Int32)], "=r,=r,=r,=r,l,r")

    def ld_weight_coherent(addr) -> list:
        """``ld_weight`` through the coherent path: ptxas (12.9, sm_90a) hoists ``griddepcontrol.wait`` above
        ``ld.global.nc`` loads - the weights a kernel requests before its PDL wait would wait too - but keeps it
        behind coherent ones (``tests/ops/test_pdl_load_order.py``)."""
        return _asm4("ld.global.L1::no_allocate.L2::256B.v4.b32 {$0,$1,$2,$3}, [$4];",
                     [_v(addr, Int64)], "=r,=r,=r,=r,l")

    def ld_weight_if(addr, pred, coherent: bool = False) -> list:
        space = "global" if coherent else "global.nc"
        return _asm4("{\n .reg .pred p;\n setp.ne.b32 p, $5, 0;\n mov.b32 $0, 0;\n mov.b32 $1, 0;\n"
                     " mov.b32 $2, 0;\n mov.b32 $3, 0;\n"
                     f" @p ld.{space}.L1::no_allocate.L2::256B.v4.b32 {{$0,$1,$2,$3}}, [$4];\n}}",
                     [_v(addr, Int64), _v(pred, Int32)], "=r,=r,=r,=r,l,r")

    def ld_plain_if(addr, pred) -> list:
        """Coherent 16-byte load (data another kernel of this graph may have just written)."""
        return _asm4("{\n .reg .pred p;\n setp.ne.b32 p, $5, 0;\n mov.b32 $0, 0;\n mov.b32 $1, 0;\n"
                     " mov.b32 $2, 0;\n mov.b32 $3, 0;\n @p ld.global.v4.b32 {$0,$1,$2,$3}, [$4];\n}",
                     [_v(addr, Int64), _v(pred, Int32)], "=r,=r,=r,=r,l,r")

    def ld_shared_v4_if(addr, pred) -> list:
        """16 bytes of shared memory at the 32-bit shared-window ``addr`` when ``pred`` (Int32) is non-zero, else four
        zero words."""
        return _asm4("{\n .reg .pred p;\n setp.ne.b32 p, $5, 0;\n mov.b32 $0, 0;\n mov.b32 $1, 0;\n"
                     " mov.b32 $2, 0;\n mov.b32 $3, 0;\n @p ld.shared.v4.b32 {$0,$1,$2,$3}, [$4];\n}",
                     [_v(addr, Int32), _v(pred, Int32)], "=r,=r,=r,=r,r,r")

    def ld_shared_v4(addr) -> list:
        """16 bytes of shared memory at the 32-bit shared-window ``addr``."""
        return _asm4("ld.shared.v4.b32 {$0,$1,$2,$3}, [$4];", [_v(addr, Int32)], "=r,=r,=r,=r,r")

    def st_shared_v4_if(addr, words: list, pred) -> None:
        """Store four words at the 32-bit shared-window ``addr`` when ``pred`` (Int32) is non-zero."""
        llvm.inline_asm(None, [_v(addr, Int32)] + [_v(w, Int32) for w in words] + [_v(pred, Int32)],
                        "{\n .reg .pred p;\n setp.ne.b32 p, $5, 0;\n @p st.shared.v4.b32 [$0], {$1,$2,$3,$4};\n}",
                        "r,r,r,r,r,r,~{memory}", has_side_effects=True, asm_dialect=0)

    def st_v4_if(addr, words: list, pred) -> None:
        llvm.inline_asm(None, [_v(addr, Int64)] + [_v(w, Int32) for w in words] + [_v(pred, Int32)],
                        "{\n .reg .pred p;\n setp.ne.b32 p, $5, 0;\n @p st.global.v4.b32 [$0], {$1,$2,$3,$4};\n}",
                        "l,r,r,r,r,r,~{memory}", has_side_effects=True, asm_dialect=0)

    def as_f32(word) -> Float32:
        return Float32(llvm.bitcast(ir.F32Type.get(), _v(word, Int32)))

    def as_i32(f) -> Int32:
        return Int32(llvm.bitcast(i32t(), _v(f, Float32)))

    # bf16 -> f32 is a 16-bit shift: the low element of a packed pair sits in the low half.
    def bf16_lo(word) -> Float32:
        return as_f32(word << 16)

    def bf16_hi(word) -> Float32:
        return as_f32(word & Int32(-65536))

    def unpack_bf16x8(words: list) -> list:
        out = []
        for w in words:
            out += [bf16_lo(w), bf16_hi(w)]
        return out

    def _cvt_pair(op: str, lo, hi) -> Int32:
        r = llvm.inline_asm(i32t(), [_v(hi, Float32), _v(lo, Float32)], f"{op} $0, $1, $2;", "=r,f,f",
                            has_side_effects=False, asm_dialect=0)
        return Int32(r)

    def pack_bf16x2(lo, hi) -> Int32:
        """Round two f32 to bf16 (RNE, like torch) and pack them, ``lo`` in the low half."""
        return _cvt_pair("cvt.rn.bf16x2.f32", lo, hi)

    def pack_f16x2(lo, hi) -> Int32:
        return _cvt_pair("cvt.rn.f16x2.f32", lo, hi)

    def f16_lo(word) -> Float32:
        return Float32(llvm.inline_asm(ir.F32Type.get(), [_v(word, Int32)],
                                       "{\n .reg .b16 l, h;\n mov.b32 {l, h}, $1;\n cvt.f32.f16 $0, l;\n}",
                                       "=f,r", has_side_effects=False, asm_dialect=0))

    def f16_hi(word) -> Float32:
        return Float32(llvm.inline_asm(ir.F32Type.get(), [_v(word, Int32)],
                                       "{\n .reg .b16 l, h;\n mov.b32 {l, h}, $1;\n cvt.f32.f16 $0, h;\n}",
                                       "=f,r", has_side_effects=False, asm_dialect=0))

    def unpack_words(dtype: str, words: list) -> list:
        """fp32 values of packed 32-bit words: 2 per word for bfloat16/float16, 1 for float32."""
        if dtype == "float32":
            return [as_f32(wd) for wd in words]
        lo, hi = (bf16_lo, bf16_hi) if dtype == "bfloat16" else (f16_lo, f16_hi)
        out = []
        for wd in words:
            out += [lo(wd), hi(wd)]
        return out

    def pack_words(dtype: str, vals: list) -> list:
        """The inverse of ``unpack_words``: round (RNE) and pack fp32 values into 32-bit words."""
        if dtype == "float32":
            return [as_i32(v) for v in vals]
        pk = pack_bf16x2 if dtype == "bfloat16" else pack_f16x2
        return [pk(vals[i], vals[i + 1]) for i in range(0, len(vals), 2)]

    def mma_bf16_16816(a: list, b: list, c: list) -> list:
        """D = A(16x16 bf16, row) * B(16x8 bf16, col) + C (f32), one warp (mma.sync, sm_80+)."""
        st = llvm.inline_asm(
            struct(4, ir.F32Type.get()),
            [_v(v, Int32) for v in a] + [_v(v, Int32) for v in b] + [_v(v, Float32) for v in c],
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
            "{$10,$11,$12,$13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False, asm_dialect=0)
        return [Float32(llvm.extractvalue(ir.F32Type.get(), st, [i])) for i in range(4)]

    def _asm2(ptx_str: str, a, b) -> list:
        """Two 32-bit words out of two 32-bit words in ($2, $3 -> $0, $1), pure (no side effects)."""
        st = llvm.inline_asm(struct(2, i32t()), [_v(a, Int32), _v(b, Int32)], ptx_str, "=r,=r,r,r",
                             has_side_effects=False, asm_dialect=0)
        return [Int32(llvm.extractvalue(i32t(), st, [i])) for i in range(2)]

    def _decode4(ptx_str: str, word, mult) -> list:
        """Four bf16x2 words out of a code word and a multiplier ($4, $5 -> $0 .. $3): the e2m1 decodes."""
        return _asm4(ptx_str, [_v(word, Int32), _v(mult, Int32)], "=r,=r,=r,=r,r,r", pure=True)

    def e4m3x4_to_bf16x2(word, mult) -> list:
        """Four e4m3 codes (one 32-bit word, byte 0 lowest) -> two bf16x2 words (bytes 0, 1 | 2, 3; the lower
        byte in the low half), each value times ``mult`` (a bf16x2 word, both halves alike).

        Integer work, no conversion instruction (those issue at a fraction of the ALU rate on sm_90): a byte
        moved to the top of a 16-bit half keeps its sign at bit 15, and its 7 exponent + mantissa bits shifted
        right by 4 land on bf16's low exponent bits and top mantissa bits - the value times 2^-120 (bf16's
        exponent bias 127 against e4m3's 7), exact for normals and subnormals (a subnormal e4m3 becomes a
        subnormal bf16 of the same scaled value). ``mult`` = 2^120 (x a power-of-two block scale) restores it,
        exactly, with one bf16x2 multiply per pair. The NaN codes (0x7F / 0xFF) decode as +-480: callers
        refuse weights holding them."""
        return _asm2(
            "{\n .reg .b32 z, r0, r1, s0, s1;\n mov.b32 z, 0;\n"
            " prmt.b32 r0, $2, z, 0x1404;\n prmt.b32 r1, $2, z, 0x3424;\n"
            " shr.b32 s0, r0, 4;\n shr.b32 s1, r1, 4;\n"
            " and.b32 s0, s0, 0x07F007F0;\n and.b32 s1, s1, 0x07F007F0;\n"
            " and.b32 r0, r0, 0x80008000;\n and.b32 r1, r1, 0x80008000;\n"
            " or.b32 r0, r0, s0;\n or.b32 r1, r1, s1;\n"
            " mul.rn.bf16x2 $0, r0, $3;\n mul.rn.bf16x2 $1, r1, $3;\n}", word, mult)

    def e4m3x4_to_bf16x2_split(word, mult) -> list:
        """Four e4m3 codes (one 32-bit word) -> two bf16x2 words: bytes 0, 2 (the even pair) and bytes 1, 3 (the
        odd pair), each value times ``mult``, with the bias trick of :func:`e4m3x4_to_bf16x2`.

        Pairs bytes that sit 16 bits apart, so each half's shift is the same: no byte permute on the weights - about
        5 instructions per word on the integer pipe plus the two left shifts as multiplies (offline sm_90 SASS:
        IMAD, the FMA pipe) against about 8.7 - and the activations take the permutation instead
        (``pair_even_odd``: 2 permutes per activation word pair and n-tile), cheaper while a lane decodes more
        weight words than it permutes activation words (n-tiles <= 2 x m-tiles)."""
        return _asm2(
            "{\n .reg .b32 m1, t1, m2, t2, s2, o1, o2;\n"
            " and.b32 m1, $2, 0x7F007F00;\n shr.b32 t1, m1, 4;\n"
            " and.b32 o1, $2, 0x80008000;\n or.b32 o1, o1, t1;\n"
            " and.b32 m2, $2, 0x007F007F;\n mul.lo.u32 t2, m2, 16;\n"
            " mul.lo.u32 s2, $2, 256;\n and.b32 s2, s2, 0x80008000;\n or.b32 o2, s2, t2;\n"
            " mul.rn.bf16x2 $0, o2, $3;\n mul.rn.bf16x2 $1, o1, $3;\n}", word, mult)

    def e2m1x8_to_bf16x2(word, mult) -> list:
        """Eight e2m1 codes (one 32-bit word, value n in bits 4n .. 4n + 3: MXFP4's low nibble first) -> four bf16x2
        words pairing values (0, 4), (1, 5), (2, 6), (3, 7) (the lower value in the low half), times ``mult``.

        A code ``s e1 e0 m`` placed as the bf16 half ``s << 15 | (e1 e0 m) << 6`` is its value x 2^-126, normals and
        the subnormal 0.5 alike; codes 16 bits apart share every shift, so each pair is two masks, one or two shifts
        (left shifts as multiplies: ptxas may issue them on the FMA pipe) and an or. ``mult`` = 2^126 x the block
        scale restores the value exactly."""
        return _decode4(
            "{\n .reg .b32 a, b, c, d, t;\n"
            " and.b32 a, $4, 0x80008000;\n and.b32 t, $4, 0x70007000;\n shr.b32 t, t, 6;\n or.b32 a, a, t;\n"
            " mul.lo.u32 b, $4, 16;\n and.b32 b, b, 0x80008000;\n and.b32 t, $4, 0x07000700;\n shr.b32 t, t, 2;\n"
            " or.b32 b, b, t;\n"
            " mul.lo.u32 c, $4, 256;\n and.b32 c, c, 0x80008000;\n and.b32 t, $4, 0x00700070;\n"
            " mul.lo.u32 t, t, 4;\n or.b32 c, c, t;\n"
            " mul.lo.u32 d, $4, 4096;\n and.b32 d, d, 0x80008000;\n and.b32 t, $4, 0x00070007;\n"
            " mul.lo.u32 t, t, 64;\n or.b32 d, d, t;\n"
            " mul.rn.bf16x2 $0, d, $5;\n mul.rn.bf16x2 $1, c, $5;\n mul.rn.bf16x2 $2, b, $5;\n"
            " mul.rn.bf16x2 $3, a, $5;\n}", word, mult)

    def e2m1x8_paired_to_bf16x2(word, mult) -> list:
        """:func:`e2m1x8_to_bf16x2` for codes stored in the paired-nibble layout (``quant.layout.paired_nibbles``):
        the same four bf16x2 pairs of values (0, 4), (1, 5), (2, 6), (3, 7), from a word whose halves hold their
        four codes with the bits where the decode wants them - value 0's sign at bit 15 and magnitude at 8-6, value
        1's three and value 2's six places lower (one shift and one mask a pair, the mask of value 0's pair), value
        3's in the four bits left (14, 13, 11, 10: three shifts). 11 integer instructions a word instead of ~16."""
        return _decode4(
            "{\n .reg .b32 a, b, c, d, t, u;\n"
            " and.b32 a, $4, 0x81C081C0;\n"
            " mul.lo.u32 b, $4, 8;\n and.b32 b, b, 0x81C081C0;\n"
            " mul.lo.u32 c, $4, 64;\n and.b32 c, c, 0x81C081C0;\n"
            " mul.lo.u32 d, $4, 2;\n and.b32 d, d, 0x80008000;\n"
            " shr.b32 t, $4, 5;\n and.b32 t, t, 0x01000100;\n"
            " shr.b32 u, $4, 4;\n and.b32 u, u, 0x00C000C0;\n or.b32 d, d, t;\n or.b32 d, d, u;\n"
            " mul.rn.bf16x2 $0, a, $5;\n mul.rn.bf16x2 $1, b, $5;\n mul.rn.bf16x2 $2, c, $5;\n"
            " mul.rn.bf16x2 $3, d, $5;\n}", word, mult)

    def e4m3_scale_to_bf16x2(byte) -> Int32:
        """An e4m3 scale byte (NVFP4's per-16 scale) -> bf16x2 holding its value x 2^62 in both halves: the e2m1
        decode's multiplier (its 2^126, less the 2^64 that the kernels put back with the fp32 global scale: with the
        whole 2^126 a scale above 4 would overflow bf16). Exact for every finite e4m3, subnormals included: the byte's
        bits placed as fp16 are its value x 2^-8, and fp16 -> fp32 -> bf16 keeps all 4 significant bits."""
        return Int32(llvm.inline_asm(
            i32t(), [_v(byte, Int32)],
            "{\n .reg .b32 t, u;\n .reg .b16 h;\n .reg .f32 f;\n"
            " and.b32 t, $1, 0x7F;\n shl.b32 t, t, 7;\n and.b32 u, $1, 0x80;\n shl.b32 u, u, 8;\n or.b32 t, t, u;\n"
            " cvt.u16.u32 h, t;\n cvt.f32.f16 f, h;\n mul.f32 f, f, 0f62800000;\n cvt.rn.bf16x2.f32 $0, f, f;\n}",
            "=r,r", has_side_effects=False, asm_dialect=0))

    def pair_even_odd(w0, w1) -> list:
        """Two packed bf16x2 words (values 0, 1 | 2, 3) -> (0, 2 | 1, 3): the activations' side of
        :func:`e4m3x4_to_bf16x2_split`'s pairing (two byte permutes)."""
        return _asm2("prmt.b32 $0, $2, $3, 0x5410;\n prmt.b32 $1, $2, $3, 0x7632;", w0, w1)

    def smem_addr(ptr) -> Int32:
        """32-bit shared-window address of a shared-memory cute pointer."""
        return Int32(llvm.ptrtoint(i32t(), ptr.to_llvm_ptr()))

    def st_cluster_f32(local_addr, rank, val) -> None:
        """Store ``val`` at the same shared-memory offset in CTA ``rank`` of this cluster (DSMEM)."""
        llvm.inline_asm(None, [_v(local_addr, Int32), _v(rank, Int32), _v(val, Float32)],
                        "{\n .reg .b32 ra;\n mapa.shared::cluster.u32 ra, $0, $1;\n"
                        " st.shared::cluster.f32 [ra], $2;\n}",
                        "r,r,f,~{memory}", has_side_effects=True, asm_dialect=0)

    def ld_cluster_f32(local_addr, rank) -> Float32:
        """Load the f32 at the same shared-memory offset in CTA ``rank`` of this cluster (DSMEM)."""
        return Float32(llvm.inline_asm(ir.F32Type.get(), [_v(local_addr, Int32), _v(rank, Int32)],
                                       "{\n .reg .b32 ra;\n mapa.shared::cluster.u32 ra, $1, $2;\n"
                                       " ld.shared::cluster.f32 $0, [ra];\n}",
                                       "=f,r,r,~{memory}", has_side_effects=True, asm_dialect=0))

    def cluster_ctarank() -> Int32:
        return Int32(llvm.inline_asm(i32t(), [], "mov.u32 $0, %cluster_ctarank;", "=r",
                                     has_side_effects=False, asm_dialect=0))

    def cluster_sync() -> None:
        """All threads of all CTAs of the cluster; release/acquire orders the DSMEM traffic."""
        llvm.inline_asm(None, [], "barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;",
                        "~{memory}", has_side_effects=True, asm_dialect=0)

    def cluster_arrive_relaxed() -> None:
        llvm.inline_asm(None, [], "barrier.cluster.arrive.relaxed.aligned;", "~{memory}",
                        has_side_effects=True, asm_dialect=0)

    def cluster_wait() -> None:
        llvm.inline_asm(None, [], "barrier.cluster.wait.aligned;", "~{memory}", has_side_effects=True, asm_dialect=0)

    def prefetch_l2_bulk(addr, nbytes) -> None:
        llvm.inline_asm(None, [_v(addr, Int64), _v(nbytes, Int32)],
                        "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r,~{memory}",
                        has_side_effects=True, asm_dialect=0)

    return SimpleNamespace(**{k: v for k, v in locals().items() if callable(v) and not k.startswith("_")
                              and k not in ("i32t", "struct")})


def mma_supports(name: str, what: str, max_m: int, ctx: Any) -> Any:
    """supports() of the mma.sync gemm kernels (small-M, split-K): M limit, K % 32, then the table."""
    from latency_specialized.kernels import tuning

    if ctx.tokens > max_m:
        return f"{what} kernel serves M<={max_m} (M={ctx.tokens})"
    if ctx.dim("K") % 32:
        return f"needs K % 32 == 0 (K={ctx.dim('K')})"
    return tuning.gemm_supports(name, ctx, fp32_out=True)
