"""CuTe DSL kernels run on the CPU through the PTX emulator (``ptx_emulator.py``): ``emulate_mma(monkeypatch)``
makes ``gemm_small_m.compile_mma`` hand back a callable that launches the kernel's sm_90a PTX in the emulator on CPU
tensors, so the public wrappers (``gemm_small_m``, ``gemm_fp8_mma``, ``gemm_q4_mma``) run end to end - argument
checks, config choice, the kernel - on this machine; ``emulate_experts`` and ``emulate_gemv`` do the same for
``moe_experts_mma`` and the GEMV. Each launch first binds its arguments to the real compiled kernel
(:func:`check_binding`).

The launch mirrors the kernel's host function (``MmaGemmKernel.__call__``): grid (min(tiles, cap), sk, 1), block
32 x wk, parameters (x, w, res, y, scl, n, m, tiles) packed as the PTX declares them.
"""

from __future__ import annotations

import torch

from ptx_emulator import Emulator, Memory, tensor_param


def sm90a_fresh_compiles(monkeypatch) -> None:
    """Compile for sm_90a with the disk tier off (a fresh compile keeps its PTX)."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.delenv("LS_KERNEL_CACHE_DIR", raising=False)


def check_binding(real_fn, *args) -> None:
    """The compiled kernel itself takes the call's arguments: as many as its signature names, less the stream (the
    call takes torch's current one) - a stream passed anyway would be a TypeError on the GPU. Where the TVM-FFI
    function is initialized on this machine, the call is made too: it binds every argument and then refuses argument
    #0's CPU device (in some processes of the full suite it is not initialized: the signature check stands alone)."""
    names = [n for n in real_fn.execution_args.get_kwargs_wrapper_spec().arg_names if n != "stream"]
    assert len(args) == len(names), f"the compiled kernel takes {names}, the wrapper passed {len(args)} arguments"
    try:
        real_fn(*args)
    except ValueError as e:
        assert "argument #0" in str(e), str(e)[:300]
        return
    except Exception as e:  # noqa: BLE001 - only the DSL's "not initialized" is expected here
        assert "not initialized" in str(e), f"{type(e).__name__}: {str(e)[:300]}"
        return
    raise AssertionError("the compiled kernel ran on CPU tensors?")


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

    def __init__(self, ptx: str, k: int, cfg, coding, real_fn=None):
        self.ptx, self.k, self.cfg, self.coding, self.real_fn = ptx, k, cfg, coding, real_fn

    def __call__(self, x, w, res, y, scl, cap) -> None:
        if self.real_fn is not None:
            check_binding(self.real_fn, x, w, res, y, scl, cap)
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
        return EmulatedMma(ptx, k, cfg, coding, fn)

    monkeypatch.setattr(gemm_small_m, "compile_mma", compile_emulated)
    monkeypatch.setattr(gemm_small_m, "grid_cap", lambda device, ctas_per_sm: 1 << 30 if ctas_per_sm <= 0 else
                        ctas_per_sm * 2)  # a 2-SM device: persistent CTAs walk several tiles


class EmulatedExpertsStage:
    """Stands in for ``moe_experts_mma.compile_stage``'s kernel: ``(x, w, scl, out, ids, sorted_ids, block_expert,
    num_padded, route_weights, global_scale, groups)`` (the stream is torch's current one); grid (tiles, groups),
    block 32 x wk, as
    ``MmaExpertsKernel.__call__``."""

    launches: list = []

    def __init__(self, ptx: str, st, cfg, real_fn=None):
        self.ptx, self.st, self.cfg, self.real_fn = ptx, st, cfg, real_fn

    def __call__(self, x, w, scl, out, ids, sorted_ids, block_expert, num_padded, route_weights, global_scale,
                 groups) -> None:
        if self.real_fn is not None:
            check_binding(self.real_fn, x, w, scl, out, ids, sorted_ids, block_expert, num_padded, route_weights,
                          global_scale, groups)
        mem = Memory()
        st, cfg = self.st, self.cfg
        tiles = st.rows // 2 // 16 if st.stage == "gate_up" else -(-st.rows // (16 * cfg.mt))
        ax, aw, asc = mem.put(x), mem.put(w), mem.put(scl)
        o = StridedRows(mem, out)
        a_ids, a_sorted, a_blk, a_np, a_w, a_gs = (mem.put(t) for t in (ids, sorted_ids, block_expert, num_padded,
                                                                         route_weights, global_scale))
        emu = Emulator(self.ptx, mem, smem_bytes=max(cfg.smem_bytes(), 16))
        emu.launch((tiles, groups, 1),
                   [tensor_param(ax, (x.shape[0],)), tensor_param(aw, (w.shape[0],)),
                    tensor_param(asc, (scl.shape[0],)),
                    o.param(), tensor_param(a_ids, (ids.shape[0],)), tensor_param(a_sorted, (sorted_ids.shape[0],)),
                    tensor_param(a_blk, (block_expert.shape[0],)), tensor_param(a_np),
                    tensor_param(a_w, (route_weights.shape[0],)), tensor_param(a_gs, (global_scale.shape[0],))],
                   block=(32 * cfg.wk, 1, 1))
        o.read_back()
        EmulatedExpertsStage.launches.append((st, cfg, groups, emu.steps))


