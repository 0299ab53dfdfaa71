"""Muse Spark 1.2 (816B-A42B), as transformers 5.24 ``models/muse_spark`` (config defaults, modeling) and vLLM 0.33
implement it. Generic blocks: GQA (window / NoPE / QK-norm / scale / gate), latent MoE, router, dense MLP;
:class:`MuseSparkSpec` adds the q scale, post-norm kinds, attention-output norm, pre/post-expert norms, gated
residual, embedding and final norms and the logit softcap. Guesses say so in a comment."""

from __future__ import annotations

import math
from typing import Literal, Sequence

from latency_specialized.spec import (ActivationSpec, DenseMLPSpec, Frozen, GQAAttentionSpec, LayerSpec, ModelSpec,
                                     MoESpec, NormSpec, ResidualSpec, RouterSpec)

NAME = "muse_spark"
QK_SCALE_FACTOR = 5.4730064863875        # config qk_scale_factor (MODELS.md's 5.473 is rounded)
OUTPUT_MULTIPLIER = 0.1767766952966369   # config output_multiplier, router and final logits: 2**-2.5
ROPE_THETA, NOPE_PERIOD = 5e5, 4   # every 4th layer counted back from the last: full attention, no RoPE
SWIGLU = ActivationSpec(kind="swiglu")  # config hidden_act "silu": silu(gate) * up

PostNormKind = Literal["weightless", "input_scaled"]   # RMSNorm(x) | RMSNorm(round_to_act(x * (1 + w)))


class ResidualGateSpec(Frozen):
    """Norm-preserving gate per channel (fp32 parameter g): w = g / temperature, b = sigmoid(w),
    a = sqrt(max(sigmoid(-w) * (1 + b), floor)), out = a * residual + b * branch."""

    temperature: float
    """Divisor of g (config ``residual_gate_temperature``: 0.3)."""
    floor: float
    """Lower clamp inside the square root (transformers' fixed 1e-3)."""


class LogitSpec(Frozen):
    """Final logits: softcap * tanh(scale * z / softcap)."""

    scale: float
    """Multiplier of the raw logits (config ``output_multiplier``)."""
    softcap: float
    """Soft cap (config ``final_logit_softcapping``: 20)."""


class DraftSpec(Frozen):
    num_speculative_tokens: int
    """Draft tokens per step (MODELS.md: a 7-draft-token mode reported; the draft model is unknown)."""


class WeightFormats(Frozen):
    releases: tuple[str, ...]
    """Released checkpoint variants (MODELS.md: BF16 and NVFP4)."""


class MuseSparkSpec(ModelSpec):
    """ModelSpec plus what the generic blocks do not express. ``norm``: the zero-centred (1 + w) pre-norms
    (input_layernorm, pre_feedforward_layernorm, pre_expert_norm), whose eps (``rms_norm_eps``) the weightless QK,
    attention-output and embedding norms share. GQA's ``softmax_scale`` is ``qk_scale_factor * head_dim**-0.5``."""

    qk_scale_factor: float = QK_SCALE_FACTOR
    """q = qk_norm(q) * qk_scale_factor (folded into each layer's softmax_scale)."""
    post_norm: NormSpec
    """eps of the post-norms (``post_norm_eps``); zero_centered: the input-scaled gain is (1 + w)."""
    post_attn_norm: PostNormKind = "weightless"
    """post_attention_layernorm (no tensor)."""
    post_ffn_norm: PostNormKind = "input_scaled"
    """post_feedforward_layernorm (weight [hidden])."""
    attn_output_norm: bool
    """o_norm: weightless RMSNorm per head over head_dim, then * sigmoid(gate_proj(attention input)), o_proj."""
    latent_pre_norm: bool = True
    """pre_expert_norm: zero-centred RMSNorm [latent] after pre_expert_proj (hidden -> latent)."""
    latent_post_norm: bool
    """post_expert_norm: input-scaled (eps ``post_norm.eps``, one weight [latent] for all experts), per expert
    output, before the routing weight."""
    embed_norm: bool
    """Token embeddings are RMS-normed (weightless) before layer 0."""
    final_norm: NormSpec = NormSpec(eps=1e-5, zero_centered=False)
    """model.norm: plain weighted RMSNorm (gain w, not 1 + w)."""
    residual_gate: ResidualGateSpec
    """The gated residual's constants (``residual.kind == 'gated'``)."""
    logits: LogitSpec
    draft: DraftSpec
    weights: WeightFormats
    unsharded: ModelSpec | None = None
    """The spec this one was sharded from (None: unsharded); the pieces are built from it."""

    def shard(self, tp: int) -> "MuseSparkSpec":
        return super().shard(tp).model_copy(update={"unsharded": self})

    def full(self) -> "MuseSparkSpec":
        return self.unsharded or self  # type: ignore[return-value]

    def full_attention_layers(self) -> tuple[int, ...]:   # layer_types full_attention: no window
        return tuple(l.index for l in self.layers if l.attention.sliding_window is None)  # type: ignore[union-attr]

    def window_layers(self) -> tuple[int, ...]:
        return tuple(l.index for l in self.layers if l.attention.sliding_window is not None)  # type: ignore

    def nope_layers(self) -> tuple[int, ...]:             # layer_rope_theta 0: no RoPE
        return tuple(l.index for l in self.layers if l.attention.rope_theta is None)  # type: ignore[union-attr]

    def dense_layers(self) -> tuple[int, ...]:            # mlp_layer_types dense: SwiGLU MLP, not latent MoE
        return tuple(l.index for l in self.layers if l.ffn.kind == "dense")


