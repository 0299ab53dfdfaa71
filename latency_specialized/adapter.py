"""The contract between the backend and one model.

An adapter names its model, gives its architecture (:meth:`ModelAdapter.spec`), says what its
fast path supports (:meth:`scope`), and lists the op sites of one decode step
(:meth:`op_sites`; the default derives them from the spec's layer kinds, so an adapter built
from standard blocks needs nothing more to be planned). Adapters that can run also provide a
reference, a program and a vLLM binding; ``capabilities`` says which exist so that the test
matrix and the CLI only ask for what is there.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from latency_specialized.errors import UserError
from latency_specialized.spec import DecodeScope, Deployment, ModelSpec, ParallelSpec

Variant = Literal["full", "medium", "tiny"]
"""full: the published architecture; tiny: a few narrow layers every adapter with a reference offers
(CPU tests); medium: optional, a few layers at widths the GPU kernels serve (``variants`` says who has it)."""

Capability = Literal["spec", "reference", "program", "checkpoint", "vllm"]


class ModelAdapter:
    """Base class of every adapter (built-in or third-party)."""

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

    # ------------------------------------------------------------------ required
    def spec(self, variant: Variant = "full") -> ModelSpec:
        raise UserError(f"{self.name}: adapter defines no spec")

    def scope(self) -> DecodeScope:
        raise UserError(f"{self.name}: adapter defines no scope")

    # ------------------------------------------------------------------ derived
    def op_sites(self, spec: ModelSpec, parallel: ParallelSpec, tokens: int, arch: str, dtype: str) -> list[Any]:
        """Op sites of one decode step on one rank; default: from the spec's standard blocks."""
        from latency_specialized.ops.sites import standard_op_sites

        return standard_op_sites(spec, parallel, tokens, arch, dtype)

    def check(self, deployment: Deployment, variant: Variant = "full") -> list[str]:
        """Every reason ``deployment`` is outside this adapter's fast path (empty: in scope)."""
        problems = self.scope().problems(deployment, self.name)
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
        ``build_ours(full_spec, tp, kind, layers, batches, device, *, seed, say, contexts, steps)`` returning
        the K-layer / 1-layer graphed programs the bench times (Kimi K3: ``kimi_k3/graphed.py``).
        The bench reaches an adapter's harness only through this hook, so a third-party adapter can be benched."""
        raise UserError(f"{self.name}: no graphed layer-bench program (the adapter defines no layer_bench())")

    def __repr__(self) -> str:
        return f"<adapter {self.name}>"
