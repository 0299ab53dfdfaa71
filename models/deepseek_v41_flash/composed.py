"""DeepSeek-V4.1-Flash as pieces (``compose_standard``): ``RoutedMoE`` (SwiGLU clamp 10 as a site attr, router
split across ranks), embedding, LM head, the mHC residual with Engram's sites (``MemoryMHCResidual``: the program
refuses Engram) and ``SparseMQAAttention``. A piece stands for every layer of its kind and layers differ in what
they own, so the kinds are ``sparse_mqa.window`` (0-1) and ``sparse_mqa.c<r>`` + ``.src`` (KV source: compressor +
compressed cache) + ``.idx`` (indexer): ``c2.src.idx`` (2, 8, 14), ``c2`` (readers), ``c1.idx`` (24, 28, 32, 36:
own queries, layer 20's keys), ... Not sites: the Engram gate, candidate blocks (README), the DSpark draft.
"""

from __future__ import annotations

import functools

from latency_specialized.errors import UserError
from latency_specialized.pieces.attention.sparse_mqa import SparseMQAAttention
from latency_specialized.pieces.residual.mhc_memory import MemoryMHCResidual
from latency_specialized.pieces.standard import compose_standard
from latency_specialized.runtime.composed import MODEL, ComposedModel
from latency_specialized.spec import LayerSpec

from latency_specialized_models.deepseek_v41_flash.spec import DeepseekV41Spec


def check_topology(spec: DeepseekV41Spec) -> None:
    """UserError naming the fix where the KV / index sources are wired in a way the pieces do not run."""
    for l in spec.layers:
        r, src, idx = l.attention.compress_ratio, spec.kv_source_for(l.index), spec.index_source_for(l.index)
        # (a KV source without an indexer fails here too: its own index source reads an older cache)
        if r and (spec.layers[src].attention.compress_ratio != r or spec.kv_source_for(idx) != src):
            raise UserError(f"{spec.name}: layer {l.index} (ratio {r}) reads KV source {src} and index source {idx}, "
                            "which do not share one compressed cache of its ratio (and indexer keys): fix "
                            "kv_source_layers / index_source_layers")


def layer_kind(spec: DeepseekV41Spec, layer: LayerSpec) -> str:
    a, own = layer.attention, (".src" if layer.index in spec.kv_source_layers else "")
    own += ".idx" if a.indexer is not None else ""  # type: ignore[union-attr]
    return f"sparse_mqa.{f'c{a.compress_ratio}' if a.compress_ratio else 'window'}{own}+moe"  # type: ignore[union-attr]


@functools.lru_cache(maxsize=16)
def composed_model(spec: DeepseekV41Spec) -> ComposedModel:
    """DeepSeek-V4.1-Flash's pieces (unsharded spec; a shard: those of the spec it was sharded from)."""
    if spec.unsharded is not None:
        return composed_model(spec.full())
    check_topology(spec)

    def attention(layer: LayerSpec) -> SparseMQAAttention:
        a = layer.attention
        return SparseMQAAttention(a, topk=spec.index_topk if a.compress_ratio else 0,  # type: ignore[arg-type]
                                  kv_source=layer.index in spec.kv_source_layers, norm_eps=spec.norm.eps,
                                  rope_theta=spec.rope.compress_theta if a.compress_ratio else spec.rope.theta)

    e = spec.engram   # Engram: sites only (the program refuses it)
    residual = MemoryMHCResidual.for_spec(spec, hc_eps=spec.hyper.eps, post_mult=spec.hyper.post_alpha,
                                          memory_layers=e.layers, rows_per_token=e.rows_per_token,
                                          row_width=e.head_dim, row_bytes=1 if e.table_dtype == "fp8_e4m3" else 2,
                                          prefix="engram")
    return compose_standard(spec, kind=lambda layer: layer_kind(spec, layer), attention=attention, residual=residual)


ATTN = {"q_a_proj": "wq_a.weight", "q_b_proj": "wq_b.weight", "kv_proj": "wkv.weight", "o_a_proj": "wo_a.weight",
        "o_b_proj": "wo_b.weight", "sinks": "attn_sink", "compressor.kv": "compressor.wkv.weight",
        "compressor.gate": "compressor.wgate.weight", "indexer.q_proj": "indexer.wq_b.weight",
        "indexer.k_proj": "indexer.wk.weight"}
FFN = {"router": "gate.weight", "router_bias": "gate.bias", "shared.gate_proj": "shared_experts.w1.weight",
       "shared.up_proj": "shared_experts.w3.weight", "shared.down_proj": "shared_experts.w2.weight"}


def tensor_name(layer: int, role: str, local: str) -> str:
    """Official checkpoint name (``names.py``) of the piece weight ``(layer, role, local)``."""
    if layer == MODEL:
        return {"embed": "embed.weight", "head": "head.weight", "residual": "norm.weight"}[role]
    p = f"layers.{layer}."
    if role == "residual":
        sub, what = local.split(".")
        return p + (f"{sub}_norm.weight" if what == "norm" else f"hc_{sub}_{what}")
    if role == "attn":
        return p + "attn." + ATTN.get(local, local + ".weight")
    if local.startswith("experts."):
        return f"{p}ffn.experts.{{e}}.{local[8:]}.weight"
    return p + "ffn." + FFN[local]


__all__ = ["check_topology", "composed_model", "layer_kind", "tensor_name"]
