"""Bit-level emulation of the mma kernel's register work for the CPU tests: PTX ``prmt`` and bf16 bit patterns as
Python ints / floats (a bf16 x bf16 product by a power of two is exact, so a float product stands for
``mul.rn.bf16x2``)."""

from __future__ import annotations

import struct

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def prmt(a: int, b: int, sel: int) -> int:
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(pool[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def bf16(bits: int) -> float:
    """The value of the bf16 in the low 16 bits of ``bits``."""
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def e2m1(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1_VALUES[code & 7]


def decode_e2m1_word(word: int, mult_bits: int) -> list[tuple[float, float]]:
    """``ptx.e2m1x8_to_bf16x2`` step by step: the pairs (values 0, 4), (1, 5), (2, 6), (3, 7), each (low, high)."""
    u = 0xFFFFFFFF
    pairs = [((word * 4096) & u & 0x80008000) | (((word & 0x00070007) * 64) & u),
             ((word * 256) & u & 0x80008000) | (((word & 0x00700070) * 4) & u),
             ((word * 16) & u & 0x80008000) | ((word & 0x07000700) >> 2),
             (word & 0x80008000) | ((word & 0x70007000) >> 6)]
    m = bf16(mult_bits)
    return [(bf16(p) * m, bf16(p >> 16) * m) for p in pairs]
