"""Quantized-weight formats as the official checkpoints store them: one frozen description per format.

A format says how a logical weight ``[..., N, K]`` (``N`` output rows, ``K`` the reduction dimension) is
stored: the element encoding, the block of values that share one scale, the scale's encoding, an optional
per-tensor global scale, the packing of sub-byte elements, and the tensor names and dtypes the checkpoint
uses. Every value dequantises as a multiplication (no format here divides)::

    mxfp4          w = e2m1(code) * 2**(ue8m0 - 127)                     scale per 1x32 along K
    nvfp4          w = e2m1(code) * float(e4m3 scale) * weight_scale_2   scale per 1x16 along K, fp32 global
    fp8-block-128  w = e4m3(w) * weight_scale_inv                        fp32 scale per 128x128 block
    fp8-block-32   w = e4m3(w) * 2**(ue8m0 - 127)                        ue8m0 scale per 32x32 block

(``weight_scale_inv`` is DeepSeek-V3's name for a multiplier: the quantiser divided by it.)

``FORMATS`` is the registry by name; ``QuantFormat.get(name)`` looks one up (a UserError listing the names
when unknown). The codecs are in :mod:`latency_specialized.quant.codecs`, the name <-> tensor mapping and
whole-checkpoint helpers in :mod:`latency_specialized.quant.checkpoint_io`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch

from latency_specialized.errors import UserError

Element = Literal["e2m1", "e4m3"]
"""Element encoding: e2m1 (FP4, two per byte, low nibble = even element) or e4m3 (float8_e4m3fn)."""
ScaleEncoding = Literal["ue8m0", "e4m3", "fp32"]
"""Block-scale encoding: ue8m0 (a biased power-of-two exponent, 255 = NaN), float8_e4m3fn or float32."""
Role = Literal["weight", "scale", "global_scale", "input_scale"]
"""The stored tensors of one quantized weight."""


PAIRED_SUFFIX = "/pairs"
"""Name suffix of the paired-layout format derived from an e2m1 one (``quant.layout.paired_nibbles``)."""


@dataclass(frozen=True)
class QuantFormat:
    """How one quantized weight is stored (frozen: a hashable cache key for kernels and plans)."""

    name: str
    """Registry name ('mxfp4', 'nvfp4', 'fp8-block-128', ...)."""
    element: Element
    block: tuple[int, int]
    """(rows, cols) of the values sharing one scale: rows along N, cols along K; (1, 32) = 32 along K."""
    scale: ScaleEncoding
    suffixes: tuple[tuple[Role, str], ...]
    """Role -> tensor-name suffix replacing the ``weight`` of ``<base>.weight``."""
    weight_dtype: torch.dtype
    """dtype of the stored elements as written (packed e2m1: uint8 or float4_e2m1fn_x2; e4m3: float8_e4m3fn)."""
    scale_dtype: torch.dtype
    """dtype of the stored block scales as written (ue8m0: uint8 or float8_e8m0fnu)."""
    partial_blocks: bool
    """True: N and K need not be multiples of the block (the scale grid is ceil(N/rows) x ceil(K/cols))."""
    models: tuple[str, ...]
    """Which models' official checkpoints use it (and for which weights)."""
    source: str
    """Where the layout was checked."""
    packing: Literal["low-first", "paired"] = "low-first"
    """e2m1 codes within each 32-bit word: as the checkpoints store them (value n of the word's 8 in bits 4n..4n+3),
    or rearranged for the mma kernels' decode (``quant.codecs.pair_codes``; the derived ``<name>/pairs`` formats of
    ``quant.layout.paired_nibbles``)."""

    # ------------------------------------------------------------------------------------------- derived
    @property
    def packed(self) -> bool:
        """Two e2m1 codes per byte, low nibble first (element 2i in bits 0-3, 2i+1 in bits 4-7)."""
        return self.element == "e2m1"

    @property
    def global_scale(self) -> bool:
        """A per-tensor fp32 multiplier (NVFP4 ``weight_scale_2``)."""
        return any(r == "global_scale" for r, _ in self.suffixes)

    @property
    def input_scale(self) -> bool:
        """A stored per-tensor activation scale (NVFP4 ``input_scale``; kept, not used to dequantise)."""
        return any(r == "input_scale" for r, _ in self.suffixes)

    def suffix(self, role: Role) -> str | None:
        """Tensor-name suffix of ``role`` (None: this format stores no such tensor)."""
        return dict(self.suffixes).get(role)

    def check_shape(self, shape: tuple[int, ...], what: str = "weight") -> None:
        """UserError unless a logical ``[..., N, K]`` weight can be stored in this format."""
        if len(shape) < 2:
            raise UserError(f"{what}: {self.name} stores matrices [..., N, K]; got shape {list(shape)}")
        rows, cols = self.block
        N, K = shape[-2], shape[-1]
        if self.partial_blocks:
            return
        if K % cols or N % rows:
            raise UserError(f"{what}: {self.name} needs N divisible by {rows} and K (the input width) divisible by "
                            f"{cols}; got shape {list(shape)}")

    def stored_shapes(self, shape: tuple[int, ...]) -> dict[Role, tuple[int, ...]]:
        """Role -> stored shape for a logical weight ``[..., N, K]`` (checked by :meth:`check_shape`)."""
        shape = tuple(int(s) for s in shape)
        self.check_shape(shape)
        lead, (N, K) = shape[:-2], shape[-2:]
        rows, cols = self.block
        out: dict[Role, tuple[int, ...]] = {
            "weight": (*lead, N, K // 2) if self.packed else shape,
            "scale": (*lead, math.ceil(N / rows), math.ceil(K / cols)),
        }
        if self.global_scale:
            out["global_scale"] = lead
        if self.input_scale:
            out["input_scale"] = lead
        return out

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes the stored tensors of a ``shape`` weight occupy (the roofline's quantized bytes)."""
        sizes = {"weight": 1, "scale": 4 if self.scale == "fp32" else 1, "global_scale": 4, "input_scale": 4}
        return sum(math.prod(s) * sizes[r] for r, s in self.stored_shapes(shape).items())

    def bits_per_value(self) -> float:
        """Stored bits per weight value, scales included (MXFP4 4.25, NVFP4 4.5, FP8-128 ~8.002)."""
        rows, cols = self.block
        scale_bits = 32 if self.scale == "fp32" else 8
        return (4 if self.packed else 8) + scale_bits / (rows * cols)

    @classmethod
    def get(cls, name: "str | QuantFormat") -> "QuantFormat":
        """The registered format ``name`` (a QuantFormat passes through); UserError listing the names."""
        if isinstance(name, QuantFormat):
            return name
        base, paired = (name[:-len(PAIRED_SUFFIX)], True) if name.endswith(PAIRED_SUFFIX) else (name, False)
        try:
            f = FORMATS[base]
        except KeyError:
            raise UserError(f"unknown quantized format {name!r}: use one of {', '.join(FORMATS)} (e2m1 ones also "
                            f"with {PAIRED_SUFFIX})") from None
        return f.paired() if paired else f

    @property
    def pairable(self) -> bool:
        """e2m1 codes as checkpoints pack them: what :meth:`paired` rearranges."""
        return self.element == "e2m1" and self.packing == "low-first"

    def paired(self) -> "QuantFormat":
        """The derived ``<name>/pairs`` format: e2m1 codes rearranged within each 32-bit word (``packing``); the one
        place it is built (``get``, ``quant.layout.paired_nibbles``). UserError for a format that is not
        :attr:`pairable`."""
        if not self.pairable:
            raise UserError(f"{self.name}: the paired layout rearranges e2m1 codes as checkpoints pack them; "
                            f"{self.name} is not that (not e2m1, or paired already)")
        return replace(self, name=self.name + PAIRED_SUFFIX, packing="paired")

    def checkpoint_packing(self) -> "QuantFormat":
        """The format :meth:`paired` derived this one from (itself if it is not paired)."""
        if self.packing != "paired":
            return self
        return replace(self, name=self.name[:-len(PAIRED_SUFFIX)], packing="low-first")


MXFP4 = QuantFormat(
    name="mxfp4", element="e2m1", block=(1, 32), scale="ue8m0",
    suffixes=(("weight", "weight_packed"), ("scale", "weight_scale")),
    weight_dtype=torch.uint8, scale_dtype=torch.uint8, partial_blocks=False,
    models=("kimi_k3: routed experts (compressed-tensors 'mxfp4-pack-quantized')",),
    source="compressed-tensors mxfp4-pack-quantized: weight_packed uint8 [N, K/2] low nibble first, weight_scale "
           "uint8 ue8m0 [N, K/32]; vLLM 0.33 Mxfp4MoEMethod (uint8 / float8_e8m0fnu scales viewed as bytes)")
"""OCP MX FP4 in the compressed-tensors layout (Kimi K3's routed experts)."""

MXFP4_DEEPSEEK = QuantFormat(
    name="mxfp4-deepseek", element="e2m1", block=(1, 32), scale="ue8m0",
    suffixes=(("weight", "weight"), ("scale", "scale")),
    weight_dtype=torch.float4_e2m1fn_x2, scale_dtype=torch.float8_e8m0fnu, partial_blocks=False,
    models=("deepseek_v41_flash: routed experts (expert_dtype 'fp4')",),
    source="vLLM 0.33 models/deepseek_v41: experts.{e}.w{1,2,3}.scale -> w*_weight_scale (Mxfp4MoEMethod), "
           "float8_e8m0fnu scales viewed as uint8; packed bytes viewed as float4_e2m1fn_x2 (mono runner). The "
           "element dtype of the released files (float4_e2m1fn_x2 vs int8/uint8) was not checked against a real "
           "header: loading accepts all three")
"""The same MX FP4 numerics in DeepSeek-V4.1's own names: ``<base>.weight`` packed + ``<base>.scale`` e8m0."""

NVFP4 = QuantFormat(
    name="nvfp4", element="e2m1", block=(1, 16), scale="e4m3",
    suffixes=(("weight", "weight"), ("scale", "weight_scale"), ("global_scale", "weight_scale_2"),
              ("input_scale", "input_scale")),
    weight_dtype=torch.uint8, scale_dtype=torch.float8_e4m3fn, partial_blocks=False,
    models=("muse_spark: the NVFP4 release (ModelOpt)",),
    source="vLLM 0.33 quantization/modelopt.py KNvfp4Static / ModelOptNvFp4FusedMoE: weight uint8 [N, K/2], "
           "weight_scale float8_e4m3fn [N, K/16], weight_scale_2 fp32 per tensor (amax/2688, a multiplier: "
           "'no reciprocation'), input_scale fp32 per tensor; utils/nvfp4_emulation_utils.py dequantize_to_dtype "
           "(value = e2m1 * (e4m3 * global), low nibble first)")
"""NVIDIA NVFP4 in the ModelOpt layout (Muse Spark's NVFP4 release)."""

FP8_BLOCK_128 = QuantFormat(
    name="fp8-block-128", element="e4m3", block=(128, 128), scale="fp32",
    suffixes=(("weight", "weight"), ("scale", "weight_scale_inv")),
    weight_dtype=torch.float8_e4m3fn, scale_dtype=torch.float32, partial_blocks=True,
    models=("glm53: every quantized linear and expert (quantization_config fp8, weight_block_size [128, 128])",),
    source="DeepSeek-V3 / GLM-5.3 layout: weight float8_e4m3fn [N, K], weight_scale_inv fp32 "
           "[ceil(N/128), ceil(K/128)], value = fp8 * scale (models/glm53/names.py, vLLM Fp8Config block_quant)")
"""FP8 e4m3 with fp32 128x128 block scales (GLM-5.3, DeepSeek-V3)."""

FP8_BLOCK_32 = QuantFormat(
    name="fp8-block-32", element="e4m3", block=(32, 32), scale="ue8m0",
    suffixes=(("weight", "weight"), ("scale", "scale")),
    weight_dtype=torch.float8_e4m3fn, scale_dtype=torch.float8_e8m0fnu, partial_blocks=True,
    models=("deepseek_v41_flash: dense linears (attention, shared experts) of the FP4-expert release",),
    source="vLLM 0.33 models/deepseek_v41/quant_config.py: weight_block_size [32, 32] with is_scale_e8m0 "
           "(expert_dtype 'fp4') -> ModelOptLinearMethod KMxfp8Static, scales [N/32, K/32] float8_e8m0fnu "
           "(repeat_interleave'd over rows at load); checkpoint name '<base>.scale' (WeightsMapper '\\.scale$')")
"""FP8 e4m3 with ue8m0 32x32 block scales (DeepSeek-V4.1-Flash dense weights)."""

FORMATS: dict[str, QuantFormat] = {f.name: f for f in (MXFP4, MXFP4_DEEPSEEK, NVFP4, FP8_BLOCK_128, FP8_BLOCK_32)}
"""Registry by name."""

FORMAT_FAMILIES: dict[str, tuple[str, ...]] = {
    "mxfp4": ("mxfp4", "mxfp4-deepseek"),
    "nvfp4": ("nvfp4",),
    "fp8-block": ("fp8-block-128", "fp8-block-32"),
}
"""The ``make-checkpoint --quant`` families -> the concrete formats; an adapter picks its model's."""

__all__ = ["Element", "ScaleEncoding", "Role", "QuantFormat", "FORMATS", "FORMAT_FAMILIES", "MXFP4", "MXFP4_DEEPSEEK",
           "NVFP4", "FP8_BLOCK_128", "FP8_BLOCK_32"]
