"""A small harness for piece tests: a piece's sites bound to the registry's choices, one StepContext.

Independent of the generic program (``runtime/composed.py``) on purpose: a piece test drives the piece
through the protocol alone (``pieces_api``), so a bug in the program cannot hide one in a piece.

* :func:`bind` plans the piece's sites (the registry picks, as ``build_plan`` does, and the real
  ``Plan.skipped_sites`` rule decides what is not called) and returns a :class:`BoundRefs`;
* :func:`random_weights` draws checkpoint-level weights from a piece's declarations;
* :func:`shard` keeps a rank's slice of one declared weight (``split`` / ``parts``), written here
  from the declaration's documented meaning (not the program's sharding code);
* :func:`run_residual` drives a residual piece around a few layers of stand-in sublayers;
* :class:`ThreadWorld` runs one function per rank in threads with a communicator whose collectives
  meet at barriers (rank-order fp32 sums): TP > 1 on one process, no gloo.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Callable, Mapping, Sequence

import torch

from latency_specialized import hardware
from latency_specialized.comm.base import LocalCommunicator
from latency_specialized.ops.plan import Plan, SiteChoice
from latency_specialized.ops.registry import ImplementationRegistry
from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.plugins import get_registry
from latency_specialized.runtime.pieces_api import StepContext, WeightDecl
from latency_specialized.spec import ModelSpec, ParallelSpec

NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
"""max|got - want| / max|want| bounds of the piece tests (fp32: summation order; bf16: roundings)."""


class BoundRefs:
    """BoundOps over a plan of some sites (counts calls per site)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.skipped = plan.skipped_sites()
        self.strided_rows = frozenset(c.site.name for c in plan.choices if c.impl and c.impl.strided_rows)
        self.strided_out = frozenset(c.site.name for c in plan.choices if c.impl and c.impl.strided_out)
        self.calls: Counter[str] = Counter()
        self._fns = {c.site.name: plan.impl(c.site.name) for c in plan.choices}

    def __getitem__(self, site: str) -> Callable[..., Any]:
        fn = self._fns[site]

        def call(*args: Any, **kw: Any) -> Any:
            self.calls[site] += 1
            return fn(*args, **kw)

        return call

    def communicate(self, site: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        self.calls[site] += 1
        return fn(*args, **kw)


def site_list(fill: Callable[[SiteBuilder], None], *, dtype: torch.dtype, rows: int, tp: int = 1,
              prefix: str = "kind", layers: tuple[int, ...] = (0,)):
    b = SiteBuilder("cpu", NAMES[dtype], rows, tp)
    b.prefix, b.layers = prefix, layers
    fill(b)
    return b.sites


def bind(fill: Callable[[SiteBuilder], None], *, dtype: torch.dtype, rows: int, tp: int = 1, prefix: str = "kind",
         registry: ImplementationRegistry | None = None) -> BoundRefs:
    """Sites added by ``fill(b)`` planned on the CPU (the registry's best choice each) and bound."""
    reg = registry or get_registry().implementations
    choices = []
    for site in site_list(fill, dtype=dtype, rows=rows, tp=tp, prefix=prefix):
        impl, refusals = reg.select(site.ctx)
        choices.append(SiteChoice(site, impl, tuple(refusals)))
    plan = Plan("piece-test", "tiny", hardware.for_arch("cpu"), ParallelSpec(tp=tp), rows, rows, rows, NAMES[dtype],
                choices)
    return BoundRefs(plan)


def step_context(ops: BoundRefs, spec: ModelSpec, *, rows: int, meta: Mapping[str, torch.Tensor] | None = None,
                 tp: int = 1, rank: int = 0, comm: Any = None, prefix: str = "kind", layer: int = 0,
                 scratch: dict[str, torch.Tensor] | None = None) -> StepContext:
    return StepContext(ops=ops, meta=dict(meta or {}), rows=rows, comm=comm or LocalCommunicator(), tp=tp,
                       rank=rank, spec=spec, rank_spec=spec.shard(tp) if tp > 1 else spec, prefix=prefix,
                       layer=layer, scratch=scratch if scratch is not None else {})


def run_residual(piece: Any, spec: ModelSpec, site_spec: ModelSpec, wl: Sequence[Mapping[str, torch.Tensor]],
                 wf: Mapping[str, torch.Tensor], x: torch.Tensor,
                 sub: Callable[[int, str, torch.Tensor], torch.Tensor], *, poison: str,
                 registry: ImplementationRegistry | None = None, tp: int = 1, rank: int = 0, comm: Any = None,
                 share: float = 1.0) -> tuple[list[torch.Tensor], torch.Tensor, BoundRefs, Any]:
    """A residual piece driven through its protocol around ``len(wl)`` layers of two sublayers (attn, ffn):
    ``sub(layer, which, h)`` stands for the sublayer (its output times ``share``: one TP rank's part of the sum).
    Its sites come from ``site_spec`` (a rank's shard, or the spec), bound as ``bind`` does; its scratch
    buffers hold two rows more than ``x`` and start as NaN in ``scratch[poison]`` (what ``start`` must write
    before it reads). Returns the sublayer inputs in call order, the final output, the bound ops and the
    residual state."""

    def fill(b: SiteBuilder) -> None:
        piece.sites(b, site_spec, "attn")
        piece.sites(b, site_spec, "ffn")
        b.prefix, b.layers = "", ()
        piece.sites(b, site_spec, "final")

    M = x.shape[0]
    ops = bind(fill, dtype=x.dtype, rows=M, tp=tp, prefix="kind", registry=registry)
    scratch = piece.buffers(spec, M + 2, x.dtype, x.device)
    scratch[poison].fill_(float("nan"))
    step = step_context(ops, spec, rows=M, tp=tp, rank=rank, comm=comm, scratch=scratch)
    rs = piece.start(step, x)
    inputs = []
    for i, w in enumerate(wl):
        step.layer = i
        for which in ("attn", "ffn"):
            h = piece.before(step, rs, w, which)
            inputs.append(h)
            y = sub(i, which, h)
            piece.after(step, rs, w, which, (y.float() * share).to(x.dtype) if share != 1.0 else y)
    step.prefix, step.layer = "", -1
    return inputs, piece.finish(step, rs, wf), ops, rs


def random_weights(decls: Sequence[WeightDecl], dtype: torch.dtype, gen: torch.Generator,
                   special: Mapping[str, Callable[[tuple[int, ...], torch.Generator], torch.Tensor]] | None = None
                   ) -> dict[str, torch.Tensor]:
    """Fresh random weights of the declared shapes (never zeros): 1-D gains 1 + 0.1 N, matrices
    N(0, 1/fan_in); ``special`` overrides by name. fp32-declared tensors stay fp32."""
    out = {}
    for d in decls:
        if special and d.name in special:
            t = special[d.name](d.shape, gen)
        elif len(d.shape) == 1:
            t = 1.0 + 0.1 * torch.randn(d.shape, generator=gen)
        else:
            t = torch.randn(d.shape, generator=gen) / d.shape[-1] ** 0.5
        out[d.name] = t.to(torch.float32 if d.dtype == "float32" else dtype)
    return out


def shard(d: WeightDecl, t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``t`` as ``d`` declares it: whole (split None), or the equal slice of
    dim ``split`` - of each part on its own when ``parts`` are given, concatenated."""
    assert d.replicas == 1, "the harness shards plain splits only"
    if d.split is None or tp == 1:
        return t
    parts = torch.split(t, list(d.parts), dim=d.split) if d.parts else [t]
    return torch.cat([p.chunk(tp, dim=d.split)[rank] for p in parts], dim=d.split).contiguous()


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (tuple(got.shape), tuple(want.shape))
    assert not torch.isnan(got).any()
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


class _Meeting:
    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list[Any] = [None] * world


class ThreadComm:
    """One rank of a :class:`ThreadWorld`: all_reduce sums in fp32 in rank order, all_gather concatenates."""

    name = "threads"

    def __init__(self, meeting: _Meeting, rank: int):
        self._m, self.rank, self.world_size = meeting, rank, meeting.world

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self._m.slots[self.rank] = t.detach().clone()
        self._m.barrier.wait()
        got = list(self._m.slots)
        self._m.barrier.wait()   # everyone has read before the next call overwrites
        return got

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(t)
        acc = parts[0].float()
        for p in parts[1:]:
            acc = acc + p.float()
        t.copy_(acc)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(t), dim=dim)


class ThreadWorld:
    """Run ``fn(rank, comm)`` on ``world`` threads; returns the results in rank order (re-raises)."""

    def __init__(self, world: int):
        self.world = world

    def run(self, fn: Callable[[int, ThreadComm], Any]) -> list[Any]:
        meeting = _Meeting(self.world)
        results: list[Any] = [None] * self.world
        errors: list[BaseException] = []

        def body(r: int) -> None:
            try:
                results[r] = fn(r, ThreadComm(meeting, r))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                errors.append(e)
                meeting.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

