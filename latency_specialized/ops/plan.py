"""Dispatch resolved once: the plan of one (model, hardware, TP, batch bucket).

``build_plan`` asks the registry, for every op site of the adapter's decode step, which
implementation serves it, and keeps every refusal with its reason. The plan is what a program
binds to and what a CUDA graph freezes; ``explain`` prints it.
"""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Collection

from latency_specialized.adapter_contract import AdapterContract, Variant
from latency_specialized.errors import UserError
from latency_specialized.hardware import Hardware
from latency_specialized.ops.registry import Implementation, ImplementationRegistry
from latency_specialized.ops.sites import OpSite, with_context
from latency_specialized.spec import Deployment, ParallelSpec

# CUDA-graph batch buckets: small sizes exact (they dominate latency serving), then steps of 8.
BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
"""The one bucket rule (``bucket_for``, ``buckets_upto``, ``bucket_of``) is defined here; the planner,
the runtime's gate (``runtime/gate.py``) and the vLLM binding (``runtime/vllm_binding.py``) all use it."""


NORM_PROLOGUES = True
"""Where a gemm site names its ``norm_site`` and the chosen implementation has ``norm_prologue``, the gemm normalises
its input itself and the norm site is skipped (``Plan.skipped_sites``). False: every norm site runs before its
gemm: an A/B switch for whether the prologue pays where a GEMV's input is short (``models/glm53/NOTES.md``,
session 53)."""


def bucket_for(batch: int, max_batch: int = 64) -> int:
    """Smallest graph bucket that holds ``batch`` under a scope limit of ``max_batch``: the smallest of
    ``BATCH_BUCKETS`` up to ``max_batch`` that holds it, else ``max_batch`` itself (a limit between two
    buckets is a bucket of its own). Raises UserError beyond ``max_batch``."""
    if batch < 1:
        raise UserError(f"batch {batch} is not valid: use a batch of 1..{max_batch}")
    if batch > max_batch:
        raise UserError(f"batch {batch} beyond the scope: use 1..{max_batch} (larger batches run stock)")
    for b in BATCH_BUCKETS:
        if batch <= b <= max_batch:
            return b
    return max_batch


def buckets_upto(max_batch: int, limit: int | None = None) -> tuple[int, ...]:
    """Every bucket a batch of 1..``max_batch`` gets from :func:`bucket_for` under the scope limit
    ``limit`` (default ``max_batch``), ascending: the buckets a deployment plans (and captures)."""
    limit = max_batch if limit is None else limit
    if not 1 <= max_batch <= limit:
        raise UserError(f"buckets up to batch {max_batch} under a limit of {limit}: use 1 <= max_batch <= limit")
    return tuple(sorted({bucket_for(b, limit) for b in range(1, max_batch + 1)}))


def bucket_of(batch: int, buckets: Collection[int]) -> int | None:
    """Smallest of ``buckets`` (any set: the planned ones, the captured ones) that holds ``batch``;
    None when none does."""
    fitting = [b for b in buckets if b >= batch]
    return min(fitting) if fitting else None


@dataclass(frozen=True)
class SiteChoice:
    """Which implementation serves a site, and why the better-ranked ones did not."""

    site: OpSite
    impl: Implementation | None
    refusals: tuple[tuple[str, str], ...]
    inner: tuple[tuple[str, "SiteChoice"], ...] = ()
    """(role, choice) of the op calls ``impl`` makes inside itself (``Implementation.inner``), resolved
    by the planner like any site; their site names are ``<site>[<role>]``."""
    stock: str = ""
    """Non-empty where a host framework's own module serves the site instead of the planner's choice,
    and why: an integration's binding sets it over a plan (``runtime.vllm_binding.SiteTable.serve_stock``:
    vLLM's Attention layer over its own KV cache); ``impl`` is then that module's call (name 'stock')."""

    @property
    def is_fast(self) -> bool:
        return self.impl is not None and not self.impl.is_reference and not self.stock

    @property
    def fn(self) -> Callable[..., Any] | None:
        """What a program binds: ``impl.fn``, given ``inner={role: Implementation}`` where the
        implementation makes inner op calls (None when nothing serves the site)."""
        if self.impl is None:
            return None
        if not self.inner:
            return self.impl.fn
        return functools.partial(self.impl.fn, inner={role: c.impl for role, c in self.inner})


