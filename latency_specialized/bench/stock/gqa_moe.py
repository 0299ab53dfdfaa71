"""The stock GQA + (latent) MoE decoder layer on one rank, composed the way stock vLLM 0.33 decodes Muse
Spark on Hopper with bf16 weights (``vllm/models/muse_spark/nvidia/model.py``, ``muse_moe_runner.py``),
generic over the spec (``GQAAttentionSpec``: heads, KV heads, head_dim, window, RoPE, QK norm, output
gate; ``MoESpec``: latent width, shared experts, router) plus the model facts of
:class:`StockGQAOptions` (the adapter's ``BenchKind.stock_options``).

Per layer (Muse Spark at TP8: 18-19 kernels at batch 1; communication excluded on one GPU)::

    boundary        previous FFN output: post-FFN norm + residual gate + input RMSNorm  (Triton stand-in, 1)
    qkv_proj        q | k | v | gate in one GEMM (vLLM's fused QKV+O-gate linear)       (cuBLAS, 1)
    qk_norm_rope_kv weightless QK norm + RoPE + KV-cache write                          (Triton stand-in, 1)
    attention       attention.gqa.triton_splitkv: the kernel ours runs (split + merge)  (Triton, 1-2)
    o_norm_gate     per-head RMSNorm of the output x sigmoid(gate)                      (Triton stand-in, 1)
    o_proj                                                                              (cuBLAS, 1)
    [all-reduce: excluded]
    boundary        post-attention norm + residual gate + pre-FFN RMSNorm               (Triton stand-in, 1)
    aux stream:     router in fp32: input cast + GEMM (replicated, GateLinear fp32)     (torch + cuBLAS, 2)
    pre_expert_proj (replicated, ReplicatedLinear) -> pre-expert RMSNorm               (cuBLAS + Triton, 2)
    grouped top-k   sigmoid + selection bias, renormalised (logit scale folded)         (Triton stand-in, 1)
    fused MoE       align, gate/up GEMM, SwiGLU, down GEMM -> per-route rows            (Triton, 4)
    [pre-norm all-reduce of the per-route rows: excluded]
    finalize        per-route post-expert norm x routing weight, fp32 top-k sum         (Triton stand-in, 1)
    post_expert_proj (replicated)                                                       (cuBLAS, 1)

and the FFN output stays unjoined: the next layer's first boundary joins it (vLLM defers that blend to
fuse it with the next norm). Shared experts, where the spec has them, run on a side stream (gate/up,
SwiGLU, down) and are added by the up-projection's addmm; without a latent width the experts run at
the hidden width and there are no latent projections.

Stand-ins (vLLM's own CUDA ops and kernels that do not run here, written the way stock writes them):
``gqa_kernels.qk_norm_rope_kv`` (vLLM's ``fused_muse_spark_qknorm_rope_kv_insert`` CUDA op),
``gqa_kernels.norm_residual_norm`` (``fused_norm_residual_norm_fwd`` / FlashInfer's
``gated_residual_next_rmsnorm``), ``norms.gated_rmsnorm`` (FlashInfer ``rmsnorm_sigmoid_gate`` / FLA
``rms_norm_gated``), ``norms.rmsnorm`` (``fused_rmsnorm_fwd``), ``moe.grouped_topk`` (the Triton
``fused_musespark1x_routing``), ``moe.moe_align`` / ``moe_gemm`` (``moe_align_block_size`` and the
Triton fused-MoE kernel of ``TritonExperts``, vLLM's BF16 MoE path on SM90), ``gqa_kernels.silu_and_mul``
(CUDA op) and ``gqa_kernels.post_expert_finalize`` (``fused_post_expert_finalize``). The decode attention
is the *same* kernel ours runs (``attention.gqa.triton_splitkv``, standing in for stock's FlashAttention-3,
which ships inside the vLLM wheel), as the MLA bench does for MLA: the cells compare everything around it.
Router, pre- and post-expert projections are replicated on every rank, as stock keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Literal, Mapping

import torch
import torch.nn.functional as F

from latency_specialized.bench.stock import gqa_kernels as gk
from latency_specialized.bench.stock import moe as moe_k
from latency_specialized.bench.stock import norms
from latency_specialized.bench.stock.common import StockLayers, fork, join, on_stream, rand_weight
from latency_specialized.errors import UserError
from latency_specialized.spec import GQAAttentionSpec, ModelSpec, MoESpec

GQA_ATTENTION = "attention.gqa.triton_splitkv"
"""The decode attention both variants run (``latency_specialized/kernels/gqa_decode_triton.py``)."""


@dataclass(frozen=True)
class StockGQAOptions:
    """What the stock layer needs beyond the generic spec (``BenchKind.stock_options`` keywords)."""

    rope_style: Literal["neox", "interleaved"] = "neox"
    """RoPE pair layout (vLLM ``is_neox_style``; Muse Spark: interleaved)."""
    attn_output_norm: bool = False
    """Weightless per-head RMSNorm of the attention output before the gate (Muse Spark's o_norm)."""
    post_attn_norm: Literal["none", "weightless", "weighted", "input_scaled"] = "none"
    """Norm of the attention output before its residual join (sandwich norms; 'none': pre-norm only)."""
    post_ffn_norm: Literal["none", "weightless", "weighted", "input_scaled"] = "none"
    """Norm of the FFN output before its residual join."""
    post_norm_eps: float = 1e-6
    """Epsilon of the post norms (and of the post-expert norm)."""
    post_norm_zero_centered: bool = False
    """Post-norm gains stored zero-centred (gain = 1 + w)."""
    gate_temperature: float | None = None
    """Norm-preserving residual gate ``s = a s + b branch`` (b = sigmoid(g/T)) with this T; None: plain add."""
    gate_floor: float = 1e-3
    """Floor inside a's square root."""
    residual_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the residual stream."""
    pre_expert_norm: bool = True
    """RMSNorm of the latent input after the pre-expert projection (latent MoE only)."""
    post_expert_norm: Literal["none", "weighted", "input_scaled"] = "none"
    """Per-route norm of the experts' outputs before the routing weight (Muse Spark: input-scaled);
    'none': the down GEMM applies the routing weight and a top-k sum follows."""

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> "StockGQAOptions":
        known = {f.name for f in fields(cls)}
        bad = sorted(set(options) - known)
        if bad:
            raise UserError(f"stock gqa_moe options {bad} unknown: use {', '.join(sorted(known))}")
        return cls(**dict(options))


def _gain(n: int, zero_centered: bool, device) -> torch.Tensor:
    """A random RMSNorm gain parameter around an effective gain of 1 (stored zero-centred or not)."""
    w = 0.1 * torch.randn(n, device=device)
    return (w if zero_centered else 1.0 + w).to(torch.bfloat16)


def _eff(w: torch.Tensor, zero_centered: bool) -> torch.Tensor:
    return (1.0 + w.float()) if zero_centered else w.float()


def resolve_attention() -> Callable[..., torch.Tensor]:
    """The decode attention ours runs (``attention.gqa.triton_splitkv``), found by its implementation name;
    a RuntimeError naming what is missing where it is not there (never another kernel in its place)."""
    try:
        from latency_specialized.kernels import gqa_decode_triton as mod
    except ImportError as e:
        raise RuntimeError(f"stock GQA layer: {GQA_ATTENTION} is not importable ({e}); the bench runs the same "
                           "decode attention in both variants and has no other") from e
    impl = next((i for i in getattr(mod, "IMPLEMENTATIONS", []) if i.name == GQA_ATTENTION), None)
    if impl is None:
        raise RuntimeError(f"stock GQA layer: latency_specialized/kernels/gqa_decode_triton.py registers no "
                           f"{GQA_ATTENTION}; the bench runs the same decode attention in both variants")
    return impl.fn


@dataclass
class GatedStream:
    """The residual stream between stock layers: the stream and the last sublayer output not yet joined."""

    stream: torch.Tensor
    """[M, N] residual stream (fp32 for a gated residual, as vLLM keeps it)."""
    branch: torch.Tensor
    """[M, N] previous sublayer output (bf16), joined by the next boundary kernel."""

    @classmethod
    def random(cls, batch: int, hidden: int, dtype: torch.dtype, device) -> "GatedStream":
        return cls(torch.randn(batch, hidden, device=device).to(dtype),
                   torch.randn(batch, hidden, device=device, dtype=torch.bfloat16))

    def clone(self) -> "GatedStream":
        return GatedStream(self.stream.clone(), self.branch.clone())


@dataclass
class _Join:
    """One residual boundary's parameters: the post norm of the joined branch, the gate, the next norm."""

    post: str
    post_w: torch.Tensor | None
    gate: torch.Tensor | None
    """Gate logits [N] fp32 (None: plain add)."""
    alpha: torch.Tensor | None
    beta: torch.Tensor | None
    pre_w: torch.Tensor


class StockGQAMoELayer:
    """One GQA + MoE layer, stock composition, on one rank, decoding against ``context`` cached tokens
    (see the module docstring).

    Parameters
    ----------
    full : the unsharded spec; ``layer`` a GQA+MoE layer index of it. tp : the TP size whose rank-0 shard
    this is. batch : sequences per step. context : cached tokens per sequence (the new token is written at
    position ``context``). options : :class:`StockGQAOptions`. block_size : paged-cache block size.
    router_weight_bytes : 4 keeps the router weight in fp32 (vLLM's GateLinear with fp32 params), 2 bf16.
    experts : optional (w13 [E, 2I, L], w2 [E, L, I]) shared with another variant. streams : (aux,
    shared) CUDA side streams (None: inline, CPU tests). attention : the decode attention (default: the
    one ours runs, :func:`resolve_attention`, looked up at the first forward).
    """

    def __init__(self, full: ModelSpec, layer: int, tp: int, batch: int, context: int, device, *,
                 options: StockGQAOptions = StockGQAOptions(), block_size: int = 16, router_weight_bytes: int = 2,
                 experts: tuple[torch.Tensor, torch.Tensor] | None = None,
                 streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None,
                 attention: Callable[..., torch.Tensor] | None = None):
        spec = full.layers[layer]
        a, f = spec.attention, spec.ffn
        if not (isinstance(a, GQAAttentionSpec) and isinstance(f, MoESpec)):
            raise UserError(f"{full.name} layer {layer} is {spec.kind}, not gqa+moe: the gqa_moe stock composition "
                            "builds GQA + MoE layers")
        if f.router.score_func != "sigmoid":
            raise UserError(f"stock gqa_moe: router score {f.router.score_func!r} has no stock top-k stand-in "
                            "(moe.grouped_topk is sigmoid + bias)")
        dev, N = device, full.hidden_size
        local = a.shard(tp) if tp > 1 else a
        self.a, self.local, self.f, self.opt = a, local, f, options
        self.M, self.N, self.context = batch, N, context
        self.Hq, self.KV, self.D = local.num_heads, local.num_kv_heads, local.head_dim
        self.eps, self.zc = full.norm.eps, full.norm.zero_centered
        self.gated = a.output_gate == "sigmoid"
        self._attention = attention
        Hq, KV, D = self.Hq, self.KV, self.D
        self.q_cols = Hq * D
        self.w_qkv = rand_weight(((2 * Hq if self.gated else Hq) * D + 2 * KV * D, N), dev)
        self.w_o = rand_weight((N, Hq * D), dev)
        self.ones_d = torch.ones(D, device=dev, dtype=torch.float32)  # the weightless o_norm's gain
        self.inv_freq = None
        if a.rope_theta is not None:
            from latency_specialized.ops.rope import rope_inv_freq

            self.inv_freq = rope_inv_freq(a.rope_theta, D, device=dev)
        # paged KV cache: each sequence's blocks in a shuffled order, ``context`` live tokens
        per_seq = -(-(context + 1) // block_size)
        self.k_cache = 0.5 * torch.randn(batch * per_seq, block_size, KV, D, device=dev, dtype=torch.bfloat16)
        self.v_cache = 0.5 * torch.randn(batch * per_seq, block_size, KV, D, device=dev, dtype=torch.bfloat16)
        self.block_table = torch.randperm(batch * per_seq, device=dev, dtype=torch.int32).view(batch, per_seq)
        self.positions = torch.full((batch,), context, device=dev, dtype=torch.int64)
        self.slot_mapping = self.block_table[:, context // block_size].long() * block_size + context % block_size
        self.seq_lens = torch.full((batch,), context + 1, device=dev, dtype=torch.int32)
        # the two boundaries of this layer: the previous layer's FFN output joined into the attention input,
        # the attention output joined into the FFN input
        self.res_dtype = torch.float32 if options.residual_dtype == "float32" else torch.bfloat16
        self.joins = [self._join(options.post_ffn_norm, dev), self._join(options.post_attn_norm, dev)]
        self.moe = StockGQALatentMoE(f, N, tp, batch, self.eps, self.zc, options, dev, experts=experts,
                                     streams=streams, router_weight_bytes=router_weight_bytes)

    def _join(self, post: str, dev) -> _Join:
        from latency_specialized.ops.residual_gated import norm_preserving_coefficients

        o, N = self.opt, self.N
        post_w = _gain(N, o.post_norm_zero_centered, dev) if post in ("weighted", "input_scaled") else None
        gate = alpha = beta = None
        if o.gate_temperature is not None:
            gate = torch.randn(N, device=dev)  # logits: b spans ~(0.04, 0.96) at T = 0.3
            alpha, beta = (t.contiguous() for t in norm_preserving_coefficients(gate, o.gate_temperature,
                                                                                o.gate_floor))
        return _Join(post, post_w, gate, alpha, beta, _gain(N, self.zc, dev))

    def weights(self) -> list[torch.Tensor]:
        out = [self.w_qkv, self.w_o]
        for j in self.joins:
            out += [t for t in (j.post_w, j.alpha, j.beta, j.pre_w) if t is not None]
        return out + self.moe.weights()

    def weight_bytes(self) -> int:
        """Bytes of every weight this layer holds (routed experts: all of them)."""
        return sum(t.numel() * t.element_size() for t in self.weights())

    def routed_ids(self) -> torch.Tensor:
        """[M, k] expert ids of the last forward."""
        return self.moe.topk_ids

    # ------------------------------------------------------------------ forward
    def _boundary(self, j: _Join, branch: torch.Tensor, st: GatedStream) -> torch.Tensor:
        h = torch.empty(self.M, self.N, device=branch.device, dtype=torch.bfloat16)
        gk.norm_residual_norm(branch, st.stream, j.pre_w, self.eps, pre_zero_centered=self.zc, post=j.post,
                              post_weight=j.post_w, post_eps=self.opt.post_norm_eps,
                              post_zero_centered=self.opt.post_norm_zero_centered, alpha=j.alpha, beta=j.beta, out=h)
        return h

    def forward(self, st: GatedStream) -> None:
        """One layer: joins ``st.branch`` (the previous FFN output) into ``st.stream``, writes this layer's FFN
        output (unjoined) to ``st.branch``."""
        if self._attention is None:
            self._attention = resolve_attention()
        M, Hq, KV, D, dev = self.M, self.Hq, self.KV, self.D, st.stream.device
        h = self._boundary(self.joins[0], st.branch, st)
        qkv = F.linear(h, self.w_qkv)
        q = torch.empty(M, Hq, D, device=dev, dtype=torch.bfloat16)
        gk.qk_norm_rope_kv(qkv, self.positions, self.inv_freq, self.slot_mapping, self.k_cache, self.v_cache,
                           num_heads=Hq, num_kv_heads=KV, qk_norm=self.a.qk_norm, eps=self.eps,
                           rope_style=self.opt.rope_style, q_out=q)
        o = self._attention(q, self.k_cache, self.v_cache, self.block_table, self.seq_lens,
                            scale=self.a.softmax_scale, window=self.a.sliding_window).view(M, Hq * D)
        gate = qkv[:, self.q_cols + 2 * KV * D:] if self.gated else None
        if self.opt.attn_output_norm and gate is not None:  # one kernel: per-head norm x sigmoid(gate)
            on = torch.empty_like(o)
            norms.gated_rmsnorm(o, gate, self.ones_d, D, self.eps, out=on)
        elif self.opt.attn_output_norm:
            on = torch.empty(M * Hq, D, device=dev, dtype=torch.bfloat16)
            norms.rmsnorm(o.view(M * Hq, D), self.ones_d, self.eps, out=on)
            on = on.view(M, Hq * D)
        elif gate is not None:  # vLLM: og.sigmoid() * attn_output
            on = gate.sigmoid() * o
        else:
            on = o
        attn_out = F.linear(on, self.w_o)
        h2 = self._boundary(self.joins[1], attn_out, st)
        self.moe.forward(h2, st.branch)

    def reference_forward(self, st: GatedStream) -> None:
        """The same layer from the op-family references (fp32 math): the oracle of ``forward``."""
        from latency_specialized.ops.attention.gqa import gqa_decode_reference, write_kv_reference
        from latency_specialized.ops.rope import apply_rope

        M, Hq, KV, D = self.M, self.Hq, self.KV, self.D
        h = self._boundary_reference(self.joins[0], st.branch, st)
        qkv = (h.float() @ self.w_qkv.float().t()).to(torch.bfloat16)
        nq, nkv = Hq * D, KV * D
        q, k = qkv[:, :nq].float().view(M, Hq, D), qkv[:, nq:nq + nkv].float().view(M, KV, D)
        v = qkv[:, nq + nkv:nq + 2 * nkv].view(M, KV, D)
        if self.a.qk_norm:
            q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + self.eps)
            k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.inv_freq is not None:
            q = apply_rope(q, self.positions, self.inv_freq, self.opt.rope_style)
            k = apply_rope(k, self.positions, self.inv_freq, self.opt.rope_style)
        q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
        write_kv_reference(self.k_cache, self.v_cache, k, v, self.slot_mapping)
        o = gqa_decode_reference(q, self.k_cache, self.v_cache, self.block_table, self.seq_lens,
                                 scale=self.a.softmax_scale, window=self.a.sliding_window).float()
        if self.opt.attn_output_norm:
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        o = o.reshape(M, nq)
        if self.gated:
            o = o * torch.sigmoid(qkv[:, nq + 2 * nkv:].float())
        attn_out = (o.to(torch.bfloat16).float() @ self.w_o.float().t()).to(torch.bfloat16)
        h2 = self._boundary_reference(self.joins[1], attn_out, st)
        self.moe.reference_forward(h2, st.branch)

    def _boundary_reference(self, j: _Join, branch: torch.Tensor, st: GatedStream) -> torch.Tensor:
        from latency_specialized.ops.residual_gated import gated_join_reference

        o = self.opt
        x, _ = gated_join_reference(branch, st.stream, j.pre_w, self.eps, zero_centered=self.zc, post=j.post,
                                    post_weight=j.post_w, post_eps=o.post_norm_eps,
                                    post_zero_centered=o.post_norm_zero_centered, gate=j.gate,
                                    gate_temperature=o.gate_temperature or 1.0, gate_eps=o.gate_floor,
                                    out_dtype=torch.bfloat16)
        return x


class StockGQALatentMoE:
    """The (latent) MoE sublayer of the stock GQA layer on one rank: router (fp32, replicated, aux stream)
    beside pre-expert projection + norm, grouped top-k, fused MoE to per-route rows, finalize, post-expert
    projection (see the module docstring)."""

    def __init__(self, f: MoESpec, hidden: int, tp: int, batch: int, eps: float, zero_centered: bool,
                 options: StockGQAOptions, device, *, experts: tuple[torch.Tensor, torch.Tensor] | None = None,
                 streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None, router_weight_bytes: int = 2):
        dev, N = device, hidden
        self.f, self.opt, self.M, self.N, self.eps = f, options, batch, N, eps
        self.E, self.top_k = f.num_experts, f.top_k
        self.latent = f.latent_dim is not None
        L = f.latent_dim or N
        I = f.expert_intermediate // tp
        self.L, self.I = L, I
        if f.activation.kind not in ("swiglu", "situ_glu"):
            raise UserError(f"stock gqa_moe: activation {f.activation.kind!r} has no stand-in")
        # router replicated, the logit scale folded into its weight (vLLM's fold_router_output_multiplier)
        rdt = torch.float32 if router_weight_bytes == 4 else torch.bfloat16
        self.w_router = (rand_weight((self.E, N), dev, torch.float32) * f.router.logit_scale).to(rdt)
        self.router = f.router.model_copy(update={"logit_scale": 1.0})
        self.bias = (0.1 * torch.randn(self.E, device=dev)) if f.router.bias_corrected else \
            torch.zeros(self.E, device=dev)
        self.w_pre = rand_weight((L, N), dev) if self.latent else None
        self.pre_w = _gain(L, zero_centered, dev) if (self.latent and options.pre_expert_norm) else None
        self.pre_w_eff = _eff(self.pre_w, zero_centered) if self.pre_w is not None else None
        self.zc = zero_centered
        self.w_post = rand_weight((N, L), dev) if self.latent else None
        self.post_w = _gain(L, options.post_norm_zero_centered, dev) if options.post_expert_norm != "none" else None
        if experts is None:
            experts = (rand_weight((self.E, 2 * I, L), dev), rand_weight((self.E, L, I), dev))
        self.w13, self.w2 = experts
        S = f.num_shared_experts * f.expert_intermediate // tp
        self.w_sgu = rand_weight((2 * S, N), dev) if S else None
        self.w_sd = rand_weight((N, S), dev) if S else None
        self.align = moe_k.AlignBuffers.allocate(moe_k.AlignSizes(batch * self.top_k, self.E, 16), dev)
        self.topk_w = torch.empty(batch, self.top_k, device=dev)
        self.topk_ids = torch.empty(batch, self.top_k, device=dev, dtype=torch.int32)
        self.aux, self.shared_stream = streams if streams is not None else (None, None)

    def weights(self) -> list[torch.Tensor]:
        ws = [self.w_router, self.bias, self.w_pre, self.pre_w, self.w_post, self.post_w, self.w13, self.w2,
              self.w_sgu, self.w_sd]
        return [t for t in ws if t is not None]

    def _act(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        a = self.f.activation
        if a.kind == "situ_glu":
            return moe_k.situ_and_mul(x, a.beta, a.beta_lin, out=out)
        return gk.silu_and_mul(x, clamp=a.clamp, out=out)

    def forward(self, h2: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` = the MoE sublayer of ``h2`` (a TP partial at TP > 1: the post-expert projection's rows of
        this rank's routed experts; stock's all-reduces are excluded)."""
        M, dev, k = self.M, h2.device, self.top_k
        fork(self.aux)
        fork(self.shared_stream)
        with on_stream(self.aux):  # GateLinear: fp32 weight -> fp32 input (a cast), fp32 GEMM
            logits = F.linear(h2.float(), self.w_router) if self.w_router.dtype == torch.float32 else \
                F.linear(h2, self.w_router)
        shared = None
        if self.w_sgu is not None:
            with on_stream(self.shared_stream):
                sgu = F.linear(h2, self.w_sgu)
                sact = torch.empty(M, sgu.shape[1] // 2, device=dev, dtype=torch.bfloat16)
                shared = F.linear(self._act(sgu, sact), self.w_sd)
        if self.latent:
            x = F.linear(h2, self.w_pre)
            if self.pre_w_eff is not None:
                xn = torch.empty_like(x)
                norms.rmsnorm(x, self.pre_w_eff, self.eps, out=xn)
                x = xn
        else:
            x = h2
        join(self.aux, logits)
        r = self.f.router
        moe_k.grouped_topk(logits, self.bias, k, renormalize=r.renormalize, scaling=r.routed_scaling,
                           renorm_eps=r.renormalize_eps, weights=self.topk_w, ids=self.topk_ids)
        moe_k.moe_align(self.topk_ids, self.align)
        T = M * k
        gu = torch.empty(T, 2 * self.I, device=dev, dtype=torch.bfloat16)
        moe_k.moe_gemm(x, self.w13, self.align, k, out=gu, a_per_pair=False)
        act = self._act(gu, torch.empty(T, self.I, device=dev, dtype=torch.bfloat16))
        yp = torch.empty(T, self.L, device=dev, dtype=torch.bfloat16)
        routed = torch.empty(M, self.L, device=dev, dtype=torch.bfloat16) if (self.latent or shared is not None) \
            else out
        if self.opt.post_expert_norm != "none":
            moe_k.moe_gemm(act, self.w2, self.align, k, out=yp, a_per_pair=True)  # per-route rows, unweighted
            # [TP > 1: stock all-reduces the per-route rows here, before the norm: excluded]
            gk.post_expert_finalize(yp, self.topk_w, self.post_w, self.opt.post_norm_eps,
                                    gain_before_norm=self.opt.post_expert_norm == "input_scaled",
                                    zero_centered=self.opt.post_norm_zero_centered, out=routed)
        else:
            moe_k.moe_gemm(act, self.w2, self.align, k, out=yp, a_per_pair=True, topk_weights=self.topk_w.view(-1))
            moe_k.moe_sum(yp, k, out=routed)
        join(self.shared_stream, *([shared] if shared is not None else []))
        for s in (self.aux, self.shared_stream):
            if s is not None:
                h2.record_stream(s)  # read on the side streams, allocated on main
        if self.latent:
            if shared is not None:
                torch.addmm(shared, routed, self.w_post.t(), out=out)
            else:
                torch.mm(routed, self.w_post.t(), out=out)
        elif shared is not None:
            torch.add(routed, shared, out=out)

    def reference_forward(self, h2: torch.Tensor, out: torch.Tensor) -> None:
        """The same sublayer from the op-family references (fp32 math); sets ``topk_ids`` too."""
        from latency_specialized.ops.mlp import mlp_reference
        from latency_specialized.ops.moe import experts_reference, finalize_reference, route_reference
        from latency_specialized.ops.norm import rmsnorm_reference

        logits = h2.float() @ self.w_router.float().t()
        weights, ids = route_reference(logits, self.bias, self.top_k, self.router)
        x = h2
        if self.latent:
            x = (h2.float() @ self.w_pre.float().t()).to(h2.dtype)
            if self.pre_w_eff is not None:
                x = rmsnorm_reference(x, self.pre_w_eff, self.eps)
        if self.opt.post_expert_norm != "none":
            y = experts_reference(x, None, ids, self.w13, self.w2, self.f.activation, per_route=True)
            routed = finalize_reference(y, weights, self.post_w, self.opt.post_norm_eps,
                                        gain_before_norm=self.opt.post_expert_norm == "input_scaled",
                                        zero_centered=self.opt.post_norm_zero_centered)
        else:
            routed = experts_reference(x, weights, ids, self.w13, self.w2, self.f.activation)
        y = routed.float() @ self.w_post.float().t() if self.latent else routed.float()
        if self.w_sgu is not None:
            y = y + mlp_reference(h2, self.w_sgu, self.w_sd, self.f.activation).float()
        out.copy_(y.to(out.dtype))
        self.topk_ids.copy_(ids)


def build_stock_gqa(full: ModelSpec, layer: int, tp: int, batch: int, context: int, copies: int, device, *,
                    options: StockGQAOptions = StockGQAOptions(), block_size: int = 16, router_weight_bytes: int = 2,
                    experts: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                    attention: Callable[..., torch.Tensor] | None = None) -> StockLayers:
    """``copies`` stock GQA+MoE layers at batch ``batch`` over ``context`` cached tokens per sequence."""
    on_gpu = torch.device(device).type == "cuda"
    streams = (torch.cuda.Stream(), torch.cuda.Stream()) if on_gpu else None
    layers = [StockGQAMoELayer(full, layer, tp, batch, context, device, options=options, block_size=block_size,
                               router_weight_bytes=router_weight_bytes, streams=streams, attention=attention,
                               experts=experts[i] if experts else None) for i in range(copies)]
    res = torch.float32 if options.residual_dtype == "float32" else torch.bfloat16
    return StockLayers(layers, GatedStream.random(batch, full.hidden_size, res, device))


def describe(full: ModelSpec, layer: int, tp: int, kind: str, options: StockGQAOptions) -> list[str]:
    """Notes of a benched GQA kind: what each cell measures (window, KV bytes), then what stock runs (the
    same second note for every GQA kind: the bench prints it once)."""
    a, f = full.layers[layer].attention, full.layers[layer].ffn
    assert isinstance(a, GQAAttentionSpec) and isinstance(f, MoESpec)
    local = a.shard(tp) if tp > 1 else a
    per_token = local.num_kv_heads * local.head_dim * 2 * 2
    if a.sliding_window:
        reads = (f"min(context + 1, {a.sliding_window}) tokens (sliding window {a.sliding_window}; "
                 f"{a.sliding_window * per_token / 2**20:.2f} MiB per sequence once the context fills it)")
    else:
        reads = "context + 1 tokens (full attention)"
    pos = f"RoPE theta {a.rope_theta:g} ({options.rope_style})" if a.rope_theta is not None else "NoPE"
    lat = f", latent width {f.latent_dim}" if f.latent_dim else ""
    shared = f", {f.num_shared_experts} shared" if f.num_shared_experts else ""
    out = [
        f"{kind} layers (layer {layer}): GQA {local.num_heads} of {a.num_heads} query heads, {local.num_kv_heads} "
        f"of {a.num_kv_heads} KV heads per rank, head_dim {a.head_dim}, {pos}"
        + (", weightless QK norm" if a.qk_norm else "")
        + (", sigmoid output gate" if a.output_gate == "sigmoid" else "")
        + f"; MoE {f.num_experts} x top-{f.top_k}{shared}{lat}. Each step reads {reads} of the paged bf16 KV cache "
        f"per sequence: {per_token} B of k + v per token on this rank, the roofline counts them plus the new token's "
        "k/v written.",
        f"GQA + MoE layers: both variants run the same decode attention ({GQA_ATTENTION}, a Triton split-KV kernel "
        "standing in for stock's FlashAttention-3, which ships in the vLLM wheel), so these cells compare "
        "everything around that kernel. Stock stand-ins (Triton, one kernel where vLLM 0.33 has one): residual "
        "boundary (post-norm + gated add + next RMSNorm; vLLM fused_norm_residual_norm_fwd), QK norm + RoPE + KV "
        "write (vLLM's fused_muse_spark_qknorm_rope_kv_insert CUDA op), output norm x sigmoid gate, pre-expert "
        "RMSNorm, grouped top-k (fused_musespark1x_routing), MoE align + fused-MoE GEMMs (TritonExperts), "
        "SwiGLU (silu_and_mul), per-route post-expert norm + weighted sum (fused_post_expert_finalize); cuBLAS "
        "for the projections; router (fp32, cast + GEMM on a side stream), pre- and post-expert projections "
        "replicated as stock keeps them.",
    ]
    return out


__all__ = ["GQA_ATTENTION", "GatedStream", "StockGQALatentMoE", "StockGQAMoELayer",
           "StockGQAOptions", "build_stock_gqa", "describe", "resolve_attention"]
