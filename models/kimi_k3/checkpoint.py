"""Read and write Kimi K3 checkpoints in the Hugging Face layout (config.json + safetensors).

Tensor names are the official ones (weights.py). The ``kimi_k3`` layout prefixes them with
``language_model.`` (vLLM also accepts ``language_model.layers.`` for ``language_model.model.layers.``);
vision-tower and projector tensors are ignored (no vision in this adapter), as are MTP layers past
``num_hidden_layers``. Routed experts may be stored as MXFP4 (``w1.weight_packed`` uint8 with two
e2m1 values per byte, low nibble first, and ``w1.weight_scale`` uint8 ue8m0 exponents per 32
values - the compressed-tensors ``mxfp4-pack-quantized`` format); they are dequantised on load.

Every problem raises :class:`CheckpointError` naming the file, tensor or config key.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from latency_specialized.errors import CheckpointError
from latency_specialized.runtime.checkpoint import mxfp4_dequantize, mxfp4_quantize  # the generic MXFP4 codec

from latency_specialized_models.kimi_k3.config import config_from_spec, spec_from_config
from latency_specialized_models.kimi_k3.spec import KimiK3Spec
from latency_specialized_models.kimi_k3.weights import expected_tensors, storage_dtype

PREFIX = "language_model."
_IGNORED_K3 = ("vision_tower.", "mm_projector.")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123])\.weight_(packed|scale)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


# ---------------------------------------------------------------------------------------------- write
def save_checkpoint(directory: str | Path, spec: KimiK3Spec, weights: dict[str, torch.Tensor], *,
                    layout: str = "kimi_k3", tokenizer: Any = None, bos_token_id: int = 1, eos_token_id: int = 2,
                    pad_token_id: int = 0) -> list[Path]:
    """Write config.json, model.safetensors (and the tokenizer files) into ``directory``.

    Routed experts are written as MXFP4 when ``spec.routed_expert_format == "mxfp4"``, else as
    ``.weight`` in the weights' dtype. Returns the written files.
    """
    from safetensors.torch import save_file

    from latency_specialized_models.kimi_k3.tokenizer import save_tokenizer

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    dtype = weights["model.embed_tokens.weight"].dtype
    cfg = config_from_spec(spec, layout=layout, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                           pad_token_id=pad_token_id, torch_dtype=str(dtype).removeprefix("torch."))
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    pre = PREFIX if layout == "kimi_k3" else ""
    tensors: dict[str, torch.Tensor] = {}
    for name in expected_tensors(spec):
        t = weights[name].detach().to("cpu").contiguous()
        m = re.match(r"^(.*\.experts\.\d+\.w[123])\.weight$", name)
        if m and spec.routed_expert_format == "mxfp4":
            packed, scale = mxfp4_quantize(t)
            tensors[pre + m.group(1) + ".weight_packed"] = packed
            tensors[pre + m.group(1) + ".weight_scale"] = scale
        else:
            tensors[pre + name] = t
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    files = [d / "config.json", d / "model.safetensors"]
    if tokenizer is not None:
        files += save_tokenizer(tokenizer, d, max_length=spec.max_context)
    return files


# ---------------------------------------------------------------------------------------------- read
@dataclass
class LoadedCheckpoint:
    """What a checkpoint directory holds, validated."""

    spec: KimiK3Spec
    weights: dict[str, torch.Tensor]
    layout: str
    tokenizer: Any = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    ignored: list[str] = field(default_factory=list)
    """Tensors present but not used (vision tower, MTP layers)."""


def _tensor_files(d: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file (through model.safetensors.index.json when present)."""
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e}): regenerate it") from e
        return {k: d / v for k, v in wm.items()}
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{d}: no *.safetensors files: point at a Hugging Face model directory")
    out: dict[str, Path] = {}
    for f in files:
        with _open_safetensors(f) as h:
            for k in h.keys():
                out[k] = f
    return out