def build_spec(*, variant: str, hidden: int, vocab: int, num_layers: int, heads: int, kv_heads: int, head_dim: int,
               window: int, experts: int, top_k: int, latent: int, expert_inter: int, max_context: int,
               full_layers: Sequence[int] | None = None, nope_layers: Sequence[int] | None = None,
               dense_layers: Sequence[int] = (), dense_inter: int | None = None, rope_theta: float = ROPE_THETA,
               qk_scale_factor: float = QK_SCALE_FACTOR, output_multiplier: float = OUTPUT_MULTIPLIER,
               softcap: float = 20.0, eps: float = 1e-5, post_eps: float = 1e-8, routed_scaling: float = 1.0,
               gate_temperature: float = 0.3) -> MuseSparkSpec:
    """A MuseSparkSpec from config-level numbers. ``full_layers`` / ``nope_layers`` default to transformers' rule
    ((num_layers - 1 - i) % 4 == 0); ``dense_layers`` get a SwiGLU MLP of ``dense_inter`` (default 2 * hidden)."""
    default = [i for i in range(num_layers) if (num_layers - 1 - i) % NOPE_PERIOD == 0]
    full, nope = (set(default if x is None else x) for x in (full_layers, nope_layers))
    base = GQAAttentionSpec(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, qk_norm=True,
                            softmax_scale=qk_scale_factor / math.sqrt(head_dim), output_gate="sigmoid")
    # fp32 router: top-k of sigmoid(x @ W^T * output_multiplier) + bias; weights: unbiased / (sum + 1e-15) * scaling
    router = RouterSpec(score_func="sigmoid", logit_scale=output_multiplier, bias_corrected=True, renormalize=True,
                        renormalize_eps=1e-15, routed_scaling=routed_scaling, fp32=True)
    moe = MoESpec(num_experts=experts, top_k=top_k, num_shared_experts=0, expert_intermediate=expert_inter,
                  latent_dim=latent, activation=SWIGLU, router=router)
    dense = DenseMLPSpec(intermediate=dense_inter or 2 * hidden, activation=SWIGLU)
    layers = tuple(LayerSpec(index=i, attention=base.model_copy(update={
        "sliding_window": None if i in full else window, "rope_theta": None if i in nope else rope_theta}),
        ffn=dense if i in dense_layers else moe) for i in range(num_layers))
    return MuseSparkSpec(
        name=NAME, variant=variant, hidden_size=hidden, vocab_size=vocab, max_context=max_context, layers=layers,
        norm=NormSpec(eps=eps, zero_centered=True), residual=ResidualSpec(kind="gated"),
        post_norm=NormSpec(eps=post_eps, zero_centered=True), attn_output_norm=True, latent_post_norm=True,
        embed_norm=True, final_norm=NormSpec(eps=eps, zero_centered=False), qk_scale_factor=qk_scale_factor,
        residual_gate=ResidualGateSpec(temperature=gate_temperature, floor=1e-3),
        logits=LogitSpec(scale=output_multiplier, softcap=softcap), draft=DraftSpec(num_speculative_tokens=7),
        weights=WeightFormats(releases=("bfloat16", "nvfp4")))


def full_spec() -> MuseSparkSpec:
    """Muse Spark 1.2, 816B total / 42B active (transformers' MuseSparkTextConfig defaults)."""
    return build_spec(variant="full", hidden=8192, vocab=202048, num_layers=62, heads=128, kv_heads=16, head_dim=64,
                      window=2048, experts=256, top_k=8, latent=4096, expert_inter=4096,
                      max_context=1_048_576)   # guess: transformers' default (the hosted API serves 1M)


def tiny_spec(qk_scale_factor: float = QK_SCALE_FACTOR) -> MuseSparkSpec:
    """Every feature at test size: full NoPE layers 3 and 7 (from the back), 6 windowed RoPE layers (window 16),
    all-sparse latent MoE (as the full model), gated residual, sandwich norms; heads and widths divide by TP 1..8.
    ``qk_scale_factor``: the released one unless a test asks for blunter attention (fp32 rounding not amplified)."""
    return build_spec(variant="tiny", hidden=64, vocab=512, num_layers=8, heads=16, kv_heads=8, head_dim=16,
                      window=16, experts=16, top_k=4, latent=32, expert_inter=32, max_context=4096,
                      qk_scale_factor=qk_scale_factor)
