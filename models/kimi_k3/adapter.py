"""The Kimi K3 adapter."""

from __future__ import annotations

from typing import ClassVar

from latency_specialized.adapter import ModelAdapter, Variant
from latency_specialized.spec import DecodeScope, ModelSpec

from latency_specialized_models.kimi_k3.spec import full_spec, tiny_spec


class KimiK3Adapter(ModelAdapter):
    name: ClassVar[str] = "kimi_k3"
    description: ClassVar[str] = "Moonshot Kimi K3: 69 KDA + 24 MLA layers, latent MoE 896x top-16, Block AttnRes"
    hf_architectures: ClassVar[tuple[str, ...]] = ("KimiK3ForConditionalGeneration", "KimiLinearForCausalLM")
    capabilities: ClassVar[frozenset[str]] = frozenset({"spec"})

    def spec(self, variant: Variant = "full") -> ModelSpec:
        return full_spec() if variant == "full" else tiny_spec()

    def scope(self) -> DecodeScope:
        return DecodeScope(archs=("cpu", "sm_90", "sm_100", "sm_103"), tp_sizes=(1, 2, 4, 8, 16), max_batch=64,
                           dtypes=("bfloat16", "float32"), spec_tokens=(0, 7))