def _open_safetensors(f: Path) -> Any:
    """``safe_open(f)``; a truncated or corrupt file raises CheckpointError naming it (not SafetensorError)."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(f), framework="pt")
    except SafetensorError as e:
        why = " ".join(str(e).split())  # one line
        raise CheckpointError(f"{f}: not a readable safetensors file ({why}): the file is truncated or corrupt; "
                              "download or write it again") from None


def load_checkpoint(directory: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str = "cpu") -> LoadedCheckpoint:
    """Validate and load a Kimi K3 checkpoint directory (either layout) in activation dtype ``dtype``."""
    from latency_specialized_models.kimi_k3.tokenizer import load_tokenizer

    d = Path(directory)
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{d}: no config.json: point --checkpoint at a Hugging Face model directory")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from e
    spec, extras = spec_from_config(cfg, where=str(cfg_path))
    layout = extras["layout"]
    expected = expected_tensors(spec)
    files = _tensor_files(d)

    # official (text-root) name -> checkpoint name(s)
    found: dict[str, str] = {}
    packed: dict[str, dict[str, str]] = {}
    ignored: list[str] = []
    for ck in files:
        name = ck
        if layout == "kimi_k3":
            if ck.startswith(_IGNORED_K3):
                ignored.append(ck)
                continue
            if not ck.startswith(PREFIX):
                raise CheckpointError(f"{d}: tensor {ck} lacks the {PREFIX!r} prefix of the kimi_k3 layout")
            name = ck[len(PREFIX):]
            if name.startswith("layers."):
                name = "model." + name
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= spec.num_layers:
            ignored.append(ck)  # MTP / speculative layers
            continue
        if "rotary_emb." in name:
            ignored.append(ck)
            continue
        pm = _EXPERT.match(name)
        if pm:
            packed.setdefault(pm.group(1) + ".weight", {})[pm.group(2)] = ck
            continue
        if name not in expected:
            raise CheckpointError(f"{d}: unexpected tensor {ck}: not part of this Kimi K3 config "
                                  "(wrong layer count or layout?)")
        found[name] = ck
    weights: dict[str, torch.Tensor] = {}
    handles: dict[Path, Any] = {}

    def read(ck: str) -> torch.Tensor:
        f = files[ck]
        if f not in handles:
            if not f.exists():
                raise CheckpointError(f"{d}: tensor {ck} maps to missing file {f.name}")
            handles[f] = _open_safetensors(f)
        return handles[f].get_tensor(ck)

    pre = PREFIX if layout == "kimi_k3" else ""
    for name, ts in expected.items():
        if name in found:
            t = read(found[name])
        elif name in packed:
            parts = packed[name]
            for part in ("packed", "scale"):
                if part not in parts:
                    raise CheckpointError(f"{d}: missing tensor {pre + name[:-len('.weight')]}.weight_{part} "
                                          "(MXFP4 experts need both weight_packed and weight_scale)")
            q, s = read(parts["packed"]), read(parts["scale"])
            exp_q, exp_s = (ts.shape[0], ts.shape[1] // 2), (ts.shape[0], ts.shape[1] // 32)
            if tuple(q.shape) != exp_q or tuple(s.shape) != exp_s or q.dtype != torch.uint8 or s.dtype != torch.uint8:
                raise CheckpointError(f"{d}: tensor {parts['packed']} / {parts['scale']} have shapes "
                                      f"{list(q.shape)} / {list(s.shape)} ({q.dtype}, {s.dtype}); expected uint8 "
                                      f"{list(exp_q)} / {list(exp_s)}")
            t = mxfp4_dequantize(q, s)
        else:
            raise CheckpointError(f"{d}: missing tensor {pre + name}")
        if ts.shape == (ts.shape[0],) and name.endswith("A_log") and t.dim() == 4:
            t = t.reshape(-1)  # older checkpoints store A_log as (1, 1, H, 1), as vLLM's loader accepts
        if name.endswith("_conv1d.weight") and t.dim() == 2:
            t = t.unsqueeze(1)  # [C, W] is accepted too (vLLM's fused conv loader does the same)
        if tuple(t.shape) != ts.shape:
            raise CheckpointError(f"{d}: tensor {pre + name} has shape {list(t.shape)}, expected {list(ts.shape)} "
                                  "for this config")
        if not (t.is_floating_point()):
            raise CheckpointError(f"{d}: tensor {pre + name} has dtype {t.dtype}, expected a float tensor")
        weights[name] = t.to(device=device, dtype=storage_dtype(ts, dtype))
    tok = load_tokenizer(d)
    if tok is not None and tok.get_vocab_size() > spec.vocab_size:
        raise CheckpointError(f"{d}: tokenizer has {tok.get_vocab_size()} ids but config vocab_size is "
                              f"{spec.vocab_size}: they must agree")
    return LoadedCheckpoint(spec, weights, layout, tok, extras.get("bos_token_id"), extras.get("eos_token_id"), ignored)
