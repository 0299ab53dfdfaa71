"""Op sites of a decode step: :class:`OpSite` and the :class:`SiteBuilder` pieces declare them with.

An op site is one call of an op family inside the decode step of one rank, e.g. the output
projection of every KDA layer. Layers of the same kind have identical shapes, so a site stands
for all layers of its kind (``layers`` lists them) and the plan stays readable: a Kimi K3 step
has ~40 distinct sites, not 900. Which sites a step has is the pieces' business (each piece's
``sites()``, composed by ``runtime.composed.ComposedModel.op_sites``; the standard pieces of a spec:
``pieces.standard.compose_standard``) - one definition per site kind.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from latency_specialized.ops.registry import OpContext, make_context
from latency_specialized.quant.formats import QuantFormat


@dataclass(frozen=True)
class OpSite:
    """One op call in the decode step of one rank."""

    name: str
    """'<layer kind>/<role>', e.g. 'kda+moe/attn.o_proj'; model-level sites have no kind prefix."""
    ctx: OpContext
    """What the implementations are asked to support."""
    layers: tuple[int, ...] = ()
    """Layers (0-based) that contain this site; empty for model-level sites."""
    weight_bytes: int = 0
    """Bytes of weights this site reads per call on this rank (for rooflines)."""

    @property
    def family(self) -> str:
        return self.ctx.family


def carries_context(family: str) -> bool:
    """Whether sites of ``family`` carry the plan's context (attr ``context``): the attention families,
    whose work grows with the sequence, so an implementation can choose or refuse by length."""
    return family.startswith("attention.")


def with_context(site: OpSite, context: int | None) -> OpSite:
    """``site`` with attr ``context`` where its family carries one (``carries_context``) and it has none
    yet; other sites, and any site for ``context=None``, unchanged."""
    if context is None or not carries_context(site.family) or site.ctx.attr("context") is not None:
        return site
    c = site.ctx
    ctx = make_context(c.family, arch=c.arch, dtype=c.dtype, tokens=c.tokens, world_size=c.world_size,
                       dims=dict(c.dims), attrs={**dict(c.attrs), "context": context})
    return replace(site, ctx=ctx)


class SiteBuilder:
    """Collects sites with shared arch/dtype/tokens/context; `add` takes the family-specific dims.

    ``context``: the longest sequence (tokens) the plan serves, or None; every attention site gets it
    as attr ``context`` (``carries_context``), so kernels can choose or refuse by length, and pieces
    may read ``b.context`` for length-dependent choices."""

    def __init__(self, arch: str, dtype: str, tokens: int, tp: int, context: int | None = None):
        self.arch, self.dtype, self.tokens, self.tp = arch, dtype, tokens, tp
        self.context = context
        self.sites: list[OpSite] = []
        self.prefix = ""
        self.layers: tuple[int, ...] = ()

    def add(self, role: str, family: str, *, weight_bytes: int = 0, world_size: int | None = None,
            tokens: int | None = None, attrs: dict[str, Any] | None = None, **dims: int) -> None:
        if self.context is not None and carries_context(family) and "context" not in (attrs or {}):
            attrs = {**(attrs or {}), "context": self.context}
        ctx = make_context(family, arch=self.arch, dtype=self.dtype,
                           tokens=self.tokens if tokens is None else tokens,
                           world_size=self.tp if world_size is None else world_size, dims=dims, attrs=attrs)
        name = f"{self.prefix}/{role}" if self.prefix else role
        self.sites.append(OpSite(name, ctx, self.layers, weight_bytes))

    def gemm(self, role: str, n: int, k: int, *, residual: bool = False, wbytes: float = 2.0,
             out_dtype: str | None = None, norm_site: str | None = None, weight_format: str | None = None) -> None:
        """A projection y[M,N] = x[M,K] W[N,K]^T; wbytes = bytes per weight element; out_dtype: result
        dtype when it is not the activation dtype (fp32 router logits); norm_site: role of the norm
        site in front of it, skipped where the gemm normalises its input (``Plan.skipped_sites``);
        weight_format: the weight stays in this stored format (``ModelSpec.kept_linear``: attr ``weight_format``,
        its bytes - codes and scales - counted instead of ``wbytes``)."""
        attrs: dict = {"residual": residual}
        if out_dtype is not None:
            attrs["out_dtype"] = out_dtype
        if norm_site is not None:
            attrs["norm_site"] = norm_site
        if weight_format is not None:
            attrs["weight_format"] = weight_format
            wbytes = stored_bytes_per_value(weight_format)
        self.add(role, "gemm", weight_bytes=int(n * k * wbytes), N=n, K=k, attrs=attrs)

    def mlp(self, role: str, inter: int, hidden: int, *, activation: str, clamp: float | None = None,
            weight_format: str | None = None, side_stream: bool = False) -> None:
        """A gated MLP site (family ``mlp``): gate|up ``[2*inter, hidden]`` and down ``[hidden, inter]``, 3 x
        hidden x inter weights at 2 bytes, or in ``weight_format`` (attr, its stored bytes); ``clamp``: the
        SwiGLU clamp; ``side_stream``: may run beside the routed experts."""
        attrs: dict[str, Any] = {"activation": activation}
        if clamp:
            attrs["clamp"] = clamp
        if side_stream:
            attrs["side_stream"] = True
        if weight_format is not None:
            attrs["weight_format"] = weight_format
        per = stored_bytes_per_value(weight_format) if weight_format is not None else 2
        self.add(role, "mlp", weight_bytes=int(3 * hidden * inter * per), N=inter, K=hidden, attrs=attrs)


def stored_bytes_per_value(fmt: str) -> float:
    """Bytes a stored weight format reads per value, its block scales included (``QuantFormat.bits_per_value``)."""
    return QuantFormat.get(fmt).bits_per_value() / 8
