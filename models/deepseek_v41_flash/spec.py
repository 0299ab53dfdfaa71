"""DeepSeek-V4.1-Flash architecture (vLLM `DeepseekV41ForCausalLM`, `model_type: deepseek_v41`). Sources, in order of
trust: /work/shared/docs/MODELS.md; vLLM's `vllm/models/deepseek_v41/` config keys; the released `text_config` as
quoted by third-party ports (marked "config"). :class:`DeepseekV41Spec` adds what the generic blocks lack: which
layers own compressed KV / an indexer, Engram, mHC constants, RoPE/YaRN, the DSpark draft, the weight formats.
"""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from latency_specialized.spec import (ActivationSpec, Frozen, IndexerSpec, LayerSpec, ModelSpec, MoESpec, NormSpec,
                                      ResidualSpec, RouterSpec, SparseMQAAttentionSpec)

NAME = "deepseek_v41_flash"

ROUTER = RouterSpec(score_func="sqrtsoftplus", bias_corrected=True, renormalize=True, routed_scaling=1.5, fp32=True)


class EngramSpec(Frozen):
    """Engram n-gram memory: hashed n-gram ids fetch table rows gated into the mHC streams before attention."""

    layers: tuple[int, ...]
    """Layers (0-based) that inject an Engram lookup (config `engram_layer_ids`)."""
    num_embeddings: tuple[int, ...]
    """Rows of each layer's table (config `engram_num_embeddings`), one per entry of ``layers``."""
    max_ngram: int
    """Longest n-gram hashed (config `engram_max_ngram_size`); n-grams of 2..max_ngram are used."""
    n_heads: int
    """Hash heads per n-gram order (config `engram_n_heads`)."""
    head_dim: int
    """Width of one table row (config `engram_head_dim`)."""
    table_dtype: Literal["fp8_e4m3", "bfloat16"] = "fp8_e4m3"
    """Storage of the tables (MODELS.md: large FP8 tables)."""

    @model_validator(mode="after")
    def _check(self) -> "EngramSpec":
        if len(self.layers) != len(self.num_embeddings):
            raise ValueError("engram: give one num_embeddings entry per Engram layer")
        return self

    @property
    def rows_per_token(self) -> int:
        """Table rows fetched per token per Engram layer: (max_ngram - 1) orders x n_heads."""
        return (self.max_ngram - 1) * self.n_heads

    def table_bytes(self) -> int:
        """Bytes of all tables (1 byte per value for FP8)."""
        return sum(self.num_embeddings) * self.head_dim * (1 if self.table_dtype == "fp8_e4m3" else 2)


class HyperConnectionSpec(Frozen):
    """mHC constants the generic ResidualSpec (streams, Sinkhorn iterations) does not carry."""

    eps: float
    """Epsilon of the mixing coefficients and of Sinkhorn (config `hc_eps`)."""
    post_alpha: float
    """Scale of the post-mix sigmoid (vLLM `hc_post_alpha`, hard-coded 2.0 there)."""


class RopeSpec(Frozen):
    """Rotary embedding of the 64 rope dims (YaRN-extended)."""

    theta: float
    """Base on window-only layers (config `rope_theta`; plain RoPE there, no YaRN)."""
    compress_theta: float
    """Base on layers with compress ratio > 0, window keys included (`compress_rope_theta`); YaRN there only."""
    yarn_factor: float
    """YaRN context extension factor (config `rope_scaling.factor`)."""
    original_context: int
    """Context the base model was trained at, before YaRN."""


class DraftSpec(Frozen):
    """The built-in DSpark draft (speculative decoding)."""

    kind: Literal["dspark"] = "dspark"
    """Draft design."""
    num_layers: int
    """Draft layers (config `num_nextn_predict_layers`)."""
    block_size: int
    """Tokens drafted per block (config `dspark_block_size`)."""
    num_speculative_tokens: int
    """Draft tokens verified per step."""
    num_experts: int
    """Routed experts of a draft layer (config `dspark_n_routed_experts`)."""
    top_k: int
    """Experts per token in a draft layer (config `dspark_num_experts_per_tok`)."""
    target_layers: tuple[int, ...]
    """Target layers whose hidden states feed the draft (config `dspark_target_layer_ids`)."""


class WeightFormats(Frozen):
    """Checkpoint weight formats (they set the bytes a decode step reads)."""

    dense: str
    """Attention, shared expert, projections."""
    routed_experts: str
    """Routed expert GEMMs."""


