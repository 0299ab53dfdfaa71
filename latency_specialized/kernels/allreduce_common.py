"""Host side shared by the fused all-reduce kernels: config, supports(), crossover, launch wrapper.

Imports no cutlass: the kernel modules build their ``IMPLEMENTATIONS`` from this on any machine,
and the DSL device code (``allreduce_device.py``) is imported only when a kernel is compiled.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from latency_specialized.contract import OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.kernels import allreduce_layout as L
from latency_specialized.kernels.compile_cache import cached_compile, cute_available

MAX_THREADS = 1024
MAX_WORLD = 8
"""One NVLink domain of H200s (8 GPUs); unicast stores to more peers than that are not planned."""

ONE_SHOT_LIMIT_BYTES: dict[int, int | None] = {2: None, 4: 512 * 1024, 8: 256 * 1024}
"""Largest per-rank message (M x N x bytes) the one-shot kernel serves, by world size (<= key).

* TP=2: always one-shot (None): one hop moving the same bytes beats two hops. Measured here
  too: with the ranks as streams of one H200, one-shot is faster at every M = 1..64
  (benchmarks/results/h200/allreduce_single_gpu_ipc.md).
* TP<=4: 512 KiB, TP<=8: 256 KiB - the NVLink switch points of vLLM's custom all-reduce
  (csrc/custom_all_reduce.cuh), whose one-shot / two-stage kernels move the same bytes per rank
  as ours. Our own TP=4/8 measurement cannot set these: on one GPU every rank's (W-1) x message
  of one-shot stores lands in the same HBM, which makes two-stage win from M=1 there - an
  artifact of sharing one GPU, not an NVLink property. Re-measure on a multi-GPU machine.
"""


@dataclass(frozen=True)
class FusedAllReduceConfig:
    """Static shape of one compiled fused all-reduce kernel (the compile-cache key)."""

    dtype: str
    """'bfloat16' or 'float32'."""
    n: int
    """Row width N (elements)."""
    world_size: int
    """Ranks W."""
    has_norm: bool = True
    """False: only the residual add (weight None)."""

    @property
    def is_bf16(self) -> bool:
        return self.dtype == "bfloat16"

    @property
    def row_words(self) -> int:
        return L.words_per_row(self.n, self.dtype)

    @property
    def vecs(self) -> int:
        """128-bit vectors per row."""
        return self.row_words // L.VEC_WORDS

    @property
    def threads_and_vpt(self) -> tuple[int, int]:
        """(threads per CTA, vectors per thread): one CTA per row, the most threads that divide the row.

        More threads per row = more 16-byte loads/stores in flight per SM, which is what a
        latency-bound exchange needs; a row split exactly avoids per-vector predicates.
        """
        for vpt in range(1, self.vecs + 1):
            t = self.vecs // vpt
            if self.vecs % vpt == 0 and t <= MAX_THREADS and t % 32 == 0:
                return t, vpt
        t = min(MAX_THREADS, -(-self.vecs // 32) * 32)
        return t, -(-self.vecs // t)

    @property
    def exact(self) -> bool:
        t, v = self.threads_and_vpt
        return t * v == self.vecs


def config_problem(dtype: str, n: int, world_size: int) -> str | None:
    """Why the fused kernels cannot serve this shape, or None."""
    if world_size < 2:
        return "world size 1: nothing to all-reduce (the residual+norm path serves)"
    if world_size > MAX_WORLD:
        return f"world size {world_size} > {MAX_WORLD}: unicast Lamport stores are planned for one NVLink domain"
    return L.layout_problem(n, dtype, world_size)


def one_shot_limit(world_size: int) -> int | None:
    """Bytes limit of the one-shot kernel at ``world_size`` (None: no limit)."""
    for w in sorted(ONE_SHOT_LIMIT_BYTES):
        if world_size <= w:
            return ONE_SHOT_LIMIT_BYTES[w]
    return ONE_SHOT_LIMIT_BYTES[max(ONE_SHOT_LIMIT_BYTES)]


def _kb(b: int) -> str:
    return f"{b / 1024:.0f} KiB"


def make_supports(kind: str) -> Callable[[OpContext], Support]:
    """supports(ctx) of the one-shot ('one_shot') or two-stage ('two_stage') implementation."""
    # why each communicator kind (latency_specialized.comm.kinds; kernels do not import comm) cannot
    # carry the kernels' peer stores; a context without ``comm`` is planned for the symmetric one
    comm_refusals = {
        "torch.distributed": "communicator torch.distributed has no peer-mapped workspace: the kernels need the "
                             "symmetric-memory communicator (CUDA IPC, ranks on one host), which a program builds "
                             "over its process group when the plan is made for it (build_plan's default on GPUs)",
        "symmetric-memory-emulated": "the symmetric-memory workspace is host memory (/dev/shm, the CPU emulation of "
                                     "the protocol): the kernels store into CUDA IPC memory",
        "local": "communicator local (one rank): no peer-mapped workspace and nothing to exchange",
        "excluded": "communication excluded (one-GPU bench): no peers, no peer-mapped workspace",
    }

    def supports(ctx: OpContext) -> Support:
        if ctx.arch == "cpu" or not ctx.arch.startswith("sm_"):
            return ("needs the symmetric-memory communicator (CUDA IPC) on an sm_90+ GPU; on CPU the "
                    "torch.distributed communicator + reference serve")
        try:
            major = int(ctx.arch[3:].rstrip("af"))
        except ValueError:
            return f"unknown arch {ctx.arch}"
        if major < 90:
            return f"{ctx.arch}: needs sm_90+ (system-scope relaxed 128-bit loads/stores)"
        comm = ctx.attr("comm")
        if comm not in (None, "symmetric-memory"):
            return comm_refusals.get(comm, f"communicator {comm} has no peer-mapped workspace: the kernels need "
                                           "the symmetric-memory communicator (CUDA IPC)")
        try:
            n = ctx.dim("N")
        except KeyError:
            return "site has no N"
        problem = config_problem(ctx.dtype, n, ctx.world_size)
        if problem:
            return problem
        ok = cute_available()
        if ok is not True:
            return ok
        msg = L.message_bytes(ctx.tokens, n, ctx.dtype)
        limit = one_shot_limit(ctx.world_size)
        if limit is None:
            if kind == "two_stage":
                return f"TP={ctx.world_size}: one-shot moves the same bytes in one hop at every size: one-shot serves"
            return True
        if kind == "one_shot" and msg > limit:
            return f"message {_kb(msg)} > one-shot limit {_kb(limit)} at TP={ctx.world_size}: two-stage serves"
        if kind == "two_stage" and msg <= limit:
            return f"message {_kb(msg)} <= one-shot limit {_kb(limit)} at TP={ctx.world_size}: one-shot serves"
        return True

    return supports


def _words(t: torch.Tensor) -> torch.Tensor:
    """int32 view of a contiguous, 16-byte aligned activation tensor (copied if it is not)."""
    t = t.contiguous()
    if t.data_ptr() % 16:  # a fresh allocation is 256-byte aligned
        t = t.clone()
    return t.view(torch.int32)


KERNEL_DIR_ENV = "LS_ALLREDUCE_KERNEL_DIR"
"""Directory of exported kernel objects shared by the processes of one machine (optional).

