"""The adapter base class every model subclasses: the contract, plus op sites from the spec's pieces.

An adapter names its model, gives its architecture (:meth:`ModelAdapter.spec`), says what its
fast path supports (:meth:`scope`), and lists the op sites of one decode step
(:meth:`op_sites`; the default composes the standard pieces of the spec's layer kinds,
``pieces.standard.compose_standard``, and lists their sites - one definition per site kind - so an
adapter built from standard blocks needs nothing more to be planned). Adapters that can run also
provide a reference, a program and a vLLM binding; ``capabilities`` says which exist so that the
test matrix and the CLI only ask for what is there (the contract and its hooks:
``adapter_contract.AdapterContract``, which is what the planner and the registry hold).
"""

from __future__ import annotations

from typing import Any

from latency_specialized.adapter_contract import AdapterContract, Capability, Variant
from latency_specialized.errors import UserError
from latency_specialized.spec import ModelSpec, ParallelSpec

__all__ = ["ModelAdapter", "AdapterContract", "Capability", "Variant"]


class ModelAdapter(AdapterContract):
    """Base class of every adapter (built-in or third-party): the contract with the standard op sites."""

    def composed_model(self, spec: ModelSpec) -> Any:
        """The model as pieces (a ``runtime.composed.ComposedModel``) of the unsharded ``spec``; default:
        the standard pieces of its layer kinds (``pieces.standard.compose_standard``, which names what has
        no piece yet)."""
        from latency_specialized.pieces.standard import compose_standard

        return compose_standard(spec)

    def op_sites(self, spec: ModelSpec, parallel: ParallelSpec, tokens: int, arch: str, dtype: str, *,
                 context: int | None = None) -> list[Any]:
        """Op sites of one decode step on one rank: the sites of :meth:`composed_model` (``spec`` full or
        sharded for ``parallel.tp``; a sharded spec is composed from this adapter's unsharded one)."""
        full = spec
        if spec.tp != 1:
            full = self.spec(spec.variant)  # type: ignore[arg-type]
            if full.tp != 1 or full.shard(spec.tp) != spec:
                raise UserError(f"{self.name}: op sites of a spec sharded for TP={spec.tp} that is not this adapter's "
                                f"{spec.variant!r} spec: pass the unsharded spec")
        return self.composed_model(full).op_sites(spec, parallel, tokens, arch, dtype, context=context)
