"""Op sites of a decode step, derived from a spec's standard building blocks.

An op site is one call of an op family inside the decode step of one rank, e.g. the output
projection of every KDA layer. Layers of the same kind have identical shapes, so a site stands
for all layers of its kind (``layers`` lists them) and the plan stays readable: a Kimi K3 step
has ~40 distinct sites, not 900.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from latency_specialized.ops.registry import OpContext, make_context
from latency_specialized.spec import (
    DenseMLPSpec,
    GQAAttentionSpec,
    KDAAttentionSpec,
    LayerSpec,
    MLAAttentionSpec,
    ModelSpec,
    MoESpec,
    ParallelSpec,
    SparseMQAAttentionSpec,
)


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


class SiteBuilder:
    """Collects sites with shared arch/dtype/tokens; `add` takes the family-specific dims."""

    def __init__(self, arch: str, dtype: str, tokens: int, tp: int):
        self.arch, self.dtype, self.tokens, self.tp = arch, dtype, tokens, tp
        self.sites: list[OpSite] = []
        self.prefix = ""
        self.layers: tuple[int, ...] = ()

    def add(self, role: str, family: str, *, weight_bytes: int = 0, world_size: int | None = None,
            tokens: int | None = None, attrs: dict[str, Any] | None = None, **dims: int) -> None:
        ctx = make_context(family, arch=self.arch, dtype=self.dtype,
                           tokens=self.tokens if tokens is None else tokens,
                           world_size=self.tp if world_size is None else world_size, dims=dims, attrs=attrs)
        name = f"{self.prefix}/{role}" if self.prefix else role
        self.sites.append(OpSite(name, ctx, self.layers, weight_bytes))

    def gemm(self, role: str, n: int, k: int, *, residual: bool = False, wbytes: float = 2.0,
             out_dtype: str | None = None, norm_site: str | None = None) -> None:
        """A projection y[M,N] = x[M,K] W[N,K]^T; wbytes = bytes per weight element; out_dtype: result
        dtype when it is not the activation dtype (fp32 router logits); norm_site: role of the norm
        site in front of it, skipped where the gemm normalises its input (``Plan.skipped_sites``)."""
        attrs: dict = {"residual": residual}
        if out_dtype is not None:
            attrs["out_dtype"] = out_dtype
        if norm_site is not None:
            attrs["norm_site"] = norm_site
        self.add(role, "gemm", weight_bytes=int(n * k * wbytes), N=n, K=k, attrs=attrs)


def _attention_sites(b: SiteBuilder, a: Any, hidden: int) -> None:
    if isinstance(a, KDAAttentionSpec):
        hd = a.num_heads * a.head_dim
        b.gemm("attn.in_proj", 4 * hd + a.num_heads, hidden)  # q, k, v, g_out and beta, fused
        b.gemm("attn.f_a_proj", a.decay_rank, hidden)
        b.gemm("attn.f_b_proj", hd, a.decay_rank)
        b.add("attn.kda", "attention.kda", heads=a.num_heads, head_dim=a.head_dim, conv=a.conv_kernel)
        b.gemm("attn.o_proj", hidden, hd)
    elif isinstance(a, MLAAttentionSpec):
        q_width = a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
        if a.q_lora_rank:
            b.gemm("attn.qkv_a_proj", a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim, hidden)
            b.add("attn.q_a_norm", "norm", N=a.q_lora_rank)
            b.gemm("attn.q_b_proj", q_width, a.q_lora_rank)
        else:
            b.gemm("attn.q_proj", q_width, hidden)
            b.gemm("attn.kv_a_proj", a.kv_lora_rank + a.qk_rope_head_dim, hidden)
        b.add("attn.kv_a_norm", "norm", N=a.kv_lora_rank)
        if a.indexer is not None:
            b.add("attn.indexer", "attention.sparse", heads=a.indexer.num_heads,
                  head_dim=a.indexer.head_dim, topk=a.indexer.topk)
        b.add("attn.mla", "attention.mla", heads=a.num_heads, kv_lora=a.kv_lora_rank,
              rope=a.qk_rope_head_dim, nope=a.qk_nope_head_dim, v=a.v_head_dim)
        if a.output_gate == "sigmoid":
            b.gemm("attn.gate_proj", a.num_heads * a.v_head_dim, hidden)
        b.gemm("attn.o_proj", hidden, a.num_heads * a.v_head_dim)
    elif isinstance(a, GQAAttentionSpec):
        b.gemm("attn.qkv_proj", (a.num_heads + 2 * a.num_kv_heads) * a.head_dim, hidden)
        b.add("attn.gqa", "attention.gqa", heads=a.num_heads, kv_heads=a.num_kv_heads, head_dim=a.head_dim,
              window=a.sliding_window or 0)
        if a.output_gate == "sigmoid":
            b.gemm("attn.gate_proj", a.num_heads * a.head_dim, hidden)
        b.gemm("attn.o_proj", hidden, a.num_heads * a.head_dim)
    elif isinstance(a, SparseMQAAttentionSpec):
        b.gemm("attn.q_a_proj", a.q_lora_rank, hidden)
        b.gemm("attn.q_b_proj", a.num_heads * a.head_dim, a.q_lora_rank)
        b.gemm("attn.kv_proj", a.head_dim, hidden)
        if a.indexer is not None:
            b.add("attn.indexer", "attention.sparse", heads=a.indexer.num_heads,
                  head_dim=a.indexer.head_dim, topk=a.indexer.topk)
        b.add("attn.sparse_mqa", "attention.sparse", heads=a.num_heads, head_dim=a.head_dim,
              topk=a.indexer.topk if a.indexer else 0)
        b.gemm("attn.o_a_proj", a.o_groups * a.o_lora_rank, a.num_heads * a.head_dim // max(a.o_groups, 1))
        b.gemm("attn.o_b_proj", hidden, a.o_groups * a.o_lora_rank)
    else:  # pragma: no cover - new kinds must add their sites here or override op_sites
        raise TypeError(f"no standard op sites for attention kind {type(a).__name__}")


def _ffn_sites(b: SiteBuilder, f: Any, hidden: int, tp: int) -> None:
    if isinstance(f, DenseMLPSpec):
        b.add("mlp", "mlp", weight_bytes=3 * hidden * f.intermediate * 2, N=f.intermediate, K=hidden,
              attrs={"activation": f.activation.kind})
        return
    assert isinstance(f, MoESpec)
    width = f.latent_dim or hidden
    # Router and latent projection split across TP ranks (each rank scores/projects its slice),
    # which is the design the reference result uses; stock replicates them.
    b.gemm("moe.router_gemm", max(f.num_experts // tp, 1), hidden, wbytes=4.0 if f.router.fp32 else 2.0)
    b.add("moe.router", "moe.router", E=f.num_experts, topk=f.top_k,
          attrs={"score_func": f.router.score_func, "bias": f.router.bias_corrected})
    if f.latent_dim:
        b.gemm("moe.latent_down", f.latent_dim // tp, hidden)
        b.add("moe.latent_norm", "norm", N=f.latent_dim)
    b.add("moe.experts", "moe.experts", E=f.num_experts, topk=f.top_k, N=f.expert_intermediate, K=width,
          attrs={"activation": f.activation.kind})
    if f.latent_dim:
        b.gemm("moe.latent_up", hidden, f.latent_dim // tp)
    if f.num_shared_experts:
        inter = f.num_shared_experts * f.expert_intermediate
        b.add("moe.shared", "mlp", weight_bytes=3 * hidden * inter * 2, N=inter, K=hidden,
              attrs={"activation": f.activation.kind, "side_stream": True})


def standard_op_sites(spec: ModelSpec, parallel: ParallelSpec, tokens: int, arch: str, dtype: str) -> list[OpSite]:
    """Sites of one decode step for a spec built from standard blocks (sharded by ``parallel.tp``)."""
    rank_spec = spec if spec.tp == parallel.tp else spec.shard(parallel.tp)
    hidden = spec.hidden_size
    b = SiteBuilder(arch, dtype, tokens, parallel.tp)
    groups: dict[str, list[LayerSpec]] = {}
    for layer in rank_spec.layers:
        groups.setdefault(layer.kind, []).append(layer)
    for kind, layers in groups.items():
        b.prefix, b.layers = kind, tuple(l.index for l in layers)
        first = layers[0]
        b.add("attn.norm", "norm", N=hidden, attrs={"residual": True})
        _attention_sites(b, first.attention, hidden)
        b.add("attn.allreduce", "allreduce", N=hidden, attrs={"residual": True, "norm": True})
        _ffn_sites(b, first.ffn, hidden, parallel.tp)
        b.add("ffn.allreduce", "allreduce", N=hidden, attrs={"residual": True, "norm": True})
    b.prefix, b.layers = "", ()
    b.add("final_norm", "norm", N=hidden, attrs={"residual": True})
    b.gemm("lm_head", spec.vocab_size // parallel.tp if spec.vocab_size % parallel.tp == 0 else spec.vocab_size, hidden)
    return b.sites
