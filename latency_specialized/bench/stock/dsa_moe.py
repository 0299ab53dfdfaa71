"""The stock DSA + MoE decoder layer on one rank (MLA with a lightning indexer and sparse attention over its
top-k, then a routed MoE with shared experts), composed the way stock vLLM 0.33 decodes DeepSeek-V3.2-style
models on Hopper with bf16 weights and a bf16 KV cache (``vllm/models/deepseek_v32/nvidia/model.py``,
``deepseek_v32/attention.py``, ``model_executor/models/deepseek_v2.py``'s ``DeepseekV2MoE``; the sparse backend
vLLM picks on SM90 for a 576-wide bf16 latent is ``FLASH_ATTN_MLA_SPARSE``: FA3 over the selected rows as a
page-size-1 block table). Generic over the spec (``MLAAttentionSpec`` with an ``IndexerSpec``; ``MoESpec``)
plus :class:`StockDSAOptions`. Per layer::

    boundary          residual add + input RMSNorm (fused_allreduce_rms_norm, AR excluded)   (Triton stand-in, 1)
    fused_qkv_a_proj  q_a | kv_a | k_pe (replicated)                                          (cuBLAS, 1)
    wk_weights_proj   indexer key | head weights (replicated)                      [indexer]  (cuBLAS, 1)
    fused_norm_rope   q_a, kv_a RMSNorms, k_pe RoPE, latent write; indexer key
                      LayerNorm + RoPE + fp8 write                                            (Triton stand-in, 1)
    q_b_proj          this rank's heads                                                       (cuBLAS, 1)
    wq_b              indexer queries (replicated)                                 [indexer]  (cuBLAS, 1)
    fused_q           q_pe RoPE; indexer query RoPE + fp8, head weights scaled                (Triton stand-in, 1)
    indexer logits    DeepGEMM fp8_paged_mqa_logits                                [indexer]  (Triton stand-in, 1)
    top-k             cooperative_topk                                             [indexer]  (torch.topk stand-in)
    convert           top-k -> physical rows + valid counts, once per index group  [indexer]  (Triton stand-in, 1)
    sparse attention  bmm W_UK, FA3 over the selected rows, bmm W_UV    (attention.mla.triton_splitkv over a
                      page-size-1 table of the selected rows: prologue, split, merge + W_UV, 3)
    o_proj                                                                                    (cuBLAS, 1)
    boundary          residual add + post-attention RMSNorm                                   (Triton stand-in, 1)
    MoE               router (bf16 weight), grouped top-k, align, fused MoE (TritonExperts), shared
                      experts on a side stream, sum          (``gqa_moe.StockGQALatentMoE`` without a latent width)

``[indexer]`` rows run only on layers that run their own indexer (``IndexerSpec.full_layers``); a layer that
reuses the latest indexer's top-k (IndexShare) reads its index group's converted rows - here a random selection
of ``topk`` cached positions fixed at build time, shared by every copy (the group converts once). The new
token's latent and key are written at position ``context`` (``seq_lens = context + 1``). The stand-in kernels:
``dsa_kernels``. Router (bf16 weight, vLLM's GateLinear with fp32 output), latent and indexer projections are
replicated on every rank, as stock keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Literal, Mapping

import torch
import torch.nn.functional as F

from latency_specialized.bench.stock import dsa_kernels as dk
from latency_specialized.bench.stock import gqa_kernels as gk
from latency_specialized.bench.stock.common import StockLayers, rand_norm_weight, rand_weight
from latency_specialized.bench.stock.gqa_moe import GatedStream, StockGQALatentMoE, StockGQAOptions
from latency_specialized.errors import UserError
from latency_specialized.spec import MLAAttentionSpec, ModelSpec, MoESpec

SPARSE_ATTENTION = "attention.mla.triton_splitkv"
"""The stand-in for stock's sparse attention (``kernels/mla_decode_triton.py``, over a page-size-1 table)."""
INDEXER_K_NORM_EPS = 1e-6
"""vLLM's indexer ``k_norm = LayerNorm(head_dim, eps=1e-6)``."""


