"""The Muse Spark adapter: the real architecture (transformers 5.24 / vLLM 0.33), composed from the pieces
(spec, config, names, pieces + name map, reference: the sibling modules; the program, verification and layer
bench harness: generic, through ``ComposedAdapter``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from latency_specialized.adapter import RUNNABLE, BenchKind, ComposedAdapter, Variant
from latency_specialized.adapter import keep_experts, tiny_only, with_program_weights
from latency_specialized.errors import UserError
from latency_specialized.spec import DecodeScope, GQAAttentionSpec, ModelSpec, MoESpec

from latency_specialized_models.muse_spark import composed
from latency_specialized_models.muse_spark.spec import NAME, MuseSparkSpec, build_spec, full_spec, tiny_spec

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class MuseSparkAdapter(ComposedAdapter):
    name: ClassVar[str] = NAME
    description: ClassVar[str] = ("Meta Muse Spark 1.2: 62 GQA layers (46 SWA-2048 + 16 NoPE full), "
                                  "latent MoE 256x top-8, gated residual, sandwich norms")
    # vLLM 0.33 and transformers 5.24: the multimodal model and vLLM's text-only class
    hf_architectures: ClassVar[tuple[str, ...]] = ("MuseSparkForConditionalGeneration", "MuseSpark1xForCausalLM")
    capabilities: ClassVar[frozenset[str]] = RUNNABLE | {"quantized_experts"}
    expert_formats: ClassVar[tuple[str, ...]] = ("nvfp4",)  # the NVFP4 release's (random weights: keep_experts)
    # the released q scale (5.47 on unit-RMS q, k; 2x the full model's softmax temperature at head_dim 16) makes the
    # tiny model amplify fp32 summation-order differences ~100x over 8 layers, the more rows compared the more (NOTES:
    # verification cells up to 6.8e-4; <= 7.7e-6 at q scale 1, which test_muse_verify_unit_q bounds at 5e-5)
    verify_rel_tol: ClassVar[float] = 1e-3

    def spec(self, variant: Variant = "full") -> ModelSpec:
        return full_spec() if variant == "full" else tiny_spec()

    def scope(self) -> DecodeScope:
        # 128 query heads / 16 KV heads: TP 1..16 keeps whole KV heads per rank (TP 16: one each).
        return DecodeScope(archs=("cpu", "sm_90"), tp_sizes=(1, 2, 4, 8, 16), max_batch=64,
                           dtypes=("bfloat16", "float32"), spec_tokens=(0, 3, 7))

    def composed_model(self, spec: ModelSpec) -> Any:
        return composed.composed_model(spec)  # type: ignore[arg-type]

    def tensor_names(self, spec: ModelSpec) -> Any:
        return composed.tensor_name_for(spec)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ reference / program
    def reference(self, spec: ModelSpec | None = None, *, checkpoint: str | Path | None = None,
                  weights: dict[str, torch.Tensor] | None = None, seed: int = 0,
                  dtype: str | torch.dtype = "bfloat16", device: str | torch.device = "cpu",
                  expert_format: str | None = None, **_: Any):
        """The reference by canonical name (``checkpoint``, ``weights`` or random); ``expert_format``: keep_experts."""
        from latency_specialized_models.muse_spark import names
        from latency_specialized_models.muse_spark.reference import MuseSparkReference

        dt = DTYPES.get(dtype, dtype)  # type: ignore[call-overload]
        if checkpoint is not None:
            spec, weights, _ = names.load(checkpoint, dt, device)
        spec = spec if spec is not None else tiny_spec()
        tiny_only(NAME, spec.variant, "816B", weights, random=True)
        weights = weights if weights is not None else names.random_weights(spec, seed, dt, device)
        spec, weights, kept = keep_experts(NAME, spec, weights, expert_format, "nvfp4", self.expert_formats,
                                           checkpoint=checkpoint, dtype=dt, device=device)
        return with_program_weights(MuseSparkReference(spec, weights), kept)

    def program_tensors(self, named: Any) -> Any:
        return composed.split_fused(named)   # the gate / up halves of the fused expert tensors (views)

    def write_checkpoint(self, directory: str | Path, *, size: Variant = "tiny", seed: int = 0,
                         dtype: str = "bfloat16", layout: str | None = None, expert_format: str | None = None,
                         quant: Literal["nvfp4"] | None = None) -> list[Path]:
        """A random-weight tiny Hugging Face checkpoint (multimodal layout); ``quant``: NVFP4 experts (ModelOpt's)."""
        from latency_specialized_models.muse_spark import names

        tiny_only(NAME, size, "816B")
        if layout not in (None, "hf") or expert_format not in (None, "bf16"):
            raise UserError(f"{NAME}: one layout (Hugging Face MuseSparkForConditionalGeneration) with bf16 experts: "
                            "drop --layout/--experts")
        spec = tiny_spec()
        return names.save(directory, spec, names.random_weights(spec, seed, DTYPES[dtype]), dtype, quant=quant)

    # ------------------------------------------------------------------ layer bench
    def bench_kinds(self) -> dict[str, BenchKind]:
        """``swa`` (sliding-window RoPE GQA + latent MoE: reads min(context + 1, window) KV tokens) and ``full``
        (NoPE full attention: context + 1), one cell per context, each standing for its first layer; stock runs
        what vLLM 0.33 runs beyond the generic spec (``bench/stock/gqa_moe.py``), its router weight fp32."""
        f = full_spec()
        first = {kind: next(L.index for L in f.layers if (L.attention.sliding_window is None) == (kind == "full"))
                 for kind in ("swa", "full")}
        options = {"rope_style": "interleaved", "attn_output_norm": f.attn_output_norm, "post_attn_norm": f.post_attn_norm,
                   "post_ffn_norm": f.post_ffn_norm, "post_norm_eps": f.post_norm.eps,
                   "post_norm_zero_centered": f.post_norm.zero_centered, "gate_temperature": f.residual_gate.temperature,
                   "gate_floor": f.residual_gate.floor, "residual_dtype": "float32",
                   "pre_expert_norm": f.latent_pre_norm,
                   "post_expert_norm": "input_scaled" if f.latent_post_norm else "none"}
        return {kind: BenchKind(layer=i, context=True, stock="gqa_moe", kv_block_size=16, router_weight_bytes=4,
                                stock_options=options) for kind, i in first.items()}

    def bench_spec(self, full: ModelSpec, tp: int, kind: str, num_layers: int, *, vocab: int = 512) -> MuseSparkSpec:
        """``num_layers`` layers of ``kind`` at Muse Spark's full widths, the layer bench's spec (run at TP ``tp`` on
        rank-shaped weights); a small vocabulary."""
        kinds = self.bench_kinds()
        if kind not in kinds:
            raise UserError(f"{NAME} bench kind {kind!r}: use {', '.join(kinds)}")
        layer = full.layers[kinds[kind].layer]
        a, f = layer.attention, layer.ffn
        assert isinstance(a, GQAAttentionSpec) and isinstance(f, MoESpec)
        spec = build_spec(variant=f"bench-{kind}x{num_layers}", hidden=full.hidden_size, vocab=vocab * tp,
                          num_layers=num_layers, heads=a.num_heads, kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                          window=a.sliding_window or 0, experts=f.num_experts, top_k=f.top_k, latent=f.latent_dim,
                          expert_inter=f.expert_intermediate, max_context=full.max_context,
                          full_layers=tuple(range(num_layers)) if kind == "full" else ())
        spec.shard(tp)  # UserError naming the fix for a TP the model cannot be split by
        return spec


__all__ = ["MuseSparkAdapter"]
