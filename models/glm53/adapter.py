"""The GLM-5.3 adapter (vLLM's ``GlmMoeDsaForCausalLM``) from the pieces. Its own: spec, config, names + FP8
checkpoint I/O, pieces, reference (sibling modules), bench kinds (NOTES.md). Generic: program, verification, harness."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from latency_specialized.adapter import RUNNABLE, BenchKind, ComposedAdapter, Variant
from latency_specialized.adapter import keep_experts, tiny_only, with_program_weights
from latency_specialized.errors import UserError
from latency_specialized.spec import DecodeScope, LinearFormat, ModelSpec

from latency_specialized_models.glm53 import names
from latency_specialized_models.glm53.composed import composed_model
from latency_specialized_models.glm53.spec import NAME, Glm53Spec, build_spec, full_spec, tiny_spec

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class Glm53Adapter(ComposedAdapter):
    name: ClassVar[str] = NAME
    description: ClassVar[str] = "Z.ai GLM-5.3: 78 MLA + DSA layers (21 indexers), 3 dense + 75 MoE 256x top-8, MTP"
    # GLM-5.2 has the same architecture and vLLM class; its numbers differ only where its config does.
    hf_architectures: ClassVar[tuple[str, ...]] = ("GlmMoeDsaForCausalLM",)
    capabilities: ClassVar[frozenset[str]] = RUNNABLE | {"quantized_experts"}
    expert_formats: ClassVar[tuple[str, ...]] = ("fp8-block-128",)  # the release's; reference(expert_format=)
    native_linears: ClassVar[LinearFormat] = LinearFormat(format="fp8-block-128", plain=("indexer.weights_proj",))

    def spec(self, variant: Variant = "full") -> ModelSpec:
        return full_spec() if variant == "full" else tiny_spec()

    def scope(self) -> DecodeScope:
        # 64 heads, expert width 2048, dense 12288: TP 1..16 divide them all. Verification steps of 3 / 7 drafts (MTP):
        # paged MLA, indexer and sparse attention write every row before any row reads (no rollback state).
        return DecodeScope(archs=("cpu", "sm_90"), tp_sizes=(1, 2, 4, 8, 16), max_batch=64,
                           dtypes=("bfloat16", "float32"), spec_tokens=(0, 3, 7))

    def composed_model(self, spec: ModelSpec) -> Any:
        return composed_model(spec)  # type: ignore[arg-type]

    def tensor_names(self, spec: ModelSpec) -> Any:
        return names.tensor_name

    def reference(self, spec: ModelSpec | None = None, *, checkpoint: str | Path | None = None,
                  weights: dict[str, torch.Tensor] | None = None, seed: int = 0,
                  dtype: str | torch.dtype = "bfloat16", device: str | torch.device = "cpu",
                  expert_format: str | None = None, linear_format: str | None = None, **_: Any):
        """The reference with weights by Hugging Face name: from ``checkpoint``, ``weights`` or random (``seed``);
        ``expert_format`` / ``linear_format`` ('native') keep the routed experts / projections FP8 (keep_experts)."""
        from latency_specialized_models.glm53.reference import Glm53Reference

        dt, cfg = DTYPES.get(dtype, dtype), {}  # type: ignore[call-overload]
        if checkpoint is not None:
            spec, named, cfg = names.load(checkpoint, dt, device)
        else:
            spec = spec if spec is not None else tiny_spec()
            tiny_only(NAME, spec.variant, "744B", weights, random=True)
            named = weights if weights is not None else names.random_weights(spec, seed, dt, device)
        spec, named, kept = keep_experts(NAME, spec, named, expert_format, "fp8-block-128", self.expert_formats,
                                         checkpoint=checkpoint, dtype=dt, device=device, linears=linear_format,
                                         native_linears=self.native_linears, is_linear=names.stored_fp8)
        return with_program_weights(Glm53Reference(spec, named, bos_token_id=cfg.get("bos_token_id")), kept)

    def write_checkpoint(self, directory: str | Path, *, size: Variant = "tiny", seed: int = 0, dtype: str = "bfloat16",
                         layout: str | None = None, expert_format: str | None = None,
                         quant: Literal["fp8-block"] | None = None) -> list[Path]:
        """A random-weight tiny checkpoint (``GlmMoeDsaForCausalLM`` layout); ``quant``: projections FP8 as released."""
        tiny_only(NAME, size, "744B")
        if layout not in (None, "hf") or expert_format not in (None, "bf16"):
            raise UserError(f"{NAME}: one layout (Hugging Face GlmMoeDsaForCausalLM), experts as --quant says: drop "
                            "--layout/--experts")
        spec = tiny_spec()
        return names.save(directory, spec, names.random_weights(spec, seed, DTYPES[dtype]), dtype,
                          quantize=names.stored_fp8 if quant else None)

    # ------------------------------------------------------------------ layer bench (NOTES.md: kinds, stock, caveats)
    def bench_kinds(self) -> dict[str, BenchKind]:
        """``moe`` (layer 6: its own DSA indexer) and ``moe_shared_topk`` (layer 3: a shared top-k); NOTES.md."""
        moe = set(range((f := full_spec()).num_layers)) - set(f.dense_layers())
        first = {"moe": min(moe & set(f.indexer_layers())), "moe_shared_topk": min(moe - set(f.indexer_layers()))}
        notes = {"moe": "ours runs the plan's attn.indexer and attn.sparse_mla (the sites table below names them)",
                 "moe_shared_topk": "ours' programs open with an indexer layer: (t_K - t_1)/(K - 1) is a reuse layer's"}
        return {k: BenchKind(layer=i, context=True, stock="dsa_moe", kv_block_size=64,
                             stock_options={"indexer_rope": "interleaved"}, notes=(f"{k} (GLM-5.3): {notes[k]}.",))
                for k, i in first.items()}

    def bench_spec(self, full: ModelSpec, tp: int, kind: str, num_layers: int, *, vocab: int = 512) -> Glm53Spec:
        """``num_layers`` MoE layers of ``kind`` at GLM-5.3's widths, a small vocabulary (NOTES.md: the pattern)."""
        if kind not in (kinds := self.bench_kinds()):
            raise UserError(f"{NAME} bench kind {kind!r}: use {', '.join(kinds)}")
        a, f = full.layers[kinds[kind].layer].attention, full.layers[kinds[kind].layer].ffn
        ix = a.indexer  # type: ignore[union-attr]
        return build_spec(variant=f"bench-{kind}x{num_layers}", hidden=full.hidden_size, vocab=vocab * tp,
                          num_layers=num_layers, first_dense=0, heads=a.num_heads, q_lora=a.q_lora_rank,
                          kv_lora=a.kv_lora_rank, nope=a.qk_nope_head_dim, rope=a.qk_rope_head_dim, v_dim=a.v_head_dim,
                          idx_heads=ix.num_heads, idx_dim=ix.head_dim, idx_topk=ix.topk, offset=1,
                          freq=1 if kind == "moe" else num_layers + 1, experts=f.num_experts, top_k=f.top_k,
                          shared=f.num_shared_experts, expert_inter=f.expert_intermediate, dense_inter=1,
                          max_context=full.max_context, rope_theta=a.rope_theta, eps=full.norm.eps)


__all__ = ["Glm53Adapter"]
