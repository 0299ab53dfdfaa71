"""The Kimi K3 adapter: spec, scope, pieces and names, reference, bench spec and checkpoints. What runs is
generic over the pieces (``composed.py``): the op sites and program are the composed model's, matrix cells
``testing/verify.py``'s, the layer bench's "ours" ``runtime/layer_harness.py``'s over :meth:`bench_spec`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from latency_specialized.adapter import BenchKind, ModelAdapter, Variant, keep_experts, kept_expert_format
from latency_specialized.adapter import with_program_weights
from latency_specialized.errors import UserError
from latency_specialized.runtime.composed import ComposedProgram
from latency_specialized.runtime.random_weights import torch_dtype
from latency_specialized.spec import DecodeScope, KDAAttentionSpec, MLAAttentionSpec, ModelSpec, MoESpec
from latency_specialized.testing import verify

from latency_specialized_models.kimi_k3 import checkpoint as ckpt
from latency_specialized_models.kimi_k3 import composed
from latency_specialized_models.kimi_k3.reference import KimiK3Reference
from latency_specialized_models.kimi_k3.spec import KimiK3Spec, build_spec, full_spec, medium_spec, tiny_spec
from latency_specialized_models.kimi_k3.tokenizer import train_tokenizer


def _kimi(spec: Any, what: str) -> KimiK3Spec:
    if not isinstance(spec, KimiK3Spec):
        raise UserError(f"kimi_k3 {what} needs a KimiK3Spec (adapter.spec('tiny'), or a checkpoint's)")
    return spec


class KimiK3Adapter(ModelAdapter):
    name: ClassVar[str] = "kimi_k3"
    description: ClassVar[str] = "Moonshot Kimi K3: 69 KDA + 24 MLA layers, latent MoE 896x top-16, Block AttnRes"
    hf_architectures: ClassVar[tuple[str, ...]] = ("KimiK3ForConditionalGeneration", "KimiLinearForCausalLM")
    capabilities: ClassVar[frozenset[str]] = frozenset({"spec", "reference", "program", "checkpoint",
                                                        "quantized_experts"})
    variants: ClassVar[tuple[str, ...]] = ("full", "medium", "tiny")
    expert_formats: ClassVar[tuple[str, ...]] = ("mxfp4",)
    """Formats the routed experts can stay in on the device (``reference(expert_format=)``; matrix cells)."""

    def spec(self, variant: Variant = "full") -> ModelSpec:
        if variant == "medium":
            return medium_spec()
        return full_spec() if variant == "full" else tiny_spec()

    def scope(self) -> DecodeScope:
        """Verification steps of 3 or 7 draft tokens run on the fast path with a spec built for them
        (``spec.with_spec_tokens(k)``: its plans and states carry the KDA verification sites and tapes)."""
        return DecodeScope(archs=("cpu", "sm_90", "sm_100", "sm_103"), tp_sizes=(1, 2, 4, 8, 16), max_batch=64,
                           dtypes=("bfloat16", "float32"), spec_tokens=(0, 3, 7))

    # ------------------------------------------------------------------ pieces
    def composed_model(self, spec: ModelSpec) -> Any:
        """The pieces of the unsharded ``spec`` (their sites are the adapter's ``op_sites``)."""
        return composed.composed_model(_kimi(spec, "composed model"))

    def tensor_names(self, spec: ModelSpec) -> Any:
        """``tensor_name(layer, role, local) -> str | None``: the checkpoint name of each piece weight."""
        return composed.tensor_name_for(_kimi(spec, "tensor names"))

    def bench_spec(self, full: ModelSpec, tp: int, kind: str, num_layers: int, *, vocab: int = 512) -> KimiK3Spec:
        """``num_layers`` layers of ``kind`` (+MoE) with Kimi K3's full widths (heads, experts, latent ...), the
        layer bench's spec: run at TP ``tp`` on rank-shaped weights, every kernel sees a TP-``tp`` shard's
        shapes. Routed experts bf16; a small vocabulary (the LM head is not part of a layer)."""
        full = _kimi(full, "bench spec")
        kda = next(l.attention for l in full.layers if isinstance(l.attention, KDAAttentionSpec))
        mla = next(l.attention for l in full.layers if isinstance(l.attention, MLAAttentionSpec))
        moe = next(l.ffn for l in full.layers if isinstance(l.ffn, MoESpec))
        spec = build_spec(variant=f"bench-{kind}x{num_layers}", hidden=full.hidden_size, vocab=vocab * tp,
                          num_layers=num_layers, mla_layers=tuple(range(num_layers)) if kind == "mla" else (),
                          kda_heads=kda.num_heads, head_dim=kda.head_dim, conv=kda.conv_kernel,
                          gate_lower_bound=kda.gate_lower_bound, mla_heads=mla.num_heads, q_lora=mla.q_lora_rank,
                          kv_lora=mla.kv_lora_rank, nope=mla.qk_nope_head_dim, rope=mla.qk_rope_head_dim,
                          v_dim=mla.v_head_dim, experts=moe.num_experts, top_k=moe.top_k,
                          shared=moe.num_shared_experts, expert_inter=moe.expert_intermediate, latent=moe.latent_dim,
                          dense_layers=(), dense_inter=moe.expert_intermediate,
                          block_size=full.residual.block_size or 12, max_context=full.max_context, eps=full.norm.eps,
                          activation=moe.activation, router=moe.router, latent_norm=full.latent_moe_norm,
                          expert_format="bf16")
        spec.shard(tp)  # UserError naming the fix for a TP the model cannot be split by
        return spec

    # ------------------------------------------------------------------ reference / program
    def reference(self, spec: ModelSpec | None = None, *, checkpoint: str | Path | None = None,
                  weights: dict[str, torch.Tensor] | None = None, seed: int = 0, dtype: str | torch.dtype = "bfloat16",
                  device: str | torch.device = "cpu", tokenizer: bool = True, expert_format: str | None = None,
                  **_: Any):
        """The torch reference with weights: from ``checkpoint``, from ``weights``, or random (``seed``: tiny
        and medium only). ``tokenizer`` trains a byte-level tokenizer of the vocabulary for random weights.

        ``expert_format`` ('mxfp4', or 'native': the checkpoint's / the release's format) keeps the routed
        experts quantized for the program: the returned reference's spec says so (``MoESpec.expert_format``)
        and its ``program_weights`` hold them as ``QuantizedWeight`` (from the checkpoint as stored, or random
        weights quantized once), while the reference itself computes with exactly those values dequantised."""
        dt = torch_dtype(dtype)
        if checkpoint is not None:
            ck = ckpt.load_checkpoint(checkpoint, dtype=dt, device=device, keep_experts=expert_format is not None)
            fmt = kept_expert_format(self.name, expert_format, ck.spec.routed_expert_format, self.expert_formats,
                                     "the checkpoint")
            spec = ck.spec.with_expert_format(fmt) if fmt else ck.spec
            ref = KimiK3Reference(spec, ck.weights, tokenizer=ck.tokenizer, bos_token_id=ck.bos_token_id,
                                  eos_token_id=ck.eos_token_id)
            if fmt:
                ref.program_weights = {**ck.weights, **ck.kept}
            return ref
        spec = _kimi(spec if spec is not None else tiny_spec(), "reference")
        if weights is None:
            if spec.variant == "full":
                raise UserError("random weights for the full Kimi K3 (2.8T parameters) do not fit anywhere: "
                                "pass --checkpoint DIR or use --size tiny / medium")
            weights = composed.random_weights(spec, seed=seed, dtype=dt, device=device)
        spec, weights, kept = keep_experts(self.name, spec, weights, expert_format, full_spec().routed_expert_format,
                                           self.expert_formats, dtype=dt, device=device,
                                           is_expert=ckpt.is_routed_expert)
        tok = train_tokenizer(spec.vocab_size) if tokenizer else None
        return with_program_weights(KimiK3Reference(spec, weights, tokenizer=tok, bos_token_id=1, eos_token_id=2),
                                    kept)

    def program(self, spec: ModelSpec, *, plans: Any, cache: Any, reference: Any = None,
                weights: dict[str, torch.Tensor] | None = None, trace: Any = None, comm: Any = None,
                weights_sharded: bool = False, dcp: Any = None, **_: Any):
        """The composed decode program over ``cache`` (this rank's ``ModelStates``) bound to ``plans``; weights
        by official name from ``reference`` or ``weights`` (full, or the rank's with ``weights_sharded``);
        ``dcp``: the DCP group of a cache split by token (``ComposedProgram``'s)."""
        if weights is None:
            if reference is None:
                raise UserError("kimi_k3 program needs weights: pass reference= or weights=")
            # the experts kept quantized where the reference was built so (else the reference's own)
            weights = getattr(reference, "program_weights", None) or reference.w
        spec = _kimi(spec, "program")
        return ComposedProgram(composed.composed_model(spec), composed.piece_weights(spec, weights), plans, cache,
                               comm=comm, trace=trace, weights_sharded=weights_sharded, dcp=dcp)

    def verify_cell(self, cell: Any, comm: Any = None) -> Any:
        """Program vs reference for one cross-model matrix cell on this rank (``testing/verify.py``)."""
        return verify.verify_cell(self, cell, comm)

    def bench_kinds(self) -> dict[str, BenchKind]:
        """The layer bench's kinds: ``kda`` (KDA + latent MoE: a fixed-size state, one cell per batch) and ``mla``
        (MLA + latent MoE over a paged latent cache, vLLM's MLA block size 64: one cell per context), each
        standing for the first such layer of the full model (layer 0 is dense)."""
        full = self.spec("full")
        first = {k: next(l.index for l in full.layers if l.attention.kind == k and isinstance(l.ffn, MoESpec))
                 for k in ("kda", "mla")}
        kda_note = ("KDA layers keep a fixed-size recurrent state: their work does not depend on the context length, "
                    "so KDA cells are measured once per batch (context 'any').")
        return {"kda": BenchKind(layer=first["kda"], context=False, stock="kda_moe", notes=(kda_note,)),
                "mla": BenchKind(layer=first["mla"], context=True, stock="mla_moe", kv_block_size=64)}

    def write_checkpoint(self, directory: str | Path, *, size: Variant = "tiny", seed: int = 0,
                         dtype: str = "bfloat16", layout: str = "kimi_k3", expert_format: str | None = None) -> list[Path]:
        """A random-weight checkpoint (config, safetensors, tokenizer) of the ``size`` variant."""
        if size != "tiny":
            raise UserError("only --size tiny checkpoints can be made (the full model has 2.8T parameters)")
        spec = tiny_spec()
        if expert_format is not None:
            if expert_format not in ("bf16", "mxfp4"):
                raise UserError(f"expert format {expert_format!r}: use bf16 or mxfp4")
            spec = spec.model_copy(update={"routed_expert_format": expert_format})
        weights = composed.random_weights(spec, seed=seed, dtype=torch_dtype(dtype))
        return ckpt.save_checkpoint(directory, spec, weights, layout=layout, tokenizer=train_tokenizer(spec.vocab_size))