@dataclass
class Plan:
    """Implementation per op site for one deployment."""

    model: str
    variant: str
    hardware: Hardware
    parallel: ParallelSpec
    batch: int
    bucket: int
    tokens: int
    dtype: str
    choices: list[SiteChoice]
    scope_problems: list[str] = field(default_factory=list)
    comm: str = "local"
    """Communicator kind the communication sites were planned for (``latency_specialized.comm.kinds``);
    each such site's context carries it as attr ``comm``."""
    context: int | None = None
    """Longest sequence (tokens) the plan serves; every attention site's context carries it as attr
    ``context`` (None: not given, no site carries one)."""

    def choice(self, site: str) -> SiteChoice:
        for c in self.choices:
            if c.site.name == site:
                return c
        raise KeyError(f"plan of {self.model} has no op site {site!r}")

    def impl(self, site: str) -> Callable[..., Any]:
        c = self.choice(site)
        if c.impl is None:
            raise UserError(f"{self.model}: no implementation serves {site}: "
                            + "; ".join(f"{n}: {r}" for n, r in c.refusals))
        return c.fn

    def runs_on(self, site: str | SiteChoice, comm: Any) -> bool | str:
        """Whether the implementation the plan picked for ``site`` runs on ``comm`` (a communicator, a
        kind name, or None for one rank): True, or the reason it does not - that implementation's
        ``supports()`` asked with the site's context planned for ``comm``'s kind."""
        from latency_specialized.comm.kinds import kind_of

        c = site if isinstance(site, SiteChoice) else self.choice(site)
        if c.impl is None:
            return "no implementation serves it"
        ctx = _with_comm(c.site, kind_of(comm)).ctx
        try:
            ok = c.impl.supports(ctx)
        except Exception as e:  # as the registry's select: a buggy supports() names itself
            ok = f"supports() raised {type(e).__name__}: {e}"
        return True if ok is True else (str(ok) if ok else "not supported")

    @property
    def in_scope(self) -> bool:
        return not self.scope_problems

    def skipped_sites(self) -> dict[str, str]:
        """Sites a program does not call at this bucket, each with the reason (site name -> why).

        Two declared relations, read from the sites' attributes (set by the adapter's site list):

        * ``fuses`` (a fusing site, e.g. ``moe.gate_down``: comma-separated roles of the sites it
          replaces, in its own prefix): where a kernel serves it, the program calls it instead of
          those sites; where only its reference would, the program calls those sites and skips it;
        * ``norm_site`` (a gemm site: the role of the norm site in front of it): where the gemm's
          implementation has ``norm_prologue``, it normalises its input itself and the norm site is
          skipped.
        Programs decide with this (one rule for the program, ``explain`` and the tests)."""
        out: dict[str, str] = {}
        for c in self.choices:
            prefix = c.site.name.rsplit("/", 1)[0] + "/" if "/" in c.site.name else ""
            fuses = c.site.ctx.attr("fuses")
            if fuses:
                names = [prefix + role for role in fuses.split(",")]
                if c.is_fast:
                    for name in names:
                        out[name] = f"fused into {c.site.name} ({c.impl.name})"
                else:
                    out[c.site.name] = f"only its reference serves it: {', '.join(names)} run instead"
            norm = c.site.ctx.attr("norm_site")
            if NORM_PROLOGUES and norm and c.impl is not None and c.impl.norm_prologue:
                out[prefix + norm] = f"{c.site.name} ({c.impl.name}) normalises its input itself"
        return out

    def called_choices(self) -> list[SiteChoice]:
        """The choices of the sites a program calls at this bucket (all but ``skipped_sites``)."""
        skipped = self.skipped_sites()
        return [c for c in self.choices if c.site.name not in skipped]

    def counts(self) -> dict[str, int]:
        """Sites, and of those a program calls: fast / reference / stock (an integration's own module,
        ``SiteChoice.stock``) / unserved; ``not_called``: the rest (``skipped_sites``: a fused site or its
        parts, an absorbed norm)."""
        called = self.called_choices()
        fast = sum(c.is_fast for c in called)
        stock = sum(bool(c.stock) for c in called)
        unserved = sum(c.impl is None for c in called)
        return {"sites": len(self.choices), "fast": fast, "reference": len(called) - fast - stock - unserved,
                "stock": stock, "unserved": unserved, "not_called": len(self.choices) - len(called)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "variant": self.variant, "arch": self.hardware.arch,
            "hardware": self.hardware.name, "tp": self.parallel.tp, "batch": self.batch, "bucket": self.bucket,
            "tokens": self.tokens, "context": self.context, "dtype": self.dtype, "comm": self.comm,
            "in_scope": self.in_scope,
            "scope_problems": self.scope_problems, "counts": self.counts(), "not_called": self.skipped_sites(),
            "sites": [
                {"site": c.site.name, "family": c.site.family, "layers": list(c.site.layers),
                 "context": c.site.ctx.describe(), "impl": c.impl.name if c.impl else None,
                 "refused": [{"impl": n, "reason": r} for n, r in c.refusals],
                 **({"inner": [{"role": role, "family": ic.site.family, "context": ic.site.ctx.describe(),
                                "impl": ic.impl.name if ic.impl else None} for role, ic in c.inner]}
                    if c.inner else {})}
                for c in self.choices
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_text(self, refusals: bool = True) -> str:
        c = self.counts()
        head = (f"plan: {self.model} ({self.variant}) on {self.hardware.arch} [{self.hardware.name}], "
                f"TP={self.parallel.tp}, batch {self.batch} -> bucket {self.bucket} ({self.tokens} tokens/step), "
                f"{self.dtype}" + (f", communicator {self.comm}" if self.parallel.tp > 1 else ""))
        lines = [head, f"  sites: {c['sites']} | fast: {c['fast']} | reference: {c['reference']} | "
                       f"stock: {c['stock']} | unserved: {c['unserved']} | not called: {c['not_called']}"]
        lines.append(f"  context: up to {self.context} tokens per sequence (attention sites carry it)"
                     if self.context is not None else "  context: not given (attention sites carry no length)")
        if self.scope_problems:
            lines.append("  OUT OF SCOPE (stock path would run): " + "; ".join(self.scope_problems))
        skipped = self.skipped_sites()
        for ch in self.choices:
            layers = _layer_ranges(ch.site.layers)
            where = f" [layers {layers}]" if layers else ""
            impl = ch.impl.name if ch.impl else "NONE"
            lines.append(f"  {ch.site.name:<34} {ch.site.family:<18} -> {impl:<26} {ch.site.ctx.describe()}{where}")
            if ch.site.name in skipped:
                lines.append(f"      not called: {skipped[ch.site.name]}")
            for role, ic in ch.inner:  # what the implementation runs inside itself, as the planner chose it
                inner_impl = ic.impl.name if ic.impl else "NONE"
                lines.append(f"      inside: {role:<12} {ic.site.family:<10} -> {inner_impl:<26} {ic.site.ctx.describe()}")
            if refusals:
                for name, reason in ch.refusals:
                    lines.append(f"      refused {name}: {reason}")
        return "\n".join(lines)


def _layer_ranges(layers: tuple[int, ...]) -> str:
    if not layers:
        return ""
    out, start, prev = [], layers[0], layers[0]
    for x in layers[1:] + (None,):  # type: ignore[operator]
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    if len(out) > 6:
        return f"{', '.join(out[:5])}, ... ({len(layers)} layers)"
    return ", ".join(out)


def _with_attrs(site: OpSite, **attrs: Any) -> OpSite:
    """``site`` with ``attrs`` added to its context (other fields unchanged)."""
    from dataclasses import replace

    from latency_specialized.ops.registry import make_context

    c = site.ctx
    ctx = make_context(c.family, arch=c.arch, dtype=c.dtype, tokens=c.tokens, world_size=c.world_size,
                       dims=dict(c.dims), attrs={**dict(c.attrs), **attrs})
    return replace(site, ctx=ctx)


def _with_comm(site: OpSite, kind: str) -> OpSite:
    """``site`` with attr ``comm`` = ``kind`` in its context (other fields unchanged)."""
    return _with_attrs(site, comm=kind)


def _inner_choices(registry: ImplementationRegistry, site: OpSite,
                   impl: Implementation | None) -> tuple[tuple[str, SiteChoice], ...]:
    """The planner's choice for every op call ``impl`` makes inside itself at ``site``."""
    if impl is None:
        return ()
    return tuple((role, SiteChoice(OpSite(f"{site.name}[{role}]", ctx, site.layers), chosen, tuple(refusals)))
                 for role, ctx, chosen, refusals in registry.inner_choices(impl, site.ctx))


def _adapter_sites(adapter: AdapterContract, spec: Any, parallel: ParallelSpec, tokens: int, arch: str, dtype: str,
                   context: int | None) -> list[OpSite]:
    """``adapter.op_sites`` for ``context``. An adapter whose ``op_sites`` was written before the ``context``
    argument (no such parameter, no ``**kw``) is asked without it, and its attention sites get the context
    here by the rule ``SiteBuilder`` applies (``ops.sites.with_context``): the same sites either way."""
    if context is None:
        return list(adapter.op_sites(spec, parallel, tokens, arch, dtype))
    try:
        params = inspect.signature(adapter.op_sites).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin or C callable: assume the contract
        params = {"context": None}  # type: ignore[assignment]
    if "context" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return list(adapter.op_sites(spec, parallel, tokens, arch, dtype, context=context))
    return [with_context(s, context) for s in adapter.op_sites(spec, parallel, tokens, arch, dtype)]


def build_plan(adapter: AdapterContract, registry: ImplementationRegistry, hardware: Hardware, *,
               tp: int = 1, batch: int = 1, dtype: str = "bfloat16", spec_tokens: int = 0,
               context: int | None = None, variant: Variant = "full", force: dict[str, str] | None = None,
               comm: Any = None) -> Plan:
    """Resolve every op site of ``adapter``'s decode step for one deployment.

    Raises UserError for a TP the architecture cannot be split by, a batch out of scope or a context
    below 1; other scope problems (arch, dtype, a context beyond the spec's ``max_context``) are kept in
    ``plan.scope_problems`` so ``explain`` can show what would run anyway. ``force`` maps family ->
    implementation name (for tests and A/B runs).

    ``context``: the longest sequence (tokens per sequence) the plan serves; it reaches the attention
    sites' contexts (attr ``context``, ``adapter.op_sites(..., context=)``), so implementations can choose
    or refuse by length, and ``plan.context``. None: not given (no site carries a length).

    ``comm``: the communicator the all-reduce sites will run on, or its kind (``comm.kinds``); every
    communication site's context carries the kind (attr ``comm``), so implementations that cannot run
    on it refuse with the reason. Default: the kind a deployment builds (``comm.kinds.default_kind``:
    one rank ``local``; on a GPU ``symmetric-memory``, whose CUDA IPC workspaces the program builds
    over its process group; on a CPU ``torch.distributed``).
    """
    from latency_specialized.comm.kinds import COMM_FAMILIES, default_kind, kind_of

    kind = default_kind(hardware.arch, tp) if comm is None else kind_of(comm)
    world = getattr(comm, "world_size", None) if comm is not None and not isinstance(comm, str) else None
    if world is not None and world != tp:
        raise UserError(f"a plan for TP={tp} over a communicator of {world} rank(s): plan with tp={world} "
                        "or pass that TP's communicator")
    scope = adapter.scope()
    spec = adapter.spec(variant)
    rank_spec = spec.shard(tp)  # raises the divisibility error naming the fix
    bucket = bucket_for(batch, scope.max_batch)
    if context is not None and context < 1:
        raise UserError(f"context {context} is not valid: use a context of 1..{spec.max_context} tokens")
    tokens = bucket * (1 + spec_tokens)
    parallel = ParallelSpec(tp=tp)
    deployment = Deployment(arch=hardware.arch, tp=tp, batch=batch, dtype=dtype, spec_tokens=spec_tokens,  # type: ignore[arg-type]
                            context=context)
    problems = scope.problems(deployment, adapter.name, max_context=spec.max_context)
    sites = [_with_comm(s, kind) if s.family in COMM_FAMILIES else s
             for s in _adapter_sites(adapter, rank_spec, parallel, tokens, hardware.arch, dtype, context)]
    if spec_tokens:
        # verification rows: every site learns k (OpContext.spec_tokens / requests; explain shows it)
        sites = [_with_attrs(s, spec_tokens=spec_tokens) for s in sites]
    choices = []
    for site in sites:
        try:
            registry.family(site.family)
        except KeyError:
            raise UserError(f"{adapter.name}: op site {site.name} calls the op family {site.family!r}, which the op "
                            "registry does not know: register the family and its implementations (ops/registry.py "
                            "FAMILIES), or compose the model from pieces whose families exist") from None
        only = (force or {}).get(site.family)
        impl, refusals = registry.select(site.ctx, only=only)
        choices.append(SiteChoice(site, impl, tuple(refusals), _inner_choices(registry, site, impl)))
    return Plan(adapter.name, variant, hardware, parallel, batch, bucket, tokens, dtype, choices, problems, kind,
                context)
