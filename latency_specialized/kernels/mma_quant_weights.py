"""Quantized weights in the mma.sync kernel (``gemm_small_m.py``): how a lane's 16-byte weight words become bf16
MMA fragments, at trace time.

The kernel streams every weight row in 64-byte chunks (16 bytes per lane, lanes t = 0..3 of a row group side by
side) straight into registers. With bf16 weights a chunk is 32 values; with quantized ones it is more - 64 e4m3
(block FP8) or 128 e2m1 (MXFP4) - and each lane decodes its words to bf16 pairs in registers (integer shifts and
masks that place the code's bits on bf16's, the exponent bias restored by one ``mul.rn.bf16x2`` that can carry a
power-of-two block scale too) and feeds them to ``m16n8k16`` MMAs with the activations of the same K. A dot product
does not care in which order K is summed, so each decode's pairing decides which activation values share a
register; where that is not the activations' memory order, they are permuted (2 ``prmt`` per two words).

:class:`QuantCoding` is the static description (part of the compile key); :func:`chunk_scales` and
:func:`chunk_mma` are called by the kernel body for each chunk (they only emit instructions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

E4M3_BIAS_MULT = 0x7B807B80
"""bf16x2 of 2^120: the e4m3 decode leaves values 2^-120 too small (bf16's exponent bias 127 against e4m3's 7)."""
NVFP4_LOG2_OFFSET = 64
"""NVFP4's weights enter the MMAs as value x e4m3 scale x 2^-64 (``ptx.e4m3_scale_to_bf16x2``): the kernels
multiply their fp32 sums by the global scale x 2^64."""
NVFP4_UNDO = float(2 ** NVFP4_LOG2_OFFSET)


@dataclass(frozen=True)
class QuantCoding:
    """How the weight codes of a quantized gemm are stored and scaled.

    ``element``: "e4m3" (one byte a value) or "e2m1" (two values a byte, the low nibble first). ``ue8m0``: one
    exponent byte per block (2^(e - 127)), folded into the decode's multiplier; else one fp32 multiplier per block
    for e4m3 codes, applied to each chunk's partial sums - or, for e2m1 codes, NVFP4: one e4m3 scale byte per 16
    values of a row (block (1, 16): two per lane load, each folded into the multiplier of its two words; the sums
    come out x 2^-64 / the global scale, ``NVFP4_LOG2_OFFSET``). ``block``: (rows, cols) of a block; rows 1 or a
    multiple of 16; cols such that one lane's values of a row share one scale (fp32: a multiple of 64; ue8m0: of 16
    for e4m3, 32 for e2m1)."""

    ue8m0: bool
    block: tuple[int, int]
    element: str = "e4m3"
    paired: bool = False
    """e2m1 only: the codes are in the paired-nibble layout (``quant.layout.paired_nibbles``), decoded with fewer
    instructions (``ptx.e2m1x8_paired_to_bf16x2``)."""

    @property
    def nvfp4(self) -> bool:
        return self.element == "e2m1" and not self.ue8m0

    @property
    def scales_in_decode(self) -> bool:
        """The block scales ride in the decode's multiplier (else they scale each chunk's fp32 sums)."""
        return self.ue8m0 or self.nvfp4

    @property
    def values_per_lane(self) -> int:
        """Values of one row in a lane's 16-byte load."""
        return 16 if self.element == "e4m3" else 32

    @property
    def chunk(self) -> int:
        """K per 64-byte chunk of a row."""
        return 4 * self.values_per_lane

    def row_bytes(self, k: int) -> int:
        return k if self.element == "e4m3" else k // 2

    def refusal(self, k: int) -> str | None:
        """Why (K, this coding) cannot compile, or None."""
        rows, cols = self.block
        if self.element not in ("e4m3", "e2m1"):
            return f"element {self.element!r} (e4m3 or e2m1)"
        if self.paired and self.element != "e2m1":
            return "the paired-nibble layout is for e2m1 codes"
        if self.nvfp4:
            return None if k % self.chunk == 0 and self.block == (1, 16) else (
                f"NVFP4 (e2m1 codes, e4m3 scales) takes block (1, 16) and K % {self.chunk} == 0 (got {self.block}, "
                f"K={k})")
        if k % self.chunk:
            return f"K % {self.chunk} != 0 (K={k})"
        if not (rows == 1 or rows % 16 == 0):
            return f"block rows {rows}: 1 or a multiple of 16"
        need = self.values_per_lane if self.ue8m0 else 64
        if cols % need:
            return f"block cols {cols}: a multiple of {need}"
        return None


