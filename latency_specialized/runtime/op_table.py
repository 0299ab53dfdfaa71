"""The bound op table of a decode program: per batch bucket, op site -> the callable its plan chose.

    table = OpTable(plans, trace)              # {bucket: Plan}; every site bound once, recorded in trace
    ops = table[bucket]                        # BoundOps: ops[site](...), ops.skipped, ops.strided_rows ...
    table.wrap(hook)                           # hook(site, bucket, fn) -> fn, around every op (census, bench)
    ops.communicate("lm_head.all_gather", comm.all_gather, logits, dim=-1)   # a non-plan call, hooked too

Every bound op counts its calls in ``table.calls`` (site -> calls, all buckets together): proof
that a program, not a reference, ran. The count is taken outside every hook, so a hook that
replaces an op (the bench's one-rank all-reduce) is still counted. ``wrap`` is the one public way
to instrument the ops (census, routing recorders, communication stand-ins) - nothing reaches into a
program's members. Hooks apply in the order they were added (the latest outermost); communication
calls (``BoundTable.communicate``) run through the same hooks, under their own site names, and are
counted in ``calls`` too.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Iterator, Mapping

from latency_specialized.errors import UserError
from latency_specialized.ops.plan import Plan
from latency_specialized.ops.registry import Implementation
from latency_specialized.trace import Trace

Hook = Callable[[str, int, Callable[..., Any]], Callable[..., Any]]
"""``hook(site, bucket, fn) -> fn'``: wraps (or replaces) one bound op."""


def _unserved(site: str, why: str) -> Callable[..., Any]:
    def call(*_a: Any, **_k: Any) -> Any:
        raise UserError(f"{site} has no implementation ({why}) and the plan skips it: the program must not call it")

    return call


class BoundTable:
    """One bucket's bound ops (the runtime's ``BoundOps``): ``table[site](...)`` calls the plan's choice."""

    def __init__(self, owner: "OpTable", bucket: int, plan: Plan):
        self.bucket = bucket
        self.plan = plan
        self.skipped: dict[str, str] = plan.skipped_sites()
        """Sites not called at this bucket and why (``Plan.skipped_sites``)."""
        self.strided_rows: frozenset[str] = frozenset(
            c.site.name for c in plan.choices if c.impl is not None and c.impl.strided_rows)
        """Sites whose implementation takes a column slice without a copy."""
        self.strided_out: frozenset[str] = frozenset(
            c.site.name for c in plan.choices if c.impl is not None and c.impl.strided_out)
        """Sites whose implementation writes a column slice of a wider tensor in place."""
        self.impls: dict[str, Implementation] = {}
        """Site -> the implementation bound to it."""
        self._owner = owner
        self._inner: dict[str, Callable[..., Any]] = {}
        self._outer: dict[str, Callable[..., Any]] = {}
        for c in plan.choices:
            name = c.site.name
            if c.impl is None:
                why = "; ".join(f"{n}: {r}" for n, r in c.refusals) or "none registered"
                if name not in self.skipped:
                    raise UserError(f"{plan.model}: no implementation serves {name} at bucket {bucket}: {why} "
                                    "(register one or force another with build_plan(force=...))")
                self._inner[name] = _unserved(name, why)
            else:
                self.impls[name] = c.impl
                self._inner[name] = c.fn  # the implementation, with the inner ops its plan chose bound
            self._outer[name] = self._counted(name)

    def _counted(self, site: str) -> Callable[..., Any]:
        calls, inner = self._owner.calls, self._inner

        def call(*args: Any, **kw: Any) -> Any:
            calls[site] += 1
            return inner[site](*args, **kw)

        call.__name__ = f"op[{site}]"
        return call

    # ------------------------------------------------------------------ BoundOps
    def __getitem__(self, site: str) -> Callable[..., Any]:
        try:
            return self._outer[site]
        except KeyError:
            raise UserError(f"the plan of {self.plan.model} (bucket {self.bucket}) has no op site {site!r}: "
                            "build the plan from the same pieces (ComposedModel.op_sites)") from None

    def __contains__(self, site: object) -> bool:
        return site in self._outer

    def __iter__(self) -> Iterator[str]:
        return iter(self._outer)

    def __len__(self) -> int:
        return len(self._outer)

    def communicate(self, site: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` as the communication site ``site`` (an all-gather outside the plan):
        counted in ``calls`` and run through every hook added so far."""
        self._owner.calls[site] += 1
        f = fn
        for hook in self._owner.hooks:
            f = hook(site, self.bucket, f)
        return f(*args, **kw)

    def _wrap(self, hook: Hook) -> int:
        for site in self._inner:
            self._inner[site] = hook(site, self.bucket, self._inner[site])
        return len(self._inner)


class OpTable:
    """Bound op tables of every bucket of a program (see the module docstring).

    Parameters
    ----------
    plans : {bucket: Plan}; each plan's ``bucket`` must be its key.
    trace : records the implementation bound to every site of every bucket (default: a new Trace).
    """

    def __init__(self, plans: Mapping[int, Plan], trace: Trace | None = None):
        if not plans:
            raise UserError("an op table needs at least one plan: build_plan for the program's batch")
        self.plans: dict[int, Plan] = dict(sorted(plans.items()))
        self.trace = trace if trace is not None else Trace()
        self.calls: Counter[str] = Counter()
        """Calls per site over all buckets (communication sites included)."""
        self.hooks: list[Hook] = []
        """Hooks added by ``wrap``, in order."""
        self._tables: dict[int, BoundTable] = {}
        for bucket, plan in self.plans.items():
            if plan.bucket != bucket:
                raise UserError(f"plan of bucket {plan.bucket} was given for bucket {bucket}: key plans by their bucket")
            table = BoundTable(self, bucket, plan)
            self._tables[bucket] = table
            for c in plan.choices:
                impl = c.impl.name if c.impl is not None else "NONE"
                note = f"bucket {bucket}" + (", not called" if c.site.name in table.skipped else "")
                self.trace.site(c.site.name, impl, note)

    @property
    def buckets(self) -> list[int]:
        return list(self._tables)

    def __getitem__(self, bucket: int) -> BoundTable:
        table = self._tables.get(bucket)
        if table is None:
            raise UserError(f"no plan for bucket {bucket} (have {self.buckets}): build one for that batch")
        return table

    def __contains__(self, bucket: object) -> bool:
        return bucket in self._tables

    def impl(self, bucket: int, site: str) -> Implementation:
        """The implementation bound to ``site`` at ``bucket``."""
        return self[bucket].impls[site]

    def wrap(self, hook: Hook) -> int:
        """Wrap every bound op of every bucket: ``fn = hook(site, bucket, fn)``; later communication calls
        go through ``hook`` too. Returns the number of ops wrapped."""
        self.hooks.append(hook)
        return sum(t._wrap(hook) for t in self._tables.values())

    def prepare(self, bucket: int) -> None:
        """Warm every implementation of the bucket's plan (``impl.prepare(ctx)``: compile, allocate)."""
        for c in self[bucket].plan.choices:
            if c.impl is not None and c.impl.prepare is not None:
                c.impl.prepare(c.site.ctx)


__all__ = ["OpTable", "BoundTable", "Hook"]
