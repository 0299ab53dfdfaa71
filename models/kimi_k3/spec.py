"""Kimi K3 architecture (MODELS.md; vLLM `KimiK3ForConditionalGeneration`, text model `kimi_linear`).

Every number of the published model is in :func:`full_spec`; :func:`tiny_spec` keeps every
feature at test size. Facts that the generic :class:`ModelSpec` has no field for (the AttnRes
norm epsilon, where the latent-MoE norm sits, the KDA output-norm epsilon, the routed-expert
weight format) live in :class:`KimiK3Spec`, a ModelSpec subclass, so the planner and the CLI see
an ordinary ModelSpec.

Sources: MODELS.md, vLLM 0.32 ``vllm/models/kimi_k3/{amd,nvidia}`` and
``vllm/transformers_utils/configs/kimi_linear.py`` (read, not copied).
"""

from __future__ import annotations

from typing import Literal

from latency_specialized.errors import UserError
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

SUPPORTED_TP: tuple[int, ...] = (1, 2, 4, 8, 16)
"""TP sizes the adapter shards for: 7168 hidden, 163840 vocab and 96 heads all split evenly."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KimiK3Spec(ModelSpec):
    """A Kimi K3 model: the generic ModelSpec plus the Kimi-only facts the reference needs."""

    kda_norm_eps: float = 1e-5
    """Epsilon of the KDA gated output RMSNorm (vLLM FusedRMSNormGated default; not the config eps)."""
    latent_moe_norm: bool = True
    """RMSNorm on the routed experts' combined *latent output*, before the up-projection (config
    ``latent_moe_use_norm``). vLLM applies it in ``KimiRoutedOutputTransform`` after the experts'
    all-reduce, i.e. down-proj -> experts -> norm -> up-proj. MODELS.md's wording ("down-projection
    with an RMSNorm on the latent") is ambiguous; we follow the vLLM code."""
    routed_expert_format: Literal["bf16", "mxfp4"] = "mxfp4"
    """Storage of the routed experts in the checkpoint (MXFP4 = e2m1 + ue8m0 scale per 32 values).
    The reference and program compute with dequantised weights in the activation dtype."""
    tie_word_embeddings: bool = False
    """lm_head shares the embedding matrix (False for Kimi K3)."""
    @property
    def mla_layers(self) -> tuple[int, ...]:
        """0-based MLA layers (the rest are KDA)."""
        return tuple(l.index for l in self.layers if l.attention.kind == "mla")

    @property
    def kda_layers(self) -> tuple[int, ...]:
        """0-based KDA layers."""
        return tuple(l.index for l in self.layers if l.attention.kind == "kda")

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """0-based layers with a dense MLP instead of the MoE."""
        return tuple(l.index for l in self.layers if l.ffn.kind == "dense")

    @property
    def attnres_block(self) -> int:
        """Layers per AttnRes block (each layer contributes two sublayer outputs)."""
        assert self.residual.block_size is not None
        return self.residual.block_size

    @property
    def attnres_rows(self) -> int:
        """Sources the final AttnRes mixes: the embedding, every completed block and the partial block.

        Kimi K3: cdiv(93, 12) = 8 stored blocks (embedding + 7 completed) + the partial one = 9.
        """
        return cdiv(self.num_layers, self.attnres_block) + 1

    def shard(self, tp: int) -> "KimiK3Spec":
        """Per-rank shapes at TP ``tp`` (1, 2, 4, 8 or 16); UserError naming the fix otherwise."""
        out = super().shard(tp)  # heads / intermediate widths first: their message names the usual culprit
        for what, n in (("hidden size", self.hidden_size), ("vocabulary", self.vocab_size)):
            if n % tp:
                raise UserError(f"TP={tp} not supported: {self.name} needs its {what} {n} divisible by TP")
        if tp not in SUPPORTED_TP:
            raise UserError(f"TP={tp} not supported: {self.name} shards for TP {', '.join(map(str, SUPPORTED_TP))}; "
                            "use one of those")
        assert isinstance(out, KimiK3Spec)
        return out


def mla_layer_indices(num_layers: int, period: int) -> tuple[int, ...]:
    """0-based MLA layers: every ``period``-th layer (1-indexed 4, 8, ...) and the last layer."""
    idx = {i for i in range(num_layers) if (i + 1) % period == 0}
    idx.add(num_layers - 1)
    return tuple(sorted(idx))