def chunk_scales(P: Any, coding: QuantCoding, scl: Any, rows: list, chunk: Any, t4: Any) -> list:
    """Per m-tile row half (rows g, g + 8 of this lane): the fp32 block scale of the chunk, or the bf16x2 multiplier
    of the ue8m0 byte of this lane's values - 2^(e - 7) for e4m3 (2^(e - 127) x the decode's 2^120), 2^(e - 1) for
    e2m1 (x its 2^126) - or NVFP4's two (one per 16 values: e4m3 scale x 2^62)."""
    from cutlass import Int32

    rb, kb = coding.block
    out = []
    for r in range(len(rows)):
        if r % 2 and rb % 16 == 0:  # rows g and g + 8 of a 16-row tile share the scale row
            out.append(out[-1])
            continue
        if coding.nvfp4:  # the lane's 32 values: two blocks of 16, words 0-1 and 2-3
            col = (chunk * coding.chunk + t4 * coding.values_per_lane) // kb
            out.append([P.e4m3_scale_to_bf16x2(scl[rows[r], col + h].to(Int32)) for h in range(2)])
        elif coding.ue8m0:
            e = scl[rows[r] // rb, (chunk * coding.chunk + t4 * coding.values_per_lane) // kb].to(Int32)
            v = (e + (120 if coding.element == "e4m3" else 126)) << 7
            out.append(v | (v << 16))
        else:
            out.append(scl[rows[r] // rb, chunk * coding.chunk // kb])
    return out


def activation_pairs(P: Any, coding: QuantCoding, xv: list, split_pairs: bool) -> list:
    """Per n-tile, the B fragments (register pairs) of the chunk's MMAs in the decode's K order. ``xv``: per n-tile the
    lane's activation words (2 bf16 each, memory order)."""
    out = []
    for words in xv:
        if coding.element == "e2m1":
            # word i of a weight row pairs values (8i + n, 8i + n + 4): activations (0, 4 | 1, 5), (2, 6 | 3, 7)
            frags = []
            for i in range(4):
                frags.append(P.pair_even_odd(words[4 * i], words[4 * i + 2]))
                frags.append(P.pair_even_odd(words[4 * i + 1], words[4 * i + 3]))
            out.append(frags)
        elif split_pairs:
            out.append([P.pair_even_odd(words[2 * i], words[2 * i + 1]) for i in range(4)])
        else:
            out.append([words[2 * i:2 * i + 2] for i in range(4)])
    return out


def chunk_mma(P: Any, coding: QuantCoding, acc: list, lo: list, hi: list, xb: list, sc: list, mt: int, nt_count: int,
              split_pairs: bool) -> None:
    """One chunk of m-tile ``mt``: decode the lane's words of rows g (``lo``) and g + 8 (``hi``), multiply with the
    activation fragments ``xb`` (:func:`activation_pairs`) and accumulate into ``acc`` (slot (mt x NT + nt) x 4 + q,
    q // 2 the row half). fp32 block scales: the chunk's sums start at zero and are scaled per row into ``acc``."""
    from cutlass import Float32, Int32

    ue = coding.scales_in_decode
    bias = Int32(E4M3_BIAS_MULT)
    m_lo = sc[2 * mt] if ue else bias
    m_hi = sc[2 * mt + 1] if ue else bias
    if coding.element == "e2m1":
        # word i -> pairs (0, 4), (1, 5), (2, 6), (3, 7): MMA 2i takes the first two, 2i + 1 the others; NVFP4:
        # words 0-1 and 2-3 have their own scale
        def mult(m, i):
            return m[i // 2] if coding.nvfp4 else m

        dec4 = P.e2m1x8_paired_to_bf16x2 if coding.paired else P.e2m1x8_to_bf16x2
        dl = [p for i in range(4) for p in _pairs2(dec4(lo[i], mult(m_lo, i)))]
        dh = [p for i in range(4) for p in _pairs2(dec4(hi[i], mult(m_hi, i)))]
    else:
        dec = P.e4m3x4_to_bf16x2_split if split_pairs else P.e4m3x4_to_bf16x2
        dl = [dec(lo[i], m_lo) for i in range(4)]
        dh = [dec(hi[i], m_hi) for i in range(4)]
    for nt in range(nt_count):
        base = (mt * nt_count + nt) * 4
        c = acc[base:base + 4] if ue else [Float32(0.0)] * 4
        for i in range(len(dl)):
            c = P.mma_bf16_16816([dl[i][0], dh[i][0], dl[i][1], dh[i][1]], xb[nt][i], c)
        for q in range(4):
            acc[base + q] = c[q] if ue else acc[base + q] + c[q] * sc[2 * mt + q // 2]


def _pairs2(four: list) -> list:
    """[p04, p15, p26, p37] -> [(p04, p15), (p26, p37)]: the A registers (K 2t, 2t + 1 | 2t + 8, 2t + 9) of two MMAs."""
    return [(four[0], four[1]), (four[2], four[3])]


__all__ = ["E4M3_BIAS_MULT", "NVFP4_LOG2_OFFSET", "NVFP4_UNDO", "QuantCoding", "activation_pairs", "chunk_mma",
           "chunk_scales"]
