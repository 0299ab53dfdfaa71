"""Install the decode override on a loaded vLLM model, in every worker.

``install(worker)`` runs right after the worker loaded its model when the deployment's decode
backend is ``latency_specialized``:

1. find the adapter for the model's architecture (``get_registry().adapter_for_architecture``);
2. list this rank's problems: adapter scope vs the deployment (arch, TP, dtype, speculative
   tokens, CUDA graphs), vLLM features the override cannot run with, the binding's own checks, and
   the plans of every batch bucket (``ops.plan.buckets_upto``, the bucket rule the gate uses too),
   which - with the sites vLLM's own modules serve marked by the binding (``binding.stock_sites``) -
   must leave no site unserved;
3. gather the lists from every rank; if any rank has a problem, every rank raises the same
   :class:`DeploymentScopeError` listing all of them (the server fails at start);
4. bind the program - the runtime's ``ComposedProgram`` - to the model's own weights and caches
   (``binding.bind``), replace ``model.forward`` on that instance with a :class:`DecodeOverride`,
   log the plan once (rank 0).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from latency_specialized import hardware
from latency_specialized.errors import UserError
from latency_specialized.plugins import get_registry
from latency_specialized.runtime.gate import DecodeGate
from latency_specialized.trace import Trace
from latency_specialized.vllm import config as backend_config
from latency_specialized.vllm.binding import BindContext, SiteTable
from latency_specialized.vllm.override import DecodeOverride
from latency_specialized.vllm.scope import (DeploymentScopeError, deployment_of, engine_problems, gather_problems)
from latency_specialized.vllm.trace_file import ENV as TRACE_ENV
from latency_specialized.vllm.trace_file import TraceWriter, trace_path

log = logging.getLogger("vllm.latency_specialized")

_ACTIVE: dict[str, Any] = {}
"""The installed override of this process ('override', 'writer'), for in-process readers."""


def active_trace() -> Trace | None:
    """The trace of the override installed in this process (None if none is)."""
    override = _ACTIVE.get("override")
    return override.trace if override is not None else None


def _world() -> tuple[int, Any]:
    """(global rank, CPU process group of all ranks) - gloo, so object gathers work on every build."""
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    return group.rank, group.cpu_group


def _architectures(vllm_config: Any) -> list[str]:
    hf = vllm_config.model_config.hf_config
    return list(getattr(hf, "architectures", None) or [])


# Architectures vLLM 0.33's in-tree specialized decode serves (its readers run in these classes'
# __init__: KimiLinearForCausalLM, also inside KimiK3ForConditionalGeneration; DeepseekV41LLMForCausalLM
# inside DeepseekV41ForCausalLM).
INTREE_ARCHITECTURES = frozenset({"KimiK3ForConditionalGeneration", "KimiLinearForCausalLM", "DeepseekV41ForCausalLM"})


def _intree_hint(archs: list[str]) -> str:
    """Where vLLM ships its own specialized decode for the model, how to pick it instead of ours."""
    if not INTREE_ARCHITECTURES.intersection(archs) or not backend_config.intree_specialized_decode_present():
        return ""
    return (f"; vLLM's own in-tree specialized decode serves this model on Blackwell: "
            f"--decode-backend {backend_config.VLLM_INTREE}")


def _local_problems(model: Any, vllm_config: Any, rank: int) -> tuple[list[str], BindContext | None, Any]:
    """This rank's problems and the context and ``(binding, sites)`` to install (the plans of every
    bucket, with the sites vLLM's own modules serve marked; None where planning failed)."""
    reg = get_registry()
    archs = _architectures(vllm_config)
    adapter = reg.adapter_for_architecture(archs)
    if adapter is None:
        served = sorted({a for ad in reg.adapters.values() for a in ad.hf_architectures})
        return [f"no latency_specialized adapter serves architecture {', '.join(archs) or '?'} "
                f"(installed adapters serve: {', '.join(served) or 'none'})"], None, None
    if "vllm" not in adapter.capabilities:
        caps = ", ".join(sorted(adapter.capabilities))
        return [f"adapter {adapter.name} has no vLLM binding yet (capabilities: {caps})"
                + _intree_hint(archs)], None, None
    hw = hardware.probe()
    deployment = deployment_of(vllm_config, hw.arch)
    scope = adapter.scope()
    max_batch = min(scope.max_batch, vllm_config.scheduler_config.max_num_seqs)
    ctx = BindContext(model=model, vllm_config=vllm_config, adapter=adapter, deployment=deployment, hardware=hw,
                      registry=reg.implementations, trace=Trace(max_events=4000), max_batch=max_batch, rank=rank)
    binding = adapter.vllm_binding()
    problems = engine_problems(vllm_config)
    try:
        plan_adapter = binding.plan_adapter(ctx)
    except UserError as e:  # the model's config cannot be described by the adapter's spec
        return problems + [str(e)], None, None
    problems = scope.problems(deployment, adapter.name) + problems
    try:
        plan_adapter.spec("full").shard(deployment.tp)
    except UserError as e:
        problems.append(str(e))
    problems += [p for p in binding.problems(ctx) if p not in problems]
    if problems:
        return problems, ctx, None
    try:
        sites = SiteTable.build(plan_adapter, ctx.registry, ctx.hardware, ctx.deployment, ctx.max_batch)
    except UserError as e:
        return [str(e)], ctx, None
    mark = getattr(binding, "stock_sites", None)  # optional: a binding whose sites the plan serves whole
    if mark is not None:
        mark(ctx, sites)
    return sites.problems(), ctx, (binding, sites)


