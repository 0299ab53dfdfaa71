"""The Qwen3-MoE adapter: a real architecture composed only from the pieces (docs/composition.md).

Its own: the spec (``spec.py``), pieces and tensor names (``composed.py``), the plain-torch reference
(``reference.py``). Generic: ``ComposedProgram``, ``runtime/checkpoint.py``, ``testing/verify.py``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, ClassVar

import torch

from latency_specialized.adapter import ComposedAdapter, Variant, tiny_only
from latency_specialized.errors import UserError
from latency_specialized.spec import DecodeScope, ModelSpec

from latency_specialized_models.qwen3_moe import composed
from latency_specialized_models.qwen3_moe.spec import NAME, VARIANTS, config_from_spec, variant_spec

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class Qwen3MoEAdapter(ComposedAdapter):
    name: ClassVar[str] = NAME
    description: ClassVar[str] = "Qwen3-MoE (30B-A3B: 48 x GQA 32/4 + QK-norm, MoE 128 top-8), composed from the pieces"
    # not Qwen3MoeForCausalLM: vllm_moe serves it for vLLM; adapter_for_architecture would pick this one first
    hf_architectures: ClassVar[tuple[str, ...]] = ()
    capabilities: ClassVar[frozenset[str]] = frozenset({"spec", "reference", "program", "checkpoint"})
    variants: ClassVar[tuple[str, ...]] = tuple(VARIANTS)

    def spec(self, variant: Variant = "full") -> ModelSpec:
        if variant not in VARIANTS:
            raise UserError(f"{NAME} has no variant {variant!r} (variants: {', '.join(VARIANTS)})")
        return variant_spec(variant)

    def scope(self) -> DecodeScope:  # TP up to Qwen3-30B-A3B's 4 KV heads (no KV replication)
        return DecodeScope(archs=("cpu", "sm_90"), tp_sizes=(1, 2, 4), max_batch=64, dtypes=("bfloat16", "float32"),
                           spec_tokens=(0,))

    def composed_model(self, spec: ModelSpec) -> Any:  # full, or a rank's shard: its unsharded spec's pieces
        return composed.composed_model(spec)

    def tensor_names(self, spec: ModelSpec) -> Any:  # tensor_name(layer, role, local): the Hugging Face name
        return composed.tensor_name_for(spec)

    def reference(self, spec: ModelSpec | None = None, *, checkpoint: str | Path | None = None,
                  weights: dict[str, torch.Tensor] | None = None, seed: int = 0,
                  dtype: str | torch.dtype = "bfloat16", device: str | torch.device = "cpu", **_: Any):
        """The reference with weights by Hugging Face name: from ``checkpoint``, ``weights`` or random (``seed``)."""
        from latency_specialized_models.qwen3_moe.reference import Qwen3MoEReference

        dt = DTYPES.get(dtype, dtype)  # type: ignore[call-overload]
        if checkpoint is not None:
            spec, named, cfg = composed.load(checkpoint, dt, device)
            file = Path(checkpoint) / "tokenizer.json"
            tok = importlib.import_module("tokenizers").Tokenizer.from_file(str(file)) if file.exists() else None
            return Qwen3MoEReference(spec, named, tokenizer=tok, bos_token_id=cfg.get("bos_token_id"))
        spec = spec if spec is not None else variant_spec("tiny")
        if weights is None:
            if spec.variant == "full":
                raise UserError("random weights for Qwen3-30B-A3B (30B parameters) are not offered: pass "
                                "--checkpoint DIR or use --size tiny / medium")
            weights = composed.random_weights(spec, seed, dt, device)
        return Qwen3MoEReference(spec, weights)

    def write_checkpoint(self, directory: str | Path, *, size: Variant = "tiny", seed: int = 0,
                         dtype: str = "bfloat16", layout: str | None = None,
                         expert_format: str | None = None) -> list[Path]:
        """A random-weight Hugging Face checkpoint of the tiny model: config.json + model.safetensors."""
        from latency_specialized.runtime.checkpoint import save_checkpoint

        tiny_only(NAME, size, "30B")
        if layout not in (None, "hf") or expert_format not in (None, "bf16"):
            raise UserError(f"{NAME}: one layout (Hugging Face Qwen3-MoE) with plain experts: drop --layout/--experts")
        spec = variant_spec("tiny")
        return save_checkpoint(directory, composed.random_weights(spec, seed, DTYPES[dtype]),
                               config_from_spec(spec, dtype))
