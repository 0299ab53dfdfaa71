"""Op sites of one Kimi K3 decode step (per rank), in the order the program calls them.

Kimi's step differs from the generic pre-norm layer (``ops/sites.py``), so the adapter lists its
own sites:

* no additive residual + norm: every sublayer input is an AttnRes mix (``*.attnres``, family
  ``residual.attnres``) whose output RMSNorm *is* the layer's input/post-attention norm; the
  sublayer output is added into the partial-block row by the (all-reduce +) residual op with no
  norm (``*.allreduce``);
* KDA's fused input projection also carries f_a (rank ``head_dim``, replicated) and beta, as vLLM's
  ``in_proj_qkvgfab``; f_b is its own GEMM;
* MLA: one GEMM for ``[q_a | kv_a | gate]`` (vLLM's ``fused_qkv_a_proj`` plus the output-gate rows,
  which read the same input), the q_a norm, q_b, then attention with the kv_a norm and the gate
  fused (``attention.mla``), then o_proj;
* latent MoE: router GEMM (fp32 logits) and latent down-projection of the rank's slice (one all-gather
  joins them) - or, where a kernel serves it, both in one site (``moe.gate_down``, one weight
  stream; the program then skips the two gemm sites: the only sites not called every step), routing,
  routed experts at the
  latent width, the experts' all-reduce fused with the latent RMSNorm (*after* the experts),
  shared experts, and the latent up-projection of the rank's hidden slice with the shared output
  as its residual (one rounding, as vLLM's ``addmm_``);
* model level: the final AttnRes mix (no output norm), the final norm and the LM head.
"""

from __future__ import annotations

from latency_specialized.ops.sites import OpSite, SiteBuilder
from latency_specialized.spec import DenseMLPSpec, KDAAttentionSpec, LayerSpec, MLAAttentionSpec, ModelSpec, MoESpec, ParallelSpec


def in_proj_rows(a: KDAAttentionSpec) -> int:
    """Rows of KDA's fused input projection (q, k, v, g_out, f_a, beta) padded to a multiple of 16."""
    rows = 4 * a.num_heads * a.head_dim + a.decay_rank + a.num_heads
    return rows + (-rows % 16)


def _attnres(b: SiteBuilder, role: str, hidden: int, rows: int, out_norm: bool) -> None:
    b.add(role, "residual.attnres", weight_bytes=2 * hidden * 2, N=hidden, R=rows, attrs={"out_norm": out_norm})


def _attention(b: SiteBuilder, a, hidden: int) -> None:
    if isinstance(a, KDAAttentionSpec):
        hd = a.num_heads * a.head_dim
        # q, k, v, g_out | f_a | beta, rows padded to a multiple of 16 as vLLM pads in_proj_qkvgfab
        # (cuBLAS picks an sm80 kernel for N=6284 at M=64: 39 vs 27 us for N=6288, H200)
        b.gemm("attn.in_proj", in_proj_rows(a), hidden)
        # f_b_proj (decay input [H*D, R]) is part of the KDA op: its kernel computes it per head
        b.add("attn.kda", "attention.kda", weight_bytes=hd * a.decay_rank * 2, heads=a.num_heads,
              head_dim=a.head_dim, conv=a.conv_kernel, decay_rank=a.decay_rank)
        b.gemm("attn.o_proj", hidden, hd)
        return
    assert isinstance(a, MLAAttentionSpec)
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    gate = a.num_heads * a.v_head_dim if a.output_gate == "sigmoid" else 0
    if a.q_lora_rank:
        # the output-gate rows ride in the fused [q_a | kv_a] projection (all read h): one GEMM less
        b.gemm("attn.qkv_a_proj", a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim + gate, hidden)
        b.add("attn.q_a_norm", "norm", N=a.q_lora_rank)
        b.gemm("attn.q_b_proj", a.num_heads * qk, a.q_lora_rank, norm_site="attn.q_a_norm")
    else:
        b.gemm("attn.kv_a_proj", a.kv_lora_rank + a.qk_rope_head_dim, hidden)
        b.gemm("attn.q_proj", a.num_heads * qk, hidden)
        if gate:
            b.gemm("attn.gate_proj", gate, hidden)
    # kv_a_layernorm (RMSNorm of the latent slice kv[:, :L]) is part of the MLA op (kv_norm_weight): its
    # only consumer is the attention, which normalises the raw latent as it writes the cache - no site.
    # (The site counts no weight bytes, w_kv_b included, so the norm's L * 2 bytes are not added either.)
    b.add("attn.mla", "attention.mla", heads=a.num_heads, kv_lora=a.kv_lora_rank, rope=a.qk_rope_head_dim,
          nope=a.qk_nope_head_dim, v=a.v_head_dim, attrs={"gate": a.output_gate, "rope": a.use_rope})
    b.gemm("attn.o_proj", hidden, a.num_heads * a.v_head_dim)


