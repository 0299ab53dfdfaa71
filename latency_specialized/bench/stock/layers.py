"""The stock Kimi K3 decoder layer on one rank, composed like stock vLLM decodes it (PERF.md "Stock").

Per KDA+MoE layer (20 kernels; communication excluded on one GPU):

    attn_res                      fused prefix add + block mix + input RMSNorm      (Triton, 1)
    in_proj                       q|k|v|g_out|f_a|beta in one GEMM (f_a replicated)   (cuBLAS, 1)
    f_b_proj                      decay up-projection                                 (cuBLAS, 1)
    conv_update, recurrent_kda, gated_rmsnorm                                         (Triton, 3)
    o_proj                                                                            (cuBLAS, 1)
    [all-reduce: excluded]
    attn_res                      prefix add + mix + post-attention RMSNorm           (Triton, 1)
    router gate (replicated, all experts) -> grouped_topk -> moe_align                (cuBLAS + Triton, 3)
    aux stream: latent down-projection (replicated)                                   (cuBLAS, 1)
    shared-expert stream: gate_up -> SiTU-GLU -> down                                 (cuBLAS + Triton, 3)
    fused MoE over the selected experts: gate_up, SiTU-GLU, down x weight, sum         (Triton, 4)
    [all-reduce of the latent + shared partials: excluded]
    latent RMSNorm -> up-projection (replicated) + shared output (addmm epilogue)      (Triton + cuBLAS, 2)

The router and the latent projections are full-size on every rank, as stock vLLM keeps them
(``ReplicatedLinear``); experts and shared experts are split by TP on their intermediate width.
All weights are random with the real per-rank shapes, drawn on the GPU.

MLA + MoE layers (``StockMLAMoELayer``): the same MoE sublayer (``StockLatentMoE``) after stock's MLA
decode attention (see that class): FlashMLA where ``LS_FLASHMLA_SRC`` names a checkout (``flashmla.py``), else
our Triton kernel as a stand-in (the results' notes say which ran).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from latency_specialized.bench.stock import kda as kda_k
from latency_specialized.bench.stock import moe as moe_k
from latency_specialized.bench.stock import norms
from latency_specialized.bench.stock.common import StockLayers
from latency_specialized.bench.stock.common import fork as _fork
from latency_specialized.bench.stock.common import join as _join
from latency_specialized.bench.stock.common import on_stream as _on
from latency_specialized.bench.stock.common import rand_norm_weight as _norm_w
from latency_specialized.bench.stock.common import rand_weight as _w
from latency_specialized.bench.stock.flashmla import stock_flashmla
from latency_specialized.ops.attention.kda import kda_decode_reference
from latency_specialized.ops.moe import experts_reference, route_reference
from latency_specialized.ops.mlp import mlp_reference
from latency_specialized.ops.norm import rmsnorm_reference
from latency_specialized.quant.checkpoint_io import QuantizedWeight
from latency_specialized.spec import ActivationSpec, KDAAttentionSpec, MLAAttentionSpec, ModelSpec, MoESpec


def _humming_experts(w13: QuantizedWeight, w2: QuantizedWeight, act: ActivationSpec):
    """Stock vLLM 0.33's MXFP4 routed experts on Hopper (humming's MoE), prepared from the same codes and scales as
    ours (UserError for another format or activation)."""
    from latency_specialized.bench.peers.humming_mxfp4 import HummingMxfp4MoE
    from latency_specialized.errors import UserError
    from latency_specialized.quant.layout import checkpoint_nibbles

    # ours may hold them in the paired layout (pieces.ffn.latent_moe.PAIR_EXPERT_CODES): humming reads the checkpoint's
    w13, w2 = checkpoint_nibbles(w13), checkpoint_nibbles(w2)
    if w13.fmt.name != "mxfp4" or w2.fmt.name != "mxfp4":
        raise UserError(f"stock routed experts kept quantized: MXFP4 only (vLLM 0.33 runs it through humming on "
                        f"Hopper), got {w13.fmt.name}")
    if act.kind == "situ_glu":
        return HummingMxfp4MoE().prepare(w13.weight, w13.scale, w2.weight, w2.scale, activation_kind="situ_glu",
                                         beta=act.beta, beta_lin=act.beta_lin)
    return HummingMxfp4MoE().prepare(w13.weight, w13.scale, w2.weight, w2.scale, activation_kind=act.kind,
                                     clamp=act.clamp)


@dataclass
class AttnResState:
    """The AttnRes stream shared by consecutive layers: running prefix and completed blocks."""

    prefix: torch.Tensor
    """[M, N] running prefix of the current block."""
    blocks: torch.Tensor
    """[M, R, N] completed block outputs."""
    delta: torch.Tensor
    """[M, N] previous sublayer's output (added to the prefix by the next attn_res)."""
    num_blocks: int
    """Completed blocks mixed (mid-model value; the cost barely depends on it)."""

    @classmethod
    def random(cls, batch: int, hidden: int, rows: int, num_blocks: int, device) -> "AttnResState":
        return cls(torch.randn(batch, hidden, device=device, dtype=torch.bfloat16),
                   torch.randn(batch, rows, hidden, device=device, dtype=torch.bfloat16),
                   torch.randn(batch, hidden, device=device, dtype=torch.bfloat16), num_blocks)


