"""The generic vLLM MoE adapter: vLLM's own MoE decoder model, decode steps by the runtime's ComposedProgram.

Unlike the model adapters, this one brings no architecture of its own: it reads the spec off the
config vLLM loaded (:func:`spec_from_config`), composes it from the pieces ``models/qwen3_moe`` uses
(:mod:`~latency_specialized_models.vllm_moe.composed`, no head) and binds vLLM's in-tree module tree
onto them (:mod:`latency_specialized_models.vllm_moe.vllm`: module -> piece weight map). It proves the
integration end to end on the CPU build of vLLM until a target model's own binding lands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from latency_specialized.adapter import ModelAdapter, Variant
from latency_specialized.errors import UserError
from latency_specialized.spec import DecodeScope, ModelSpec

from latency_specialized_models.vllm_moe.checkpoint import TinyQwen3MoeConfig, write_tiny_qwen3_moe
from latency_specialized_models.vllm_moe.composed import composed_model
from latency_specialized_models.vllm_moe.spec import NAME, full_spec, spec_from_config, tiny_spec


class VllmMoEAdapter(ModelAdapter):
    name: ClassVar[str] = NAME
    description: ClassVar[str] = ("vLLM's in-tree Qwen3-MoE decoder (GQA + QK-norm, softmax top-k MoE) through a "
                                  "generic binding; proves the vLLM integration on the CPU build")
    hf_architectures: ClassVar[tuple[str, ...]] = ("Qwen3MoeForCausalLM",)
    capabilities: ClassVar[frozenset[str]] = frozenset({"spec", "checkpoint", "vllm"})

    def __init__(self, loaded: ModelSpec | None = None):
        self._loaded = loaded

    @classmethod
    def for_config(cls, hf_config: Any) -> "VllmMoEAdapter":
        """This adapter with ``spec("full")`` = the model vLLM loaded (for scope checks and plans)."""
        return cls(spec_from_config(hf_config, "full"))

    def spec(self, variant: Variant = "full") -> ModelSpec:
        if variant == "tiny":
            return tiny_spec()
        return self._loaded if self._loaded is not None else full_spec()

    def scope(self) -> DecodeScope:
        # GPU archs are listed so plans can be made for them; the vLLM binding itself refuses GPUs
        # until it has been validated there (see vllm.py).
        return DecodeScope(archs=("cpu", "sm_90", "sm_100", "sm_103"), tp_sizes=(1, 2, 4, 8), max_batch=64,
                           dtypes=("bfloat16", "float32"), spec_tokens=(0,))

    def composed_model(self, spec: ModelSpec) -> Any:
        """The pieces (``composed.py``: those ``qwen3_moe`` composes, head-less): the plan's sites (the
        base class's ``op_sites``) are the ones the vLLM binding's program calls."""
        return composed_model(spec)

    def write_checkpoint(self, directory: str | Path, *, size: str = "tiny", seed: int = 1234,
                         dtype: str = "bfloat16", layout: str | None = None,
                         expert_format: str | None = None) -> list[Path]:
        """The tiny Qwen3-MoE checkpoint (HF layout, BPE tokenizer, chat template); returns its files."""
        if size != "tiny":
            raise UserError(f"{NAME}: only the tiny checkpoint can be written (use --size tiny)")
        if layout is not None or expert_format is not None:
            raise UserError(f"{NAME}: one layout (Hugging Face Qwen3-MoE) and plain experts: drop --layout/--experts")
        out = write_tiny_qwen3_moe(directory, TinyQwen3MoeConfig(seed=seed), dtype=dtype)
        return sorted(p for p in out.iterdir() if p.is_file())

    def vllm_binding(self) -> Any:
        from latency_specialized_models.vllm_moe.vllm import VllmMoEBinding

        return VllmMoEBinding(self)
