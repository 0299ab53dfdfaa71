"""Op families and their implementations.

An op family (``gemm``, ``norm``, ``moe.experts`` ...) has one calling convention, a plain-torch
reference, and any number of implementations. An implementation declares ``supports(ctx)``: it
returns ``True``, or a short reason why it cannot serve that context (arch, dtype, shape, token
count, world size). The planner asks every implementation, highest priority first, and keeps the
reasons of those that refused so that ``explain`` can print them.
"""

from __future__ import annotations

from typing import Iterable

# The implementation contract lives in the foundation (kernels use it too); re-exported here.
from latency_specialized.contract import Implementation, OpContext, Support, always, make_context
from latency_specialized.errors import PluginError

__all__ = ["FAMILIES", "Implementation", "ImplementationRegistry", "OpContext", "Support", "always", "make_context"]

# The families DESIGN.md names; an implementation for any other family is a plugin error.
FAMILIES: dict[str, str] = {
    "gemm": "decode projections y = x W^T (+ residual), shape-adaptive",
    "norm": "RMSNorm variants: residual-fused, gated, zero-centred",
    "allreduce": "all-reduce fused with residual add and RMSNorm",
    "moe.router": "router scores, bias-corrected top-k, renormalise, scaling",
    "moe.gate_down": "router logits (fp32) and latent input of a latent MoE from one read of the hidden state",
    "moe.experts": "routed experts over the selected experts only (gate/up + act + down + combine)",
    "moe.finalize": "per-route RMSNorm of the routed experts' outputs (optional gain before/after), fp32 weighted sum over top-k",
    "mlp": "dense gated MLP (gate/up + activation + down): dense layers and shared experts",
    "prefetch": "warm the L2 with upcoming weights from a side stream",
    "attention.kda": "KDA decode: conv, gated delta-rule state update, read-out, gated norm",
    "attention.kda_verify": "KDA over 1 + k tokens per request in order (spec-decode verify), per-token rollback tape",
    "attention.kda_accept": "KDA rollback: live states moved on to the accepted prefix from the verify tape",
    "attention.mla": "MLA decode, absorbed form over a paged latent KV cache",
    "attention.gqa": "GQA decode over a paged KV cache, optional sliding window",
    "attention.qk_norm_rope": "per-head RMSNorm of q and k (weighted or weightless) + RoPE from a fused qkv projection",
    "attention.sparse": "top-k index attention (DSA-style)",
    "attention.dcp_merge": "merge partial attention outputs by LSE across context-parallel ranks",
    "residual.attnres": "Block AttnRes: softmax mix of RMS-normed block outputs by a learned query (+ RMSNorm)",
    "residual.mhc": "mHC seam: fold the sublayer output into n streams (post/comb), Sinkhorn coefficients, carried-pre collapse + RMSNorm",
    "residual.gated": "residual join: post-sublayer RMSNorm (weightless/weighted/input-scaled), plain or norm-preserving gated add, next RMSNorm",
    "attention.indexer": "DSA indexer: key LayerNorm + RoPE + key-cache write, relu-weighted scores, static-width top-k",
    "attention.sparse_mla": "absorbed MLA decode over an indexer's top-k of a paged latent cache",
    "attention.sparse_mqa": "sparse MQA decode over a sliding-window ring + selected compressed rows, sinks, output inverse RoPE",
    "attention.sparse_mqa_compress": "sparse MQA compressor: pending-row write, softmax-gated pool, RMSNorm, RoPE, compressed-cache write",
    "attention.sparse_mqa_compress_index": "sparse MQA compressor + the indexer's new key: key projection, RMSNorm, RoPE, index-key cache write",
}


class ImplementationRegistry:
    """All implementations, per family, in priority order."""

    def __init__(self) -> None:
        self._by_family: dict[str, list[Implementation]] = {f: [] for f in FAMILIES}
        self._names: dict[str, Implementation] = {}

    def register(self, impl: Implementation) -> None:
        if impl.family not in self._by_family:
            raise PluginError(f"{impl.provider}: implementation {impl.name} names unknown family "
                              f"'{impl.family}' (use one of {', '.join(FAMILIES)})")
        if impl.name in self._names:
            old = self._names[impl.name]
            if old.fn is impl.fn:
                return  # idempotent re-registration
            raise PluginError(f"{impl.provider}: implementation name {impl.name} is already registered "
                              f"by {old.provider}; pick a unique name")
        self._names[impl.name] = impl
        self._by_family[impl.family].append(impl)
        self._by_family[impl.family].sort(key=lambda i: (-i.priority, i.name))

    def family(self, name: str) -> list[Implementation]:
        if name not in self._by_family:
            raise KeyError(f"unknown op family {name!r}")
        return list(self._by_family[name])

    def get(self, name: str) -> Implementation:
        return self._names[name]

    def reference(self, family: str) -> Implementation:
        for impl in self._by_family[family]:
            if impl.is_reference:
                return impl
        raise LookupError(f"op family {family} has no reference registered")

    def __iter__(self) -> Iterable[Implementation]:
        return iter(self._names.values())

    def select(self, ctx: OpContext, *, only: str | None = None,
               allow_reference: bool = True) -> tuple[Implementation | None, list[tuple[str, str]]]:
        """The best implementation for ``ctx`` and the (name, reason) of every one refused first.

        ``only`` forces one implementation by name (a refusal then returns None). An implementation with
        inner op calls (``Implementation.inner``) serves only where each of them has a fast implementation.
        """
        refusals: list[tuple[str, str]] = []
        for impl in self._by_family[ctx.family]:
            if only is not None and impl.name != only:
                continue
            if impl.is_reference and not allow_reference:
                refusals.append((impl.name, "reference not allowed here"))
                continue
            try:
                ok = impl.supports(ctx)
                if ok is True and impl.inner is not None:
                    ok = self._inner_problem(impl, ctx)
            except Exception as e:  # a buggy supports() must not take the planner down
                ok = f"supports() raised {type(e).__name__}: {e}"
            if ok is True:
                return impl, refusals
            refusals.append((impl.name, str(ok) if ok else "not supported"))
        return None, refusals

    def inner_choices(self, impl: Implementation, ctx: OpContext
                      ) -> list[tuple[str, OpContext, Implementation | None, list[tuple[str, str]]]]:
        """``(role, context, implementation or None, refusals)`` of every inner op call of ``impl`` at
        ``ctx`` (``Implementation.inner``): the best *fast* implementation of each, as :meth:`select`
        picks it (references are never chosen inside another implementation). Empty without ``inner``."""
        if impl.inner is None:
            return []
        out = []
        for role, inner_ctx in impl.inner(ctx):
            chosen, refusals = self.select(inner_ctx, allow_reference=False)
            out.append((role, inner_ctx, chosen, refusals))
        return out

    def _inner_problem(self, impl: Implementation, ctx: OpContext) -> Support:
        missing = [f"{role} ({c.family} {c.describe()})" for role, c, chosen, _ in self.inner_choices(impl, ctx)
                   if chosen is None]
        return True if not missing else "no fast implementation serves its inner " + ", ".join(missing)
