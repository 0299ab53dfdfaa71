"""Run one piece outside a program: its sites bound to the op families' references, a StepContext by hand."""

from __future__ import annotations

from typing import Any, Callable

import torch

from latency_specialized.comm.base import LocalCommunicator
from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.plugins import get_registry
from latency_specialized.runtime.composed import shard_weight
from latency_specialized.runtime.pieces_api import StepContext
from latency_specialized.spec import ModelSpec


class RefOps(dict):
    """A BoundOps: every site -> its family's reference; communication calls recorded."""

    def __init__(self, sites) -> None:
        reg = get_registry().implementations
        super().__init__({s.name: reg.reference(s.family).fn for s in sites})
        self.sites = {s.name: s for s in sites}
        self.skipped: dict[str, str] = {}
        self.strided_rows: frozenset[str] = frozenset()
        self.strided_out: frozenset[str] = frozenset()
        self.communicated: list[str] = []

    def communicate(self, site: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        self.communicated.append(site)
        return fn(*args, **kw)


def piece_sites(piece, spec: ModelSpec, tp: int, rows: int, prefix: str = "k", layers=(0,), where: str | None = None):
    rank_spec = spec.shard(tp) if tp > 1 else spec
    b = SiteBuilder("cpu", "float32", rows, tp)
    b.prefix, b.layers = prefix, tuple(layers)
    if where is None:
        piece.sites(b, rank_spec)
    else:
        piece.sites(b, rank_spec, where)
    return b.sites


def make_step(sites, spec: ModelSpec, rows: int, *, tp: int = 1, rank: int = 0, prefix: str = "k", layer: int = 0,
              meta: dict | None = None, comm: Any = None, scratch: dict | None = None) -> StepContext:
    return StepContext(ops=RefOps(sites), meta=meta or {}, rows=rows, comm=comm or LocalCommunicator(), tp=tp,
                       rank=rank, spec=spec, rank_spec=spec.shard(tp) if tp > 1 else spec, prefix=prefix, layer=layer,
                       scratch=scratch or {})


def rank_weights(piece, spec: ModelSpec, full: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """The piece's arranged weights of ``rank`` from full ones (sharded by its declarations)."""
    decls = {d.name: d for d in piece.weights(spec, tp)}
    rank_spec = spec.shard(tp) if tp > 1 else spec
    return piece.arrange({n: shard_weight(decls[n], t, rank, tp) for n, t in full.items()}, rank_spec)


def random_full(piece, spec: ModelSpec, g: torch.Generator, dtype=torch.float32) -> dict[str, torch.Tensor]:
    out = {}
    for d in piece.weights(spec, 1):
        x = torch.randn(d.shape, generator=g, dtype=torch.float64)
        x = 1.0 + 0.2 * x if "norm" in d.name else (x if d.name in ("sinks", "router_bias") else x / d.shape[-1] ** 0.5)
        out[d.name] = x.to(torch.float32 if d.dtype == "float32" else dtype)
    return out
