"""The Kimi K3 adapter: spec, scope, op sites, reference, program and checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from latency_specialized.adapter import ModelAdapter, Variant
from latency_specialized.errors import UserError
from latency_specialized.spec import DecodeScope, ModelSpec, ParallelSpec

from latency_specialized_models.kimi_k3.spec import KimiK3Spec, full_spec, medium_spec, tiny_spec

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """torch dtype from a name ('bfloat16', 'float32', ...); UserError naming the choices."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise UserError(f"dtype {name!r} not supported: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


class KimiK3Adapter(ModelAdapter):
    name: ClassVar[str] = "kimi_k3"
    description: ClassVar[str] = "Moonshot Kimi K3: 69 KDA + 24 MLA layers, latent MoE 896x top-16, Block AttnRes"
    hf_architectures: ClassVar[tuple[str, ...]] = ("KimiK3ForConditionalGeneration", "KimiLinearForCausalLM")
    capabilities: ClassVar[frozenset[str]] = frozenset({"spec", "reference", "program", "checkpoint"})
    variants: ClassVar[tuple[str, ...]] = ("full", "medium", "tiny")

    def spec(self, variant: Variant = "full") -> ModelSpec:
        if variant == "medium":
            return medium_spec()
        return full_spec() if variant == "full" else tiny_spec()

    def scope(self) -> DecodeScope:
        return DecodeScope(archs=("cpu", "sm_90", "sm_100", "sm_103"), tp_sizes=(1, 2, 4, 8, 16), max_batch=64,
                           dtypes=("bfloat16", "float32"), spec_tokens=(0,))

    def op_sites(self, spec: ModelSpec, parallel: ParallelSpec, tokens: int, arch: str, dtype: str) -> list[Any]:
        """Kimi's own step: AttnRes mixes instead of residual norms, latent MoE tail (see sites.py)."""
        from latency_specialized_models.kimi_k3.sites import kimi_op_sites

        return kimi_op_sites(spec, parallel, tokens, arch, dtype)

    # ------------------------------------------------------------------ reference / program
    def reference(self, spec: ModelSpec | None = None, *, checkpoint: str | Path | None = None,
                  weights: dict[str, torch.Tensor] | None = None, seed: int = 0, dtype: str | torch.dtype = "bfloat16",
                  device: str | torch.device = "cpu", tokenizer: bool = True, **_: Any):
        """The torch reference with weights: from ``checkpoint``, from ``weights``, or random (``seed``).

        Random weights are offered for the tiny and medium variants (the full model has 2.8T parameters).
        ``tokenizer`` trains a byte-level tokenizer of the spec's vocabulary in memory for random weights.
        """
        from latency_specialized_models.kimi_k3.reference import KimiK3Reference

        dt = torch_dtype(dtype)
        if checkpoint is not None:
            from latency_specialized_models.kimi_k3.checkpoint import load_checkpoint

            ck = load_checkpoint(checkpoint, dtype=dt, device=device)
            return KimiK3Reference(ck.spec, ck.weights, tokenizer=ck.tokenizer, bos_token_id=ck.bos_token_id,
                                   eos_token_id=ck.eos_token_id)
        spec = spec if spec is not None else tiny_spec()
        if not isinstance(spec, KimiK3Spec):
            raise UserError("kimi_k3 reference needs a KimiK3Spec (adapter.spec('tiny'), or a checkpoint)")
        if weights is None:
            if spec.variant == "full":
                raise UserError("random weights for the full Kimi K3 (2.8T parameters) do not fit anywhere: "
                                "pass --checkpoint DIR or use --size tiny / medium")
            from latency_specialized_models.kimi_k3.weights import random_weights

            weights = random_weights(spec, seed=seed, dtype=dt, device=device)
        tok = None
        if tokenizer:
            from latency_specialized_models.kimi_k3.tokenizer import train_tokenizer

            tok = train_tokenizer(spec.vocab_size)
        return KimiK3Reference(spec, weights, tokenizer=tok, bos_token_id=1, eos_token_id=2)

    def program(self, spec: ModelSpec, *, plans: Any, cache: Any, reference: Any = None,
                weights: dict[str, torch.Tensor] | None = None, trace: Any = None, comm: Any = None, **_: Any):
        """The decode program over ``cache`` bound to ``plans`` (weights from ``reference`` or ``weights``)."""
        from latency_specialized_models.kimi_k3.program import KimiK3Program

        if weights is None:
            if reference is None:
                raise UserError("kimi_k3 program needs weights: pass reference= or weights=")
            weights = reference.w
        if not isinstance(spec, KimiK3Spec):
            raise UserError("kimi_k3 program needs a KimiK3Spec")
        return KimiK3Program(spec, weights, plans, cache, trace=trace, comm=comm)

    def verify_cell(self, cell: Any, comm: Any = None) -> Any:
        """Program vs reference for one cross-model matrix cell on this rank (see verify.py)."""
        from latency_specialized_models.kimi_k3.verify import verify_cell

        return verify_cell(self, cell, comm)

    def layer_bench(self) -> Any:
        """The layer bench's "ours": ``graphed.build_ours`` (rank-shaped programs in CUDA graphs)."""
        from latency_specialized_models.kimi_k3 import graphed

        return graphed

    def write_checkpoint(self, directory: str | Path, *, size: Variant = "tiny", seed: int = 0,
                         dtype: str = "bfloat16", layout: str = "kimi_k3", expert_format: str | None = None) -> list[Path]:
        """A random-weight checkpoint (config, safetensors, tokenizer) of the ``size`` variant."""
        from latency_specialized_models.kimi_k3.checkpoint import save_checkpoint
        from latency_specialized_models.kimi_k3.tokenizer import train_tokenizer
        from latency_specialized_models.kimi_k3.weights import random_weights

        if size != "tiny":
            raise UserError("only --size tiny checkpoints can be made (the full model has 2.8T parameters)")
        spec = tiny_spec()
        if expert_format is not None:
            if expert_format not in ("bf16", "mxfp4"):
                raise UserError(f"expert format {expert_format!r}: use bf16 or mxfp4")
            spec = spec.model_copy(update={"routed_expert_format": expert_format})
        weights = random_weights(spec, seed=seed, dtype=torch_dtype(dtype))
        return save_checkpoint(directory, spec, weights, layout=layout, tokenizer=train_tokenizer(spec.vocab_size))

    def __repr__(self) -> str:
        return f"<adapter {self.name}>"
