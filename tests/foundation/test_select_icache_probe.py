"""The cold-code probe's kernels (``benchmarks/scripts/select_icache_probe.py``) build for sm_90 on the CPU: the big one
holds every distinct FMA of its straight-line code in the PTX, the small one a loop - so a device call does not find
out first."""

from __future__ import annotations

import pytest

from tests.script_loader import load_script

triton = pytest.importorskip("triton")

probe = load_script("benchmarks/scripts/select_icache_probe.py")


def test_probe_kernels_build_for_hopper():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    big, loop, asm, n = probe._kernels(4)
    assert n == 256 and len(set(asm.splitlines()[1:])) == n   # distinct constants: nothing to fold
    target = GPUTarget("cuda", 90, 32)
    ptx = triton.compile(ASTSource(fn=big, signature={"x": "*fp32", "ASM": "constexpr", "BLOCK": "constexpr"},
                                   constexprs={"ASM": asm, "BLOCK": 128}), target=target,
                         options=dict(num_warps=4)).asm["ptx"]
    assert ptx.count("fma.rn.f32") >= n
    ptx = triton.compile(ASTSource(fn=loop, signature={"x": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                                   constexprs={"BLOCK": 128}), target=target, options=dict(num_warps=4)).asm["ptx"]
    assert "bra" in ptx and ptx.count("fma.rn.f32") < 16   # a loop, not unrolled code
