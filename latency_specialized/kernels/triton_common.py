"""What every Triton kernel's ``supports()`` checks first: a CUDA arch (tensor cores where the kernel dots),
Triton installed, an activation dtype it handles. Each kernel then checks its own shapes."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from typing import Any

import torch

from latency_specialized.contract import OpContext
from latency_specialized.errors import UserError
from latency_specialized.hardware import capability

DTYPES = ("bfloat16", "float16", "float32")


def arch_number(arch: str) -> int | None:
    """``sm_90a`` -> 90; None for a non-CUDA arch (``cpu``)."""
    m = re.match(r"sm_(\d+)", arch)
    return int(m.group(1)) if m else None


def triton_gpu_refusal(ctx: OpContext, serves: str, *, min_sm: int | None = None) -> str | None:
    """The reason this Triton kernel cannot serve ``ctx`` on grounds every Triton kernel shares, or None.

    ``serves``: what the reference serves instead (named in the CPU refusal); ``min_sm``: the oldest arch
    (80 for kernels with bf16 ``tl.dot``)."""
    n = arch_number(ctx.arch)
    if n is None:
        return (f"a Triton kernel for CUDA GPUs (CUDA-graph capturable); on {ctx.arch} the reference serves "
                f"{serves}")
    if min_sm is not None and n < min_sm:
        return f"needs bf16 tensor cores (sm_{min_sm}+), got {ctx.arch}"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if ctx.dtype not in DTYPES:
        return f"dtype {ctx.dtype} (bf16/fp16/fp32 only)"
    return None


def quantized_weight_refusal(ctx: OpContext, name: str, formats: tuple[str, ...], what: str, *,
                             min_sm: int | None = None, kind: str = "weights") -> str | None:
    """The reason a Triton kernel over weights kept as stored (``formats``; ``what`` they are, e.g. 'block-FP8';
    ``kind``: what it computes over them, for the messages) cannot serve ``ctx`` on the grounds they all share (arch,
    the site's ``weight_format``, bf16 activations), or None."""
    why = triton_gpu_refusal(ctx, f"the {kind} (dequantising)", min_sm=min_sm)
    if why:
        return why
    fmt = ctx.attr("weight_format")
    if fmt not in formats:
        return f"weights {fmt or 'bf16'}: {name} reads {what} {kind} ({', '.join(formats)})"
    if ctx.dtype != "bfloat16":
        return f"dtype {ctx.dtype} (bf16 activations only)"
    return None


def quantized_experts_refusal(ctx: OpContext, name: str, formats: tuple[str, ...], what: str, *,
                              min_sm: int | None = None) -> str | None:
    """:func:`quantized_weight_refusal` of a routed-experts kernel, which also needs a SiTU-GLU / SwiGLU site."""
    why = quantized_weight_refusal(ctx, name, formats, what, min_sm=min_sm, kind="experts")
    if why:
        return why
    if ctx.attr("activation") not in ("situ_glu", "swiglu"):
        return f"activation {ctx.attr('activation')} (SiTU-GLU or SwiGLU only)"
    return None


def head_dim_refusal(D: int, lo: int, hi: int) -> str | None:
    """The reason a kernel whose tiles span the head (``tl.arange`` widths) cannot take head dim ``D``, or None."""
    if D < lo or D > hi or D & (D - 1):
        return f"head_dim {D} is not a power of two in [{lo}, {hi}]"
    return None


@functools.cache
def triton_has_gdc() -> bool:
    """Triton's grid dependency control (``tl.extra.cuda.gdc_wait`` / ``gdc_launch_dependents``) and its
    ``launch_pdl`` launch option (Triton >= 3.3): what programmatic dependent launch needs."""
    try:
        import triton.language.extra.cuda as tlc
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return (hasattr(tlc, "gdc_wait") and hasattr(tlc, "gdc_launch_dependents")
            and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}))


def interpreting() -> bool:
    """Whether Triton runs kernels under its interpreter (``TRITON_INTERPRET`` set)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pdl_available(device: Any) -> bool:
    """Whether a Triton kernel can launch on ``device`` with programmatic dependent launch: compiled (not the
    interpreter), an sm_90+ CUDA GPU and a Triton with grid dependency control. Each kernel's switch (``PDL``,
    ``MERGE_PDL``, ...) comes on top."""
    if interpreting() or device.type != "cuda":
        return False
    return capability(device)[0] >= 9 and triton_has_gdc()


def pdl_launch(on: bool) -> dict[str, bool]:
    """Triton's launch keyword for PDL where ``on`` (nothing otherwise: older Triton has no ``launch_pdl``)."""
    return {"launch_pdl": True} if on else {}


_ZEROED: dict[tuple, torch.Tensor] = {}


def cached_zeroed_int32(owner: str, shape: tuple[int, ...], device: torch.device,
                        refuse_in_capture: str | None = None) -> torch.Tensor:
    """A zeroed int32 tensor of ``shape`` cached per (``owner``, shape, device): the counters / workspace of a kernel
    whose every call leaves them zeroed again, so graph replays need no memset. Made under a CUDA-graph capture, the
    zeroing is a node of that graph and the tensor lives in its pool: returned, not cached - or, where the kernel
    wants one tensor for the process (``refuse_in_capture``, the fix to name), a ``UserError``. One tensor must not
    serve two calls running at once on different streams."""
    key = (owner, tuple(shape), str(device))
    t = _ZEROED.get(key)
    if t is None:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing and refuse_in_capture is not None:
            raise UserError(f"{owner}: {refuse_in_capture}")
        t = torch.zeros(shape, dtype=torch.int32, device=device)
        if not capturing:
            _ZEROED[key] = t
    return t


__all__ = ["DTYPES", "arch_number", "cached_zeroed_int32", "head_dim_refusal", "interpreting", "pdl_available",
           "pdl_launch", "quantized_experts_refusal", "quantized_weight_refusal", "triton_gpu_refusal", "triton_has_gdc"]
