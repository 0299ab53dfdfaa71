"""Muse Spark 1.2 (816B-A42B) architecture (MODELS.md; no vLLM class exists).

MODELS.md's values come from a third-party reference implementation that checks the checkpoint's
config (no model card). Values MODELS.md marks uncertain, and values derived here, say so in a
comment. The smaller open sibling in vLLM, `MuseGlimmerForCausalLM`
(`vllm/model_executor/models/muse_glimmer.py`), confirms the shared design: weightless fp32
QK-norm, sandwich norms with a (1 + w) gain and a separate post-norm eps, RMS-normed embeddings,
a sigmoid attention output gate read from the layer input, NoPE full-attention layers
interleaved with RoPE sliding-window layers, logit softcap.

The generic blocks carry GQA (window / NoPE / QK-norm / scale / gate), the latent MoE and the
router; :class:`MuseSparkSpec` adds what they lack: the post-norm, the attention-output norm, the
gated residual's constants, the embedding norm and the logit softcap.
"""

from __future__ import annotations

import math

from latency_specialized.spec import (
    ActivationSpec,
    Frozen,
    GQAAttentionSpec,
    LayerSpec,
    ModelSpec,
    MoESpec,
    NormSpec,
    ResidualSpec,
    RouterSpec,
)

NAME = "muse_spark"

# fp32 router: sigmoid(logits * 2^-2.5); top-k on sigmoid + selection bias; weights = the unbiased
# sigmoid renormalised with eps 1e-15; scaling 1.0 (MODELS.md).
ROUTER = RouterSpec(score_func="sigmoid", logit_scale=2.0**-2.5, bias_corrected=True, renormalize=True,
                    renormalize_eps=1e-15, routed_scaling=1.0, fp32=True)
# guess: MODELS.md does not name the expert activation; Muse Glimmer's MLP is SiLU-gated.
SWIGLU = ActivationSpec(kind="swiglu")
# Layer pattern S F S S: l % 4 == 1 is full attention without RoPE (MODELS.md).
FULL_ATTENTION_PERIOD, FULL_ATTENTION_PHASE = 4, 1


class ResidualGateSpec(Frozen):
    """Norm-preserving residual gate: s = a*s + b*branch, b = sigmoid(g/temperature),
    a = sqrt(max(sigmoid(-g/temperature) * (1 + b), floor))."""

    temperature: float
    """Divisor of the gate logit g (MODELS.md: 0.3)."""
    floor: float
    """Lower clamp inside the square root of a (MODELS.md: 1e-3)."""


class LogitSpec(Frozen):
    """Final logits: softcap * tanh(scale * z / softcap)."""

    scale: float
    """Multiplier of the raw logits before capping (MODELS.md: 2^-2.5)."""
    softcap: float
    """Soft cap (MODELS.md: 20)."""


class DraftSpec(Frozen):
    """Speculative decoding as reported; the draft model itself is unknown."""

    num_speculative_tokens: int
    """Draft tokens verified per step (MODELS.md: 7-draft-token mode reported)."""


class WeightFormats(Frozen):
    """Released weight formats."""

    releases: tuple[str, ...]
    """Checkpoint variants (MODELS.md: BF16 and NVFP4)."""


