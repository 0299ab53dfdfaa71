"""prefetch.cutedsl_l2: warm the L2 with upcoming weights (``cp.async.bulk.prefetch.L2``).

A device table of (address, bytes) rows - built once per weight set, before graph capture - is
walked by a small grid: thread ``i`` of the grid issues one bulk prefetch per 16 KiB chunk
``i, i + threads, ...`` of every row. The instruction only asks the copy engine to pull the
bytes into L2; it returns at once and writes nothing, so the kernel finishes in ~2 us and the
bytes keep arriving while the main stream computes.

Use it from a side stream so it overlaps work on the main stream (communication gaps, the
attention kernel): :class:`L2Prefetcher` forks with an event from the current stream, launches
on its own stream and records a join event that the consumer waits on before reading the
weights - all of it graph-capturable (events become graph edges). Prefetching changes no values;
the family's reference is a no-op.

The L2 is 60 MB on an H200: prefetching more than ~half of it evicts what the main stream is
using; ``max_bytes`` caps each call (a prefix of each tensor, in table order).
"""

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.kernels import compile_cache

NAME = "prefetch.cutedsl_l2"
CHUNK = 16 * 1024  # bytes per cp.async.bulk.prefetch: large enough to be cheap to issue, small to spread
GRID = 32          # CTAs of 32 threads: the issuing is trivial, a few SMs suffice


@dataclass(frozen=True)
class PrefetchConfig:
    """How the prefetch kernel issues its requests (hashable: part of the compile key)."""

    grid: int = GRID
    """CTAs of 32 threads issuing the requests."""
    chunk: int = CHUNK
    """Bytes per request (bulk mode)."""
    mode: str = "bulk"
    """'bulk': cp.async.bulk.prefetch.L2 per chunk; 'lines': prefetch.global.L2::evict_last per 128 B."""
    evict_last: bool = False
    """bulk mode: attach an L2 evict_last cache policy, so the lines survive until they are used."""

    def label(self) -> str:
        return f"{self.mode}-g{self.grid}-c{self.chunk // 1024}k{'-el' if self.evict_last else ''}"


