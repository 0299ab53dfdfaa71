"""Host-side helpers shared by the CuTe DSL kernel modules (no cutlass import at module load)."""

from __future__ import annotations

from typing import Any

import torch


def cutlass_dtype(name: str) -> Any:
    """The cutlass numeric type of a torch dtype name ('bfloat16', 'float32', 'int64', ...)."""
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32,
            "int32": cutlass.Int32, "int64": cutlass.Int64}[name]


def dtype_name(t: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16 (hashable compile-cache key part)."""
    return str(t).removeprefix("torch.")


def compile_options(arch: str, maxrregcount: int = 0) -> str:
    """TVM-FFI compile for ``arch``, keeping the PTX (``ptx_of``) in a temp dump dir for the CPU tests' checks."""
    import os
    import tempfile

    dump = os.path.join(tempfile.gettempdir(), f"ls_kernels_ptx_{os.getpid()}")
    os.makedirs(dump, exist_ok=True)
    regs = f" --ptxas-options '-maxrregcount={maxrregcount}'" if maxrregcount else ""
    return f"--enable-tvm-ffi --gpu-arch {arch} --keep-ptx --dump-dir {dump}{regs}"


def ptx_of(compiled: Any) -> str | None:
    """The PTX of a fresh compile (None for one loaded from the disk cache)."""
    art = getattr(compiled, "artifacts", None)
    return getattr(art, "PTX", None) if art is not None else None


def sm90_dsl_support(ctx: Any) -> Any:
    """The checks every sm_90 CuTe DSL kernel's ``supports()`` starts with: the DSL is installed and
    the target is sm_90 or newer. True, or the reason (a contract.Support)."""
    from latency_specialized.kernels.compile_cache import cute_available

    ok = cute_available()
    if ok is not True:
        return ok
    if ctx.arch == "cpu" or not ctx.arch.startswith("sm_") or int(ctx.arch[3:5]) < 90:
        return f"needs sm_90+ (got {ctx.arch})"
    return True