Every rank process would otherwise compile the same kernels (seconds each); with this set, the
first process to compile a kernel exports it (``export_to_c``) and the others load the object
(about 1 ms). File names carry the config, the arch and a hash of the kernel sources.
"""

_SOURCES = ("allreduce_device.py", "allreduce_lamport.py", "allreduce_two_stage.py", "allreduce_layout.py")


def _sources_hash() -> str:
    """Hash of everything that shapes the compiled code (not this module's host-only parts)."""
    import inspect

    h = hashlib.sha1()
    here = Path(__file__).parent
    for name in _SOURCES:
        h.update((here / name).read_bytes())
    for obj in (FusedAllReduceConfig, fake_args, compile_with):
        h.update(inspect.getsource(obj).encode())
    return h.hexdigest()[:12]


def object_path(directory: str, kernel_name: str, cfg: FusedAllReduceConfig, arch: str) -> tuple[Path, str]:
    """(object file, symbol) of the exported kernel for ``cfg`` in ``directory`` (names carry the sources hash)."""
    symbol = (f"{kernel_name.replace('.', '_')}_{cfg.dtype}_n{cfg.n}_w{cfg.world_size}"
              f"_norm{int(cfg.has_norm)}_{arch}")
    return Path(directory) / f"{symbol}_{_sources_hash()}.o", symbol


def get_kernel(kernel_name: str, build: Callable[[FusedAllReduceConfig, str], Any], cfg: FusedAllReduceConfig):
    """The compiled kernel for ``cfg``: in-memory cache, then $LS_ALLREDUCE_KERNEL_DIR, then compile."""

    def build_or_load(arch: str):
        directory = os.environ.get(KERNEL_DIR_ENV)
        if not directory:
            return build(cfg, arch)
        import cutlass.cute as cute

        path, symbol = object_path(directory, kernel_name, cfg, arch)
        path.parent.mkdir(parents=True, exist_ok=True)  # a fresh machine: the first rank creates it
        if path.exists():
            try:
                return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), symbol)
            except Exception as e:  # noqa: BLE001 - e.g. an object from another tvm-ffi build: recompile
                import sys

                print(f"{kernel_name}: cannot load {path.name} ({type(e).__name__}: {e}); compiling",
                      file=sys.stderr)
        fn = build(cfg, arch)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.o")
        fn.export_to_c(str(tmp), function_name=symbol)
        os.replace(tmp, path)  # atomic: a concurrent reader sees no partial object
        return fn

    return cached_compile(kernel_name, (cfg,), build_or_load)