class MuseSparkSpec(ModelSpec):
    """ModelSpec plus the Muse Spark features the generic blocks do not express.

    ``norm`` is the pre-norm (eps 1e-5, zero-centred); the other norms are here."""

    post_norm: NormSpec
    """Sandwich post-norm after each sublayer (before the gated residual)."""
    attn_output_norm: bool
    """RMSNorm on the attention output before the sigmoid gate and o_proj."""
    latent_post_norm: bool
    """RMSNorm on the experts' latent output before the 4096 -> hidden projection."""
    embed_norm: bool
    """Token embeddings are RMS-normed (weightless) before layer 0."""
    residual_gate: ResidualGateSpec
    """Constants of the gated residual (``residual.kind == 'gated'``)."""
    logits: LogitSpec
    """Logit scaling and softcap."""
    draft: DraftSpec
    """Speculative decoding."""
    weights: WeightFormats
    """Weight formats."""

    def full_attention_layers(self) -> tuple[int, ...]:
        """Layers without a window (the NoPE full-attention layers)."""
        return tuple(l.index for l in self.layers if l.attention.sliding_window is None)  # type: ignore[union-attr]

    def window_layers(self) -> tuple[int, ...]:
        """Sliding-window RoPE layers."""
        return tuple(l.index for l in self.layers if l.attention.sliding_window is not None)  # type: ignore[union-attr]


def is_full_attention(layer: int) -> bool:
    """The S F S S pattern: every 4th layer starting at 1 is full attention."""
    return layer % FULL_ATTENTION_PERIOD == FULL_ATTENTION_PHASE


def build_spec(*, variant: str, hidden: int, vocab: int, num_layers: int, heads: int, kv_heads: int, head_dim: int,
               window: int, experts: int, top_k: int, latent: int, expert_inter: int,
               max_context: int) -> MuseSparkSpec:
    # softmax scale 5.473/sqrt(head_dim) after the weightless QK-norm (MODELS.md).
    scale = 5.473 / math.sqrt(head_dim)
    full = GQAAttentionSpec(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, sliding_window=None,
                            rope_theta=None, qk_norm=True, softmax_scale=scale, output_gate="sigmoid")
    swa = full.model_copy(update={"sliding_window": window, "rope_theta": 5e5})
    moe = MoESpec(num_experts=experts, top_k=top_k, num_shared_experts=0, expert_intermediate=expert_inter,
                  latent_dim=latent, activation=SWIGLU, router=ROUTER)
    layers = tuple(LayerSpec(index=i, attention=full if is_full_attention(i) else swa, ffn=moe)
                   for i in range(num_layers))
    return MuseSparkSpec(
        name=NAME, variant=variant, hidden_size=hidden, vocab_size=vocab, max_context=max_context, layers=layers,
        norm=NormSpec(eps=1e-5, zero_centered=True), residual=ResidualSpec(kind="gated"),
        post_norm=NormSpec(eps=1e-8, zero_centered=True), attn_output_norm=True, latent_post_norm=True,
        embed_norm=True, residual_gate=ResidualGateSpec(temperature=0.3, floor=1e-3),
        logits=LogitSpec(scale=2.0**-2.5, softcap=20.0), draft=DraftSpec(num_speculative_tokens=7),
        weights=WeightFormats(releases=("bfloat16", "nvfp4")))


def full_spec() -> MuseSparkSpec:
    """Muse Spark 1.2, 816B total / 42B active (MODELS.md)."""
    return build_spec(
        variant="full", hidden=8192, vocab=202048, num_layers=62, heads=128, kv_heads=16, head_dim=64, window=2048,
        experts=256, top_k=8, latent=4096,
        # derived: MODELS.md says "experts of width 4096"; 816B total minus attention, latent
        # projections and embeddings (~21B) leaves ~795B = 256 experts x 62 layers x 3 x 4096 x I,
        # so I ~ 4077 -> 4096 (consistent with ~42B active at top-8).
        expert_inter=4096,
        # guess: max context not found; the hosted API serves 1M.
        max_context=1_048_576,
    )


def tiny_spec() -> MuseSparkSpec:
    """Every feature at test size: S F S S pattern (2 full NoPE layers, 6 windowed), latent MoE
    without shared experts, gated residual, sandwich norms. Heads and widths divide by TP 1..8."""
    return build_spec(variant="tiny", hidden=64, vocab=512, num_layers=8, heads=16, kv_heads=8, head_dim=16,
                      window=16, experts=16, top_k=4, latent=32, expert_inter=32, max_context=4096)
