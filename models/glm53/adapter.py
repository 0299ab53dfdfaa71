"""The GLM-5.3 adapter: transformers' / vLLM's ``GlmMoeDsaForCausalLM``, composed from the pieces.

Its own: spec (``spec.py``), config parsing (``config.py``), tensor names and checkpoint I/O with FP8
block dequantisation (``names.py``), pieces (``composed.py``), the plain-torch reference (``reference.py``).
Generic: ``ComposedProgram`` (through ``ComposedAdapter``), ``runtime/checkpoint.py``, ``testing/verify.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from latency_specialized.adapter import ComposedAdapter, Variant
from latency_specialized.errors import UserError
from latency_specialized.spec import DecodeScope, ModelSpec

from latency_specialized_models.glm53 import names
from latency_specialized_models.glm53.composed import composed_model
from latency_specialized_models.glm53.spec import NAME, full_spec, tiny_spec

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class Glm53Adapter(ComposedAdapter):
    name: ClassVar[str] = NAME
    description: ClassVar[str] = ("Z.ai GLM-5.3: 78 MLA + DSA layers (IndexShare: 21 indexers), "
                                  "3 dense + 75 MoE 256x top-8, MTP")
    # GLM-5.2 has the same architecture and vLLM class; its numbers differ only where its config does.
    hf_architectures: ClassVar[tuple[str, ...]] = ("GlmMoeDsaForCausalLM",)
    capabilities: ClassVar[frozenset[str]] = frozenset({"spec", "reference", "program", "checkpoint"})

    def spec(self, variant: Variant = "full") -> ModelSpec:
        return full_spec() if variant == "full" else tiny_spec()

    def scope(self) -> DecodeScope:
        # 64 heads, expert width 2048, dense 12288: TP 1..16 divide them all. No speculation on the fast path yet
        # (the MTP layer's verification steps: issue 25).
        return DecodeScope(archs=("cpu", "sm_90"), tp_sizes=(1, 2, 4, 8, 16), max_batch=64,
                           dtypes=("bfloat16", "float32"), spec_tokens=(0,))

    def composed_model(self, spec: ModelSpec) -> Any:
        return composed_model(spec)  # type: ignore[arg-type]

    def tensor_names(self, spec: ModelSpec) -> Any:
        return names.tensor_name

    def reference(self, spec: ModelSpec | None = None, *, checkpoint: str | Path | None = None,
                  weights: dict[str, torch.Tensor] | None = None, seed: int = 0,
                  dtype: str | torch.dtype = "bfloat16", device: str | torch.device = "cpu", **_: Any):
        """The reference with weights by Hugging Face name: from ``checkpoint``, ``weights`` or random (``seed``)."""
        from latency_specialized_models.glm53.reference import Glm53Reference

        dt = DTYPES.get(dtype, dtype)  # type: ignore[call-overload]
        if checkpoint is not None:
            spec, named, cfg = names.load(checkpoint, dt, device)
            return Glm53Reference(spec, named, bos_token_id=cfg.get("bos_token_id"))
        spec = spec if spec is not None else tiny_spec()
        if weights is None:
            if spec.variant == "full":
                raise UserError("random weights for GLM-5.3 (744B parameters) are not offered: pass --checkpoint DIR "
                                "or use --size tiny")
            weights = names.random_weights(spec, seed, dt, device)
        return Glm53Reference(spec, weights)

    def write_checkpoint(self, directory: str | Path, *, size: Variant = "tiny", seed: int = 0,
                         dtype: str = "bfloat16", layout: str | None = None,
                         expert_format: str | None = None) -> list[Path]:
        """A random-weight Hugging Face checkpoint of the tiny model (``GlmMoeDsaForCausalLM`` layout)."""
        if size != "tiny":
            raise UserError(f"{NAME}: only --size tiny checkpoints can be made (the full model has 744B parameters)")
        if layout not in (None, "hf") or expert_format not in (None, "bf16"):
            raise UserError(f"{NAME}: one layout (Hugging Face GlmMoeDsaForCausalLM) with bf16 experts: drop "
                            "--layout/--experts")
        spec = tiny_spec()
        return names.save(directory, spec, names.random_weights(spec, seed, DTYPES[dtype]), dtype)


__all__ = ["Glm53Adapter"]
