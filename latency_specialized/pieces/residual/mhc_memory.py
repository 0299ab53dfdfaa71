"""mHC residual with a memory injection: rows of a large hashed table (n-gram memory) fetched per token and
projected into the streams before the attention of some layers. Sites only (the gate that joins the rows into the
streams has no op family yet, so a program refuses such models): ``memory.prefetch`` (the rows, on a side stream;
tables sharded by hash column across ranks) and ``memory.wkv`` (the rows -> one key per stream + a shared value,
column-parallel), then the mHC seams (``pieces/residual/mhc.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.pieces.residual.mhc import MHCResidual
from latency_specialized.spec import ModelSpec


@dataclass(frozen=True)
class MemoryMHCResidual(MHCResidual):
    """mHC with table rows injected before the attention of ``memory_layers`` (site prefix ``prefix``)."""

    memory_layers: tuple[int, ...] = ()
    """Layers with an injection."""
    rows_per_token: int = 0
    """Table rows fetched per token and layer."""
    row_width: int = 0
    """Values per row."""
    row_bytes: int = 1
    """Bytes per stored value (1: FP8 tables)."""
    prefix: str = "memory"
    """Site name prefix (e.g. the model's name for the memory)."""

    def sites(self, b: SiteBuilder, rank_spec: ModelSpec, where: Literal["attn", "ffn", "final"]) -> None:
        group = b.layers
        here = tuple(l for l in self.memory_layers if l in group)
        if where == "attn" and here:
            share = -(-self.rows_per_token // rank_spec.tp)   # a rank's share of each token's rows
            b.layers = here
            b.add(f"{self.prefix}.prefetch", "prefetch",
                  weight_bytes=b.tokens * share * self.row_width * self.row_bytes,
                  rows=share, row_width=self.row_width, attrs={"side_stream": True, "source": f"{self.prefix}_table"})
            b.gemm(f"{self.prefix}.wkv", rank_spec.hidden_size * (self.streams + 1) // rank_spec.tp,
                   self.rows_per_token * self.row_width)
            b.layers = group
        super().sites(b, rank_spec, where)


__all__ = ["MemoryMHCResidual"]
