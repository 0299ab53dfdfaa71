"""The mma.sync kernel family run on the CPU through the PTX emulator (``ptx_emulator.py``): ``emulate_mma(monkeypatch)``
makes ``gemm_small_m.compile_mma`` hand back a callable that launches the kernel's sm_90a PTX in the emulator on CPU
tensors, so the public wrappers (``gemm_small_m``, ``gemm_fp8_mma``, ``gemm_q4_mma``) run end to end - argument
checks, config choice, the kernel - on this machine.

The launch mirrors the kernel's host function (``MmaGemmKernel.__call__``): grid (min(tiles, cap), sk, 1), block
32 x wk, parameters (x, w, res, y, scl, n, m, tiles) packed as the PTX declares them.
"""

from __future__ import annotations

import os

import torch

from ptx_emulator import Emulator, Memory, tensor_param


def sm90a_fresh_compiles(monkeypatch) -> None:
    """Compile for sm_90a with the disk tier off (a fresh compile keeps its PTX)."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.delenv("LS_KERNEL_CACHE_DIR", raising=False)
    os.environ.pop("LS_KERNEL_CACHE_DIR", None)


class StridedRows:
    """A [rows, cols] view with unit column stride placed in emulator memory over its whole row span (so a column
    slice of a wider tensor keeps its row stride), read back into the view after a launch."""

    def __init__(self, mem: Memory, t: torch.Tensor):
        assert t.dim() == 2 and t.stride(1) == 1, "rows with unit column stride"
        self.t = t
        rows, cols = t.shape
        self.span = (rows - 1) * t.stride(0) + cols if rows else 0
        flat = torch.as_strided(t, (self.span,), (1,)) if rows else t.reshape(-1)
        self.addr = mem.put(flat)
        self.mem = mem

    def param(self) -> bytes:
        return tensor_param(self.addr, tuple(self.t.shape), (self.t.stride(0),))

    def read_back(self) -> None:
        if not self.span:
            return
        flat = torch.empty(self.span, dtype=self.t.dtype)
        flat.copy_(self.mem.tensor(self.addr, flat))
        rows, cols = self.t.shape
        self.t.copy_(torch.as_strided(flat, (rows, cols), (self.t.stride(0), 1)))


class EmulatedMma:
    """Stands in for a compiled mma kernel: ``(x, w, res, y, scl, cap)`` as ``run_mma`` / ``run_quantized_mma``
    call it."""

    launches: list = []

    def __init__(self, ptx: str, k: int, cfg, coding):
        self.ptx, self.k, self.cfg, self.coding = ptx, k, cfg, coding

    def __call__(self, x, w, res, y, scl, cap) -> None:
        mem = Memory()
        m, n = x.shape[0], w.shape[0]
        rows = 16 * self.cfg.mt
        tiles = -(-n // rows)
        ax, aw = mem.put(x), mem.put(w)
        out = StridedRows(mem, y)
        r = out if res is y else StridedRows(mem, res)
        if self.coding is None:
            s_param = tensor_param(ax, (m,))
        else:
            s = scl.contiguous()
            s_param = tensor_param(mem.put(s), tuple(s.shape), (s.shape[1],))
        emu = Emulator(self.ptx, mem, smem_bytes=max(self.cfg.smem_bytes(), 16))
        emu.launch((min(tiles, cap), self.cfg.sk, 1),
                   [tensor_param(ax, (m,)), tensor_param(aw, (n,)), r.param(), out.param(), s_param, n, m, tiles],
                   block=(32 * self.cfg.wk, 1, 1))
        out.read_back()
        EmulatedMma.launches.append((self.k, self.cfg, self.coding, emu.steps))


def emulate_mma(monkeypatch) -> None:
    """Route ``compile_mma`` (and the wrappers that imported it) to the emulator; tensors stay on the CPU."""
    from latency_specialized.kernels import gemm_small_m
    from latency_specialized.kernels.dsl_common import ptx_of

    sm90a_fresh_compiles(monkeypatch)
    real = gemm_small_m.compile_mma

    def compile_emulated(k, cfg, residual, out_fp32=False, coding=None):
        if cfg.sk != 1:
            raise NotImplementedError("cluster launches (sk > 1) are not emulated")
        fn = real(k, cfg, residual, out_fp32=out_fp32, coding=coding)
        ptx = ptx_of(fn)
        assert ptx, "a fresh compile keeps its PTX (disk tier off)"
        return EmulatedMma(ptx, k, cfg, coding)

    monkeypatch.setattr(gemm_small_m, "compile_mma", compile_emulated)
    monkeypatch.setattr(gemm_small_m, "grid_cap", lambda device, ctas_per_sm: 1 << 30 if ctas_per_sm <= 0 else
                        ctas_per_sm * 2)  # a 2-SM device: persistent CTAs walk several tiles
