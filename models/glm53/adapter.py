"""The GLM-5.3 adapter."""

from __future__ import annotations

from typing import Any, ClassVar

from latency_specialized.adapter import ModelAdapter, Variant
from latency_specialized.spec import DecodeScope, ModelSpec

from latency_specialized_models.glm53.sites import composed_model
from latency_specialized_models.glm53.spec import NAME, Glm53Spec, full_spec, tiny_spec


class Glm53Adapter(ModelAdapter):
    name: ClassVar[str] = NAME
    description: ClassVar[str] = ("Z.ai GLM-5.3: 78 MLA + DSA layers (IndexShare: 21 indexers), "
                                  "3 dense + 75 MoE 256x top-8, MTP")
    # GLM-5.2 has the same architecture and vLLM class; its numbers differ only where its config does.
    hf_architectures: ClassVar[tuple[str, ...]] = ("GlmMoeDsaForCausalLM",)
    capabilities: ClassVar[frozenset[str]] = frozenset({"spec"})

    def spec(self, variant: Variant = "full") -> ModelSpec:
        return full_spec() if variant == "full" else tiny_spec()

    def scope(self) -> DecodeScope:
        # 64 heads, expert width 2048, dense 12288: TP 1..16 divide them all.
        # Speculation: 0 or the MTP layer's 5 draft tokens.
        return DecodeScope(archs=("cpu", "sm_90", "sm_100", "sm_103"), tp_sizes=(1, 2, 4, 8, 16), max_batch=64,
                           dtypes=("bfloat16", "float32"), spec_tokens=(0, full_spec().mtp.num_speculative_tokens))

    def composed_model(self, spec: ModelSpec) -> Any:
        """Standard pieces with the sparse-MLA stand-in (``sites.composed_model``); the default
        ``op_sites`` lists their sites."""
        assert isinstance(spec, Glm53Spec)
        return composed_model(spec)
