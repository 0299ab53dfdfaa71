"""Kimi K3 checkpoints (config.json + safetensors) over the generic ``runtime/checkpoint.py``: Kimi's layout.

Tensor names are the official ones (``composed.tensor_name_for``); the ``kimi_k3`` layout (multimodal)
prefixes them with ``language_model.`` (vLLM also accepts ``language_model.layers.``); vision-tower and
projector tensors, MTP layers past ``num_hidden_layers`` and rotary caches are ignored. Routed experts
may be stored as MXFP4 (``w1.weight_packed`` + ``w1.weight_scale``: the generic codec), dequantised on
load; older checkpoints' ``A_log`` ``(1, 1, H, 1)`` and conv taps ``[C, W]`` are accepted, as by vLLM.
Every problem raises :class:`CheckpointError` naming the file, tensor or config key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from latency_specialized.errors import CheckpointError
from latency_specialized.runtime import checkpoint as generic
from latency_specialized.runtime.checkpoint import mxfp4_dequantize, mxfp4_quantize  # noqa: F401 - the codec Kimi uses
from latency_specialized.runtime.tokenizer import load_tokenizer

from latency_specialized_models.kimi_k3.composed import expected_tensors
from latency_specialized_models.kimi_k3.config import config_from_spec, spec_from_config
from latency_specialized_models.kimi_k3.spec import KimiK3Spec
from latency_specialized_models.kimi_k3.tokenizer import save_tokenizer

PREFIX = "language_model."
_IGNORED_K3 = ("vision_tower.", "mm_projector.")
_EXPERT = re.compile(r"^.*\.experts\.\d+\.w[123]\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def is_routed_expert(name: str) -> bool:
    """A routed expert's ``w1`` / ``w2`` / ``w3`` weight (what the release stores as MXFP4)."""
    return bool(_EXPERT.match(name))


def save_checkpoint(directory: str | Path, spec: KimiK3Spec, weights: dict[str, torch.Tensor], *,
                    layout: str = "kimi_k3", tokenizer: Any = None, bos_token_id: int = 1, eos_token_id: int = 2,
                    pad_token_id: int = 0) -> list[Path]:
    """Write config.json, model.safetensors (and the tokenizer files) into ``directory``; routed experts as
    MXFP4 when ``spec.routed_expert_format == "mxfp4"``. Returns the written files."""
    dtype = weights["model.embed_tokens.weight"].dtype
    cfg = config_from_spec(spec, layout=layout, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                           pad_token_id=pad_token_id, torch_dtype=str(dtype).removeprefix("torch."))
    pre = PREFIX if layout == "kimi_k3" else ""
    mxfp4 = spec.routed_expert_format == "mxfp4"
    files = generic.save_checkpoint(directory, {pre + n: weights[n] for n in expected_tensors(spec)}, cfg,
                                    quantize=lambda name: mxfp4 and is_routed_expert(name))
    if tokenizer is not None:
        files += save_tokenizer(tokenizer, Path(directory), max_length=spec.max_context)
    return files


@dataclass
class LoadedCheckpoint:
    """What a checkpoint directory holds, validated."""

    spec: KimiK3Spec
    weights: dict[str, torch.Tensor]
    """Official name -> tensor."""
    layout: str
    tokenizer: Any = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    ignored: list[str] = field(default_factory=list)
    """Tensors present but not used (vision tower, MTP layers)."""
    kept: dict[str, Any] = field(default_factory=dict)
    """With ``keep_experts``: official name -> ``QuantizedWeight`` of every routed expert weight, as stored."""


def _legacy_shapes(name: str, t: torch.Tensor) -> torch.Tensor:
    if name.endswith("A_log") and t.dim() == 4:
        return t.reshape(-1)   # (1, 1, H, 1), as vLLM's loader accepts
    if name.endswith("_conv1d.weight") and t.dim() == 2:
        return t.unsqueeze(1)  # [C, W] (vLLM's fused conv loader does the same)
    return t


def load_checkpoint(directory: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str = "cpu", keep_experts: bool = False) -> LoadedCheckpoint:
    """Validate and load a Kimi K3 checkpoint directory (either layout) in activation dtype ``dtype``.
    ``keep_experts``: also the MXFP4 routed experts exactly as stored (``LoadedCheckpoint.kept``; the
    ``weights`` keep their dequantised values for the reference)."""
    d = Path(directory)
    cfg = generic.read_config(d)
    if cfg is None:
        raise CheckpointError(f"{d}: no config.json: point --checkpoint at a Hugging Face model directory")
    spec, extras = spec_from_config(cfg, where=str(d / "config.json"))
    layout = extras["layout"]
    expected = expected_tensors(spec)
    # official (text-root) name -> its name in the checkpoint (MXFP4: without the _packed / _scale suffix);
    # what is not this config's is ignored or refused here, before any tensor is read
    stored: dict[str, str] = {}
    ignored: list[str] = []
    for ck in generic.tensor_files(d):
        name = ck
        if layout == "kimi_k3":
            if ck.startswith(_IGNORED_K3):
                ignored.append(ck)
                continue
            if not ck.startswith(PREFIX):
                raise CheckpointError(f"{d}: tensor {ck} lacks the {PREFIX!r} prefix of the kimi_k3 layout")
            name = ck[len(PREFIX):]
            name = "model." + name if name.startswith("layers.") else name
        m = _LAYER.match(name)
        if (m and int(m.group(1)) >= spec.num_layers) or "rotary_emb." in name:
            ignored.append(ck)  # MTP / speculative layers, rotary caches
            continue
        cut = next((len(s) for s in ("_packed", "_scale") if name.endswith(".weight" + s)), 0)
        if name[:len(name) - cut] not in expected:
            raise CheckpointError(f"{d}: unexpected tensor {ck}: not part of this Kimi K3 config "
                                  "(wrong layer count or layout?)")
        stored[name[:len(name) - cut]] = ck[:len(ck) - cut]
    pre = PREFIX if layout == "kimi_k3" else ""
    names = {n: stored.get(n, pre + n) for n in expected}  # a missing one is named with the layout's prefix
    loaded = generic.load_checkpoint(d, {names[n]: expected[n] for n in expected}, dtype, device=device,
                                     adjust=_legacy_shapes)
    weights = {n: loaded.tensors[names[n]] for n in expected}
    tok = load_tokenizer(d)  # the generic reader
    if tok is not None and tok.get_vocab_size() > spec.vocab_size:
        raise CheckpointError(f"{d}: tokenizer has {tok.get_vocab_size()} ids but config vocab_size is "
                              f"{spec.vocab_size}: they must agree")
    kept = _stored_experts(d, spec, names, device) if keep_experts else {}
    return LoadedCheckpoint(spec, weights, layout, tok, extras.get("bos_token_id"), extras.get("eos_token_id"), ignored,
                            kept)


def _stored_experts(d: Path, spec: KimiK3Spec, names: dict[str, str], device: torch.device | str) -> dict[str, Any]:
    """Official name -> QuantizedWeight (on ``device``) of every routed expert weight, read as stored."""
    experts = [n for n in names if is_routed_expert(n)]
    if spec.routed_expert_format != "mxfp4" or not experts:
        raise CheckpointError(f"{d}: routed experts stored as {spec.routed_expert_format}, not MXFP4: there is "
                              "nothing to keep quantized; drop --experts (they load as bf16)")
    return generic.read_quantized(d, {n: names[n] for n in experts}, "mxfp4", device)
