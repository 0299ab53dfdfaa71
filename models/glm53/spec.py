"""GLM-5.3 architecture (MODELS.md; vLLM `GlmMoeDsaForCausalLM`, `model_type: glm_moe_dsa`).

Same architecture as GLM-5.2, which vLLM serves from `vllm/models/deepseek_v32/` (DeepSeek V3.2's DSA: MLA + lightning
indexer). Config keys read there: `index_topk_freq` and `index_skip_topk_offset` decide which layers run their own
indexer ("IndexShare"): layer l runs it when max(l - offset + 1, 0) % freq == 0, i.e. {0, 1, 2, 6, 10, ..., 74} for
freq 4, offset 3 - the 21 layers MODELS.md lists. Values MODELS.md does not list are marked "config" (quoted from
third-party copies of the released config.json).

The generic blocks carry MLA + the DSA indexer (with its full-layer list), the dense first layers and the MoE;
:class:`Glm53Spec` adds the IndexShare rule, the MTP layer and weight formats.
"""

from __future__ import annotations

from pydantic import model_validator

from latency_specialized.spec import (
    ActivationSpec,
    DenseMLPSpec,
    Frozen,
    IndexerSpec,
    LayerSpec,
    MLAAttentionSpec,
    ModelSpec,
    MoESpec,
    NormSpec,
    ResidualSpec,
    RouterSpec,
)

NAME = "glm53"

ROUTER = RouterSpec(score_func="sigmoid", bias_corrected=True, renormalize=True, routed_scaling=2.5, fp32=True)
SWIGLU = ActivationSpec(kind="swiglu")  # config `hidden_act: silu`


def index_share_layers(num_layers: int, freq: int, offset: int) -> tuple[int, ...]:
    """Layers that run their own indexer (vLLM's rule for `index_topk_freq` / `index_skip_topk_offset`)."""
    return tuple(l for l in range(num_layers) if max(l - offset + 1, 0) % freq == 0)


class IndexShareSpec(Frozen):
    """Which layers compute top-k themselves; the others reuse the latest full layer's top-k."""

    freq: int
    """Config `index_topk_freq`."""
    skip_offset: int
    """Config `index_skip_topk_offset`."""
    mtp_reuse: bool
    """Config `index_share_for_mtp_iteration`: draft steps after the first reuse the top-k."""


class MTPSpec(Frozen):
    """Multi-token-prediction draft layer(s) shipped with the checkpoint."""

    num_layers: int
    """MTP layers (config `num_nextn_predict_layers`)."""
    num_speculative_tokens: int
    """Draft tokens verified per step (MODELS.md: 5)."""


class WeightFormats(Frozen):
    """Checkpoint weight formats."""

    main: str
    """Released checkpoint."""
    variants: tuple[str, ...]
    """Other releases."""


class Glm53Spec(ModelSpec):
    """ModelSpec plus the GLM-5.3 features the generic blocks do not express."""

    index_share: IndexShareSpec
    """IndexShare rule (the resulting layers are in every layer's ``attention.indexer.full_layers``)."""
    mtp: MTPSpec
    """MTP draft."""
    weights: WeightFormats
    """Weight formats."""
    latent_norm_eps: float = 1e-6
    """Epsilon of the q_a / kv_a latent RMSNorms: transformers builds them with its RMSNorm default 1e-6
    (not ``rms_norm_eps``); vLLM uses ``rms_norm_eps``."""
    unsharded: ModelSpec | None = None
    """The spec this one was sharded from (None: this one is unsharded); the pieces are built from it."""

    def shard(self, tp: int) -> "Glm53Spec":
        return super().shard(tp).model_copy(update={"unsharded": self.full()})

    def full(self) -> "Glm53Spec":
        return self.unsharded or self  # type: ignore[return-value]

    @model_validator(mode="after")
    def _check_index_share(self) -> "Glm53Spec":
        want = index_share_layers(len(self.layers), self.index_share.freq, self.index_share.skip_offset)
        for layer in self.layers:
            a = layer.attention
            if not isinstance(a, MLAAttentionSpec) or a.indexer is None:
                raise ValueError(f"layer {layer.index}: GLM-5.3 layers are MLA + DSA indexer")
            if a.indexer.full_layers != want:
                raise ValueError(f"layer {layer.index}: indexer full_layers {a.indexer.full_layers} != IndexShare "
                                 f"rule {want}")
        return self

    def indexer_layers(self) -> tuple[int, ...]:
        """Layers that run the indexer themselves."""
        return self.layers[0].attention.indexer.full_layers  # type: ignore[union-attr]

    def shared_indexer_layers(self) -> tuple[int, ...]:
        """Layers that reuse the latest indexer layer's top-k."""
        full = set(self.indexer_layers())
        return tuple(l.index for l in self.layers if l.index not in full)

    def dense_layers(self) -> tuple[int, ...]:
        """Layers with a dense MLP instead of the MoE."""
        return tuple(l.index for l in self.layers if l.ffn.kind == "dense")


