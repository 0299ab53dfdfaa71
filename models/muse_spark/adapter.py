"""The Muse Spark adapter."""

from __future__ import annotations

from typing import Any, ClassVar

from latency_specialized.adapter import ModelAdapter, Variant
from latency_specialized.spec import DecodeScope, ModelSpec, ParallelSpec

from latency_specialized_models.muse_spark.sites import composed_model, muse_op_sites
from latency_specialized_models.muse_spark.spec import NAME, MuseSparkSpec, full_spec, tiny_spec


class MuseSparkAdapter(ModelAdapter):
    name: ClassVar[str] = NAME
    description: ClassVar[str] = ("Meta Muse Spark 1.2: 62 GQA layers (46 SWA-2048 + 16 NoPE full), "
                                  "latent MoE 256x top-8, gated residual, sandwich norms")
    # No vLLM class and no public config exist, so this name is ours: it follows vLLM's name for
    # the sibling (`MuseGlimmerForCausalLM`); our vLLM binding registers the model class under it.
    hf_architectures: ClassVar[tuple[str, ...]] = ("MuseSparkForCausalLM",)
    capabilities: ClassVar[frozenset[str]] = frozenset({"spec"})

    def spec(self, variant: Variant = "full") -> ModelSpec:
        return full_spec() if variant == "full" else tiny_spec()

    def scope(self) -> DecodeScope:
        # 128 query heads / 16 KV heads: TP 1..16 keeps whole KV heads per rank (TP 16: one each).
        # Speculation: 0 or the reported 7 draft tokens.
        return DecodeScope(archs=("cpu", "sm_90", "sm_100", "sm_103"), tp_sizes=(1, 2, 4, 8, 16), max_batch=64,
                           dtypes=("bfloat16", "float32"), spec_tokens=(0, full_spec().draft.num_speculative_tokens))

    def composed_model(self, spec: ModelSpec) -> Any:
        assert isinstance(spec, MuseSparkSpec)
        return composed_model(spec)

    def op_sites(self, spec: ModelSpec, parallel: ParallelSpec, tokens: int, arch: str, dtype: str, *,
                 context: int | None = None) -> list[Any]:
        """The composed model's sites plus what Muse adds to its pieces (``sites.muse_op_sites``)."""
        return muse_op_sites(spec, super().op_sites(spec, parallel, tokens, arch, dtype, context=context))
