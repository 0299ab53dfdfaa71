"""The DeepSeek-V4.1-Flash adapter (vLLM's ``DeepseekV41ForCausalLM``) from the pieces. Its own: spec, config, names +
FP8 / FP4 checkpoint I/O, the layer kinds and name map (``composed.py``), reference, bench kinds (NOTES.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from latency_specialized.adapter import RUNNABLE, BenchKind, ComposedAdapter, Variant
from latency_specialized.adapter import keep_experts, tiny_only, with_program_weights
from latency_specialized.errors import UserError
from latency_specialized.spec import DecodeScope, LinearFormat, ModelSpec

from latency_specialized_models.deepseek_v41_flash import names
from latency_specialized_models.deepseek_v41_flash.composed import composed_model, layer_kind, tensor_name
from latency_specialized_models.deepseek_v41_flash.reference import refuse_unmodelled
from latency_specialized_models.deepseek_v41_flash.config import config_from_spec, spec_from_config
from latency_specialized_models.deepseek_v41_flash.spec import NAME, DeepseekV41Spec, full_spec, medium_spec, tiny_spec

EXPERT_FORMAT = "mxfp4-deepseek"  # the routed experts' stored format (expert_dtype fp4; DeepSeek's tensor names)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
BENCH = {"c2_idx": ("c2.src.idx", "ratio-2 KV source running its own indexer"), "c1_reuse": (
    "c1", "ratio-1 reader of a source's KV reusing its top-k"), "window": ("window", "window only")}  # (sort, what)
_first = lambda spec, sort: next(l.index for l in spec.layers if layer_kind(spec, l) == f"sparse_mqa.{sort}+moe")  # noqa


class DeepseekV41FlashAdapter(ComposedAdapter):
    name: ClassVar[str] = NAME
    description: ClassVar[str] = ("DeepSeek-V4.1-Flash: 40 sparse MQA-MLA layers (SWA + compressed KV + indexer), "
                                  "MoE 384x top-6, mHC x4, Engram")
    hf_architectures: ClassVar[tuple[str, ...]] = ("DeepseekV41ForCausalLM",)
    expert_formats: ClassVar[tuple[str, ...]] = (EXPERT_FORMAT,)  # kept on the device: reference(expert_format=)
    capabilities: ClassVar[frozenset[str]] = RUNNABLE | {"quantized_experts"}
    native_linears: ClassVar[LinearFormat] = LinearFormat(format="fp8-block-32", plain=(  # names.FP8: the rest
        "compressor.kv", "compressor.gate", "indexer.weights_proj", "indexer.k_proj"))
    variants: ClassVar[tuple[str, ...]] = ("full", "medium", "tiny")

    def spec(self, variant: Variant = "full") -> ModelSpec:
        return {"full": full_spec, "medium": medium_spec}.get(variant, tiny_spec)()

    def scope(self) -> DecodeScope:
        # TP divides the 8 output groups (vLLM's: GB300 + TP4); verification 3 / 7: pieces/attention/sparse_mqa.py
        return DecodeScope(archs=("cpu", "sm_90", "sm_100", "sm_103"), tp_sizes=(1, 2, 4, 8), max_batch=64,
                           dtypes=("bfloat16", "float32"), spec_tokens=(0, 3, 7))

    def composed_model(self, spec: ModelSpec) -> Any:
        return composed_model(spec)  # type: ignore[arg-type]

    def tensor_names(self, spec: ModelSpec) -> Any:
        return tensor_name

    def reference(self, spec: ModelSpec | None = None, *, checkpoint: str | Path | None = None, weights: dict[str,
                  torch.Tensor] | None = None, seed: int = 0, dtype: str | torch.dtype = "bfloat16", device="cpu",
                  expert_format: str | None = None, linear_format: str | None = None, **_):
        """The reference with weights by official name: from ``checkpoint``, ``weights`` or random (``seed``);
        ``expert_format`` / ``linear_format`` ('native') keep the routed experts FP4 / projections FP8 (keep_experts)."""
        from latency_specialized_models.deepseek_v41_flash.reference import DeepseekV41Reference

        dt = DTYPES.get(dtype, dtype)  # type: ignore[call-overload]
        if checkpoint is not None:
            spec, w, _ = names.load(checkpoint, dt, device)
        else:
            spec = spec if spec is not None else tiny_spec()
            refuse_unmodelled(spec.full(), "reference")  # type: ignore[attr-defined]
            tiny_only(NAME, spec.variant, "748B", weights, random=True)
            w = weights if weights is not None else names.random_weights(spec, seed, dt, device)  # type: ignore
        spec, w, kept = keep_experts(NAME, spec, w, expert_format, EXPERT_FORMAT, self.expert_formats, checkpoint=checkpoint,
                                     dtype=dt, device=device, linears=linear_format, native_linears=self.native_linears,
                                     is_linear=lambda n: any(f in n for f in names.FP8))
        return with_program_weights(DeepseekV41Reference(spec, w), kept)  # type: ignore[arg-type]

    def program(self, spec: ModelSpec, **kw: Any) -> Any:
        """The composed program (``ComposedAdapter.program``); refuses what the pieces do not model (Engram, YaRN)."""
        refuse_unmodelled(spec.full(), "program")  # type: ignore[attr-defined]
        return super().program(spec, **kw)

    def write_checkpoint(self, directory: str | Path, *, size: Variant = "tiny", seed: int = 0, dtype: str = "bfloat16",
                         layout: str | None = None, expert_format: str | None = None) -> list[Path]:
        """A random-weight checkpoint of the tiny model in the official layout (dense FP8 32x32 blocks, FP4 experts)."""
        tiny_only(NAME, size, "748B")
        if layout not in (None, "official") or expert_format not in (None, "mxfp4"):
            raise UserError(f"{NAME}: one layout (official: FP8 dense, MXFP4-style experts): drop --layout/--experts")
        spec, kinds = tiny_spec(), names.expected_tensors(tiny_spec())
        return names.save(directory, spec, names.random_weights(spec, seed, DTYPES[dtype]), dtype,
                          quantize=lambda n: kinds[n][2] != "plain")

    def bench_kinds(self) -> dict[str, BenchKind]:  # the first layer of each sort (NOTES.md: kinds, stock, caveats)
        return {k: BenchKind(layer=(i := _first(full_spec(), sort)), context=True, stock="sparse_mqa_moe",
                             kv_block_size=64, notes=(f"{k} (DeepSeek-V4.1-Flash layer {i}): {what}.",))
                for k, (sort, what) in BENCH.items()}

    def bench_spec(self, full: ModelSpec, tp: int, kind: str, num_layers: int, *, vocab: int = 512) -> DeepseekV41Spec:
        """K = ``num_layers`` layers of ``kind``, full widths, vocabulary 512 x TP, no Engram / YaRN. ``c2_idx``: all
        sources + indexers; ``c1_reuse``: layer 0 the source + indexer (``(t_K - t_1) / (K - 1)``: a reader)."""
        if kind not in BENCH:
            raise UserError(f"{NAME} bench kind {kind!r}: use {', '.join(BENCH)}")
        K, c = num_layers, config_from_spec(full.full())  # type: ignore[attr-defined]
        src, t = {"c2_idx": list(range(K)), "c1_reuse": [0], "window": []}[kind], c["text_config"]
        t.update(num_hidden_layers=K, vocab_size=vocab * tp, kv_source_layer_ids=src, index_source_layer_ids=src,
                 compress_ratios=[full.layers[_first(full, BENCH[kind][0])].attention.compress_ratio] * K,  # type:ignore
                 candidate_source_layer_id=-1, engram_layer_ids=[], engram_num_embeddings=[],
                 dspark_target_layer_ids=[], rope_scaling=dict(t["rope_scaling"], factor=1.0))
        return spec_from_config(c, where=f"{NAME} bench spec", variant=f"bench-{kind}x{K}")

__all__ = ["DeepseekV41FlashAdapter"]
