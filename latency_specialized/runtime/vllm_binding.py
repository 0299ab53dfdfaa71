"""The contract between the vLLM integration and an adapter's vLLM binding, and the generic decode
step every binding returns: the runtime's :class:`~latency_specialized.runtime.composed.ComposedProgram`
run over vLLM's own tensors.

It sits at the runtime layer, below the adapters that implement it (``models/<name>/vllm.py``) and
the integration that drives it (``latency_specialized/vllm/``, which re-exports it as
``latency_specialized.vllm.binding``).

An adapter with the ``vllm`` capability returns a :class:`VllmBinding` from ``vllm_binding()``.
At model load the integration, on every rank:

1. builds a :class:`SiteTable` - the plans of every batch bucket (``ops.plan.buckets_upto``: the
   planner's one bucket rule, which the gate uses too) from the binding's ``plan_adapter(ctx)``;
2. lists this rank's problems: ``binding.problems(ctx)``, after ``binding.stock_sites(ctx, sites)``
   marked the sites vLLM's own modules serve, the sites no implementation serves
   (:meth:`SiteTable.problems`) - gathered collectively (:mod:`latency_specialized.vllm.scope`);
3. calls ``binding.bind(ctx, sites)``, which returns the decode step
   ``step(input_ids, positions, batch) -> hidden_states``: a :class:`VllmComposedStep` over the
   model's own weights (views of vLLM's parameters) and KV caches.

The integration owns the gate (pure decode? batch in scope?) and the trace.

What serves each op site is the plan's :class:`~latency_specialized.ops.plan.SiteChoice` - the same
object the program's :class:`~latency_specialized.runtime.op_table.OpTable` binds:

* an op site runs the implementation its plan chose: a fast one where there is one, the plain-torch
  reference on the CPU (there it is the backend's implementation, and serving with it checks the
  binding against stock vLLM);
* a site vLLM's own module serves (``SiteChoice.stock`` set by :meth:`SiteTable.serve_stock`, impl
  name 'stock'): today ``attn.gqa`` - vLLM's ``Attention`` layer, with its paged KV cache, backend
  kernels and per-step metadata (:class:`VllmAttention`);
* a site no implementation serves, or only the reference on a GPU (slower than stock there, and the
  composed program has no per-site stock module to fall back on), is a start-time problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Protocol

import torch

from latency_specialized.adapter_contract import AdapterContract as ModelAdapter  # the contract (foundation layer)
from latency_specialized.errors import UserError
from latency_specialized.hardware import Hardware
from latency_specialized.ops.plan import Plan, SiteChoice, bucket_of, buckets_upto, build_plan
from latency_specialized.ops.registry import Implementation, ImplementationRegistry, always
from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
from latency_specialized.runtime.composed import ComposedModel, ComposedProgram, Weights
from latency_specialized.runtime.states import ModelStates
from latency_specialized.spec import Deployment
from latency_specialized.trace import Trace

STOCK = "stock"
"""Implementation name of sites served by vLLM's own module (``SiteChoice.stock`` holds why)."""


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

    def stock_sites(self, ctx: BindContext, sites: "SiteTable") -> None:
        """Mark the sites vLLM's own modules serve (``sites.serve_stock``), before the collective check
        (optional: without it the plans serve every site)."""

    def bind(self, ctx: BindContext, sites: "SiteTable") -> DecodeStep:
        """Build the decode step over the model's own weights; called once all ranks passed."""