@dataclass(frozen=True)
class StockDSAOptions:
    """What the stock layer needs beyond the generic spec (``BenchKind.stock_options`` keywords)."""

    indexer_rope: Literal["neox", "interleaved"] = "neox"
    """RoPE pair layout of the indexer's key and queries (vLLM: ``indexer_rope_interleave`` -> interleaved)."""

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> "StockDSAOptions":
        known = {f.name for f in fields(cls)}
        bad = sorted(set(options) - known)
        if bad:
            raise UserError(f"stock dsa_moe options {bad} unknown: use {', '.join(sorted(known))}")
        return cls(**dict(options))


def runs_own_indexer(a: MLAAttentionSpec, layer: int) -> bool:
    """Whether ``layer`` runs its own indexer (else it reuses the latest full layer's top-k)."""
    assert a.indexer is not None
    return not a.indexer.full_layers or layer in a.indexer.full_layers


def random_selection(block_table: torch.Tensor, context: int, topk: int, block_size: int,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [B, K] int32, counts [B] int32): ``min(K, context + 1)`` distinct random positions of each sequence
    as physical cache rows (valid first), what an index group's convert step hands its reuse layers."""
    B = block_table.shape[0]
    n = context + 1
    idx = torch.stack([torch.randperm(n, generator=generator)[:topk] for _ in range(B)]).to(block_table.device)
    if idx.shape[1] < topk:
        idx = torch.cat([idx, idx.new_full((B, topk - idx.shape[1]), -1)], 1)
    seq = torch.full((B,), n, device=block_table.device, dtype=torch.int32)
    return dk.convert_topk_reference(idx, block_table, seq, block_size)