def align_like_triton(ids: torch.Tensor, buf):
    """``triton_moe.moe_align``'s layout in torch: pairs grouped by expert (ascending, pairs in order), each run
    padded to ``block_m`` with the sentinel T; entries past ``num_padded`` filled with values that would address
    far outside any buffer (a kernel that reads them fails in the emulator)."""
    flat = ids.reshape(-1).tolist()
    T, bm = len(flat), buf.sizes.block_m
    sorted_ids, experts = [], []
    for e in sorted(set(flat)):
        run = [p for p, x in enumerate(flat) if x == e]
        run += [T] * (-len(run) % bm)
        sorted_ids += run
        experts += [e] * (len(run) // bm)
    buf.sorted_ids.fill_(1 << 30)
    buf.expert_ids.fill_(1 << 24)
    buf.sorted_ids[:len(sorted_ids)] = torch.tensor(sorted_ids, dtype=torch.int32)
    buf.expert_ids[:len(experts)] = torch.tensor(experts, dtype=torch.int32)
    buf.num_padded.fill_(len(sorted_ids))
    return buf


def route_sum_torch(yp: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
    """``triton_q4.route_sum`` in torch (fp32, routes in order)."""
    M, k = weights.shape
    acc = torch.zeros(M, yp.shape[1])
    for j in range(k):
        acc += weights[:, j:j + 1] * yp.view(M, k, -1)[:, j].float()
    out.copy_(acc.to(out.dtype))


def emulate_experts(monkeypatch) -> None:
    """Route ``moe_experts_mma``'s kernels to the emulator; its Triton helpers (align, route sum) to torch."""
    from latency_specialized.kernels import moe_experts_mma, triton_moe, triton_q4
    from latency_specialized.kernels.dsl_common import ptx_of

    sm90a_fresh_compiles(monkeypatch)
    real = moe_experts_mma.compile_stage

    def compile_emulated(st, cfg):
        fn = real(st, cfg)
        ptx = ptx_of(fn)
        assert ptx, "a fresh compile keeps its PTX (disk tier off)"
        return EmulatedExpertsStage(ptx, st, cfg, fn)

    monkeypatch.setattr(moe_experts_mma, "compile_stage", compile_emulated)
    monkeypatch.setattr(triton_moe, "moe_align", align_like_triton)
    monkeypatch.setattr(triton_q4, "route_sum", route_sum_torch)


class EmulatedGemv:
    """Stands in for ``gemm_gemv.compile_gemv``'s plain kernel or its norm prologue (no GLU or split): ``(x, w, res,
    y, cap, gain, eps)``; grid min(row groups, cap), block 32 x warps, as ``GemvKernel.__call__``. ``strided_x``: x
    takes a row stride (the norm prologue's x)."""

    def __init__(self, ptx: str, cfg, real_fn=None, strided_x: bool = False):
        self.ptx, self.cfg, self.real_fn, self.strided_x = ptx, cfg, real_fn, strided_x

    def __call__(self, x, w, res, y, cap, gain, eps) -> None:
        import struct

        if self.real_fn is not None:
            check_binding(self.real_fn, x, w, res, y, cap, gain, eps)
        mem = Memory()
        cfg = self.cfg
        n = w.shape[0]
        groups = -(-n // (cfg.warps // cfg.k_split * cfg.rows_per_warp))
        aw, ag = mem.put(w), mem.put(gain)
        xp = tensor_param(StridedRows(mem, x).addr, (), (x.stride(0),)) if self.strided_x else tensor_param(mem.put(x))
        out = StridedRows(mem, y)
        r = out if res is y else StridedRows(mem, res)
        emu = Emulator(self.ptx, mem)
        emu.launch((min(groups, cap), 1, 1), [xp, tensor_param(aw, (n,)), r.param(), out.param(), n,
                                              groups, tensor_param(ag), struct.pack("<f", eps)],
                   block=(32 * cfg.warps, 1, 1))
        out.read_back()


def emulate_gemv(monkeypatch) -> None:
    """Route ``gemm_gemv.compile_gemv`` (plain projections) to the emulator."""
    from latency_specialized.kernels import gemm_gemv
    from latency_specialized.kernels.dsl_common import ptx_of

    sm90a_fresh_compiles(monkeypatch)
    real = gemm_gemv.compile_gemv

    def compile_emulated(k, m, cfg, residual, out_fp32=False, glu=None, split=False, norm=False, norm_smem=False):
        if glu is not None or split:
            raise NotImplementedError("the plain GEMV and its norm prologue are emulated (no GLU, no split)")
        fn = real(k, m, cfg, residual, out_fp32=out_fp32, norm=norm, norm_smem=norm_smem)
        ptx = ptx_of(fn)
        assert ptx, "a fresh compile keeps its PTX (disk tier off)"
        return EmulatedGemv(ptx, cfg, fn, strided_x=norm)

    monkeypatch.setattr(gemm_gemv, "compile_gemv", compile_emulated)
    monkeypatch.setattr(gemm_gemv, "grid_cap", lambda device, ctas_per_sm: 1 << 30 if ctas_per_sm <= 0 else
                        ctas_per_sm * 2)