class StockLatentMoE:
    """The latent-MoE sublayer of a stock Kimi K3 layer on one rank (router .. latent up-projection).

    Parameters
    ----------
    f : the layer's MoESpec; ``hidden`` the model width; ``tp`` the TP size whose rank-0 shard this is.
    batch : tokens per step.
    experts : optional (w13 [E, 2I, L], w2 [E, L, I]) to share routed-expert weights with another variant; as
        MXFP4 ``QuantizedWeight`` the routed experts run as stock vLLM 0.33 runs MXFP4 experts on Hopper: humming's
        MoE (``bench/peers/humming_mxfp4.py``: its align, w13 GEMM, SiTU-GLU process-input kernel, w2 GEMM, route
        sum) in place of the Triton fused MoE.
    streams : (aux, shared) CUDA side streams (None: inline, CPU tests).
    """

    def __init__(self, f: MoESpec, hidden: int, tp: int, batch: int, eps: float, device, *,
                 experts: tuple[torch.Tensor, torch.Tensor] | None = None,
                 streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None):
        N, dev = hidden, device
        self.M, self.eps = batch, eps
        self.top_k, self.E = f.top_k, f.num_experts
        self._router = f.router
        L = f.latent_dim or N
        I = f.expert_intermediate // tp
        self.L, self.I = L, I
        self.act = f.activation
        # router + latent projections replicated, as stock keeps them
        self.w_gate = _w((self.E, N), dev)
        self.gate_bias = 0.1 * torch.randn(self.E, device=dev)
        self.w_ld = _w((L, N), dev)
        self.w_lu = _w((N, L), dev)
        self.lat_norm_w = _norm_w(L, dev)
        if experts is None:
            experts = (_w((self.E, 2 * I, L), dev), _w((self.E, L, I), dev))
        self.w13, self.w2 = experts
        self.humming = _humming_experts(self.w13, self.w2, self.act) if isinstance(self.w13, QuantizedWeight) else None
        S = f.num_shared_experts * f.expert_intermediate // tp
        self.w_sgu = _w((2 * S, N), dev)
        self.w_sd = _w((N, S), dev)
        self.align = moe_k.AlignBuffers.allocate(moe_k.AlignSizes(batch * self.top_k, self.E, 16), dev)
        self.topk_w = torch.empty(batch, self.top_k, device=dev)
        self.topk_ids = torch.empty(batch, self.top_k, device=dev, dtype=torch.int32)
        self.aux, self.shared_stream = streams if streams is not None else (None, None)

    def weights(self) -> list[torch.Tensor]:
        return [self.w_gate, self.gate_bias, self.w_ld, self.w_lu, self.lat_norm_w, self.w13, self.w2, self.w_sgu,
                self.w_sd]

    def forward(self, h2: torch.Tensor, out: torch.Tensor) -> None:
        """``out = latent_up(norm(routed experts(latent_down(h2)))) + shared(h2)`` (partials at TP > 1)."""
        M, dev = self.M, h2.device
        _fork(self.aux)
        _fork(self.shared_stream)
        with _on(self.aux):
            lat = F.linear(h2, self.w_ld)
        with _on(self.shared_stream):
            sgu = F.linear(h2, self.w_sgu)
            sact = torch.empty(M, sgu.shape[1] // 2, device=dev, dtype=torch.bfloat16)
            moe_k.situ_and_mul(sgu, self.act.beta, self.act.beta_lin, out=sact)
            shared = F.linear(sact, self.w_sd)
        logits = F.linear(h2, self.w_gate)
        moe_k.grouped_topk(logits, self.gate_bias, self.top_k, weights=self.topk_w, ids=self.topk_ids)
        if self.humming is None:
            moe_k.moe_align(self.topk_ids, self.align)
        _join(self.aux, lat)
        routed = torch.empty(M, self.L, device=dev, dtype=torch.bfloat16)
        if self.humming is not None:  # stock's MXFP4 path: humming aligns the routes itself
            self.humming(lat, self.topk_w, self.topk_ids, out=routed)
        else:
            self._fused_moe(lat, routed)
        normed = torch.empty_like(routed)
        norms.rmsnorm(routed, self.lat_norm_w, self.eps, out=normed)
        _join(self.shared_stream, shared)
        for s in (self.aux, self.shared_stream):
            if s is not None:
                h2.record_stream(s)  # read on the side streams, allocated on main
        torch.addmm(shared, normed, self.w_lu.t(), out=out)

    def _fused_moe(self, lat: torch.Tensor, routed: torch.Tensor) -> None:
        """Stock's Triton fused MoE over bf16 experts (after its align): w13 GEMM, SiTU-GLU, w2 GEMM x routing
        weight, sum."""
        M, dev = self.M, lat.device
        T = M * self.top_k
        gu = torch.empty(T, 2 * self.I, device=dev, dtype=torch.bfloat16)
        moe_k.moe_gemm(lat, self.w13, self.align, self.top_k, out=gu, a_per_pair=False)
        act = torch.empty(T, self.I, device=dev, dtype=torch.bfloat16)
        moe_k.situ_and_mul(gu, self.act.beta, self.act.beta_lin, out=act)
        yp = torch.empty(T, self.L, device=dev, dtype=torch.bfloat16)
        moe_k.moe_gemm(act, self.w2, self.align, self.top_k, out=yp, a_per_pair=True,
                       topk_weights=self.topk_w.view(-1))
        moe_k.moe_sum(yp, self.top_k, out=routed)

    def reference_forward(self, h2: torch.Tensor, out: torch.Tensor) -> None:
        """The same sublayer from the op-family references (fp32 math); sets ``topk_ids`` too."""
        logits = (h2.float() @ self.w_gate.float().t()).to(h2.dtype)
        router = route_reference(logits, self.gate_bias, self.top_k, self._router)
        lat = (h2.float() @ self.w_ld.float().t()).to(h2.dtype)
        routed = experts_reference(lat, router[0], router[1], self.w13, self.w2, self.act)
        normed = rmsnorm_reference(routed, self.lat_norm_w, self.eps)
        shared = mlp_reference(h2, self.w_sgu, self.w_sd, self.act)
        out.copy_((normed.float() @ self.w_lu.float().t() + shared.float()).to(h2.dtype))
        self.topk_ids.copy_(router[1])


class _StockMoELayer:
    """What the stock X+MoE layers share: the two AttnRes mixes around the attention and the
    latent-MoE sublayer (``res`` and ``moe`` are set by the subclass)."""

    res: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    moe: StockLatentMoE
    eps: float
    M: int
    N: int

    def _attn_input(self, st: AttnResState) -> torch.Tensor:
        h = torch.empty(self.M, self.N, device=st.prefix.device, dtype=torch.bfloat16)
        nw, qk, ow = self.res[0]
        norms.attn_res(st.prefix, st.delta, st.blocks, nw, qk, ow, st.num_blocks, -1, self.eps, self.eps, out=h)
        return h

    def _moe_sublayer(self, st: AttnResState, attn_out: torch.Tensor) -> None:
        h2 = torch.empty(self.M, self.N, device=st.prefix.device, dtype=torch.bfloat16)
        nw, qk, ow = self.res[1]
        norms.attn_res(st.prefix, attn_out, st.blocks, nw, qk, ow, st.num_blocks, -1, self.eps, self.eps, out=h2)
        self.moe.forward(h2, st.delta)

    def _attn_input_reference(self, st: AttnResState) -> torch.Tensor:
        nw, qk, ow = self.res[0]
        return norms.attn_res_reference(st.prefix, st.delta, st.blocks, nw, qk, ow, st.num_blocks, -1, self.eps,
                                        self.eps)

    def _moe_sublayer_reference(self, st: AttnResState, attn_out: torch.Tensor) -> None:
        nw, qk, ow = self.res[1]
        h2 = norms.attn_res_reference(st.prefix, attn_out, st.blocks, nw, qk, ow, st.num_blocks, -1, self.eps, self.eps)
        self.moe.reference_forward(h2, st.delta)

    def routed_ids(self) -> torch.Tensor:
        """[M, k] expert ids of the last forward."""
        return self.moe.topk_ids

    def _bytes(self, attention_weights: list[torch.Tensor]) -> int:
        """Bytes of the layer's weights: its attention's plus the MoE sublayer's (all routed experts)."""
        return sum(t.nbytes if isinstance(t, QuantizedWeight) else t.numel() * t.element_size()
                   for t in [*attention_weights, *self.moe.weights()])


class StockKDAMoELayer(_StockMoELayer):
    """One KDA + latent-MoE layer, stock composition, on one rank (see the module docstring).

    Parameters
    ----------
    full : the unsharded model spec; ``layer`` a KDA+MoE layer index of it.
    tp : tensor-parallel size whose rank-0 shard this is.
    batch : sequences per step (state rows: batch + 1, row 0 is the padding row).
    experts : optional (w13 [E, 2I, L], w2 [E, L, I]) to share routed-expert weights with another variant.
    """

    def __init__(self, full: ModelSpec, layer: int, tp: int, batch: int, device, *,
                 experts: tuple[torch.Tensor, torch.Tensor] | None = None,
                 streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None):
        spec = full.layers[layer]
        a, f = spec.attention, spec.ffn
        assert isinstance(a, KDAAttentionSpec) and isinstance(f, MoESpec), f"layer {layer} is not KDA+MoE"
        N = full.hidden_size
        H, D = a.num_heads // tp, a.head_dim
        HD = H * D
        self.N, self.H, self.D, self.HD, self.M = N, H, D, HD, batch
        self.eps = full.norm.eps
        self.lower_bound = a.gate_lower_bound
        dev = device
        # attention
        rows = 4 * HD + a.decay_rank + H
        self.in_rows = rows + (-rows % 16)  # vLLM pads the merged in_proj to 16 rows
        self.w_in = _w((self.in_rows, N), dev)
        self.w_fb = _w((HD, a.decay_rank), dev)
        self.conv_w = _w((3 * HD, a.conv_kernel), dev, torch.float32)
        self.A_log = torch.log(0.5 + 1.5 * torch.rand(H, device=dev))
        self.dt_bias = -2.0 + 0.5 * torch.randn(HD, device=dev)
        self.o_norm_w = _norm_w(D, dev, torch.float32)
        self.w_o = _w((N, HD), dev)
        self.state = 0.1 * torch.randn(batch + 1, H, D, D, device=dev)
        self.conv_state = torch.randn(batch + 1, 3 * HD, a.conv_kernel - 1, device=dev, dtype=torch.bfloat16)
        self.state_idx = torch.arange(1, batch + 1, device=dev, dtype=torch.int32)
        # AttnRes (two mixes per layer)
        self.res = [(_norm_w(N, dev), _w((N,), dev, fan_in=N), _norm_w(N, dev)) for _ in range(2)]
        self.moe = StockLatentMoE(f, N, tp, batch, self.eps, dev, experts=experts, streams=streams)

    def weight_bytes(self) -> int:
        """Bytes of every weight this layer holds (routed experts: all of them)."""
        return self._bytes([self.w_in, self.w_fb, self.conv_w, self.A_log, self.dt_bias, self.o_norm_w, self.w_o])

    def forward(self, st: AttnResState) -> None:
        """One layer; reads ``st.delta`` (previous sublayer output), writes this layer's output to it."""
        M, HD, D, H = self.M, self.HD, self.D, self.H
        dev = st.prefix.device
        h = self._attn_input(st)
        proj = F.linear(h, self.w_in)
        mixed, g_out = proj[:, : 3 * HD], proj[:, 3 * HD: 4 * HD]
        f_a = proj[:, 4 * HD: 4 * HD + D]
        beta = proj[:, 4 * HD + D: 4 * HD + D + H]
        fdec = F.linear(f_a, self.w_fb)
        conv = torch.empty(M, 3 * HD, device=dev, dtype=torch.bfloat16)
        kda_k.conv_update(mixed, self.conv_state, self.conv_w, self.state_idx, out=conv)
        o = torch.empty(M, HD, device=dev, dtype=torch.bfloat16)
        kda_k.recurrent_kda(conv, fdec, self.A_log, self.dt_bias, beta, self.state, self.state_idx, num_heads=H,
                            lower_bound=self.lower_bound, out=o)
        on = torch.empty_like(o)
        norms.gated_rmsnorm(o, g_out, self.o_norm_w, D, self.eps, out=on)
        self._moe_sublayer(st, F.linear(on, self.w_o))

    def reference_forward(self, st: AttnResState) -> None:
        """The same layer from the op-family references (fp32 math): the oracle of ``forward``."""
        HD, D, H = self.HD, self.D, self.H
        h = self._attn_input_reference(st)
        proj = (h.float() @ self.w_in.float().t()).to(h.dtype)
        mixed, g_out = proj[:, : 3 * HD], proj[:, 3 * HD: 4 * HD]
        f_a, beta = proj[:, 4 * HD: 4 * HD + D], proj[:, 4 * HD + D: 4 * HD + D + H]
        fdec = (f_a.float() @ self.w_fb.float().t()).to(h.dtype)
        o = kda_decode_reference(mixed, self.conv_state, self.conv_w, fdec, self.A_log, self.dt_bias, beta, g_out,
                                 self.o_norm_w, self.state, self.state_idx, num_heads=H, eps=self.eps,
                                 gate_lower_bound=self.lower_bound)
        self._moe_sublayer_reference(st, (o.float() @ self.w_o.float().t()).to(h.dtype))


class StockMLAMoELayer(_StockMoELayer):
    """One MLA + latent-MoE layer, stock composition, on one rank, decoding against ``context`` cached tokens.

    Attention (stock vLLM's MLA decode path, absorbed form):

        attn_res                  prefix add + block mix + input RMSNorm                  (Triton, 1)
        fused_qkv_a_proj          q_a | kv_a (replicated, as vLLM's ReplicatedLinear)      (cuBLAS, 1)
        q_a_layernorm, kv_a_layernorm                                                      (Triton, 2)
        q_b_proj, g_proj (Kimi's sigmoid output gate)                                      (cuBLAS, 2)
        MLA decode (``StockFlashMLA``): concat_and_cache_mla, bmm W_UK, cat, FlashMLA
        split-KV + combine, bmm W_UV, then the gate (sigmoid, multiply) or a head-major copy (8 or 7)
        o_proj                                                                             (cuBLAS, 1)

    The MLA decode is FlashMLA where ``LS_FLASHMLA_SRC`` names a checkout (``flashmla.py``); otherwise
    ``attention.mla.triton_splitkv`` - the *same* function ours runs - stands in for it, and the MLA cells
    compare everything around the attention kernel (``mla_note`` says which ran). The MoE sublayer is
    ``StockLatentMoE`` (as in the KDA layer).

    Parameters
    ----------
    full : the unsharded spec; ``layer`` an MLA+MoE layer index. context : cached tokens per sequence
    (the new token is written at position ``context``). block_size : paged-cache block size (64, vLLM's
    MLA default).
    """

    def __init__(self, full: ModelSpec, layer: int, tp: int, batch: int, context: int, device, *,
                 experts: tuple[torch.Tensor, torch.Tensor] | None = None,
                 streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None, block_size: int = 64):
        spec = full.layers[layer]
        a, f = spec.attention, spec.ffn
        assert isinstance(a, MLAAttentionSpec) and isinstance(f, MoESpec), f"layer {layer} is not MLA+MoE"
        assert a.q_lora_rank, "stock MLA composition: q_lora layers only (Kimi K3)"
        N, dev = full.hidden_size, device
        H = a.num_heads // tp
        self.a, self.N, self.H, self.M = a, N, H, batch
        self.eps = full.norm.eps
        L, R, ql = a.kv_lora_rank, a.qk_rope_head_dim, a.q_lora_rank
        qk = a.qk_nope_head_dim + R
        self.w_qkv_a = _w((ql + L + R, N), dev)
        self.q_a_norm_w, self.kv_a_norm_w = _norm_w(ql, dev), _norm_w(L, dev)
        self.w_q_b = _w((H * qk, ql), dev)
        self.w_kv_b = _w((H * (a.qk_nope_head_dim + a.v_head_dim), L), dev)
        self.w_g = _w((H * a.v_head_dim, N), dev) if a.output_gate == "sigmoid" else None
        self.w_o = _w((N, H * a.v_head_dim), dev)
        # paged latent cache: each sequence's blocks in a shuffled order, ``context`` live tokens
        per_seq = -(-(context + 1) // block_size)
        self.cache = 0.5 * torch.randn(batch * per_seq, block_size, L + R, device=dev, dtype=torch.bfloat16)
        order = torch.randperm(batch * per_seq, device=dev, dtype=torch.int32)
        self.block_table = order.view(batch, per_seq)
        pos = torch.full((batch,), context, device=dev, dtype=torch.int64)
        self.slot_mapping = self.block_table[:, context // block_size].long() * block_size + context % block_size
        self.seq_lens = (pos + 1).to(torch.int32)
        self.res = [(_norm_w(N, dev), _w((N,), dev, fan_in=N), _norm_w(N, dev)) for _ in range(2)]
        self.moe = StockLatentMoE(f, N, tp, batch, self.eps, dev, experts=experts, streams=streams)
        # stock's own MLA decode kernel where LS_FLASHMLA_SRC names a FlashMLA checkout (bench/stock/flashmla.py)
        self.flashmla = stock_flashmla(self.w_kv_b, H, a.qk_nope_head_dim, a.v_head_dim)

    def weight_bytes(self) -> int:
        gate = [self.w_g] if self.w_g is not None else []
        return self._bytes([self.w_qkv_a, self.q_a_norm_w, self.kv_a_norm_w, self.w_q_b, self.w_kv_b, self.w_o, *gate])

    def _attention(self, h: torch.Tensor, mla) -> torch.Tensor:
        a, M, H, dev = self.a, self.M, self.H, h.device
        L, ql = a.kv_lora_rank, a.q_lora_rank
        y = F.linear(h, self.w_qkv_a)
        q_c = torch.empty(M, ql, device=dev, dtype=torch.bfloat16)
        norms.rmsnorm(y[:, :ql], self.q_a_norm_w, self.eps, out=q_c)
        c = torch.empty(M, L, device=dev, dtype=torch.bfloat16)
        norms.rmsnorm(y[:, ql:ql + L], self.kv_a_norm_w, self.eps, out=c)
        q = F.linear(q_c, self.w_q_b).view(M, H, a.qk_nope_head_dim + a.qk_rope_head_dim)
        gate = F.linear(h, self.w_g) if self.w_g is not None else None
        o = mla(q, c, y[:, ql + L:], self.cache, self.slot_mapping, self.block_table, self.seq_lens, self.w_kv_b,
                qk_nope_head_dim=a.qk_nope_head_dim, v_head_dim=a.v_head_dim, gate=gate)
        return F.linear(o, self.w_o)

    def forward(self, st: AttnResState) -> None:
        """One layer; reads ``st.delta`` (previous sublayer output), writes this layer's output to it."""
        from latency_specialized.kernels.mla_decode_triton import mla_decode_triton

        self._moe_sublayer(st, self._attention(self._attn_input(st), self.flashmla or mla_decode_triton))

    def reference_forward(self, st: AttnResState) -> None:
        """The same layer from the op-family references (fp32 math): the oracle of ``forward``."""
        from latency_specialized.ops.attention.mla import mla_decode_reference

        a, ql, L = self.a, self.a.q_lora_rank, self.a.kv_lora_rank
        h = self._attn_input_reference(st)
        y = (h.float() @ self.w_qkv_a.float().t()).to(h.dtype)
        q_c = rmsnorm_reference(y[:, :ql], self.q_a_norm_w, self.eps)
        c = rmsnorm_reference(y[:, ql:ql + L], self.kv_a_norm_w, self.eps)
        q = (q_c.float() @ self.w_q_b.float().t()).to(h.dtype).view(self.M, self.H, -1)
        gate = (h.float() @ self.w_g.float().t()).to(h.dtype) if self.w_g is not None else None
        o = mla_decode_reference(q, c, y[:, ql + L:], self.cache, self.slot_mapping, self.block_table, self.seq_lens,
                                 self.w_kv_b, qk_nope_head_dim=a.qk_nope_head_dim, v_head_dim=a.v_head_dim, gate=gate)
        self._moe_sublayer_reference(st, (o.float() @ self.w_o.float().t()).to(h.dtype))


def build_stock_kda(full: ModelSpec, layer: int, tp: int, batch: int, copies: int, device, *,
                    experts: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> StockLayers:
    """``copies`` stock KDA+MoE layers at batch ``batch`` with an AttnRes stream mid-model."""
    on_gpu = torch.device(device).type == "cuda"
    streams = (torch.cuda.Stream(), torch.cuda.Stream()) if on_gpu else None
    layers = [StockKDAMoELayer(full, layer, tp, batch, device, streams=streams,
                               experts=experts[i] if experts else None) for i in range(copies)]
    rows = full.residual.max_cached_blocks or 8
    st = AttnResState.random(batch, full.hidden_size, rows, num_blocks=min(4, rows), device=device)
    return StockLayers(layers, st)


def build_stock_mla(full: ModelSpec, layer: int, tp: int, batch: int, context: int, copies: int, device, *,
                    experts: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                    block_size: int = 64) -> StockLayers:
    """``copies`` stock MLA+MoE layers at batch ``batch`` over ``context`` cached tokens per sequence."""
    on_gpu = torch.device(device).type == "cuda"
    streams = (torch.cuda.Stream(), torch.cuda.Stream()) if on_gpu else None
    layers = [StockMLAMoELayer(full, layer, tp, batch, context, device, streams=streams, block_size=block_size,
                               experts=experts[i] if experts else None) for i in range(copies)]
    rows = full.residual.max_cached_blocks or 8
    st = AttnResState.random(batch, full.hidden_size, rows, num_blocks=min(4, rows), device=device)
    return StockLayers(layers, st)
