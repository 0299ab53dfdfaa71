"""Kimi K3 architecture (MODELS.md; vLLM `KimiK3ForConditionalGeneration`, text model `kimi_linear`)."""

from __future__ import annotations

from latency_specialized.spec import (
    ActivationSpec,
    DenseMLPSpec,
    KDAAttentionSpec,
    LayerSpec,
    MLAAttentionSpec,
    ModelSpec,
    MoESpec,
    NormSpec,
    ResidualSpec,
    RouterSpec,
)

SITU = ActivationSpec(kind="situ_glu", beta=4.0, beta_lin=25.0)
ROUTER = RouterSpec(score_func="sigmoid", bias_corrected=True, renormalize=True, routed_scaling=1.0)


def mla_layer_indices(num_layers: int, period: int) -> tuple[int, ...]:
    """0-based MLA layers: every ``period``-th layer (1-indexed 4, 8, ...) and the last layer."""
    idx = {i for i in range(num_layers) if (i + 1) % period == 0}
    idx.add(num_layers - 1)
    return tuple(sorted(idx))


def build_spec(*, variant: str, hidden: int, vocab: int, num_layers: int, mla_period: int, kda_heads: int,
               head_dim: int, decay_rank: int, mla_heads: int, q_lora: int, kv_lora: int, nope: int, rope: int,
               v_dim: int, experts: int, top_k: int, shared: int, expert_inter: int, latent: int,
               dense_inter: int, block_size: int, max_blocks: int, max_context: int) -> ModelSpec:
    mla = set(mla_layer_indices(num_layers, mla_period))
    moe = MoESpec(num_experts=experts, top_k=top_k, num_shared_experts=shared, expert_intermediate=expert_inter,
                  latent_dim=latent, activation=SITU, router=ROUTER)
    layers = []
    for i in range(num_layers):
        attn = (MLAAttentionSpec(num_heads=mla_heads, q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope,
                                 qk_rope_head_dim=rope, v_head_dim=v_dim, use_rope=False, output_gate="sigmoid")
                if i in mla else
                KDAAttentionSpec(num_heads=kda_heads, head_dim=head_dim, conv_kernel=4, decay_rank=decay_rank,
                                 gate_lower_bound=-5.0))
        ffn = DenseMLPSpec(intermediate=dense_inter, activation=SITU) if i == 0 else moe
        layers.append(LayerSpec(index=i, attention=attn, ffn=ffn))
    return ModelSpec(name="kimi_k3", variant=variant, hidden_size=hidden, vocab_size=vocab, max_context=max_context,
                     layers=tuple(layers), norm=NormSpec(eps=1e-5),
                     residual=ResidualSpec(kind="attnres", block_size=block_size, max_cached_blocks=max_blocks))


def full_spec() -> ModelSpec:
    """The published Kimi K3 (2.8T total, 104B active)."""
    return build_spec(variant="full", hidden=7168, vocab=163840, num_layers=93, mla_period=4, kda_heads=96,
                      head_dim=128, decay_rank=128, mla_heads=96, q_lora=1536, kv_lora=512, nope=128, rope=64,
                      v_dim=128, experts=896, top_k=16, shared=2, expert_inter=3072, latent=3584,
                      dense_inter=33792, block_size=12, max_blocks=8, max_context=1_048_576)


def tiny_spec() -> ModelSpec:
    """Every feature of the full model at test size: KDA + MLA, dense layer 0, latent MoE with
    shared experts, three AttnRes blocks; heads and widths divisible by TP 1..8."""
    return build_spec(variant="tiny", hidden=64, vocab=512, num_layers=6, mla_period=4, kda_heads=8,
                      head_dim=16, decay_rank=16, mla_heads=8, q_lora=32, kv_lora=16, nope=8, rope=8,
                      v_dim=8, experts=16, top_k=4, shared=2, expert_inter=16, latent=32,
                      dense_inter=64, block_size=4, max_blocks=8, max_context=4096)
