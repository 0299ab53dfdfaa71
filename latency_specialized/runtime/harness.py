"""The graph harness around a decode program: runner factory, spec-bound adapters, op-table hooks.

    runner = make_runner(program, buffers, use_graphs=True)     # one CUDA graph per bucket of its plans
    plan = build_plan(SpecBoundAdapter(adapter, spec), ...)    # plans of another spec (bench, medium)
    exclude_communication(program)                             # all-reduces -> the one-rank fused kernel
    recorder = OutputRecorder(program, "moe.router", pick=lambda out: out[1])   # expert ids of a step

Everything here instruments a program only through ``program.op_table.wrap(hook)`` (``runtime/op_table.py``)
and its public members (``plans``, ``max_batch``, ``trace``); nothing names a model.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from latency_specialized.errors import UserError
from latency_specialized.runtime.buffers import DecodeBuffers
from latency_specialized.runtime.gate import DecodeGate
from latency_specialized.runtime.graph_runner import CUDAGraphRunner
from latency_specialized.trace import Trace

LOCAL_ALLREDUCE = "allreduce.cutedsl_local"
"""The one-rank fused residual (+RMSNorm) implementation of the ``allreduce`` family."""
SUM_ONLY_KERNEL = False
"""``exclude_communication`` at a sum-only all-reduce: False leaves it out (the partial is the sum, as stock's);
True runs the one-rank kernel there too (a copy through zeros; what the bench did before session 44, for an A/B:
``--ab kernel:latency_specialized.runtime.harness.SUM_ONLY_KERNEL=True``)."""


def make_runner(program: Any, buffers: DecodeBuffers, *, buckets: Sequence[int] | None = None,
                trace: Trace | None = None, fallback: Callable[..., Any] | None = None,
                use_graphs: bool | None = None, preserve_state: bool = True) -> CUDAGraphRunner:
    """A graph runner over ``program`` for the buckets it has plans for (or ``buckets``)."""
    have = sorted(program.plans)
    chosen = tuple(sorted(buckets)) if buckets is not None else tuple(have)
    missing = [b for b in chosen if b not in program.plans]
    if missing:
        raise UserError(f"no plan for bucket(s) {missing}: build the program with plans for them (have {have})")
    gate = DecodeGate(max_batch=program.max_batch, buckets=chosen)
    return CUDAGraphRunner(program, buffers, gate=gate, trace=trace if trace is not None else program.trace,
                           fallback=fallback, use_graphs=use_graphs, preserve_state=preserve_state)


class SpecBoundAdapter:
    """``adapter`` with another (unsharded) spec for every variant: plans for a spec the adapter does not
    list (a layer-bench spec of the full widths, a checkpoint's spec). Sites still come from
    ``adapter.op_sites``, given that full spec where the planner passes its rank shard."""

    def __init__(self, adapter: Any, spec: Any):
        self._base, self._spec = adapter, spec
        self.name = adapter.name

    def spec(self, variant: str = "full") -> Any:
        return self._spec

    def scope(self) -> Any:
        return self._base.scope()

    def op_sites(self, spec: Any, parallel: Any, *args: Any, **kw: Any) -> list[Any]:
        if spec.tp != 1 and spec.tp == parallel.tp and self._spec.shard(spec.tp) == spec:
            spec = self._spec  # the sites of a rank are those of its full spec at that TP
        return self._base.op_sites(spec, parallel, *args, **kw)


def _sums_only(program: Any, site: str, bucket: int) -> bool:
    """True for an all-reduce site that only sums the ranks' partials (attrs: no residual, no norm)."""
    plan = getattr(program, "plans", {}).get(bucket)
    try:
        ctx = plan.choice(site).site.ctx
    except (AttributeError, KeyError):
        return False
    return not ctx.attr("residual") and not ctx.attr("norm")


def _one_rank_sum(partial: torch.Tensor, residual: Any, weight: Any, eps: float, *, comm: Any = None,
                  out: Any = None, **kw: Any) -> tuple[None, torch.Tensor]:
    """A sum-only all-reduce of one rank with the exchange left out: the partial itself (no kernel)."""
    if out is not None and out[1] is not None:
        out[1].copy_(partial)
        return None, out[1]
    return None, partial


def exclude_communication(program: Any, registry: Any = None) -> int:
    """Bind every all-reduce site of ``program`` to its one-rank form (communication left out, for a one-GPU
    bench of a TP rank); returns the number of sites rebound (counted over buckets).

    Where the all-reduce is fused with a residual add and / or a norm, the one-rank fused kernel: the rank's
    partial sums are added to the residual as if the other ranks contributed zero, the same memory traffic as
    the real fused all-reduce minus the peer exchange. Where it only sums partials (mHC and gated residual
    streams, per-route partials: attrs without residual or norm), nothing is left once the exchange is
    excluded: the partial is the sum, as the stock compositions leave those all-reduces out (no kernel)."""
    if registry is None:
        from latency_specialized.plugins import get_registry

        registry = get_registry().implementations
    one_rank = registry.get(LOCAL_ALLREDUCE).fn   # through the family's registry: no kernel import here
    rebound: list[str] = []

    def hook(site: str, bucket: int, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not site.endswith("allreduce"):
            return fn
        if not SUM_ONLY_KERNEL and _sums_only(program, site, bucket):
            rebound.append(site)
            return _one_rank_sum

        def local(partial, residual, weight, eps, *, comm=None, _fn=one_rank, **kw):
            return _fn(partial, residual, weight, eps, comm=None, **kw)

        rebound.append(site)
        return local

    program.op_table.wrap(hook)
    return len(rebound)


class OutputRecorder:
    """Copies of what the sites ending in ``suffix`` return, while ``recording`` (outside timed graphs)."""

    def __init__(self, program: Any, suffix: str, pick: Callable[[Any], torch.Tensor] = lambda out: out):
        self.recorded: list[torch.Tensor] = []
        self.recording = False
        self._pick = pick

        def hook(site: str, bucket: int, fn: Callable[..., Any]) -> Callable[..., Any]:
            if not site.endswith(suffix):
                return fn

            def wrapped(*args: Any, _fn=fn, **kw: Any) -> Any:
                out = _fn(*args, **kw)
                if self.recording:
                    self.recorded.append(self._pick(out).detach().clone())
                return out

            return wrapped

        program.op_table.wrap(hook)

    def record(self, step: Callable[[], None]) -> list[torch.Tensor]:
        """Run ``step`` once recording; returns what the sites returned, in call order."""
        self.recorded.clear()
        self.recording = True
        try:
            step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        finally:
            self.recording = False
        return list(self.recorded)


__all__ = ["make_runner", "SpecBoundAdapter", "exclude_communication", "OutputRecorder", "LOCAL_ALLREDUCE"]