def install(model: Any, vllm_config: Any) -> DecodeOverride:
    """Check collectively, bind and install on this worker's model (raises DeploymentScopeError)."""
    rank, group = _world()
    problems, ctx, bound = _local_problems(model, vllm_config, rank)
    everyone = gather_problems(problems, group)
    name = ctx.adapter.name if ctx is not None else "/".join(_architectures(vllm_config)) or "model"
    if everyone:
        raise DeploymentScopeError(name, everyone)
    assert ctx is not None and bound is not None  # no problems on this rank means it was bound
    binding, sites = bound
    step = binding.bind(ctx, sites)
    template = os.environ.get(TRACE_ENV, "").strip()
    writer = TraceWriter(ctx.trace, trace_path(template, rank) if template else None,
                         extra={"model": ctx.adapter.name, "rank": rank, "backend": backend_config.OURS})
    gate = DecodeGate(max_batch=ctx.max_batch, buckets=sites.buckets,  # the planned buckets: one bucket rule
                      spec_tokens=ctx.adapter.scope().spec_tokens)
    override = DecodeOverride(model.forward, step, gate=gate, trace=ctx.trace, writer=writer)
    model.forward = override  # this instance only: vLLM's class and every other model stay stock
    _ACTIVE.update(override=override, writer=writer)
    smallest = min(sites.plans)
    first = sites.plans[smallest]
    with writer.lock:
        for c in first.choices:
            impl = c.impl.name if c.impl is not None else "NONE"
            ctx.trace.site(c.site.name, impl, sites.reason(smallest, c.site.name))
        ctx.trace.note(f"installed on rank {rank}: buckets {sorted(sites.plans)}, max batch {ctx.max_batch}",
                       buckets=sorted(sites.plans), deployment=ctx.deployment.model_dump())
        writer.touched()
    if rank == 0:
        log.info("latency_specialized: decode override installed for %s (%s)\n%s\n%s", ctx.adapter.name,
                 ctx.deployment.model_dump(), first.to_text(refusals=False), _served_text(sites, min(sites.plans)))
    return override


def _served_text(sites: SiteTable, bucket: int) -> str:
    """What serves each site of the program (the sites vLLM's own modules serve named, with why)."""
    lines = [f"  served (bucket {bucket}):"]
    for c in sites.plans[bucket].choices:
        why = sites.reason(bucket, c.site.name)
        lines.append(f"    {c.site.name:<34} {c.impl.name if c.impl is not None else 'NONE'}"
                     + (f"  ({why})" if why else ""))
    return "\n".join(lines)