# ---------------------------------------------------------------------------------------------- sites
@dataclass
class SiteTable:
    """The plans of every bucket of one vLLM deployment; what serves a site is the plan's SiteChoice."""

    plans: dict[int, Plan]
    """Bucket -> plan (``ops.plan.buckets_upto``), with the stock sites applied."""
    allow_reference: bool
    """References may serve (CPU); on GPUs a site only the reference serves is a start-time problem."""
    stock: dict[str, str] = field(default_factory=dict)
    """Site -> why vLLM's own module serves it (every bucket)."""

    @classmethod
    def build(cls, adapter: ModelAdapter, registry: ImplementationRegistry, hardware: Hardware,
              deployment: Deployment, max_batch: int) -> "SiteTable":
        """Plans of ``adapter.spec("full")`` for every bucket a batch of 1..``max_batch`` gets under the
        adapter's scope limit (``ops.plan.buckets_upto``)."""
        buckets = buckets_upto(max_batch, max(max_batch, adapter.scope().max_batch))
        plans = {b: build_plan(adapter, registry, hardware, tp=deployment.tp, batch=b, dtype=deployment.dtype,
                               spec_tokens=deployment.spec_tokens, variant="full") for b in buckets}
        return cls(plans, allow_reference=not hardware.is_gpu)

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self.plans))

    def bucket(self, batch: int) -> int:
        """The bucket of ``batch`` (``ops.plan.bucket_of`` over the planned buckets)."""
        b = bucket_of(batch, self.plans)
        if b is None:
            raise ValueError(f"batch {batch} beyond the largest planned bucket {max(self.plans)}")
        return b

    def serve_stock(self, site: str, fn: Callable[..., Any], reason: str) -> None:
        """vLLM's own module serves ``site`` in every bucket: each plan's choice becomes a SiteChoice with
        ``stock=reason`` whose implementation ('stock') calls ``fn`` (the family's calling convention);
        the planner's pick is kept among the refusals, naming why it does not serve."""
        if any(all(c.site.name != site for c in plan.choices) for plan in self.plans.values()):
            raise UserError(f"serve_stock: the plans have no op site {site!r} (sites come from the pieces' op_sites)")
        self.stock[site] = reason
        for plan in self.plans.values():
            for i, c in enumerate(plan.choices):
                if c.site.name != site:
                    continue
                impl = Implementation(c.site.family, STOCK, fn, always, description=reason, provider="vllm")
                superseded = ((c.impl.name, f"not used: {reason}"),) if c.impl is not None else ()
                plan.choices[i] = replace(c, impl=impl, inner=(), refusals=c.refusals + superseded, stock=reason)

    def choice(self, bucket: int, site: str) -> SiteChoice:
        """The plan's SiteChoice of ``site`` at ``bucket`` (what the program's op table binds)."""
        return self.plans[bucket].choice(site)

    def reason(self, bucket: int, site: str) -> str:
        """One line on what serves ``site`` where it is not simply the plan's implementation."""
        c = self.choice(bucket, site)
        if c.stock:
            return c.stock
        return self.plans[bucket].skipped_sites().get(site, "")

    def problems(self) -> list[str]:
        """Sites of any bucket that nothing can serve (no implementation; only the reference on a GPU)."""
        out: list[str] = []
        for bucket, plan in sorted(self.plans.items()):
            skipped = plan.skipped_sites()
            for c in plan.choices:
                if c.stock or c.site.name in skipped:
                    continue
                if c.impl is None:
                    why = "; ".join(f"{n}: {r}" for n, r in c.refusals) or "none registered"
                    p = f"no implementation serves {c.site.name} ({why})"
                elif c.impl.is_reference and not self.allow_reference:
                    p = (f"only the reference ({c.impl.name}) serves {c.site.name} on {plan.hardware.arch}, slower "
                         "than stock vLLM")
                else:
                    continue
                if p not in out:
                    out.append(p)
        return out


