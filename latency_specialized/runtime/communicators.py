"""The communicator every communication site of a program runs on, resolved once when it is built.

A plan is made for a communicator kind (``Plan.comm``; its all-reduce sites' contexts carry it, and
implementations that cannot run on a kind refuse it). A program is given one communicator (a
process group, or None for one rank). :class:`SiteCommunicators` binds every all-reduce site of
the program's plans to a communicator that runs the implementation its plan picked there:

* the given communicator, where that implementation runs on it (``Plan.runs_on``);
* else a :class:`~latency_specialized.comm.symmetric.SymmetricMemoryCommunicator` built here over
  the given communicator's process group (CUDA IPC: tensors on a GPU, ranks on one host), one per
  (row width N, dtype) sized for the largest bucket, where the plan picked a fused symmetric-memory
  kernel - a plan built without ``comm=`` on a GPU at TP > 1 does;
* else the build fails with a UserError naming the site, the implementation, why it cannot run on
  this communicator and the fix. No path leaves a site bound to an implementation its communicator
  cannot run.

Building is collective: every rank of a program builds the same plans, so every rank takes the same
decisions and creates the same workspaces in the same order. Build before any CUDA-graph capture.
A program issues all of its all-reduces on its main stream, in the same order on every rank, so
sites and buckets of one width share one workspace safely (its slot rotation follows that order).
:meth:`SiteCommunicators.close` releases the workspaces built here (collective).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from latency_specialized.comm.kinds import COMM_FAMILIES, SYMMETRIC, kind_of
from latency_specialized.errors import UserError
from latency_specialized.ops.plan import Plan, SiteChoice


def _fit_problem(comm: Any, c: SiteChoice) -> str | None:
    """Why a symmetric-memory workspace does not fit site ``c`` (width, dtype, rows), or None."""
    from latency_specialized.comm.symmetric import SymmetricMemoryCommunicator

    if not isinstance(comm, SymmetricMemoryCommunicator):
        return None
    ctx = c.site.ctx
    n = ctx.dim("N")
    if comm.hidden != n or comm.dtype != ctx.dtype or comm.max_tokens < ctx.tokens:
        return (f"its workspace is built for [<= {comm.max_tokens}, {comm.hidden}] {comm.dtype}, the site "
                f"all-reduces [{ctx.tokens}, {n}] {ctx.dtype}")
    return None


def _serves(plan: Plan, c: SiteChoice, comm: Any) -> bool | str:
    ok = plan.runs_on(c, comm)
    if ok is not True:
        return ok
    return _fit_problem(comm, c) or True


def _comm_sites(plans: Mapping[int, Plan]) -> list[tuple[int, Plan, SiteChoice]]:
    return [(bucket, plan, c) for bucket, plan in sorted(plans.items()) for c in plan.choices
            if c.site.family in COMM_FAMILIES and c.impl is not None]


def workspace_needs(plans: Mapping[int, Plan], comm: Any) -> dict[tuple[int, str], int]:
    """The symmetric-memory workspaces a program over ``comm`` (a communicator or its kind) needs for
    ``plans``: {(row width N, dtype): largest row count}, for the sites whose picked implementation
    does not run on ``comm`` but runs on a symmetric-memory communicator."""
    need: dict[tuple[int, str], int] = {}
    for _, plan, c in _comm_sites(plans):
        if _serves(plan, c, comm) is not True and plan.runs_on(c, SYMMETRIC) is True:
            key = (c.site.ctx.dim("N"), c.site.ctx.dtype)
            need[key] = max(need.get(key, 0), c.site.ctx.tokens)
    return need


class SiteCommunicators:
    """Communicator per (bucket, communication site) of a program's plans (see the module docstring).

    Parameters
    ----------
    plans : {bucket: Plan} of one program (all for the same TP).
    comm : the program's communicator (None: one rank).
    device : where the program's tensors live (symmetric-memory workspaces are built there).
    """

    def __init__(self, plans: Mapping[int, Plan], comm: Any, device: torch.device | str):
        from latency_specialized.comm import symmetric as S

        self.comm = comm
        self.built: dict[tuple[int, str], Any] = {}
        """Workspaces built here, by (row width N, dtype): released by ``close``."""
        self._by_site: dict[tuple[int, str], Any] = {}
        sites = _comm_sites(plans)
        need = workspace_needs(plans, comm)
        problem = S.workspace_problem(comm, device) if need else None  # the same on every rank: collective
        if need and problem is None:
            for (n, dt), rows in sorted(need.items()):
                self.built[(n, dt)] = S.workspace_over(comm, hidden=n, dtype=dt, max_tokens=rows, device=device)
        for bucket, plan, c in sites:
            serving = [x for x in (comm, *self.built.values()) if _serves(plan, c, x) is True]
            if not serving:  # (comm may be None: one rank)
                self.close_built()
                why = _serves(plan, c, comm)
                extra = f"; no symmetric-memory workspace can be built: {problem}" if problem else ""
                raise UserError(
                    f"{plan.model}: site {c.site.name} (bucket {bucket}) is planned for {c.impl.name} on a "
                    f"{plan.comm} communicator, which cannot run on this program's communicator "
                    f"({kind_of(comm)}): {why}{extra}. Fix: build the plans for the communicator the program "
                    "gets (build_plan(..., comm=comm)) so that they pick an implementation it runs"
                    + (", or run the ranks on one host with their tensors on CUDA" if problem else ""))
            self._by_site[(bucket, c.site.name)] = serving[0]

    def __call__(self, bucket: int, site: str) -> Any:
        """The communicator ``site`` of ``bucket`` runs on."""
        try:
            return self._by_site[(bucket, site)]
        except KeyError:
            raise UserError(f"no communication site {site!r} in the plan of bucket {bucket}") from None

    def kinds(self) -> dict[tuple[int, str], str]:
        """{(bucket, site): communicator kind} (what ``explain``-style reports and tests read)."""
        return {k: kind_of(v) for k, v in self._by_site.items()}

    def close_built(self) -> None:
        """Release the workspaces built here (collective); the sites bound to them are unusable after."""
        for w in self.built.values():
            w.destroy()
        self.built.clear()

    def close(self) -> None:
        """Release the workspaces built here and forget every binding (collective)."""
        self.close_built()
        self._by_site.clear()