def _ffn(b: SiteBuilder, f, hidden: int, tp: int, latent_norm: bool) -> None:
    if isinstance(f, DenseMLPSpec):
        b.add("mlp", "mlp", weight_bytes=3 * hidden * f.intermediate * 2, N=f.intermediate, K=hidden,
              attrs={"activation": f.activation.kind})
        return
    assert isinstance(f, MoESpec)
    width = f.latent_dim or hidden
    # Router and latent down-projection split across ranks (ops/tp_moe.py): rank r scores experts
    # r*E/tp.. and projects latent channels r*L/tp..; one all-gather (communication, not a site)
    # assembles the full logits and latent on every rank. The router weight is bf16 (as stored);
    # its logits are fp32 (vLLM's GateLinear: bf16 x bf16 -> fp32), so the site asks for fp32 output.
    if f.latent_dim:
        # both read the same normed h: where a kernel serves this site (the batch-1 GEMV) the program calls it
        # instead of the two gemm sites below (one weight stream, one launch); elsewhere it calls those
        n_gate, n_latent = f.num_experts // tp, width // tp
        b.add("moe.gate_down", "moe.gate_down", weight_bytes=(n_gate + n_latent) * hidden * 2,
              N=n_gate + n_latent, K=hidden, n_gate=n_gate, attrs={"fuses": "moe.router_gemm,moe.latent_down"})
    b.gemm("moe.router_gemm", f.num_experts // tp, hidden, out_dtype="float32")
    b.add("moe.router", "moe.router", E=f.num_experts, topk=f.top_k,
          attrs={"score_func": f.router.score_func, "bias": f.router.bias_corrected})
    b.gemm("moe.latent_down", width // tp, hidden)
    b.add("moe.experts", "moe.experts", E=f.num_experts, topk=f.top_k, N=f.expert_intermediate, K=width,
          attrs={"activation": f.activation.kind})
    # the experts' partial latent is all-reduced with the latent RMSNorm fused (vLLM: all-reduce, then norm)
    b.add("moe.latent_allreduce", "allreduce", N=width, attrs={"residual": False, "norm": latent_norm})
    if f.num_shared_experts:
        inter = f.num_shared_experts * f.expert_intermediate
        b.add("moe.shared", "mlp", weight_bytes=3 * hidden * inter * 2, N=inter, K=hidden,
              attrs={"activation": f.activation.kind, "side_stream": True})
    # each rank up-projects into its hidden slice, added to the shared experts' partial (vLLM's
    # sharded latent-MoE tail), so the FFN all-reduce counts the routed output once
    b.gemm("moe.latent_up", hidden // tp, width, residual=bool(f.num_shared_experts))


def kimi_op_sites(spec: ModelSpec, parallel: ParallelSpec, tokens: int, arch: str, dtype: str) -> list[OpSite]:
    """Sites of one Kimi K3 decode step on one rank (``spec`` full or already sharded)."""
    rank_spec = spec if spec.tp == parallel.tp else spec.shard(parallel.tp)
    hidden = spec.hidden_size
    block = spec.residual.block_size or 1
    b = SiteBuilder(arch, dtype, tokens, parallel.tp)
    groups: dict[str, list[LayerSpec]] = {}
    for layer in rank_spec.layers:
        groups.setdefault(layer.kind, []).append(layer)
    rows = -(-spec.num_layers // block) + 1
    for kind, layers in groups.items():
        b.prefix, b.layers = kind, tuple(l.index for l in layers)
        first = layers[0]
        _attnres(b, "attn.attnres", hidden, rows, out_norm=True)
        _attention(b, first.attention, hidden)
        b.add("attn.allreduce", "allreduce", N=hidden, attrs={"residual": True, "norm": False})
        _attnres(b, "ffn.attnres", hidden, rows, out_norm=True)
        _ffn(b, first.ffn, hidden, parallel.tp, getattr(spec, "latent_moe_norm", True))
        b.add("ffn.allreduce", "allreduce", N=hidden, attrs={"residual": True, "norm": False})
    b.prefix, b.layers = "", ()
    _attnres(b, "final.attnres", hidden, rows, out_norm=False)
    b.add("final_norm", "norm", N=hidden)
    b.gemm("lm_head", spec.vocab_size // parallel.tp, hidden)
    return b.sites
