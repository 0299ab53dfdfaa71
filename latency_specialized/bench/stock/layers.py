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
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from latency_specialized.bench.stock import kda as kda_k
from latency_specialized.bench.stock import moe as moe_k
from latency_specialized.bench.stock import norms
from latency_specialized.ops.attention.kda import kda_decode_reference
from latency_specialized.ops.moe import experts_reference, route_reference
from latency_specialized.ops.mlp import mlp_reference
from latency_specialized.ops.norm import rmsnorm_reference
from latency_specialized.spec import KDAAttentionSpec, ModelSpec, MoESpec


def _on(stream):
    """Run on ``stream`` (a CUDA side stream), or inline where there is none (CPU tests)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _fork(stream) -> None:
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())


def _join(stream, *tensors: torch.Tensor) -> None:
    if stream is not None:
        main = torch.cuda.current_stream()
        main.wait_stream(stream)
        for t in tensors:  # made on the side stream, used on main: keep the allocator from reusing it early
            t.record_stream(main)


def _w(shape: tuple[int, ...], device, dtype=torch.bfloat16, fan_in: int | None = None) -> torch.Tensor:
    fan = fan_in if fan_in is not None else shape[-1]
    t = torch.randn(shape, device=device, dtype=torch.float32 if dtype == torch.float32 else dtype)
    return t.mul_(fan ** -0.5).to(dtype)


def _norm_w(n: int, device, dtype=torch.bfloat16) -> torch.Tensor:
    return (1.0 + 0.1 * torch.randn(n, device=device)).to(dtype)


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


class StockKDAMoELayer:
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
        self.top_k, self.E = f.top_k, f.num_experts
        self._router = f.router
        L = f.latent_dim or N
        I = f.expert_intermediate // tp
        self.L, self.I = L, I
        self.act = f.activation
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
        # MoE (router + latent projections replicated, as stock keeps them)
        self.w_gate = _w((self.E, N), dev)
        self.gate_bias = 0.1 * torch.randn(self.E, device=dev)
        self.w_ld = _w((L, N), dev)
        self.w_lu = _w((N, L), dev)
        self.lat_norm_w = _norm_w(L, dev)
        if experts is None:
            experts = (_w((self.E, 2 * I, L), dev), _w((self.E, L, I), dev))
        self.w13, self.w2 = experts
        S = f.num_shared_experts * f.expert_intermediate // tp
        self.w_sgu = _w((2 * S, N), dev)
        self.w_sd = _w((N, S), dev)
        self.align = moe_k.AlignBuffers.allocate(moe_k.AlignSizes(batch * self.top_k, self.E, 16), dev)
        self.topk_w = torch.empty(batch, self.top_k, device=dev)
        self.topk_ids = torch.empty(batch, self.top_k, device=dev, dtype=torch.int32)
        self.aux, self.shared_stream = streams if streams is not None else (None, None)

    def weight_bytes(self) -> int:
        """Bytes of every weight this layer holds (routed experts: all of them)."""
        ts = [self.w_in, self.w_fb, self.conv_w, self.A_log, self.dt_bias, self.o_norm_w, self.w_o, self.w_gate,
              self.gate_bias, self.w_ld, self.w_lu, self.lat_norm_w, self.w13, self.w2, self.w_sgu, self.w_sd]
        return sum(t.numel() * t.element_size() for t in ts)

    def forward(self, st: AttnResState) -> None:
        """One layer; reads ``st.delta`` (previous sublayer output), writes this layer's output to it."""
        M, HD, D, H, N = self.M, self.HD, self.D, self.H, self.N
        dev = st.prefix.device
        # ---- attention sublayer
        h = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        nw, qk, ow = self.res[0]
        norms.attn_res(st.prefix, st.delta, st.blocks, nw, qk, ow, st.num_blocks, -1, self.eps, self.eps, out=h)
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
        attn_out = F.linear(on, self.w_o)
        # ---- MoE sublayer
        h2 = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        nw, qk, ow = self.res[1]
        norms.attn_res(st.prefix, attn_out, st.blocks, nw, qk, ow, st.num_blocks, -1, self.eps, self.eps, out=h2)
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
        moe_k.moe_align(self.topk_ids, self.align)
        _join(self.aux, lat)
        T = M * self.top_k
        gu = torch.empty(T, 2 * self.I, device=dev, dtype=torch.bfloat16)
        moe_k.moe_gemm(lat, self.w13, self.align, self.top_k, out=gu, a_per_pair=False)
        act = torch.empty(T, self.I, device=dev, dtype=torch.bfloat16)
        moe_k.situ_and_mul(gu, self.act.beta, self.act.beta_lin, out=act)
        yp = torch.empty(T, self.L, device=dev, dtype=torch.bfloat16)
        moe_k.moe_gemm(act, self.w2, self.align, self.top_k, out=yp, a_per_pair=True,
                       topk_weights=self.topk_w.view(-1))
        routed = torch.empty(M, self.L, device=dev, dtype=torch.bfloat16)
        moe_k.moe_sum(yp, self.top_k, out=routed)
        normed = torch.empty_like(routed)
        norms.rmsnorm(routed, self.lat_norm_w, self.eps, out=normed)
        _join(self.shared_stream, shared)
        for s in (self.aux, self.shared_stream):
            if s is not None:
                h2.record_stream(s)  # read on the side streams, allocated on main
        torch.addmm(shared, normed, self.w_lu.t(), out=st.delta)

    def reference_forward(self, st: AttnResState) -> None:
        """The same layer from the op-family references (fp32 math): the oracle of ``forward``."""
        M, HD, D, H = self.M, self.HD, self.D, self.H
        nw, qk, ow = self.res[0]
        h = norms.attn_res_reference(st.prefix, st.delta, st.blocks, nw, qk, ow, st.num_blocks, -1, self.eps, self.eps)
        proj = (h.float() @ self.w_in.float().t()).to(h.dtype)
        mixed, g_out = proj[:, : 3 * HD], proj[:, 3 * HD: 4 * HD]
        f_a, beta = proj[:, 4 * HD: 4 * HD + D], proj[:, 4 * HD + D: 4 * HD + D + H]
        fdec = (f_a.float() @ self.w_fb.float().t()).to(h.dtype)
        o = kda_decode_reference(mixed, self.conv_state, self.conv_w, fdec, self.A_log, self.dt_bias, beta, g_out,
                                 self.o_norm_w, self.state, self.state_idx, num_heads=H, eps=self.eps,
                                 gate_lower_bound=self.lower_bound)
        attn_out = (o.float() @ self.w_o.float().t()).to(h.dtype)
        nw, qk, ow = self.res[1]
        h2 = norms.attn_res_reference(st.prefix, attn_out, st.blocks, nw, qk, ow, st.num_blocks, -1, self.eps, self.eps)
        logits = (h2.float() @ self.w_gate.float().t()).to(h2.dtype)
        router = route_reference(logits, self.gate_bias, self.top_k, self._router)
        lat = (h2.float() @ self.w_ld.float().t()).to(h2.dtype)
        routed = experts_reference(lat, router[0], router[1], self.w13, self.w2, self.act)
        normed = rmsnorm_reference(routed, self.lat_norm_w, self.eps)
        shared = mlp_reference(h2, self.w_sgu, self.w_sd, self.act)
        st.delta.copy_((normed.float() @ self.w_lu.float().t() + shared.float()).to(h2.dtype))
        self.topk_ids.copy_(router[1])

    def routed_ids(self) -> torch.Tensor:
        """[M, k] expert ids of the last forward."""
        return self.topk_ids


class StockLayers:
    """``copies`` stock layers of one kind run back to back (weights rotate beyond L2)."""

    name = "stock"

    def __init__(self, layers: list[StockKDAMoELayer], stream_state: AttnResState):
        self.layers, self.st = layers, stream_state
        self.copies = len(layers)

    def step(self) -> None:
        for layer in self.layers:
            layer.forward(self.st)

    def routed_ids(self) -> list[torch.Tensor]:
        return [layer.routed_ids() for layer in self.layers]

    def weight_bytes(self) -> int:
        return sum(layer.weight_bytes() for layer in self.layers)


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