# ---------------------------------------------------------------------------------------------- attention
class VllmAttention:
    """``attention.gqa`` served by vLLM's own ``Attention`` layer of each layer (site impl 'stock').

    Called with the family's convention (``q, k_cache, v_cache, block_table, seq_lens, scale=, window=,
    sinks=, k=, v=, slot_mapping=``): the layer is found by the state it is handed - the program's
    ``k`` state of that layer is a view of the layer's own KV cache (:func:`kv_state_views`,
    registered by :meth:`bind_states`) - and it is called on the step's live rows ``[:live]``:
    vLLM writes ``k`` / ``v`` into its cache at its own slot mapping and attends with its backend and
    its metadata (the same step's, from vLLM's forward context). Padded rows of the bucket return
    zeros. ``scale`` / ``window`` / ``sinks`` are the binding's to check against the layer at start
    (the layer applies its own); the cache views' block interior is the backend's layout, which only
    vLLM's layer reads.
    """

    def __init__(self, layers: Mapping[int, Any]):
        self.layers = dict(layers)
        """Layer index -> vLLM Attention module."""
        self.live = 0
        """Rows of the current step that are real tokens (set per step by :class:`VllmComposedStep`)."""
        self._by_state: dict[int, Any] = {}

    def bind_states(self, states: ModelStates) -> None:
        """Map each layer's ``k`` state (a view of that layer's vLLM cache) to its Attention module."""
        self._by_state = {states.layer(i)["k"].data_ptr(): module for i, module in self.layers.items()}

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, *, scale: float | None = None, window: int | None = None,
                 sinks: torch.Tensor | None = None, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                 slot_mapping: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 cross_row_reads: bool = False) -> torch.Tensor:
        # cross_row_reads (the contract's verification-step flag) needs nothing here: vLLM's layer caches the
        # call's new k / v before its attention reads them
        layer = self._by_state.get(k_cache.data_ptr())
        if layer is None:
            raise UserError("attention.gqa (stock): the KV state is not a bound vLLM cache view: build the "
                            "program's states with kv_state_views and VllmAttention.bind_states")
        if k is None or v is None:
            raise UserError("attention.gqa (stock): vLLM's Attention layer writes the new token itself: pass k, v "
                            "and slot_mapping (the KV-write convention)")
        n, M = self.live, q.shape[0]
        o = layer(q[:n], k[:n], v[:n]).view(n, *q.shape[1:])
        if n == M and out is None:
            return o
        y = out if out is not None else q.new_empty(q.shape)
        y[:n].copy_(o)
        y[n:].zero_()
        return y