class DeepseekV41Spec(ModelSpec):
    """ModelSpec plus the DeepSeek-V4.1 features the generic blocks do not express."""

    kv_source_layers: tuple[int, ...]
    """Layers owning a compressor + compressed KV; others read the latest at or below (`kv_source_layer_ids`)."""
    index_source_layers: tuple[int, ...]
    """Layers running the indexer; others reuse the latest one's top-k (`index_source_layer_ids`)."""
    index_topk: int
    """Compressed tokens each query attends to on compressed layers (config `index_topk`)."""
    candidate_source_layer: int
    """Indexer that also publishes candidate blocks later indexers score within (-1: none)."""
    candidate_topk_blocks: int
    """Candidate blocks published by the candidate source."""
    candidate_block_size: int
    """Compressed positions per candidate block."""
    hyper: HyperConnectionSpec
    """mHC constants (streams and Sinkhorn iterations are in ``residual``)."""
    engram: EngramSpec
    """Engram lookups."""
    rope: RopeSpec
    """RoPE / YaRN."""
    draft: DraftSpec
    """Built-in DSpark draft."""
    weights: WeightFormats
    """Weight formats of the released checkpoint."""
    unsharded: ModelSpec | None = None
    """The spec this one was sharded from (None: this one is unsharded)."""

    def shard(self, tp: int) -> "DeepseekV41Spec":
        return super().shard(tp).model_copy(update={"unsharded": self})  # type: ignore[return-value]

    def full(self) -> "DeepseekV41Spec":
        """The unsharded spec (this one when it is unsharded)."""
        return self.unsharded or self  # type: ignore[return-value]

    @model_validator(mode="after")
    def _check_topology(self) -> "DeepseekV41Spec":
        n = len(self.layers)
        for what, ids in (("kv_source_layers", self.kv_source_layers),
                          ("index_source_layers", self.index_source_layers), ("engram.layers", self.engram.layers)):
            if any(not 0 <= i < n for i in ids):
                raise ValueError(f"{what} {ids} must be layer indices 0..{n - 1}")
        for layer in self.layers:
            if not isinstance(a := layer.attention, SparseMQAAttentionSpec):
                raise ValueError(f"layer {layer.index}: DeepSeek-V4.1 layers are sparse_mqa, got {a.kind}")
            if (has_idx := a.indexer is not None) != (layer.index in self.index_source_layers):
                raise ValueError(f"layer {layer.index}: indexer present={has_idx} but index_source_layers says "
                                 f"{layer.index in self.index_source_layers}")
            if a.compress_ratio > 0 and None in (self.kv_source_for(layer.index), self.index_source_for(layer.index)):
                raise ValueError(f"layer {layer.index}: compressed layer has no KV/index source at or below it")
        return self

    def compress_ratios(self) -> tuple[int, ...]:
        """Per-layer compress ratio, as in the config's `compress_ratios` (draft layers excluded)."""
        return tuple(l.attention.compress_ratio for l in self.layers)  # type: ignore[union-attr]

    def kv_source_for(self, layer: int) -> int | None:
        """The KV source a layer reads: the latest at or below it (None: none)."""
        return max((s for s in self.kv_source_layers if s <= layer), default=None)

    def index_source_for(self, layer: int) -> int | None:
        """The indexer whose top-k a layer uses: the latest at or below it (None: none)."""
        return max((s for s in self.index_source_layers if s <= layer), default=None)


def build_spec(*, variant: str, hidden: int, vocab: int, ratios: tuple[int, ...], heads: int, head_dim: int,
               rope_dim: int, q_lora: int, o_groups: int, o_lora: int, window: int, kv_sources: tuple[int, ...],
               index_sources: tuple[int, ...], idx_heads: int, idx_dim: int, idx_topk: int, candidate_layer: int,
               candidate_blocks: int, candidate_block: int, experts: int, top_k: int, shared: int, expert_inter: int,
               engram: EngramSpec, draft: DraftSpec, max_context: int, rope: RopeSpec, norm_eps: float,
               routed_scaling: float = 1.5, swiglu_clamp: float = 10.0, hc_mult: int = 4, hc_iters: int = 20,
               hc_eps: float = 1e-6) -> DeepseekV41Spec:
    indexer = IndexerSpec(num_heads=idx_heads, head_dim=idx_dim, topk=idx_topk, full_layers=index_sources)
    moe = MoESpec(num_experts=experts, top_k=top_k, num_shared_experts=shared, expert_intermediate=expert_inter,
                  activation=ActivationSpec(kind="swiglu", clamp=swiglu_clamp),
                  router=ROUTER.model_copy(update={"routed_scaling": routed_scaling}))
    layers = tuple(LayerSpec(index=i, ffn=moe, attention=SparseMQAAttentionSpec(
        num_heads=heads, head_dim=head_dim, rope_dim=rope_dim, q_lora_rank=q_lora, o_groups=o_groups, o_lora_rank=o_lora,
        sliding_window=window, compress_ratio=r, indexer=indexer if i in index_sources else None))
        for i, r in enumerate(ratios))
    return DeepseekV41Spec(
        name=NAME, variant=variant, hidden_size=hidden, vocab_size=vocab, max_context=max_context, layers=layers,
        norm=NormSpec(eps=norm_eps), residual=ResidualSpec(kind="mhc", streams=hc_mult, sinkhorn_iters=hc_iters),
        kv_source_layers=kv_sources, index_source_layers=index_sources, index_topk=idx_topk,
        candidate_source_layer=candidate_layer, candidate_topk_blocks=candidate_blocks,
        candidate_block_size=candidate_block, hyper=HyperConnectionSpec(eps=hc_eps, post_alpha=2.0), engram=engram,
        rope=rope, draft=draft, weights=WeightFormats(dense="fp8_e4m3 blocks 32x32, ue8m0 scales",
                                                      routed_experts="fp4_e2m1, one ue8m0 scale per 32"))