class StockDSAMoELayer:
    """One DSA + MoE layer, stock composition, on one rank, decoding against ``context`` cached tokens (see the
    module docstring).

    Parameters
    ----------
    full : the unsharded spec; ``layer`` an MLA (+ indexer) + MoE layer index of it. tp : the TP size whose rank-0
    shard this is. batch : sequences per step. options : :class:`StockDSAOptions`. block_size : paged-cache block
    size (vLLM's sparse MLA: 64). router_weight_bytes : 4 keeps the router weight fp32, 2 bf16. experts : optional
    (w13 [E, 2I, N], w2 [E, N, I]) shared with another variant. streams : (aux, shared) side streams (None:
    inline). attention : the sparse attention (default :data:`SPARSE_ATTENTION`; tests pass the torch reference
    of the same contract). selection : a reuse layer's (rows, counts) (default: :func:`random_selection`).
    """

    def __init__(self, full: ModelSpec, layer: int, tp: int, batch: int, context: int, device, *,
                 options: StockDSAOptions = StockDSAOptions(), block_size: int = 64, router_weight_bytes: int = 2,
                 experts: tuple[torch.Tensor, torch.Tensor] | None = None,
                 streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None,
                 attention: Callable[..., torch.Tensor] | None = None,
                 selection: tuple[torch.Tensor, torch.Tensor] | None = None):
        spec = full.layers[layer]
        a, f = spec.attention, spec.ffn
        if not (isinstance(a, MLAAttentionSpec) and a.indexer is not None and isinstance(f, MoESpec)):
            raise UserError(f"{full.name} layer {layer} is {spec.kind}: the dsa_moe stock composition builds MLA + "
                            "indexer (DSA) + MoE layers")
        if not (a.q_lora_rank and a.use_rope and a.output_gate == "none"):
            raise UserError("stock dsa_moe: a query LoRA, RoPE and no output gate (DeepSeek-V3.2 / GLM-5 MLA)")
        dev, N, ix = device, full.hidden_size, a.indexer
        self.a, self.ix, self.opt, self.M, self.N = a, ix, options, batch, N
        self.own = runs_own_indexer(a, layer)
        self.H = H = a.num_heads // tp
        self.eps = full.norm.eps          # vLLM's q_a / kv_a RMSNorms take rms_norm_eps too
        self.bs = block_size
        ql, L, R, nope, v = a.q_lora_rank, a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim, a.v_head_dim
        self.ql, self.L, self.R, self.nope, self.v = ql, L, R, nope, v
        self._attention = attention
        self.w_qkv_a = rand_weight((ql + L + R, N), dev)
        self.q_a_w, self.kv_a_w = rand_norm_weight(ql, dev), rand_norm_weight(L, dev)
        self.w_q_b = rand_weight((H * (nope + R), ql), dev)
        self.w_kv_b = rand_weight((H * (nope + v), L), dev)
        self.w_o = rand_weight((N, H * v), dev)
        self.norm_w = [rand_norm_weight(N, dev) for _ in range(2)]   # input / post-attention RMSNorm
        from latency_specialized.ops.rope import rope_inv_freq

        self.inv_freq = rope_inv_freq(a.rope_theta, R, device=dev)
        self.rope_il, self.index_il = a.rope_interleaved, options.indexer_rope == "interleaved"
        # paged latent cache: each sequence's blocks in a shuffled order, ``context`` live tokens + the new one
        per_seq = -(-(context + 1) // block_size)
        nb = batch * per_seq
        self.cache = 0.5 * torch.randn(nb, block_size, L + R, device=dev, dtype=torch.bfloat16)
        self.block_table = torch.randperm(nb, device=dev, dtype=torch.int32).view(batch, per_seq)
        self.positions = torch.full((batch,), context, device=dev, dtype=torch.int64)
        self.slot_mapping = self.block_table[:, context // block_size].long() * block_size + context % block_size
        self.seq_lens = torch.full((batch,), context + 1, device=dev, dtype=torch.int32)
        self.no_slot = torch.full((batch,), -1, device=dev, dtype=torch.int64)  # the latent is written before
        K, D, hi = ix.topk, ix.head_dim, ix.num_heads
        if self.own:
            self.rows = torch.full((batch, K), -1, device=dev, dtype=torch.int32)
            self.counts = torch.zeros(batch, device=dev, dtype=torch.int32)
            self.w_ikw = rand_weight((D + hi, N), dev)
            self.w_iq = rand_weight((hi * D, ql), dev)
            self.ik_norm = (1.0 + 0.1 * torch.randn(D, device=dev), 0.1 * torch.randn(D, device=dev))
            self.key_cache, self.key_scales = dk.fp8_quantize_reference(torch.randn(nb, block_size, D, device=dev))
            self.w_scale = D ** -0.5 * hi ** -0.5      # the indexer's softmax scale and head-count scale
            self.logits = torch.empty(batch, max(per_seq * block_size, K), device=dev, dtype=torch.float32)
        else:   # the index group's converted rows (shared by its layers: the same tensors)
            self.rows, self.counts = selection if selection is not None else \
                random_selection(self.block_table, context, K, block_size)
        self.moe = StockGQALatentMoE(f, N, tp, batch, self.eps, False, StockGQAOptions(post_expert_norm="none"), dev,
                                     experts=experts, streams=streams, router_weight_bytes=router_weight_bytes)

    def weights(self) -> list[torch.Tensor]:
        out = [self.w_qkv_a, self.q_a_w, self.kv_a_w, self.w_q_b, self.w_kv_b, self.w_o, *self.norm_w]
        if self.own:
            out += [self.w_ikw, self.w_iq, *self.ik_norm]
        return out + self.moe.weights()

    def weight_bytes(self) -> int:
        """Bytes of every weight this layer holds (routed experts: all of them)."""
        return sum(t.numel() * t.element_size() for t in self.weights())

    def routed_ids(self) -> torch.Tensor:
        """[M, k] expert ids of the last forward."""
        return self.moe.topk_ids

    # ------------------------------------------------------------------ forward
    def _boundary(self, w: torch.Tensor, branch: torch.Tensor, st: GatedStream) -> torch.Tensor:
        h = torch.empty(self.M, self.N, device=branch.device, dtype=torch.bfloat16)
        gk.norm_residual_norm(branch, st.stream, w, self.eps, pre_zero_centered=False, post="none", post_weight=None,
                              post_eps=self.eps, post_zero_centered=False, alpha=None, beta=None, out=h)
        return h

    def _index_args(self, ikw: torch.Tensor | None) -> dict[str, Any]:
        if ikw is None:
            return {}
        return dict(index_k=ikw[:, :self.ix.head_dim], index_k_norm=self.ik_norm, index_k_eps=INDEXER_K_NORM_EPS,
                    key_cache=self.key_cache, key_scales=self.key_scales, index_inv_freq=self.inv_freq,
                    index_rope_interleaved=self.index_il)

    def _q_args(self, q_c: torch.Tensor, ikw: torch.Tensor | None, matmul) -> dict[str, Any]:
        if ikw is None:
            return {}
        iq = matmul(q_c, self.w_iq).view(self.M, self.ix.num_heads, self.ix.head_dim)
        return dict(index_q=iq, index_weights=ikw[:, self.ix.head_dim:], index_inv_freq=self.inv_freq,
                    index_rope_interleaved=self.index_il, weight_scale=self.w_scale)

    def forward(self, st: GatedStream) -> None:
        """One layer: joins ``st.branch`` (the previous FFN output) into ``st.stream``, writes this layer's FFN
        output (unjoined) to ``st.branch``."""
        if self._attention is None:
            from latency_specialized.kernels.mla_decode_triton import mla_decode_triton

            self._attention = mla_decode_triton
        M, dev, ql, L = self.M, st.stream.device, self.ql, self.L
        h = self._boundary(self.norm_w[0], st.branch, st)
        y = F.linear(h, self.w_qkv_a)
        ikw = F.linear(h, self.w_ikw) if self.own else None
        q_c = torch.empty(M, ql, device=dev, dtype=torch.bfloat16)
        dk.norm_rope_cache(self.positions, y, self.q_a_w, self.kv_a_w, self.eps, self.cache, self.slot_mapping,
                           self.inv_freq, q_lora=ql, rope_interleaved=self.rope_il, q_c=q_c, **self._index_args(ikw))
        q = F.linear(q_c, self.w_q_b).view(M, self.H, self.nope + self.R)
        iq8, iw = dk.rope_q_index(self.positions, q, self.inv_freq, nope=self.nope, rope_interleaved=self.rope_il,
                                  **self._q_args(q_c, ikw, F.linear))
        if self.own:
            dk.indexer_logits(iq8, iw, self.key_cache, self.key_scales, self.block_table, self.seq_lens,
                              out=self.logits)
            _, idx = dk.topk_select(self.logits, self.ix.topk)
            dk.convert_topk(idx, self.block_table, self.seq_lens, self.bs, rows=self.rows, counts=self.counts)
        o = self._attention(q, y[:, ql:ql + L], y[:, ql + L:], self.cache.view(-1, 1, L + self.R), self.no_slot,
                            self.rows, self.counts, self.w_kv_b, qk_nope_head_dim=self.nope, v_head_dim=self.v)
        h2 = self._boundary(self.norm_w[1], F.linear(o, self.w_o), st)
        self.moe.forward(h2, st.branch)

    def reference_forward(self, st: GatedStream) -> None:
        """The same layer from torch references (fp32 math, the kernels' roundings): the oracle of ``forward``;
        its selection lands in ``rows`` / ``counts``."""
        from latency_specialized.ops.attention.mla import mla_decode_reference
        from latency_specialized.ops.norm import rmsnorm_reference

        def mm(x, w):
            return (x.float() @ w.float().t()).to(torch.bfloat16)

        def boundary(w, branch):
            st.stream.copy_((st.stream.float() + branch.float()).to(st.stream.dtype))
            return rmsnorm_reference(st.stream, w, self.eps)

        M, ql, L = self.M, self.ql, self.L
        h = boundary(self.norm_w[0], st.branch)
        y = mm(h, self.w_qkv_a)
        ikw = mm(h, self.w_ikw) if self.own else None
        q_c = dk.norm_rope_cache_reference(self.positions, y, self.q_a_w, self.kv_a_w, self.eps, self.cache,
                                           self.slot_mapping, self.inv_freq, q_lora=ql, rope_interleaved=self.rope_il,
                                           **self._index_args(ikw))
        q = mm(q_c, self.w_q_b).view(M, self.H, self.nope + self.R)
        iq8, iw = dk.rope_q_index_reference(self.positions, q, self.inv_freq, nope=self.nope,
                                            rope_interleaved=self.rope_il, **self._q_args(q_c, ikw, mm))
        if self.own:
            logits = dk.indexer_logits_reference(iq8, iw, self.key_cache, self.key_scales, self.block_table,
                                                 self.seq_lens, self.logits.shape[1])
            rows, counts = dk.topk_rows_reference(logits, self.ix.topk, self.block_table, self.seq_lens, self.bs)
            self.rows.copy_(rows)
            self.counts.copy_(counts)
        o = mla_decode_reference(q, y[:, ql:ql + L], y[:, ql + L:], self.cache.view(-1, 1, L + self.R), self.no_slot,
                                 self.rows, self.counts, self.w_kv_b, qk_nope_head_dim=self.nope, v_head_dim=self.v)
        self.moe.reference_forward(boundary(self.norm_w[1], mm(o, self.w_o)), st.branch)


def build_stock_dsa(full: ModelSpec, layer: int, tp: int, batch: int, context: int, copies: int, device, *,
                    options: StockDSAOptions = StockDSAOptions(), block_size: int = 64, router_weight_bytes: int = 2,
                    experts: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                    attention: Callable[..., torch.Tensor] | None = None) -> StockLayers:
    """``copies`` stock DSA+MoE layers at batch ``batch`` over ``context`` cached tokens per sequence (reuse layers:
    one shared selection, as one index group)."""
    on_gpu = torch.device(device).type == "cuda"
    streams = (torch.cuda.Stream(), torch.cuda.Stream()) if on_gpu else None
    layers: list[StockDSAMoELayer] = []
    for i in range(copies):
        selection = (layers[0].rows, layers[0].counts) if layers and not layers[0].own else None
        layers.append(StockDSAMoELayer(full, layer, tp, batch, context, device, options=options, block_size=block_size,
                                       router_weight_bytes=router_weight_bytes, streams=streams, attention=attention,
                                       experts=experts[i] if experts else None, selection=selection))
    return StockLayers(layers, GatedStream.random(batch, full.hidden_size, torch.bfloat16, device))


def build_for_kind(full: ModelSpec, bk: Any, tp: int, batch: int, context: int, copies: int, device, *,
                   experts: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> StockLayers:
    """The composition's builder (``compositions.COMPOSITIONS['dsa_moe']``) for a ``BenchKind`` ``bk``."""
    return build_stock_dsa(full, bk.layer, tp, batch, context, copies, device,
                           options=StockDSAOptions.from_mapping(bk.stock_options), block_size=bk.kv_block_size,
                           router_weight_bytes=bk.router_weight_bytes, experts=experts)


def notes_for_kind(full: ModelSpec, name: str, bk: Any, tp: int) -> list[str]:
    """The composition's notes for a ``BenchKind`` ``bk`` named ``name`` (:func:`describe`)."""
    return describe(full, bk.layer, tp, name, StockDSAOptions.from_mapping(bk.stock_options))


# ------------------------------------------------------------------------------------------ roofline and notes
def sparse_attention_bytes(full: ModelSpec, layer: int, tp: int, batch: int, context: int | None, *,
                           weight_bytes: float = 2.0, key_bytes: float | None = None) -> dict[str, float]:
    """The attention terms of a DSA layer's floor on one rank (``layer_bench.layer_bytes`` takes them for every
    MLA layer with an indexer): ``kv_cache`` the ``min(context + 1, topk)`` selected
    latents (+ the new one written) instead of the whole context; on indexer layers ``indexer_weights``
    (wq_b, wk, weights_proj, k_norm; / TP like every weight) and ``indexer_cache`` (every cached key read + the
    new one written, ``key_bytes`` per token: default head_dim x ``weight_bytes`` - unquantised; vLLM's fp8 keys
    are head_dim + 4)."""
    a = full.layers[layer].attention
    assert isinstance(a, MLAAttentionSpec) and a.indexer is not None and a.q_lora_rank
    ix, n = a.indexer, (context or 0) + 1
    out = {"kv_cache": batch * (min(n, ix.topk) + 1) * a.latent_width * weight_bytes}
    if runs_own_indexer(a, layer):
        kb = ix.head_dim * weight_bytes if key_bytes is None else key_bytes
        out["indexer_weights"] = ((ix.num_heads * ix.head_dim * a.q_lora_rank + (ix.head_dim + ix.num_heads)
                                   * full.hidden_size) * weight_bytes + 2 * ix.head_dim * 4) / tp
        out["indexer_cache"] = batch * (n + 1) * kb
    return out


def describe(full: ModelSpec, layer: int, tp: int, kind: str, options: StockDSAOptions) -> list[str]:
    """Notes of a benched DSA kind: what its cells measure, the roofline's miscount (with figures at two
    contexts), then what stock runs (that note the same for every DSA kind: the bench prints it once)."""
    a, f = full.layers[layer].attention, full.layers[layer].ffn
    assert isinstance(a, MLAAttentionSpec) and a.indexer is not None and isinstance(f, MoESpec)
    ix, own = a.indexer, runs_own_indexer(a, layer)
    heads = a.num_heads // tp
    sel = (f"runs its own indexer ({ix.num_heads} heads x {ix.head_dim}, fp8 keys in stock, bf16 in ours) and "
           f"attends to its top-{ix.topk}" if own else
           f"reuses the latest indexer layer's top-{ix.topk} (no indexer of its own) and attends to it")
    mb = 2 ** 20

    def dense(c):
        return (c + 1) * a.latent_width * 2 / mb

    def sparse(c):
        b = sparse_attention_bytes(full, layer, tp, 1, c)
        return (b["kv_cache"] + b.get("indexer_cache", 0)) / mb

    counted = ", ".join(f"{c}: {sparse(c):.1f} MB (the whole cache: {dense(c):.1f} MB)" for c in (4096, 32768))
    w = sparse_attention_bytes(full, layer, tp, 1, 0).get("indexer_weights", 0) / mb
    return [
        f"{kind} layers (layer {layer}): MLA {heads} of {a.num_heads} heads per rank (q_lora {a.q_lora_rank}, kv_lora "
        f"{a.kv_lora_rank}, nope {a.qk_nope_head_dim}, rope {a.qk_rope_head_dim} "
        f"{'interleaved' if a.rope_interleaved else 'neox'}, v {a.v_head_dim}); the layer {sel}; MoE "
        f"{f.num_experts} x top-{f.top_k}, {f.num_shared_experts} shared. Paged bf16 latent cache, "
        f"{a.latent_width * 2} B per token.",
        f"{kind} roofline: the bytes of the selected min(context + 1, {ix.topk}) latents" +
        (f", every cached indexer key and {w:.2f} MB of indexer weights (/TP)" if own else "") +
        f" (sparse_attention_bytes), not the whole latent cache; per sequence at context {counted}.",
        f"DSA + MoE layers, stock: vLLM 0.33's Hopper bf16 path with stand-ins written the way stock writes them "
        f"(bench/stock/dsa_kernels.py): residual add + RMSNorm (Triton, for fused_allreduce_rms_norm with the "
        f"all-reduce excluded), fused_norm_rope and fused_q (Triton, one kernel each, as vLLM's own Triton kernels), "
        f"the indexer's fp8 paged MQA logits (Triton, for DeepGEMM's fp8_paged_mqa_logits), top-k (torch.topk for "
        f"vLLM's one-kernel cooperative_topk CUDA op: 1 kernel / 22-27 us at 4k positions, 19 kernels / 44-69 us at "
        f"32k on the H200, likely slower than vLLM's - stock's indexer cells carry that), the top-k -> cache-row "
        f"conversion (Triton, once per index group), sparse attention = {SPARSE_ATTENTION} over a page-size-1 table of the selected rows (for bmm W_UK "
        f"+ FlashAttention-3's sparse MLA (FLASH_ATTN_MLA_SPARSE) + bmm W_UV, which ship in the vLLM wheel), MoE as "
        f"the GQA composition's (grouped top-k, align, Triton fused MoE, SiLU-and-mul, shared experts on a side "
        f"stream); cuBLAS for every projection, router / q_a|kv_a / indexer projections replicated as stock keeps "
        f"them. Reuse layers read a fixed random selection of the group's top-k.",
    ]


__all__ = ["INDEXER_K_NORM_EPS", "SPARSE_ATTENTION", "StockDSAMoELayer", "StockDSAOptions",
           "build_for_kind", "build_stock_dsa", "describe", "notes_for_kind", "random_selection", "runs_own_indexer",
           "sparse_attention_bytes"]
