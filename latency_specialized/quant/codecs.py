"""Torch references of the element and scale encodings, and quantize / dequantize per format.

These are the *references* (fp32, on whatever device the tensors are): kernels that read quantized weights
are checked against :func:`dequantize`. Every function takes ``name`` (the tensor it works on) so that a bad
code in a checkpoint - a NaN ue8m0 (255), a NaN e4m3 scale, a non-finite fp32 scale - is a CheckpointError
naming that tensor.

e2m1 (FP4): sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; code -> value::

    0 0.0   1 0.5 (the subnormal)   2 1.0   3 1.5   4 2.0   5 3.0   6 4.0   7 6.0
    8 -0.0  9 -0.5  10 -1.0  11 -1.5  12 -2.0  13 -3.0  14 -4.0  15 -6.0

packed two per byte, the even element in the low nibble. ue8m0: a byte ``e`` means ``2**(e - 127)`` (0 ->
2^-127, 254 -> 2^127), 255 is NaN. e4m3 = ``torch.float8_e4m3fn`` (max 448, no inf, 0x7f / 0xff NaN).
"""

from __future__ import annotations

from typing import Literal

import torch

from latency_specialized.errors import CheckpointError, UserError
from latency_specialized.quant.formats import QuantFormat

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""e2m1 magnitudes by the low three bits of a code; bit 3 is the sign."""
E2M1_VALUES = (*E2M1, *(-v for v in E2M1))
"""Value of each of the 16 codes (code 8 is -0.0)."""
E2M1_MAX = 6.0
E4M3_MAX = 448.0
UE8M0_BIAS = 127
UE8M0_NAN = 255
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)
"""Midpoints whose upper neighbour has the even code (round half to even goes up there)."""

Ties = Literal["even", "down"]
"""Rounding of exact midpoints between two e2m1 magnitudes: 'even' (IEEE / the hardware's cvt.rn, ModelOpt
and vLLM's reference) or 'down' (towards the smaller magnitude: this project's MXFP4 writer since its first
version, kept so that existing checkpoints are written byte for byte as before). Only exact midpoints differ."""


# ------------------------------------------------------------------------------------------------ e2m1
def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 code values as fp32 ``[16]``."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A stored packed / e8m0 / e4m3 tensor as its raw uint8 bytes (a view; int8 and fp8/fp4 dtypes too)."""
    if t.dtype == torch.uint8:
        return t
    if t.element_size() != 1 or t.dtype == torch.bool:
        raise UserError(f"expected a one-byte tensor (uint8, int8, float8_*, float4_e2m1fn_x2), got {t.dtype}")
    return t.view(torch.uint8)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K/2]`` bytes -> ``[..., K]`` int64 codes; element 2i is the low nibble of byte i."""
    p = as_bytes(packed)
    # the nibbles split as bytes, widened once at the end (not two int64 halves and their stacked copy)
    return torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2).to(torch.int64)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` codes (0..15) -> ``[..., K/2]`` uint8, the even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise UserError(f"e2m1 packs two codes per byte: the last dimension must be even (got {codes.shape[-1]})")
    c = codes.to(torch.int64)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """int codes -> fp32 values (the exact table)."""
    return e2m1_table(codes.device)[codes.to(torch.int64)]


def e2m1_encode(x: torch.Tensor, ties: Ties = "even") -> torch.Tensor:
    """fp32 values (already divided by their scale) -> int64 codes: nearest magnitude, saturating at 6;
    negative values that round to zero get +0 (code 0), never -0."""
    ax = x.abs().float()
    mid = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    idx = torch.bucketize(ax, mid)                      # count of midpoints < |x|: ties go down
    if ties == "even":
        up = torch.zeros_like(ax, dtype=torch.bool)
        for m in _TIES_UP:
            up |= ax == m
        idx = idx + up.to(torch.int64)
    elif ties != "down":
        raise ValueError(f"ties {ties!r}: use 'even' or 'down'")
    return idx | (((x < 0) & (idx > 0)).to(torch.int64) << 3)


# ------------------------------------------------------------------------------------------------ scales
def ue8m0_decode(scale: torch.Tensor, name: str = "ue8m0 scale") -> torch.Tensor:
    """ue8m0 bytes (uint8 or float8_e8m0fnu) -> fp32 ``2**(e - 127)``; 255 (NaN) is a CheckpointError."""
    b = as_bytes(scale)
    bad = b == UE8M0_NAN
    if bool(bad.any()):
        where = [int(i) for i in bad.nonzero()[0]]
        raise CheckpointError(f"tensor {name}: ue8m0 scale 255 (NaN) at index {where} ({int(bad.sum())} of "
                              f"{b.numel()}): the checkpoint is corrupt or was written by a broken quantiser; "
                              "write it again")
    # the fp32 bit pattern, not exp2: a GPU exp2 of -127 is not exactly the subnormal 2^-127
    bits = (b.to(torch.int32) << 23).view(torch.float32)
    return torch.where(b == 0, torch.tensor(2.0 ** -127, device=b.device), bits)


def ue8m0_encode(exponent: torch.Tensor) -> torch.Tensor:
    """Integer-valued exponents in [-127, 127] -> uint8 ue8m0 bytes."""
    return (exponent + UE8M0_BIAS).to(torch.uint8)


def e4m3_decode(scale: torch.Tensor, name: str = "e4m3 scale") -> torch.Tensor:
    """float8_e4m3fn (or its bytes) -> fp32; a NaN code is a CheckpointError naming ``name``."""
    s = scale if scale.dtype == torch.float8_e4m3fn else as_bytes(scale).view(torch.float8_e4m3fn)
    f = s.to(torch.float32)
    bad = torch.isnan(f)
    if bool(bad.any()):
        where = [int(i) for i in bad.nonzero()[0]]
        raise CheckpointError(f"tensor {name}: float8_e4m3fn scale NaN at index {where} ({int(bad.sum())} of "
                              f"{f.numel()}): the checkpoint is corrupt or was written by a broken quantiser; "
                              "write it again")
    return f


def fp32_scale_decode(scale: torch.Tensor, name: str = "fp32 scale") -> torch.Tensor:
    """A stored float scale -> fp32; NaN or inf is a CheckpointError naming ``name``."""
    if not scale.is_floating_point():
        raise CheckpointError(f"tensor {name}: a float32 scale, got dtype {scale.dtype}")
    f = scale.to(torch.float32)
    bad = ~torch.isfinite(f)
    if bool(bad.any()):
        raise CheckpointError(f"tensor {name}: {int(bad.sum())} non-finite scale value(s) (NaN / inf) of "
                              f"{f.numel()}: the checkpoint is corrupt; write it again")
    return f


def _check_finite(w: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(w).all()):
        raise UserError(f"cannot quantize {name}: it holds NaN or inf")


def _expand_blocks(scale: torch.Tensor, block: tuple[int, int], N: int, K: int) -> torch.Tensor:
    """``[..., ceil(N/r), ceil(K/c)]`` -> ``[..., N, K]`` (each scale over its block; edge blocks cropped)."""
    r, c = block
    return scale.repeat_interleave(r, -2)[..., :N, :].repeat_interleave(c, -1)[..., :K]


# ------------------------------------------------------------------------------------------------ MXFP4
def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, *, block: int = 32,
                     name: str = "MXFP4 weight_scale") -> torch.Tensor:
    """``[..., N, K/2]`` packed codes + ``[..., N, K/32]`` ue8m0 exponents -> ``[..., N, K]`` fp32."""
    vals = e2m1_decode(unpack_e2m1(packed))
    s = ue8m0_decode(scale, name)
    return (vals.view(*vals.shape[:-1], -1, block) * s.unsqueeze(-1)).flatten(-2)


def mxfp4_quantize(w: torch.Tensor, *, block: int = 32, ties: Ties = "down",
                   name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., N, K]`` float -> (codes ``[..., N, K/2]`` uint8, ue8m0 scales ``[..., N, K/32]`` uint8), OCP MX rules.

    Scale exponent per 32 values: floor(log2(amax)) - 2 (e2m1's largest exponent), clamped to [-127, 127];
    values rounded to the nearest e2m1 magnitude (saturating at 6; ``ties``: see :data:`Ties`)."""
    if w.shape[-1] % block:
        raise CheckpointError(f"MXFP4 needs the input width divisible by {block} (got {w.shape[-1]})")
    _check_finite(w, name)
    g = w.float().reshape(*w.shape[:-1], -1, block)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126)
    e = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    codes = e2m1_encode(g / torch.exp2(e), ties).flatten(-2)
    return pack_e2m1(codes), ue8m0_encode(e.squeeze(-1))


