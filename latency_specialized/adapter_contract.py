"""The contract between the backend and one model: what the planner and the adapter registry ask.

An adapter names its model, gives its architecture (:meth:`AdapterContract.spec`), says what its
fast path supports (:meth:`scope`), and lists the op sites of one decode step (:meth:`op_sites`).
Adapters that can run also provide a reference, a program and a vLLM binding; ``capabilities`` says
which exist so that the test matrix and the CLI only ask for what is there.

This is the foundation-level contract: the planner (``ops/plan.py``), the plugin registry and the
runtime hold adapters as ``AdapterContract``. Adapters subclass :class:`latency_specialized.adapter.ModelAdapter`
(composition layer), whose default ``op_sites`` composes the standard pieces of the spec - a default
that needs ``latency_specialized.pieces``, so it cannot live down here.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from latency_specialized.errors import UserError
from latency_specialized.spec import DecodeScope, Deployment, LinearFormat, ModelSpec, ParallelSpec

Variant = Literal["full", "medium", "tiny"]
"""full: the published architecture; tiny: a few narrow layers every adapter with a reference offers
(CPU tests); medium: optional, a few layers at widths the GPU kernels serve (``variants`` says who has it)."""

Capability = Literal["spec", "reference", "program", "checkpoint", "vllm", "quantized_experts"]


class AdapterContract:
    """What every adapter is (built-in or third-party); subclass ``latency_specialized.adapter.ModelAdapter``."""

    name: ClassVar[str] = ""
    """Registry name, e.g. 'kimi_k3'."""
    description: ClassVar[str] = ""
    """One line for `latency-specialized models`."""
    hf_architectures: ClassVar[tuple[str, ...]] = ()
    """`architectures` values of the Hugging Face config this adapter serves."""
    capabilities: ClassVar[frozenset[str]] = frozenset({"spec"})
    """What this adapter provides beyond a spec (see Capability)."""
    variants: ClassVar[tuple[str, ...]] = ("full", "tiny")
    """Spec variants :meth:`spec` accepts (see Variant)."""
    native_linears: ClassVar[LinearFormat | None] = None
    """How the release stores its dense projections where the adapter keeps them so (``reference(linear_format=
    'native')``, ``generate --linears native``, the matrix's ``-dense-`` cells); None: dequantised at load."""

    # ------------------------------------------------------------------ required
    def spec(self, variant: Variant = "full") -> ModelSpec:
        raise UserError(f"{self.name}: adapter defines no spec")

    def scope(self) -> DecodeScope:
        raise UserError(f"{self.name}: adapter defines no scope")

    # ------------------------------------------------------------------ derived
    def op_sites(self, spec: ModelSpec, parallel: ParallelSpec, tokens: int, arch: str, dtype: str, *,
                 context: int | None = None) -> list[Any]:
        """Op sites (``ops.sites.OpSite``) of one decode step on one rank (``spec`` full or sharded for
        ``parallel.tp``); ``context``: the longest sequence the plan serves (None: not given), which the
        attention sites carry (``SiteBuilder(context=...)``). ``ModelAdapter`` composes them from the
        spec's standard pieces."""
        raise UserError(f"{self.name}: adapter defines no op sites (subclass latency_specialized.adapter.ModelAdapter "
                        "for the sites of the spec's standard pieces, or define op_sites)")

    def check(self, deployment: Deployment, variant: Variant = "full") -> list[str]:
        """Every reason ``deployment`` is outside this adapter's fast path (empty: in scope)."""
        problems = self.scope().problems(deployment, self.name, max_context=self.spec(variant).max_context)
        try:
            self.spec(variant).shard(deployment.tp)
        except UserError as e:
            msg = str(e)
            if msg not in " ".join(problems):
                problems.append(msg)
        return problems

    # ------------------------------------------------------------------ optional
    def reference(self, spec: ModelSpec, **kw: Any) -> Any:
        raise UserError(f"{self.name}: no torch reference yet (capabilities: {sorted(self.capabilities)})")

    def program(self, spec: ModelSpec, **kw: Any) -> Any:
        raise UserError(f"{self.name}: no decode program yet (capabilities: {sorted(self.capabilities)})")

    def verify_cell(self, cell: Any, comm: Any = None) -> Any:
        """Run the decode program against the reference for one test-matrix cell on this rank.

        ``cell`` is a latency_specialized.testing.matrix.Cell; ``comm`` the rank's communicator
        (None for TP=1). Returns a CellResult. Adapters with the 'program' capability implement it.
        """
        raise UserError(f"{self.name}: no decode program to verify yet (capabilities: {sorted(self.capabilities)})")

    def vllm_binding(self) -> Any:
        raise UserError(f"{self.name}: no vLLM binding yet (capabilities: {sorted(self.capabilities)})")

    def layer_bench(self) -> Any:
        """The "ours" side of ``latency-specialized bench`` (``bench/layer_bench.py``): an object with
        ``build_ours(full_spec, tp, kind, layers, batches, device, *, seed, say, contexts, steps[, routing])`` returning
        the K-layer / 1-layer graphed programs the bench times (``runtime.layer_harness.LayerBenchHarness``
        over the adapter's pieces and ``bench_spec``).
        The bench reaches an adapter's harness only through this hook, so a third-party adapter can be benched."""
        raise UserError(f"{self.name}: no graphed layer-bench program (the adapter defines no layer_bench())")

    def __repr__(self) -> str:
        return f"<adapter {self.name}>"


class SpecBoundAdapter:
    """An adapter whose ``spec()`` returns one given spec (a checkpoint's, or one with its experts kept
    quantized), for ``build_plan``; everything else is the adapter's."""

    def __init__(self, adapter: Any, spec: ModelSpec):
        self._adapter, self._spec = adapter, spec
        self.name = adapter.name

    def spec(self, variant: str = "full") -> ModelSpec:
        return self._spec

    def op_sites(self, spec: ModelSpec, parallel: ParallelSpec, tokens: int, arch: str, dtype: str, *,
                 context: int | None = None) -> list[Any]:
        """The adapter's sites of the bound spec (``spec``: it, or its shard for ``parallel.tp``)."""
        if spec.tp != 1:
            if self._spec.tp != 1 or self._spec.shard(spec.tp) != spec:
                raise UserError(f"{self.name}: op sites of a TP={spec.tp} shard that is not the bound spec's")
            spec = self._spec
        return self._adapter.op_sites(spec, parallel, tokens, arch, dtype, context=context)

    def __getattr__(self, item: str) -> Any:
        return getattr(self._adapter, item)