def kv_state_views(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` views ``[num_blocks, block_size, KV, D]`` of one layer's vLLM KV cache (no copy): the
    paged states the GQA piece declares, over vLLM's own tensor.

    vLLM 0.32's CPU backend (``CPU_ATTN``) keeps ``[num_blocks, KV, block_size, 2 * D]`` and reads it as
    ``[num_blocks, KV, 2 * block_size, D]``, keys in the first half of each head's block row, values in
    the second; the views are those halves with the block and head axes swapped. Their block interior
    is the backend's own (it may pack it per ISA): only vLLM's layer reads them (:class:`VllmAttention`).
    Another layout is a UserError naming it."""
    KV, D = num_kv_heads, head_dim
    if kv_cache.dim() == 4 and kv_cache.shape[1] == KV and kv_cache.shape[3] == 2 * D:
        nb, _, bs, _ = kv_cache.shape
        k, v = kv_cache.view(nb, KV, 2 * bs, D).chunk(2, dim=2)
        return k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    raise UserError(f"vLLM KV cache of shape {list(kv_cache.shape)} ({kv_cache.dtype}): not the CPU backend's "
                    f"[blocks, {KV} heads, block_size, 2 x {D}] layout, the only one bound so far")


def forward_metadata(layer_name: str) -> Any:
    """The attention metadata of ``layer_name`` in vLLM's current forward context (None outside one)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    meta = get_forward_context().attn_metadata
    if isinstance(meta, dict):
        return meta.get(layer_name)
    return meta


# ---------------------------------------------------------------------------------------------- step
class VllmComposedStep:
    """The decode step of a vLLM binding: a :class:`ComposedProgram` over vLLM's weights and KV caches.

    Parameters
    ----------
    model : the composed model of the loaded config (unsharded spec; ``head=None``: vLLM's
        ``compute_logits`` stays the head, the program's output is the final hidden state).
    weights : this rank's weights ``{layer: {role: {local: tensor}}}`` - views of vLLM's parameters.
    sites : the plans (with the stock sites applied) the program binds, one per bucket.
    attention : the :class:`VllmAttention` of the layers (their KV caches become the program's states),
        the callable the binding gave ``SiteTable.serve_stock`` for the ``attn.gqa`` sites.
    metadata_layer : name of the attention layer whose metadata describes the step (slot mapping,
        block table, sequence lengths; one KV-cache group).
    comm : communicator of the all-reduce sites (None: TP=1).

    The program is built at the first step, when vLLM has bound its KV caches (after the model load,
    which is when the binding runs), and rebuilt if vLLM rebinds them. Per step, rows ``[:batch]`` of
    the static buffers take vLLM's token ids and positions and the slot mapping, block table and
    sequence lengths of its attention metadata; rows up to the bucket are padding (slot -1, length 0).
    Returns rows ``[:batch]`` of the program's ``hidden`` output (a view of its static buffer, as
    vLLM's own CUDA-graph path returns its graph's output).
    """

    def __init__(self, model: ComposedModel, weights: Weights, sites: SiteTable, attention: VllmAttention, *,
                 metadata_layer: str, comm: Any = None, metadata_fn: Callable[[str], Any] = forward_metadata):
        if model.head is not None:
            raise UserError("the vLLM binding's composed model has no head (vLLM's compute_logits is): build it "
                            "with head=None")
        self.model, self.weights, self.sites, self.comm = model, weights, sites, comm
        self.attention = attention
        self.tp = comm.world_size if comm is not None else 1
        self.metadata_layer, self.metadata_fn = metadata_layer, metadata_fn
        self.program: ComposedProgram | None = None
        """The program (None until the first step)."""
        self.buffers: DecodeBuffers | None = None
        self.trace = Trace()
        """The program's own trace (sites bound per bucket); the worker's trace is the integration's."""
        self._caches: tuple[int, ...] = ()

    # ------------------------------------------------------------------ construction
    def _bound_caches(self) -> tuple[torch.Tensor, ...]:
        caches = tuple(m.kv_cache for _, m in sorted(self.attention.layers.items()))
        if any(not isinstance(c, torch.Tensor) or c.numel() == 0 for c in caches):
            raise UserError("vLLM has not bound its KV caches yet: a decode step before the cache was allocated")
        return caches

    def _build(self, caches: tuple[torch.Tensor, ...]) -> ComposedProgram:
        tp = self.tp
        rank_spec = self.model.spec.shard(tp) if tp > 1 else self.model.spec
        tensors = {}
        for i, kv in zip(sorted(self.attention.layers), caches):
            a = rank_spec.layers[i].attention
            k, v = kv_state_views(kv, a.num_kv_heads, a.head_dim)
            tensors[i] = {"k": k, "v": v}
        states = ModelStates.external(self.model, tensors, tp=tp)
        self.attention.bind_states(states)
        return ComposedProgram(self.model, self.weights, self.sites.plans, states, comm=self.comm, trace=self.trace,
                               weights_sharded=True)

    def _ensure(self, meta: Any) -> ComposedProgram:
        caches = self._bound_caches()
        ptrs = tuple(c.data_ptr() for c in caches)
        if self.program is None or ptrs != self._caches:
            self.program, self._caches, self.buffers = self._build(caches), ptrs, None
        width = int(meta.block_table.shape[1])
        if self.buffers is None or self.buffers.spec.max_blocks_per_seq < width:
            states = self.program.states
            self.buffers = DecodeBuffers(BufferSpec(max_batch=self.program.max_batch, max_blocks_per_seq=width,
                                                    block_size=states.block_size or 1), device=self.program.device)
        return self.program

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: int) -> torch.Tensor:
        meta = self.metadata_fn(self.metadata_layer)
        if meta is None:
            raise UserError(f"no attention metadata for {self.metadata_layer}: the decode gate lets only steps "
                            "with metadata through")
        program = self._ensure(meta)
        buf, n, bucket = self.buffers, batch, self.sites.bucket(batch)
        assert buf is not None
        width = int(meta.block_table.shape[1])
        buf.tokens[:n].copy_(input_ids[:n])
        buf.positions[:n].copy_(positions[:n])
        buf.slot_mapping[:n].copy_(meta.slot_mapping[:n])
        buf.seq_lens[:n].copy_(meta.seq_lens[:n])
        buf.block_tables[:n, :width].copy_(meta.block_table[:n])
        buf.block_tables[:n, width:].zero_()
        for t, pad in ((buf.tokens, 0), (buf.positions, 0), (buf.slot_mapping, -1), (buf.seq_lens, 0),
                       (buf.block_tables, 0)):
            t[n:bucket].fill_(pad)
        self.attention.live = n
        program.step(buf, bucket)
        assert program.hidden is not None
        out = program.hidden[:n]
        rows = int(input_ids.shape[0])
        if rows > n:  # vLLM padded the step: its padding rows get zeros (never sampled)
            out = torch.cat([out, out.new_zeros(rows - n, out.shape[1])])
        return out


__all__ = ["STOCK", "BindContext", "DecodeStep", "VllmBinding", "SiteTable", "SiteChoice", "VllmAttention",
           "VllmComposedStep", "kv_state_views", "forward_metadata"]
