"""The stock DeepSeek-V4.1 decoder layer on one rank (mHC seams, sparse MQA over a sliding window + compressed KV
with the lightning indexer where the layer runs one, routed MoE with a shared expert), composed the way stock vLLM
0.33 decodes ``DeepseekV41ForCausalLM`` on Hopper with bf16 weights (``vllm/models/deepseek_v41/nvidia/model.py``:
``DeepseekV4DecoderLayer.forward`` with ``mhc_shifted_post_pre``; ``attention.py`` + ``nvidia/flashmla.py``: the
FlashMLA attention class vLLM picks off SM100/SM12x; ``deepseek_v4/nvidia/model.py``'s ``DeepseekV4MoE``). Per layer::

    mHC seam          post of the previous FFN folded into the pre-norm projection; Sinkhorn,
                      collapse, attn_norm                                            (Triton stand-ins, 2)
    fused_wqa_wkv     q-lora | kv (replicated)                                        (cuBLAS, 1)
    compressor kv     [kv | gate] projection (aux stream 0, replicated)     [KV src]  (cuBLAS, 1)
    weights_proj      indexer head weights (aux stream 1, replicated)       [index]   (cuBLAS, 1)
    fused_q_kv_rmsnorm                                                               (Triton stand-in, 1)
    wq_b              this rank's heads                                               (cuBLAS, 1)
    qnorm_rope_kv_insert  q head norm + RoPE, kv RoPE + window-cache write           (Triton stand-in, 1)
    compressor        pending rows, pool, norm, RoPE, compressed-cache write  [KV src]  (Triton stand-in, 1)
    indexer wq_b, wk  (replicated)                                          [index]   (cuBLAS, 1 + 1 key owner)
    indexer_k_store   key norm + RoPE + fp8 write                           [key owner] (Triton stand-in, 1)
    query quant       indexer q RoPE + fp8, weights scaled                  [index]   (dsa_kernels.rope_q_index, 1)
    logits, top-k     fp8_paged_mqa_logits, cooperative top-k               [index]   (dsa_kernels, 1 + torch.topk)
    global indices    top-k -> compressed-cache rows + lengths              [compressed] (dsa_kernels.convert_topk, 1)
    FlashMLA sparse   window + selected compressed rows, sinks; inverse RoPE  (Triton stand-in: split + combine, 2)
    wo_a, wo_b        grouped low-rank output (bmm) and the row-parallel wo_b                  (cuBLAS, 2)
    mHC seam          post of the attention, ffn_norm                                (Triton stand-ins, 2)
    MoE               GateLinear (bf16 weight), sqrtsoftplus + bias top-k, align, fused MoE (TritonExperts,
                      SwiGLU clamp), shared expert on a side stream, sum

Layers that reuse the latest indexer's top-k read a fixed random selection of ``min(topk, compressed rows)``
positions shared by every copy; readers of a KV source (not sources themselves) share one compressed cache, as
the real layers share their source's. The new token sits at position ``context`` (``seq_lens = context + 1``); a
compressed row is written where the token completes one. Stand-in kernels: ``sparse_mqa_kernels``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from latency_specialized.bench.stock import dsa_kernels as dk
from latency_specialized.bench.stock import moe as moe_k
from latency_specialized.bench.stock import sparse_mqa_kernels as sk
from latency_specialized.bench.stock.common import StockLayers, fork, join, on_stream, rand_norm_weight, rand_weight
from latency_specialized.bench.stock.gqa_moe import StockGQALatentMoE, StockGQAOptions
from latency_specialized.errors import UserError
from latency_specialized.spec import ModelSpec, MoESpec, SparseMQAAttentionSpec

__all__ = ["MHCState", "StockSparseMQAMoELayer", "StockSqrtSoftplusMoE", "build_for_kind", "build_stock_sparse_mqa",
           "notes_for_kind", "sparse_mqa_bytes"]


class MHCState:
    """What the stock layers share: the mHC streams [M, n, N], the last sublayer's output ``y`` and its post / comb
    coefficients, and the carried pre-mix (two buffers: a seam reads one and writes the other)."""

    def __init__(self, streams, y, post, comb, pre):
        self.streams, self.y, self.post, self.comb, self.pre = streams, y, post, comb, pre

    @classmethod
    def random(cls, batch: int, hidden: int, n: int, device) -> "MHCState":
        from latency_specialized.ops.residual_mhc import sinkhorn

        streams = torch.randn(batch, n, hidden, device=device).to(torch.bfloat16)
        y = (0.5 * torch.randn(batch, hidden, device=device)).to(torch.bfloat16)
        post = 2 * torch.sigmoid(torch.randn(batch, n, device=device))
        comb = sinkhorn(torch.randn(batch, n, n, device=device), 20, 1e-6).contiguous()
        pre = [torch.sigmoid(torch.randn(batch, n, device=device)) + 1e-6 for _ in range(2)]
        return cls(streams, y, post, comb, pre)

    def clone(self) -> "MHCState":
        return MHCState(self.streams.clone(), self.y.clone(), self.post.clone(), self.comb.clone(),
                        [p.clone() for p in self.pre])


class StockSqrtSoftplusMoE(StockGQALatentMoE):
    """The GQA composition's MoE sublayer (no latent width, no post-expert norm) with DeepSeek-V4's routing:
    ``sk.sqrtsoftplus_topk`` for ``fused_topk_bias`` (any top-k; the sigmoid kernel takes powers of two only)."""

    def forward(self, h2: torch.Tensor, out: torch.Tensor) -> None:
        M, dev, k = self.M, h2.device, self.top_k
        fork(self.aux)
        fork(self.shared_stream)
        with on_stream(self.aux):
            logits = F.linear(h2, self.w_router)
        shared = None
        if self.w_sgu is not None:
            with on_stream(self.shared_stream):
                sgu = F.linear(h2, self.w_sgu)
                shared = F.linear(self._act(sgu, torch.empty(M, sgu.shape[1] // 2, device=dev, dtype=torch.bfloat16)),
                                  self.w_sd)
        join(self.aux, logits)
        r = self.f.router
        sk.sqrtsoftplus_topk(logits, self.bias, k, renormalize=r.renormalize, scaling=r.routed_scaling,
                             renorm_eps=r.renormalize_eps, weights=self.topk_w, ids=self.topk_ids)
        moe_k.moe_align(self.topk_ids, self.align)
        T = M * k
        gu = torch.empty(T, 2 * self.I, device=dev, dtype=torch.bfloat16)
        moe_k.moe_gemm(h2, self.w13, self.align, k, out=gu, a_per_pair=False)
        act = self._act(gu, torch.empty(T, self.I, device=dev, dtype=torch.bfloat16))
        yp = torch.empty(T, self.L, device=dev, dtype=torch.bfloat16)
        moe_k.moe_gemm(act, self.w2, self.align, k, out=yp, a_per_pair=True, topk_weights=self.topk_w.view(-1))
        routed = torch.empty(M, self.L, device=dev, dtype=torch.bfloat16) if shared is not None else out
        moe_k.moe_sum(yp, k, out=routed)
        join(self.shared_stream, *([shared] if shared is not None else []))
        for s in (self.aux, self.shared_stream):
            if s is not None:
                h2.record_stream(s)
        if shared is not None:
            torch.add(routed, shared, out=out)


def _sources(full: ModelSpec, layer: int) -> tuple[bool, bool, bool]:
    """(KV source, runs an indexer, writes indexer keys) of ``layer`` (DeepseekV41Spec's fields; generic: none)."""
    a = full.layers[layer].attention
    src = layer in getattr(full, "kv_source_layers", ())
    idx = a.indexer is not None  # type: ignore[union-attr]
    return src, idx, src and idx


class StockSparseMQAMoELayer:
    """One DeepSeek-V4.1 layer, stock composition, on one rank (see the module docstring).

    Parameters
    ----------
    full : the unsharded spec (a ``DeepseekV41Spec``: ``kv_source_layers``, ``index_topk``, ``rope``, ``hyper``);
    ``layer`` a sparse MQA + MoE layer of it. tp : the TP size whose rank-0 shard this is. batch, context : sequences
    and cached tokens. block_size : compressed-cache block size (compressed rows). experts : optional (w13, w2)
    shared with another variant. streams : (aux0, aux1, shared) side streams (None: inline). shared : the first
    copy's read-only caches and selection (reader layers share them). attention : the sparse decode (tests pass
    the torch reference of the same contract).
    """

    def __init__(self, full: ModelSpec, layer: int, tp: int, batch: int, context: int, device, *,
                 block_size: int = 64, experts: tuple[torch.Tensor, torch.Tensor] | None = None,
                 streams: tuple[Any, Any, Any] | None = None, shared: "StockSparseMQAMoELayer | None" = None,
                 attention: Any = None):
        spec = full.layers[layer]
        a, f = spec.attention, spec.ffn
        if not (isinstance(a, SparseMQAAttentionSpec) and isinstance(f, MoESpec) and full.residual.kind == "mhc"):
            raise UserError(f"{full.name} layer {layer} is {spec.kind}: the sparse_mqa_moe stock composition builds "
                            "sparse MQA + MoE layers with an mHC residual (DeepSeek-V4.1)")
        from latency_specialized.ops.rope import rope_inv_freq

        dev, N = device, full.hidden_size
        self.a, self.M, self.N, self.layer = a, batch, N, layer
        self.src, self.idx, self.key_owner = _sources(full, layer)
        self.r = r = a.compress_ratio
        self.H, self.G = a.num_heads // tp, a.o_groups // tp
        D, R, W, ql, ol = a.head_dim, a.rope_dim, a.sliding_window, a.q_lora_rank, a.o_lora_rank
        self.D, self.ql, self.eps, self.bs = D, ql, full.norm.eps, block_size
        self.n = full.residual.streams
        hyper = getattr(full, "hyper", None)
        self.hc_eps = hyper.eps if hyper is not None else 1e-6
        self.post_mult = hyper.post_alpha if hyper is not None else 2.0
        self.iters = full.residual.sinkhorn_iters
        rope = getattr(full, "rope", None)
        theta = (rope.compress_theta if r else rope.theta) if rope is not None else 10_000.0
        self.inv_freq = rope_inv_freq(theta, R, device=dev)
        self._attention = attention
        # weights (fp32 where the checkpoint keeps them: sinks, mHC)
        self.w_qkv = rand_weight((ql + D, N), dev)
        self.q_norm_w, self.kv_norm_w = rand_norm_weight(ql, dev), rand_norm_weight(D, dev)
        self.w_qb = rand_weight((self.H * D, ql), dev)
        self.sinks = torch.randn(self.H, device=dev)
        self.w_oa = rand_weight((self.G, ol, self.H * D // self.G), dev)
        self.w_ob = rand_weight((N, self.G * ol), dev)
        X, n = (2 + self.n) * self.n, self.n
        self.fn = [rand_weight((X, n * N), dev, torch.float32) for _ in range(2)]
        self.hc_scale = [0.5 + torch.rand(3, device=dev) for _ in range(2)]
        self.hc_base = [0.1 * torch.randn(X, device=dev) for _ in range(2)]
        self.norm_w = [rand_norm_weight(N, dev) for _ in range(2)]
        S = -(-N // sk.MHC_CHUNK)
        BX = 1 << (X - 1).bit_length()
        self.mix = torch.empty(S, batch, BX, device=dev)
        self.sqrsum = torch.empty(S, batch, device=dev)
        # states: the window ring, the compressed cache (paged), the pending rows, the indexer keys
        self.positions = torch.full((batch,), context, device=dev, dtype=torch.int64)
        self.seq_lens = torch.full((batch,), context + 1, device=dev, dtype=torch.int32)
        self.state_rows = torch.arange(batch, device=dev, dtype=torch.int32)
        self.window = (0.5 * torch.randn(batch, W, D, device=dev)).to(torch.bfloat16)
        self.K = getattr(full, "index_topk", a.indexer.topk if a.indexer else 0) if r else 0  # type: ignore[union-attr]
        if r:
            n_c = (context + 1) // r
            self.seq_c = torch.full((batch,), n_c, device=dev, dtype=torch.int32)
            if shared is not None and not self.src:
                self.comp, self.bt_c = shared.comp, shared.bt_c
            else:
                per_seq = -(-(n_c + 1) // block_size)
                self.comp = (0.5 * torch.randn(batch * per_seq, block_size, D, device=dev)).to(torch.bfloat16)
                self.bt_c = torch.randperm(batch * per_seq, device=dev, dtype=torch.int32).view(batch, per_seq)
            self.rows = torch.full((batch, self.K), -1, device=dev, dtype=torch.int32)
            self.counts = torch.zeros(batch, device=dev, dtype=torch.int32)
            if self.src:
                self.w_comp = rand_weight((D * (2 if r > 1 else 1), N), dev)
                self.comp_norm_w = rand_norm_weight(D, dev)
                self.pending = (0.5 * torch.randn(batch, r, 2 * D, device=dev)).to(torch.bfloat16) if r > 1 else None
                self.lat = torch.empty(batch, D, device=dev, dtype=torch.bfloat16)
            if self.idx:
                ix = a.indexer
                self.ix = ix
                self.w_iq = rand_weight((ix.num_heads * ix.head_dim, ql), dev)  # type: ignore[union-attr]
                self.w_iw = rand_weight((ix.num_heads, N), dev)  # type: ignore[union-attr]
                self.w_scale = ix.head_dim ** -0.5 * ix.num_heads ** -0.5  # type: ignore[union-attr]
                self.inv_i = rope_inv_freq(theta, R, device=dev)
                self.dummy_q = torch.zeros(batch, 1, R, device=dev, dtype=torch.bfloat16)
                nb = self.bt_c.numel()
                if shared is not None and not self.key_owner and getattr(shared, "key_cache", None) is not None:
                    self.key_cache, self.key_scales = shared.key_cache, shared.key_scales
                else:
                    self.key_cache, self.key_scales = dk.fp8_quantize_reference(
                        torch.randn(nb, block_size, ix.head_dim, device=dev))  # type: ignore[union-attr]
                if self.key_owner:
                    self.w_ik = rand_weight((ix.head_dim, D), dev)  # type: ignore[union-attr]
                    self.ik_norm_w = rand_norm_weight(ix.head_dim, dev)  # type: ignore[union-attr]
                self.logits = torch.empty(batch, max(self.bt_c.shape[1] * block_size, self.K), device=dev)
                self.sel = None
            elif shared is not None and shared.sel is not None:
                self.sel = shared.sel
            else:   # the index group's selection: distinct random positions among the complete rows
                g = torch.Generator().manual_seed(1234 + layer)
                sel = torch.stack([torch.randperm(max(n_c, self.K), generator=g)[:self.K] for _ in range(batch)])
                self.sel = sel.masked_fill(sel >= n_c, -1).to(dev)
        else:
            self.sel = None
        self.moe = StockSqrtSoftplusMoE(f, N, tp, batch, self.eps, False, StockGQAOptions(post_expert_norm="none"), dev,
                                        experts=experts, streams=(streams[0], streams[2]) if streams else None)
        self.aux = (streams[0], streams[1]) if streams else (None, None)

    def weights(self) -> list[torch.Tensor]:
        names = ("w_qkv", "q_norm_w", "kv_norm_w", "w_qb", "sinks", "w_oa", "w_ob", "w_comp", "comp_norm_w", "w_iq",
                 "w_iw", "w_ik", "ik_norm_w")
        out = [getattr(self, k) for k in names if getattr(self, k, None) is not None]
        return out + self.fn + self.hc_scale + self.hc_base + self.norm_w + self.moe.weights()

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weights())

    def routed_ids(self) -> torch.Tensor:
        return self.moe.topk_ids

    # ------------------------------------------------------------------ forward
    def _seam(self, i: int, st: MHCState) -> torch.Tensor:
        x = torch.empty(self.M, self.N, device=st.y.device, dtype=torch.bfloat16)
        sk.mhc_post_mix(st.streams, st.y, st.post, st.comb, self.fn[i], mix=self.mix, sqrsum=self.sqrsum)
        sk.mhc_pre_norm(self.mix, self.sqrsum, self.hc_scale[i], self.hc_base[i], st.streams, st.pre[i],
                        self.norm_w[i], rms_eps=self.eps, hc_eps=self.hc_eps, post_mult=self.post_mult,
                        norm_eps=self.eps, iters=self.iters, pre=st.pre[1 - i], post=st.post, comb=st.comb, out=x)
        return x

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        M, D, ql, dev = self.M, self.D, self.ql, x.device
        a0, a1 = (self.aux[0] if self.src else None), (self.aux[1] if self.idx else None)
        fork(a0)  # only streams that get work: a forked stream left unjoined breaks the graph capture
        fork(a1)
        y = F.linear(x, self.w_qkv)
        if self.src:
            with on_stream(a0):     # the compressor beside the query path (vLLM: aux stream 0)
                c = F.linear(x, self.w_comp)
                sk.compress_insert(c, self.pending, self.state_rows, self.positions, self.comp_norm_w, self.inv_freq,
                                   self.comp, self.bt_c, self.r, self.eps, lat=self.lat)
        if self.idx:
            with on_stream(a1):
                iw = F.linear(x, self.w_iw)
        qr = torch.empty(M, ql, device=dev, dtype=torch.bfloat16)
        kv = torch.empty(M, D, device=dev, dtype=torch.bfloat16)
        sk.q_kv_rmsnorm(y, self.q_norm_w, self.kv_norm_w, self.eps, q_lora=ql, out=(qr, kv))
        q = F.linear(qr, self.w_qb).view(M, self.H, D)
        sk.qnorm_rope_kv_insert(q, kv, self.positions, self.inv_freq, self.window, self.state_rows, self.eps)
        join(a0, *([self.lat] if self.src else []))
        sel = self.sel
        if self.idx:
            iq = F.linear(qr, self.w_iq).view(M, self.ix.num_heads, self.ix.head_dim)
            if self.key_owner:
                k = F.linear(self.lat, self.w_ik)
                sk.index_key_store(k, self.ik_norm_w, self.positions, self.inv_i, self.key_cache, self.key_scales,
                                   self.bt_c, self.r, self.eps)
            join(a1, iw)
            iq8, iwo = dk.rope_q_index(self.positions, self.dummy_q, self.inv_i, nope=0, rope_interleaved=True,
                                       index_q=iq, index_weights=iw, index_inv_freq=self.inv_i,
                                       index_rope_interleaved=True, weight_scale=self.w_scale)
            dk.indexer_logits(iq8, iwo, self.key_cache, self.key_scales, self.bt_c, self.seq_c, out=self.logits)
            _, sel = dk.topk_select(self.logits, self.K)
        for s in (a0, a1):
            if s is not None:
                x.record_stream(s)
        if self.r:
            dk.convert_topk(sel, self.bt_c, self.seq_c, self.bs, rows=self.rows, counts=self.counts)
        o = torch.empty(self.G, M, self.H // self.G * D, device=dev, dtype=torch.bfloat16)
        attend = self._attention or sk.sparse_mqa_decode
        o = attend(q, self.window, self.state_rows, self.seq_lens, self.comp if self.r else None,
                   self.rows if self.r else None, self.counts if self.r else None, self.sinks, self.positions,
                   self.inv_freq, groups=self.G, **({} if self._attention else {"out": o}))
        og = torch.bmm(o, self.w_oa.transpose(1, 2))                                   # [G, M, o_lora]
        og = og[0] if self.G == 1 else og.transpose(0, 1).reshape(M, -1)
        return F.linear(og, self.w_ob)

    def forward(self, st: MHCState) -> None:
        """One layer: folds ``st.y`` (the previous FFN output) into the streams, leaves this layer's FFN output
        (unjoined) in ``st.y``."""
        x = self._seam(0, st)
        st.y = self.attention(x)
        x2 = self._seam(1, st)
        self.moe.forward(x2, st.y)

    def reference_forward(self, st: MHCState) -> None:
        """The same layer from torch references (fp32 math, the kernels' roundings): the oracle of ``forward``."""
        def mm(x, w):
            return (x.float() @ w.float().t()).to(torch.bfloat16)

        def seam(i):
            x, pre, post, comb = sk.mhc_seam_reference(
                st.streams, st.y, st.post, st.comb, self.fn[i], self.hc_scale[i], self.hc_base[i], st.pre[i],
                self.norm_w[i], rms_eps=self.eps, hc_eps=self.hc_eps, post_mult=self.post_mult, norm_eps=self.eps,
                iters=self.iters)
            st.pre[1 - i].copy_(pre)
            st.post.copy_(post)
            st.comb.copy_(comb)
            return x

        M, D, ql = self.M, self.D, self.ql
        x = seam(0)
        y = mm(x, self.w_qkv)
        qr, kv = sk.q_kv_rmsnorm_reference(y, self.q_norm_w, self.kv_norm_w, self.eps, q_lora=ql)
        q = mm(qr, self.w_qb).view(M, self.H, D)
        sk.qnorm_rope_kv_insert_reference(q, kv, self.positions, self.inv_freq, self.window, self.state_rows, self.eps)
        sel = self.sel
        if self.src:
            lat = sk.compress_insert_reference(mm(x, self.w_comp), self.pending, self.state_rows, self.positions,
                                               self.comp_norm_w, self.inv_freq, self.comp, self.bt_c, self.r, self.eps)
        if self.idx:
            iq = mm(qr, self.w_iq).view(M, self.ix.num_heads, self.ix.head_dim)
            if self.key_owner:
                sk.index_key_store_reference(mm(lat, self.w_ik), self.ik_norm_w, self.positions, self.inv_i,
                                             self.key_cache, self.key_scales, self.bt_c, self.r, self.eps)
            iq8, iwo = dk.rope_q_index_reference(self.positions, self.dummy_q.clone(), self.inv_i, nope=0,
                                                 rope_interleaved=True, index_q=iq, index_weights=mm(x, self.w_iw),
                                                 index_inv_freq=self.inv_i, index_rope_interleaved=True,
                                                 weight_scale=self.w_scale)
            logits = dk.indexer_logits_reference(iq8, iwo, self.key_cache, self.key_scales, self.bt_c, self.seq_c,
                                                 self.logits.shape[1])
            rows, counts = dk.topk_rows_reference(logits, self.K, self.bt_c, self.seq_c, self.bs)
        elif self.r:
            rows, counts = dk.convert_topk_reference(sel, self.bt_c, self.seq_c, self.bs)
        if self.r:
            self.rows.copy_(rows)
            self.counts.copy_(counts)
        o = sk.sparse_mqa_decode_reference(q, self.window, self.state_rows, self.seq_lens,
                                           self.comp if self.r else None, self.rows if self.r else None,
                                           self.counts if self.r else None, self.sinks, self.positions, self.inv_freq,
                                           groups=self.G)
        og = (torch.einsum("gmk,gok->gmo", o.float(), self.w_oa.float())).to(torch.bfloat16)
        st.y = mm(og.transpose(0, 1).reshape(M, -1), self.w_ob)
        self.moe.reference_forward(seam(1), st.y)


def build_stock_sparse_mqa(full: ModelSpec, layer: int, tp: int, batch: int, context: int, copies: int, device, *,
                           block_size: int = 64, experts: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                           attention: Any = None) -> StockLayers:
    """``copies`` stock layers of ``layer``'s sort (readers share the first copy's caches and selection)."""
    on_gpu = torch.device(device).type == "cuda"
    streams = (torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()) if on_gpu else None
    layers: list[StockSparseMQAMoELayer] = []
    for i in range(copies):
        layers.append(StockSparseMQAMoELayer(full, layer, tp, batch, context, device, block_size=block_size,
                                             experts=experts[i] if experts else None, streams=streams,
                                             shared=layers[0] if layers else None, attention=attention))
    return StockLayers(layers, MHCState.random(batch, full.hidden_size, full.residual.streams, device))


def build_for_kind(full: ModelSpec, bk: Any, tp: int, batch: int, context: int, copies: int, device, *,
                   experts: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> StockLayers:
    """The composition's builder (``compositions.COMPOSITIONS['sparse_mqa_moe']``) for a ``BenchKind`` ``bk``."""
    if bk.stock_options:
        raise UserError(f"stock sparse_mqa_moe takes no options: drop {sorted(bk.stock_options)}")
    return build_stock_sparse_mqa(full, bk.layer, tp, batch, context, copies, device, block_size=bk.kv_block_size,
                                  experts=experts)


# ------------------------------------------------------------------------------------------ roofline and notes
def sparse_mqa_bytes(full: ModelSpec, layer: int, tp: int, batch: int, context: int | None, *,
                     weight_bytes: float = 2.0) -> dict[str, float]:
    """The attention + mHC terms of a DeepSeek-V4.1 layer's floor on one rank (``layer_bench.layer_bytes`` takes
    them for every sparse MQA layer): weights / TP (q_a | kv, q_b, sinks fp32, wo_a, wo_b, q / kv norms; KV sources
    the compressor + its norm; index layers wq_b + weights_proj, key owners wk + its norm); ``kv_cache``: the
    ``min(context + 1, window)`` window rows + ``min(compressed rows, topk)`` selected rows read, the new window row
    written (+ one compressed row on a source); ``indexer_cache``: every compressed row's key read (+ one written by a
    key owner); ``compressor_state``: a source's pending rows (ratio > 1) read and written; ``mhc``: both seams'
    fp32 projections, bases, scales and the two bf16 input norms / TP, plus the streams read twice and written
    twice per seam."""
    a = full.layers[layer].attention
    assert isinstance(a, SparseMQAAttentionSpec)
    N, wb, D, r = full.hidden_size, weight_bytes, a.head_dim, a.compress_ratio
    src, idx, key_owner = _sources(full, layer)
    n = (context or 0) + 1
    w = (a.q_lora_rank + D) * N + a.num_heads * D * a.q_lora_rank + a.o_groups * a.o_lora_rank * (
        a.num_heads * D // a.o_groups) + N * a.o_groups * a.o_lora_rank + a.q_lora_rank + D
    w = w * wb + a.num_heads * 4
    topk = getattr(full, "index_topk", a.indexer.topk if a.indexer else 0)
    rows = min(n, a.sliding_window) + (min(n // r, topk) if r else 0)
    out: dict[str, float] = {"kv_cache": batch * (rows + 1 + (1 if src else 0)) * D * wb}
    if src:
        w += (D * (2 if r > 1 else 1) * N + D) * wb
        if r > 1:
            out["compressor_state"] = batch * r * 2 * D * wb * 2
    if idx:
        ix = a.indexer
        w += (ix.num_heads * ix.head_dim * a.q_lora_rank + ix.num_heads * N) * wb  # type: ignore[union-attr]
        if key_owner:
            w += (ix.head_dim * D + ix.head_dim) * wb  # type: ignore[union-attr]
        out["indexer_cache"] = batch * (n // r + (1 if key_owner else 0)) * ix.head_dim * wb  # type: ignore[union-attr]
    out["attn_weights"] = w / tp
    s = full.residual.streams
    X = (2 + s) * s
    out["mhc"] = 2 * ((X * s * N + X + 3) * 4 + N * wb) / tp + 2 * batch * s * N * wb * 3
    return out


def notes_for_kind(full: ModelSpec, name: str, bk: Any, tp: int) -> list[str]:
    """What one benched DeepSeek-V4.1 kind's cells measure, then what stock runs (the same for every kind)."""
    layer = bk.layer
    a, f = full.layers[layer].attention, full.layers[layer].ffn
    src, idx, key_owner = _sources(full, layer)
    r = a.compress_ratio
    what = ("window only (no compressed KV)" if not r else
            f"compressed KV ratio {r}" + (" (this layer's compressor writes it)" if src else " (a source's cache)")
            + (f", its own indexer ({a.indexer.num_heads} x {a.indexer.head_dim})" if idx else
               ", the latest indexer's top-k reused"))
    b = sparse_mqa_bytes(full, layer, tp, 1, 4096)
    return [
        f"{name} layers (layer {layer}): sparse MQA {a.num_heads // tp} of {a.num_heads} heads per rank (head "
        f"{a.head_dim}, rope {a.rope_dim}, q_lora {a.q_lora_rank}, {a.o_groups} x o_lora {a.o_lora_rank} output "
        f"groups), window {a.sliding_window}, {what}; MoE {f.num_experts} x top-{f.top_k}, "
        f"{f.num_shared_experts} shared; mHC x{full.residual.streams}. Roofline at batch 1, context 4096: "
        f"{b['kv_cache'] / 2**20:.2f} MB of KV rows" + (f", {b['indexer_cache'] / 2**20:.2f} MB of indexer keys"
                                                         if idx else "") +
        f", {b['attn_weights'] / 2**20:.1f} MB of attention weights (/TP), {b['mhc'] / 2**20:.2f} MB of mHC.",
        "DeepSeek-V4.1 layers, stock: vLLM 0.33's Hopper bf16 path (FlashMLA attention class) with stand-ins "
        "written the way stock writes them (bench/stock/sparse_mqa_kernels.py): mHC seams as 2 Triton kernels each "
        "(for the tilelang fused post + pre-norm GEMM and MHC_PRE_NORM_KERNEL), fused_q_kv_rmsnorm, "
        "qnorm_rope_kv_insert (for vLLM's CUDA op), the compressor (fused_compress_quant_cache) and indexer_k_store "
        "(Triton), the indexer's query quant, fp8_paged_mqa_logits (DeepGEMM), top-k (torch.topk for vLLM's "
        "one-kernel top-k) and the global-index conversion from bench/stock/dsa_kernels.py, FlashMLA's sparse "
        "decode (flash_mla_with_kvcache over the SWA + compressed indices with sinks; not runnable here) as a Triton "
        "split + combine with the output's inverse RoPE folded into the combine, sqrtsoftplus top-k (for "
        "fused_topk_bias), MoE as the GQA composition's (align, Triton fused MoE, SwiGLU clamp, shared expert on a "
        "side stream); cuBLAS for every projection (wq_a | wkv, compressor, indexer replicated), wo_a a bmm. Caches "
        "bf16 (stock: fp8 FlashMLA records, about 0.6 KB per row vs 1 KB here); the whole layer is captured in one CUDA "
        "graph (stock runs the indexer and attention in an eager break of a breakable graph: slower than measured "
        "here). Reuse layers read a fixed random selection.",
    ]
