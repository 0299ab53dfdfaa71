"""The stock compositions the layer bench builds, by the name an adapter's ``BenchKind.stock`` gives.

Each has ``build(full, bench_kind, tp, batch, context, copies, device, experts=)`` -> an object with
``step()``, ``routed_ids()`` and ``weight_bytes()`` (``copies`` layers run back to back), and
``notes(full, kind_name, bench_kind, tp)`` -> what the results must say about it (stand-ins, which kernel
both variants share). The builders import their Triton modules lazily: this table loads anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from latency_specialized.bench.stock.flashmla import mla_note
from latency_specialized.errors import UserError


@dataclass(frozen=True)
class StockComposition:
    """One stock composition: its builder and its notes (see the module docstring)."""

    name: str
    build: Callable[..., Any]
    notes: Callable[..., list[str]]
    description: str
    expert_formats: tuple[str, ...] = ()
    """Stored formats of routed experts (``QuantizedWeight``, bench ``--experts``) it runs as stock does (bf16
    always)."""


def _build_kda(full, bk, tp, batch, context, copies, device, *, experts=None):
    from latency_specialized.bench.stock.layers import build_stock_kda

    return build_stock_kda(full, bk.layer, tp, batch, copies, device, experts=experts)


def _build_mla(full, bk, tp, batch, context, copies, device, *, experts=None):
    from latency_specialized.bench.stock.layers import build_stock_mla

    return build_stock_mla(full, bk.layer, tp, batch, context, copies, device, experts=experts,
                           block_size=bk.kv_block_size)


def _gqa_options(bk):
    from latency_specialized.bench.stock.gqa_moe import StockGQAOptions

    return StockGQAOptions.from_mapping(bk.stock_options)


def _build_gqa(full, bk, tp, batch, context, copies, device, *, experts=None):
    from latency_specialized.bench.stock.gqa_moe import build_stock_gqa

    return build_stock_gqa(full, bk.layer, tp, batch, context, copies, device, options=_gqa_options(bk),
                           block_size=bk.kv_block_size, router_weight_bytes=bk.router_weight_bytes, experts=experts)


def _notes_gqa(full, name, bk, tp):
    from latency_specialized.bench.stock.gqa_moe import describe

    return describe(full, bk.layer, tp, name, _gqa_options(bk))


def _dsa(name, module="dsa_moe"):
    def call(*args, **kw):  # bench/stock/<module>.py's builder / notes of a BenchKind, imported at call time
        import importlib

        return getattr(importlib.import_module(f"latency_specialized.bench.stock.{module}"), name)(*args, **kw)

    return call


COMPOSITIONS: dict[str, StockComposition] = {
    "kda_moe": StockComposition("kda_moe", _build_kda, lambda full, name, bk, tp: [],
                                "Kimi K3 KDA + latent MoE with AttnRes (bench/stock/layers.py)",
                                expert_formats=("mxfp4",)),
    "mla_moe": StockComposition("mla_moe", _build_mla, lambda full, name, bk, tp: [mla_note()],
                                "Kimi K3 MLA + latent MoE with AttnRes (bench/stock/layers.py)",
                                expert_formats=("mxfp4",)),
    "gqa_moe": StockComposition("gqa_moe", _build_gqa, _notes_gqa,
                                "GQA (window / NoPE / QK norm / gate) + (latent) MoE, sandwich-normed gated "
                                "residual as vLLM runs Muse Spark (bench/stock/gqa_moe.py)"),
    "dsa_moe": StockComposition("dsa_moe", _dsa("build_for_kind"), _dsa("notes_for_kind"),
                                "MLA + DSA indexer (own or shared top-k) + sparse attention + MoE with shared experts, "
                                "pre-norm, as vLLM runs DeepSeek-V3.2 / GLM-5 on Hopper (bench/stock/dsa_moe.py)"),
    "sparse_mqa_moe": StockComposition("sparse_mqa_moe", _dsa("build_for_kind", "sparse_mqa_moe"),
                                       _dsa("notes_for_kind", "sparse_mqa_moe"),
                                       "sparse MQA (window + compressed KV, own or shared top-k) + MoE with a shared "
                                       "expert, mHC residual, as vLLM runs DeepSeek-V4.1 on Hopper "
                                       "(bench/stock/sparse_mqa_moe.py)"),
}


def composition(name: str) -> StockComposition:
    """The composition named ``name`` (a UserError naming the known ones otherwise)."""
    if name not in COMPOSITIONS:
        raise UserError(f"no stock composition {name!r}: the bench builds {', '.join(COMPOSITIONS)}")
    return COMPOSITIONS[name]


__all__ = ["COMPOSITIONS", "StockComposition", "composition"]
