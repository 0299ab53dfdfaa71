"""Muse Spark tensor names, checkpoint loading and saving, random weights. Canonical names are the text part of
transformers 5.24's ``MuseSparkForConditionalGeneration`` as ``save_pretrained`` writes it: ``lm_head.weight`` and,
under :data:`PREFIX`, those of :func:`expected_tensors` (shapes there: H hidden, Hq / KV heads of D, E experts of
width I at latent Hm, I dense width; ``gate_up_proj`` [E, 2I, Hm]: gate rows first). 'float32' ones are
transformers' ``_keep_in_fp32_modules_strict`` (router weight and bias, residual gates). :func:`load` also reads
standalone text checkpoints: prefix ``model.`` (``MuseSpark1xForCausalLM``-style) or none (``MuseSparkTextModel``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from latency_specialized.adapter import FUSED_EXPERTS
from latency_specialized.errors import CheckpointError
from latency_specialized.quant import quantize_named
from latency_specialized.runtime.checkpoint import load_checkpoint, read_config, save_checkpoint, tensor_files
from latency_specialized.runtime.random_weights import torch_dtype
from latency_specialized.spec import MoESpec

from latency_specialized_models.muse_spark.config import config_from_spec, spec_from_config
from latency_specialized_models.muse_spark.spec import MuseSparkSpec

PREFIX = "model.language_model."
"""Prefix of the text model's tensors in the multimodal checkpoint (``lm_head.weight`` has none)."""
TEXT_PREFIXES = (PREFIX, "model.", "")
"""Layouts :func:`load` accepts, tried in this order."""
Expected = dict[str, tuple[tuple[int, ...], str]]


def expected_tensors(spec: MuseSparkSpec, prefix: str = PREFIX) -> Expected:
    """Canonical name (text tensors under ``prefix``) -> (shape, dtype kind 'act' | 'float32'), checkpoint order."""
    if spec.tp != 1:
        raise CheckpointError("name the unsharded spec's tensors: checkpoints hold every rank's weights")
    H, V, P, A, F32 = spec.hidden_size, spec.vocab_size, prefix, "act", "float32"
    out: Expected = {f"{P}embed_tokens.weight": ((V, H), A)}
    for layer in spec.layers:
        a, f, p = layer.attention, layer.ffn, f"{P}layers.{layer.index}."
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim  # type: ignore[union-attr]
        out.update({f"{p}self_attn.{n}_proj.weight": (shape, A) for n, shape in (
            ("q", (q, H)), ("k", (kv, H)), ("v", (kv, H)), ("o", (H, q)), ("gate", (q, H)))})
        out.update({p + "input_layernorm.weight": ((H,), A), p + "post_attention_residual_gate.gate": ((H,), F32),
                    p + "pre_feedforward_layernorm.weight": ((H,), A)})
        m = f"{p}mlp."
        if isinstance(f, MoESpec):
            E, I, Hm = f.num_experts, f.expert_intermediate, f.latent_dim or H
            out.update({f"{m}gate.weight": ((E, H), F32), f"{m}gate.e_score_correction_bias": ((E,), F32),
                        f"{m}pre_expert_proj.weight": ((Hm, H), A), f"{m}pre_expert_norm.weight": ((Hm,), A),
                        f"{m}experts.gate_up_proj": ((E, 2 * I, Hm), A), f"{m}experts.down_proj": ((E, Hm, I), A),
                        f"{m}experts.post_expert_norm.weight": ((Hm,), A), f"{m}post_expert_proj.weight": ((H, Hm), A)})
        else:
            I = f.intermediate
            out.update({f"{m}gate_proj.weight": ((I, H), A), f"{m}up_proj.weight": ((I, H), A),
                        f"{m}down_proj.weight": ((H, I), A)})
        out.update({p + "post_feedforward_layernorm.weight": ((H,), A),
                    p + "post_feedforward_residual_gate.gate": ((H,), F32)})
    return {**out, f"{P}norm.weight": ((H,), A), "lm_head.weight": ((V, H), A)}