def build_spec(*, variant: str, hidden: int, vocab: int, num_layers: int, mla_layers: tuple[int, ...],
               kda_heads: int, head_dim: int, conv: int = 4, gate_lower_bound: float = -5.0, mla_heads: int,
               q_lora: int | None, kv_lora: int, nope: int, rope: int, v_dim: int, experts: int, top_k: int,
               shared: int, expert_inter: int, latent: int | None, dense_layers: tuple[int, ...] = (0,),
               dense_inter: int, block_size: int, max_context: int, eps: float = 1e-5,
               activation: ActivationSpec = SITU, router: RouterSpec = ROUTER, latent_norm: bool = True,
               expert_format: Literal["bf16", "mxfp4"] = "mxfp4", tie_embeddings: bool = False) -> KimiK3Spec:
    """A KimiK3Spec from the config-level numbers (also used by the checkpoint config mapping).

    The KDA decay input f_a has rank ``head_dim`` (vLLM sizes ``f_a_proj`` by head_dim), so the
    spec's ``decay_rank`` is tied to it.
    """
    mla = set(mla_layers)
    dense = set(dense_layers)
    moe = MoESpec(num_experts=experts, top_k=top_k, num_shared_experts=shared, expert_intermediate=expert_inter,
                  latent_dim=latent, activation=activation, router=router)
    layers = []
    for i in range(num_layers):
        attn = (MLAAttentionSpec(num_heads=mla_heads, q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope,
                                 qk_rope_head_dim=rope, v_head_dim=v_dim, use_rope=False, output_gate="sigmoid")
                if i in mla else
                KDAAttentionSpec(num_heads=kda_heads, head_dim=head_dim, conv_kernel=conv, decay_rank=head_dim,
                                 gate_lower_bound=gate_lower_bound))
        ffn = DenseMLPSpec(intermediate=dense_inter, activation=activation) if i in dense else moe
        layers.append(LayerSpec(index=i, attention=attn, ffn=ffn))
    return KimiK3Spec(name="kimi_k3", variant=variant, hidden_size=hidden, vocab_size=vocab, max_context=max_context,
                      layers=tuple(layers), norm=NormSpec(eps=eps),
                      residual=ResidualSpec(kind="attnres", block_size=block_size,
                                            max_cached_blocks=cdiv(num_layers, block_size)),
                      latent_moe_norm=latent_norm, routed_expert_format=expert_format,
                      tie_word_embeddings=tie_embeddings)


def full_spec() -> KimiK3Spec:
    """The published Kimi K3 (2.8T total, 104B active; MODELS.md).

    93 layers: MLA on 1-indexed 4, 8, ..., 92 and 93 (24), KDA elsewhere (69); layer 0 dense
    (33792); 896 experts top-16 + 2 shared of 3072, latent width 3584; AttnRes blocks of 12 layers
    (cdiv(93, 12) = 8 stored blocks + the partial one).
    """
    return build_spec(variant="full", hidden=7168, vocab=163840, num_layers=93, mla_layers=mla_layer_indices(93, 4),
                      kda_heads=96, head_dim=128, mla_heads=96, q_lora=1536, kv_lora=512, nope=128, rope=64,
                      v_dim=128, experts=896, top_k=16, shared=2, expert_inter=3072, latent=3584,
                      dense_inter=33792, block_size=12, max_context=1_048_576, expert_format="mxfp4")


def medium_spec() -> KimiK3Spec:
    """4 layers (KDA+dense, 2 x KDA+MoE, MLA+MoE), hidden 1024, at widths the GPU kernels serve.

    KDA head_dim 128, latent 512 = 2 x 256, 128 experts (the 4-warp router), SiTU-GLU experts of
    256: on a GPU every site runs a kernel (none falls back to a host-syncing reference), so the
    whole step captures into one CUDA graph. The long check and ``make demo`` on a GPU use it.
    """
    return build_spec(variant="medium", hidden=1024, vocab=2048, num_layers=4,
                      mla_layers=mla_layer_indices(4, 4), kda_heads=8, head_dim=128, mla_heads=8, q_lora=256,
                      kv_lora=128, nope=64, rope=32, v_dim=64, experts=128, top_k=8, shared=1, expert_inter=256,
                      latent=512, dense_inter=1024, block_size=2, max_context=4096, expert_format="bf16")


def tiny_spec() -> KimiK3Spec:
    """Every feature of the full model at test size.

    7 layers: KDA+dense (0), KDA+MoE (1, 2, 4, 5), MLA+MoE on 1-indexed 4 and on the last layer 7
    (the same "every 4th and the last" rule); AttnRes blocks of 3 layers, so blocks are written at
    layers 0, 3, 6 and the final mix sees the embedding, two completed blocks and the partial one.
    Heads and widths split by TP 1, 2, 4, 8; routed experts stored as bf16.
    """
    return build_spec(variant="tiny", hidden=64, vocab=512, num_layers=7, mla_layers=mla_layer_indices(7, 4),
                      kda_heads=8, head_dim=16, mla_heads=8, q_lora=32, kv_lora=16, nope=8, rope=8, v_dim=8,
                      experts=16, top_k=4, shared=2, expert_inter=32, latent=32, dense_inter=64, block_size=3,
                      max_context=4096, expert_format="bf16")