@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64
    from cutlass._mlir.dialects import llvm

    from latency_specialized.kernels.gemm_common import ptx

    P = ptx()

    def bulk_evict_last(addr, nbytes):
        llvm.inline_asm(None, [Int64(addr).ir_value(), Int32(nbytes).ir_value()],
                        "{\n .reg .b64 pol;\n createpolicy.fractional.L2::evict_last.b64 pol, 0f3F800000;\n"
                        " cp.async.bulk.prefetch.L2.global.L2::cache_hint [$0], $1, pol;\n}",
                        "l,r,~{memory}", has_side_effects=True, asm_dialect=0)

    def line(addr):
        llvm.inline_asm(None, [Int64(addr).ir_value()], "prefetch.global.L2::evict_last [$0];", "l,~{memory}",
                        has_side_effects=True, asm_dialect=0)

    class PrefetchKernel:
        def __init__(self, cfg: PrefetchConfig):
            self.cfg = cfg

        @cute.jit
        def __call__(self, table: cute.Tensor, stream):
            rows = table.shape[0]
            self.kernel(table, rows).launch(grid=[self.cfg.grid, 1, 1], block=[32, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, table: cute.Tensor, rows: Int32):
            cfg = self.cfg
            step: cutlass.Constexpr = cfg.grid * 32
            tid, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            me = bid * 32 + tid
            for r in range(rows):
                addr = table[r, 0]
                nbytes = table[r, 1]
                if cutlass.const_expr(cfg.mode == "lines"):
                    for c in range(me, Int32((nbytes + 127) // 128), step):
                        line(addr + Int64(c) * 128)
                else:
                    nchunks = Int32((nbytes + (cfg.chunk - 1)) // cfg.chunk)
                    for c in range(me, nchunks, step):
                        off = Int64(c) * cfg.chunk
                        size = cutlass.min(nbytes - off, Int64(cfg.chunk))
                        if cutlass.const_expr(cfg.evict_last):
                            bulk_evict_last(addr + off, Int32(size))
                        else:
                            P.prefetch_l2_bulk(addr + off, Int32(size))

    return PrefetchKernel


@compile_cache.compile_unit
def compile_prefetch(cfg: PrefetchConfig = PrefetchConfig()):
    def build(arch: str):
        import cutlass
        import cutlass.cute as cute

        from latency_specialized.kernels.gemm_common import compile_options, fake_rows, fake_stream

        t = fake_rows(cutlass.Int64, cute.sym_int(), 2, align=16)
        return cute.compile(_kernel_class()(cfg), t, fake_stream(), options=compile_options(arch))

    return compile_cache.cached_compile(NAME, (cfg.grid, cfg.chunk, cfg.mode, cfg.evict_last), build)


def build_table(tensors: Sequence[torch.Tensor], max_bytes: int | None = None) -> torch.Tensor:
    """The device table [rows, 2] int64 of (address, bytes) for ``tensors`` (capped at max_bytes total).

    Bytes are rounded down to 16 (the instruction's granularity); each tensor must be contiguous.
    Must run outside graph capture (it copies the table to the device).
    """
    if not tensors:
        raise UserError("prefetch: no tensors given")
    dev = tensors[0].device
    left = max_bytes if max_bytes is not None else None
    rows = []
    for t in tensors:
        if t.device != dev or not t.is_contiguous():
            raise UserError("prefetch: tensors must be contiguous and on one device: call .contiguous()")
        nb = t.numel() * t.element_size()
        if left is not None:
            nb = min(nb, left)
            left -= nb
        addr = t.data_ptr()
        if addr % 16:  # the bulk prefetch wants 16-byte aligned ranges: skip the unaligned head
            skip = 16 - addr % 16
            addr, nb = addr + skip, nb - skip
        nb -= nb % 16
        if nb > 0:
            rows.append((addr, nb))
        if left is not None and left <= 0:
            break
    if not rows:
        raise UserError("prefetch: nothing to prefetch (max_bytes too small?)")
    return torch.tensor(rows, dtype=torch.int64).to(dev)


@dataclass
class L2Prefetcher:
    """Prefetch a fixed weight set from a side stream, graph-capturable.

    >>> pf = L2Prefetcher([w_o, w_in], max_bytes=40 << 20)   # before capture
    >>> pf.start()          # fork: side stream waits for the current stream, launches the prefetch
    >>> ...main-stream work...
    >>> pf.join()           # the current stream waits for the prefetch kernel (not for the bytes)
    """

    tensors: Sequence[torch.Tensor]
    max_bytes: int | None = None
    config: PrefetchConfig = PrefetchConfig()

    def __post_init__(self) -> None:
        self.table = build_table(self.tensors, self.max_bytes)
        self.bytes = int(self.table[:, 1].sum().item())
        self.stream = torch.cuda.Stream(device=self.table.device)
        self._fork = torch.cuda.Event()
        self._join = torch.cuda.Event()
        self.fn = compile_prefetch(self.config)

    def start(self) -> None:
        cur = torch.cuda.current_stream(self.table.device)
        self._fork.record(cur)
        self.stream.wait_event(self._fork)
        with torch.cuda.stream(self.stream):
            self.fn(self.table)
        self._join.record(self.stream)

    def join(self) -> None:
        torch.cuda.current_stream(self.table.device).wait_event(self._join)


_TABLES: dict[tuple, torch.Tensor] = {}


def prefetch_l2_cute(tensors: Sequence[torch.Tensor], max_bytes: int | None = None) -> None:
    """Issue L2 prefetches of ``tensors`` on the *current* stream (family contract: ops/prefetch.py).

    The caller picks the stream (a side stream to overlap; see :class:`L2Prefetcher`). The table
    of a tensor set is built on the first (eager) call; building one during graph capture raises.
    """
    key = tuple((t.data_ptr(), t.numel() * t.element_size()) for t in tensors) + (max_bytes,)
    table = _TABLES.get(key)
    if table is None:
        if torch.cuda.is_current_stream_capturing():
            raise UserError("prefetch: this tensor set has no table yet; call prefetch_l2 once eagerly "
                            "(warm-up) before CUDA-graph capture")
        table = _TABLES[key] = build_table(tensors, max_bytes)
    compile_prefetch()(table)


def _supports(ctx: OpContext) -> Support:
    if not ctx.arch.startswith("sm_9") and not ctx.arch.startswith("sm_1"):
        return f"cp.async.bulk.prefetch needs sm_90+ (arch {ctx.arch})"
    return compile_cache.cute_available()


IMPLEMENTATIONS = [
    Implementation("prefetch", NAME, prefetch_l2_cute, _supports, priority=10,
                   description="CuTe DSL cp.async.bulk.prefetch.L2 over a device (address, bytes) table"),
]