def rename(name: str, old: str, new: str) -> str:
    """``name`` under text prefix ``old`` -> under ``new`` (``lm_head.weight`` keeps its name in every layout)."""
    return name if name == "lm_head.weight" else new + name[len(old):]


def load(directory: str | Path, dtype: torch.dtype | str = torch.bfloat16,
         device: torch.device | str = "cpu") -> tuple[MuseSparkSpec, dict[str, torch.Tensor], dict[str, Any]]:
    """(spec, tensors by canonical name, config.json) of a Muse Spark checkpoint directory (any layout above):
    'act' tensors cast to ``dtype``, 'float32' ones fp32. CheckpointError naming the fix for a missing config.json,
    a missing or misshaped tensor, or text-layer tensors the config does not have."""
    d, dtype = Path(directory), torch_dtype(dtype)
    cfg = read_config(d)
    if cfg is None:
        raise CheckpointError(f"{d}: no config.json: point at a Hugging Face model directory")
    spec = spec_from_config(cfg, where=str(d / "config.json"))
    stored = tensor_files(d)
    prefix = next((p for p in TEXT_PREFIXES if p + "embed_tokens.weight" in stored), None)
    if prefix is None:
        raise CheckpointError(f"{d}: no Muse Spark text tensors: expected one of "
                              f"{', '.join(p + 'embed_tokens.weight' for p in TEXT_PREFIXES)}")
    ck = load_checkpoint(d, expected_tensors(spec, prefix), dtype, device=device)
    if extra := [n for n in ck.unused if n.startswith((prefix + "layers.", prefix + "embed_"))]:
        raise CheckpointError(f"{d}: tensors {extra[:3]} are not in this config's {spec.num_layers}-layer text model: "
                              "the config.json does not match the tensors (layer count, dense/sparse layers?)")
    return spec, {rename(n, prefix, PREFIX): t for n, t in ck.tensors.items()}, cfg


def _init(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    if name.endswith("language_model.norm.weight"):   # plain gain w; the other norms' gains are (1 + w)
        return 1 + 0.1 * x
    for end, scale in ((".gate", 0.5), ("_bias", 0.01), ("norm.weight", 0.1), ("embed_tokens.weight", 1)):
        if name.endswith(end):
            return scale * x
    return x / shape[-1] ** 0.5


def random_weights(spec: MuseSparkSpec, seed: int = 0, dtype: torch.dtype | str = torch.bfloat16,
                   device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Random tensors by canonical name, drawn on the CPU in checkpoint order from one seeded generator: (1 + w)
    norm weights ~ N(0, 0.1), the final norm 1 + N(0, 0.1), residual gates ~ N(0, 0.5), router bias ~ N(0, 0.01),
    embeddings N(0, 1), projections and experts N(0, 1/fan_in)."""
    dtype = torch_dtype(dtype)
    g, fp32 = torch.Generator().manual_seed(seed), torch.float64 if dtype == torch.float64 else torch.float32
    return {n: _init(n, shape, g).to(device=device, dtype=fp32 if kind == "float32" else dtype)
            for n, (shape, kind) in expected_tensors(spec).items()}


def save(directory: str | Path, spec: MuseSparkSpec, named: dict[str, torch.Tensor], dtype: torch.dtype | str =
         torch.bfloat16, *, max_shard_bytes: int | None = None, quant: str | None = None) -> list[Path]:
    """Write ``named`` (canonical names; 'act' tensors in ``dtype``, the fp32 ones fp32, the fused routed experts in
    ``quant`` with ModelOpt's names) and :func:`config_from_spec`'s config.json into ``directory``; the files."""
    dtype, exp = torch_dtype(dtype), expected_tensors(spec)
    if missing := [n for n in exp if n not in named]:
        raise CheckpointError(f"cannot save: tensors {missing[:3]} missing for this spec")
    out = {n: named[n].to(torch.float32 if kind == "float32" else dtype) for n, (_, kind) in exp.items()}
    if quant:
        out = quantize_named(out, quant, select=lambda n: n.endswith(FUSED_EXPERTS))
    return save_checkpoint(directory, out, config_from_spec(spec, dtype), max_shard_bytes=max_shard_bytes)