def full_spec() -> DeepseekV41Spec:
    """The released DeepSeek-V4.1-Flash: 40 layers, 552B backbone + 196B Engram, ~16B active."""
    # MODELS.md: layers 0-1 window only, 2-19 ratio-2 compression, 20-39 full-length compressed.
    ratios = (0,) * 2 + (2,) * 18 + (1,) * 20
    return build_spec(
        variant="full", hidden=5120, vocab=129280, ratios=ratios, heads=64, head_dim=512, rope_dim=64, q_lora=1280,
        o_groups=8, o_lora=1024, window=128, idx_heads=32, idx_dim=128, idx_topk=512,
        kv_sources=(2, 8, 14, 20),  # config `kv_source_layer_ids` (MODELS.md: 20-39 read layer 20's KV)
        index_sources=(2, 8, 14, 20, 24, 28, 32, 36), experts=384, top_k=6, shared=1, expert_inter=2304,  # MODELS.md
        candidate_layer=20, candidate_blocks=2048, candidate_block=8,  # config `candidate_*`
        engram=EngramSpec(layers=(1, 14),  # MODELS.md
                          num_embeddings=(384_006_168, 384_016_682),  # config; x256 B = 196.6e9 (MODELS.md: 196B)
                          max_ngram=4, n_heads=8, head_dim=256),  # config
        draft=DraftSpec(num_layers=3, block_size=5, num_speculative_tokens=5,  # MODELS.md
                        num_experts=128, top_k=3, target_layers=(37, 38, 39)),  # config
        max_context=1_048_576,  # MODELS.md: 1M = YaRN x16 over 65536
        rope=RopeSpec(theta=10_000.0, compress_theta=160_000.0,  # config
                      yarn_factor=16.0, original_context=65_536),  # MODELS.md
        # config `rms_norm_eps` as quoted verbatim by two third-party ports (1e-20, not the usual 1e-6); not in
        norm_eps=1e-20)  # MODELS.md - check against the checkpoint before trusting numerics on it


def tiny_spec() -> DeepseekV41Spec:
    """Every feature the program runs, at test size (no Engram: refused); widths divide by TP 1..8; 16 indexer heads
    (4 tied at relu 0 too often); top-k 16 < the compressed rows of a 40-token context (ratio 1 and 2)."""
    ratios = (0,) * 2 + (2,) * 4 + (1,) * 4
    return build_spec(
        variant="tiny", hidden=64, vocab=512, ratios=ratios, heads=16, head_dim=32, rope_dim=8, q_lora=32,
        o_groups=8, o_lora=16, window=8, kv_sources=(2, 4, 6), index_sources=(2, 4, 6, 8), idx_heads=16, idx_dim=16,
        idx_topk=16, candidate_layer=6, candidate_blocks=4, candidate_block=2, experts=16, top_k=4, shared=1,
        expert_inter=32, engram=EngramSpec(layers=(), num_embeddings=(), max_ngram=3, n_heads=2, head_dim=16),
        draft=DraftSpec(num_layers=1, block_size=5, num_speculative_tokens=5, num_experts=8, top_k=2,
                        target_layers=(7, 8, 9)), max_context=4096, norm_eps=1e-20,  # eps: as the full model
        rope=RopeSpec(theta=10_000.0, compress_theta=160_000.0, yarn_factor=1.0, original_context=4096))


def medium_spec() -> DeepseekV41Spec:
    """Each layer kind at widths GPU kernels serve (long check): window (0), ratio-2 KV source + indexer (1), ratio-1
    source + indexer (2), its reader reusing 2's top-k (3); top-k 64 < the compressed rows past 128 / 64 tokens."""
    return build_spec(
        variant="medium", hidden=1024, vocab=2048, ratios=(0, 2, 1, 1), heads=16, head_dim=256, rope_dim=64, q_lora=256,
        o_groups=4, o_lora=256, window=128, kv_sources=(1, 2), index_sources=(1, 2), idx_heads=16, idx_dim=128,
        idx_topk=64, candidate_layer=-1, candidate_blocks=0, candidate_block=0, experts=128, top_k=6, shared=1,
        expert_inter=256, engram=EngramSpec(layers=(), num_embeddings=(), max_ngram=3, n_heads=2, head_dim=16),
        draft=DraftSpec(num_layers=1, block_size=5, num_speculative_tokens=5, num_experts=8, top_k=2,
                        target_layers=(1, 2, 3)), max_context=4096, norm_eps=1e-20,
        rope=RopeSpec(theta=10_000.0, compress_theta=160_000.0, yarn_factor=1.0, original_context=4096))
