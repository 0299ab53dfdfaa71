"""Op families and their implementations.

An op family (``gemm``, ``norm``, ``moe.experts`` ...) has one calling convention, a plain-torch
reference, and any number of implementations. An implementation declares ``supports(ctx)``: it
returns ``True``, or a short reason why it cannot serve that context (arch, dtype, shape, token
count, world size). The planner asks every implementation, highest priority first, and keeps the
reasons of those that refused so that ``explain`` can print them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from latency_specialized.errors import PluginError

Support = bool | str
"""``True`` when an implementation serves a context, else the reason it does not."""

# The families DESIGN.md names; an implementation for any other family is a plugin error.
FAMILIES: dict[str, str] = {
    "gemm": "decode projections y = x W^T (+ residual), shape-adaptive",
    "norm": "RMSNorm variants: residual-fused, gated, zero-centred",
    "allreduce": "all-reduce fused with residual add and RMSNorm",
    "moe.router": "router scores, bias-corrected top-k, renormalise, scaling",
    "moe.gate_down": "router logits (fp32) and latent input of a latent MoE from one read of the hidden state",
    "moe.experts": "routed experts over the selected experts only (gate/up + act + down + combine)",
    "mlp": "dense gated MLP (gate/up + activation + down): dense layers and shared experts",
    "prefetch": "warm the L2 with upcoming weights from a side stream",
    "attention.kda": "KDA decode: conv, gated delta-rule state update, read-out, gated norm",
    "attention.mla": "MLA decode, absorbed form over a paged latent KV cache",
    "attention.gqa": "GQA decode over a paged KV cache, optional sliding window",
    "attention.sparse": "top-k index attention (DSA-style)",
    "attention.dcp_merge": "merge partial attention outputs by LSE across context-parallel ranks",
    "residual.attnres": "Block AttnRes: softmax mix of RMS-normed block outputs by a learned query (+ RMSNorm)",
}


@dataclass(frozen=True)
class OpContext:
    """Everything an implementation may look at to decide whether it serves an op site."""

    family: str
    """Op family."""
    arch: str
    """'cpu' or 'sm_XY'."""
    dtype: str
    """Activation dtype name ('bfloat16', 'float32' ...)."""
    tokens: int
    """Rows M processed per call (batch bucket x (1 + speculative tokens))."""
    world_size: int = 1
    """Ranks of the communicator (allreduce) or TP size."""
    dims: tuple[tuple[str, int], ...] = ()
    """Static named sizes, e.g. (('N', 12288), ('K', 7168))."""
    attrs: tuple[tuple[str, Any], ...] = ()
    """Static non-size attributes, e.g. (('score_func', 'sigmoid'),)."""

    def dim(self, name: str) -> int:
        for k, v in self.dims:
            if k == name:
                return v
        raise KeyError(f"op context of {self.family} has no dim {name!r}")

    def attr(self, name: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == name:
                return v
        return default

    def describe(self) -> str:
        dims = " ".join(f"{k}={v}" for k, v in self.dims)
        attrs = " ".join(f"{k}={v}" for k, v in self.attrs)
        return " ".join(x for x in (f"M={self.tokens}", dims, attrs, self.dtype) if x)


def make_context(family: str, *, arch: str, dtype: str, tokens: int, world_size: int = 1,
                 dims: Mapping[str, int] | None = None, attrs: Mapping[str, Any] | None = None) -> OpContext:
    """Build an OpContext from plain mappings (sorted, so equal contexts hash equal)."""
    return OpContext(family, arch, dtype, tokens, world_size,
                     tuple(sorted((dims or {}).items())), tuple(sorted((attrs or {}).items())))


@dataclass(frozen=True)
class Implementation:
    """One way to compute an op family."""

    family: str
    """Family it implements."""
    name: str
    """Unique name, e.g. 'gemm.cutedsl_gemv'."""
    fn: Callable[..., Any]
    """The callable, with the family's calling convention."""
    supports: Callable[[OpContext], Support]
    """True, or the reason it refuses a context."""
    priority: int = 0
    """Higher wins among the implementations that support a context. References use -100."""
    description: str = ""
    """One line for `explain`."""
    provider: str = "latency_specialized"
    """Plugin that registered it."""
    is_reference: bool = False
    """The plain-torch oracle of the family."""
    prepare: Callable[..., Any] | None = field(default=None, compare=False)
    """Optional warm-up/compile hook called with the context before graph capture."""
    strided_rows: bool = False
    """Takes a 2-D input ``x`` whose rows are strided (a column slice of a wider tensor: unit column
    stride, 16-byte aligned row starts) without copying it; else callers pass contiguous rows."""
    strided_out: bool = False
    """Writes its 2-D output(s) into ``out=`` tensors with strided rows (a column slice of a wider tensor)
    directly, without a temporary and a copy: a program may then hand it a slice of a collective's buffer."""
    norm_prologue: bool = False
    """gemm: takes ``norm_weight=``/``norm_eps=`` and RMS-normalises x itself (y = rmsnorm(x) @ W^T, the
    norm rounded to the activation dtype as the norm op rounds it; x may be a strided column slice).
    A program then skips the norm site in front of such a gemm (one kernel less)."""


def always(_: OpContext) -> Support:
    return True


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

        ``only`` forces one implementation by name (a refusal then returns None).
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
            except Exception as e:  # a buggy supports() must not take the planner down
                ok = f"supports() raised {type(e).__name__}: {e}"
            if ok is True:
                return impl, refusals
            refusals.append((impl.name, str(ok) if ok else "not supported"))
        return None, refusals
