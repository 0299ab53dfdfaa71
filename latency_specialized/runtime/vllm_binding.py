"""The contract between the vLLM integration and an adapter's vLLM binding.

It sits at the runtime layer, below the adapters that implement it (``models/<name>/vllm.py``) and
the integration that drives it (``latency_specialized/vllm/``, which re-exports it as
``latency_specialized.vllm.binding``).

An adapter with the ``vllm`` capability returns a :class:`VllmBinding` from ``vllm_binding()``.
At model load the integration calls ``problems(ctx)`` on every rank (collected collectively, see
:mod:`latency_specialized.vllm.scope`), then ``bind(ctx)``, which returns a callable decode step
``step(input_ids, positions, batch) -> hidden_states`` over the vLLM model's own modules, weights
and caches. The integration owns the gate (pure decode? batch in scope?) and the trace.

:class:`SiteTable` turns the plans of every batch bucket into "which function serves this op site,
or does the stock module" - the one rule every binding follows:

* an op site with a fast implementation runs it;
* an op site whose only implementation is the plain-torch reference runs the reference on the CPU
  (there it is the backend's implementation, and serving with it checks the binding against stock)
  and the stock module on GPUs (a reference is slower than stock there);
* an op site with no implementation, or whose weights are not in a layout the op family takes
  (quantized, biased, repacked), calls the stock vLLM module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from latency_specialized.adapter import ModelAdapter
from latency_specialized.hardware import Hardware
from latency_specialized.ops.plan import BATCH_BUCKETS, Plan, build_plan
from latency_specialized.ops.registry import ImplementationRegistry
from latency_specialized.spec import Deployment
from latency_specialized.trace import Trace

STOCK = "stock"
"""Implementation name recorded for sites served by the stock vLLM module."""
FUSED = "fused"
"""Implementation name recorded for sites whose work another site's implementation does."""


@dataclass
class BindContext:
    """Everything a binding may look at on one rank."""

    model: Any
    """The vLLM model (top-level nn.Module the model runner calls)."""
    vllm_config: Any
    """vLLM's VllmConfig."""
    adapter: ModelAdapter
    """The adapter serving the model's architecture."""
    deployment: Deployment
    """What the deployment asks for (arch, TP, dtype, spec tokens, graphs)."""
    hardware: Hardware
    """This rank's device."""
    registry: ImplementationRegistry
    """Op implementations."""
    trace: Trace
    """The worker's trace (record under the integration's lock; binding time only)."""
    max_batch: int
    """Largest batch a step may have (min of the adapter scope and vLLM's max_num_seqs)."""
    rank: int = 0
    """Global rank of this worker."""


class DecodeStep(Protocol):
    def __call__(self, input_ids: Any, positions: Any, batch: int) -> Any:
        """Hidden states [tokens, hidden] after the final norm, exactly what the stock forward returns."""


class VllmBinding(Protocol):
    def problems(self, ctx: BindContext) -> list[str]:
        """Every reason this rank cannot run the decode program (empty: bindable)."""

    def plan_adapter(self, ctx: BindContext) -> ModelAdapter:
        """An adapter whose ``spec("full")`` is the loaded model (scope check and planning use it)."""

    def bind(self, ctx: BindContext, sites: "SiteTable") -> DecodeStep:
        """Build the decode step over the model's own weights; called once all ranks passed."""


@dataclass(frozen=True)
class SiteChoice:
    """What serves one op site in one bucket."""

    site: str
    impl: str
    """Implementation name, or 'stock'."""
    fn: Callable[..., Any] | None
    """The implementation's callable; None means call the stock module."""
    reason: str = ""
    """Why the stock module serves (empty when an implementation does)."""


@dataclass
class SiteTable:
    """Implementation per (bucket, op site), resolved once at install (dispatch is not per call)."""

    plans: dict[int, Plan]
    allow_reference: bool
    """References may serve (CPU); on GPUs a reference-only site runs the stock module."""
    overrides: dict[str, str] = field(default_factory=dict)
    """site -> reason the stock module must serve whatever the plan says (layout, bias ...)."""
    fused: dict[str, str] = field(default_factory=dict)
    """site -> the site whose implementation does its work (e.g. a norm fused into an all-reduce)."""
    _cache: dict[tuple[int, str], SiteChoice] = field(default_factory=dict)

    @classmethod
    def build(cls, adapter: ModelAdapter, registry: ImplementationRegistry, hardware: Hardware,
              deployment: Deployment, max_batch: int) -> "SiteTable":
        """Plans of ``adapter.spec("full")`` for every graph bucket up to ``max_batch``."""
        buckets = sorted({b for b in BATCH_BUCKETS if b <= max_batch} | {max_batch})
        plans = {b: build_plan(adapter, registry, hardware, tp=deployment.tp, batch=b, dtype=deployment.dtype,
                               spec_tokens=deployment.spec_tokens, variant="full") for b in buckets}
        return cls(plans, allow_reference=not hardware.is_gpu)

    def bucket(self, batch: int) -> int:
        for b in sorted(self.plans):
            if b >= batch:
                return b
        raise ValueError(f"batch {batch} beyond the largest planned bucket {max(self.plans)}")

    def force_stock(self, site: str, reason: str) -> None:
        """Make the stock module serve ``site`` in every bucket (e.g. its weights are quantized)."""
        self.overrides.setdefault(site, reason)
        self._cache = {k: v for k, v in self._cache.items() if k[1] != site}

    def fuse(self, site: str, into: str) -> None:
        """Record that ``site`` never runs on its own: the program does its work inside ``into``."""
        self.fused[site] = into
        self._cache = {k: v for k, v in self._cache.items() if k[1] != site}

    def choice(self, bucket: int, site: str) -> SiteChoice:
        key = (bucket, site)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if site in self.fused:
            out = SiteChoice(site, FUSED, None, f"done inside {self.fused[site]}")
        elif site in self.overrides:
            out = SiteChoice(site, STOCK, None, self.overrides[site])
        else:
            c = self.plans[bucket].choice(site)
            if c.impl is None:
                out = SiteChoice(site, STOCK, None, "no implementation: " + "; ".join(f"{n}: {r}" for n, r in c.refusals))
            elif c.impl.is_reference and not self.allow_reference:
                out = SiteChoice(site, STOCK, None, f"only the reference ({c.impl.name}) supports it on this GPU")
            else:
                out = SiteChoice(site, c.impl.name, c.fn)  # c.fn: with the inner ops the plan chose
        self._cache[key] = out
        return out

    def fn(self, bucket: int, site: str) -> Callable[..., Any] | None:
        """The implementation serving ``site``; None: call the stock module."""
        c = self.choice(bucket, site)
        if c.impl == FUSED:
            raise KeyError(f"op site {site} is fused into {self.fused[site]}: the program must not call it")
        return c.fn
