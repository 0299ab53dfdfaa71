"""Triton kernels compiled for the H200 (sm_90) on a machine without a GPU: the launches a CPU run makes are
recorded instead of run, then each is compiled with the argument types and constexprs it was launched with.

    with recorded_launches() as launches:
        stock.step()                     # kernel[grid](...) calls record, outputs stay as allocated
    problems = compile_for_hopper(launches)   # {kernel name + constexprs: "CompilationError: ..."}

What it catches before any GPU run: type errors the interpreter lets through (a name bound to tiles of two
shapes in the branches of an ``if``), non-power-of-two ``tl.arange`` widths, constexpr misuse. What it cannot:
resource limits at run time and numerics (the interpreter cases and the GPU tests check those). Outputs of
recorded launches are never written, so only code whose later steps accept arbitrary values may run under it."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
           torch.int64: "i64", torch.int16: "i16", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1",
           torch.float8_e4m3fn: "fp8e4nv"}
_OPTIONS = ("num_warps", "num_stages")


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[tuple[Any, tuple, dict]]]:
    """``kernel[grid](*args, **kw)`` records ``(kernel, args, kw)`` instead of launching, inside the block."""
    from triton.runtime.jit import JITFunction

    launches: list[tuple[Any, tuple, dict]] = []
    original = JITFunction.__getitem__

    def getitem(self, grid):
        return lambda *args, **kw: launches.append((self, args, kw))

    JITFunction.__getitem__ = getitem
    try:
        yield launches
    finally:
        JITFunction.__getitem__ = original


def _signature(fn: Any, args: tuple, kw: dict) -> tuple[dict[str, str], dict[str, Any]]:
    """(signature, constexprs) of a recorded launch, unspecialized (every argument generic)."""
    sig, const, _ = _launch_signature(fn, args, kw, specialize=False)
    return sig, const


def _launch_signature(fn: Any, args: tuple, kw: dict, specialize: bool
                      ) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int], list]]:
    """(signature, constexprs, attrs); ``specialize``: the attributes a real launch gets from its argument values
    (Triton's JIT marks 16-byte-aligned pointers and integers divisible by 16 ``tt.divisibility`` 16 and makes an
    integer 1 a constant) - what decides vectorized, ``cp.async``-pipelined loads."""
    values = dict(zip((p.name for p in fn.params), args))
    values.update({k: v for k, v in kw.items() if k not in _OPTIONS})
    sig: dict[str, str] = {}
    const: dict[str, Any] = {}
    attrs: dict[tuple[int], list] = {}
    for i, p in enumerate(fn.params):
        v = values[p.name] if p.name in values else (p.default if p.has_default else None)
        if p.is_constexpr or v is None or not isinstance(v, (torch.Tensor, bool, int, float)):
            sig[p.name], const[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _DTYPES[v.dtype]
            if specialize and v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            if specialize and v == 1:
                sig[p.name], const[p.name] = "constexpr", 1
                continue
            sig[p.name] = "i64" if abs(v) >= 2 ** 31 else "i32"
            if specialize and v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p.name] = "fp32"
    return sig, const, attrs


def compile_for_hopper(launches: list[tuple[Any, tuple, dict]], *, specialize: bool = True) -> dict[str, str]:
    """Each distinct (kernel, constexprs) of ``launches`` compiled for sm_90; returns the failures by
    ``"kernel {constexprs}"`` (empty: every one compiled)."""
    problems: dict[str, str] = {}
    for key, got in _compiled(launches, specialize).items():
        if isinstance(got, Exception):
            problems[key] = f"{type(got).__name__}: {got}"
    return problems


def ptx_for_hopper(launches: list[tuple[Any, tuple, dict]], *, specialize: bool = True) -> dict[str, str]:
    """``"kernel {constexprs}"`` -> its sm_90 PTX, for each distinct launch (a compile failure raises): what a
    test reads to check the instructions a path uses (``wgmma`` and its operand types, ``cp.async`` pipelining);
    specialized on the launch's argument values as the JIT would (``_signature``)."""
    out: dict[str, str] = {}
    for key, got in _compiled(launches, specialize).items():
        if isinstance(got, Exception):
            raise AssertionError(f"{key}: {type(got).__name__}: {got}") from got
        out[key] = got
    return out


def resource_usage(launches: list[tuple[Any, tuple, dict]]) -> dict[str, tuple[int, int]]:
    """``"kernel {constexprs}"`` -> (registers per thread, stack bytes) of its sm_90 cubin, as the JIT would build it
    (specialized), read by the ``cuobjdump`` Triton ships: a stack frame means spilled registers."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out: dict[str, tuple[int, int]] = {}
    for key, got in _compiled(launches, True, asm="cubin").items():
        if isinstance(got, Exception):
            raise AssertionError(f"{key}: {type(got).__name__}: {got}") from got
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(got)
            f.flush()
            text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                  check=True).stdout
        m = re.search(r"REG:(\d+).*?STACK:(\d+)", text, re.S)
        assert m, text[-500:]
        out[key] = (int(m.group(1)), int(m.group(2)))
    return out


def _compiled(launches: list[tuple[Any, tuple, dict]], specialize: bool, asm: str = "ptx") -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    done: dict[str, Any] = {}
    for fn, args, kw in launches:
        sig, const, attrs = _launch_signature(fn, args, kw, specialize)
        key = f"{fn.fn.__name__} {const}"
        if key in done:
            continue
        try:
            done[key] = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                                       target=GPUTarget("cuda", 90, 32),
                                       options={k: kw[k] for k in _OPTIONS if k in kw}).asm[asm]
        except Exception as e:  # noqa: BLE001 - reported per kernel
            done[key] = e
    return done


__all__ = ["recorded_launches", "compile_for_hopper", "ptx_for_hopper"]
