"""The implementation contract: what an op implementation is and what it is asked (foundation).

Kernels (``latency_specialized/kernels/``) declare their :class:`Implementation` objects against
this contract, and the op families and the planner (``latency_specialized/ops/``) collect and select
them; both import it from here, so a kernel never imports the ops layer. The registry of
implementations and the list of op families stay in ``ops/registry.py`` (which re-exports these
names).

An implementation declares ``supports(ctx)``: it returns ``True``, or a short reason why it cannot
serve that context (arch, dtype, shape, token count, world size). The planner asks every
implementation, highest priority first, and keeps the reasons of those that refused so that
``explain`` can print them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

Support = bool | str
"""``True`` when an implementation serves a context, else the reason it does not."""


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
    """Rows M processed per call (batch bucket x (1 + speculative tokens)): see :attr:`requests`."""
    world_size: int = 1
    """Ranks of the communicator (allreduce) or TP size."""
    dims: tuple[tuple[str, int], ...] = ()
    """Static named sizes, e.g. (('N', 12288), ('K', 7168))."""
    attrs: tuple[tuple[str, Any], ...] = ()
    """Static non-size attributes, e.g. (('score_func', 'sigmoid'),)."""

    @property
    def spec_tokens(self) -> int:
        """Draft tokens per request of a verification step (attr ``spec_tokens``, set by the planner
        when k > 0); 0 for plain decode."""
        return int(self.attr("spec_tokens", 0))

    @property
    def requests(self) -> int:
        """Requests per call: ``tokens / (1 + spec_tokens)``."""
        return self.tokens // (1 + self.spec_tokens)

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
    inner: Callable[[OpContext], Sequence[tuple[str, OpContext]]] | None = field(default=None, compare=False)
    """The op calls this implementation makes inside itself, as ``(role, context)`` pairs for a context it
    serves (e.g. the gate/up and down gemms of a fused MLP). The planner resolves each from the same
    registry (fast implementations only; where one has none, this implementation refuses the site),
    ``explain`` shows them under the site, and the plan binds them: ``fn`` is then called with
    ``inner={role: Implementation}`` - an implementation never chooses other implementations itself."""


def always(_: OpContext) -> Support:
    """``supports`` of an implementation that serves every context (references)."""
    return True