# ------------------------------------------------------------------------------------------------ NVFP4
def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """ModelOpt's ``weight_scale_2``: amax / (6 * 448) as fp32 (1.0 for an all-zero tensor)."""
    amax = w.detach().abs().amax().float()
    return torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))


def nvfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, *, block: int = 16,
                     name: str = "NVFP4 weight") -> torch.Tensor:
    """``[..., N, K/2]`` codes, ``[..., N, K/16]`` e4m3 scales, fp32 global (``[]`` or ``[...]``) -> fp32
    ``[..., N, K]``: value = e2m1 * (e4m3 * global), the order of vLLM's ``dequantize_to_dtype``."""
    vals = e2m1_decode(unpack_e2m1(packed))
    g = fp32_scale_decode(global_scale, name + "_scale_2")
    s = e4m3_decode(scale, name + "_scale") * g.reshape(*g.shape, 1, 1)
    return (vals.view(*vals.shape[:-1], -1, block) * s.unsqueeze(-1)).flatten(-2)


def nvfp4_quantize(w: torch.Tensor, global_scale: torch.Tensor | None = None, *, block: int = 16,
                   ties: Ties = "even", name: str = "weight") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[..., N, K]`` float -> (codes ``[..., N, K/2]`` uint8, e4m3 scales ``[..., N, K/16]``, fp32 global ``[]``).

    ModelOpt's recipe: global = amax / 2688 (:func:`nvfp4_global_scale`), block scale = e4m3(block amax / 6 /
    global) (<= 448 by construction), codes = e2m1(w / (scale * global)), saturating; a block whose scale
    rounds to 0 stores zeros."""
    if w.shape[-1] % block:
        raise CheckpointError(f"NVFP4 needs the input width divisible by {block} (got {w.shape[-1]})")
    _check_finite(w, name)
    gs = nvfp4_global_scale(w) if global_scale is None else global_scale.float()
    g = w.float().reshape(*w.shape[:-1], -1, block)
    bscale = (g.abs().amax(-1) / E2M1_MAX / gs).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    eff = bscale.float() * gs
    x = torch.where(eff.unsqueeze(-1) > 0, g / eff.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).tiny),
                    torch.zeros_like(g))
    codes = e2m1_encode(x, ties).flatten(-2)
    return pack_e2m1(codes), bscale, gs.reshape(())


# ------------------------------------------------------------------------------------------------ FP8 blocks
def fp8_block_dequantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128), *,
                         encoding: Literal["fp32", "ue8m0"] = "fp32", name: str = "FP8 weight") -> torch.Tensor:
    """``w [..., N, K]`` float8_e4m3fn with ``scale [..., ceil(N/r), ceil(K/c)]`` (fp32 multipliers, or ue8m0
    bytes) -> fp32 ``[..., N, K]``; edge blocks are partial."""
    if w.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"tensor {name}: a block-scaled FP8 weight must be float8_e4m3fn, got {w.dtype}")
    s = ue8m0_decode(scale, name + " scale") if encoding == "ue8m0" else fp32_scale_decode(scale, name + " scale")
    N, K = w.shape[-2:]
    return w.float() * _expand_blocks(s, block, N, K)


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128), *,
                       encoding: Literal["fp32", "ue8m0"] = "fp32",
                       name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> (float8_e4m3fn ``[..., N, K]``, scales ``[..., ceil(N/r), ceil(K/c)]``).

    fp32: scale = block amax / 448 (amax clamped to 1e-12; DeepSeek-V3's and models/glm53's writer).
    ue8m0: scale = 2**ceil(log2(amax / 448)), the smallest power of two that keeps the block <= 448
    (DeepSeek's ``scale_fmt='ue8m0'`` rounding), stored as uint8 exponents."""
    _check_finite(w, name)
    r, c = block
    *lead, N, K = w.shape
    nb, kb = -(-N // r), -(-K // c)
    x = torch.nn.functional.pad(w.float(), (0, kb * c - K, 0, nb * r - N)).reshape(*lead, nb, r, kb, c)
    amax = x.abs().amax((-3, -1))
    if encoding == "ue8m0":
        e = torch.ceil(torch.log2(amax.clamp_min(2.0 ** -126) / E4M3_MAX)).clamp(-127, 127)
        scale_f, stored = torch.exp2(e), ue8m0_encode(e)
    elif encoding == "fp32":
        scale_f = amax.clamp_min(1e-12) / E4M3_MAX
        stored = scale_f
    else:
        raise ValueError(f"encoding {encoding!r}: use 'fp32' or 'ue8m0'")
    q = (x / scale_f[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    q = q.reshape(*lead, nb * r, kb * c)[..., :N, :K].to(torch.float8_e4m3fn)
    return q, stored


# ------------------------------------------------------------------------------------------------ by format
PAIRED_SLOTS = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (14, 13, 11, 10))
"""The paired layout: where value j (j = 0..3) of a 16-bit half puts its code's bits (sign, e1, e0, m). Value 0's
bits sit where a bf16 wants an e2m1 value x 2^-126 (sign 15, magnitude 8-6: one mask), values 1 and 2 three and six
places lower (a shift and that mask), value 3 in the four bits left (three shifts): ``ptx.e2m1x8_paired_to_bf16x2``.
Both halves of a 32-bit word alike, so value j and j + 4 decode together as one bf16x2 pair."""


def _rearrange_words(codes: torch.Tensor, moves) -> torch.Tensor:
    """``codes`` (one-byte tensor, rows of whole 32-bit words) with each word's bits moved by ``moves`` ((from, to)
    bit pairs), in slices of ~4M words (int64 temporaries: an expert stack is gigabytes); same shape and dtype."""
    b = as_bytes(codes)
    if b.shape[-1] % 4:
        raise UserError(f"packed e2m1 codes of {b.shape[-1]} bytes a row: the paired layout rearranges whole 32-bit "
                        "words (8 values), so rows need a multiple of 4 bytes")
    flat = b.contiguous().view(-1, 4)
    out = torch.empty_like(flat)
    step = 1 << 22
    for lo in range(0, flat.shape[0], step):
        w = flat[lo:lo + step].to(torch.int64)
        w = w[:, 0] | (w[:, 1] << 8) | (w[:, 2] << 16) | (w[:, 3] << 24)
        r = torch.zeros_like(w)
        for src, dst in moves:
            r |= ((w >> src) & 1) << dst
        out[lo:lo + step] = torch.stack([(r >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)
    return out.view(b.shape).view(codes.dtype)


def _paired_moves() -> list[tuple[int, int]]:
    """(checkpoint bit, paired bit) of every bit of a word: value j of half h, code bit (sign, e1, e0, m)."""
    return [(h + 4 * j + bit, h + pos) for h in (0, 16) for j, slots in enumerate(PAIRED_SLOTS)
            for bit, pos in zip((3, 2, 1, 0), slots)]


def pair_codes(codes: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 codes (``[..., K/2]`` bytes, low nibble first) rearranged within each 32-bit word into the paired
    layout (``PAIRED_SLOTS``); same shape and dtype. A bijection: :func:`unpair_codes` undoes it."""
    return _rearrange_words(codes, _paired_moves())


def unpair_codes(codes: torch.Tensor) -> torch.Tensor:
    """The checkpoint's packing (low nibble first) of codes in the paired layout: the inverse of :func:`pair_codes`."""
    return _rearrange_words(codes, [(dst, src) for src, dst in _paired_moves()])


def dequantize(fmt: QuantFormat | str, weight: torch.Tensor, scale: torch.Tensor,
               global_scale: torch.Tensor | None = None, *, name: str = "weight") -> torch.Tensor:
    """The fp32 ``[..., N, K]`` of one stored weight of ``fmt`` (tensors as stored, any one-byte dtype; e2m1 codes in
    either packing)."""
    f = QuantFormat.get(fmt)
    if f.packing == "paired":
        weight = unpair_codes(weight)
    if f.element == "e2m1" and f.scale == "ue8m0":
        return mxfp4_dequantize(weight, scale, block=f.block[1], name=f"{name} ({f.suffix('scale')})")
    if f.element == "e2m1" and f.scale == "e4m3":
        if global_scale is None:
            raise CheckpointError(f"tensor {name}: {f.name} needs its global scale ({f.suffix('global_scale')})")
        return nvfp4_dequantize(weight, scale, global_scale, block=f.block[1], name=name)
    if f.element == "e4m3":
        return fp8_block_dequantize(weight, scale, f.block, encoding=f.scale, name=name)  # type: ignore[arg-type]
    raise NotImplementedError(f"no codec for {f}")


def quantize(fmt: QuantFormat | str, w: torch.Tensor, *, name: str = "weight",
             ties: Ties | None = None) -> dict[str, torch.Tensor]:
    """Role -> stored tensor (in the format's stored dtypes) of ``w [..., N, K]``; NVFP4's ``input_scale``
    is not a property of the weight and is left to :func:`~latency_specialized.quant.checkpoint_io.quantize_named`."""
    f = QuantFormat.get(fmt)
    f.check_shape(tuple(w.shape), name)
    if f.element == "e2m1" and f.scale == "ue8m0":
        q, s = mxfp4_quantize(w, block=f.block[1], ties=ties or "down", name=name)
        return {"weight": q.view(f.weight_dtype), "scale": s.view(f.scale_dtype)}
    if f.element == "e2m1" and f.scale == "e4m3":
        lead = tuple(w.shape[:-2])
        if lead:  # one global scale per matrix (ModelOpt stores experts one by one)
            flat = w.reshape(-1, *w.shape[-2:])
            parts = [nvfp4_quantize(m, block=f.block[1], ties=ties or "even", name=name) for m in flat]
            q = torch.stack([p[0] for p in parts]).reshape(*lead, *parts[0][0].shape)
            s = torch.stack([p[1] for p in parts]).reshape(*lead, *parts[0][1].shape)
            g = torch.stack([p[2] for p in parts]).reshape(lead)
        else:
            q, s, g = nvfp4_quantize(w, block=f.block[1], ties=ties or "even", name=name)
        return {"weight": q.view(f.weight_dtype), "scale": s, "global_scale": g}
    if f.element == "e4m3":
        q, s = fp8_block_quantize(w, f.block, encoding=f.scale, name=name)  # type: ignore[arg-type]
        return {"weight": q, "scale": s.view(f.scale_dtype) if f.scale == "ue8m0" else s.to(f.scale_dtype)}
    raise NotImplementedError(f"no codec for {f}")


__all__ = ["E2M1", "E2M1_VALUES", "E2M1_MAX", "E4M3_MAX", "UE8M0_BIAS", "UE8M0_NAN", "Ties", "e2m1_table",
           "as_bytes", "unpack_e2m1", "pack_e2m1", "e2m1_decode", "e2m1_encode", "ue8m0_decode", "ue8m0_encode",
           "e4m3_decode", "fp32_scale_decode", "mxfp4_dequantize", "mxfp4_quantize", "nvfp4_global_scale",
           "nvfp4_dequantize", "nvfp4_quantize", "fp8_block_dequantize", "fp8_block_quantize", "dequantize",
           "quantize", "PAIRED_SLOTS", "pair_codes", "unpair_codes"]
