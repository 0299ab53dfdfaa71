"""The DeepSeek-V4.1-Flash adapter."""

from __future__ import annotations

from typing import Any, ClassVar

from latency_specialized.adapter import ModelAdapter, Variant
from latency_specialized.spec import DecodeScope, ModelSpec, ParallelSpec

from latency_specialized_models.deepseek_v41_flash.sites import composed_model, dsv41_op_sites
from latency_specialized_models.deepseek_v41_flash.spec import NAME, DeepseekV41Spec, full_spec, tiny_spec


class DeepseekV41FlashAdapter(ModelAdapter):
    name: ClassVar[str] = NAME
    description: ClassVar[str] = ("DeepSeek-V4.1-Flash: 40 sparse MQA-MLA layers (SWA + compressed KV + indexer), "
                                  "MoE 384x top-6, mHC x4, Engram")
    hf_architectures: ClassVar[tuple[str, ...]] = ("DeepseekV41ForCausalLM",)
    capabilities: ClassVar[frozenset[str]] = frozenset({"spec"})

    def spec(self, variant: Variant = "full") -> ModelSpec:
        return full_spec() if variant == "full" else tiny_spec()

    def scope(self) -> DecodeScope:
        # TP must divide the 8 output groups (and the 64 heads): 1, 2, 4, 8. vLLM's own
        # specialized decode for this model is GB300 + TP4 only; ours also targets Hopper.
        # Speculation: 0 or the built-in DSpark draft's 5 tokens.
        return DecodeScope(archs=("cpu", "sm_90", "sm_100", "sm_103"), tp_sizes=(1, 2, 4, 8), max_batch=64,
                           dtypes=("bfloat16", "float32"), spec_tokens=(0, full_spec().draft.num_speculative_tokens))

    def composed_model(self, spec: ModelSpec) -> Any:
        assert isinstance(spec, DeepseekV41Spec)
        return composed_model(spec)

    def op_sites(self, spec: ModelSpec, parallel: ParallelSpec, tokens: int, arch: str, dtype: str, *,
                 context: int | None = None) -> list[Any]:
        """The composed model's sites with the experts' SwiGLU clamp (``sites.dsv41_op_sites``)."""
        return dsv41_op_sites(spec, super().op_sites(spec, parallel, tokens, arch, dtype, context=context))