def build_spec(*, variant: str, hidden: int, vocab: int, num_layers: int, first_dense: int, heads: int, q_lora: int,
               kv_lora: int, nope: int, rope: int, v_dim: int, idx_heads: int, idx_dim: int, idx_topk: int,
               freq: int, offset: int, experts: int, top_k: int, shared: int, expert_inter: int, dense_inter: int,
               max_context: int, rope_theta: float = 8e6, eps: float = 1e-5, mtp_layers: int = 1,
               mtp_reuse: bool = True, renormalize: bool = True, routed_scaling: float = 2.5) -> Glm53Spec:
    full = index_share_layers(num_layers, freq, offset)
    attn = MLAAttentionSpec(
        num_heads=heads, q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
        v_head_dim=v_dim, use_rope=True, rope_theta=rope_theta, rope_interleaved=True, output_gate="none",
        indexer=IndexerSpec(num_heads=idx_heads, head_dim=idx_dim, topk=idx_topk, full_layers=full))
    moe = MoESpec(num_experts=experts, top_k=top_k, num_shared_experts=shared, expert_intermediate=expert_inter,
                  activation=SWIGLU,
                  router=ROUTER.model_copy(update={"renormalize": renormalize, "routed_scaling": routed_scaling}))
    dense = DenseMLPSpec(intermediate=dense_inter, activation=SWIGLU)
    layers = tuple(LayerSpec(index=i, attention=attn, ffn=dense if i < first_dense else moe)
                   for i in range(num_layers))
    return Glm53Spec(
        name=NAME, variant=variant, hidden_size=hidden, vocab_size=vocab, max_context=max_context, layers=layers,
        norm=NormSpec(eps=eps),  # config `rms_norm_eps` (1e-5; not in MODELS.md)
        residual=ResidualSpec(kind="pre_norm"),
        index_share=IndexShareSpec(freq=freq, skip_offset=offset, mtp_reuse=mtp_reuse),
        mtp=MTPSpec(num_layers=mtp_layers, num_speculative_tokens=5),
        weights=WeightFormats(main="fp8_e4m3 blocks 128x128", variants=("bfloat16", "fp4")))


def full_spec() -> Glm53Spec:
    """GLM-5.3: 78 layers (+1 MTP), ~744B total / ~40B active (MODELS.md; a checkpoint's spec comes from its
    config.json: ``config.spec_from_config``, which reads its context and RoPE base)."""
    return build_spec(
        variant="full", hidden=6144, vocab=154880, num_layers=78, first_dense=3, heads=64, q_lora=2048, kv_lora=512,
        nope=192, rope=64, v_dim=256, idx_heads=32, idx_dim=128, idx_topk=2048,
        freq=4, offset=3,  # config; gives MODELS.md's 21 indexer layers {0, 1, 2, 6, 10, ..., 74}
        experts=256, top_k=8, shared=1, expert_inter=2048, dense_inter=12288, max_context=1_048_576)


def tiny_spec() -> Glm53Spec:
    """Every feature at test size: 3 dense + 5 MoE layers, indexer on {0, 1, 2, 6} and shared on
    the rest (same IndexShare rule), MLA with rope + DSA (top-16: sparse beyond 16 tokens; 16 indexer heads: with
    fewer, exact ties of the relu-weighted scores are common and torch.topk breaks them by tensor shape), 1 MTP layer.
    Heads, experts, widths and vocab divide by TP 1, 2, 4, 8."""
    return build_spec(
        variant="tiny", hidden=64, vocab=512, num_layers=8, first_dense=3, heads=8, q_lora=32, kv_lora=16, nope=16,
        rope=8, v_dim=16, idx_heads=16, idx_dim=16, idx_topk=16, freq=4, offset=3, experts=16, top_k=4, shared=1,
        expert_inter=16, dense_inter=64, max_context=4096)