def launch(kernel_name: str, build: Callable[[FusedAllReduceConfig, str], Any], partial: torch.Tensor,
           residual: torch.Tensor, weight: torch.Tensor | None, eps: float, comm: Any,
           zero_centered: bool, out: tuple[torch.Tensor, torch.Tensor] | None = None
           ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Check, compile (cached) and launch a fused all-reduce kernel on the current stream.

    Parameters
    ----------
    partial : [M, N] this rank's partial sum (bf16 or fp32, CUDA).
    residual : [M, N] residual stream (same on every rank).
    weight : [N] norm gain, or None for residual add only (returns (None, residual_out)).
    comm : SymmetricMemoryCommunicator built for (N, dtype, max_tokens >= M).
    out : optional (normed, residual_out) destinations [M, N], contiguous, like ``partial``
        (normed ignored without weight).

    Returns
    -------
    (normed [M, N], residual_out [M, N]) in partial.dtype, bit-identical on every rank.
    """
    if not isinstance(comm, L.PeerWorkspace):  # the raw buffers a SymmetricMemoryCommunicator holds
        raise UserError(f"{kernel_name} needs a SymmetricMemoryCommunicator (got {type(comm).__name__}): build "
                        f"one with SymmetricMemoryCommunicator(group, hidden=N, dtype=..., max_tokens=...)")
    if comm.device.type != "cuda":
        raise UserError(f"{kernel_name} runs on CUDA: the CPU workspace is for latency_specialized.comm.emulation")
    comm.check_call(partial, residual, weight)
    cfg = FusedAllReduceConfig(comm.dtype, comm.hidden, comm.world_size, weight is not None)
    fn = get_kernel(kernel_name, build, cfg)
    if out is not None:
        normed, res_out = out
        if normed is None:  # (None, residual_out): the add-only form, or a normed output not wanted in place
            normed = torch.empty_like(partial) if weight is not None else res_out
        for t in (normed, res_out):
            if t.shape != partial.shape or t.dtype != partial.dtype or not t.is_contiguous() or t.data_ptr() % 16:
                raise UserError(f"out tensors must be contiguous, 16-byte aligned {tuple(partial.shape)} "
                                f"{partial.dtype} (got {tuple(t.shape)} {t.dtype})")
    else:
        res_out = torch.empty_like(partial)
        normed = torch.empty_like(partial) if weight is not None else res_out
    w = _words(weight) if weight is not None else _words(partial)[0]  # unused when has_norm is False
    fn(_words(partial), _words(residual), w, normed.view(torch.int32), res_out.view(torch.int32),
       comm.peer_ptrs, comm.flags, comm.buffer, comm.rank, comm.slot_words, float(eps), 1.0 if zero_centered else 0.0)
    return (normed if weight is not None else None), res_out


def fake_args(cfg: FusedAllReduceConfig):
    """Fake tensors/scalars matching ``launch``'s call, for compiling without a GPU."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    m = cute.sym_int()
    nw = cfg.row_words
    # row-major [M, Nw] (the default stride order of compact fakes is column-major)
    act = [make_fake_compact_tensor(cutlass.Int32, (m, nw), stride_order=(1, 0), assumed_align=16) for _ in range(2)]
    weight = make_fake_compact_tensor(cutlass.Int32, (nw,), assumed_align=16)
    outs = [make_fake_compact_tensor(cutlass.Int32, (m, nw), stride_order=(1, 0), assumed_align=16) for _ in range(2)]
    peers = make_fake_compact_tensor(cutlass.Int64, (cfg.world_size,), assumed_align=8)
    flags = make_fake_compact_tensor(cutlass.Int32, (L.FLAG_WORDS,), assumed_align=16)
    buf = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=16)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return (*act, weight, *outs, peers, flags, buf, cutlass.Int32(0), cutlass.Int32(4), cutlass.Float32(1e-5),
            cutlass.Float32(0.0), stream)


def compile_with(kernel_obj: Any, cfg: FusedAllReduceConfig, arch: str, extra_options: str = ""):
    """cute.compile a kernel object for ``arch`` with TVM-FFI (stream = torch's current stream)."""
    import cutlass.cute as cute

    return cute.compile(kernel_obj, *fake_args(cfg), options=f"--enable-tvm-ffi --gpu-arch {arch} {extra_options}")


def entry_points(kernel_name: str, kernel_class: Callable[[], type]):
    """``(build, compile_for, prepare)`` of a fused all-reduce kernel module, from its lazily defined
    kernel class: ``build(cfg, arch)`` for the compile cache; ``compile_for(cfg, arch, extra_options)``
    compiles without a GPU (CPU CI), uncached, returning the TVM-FFI function (``extra_options=
    "--keep-ptx"`` keeps its PTX in ``__ptx__``); ``prepare(ctx)`` compiles (or loads) the kernel of a
    plan site before graph capture."""

    def build(cfg: FusedAllReduceConfig, arch: str):
        return compile_with(kernel_class()(cfg), cfg, arch)

    def compile_for(cfg: FusedAllReduceConfig, arch: str = "sm_90a", extra_options: str = ""):
        return compile_with(kernel_class()(cfg), cfg, arch, extra_options)

    def prepare(ctx: OpContext):
        return get_kernel(kernel_name, build, FusedAllReduceConfig(ctx.dtype, ctx.dim("N"), ctx.world_size,
                                                                    bool(ctx.attr("norm", True))))

    return build, compile_for, prepare
