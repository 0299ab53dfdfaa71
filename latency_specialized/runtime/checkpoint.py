"""Generic checkpoint I/O in the Hugging Face layout: config.json + safetensors (sharded or not).

    files = save_checkpoint(directory, named_tensors, config_json, max_shard_bytes=2**30)
    ck = load_checkpoint(directory, expected, torch.bfloat16)     # expected: name -> (shape, dtype kind)
    ck.tensors[name], ck.config, ck.unused

Any adapter reads its checkpoint through this: its name map (``runtime.composed.expected_tensors``)
says which tensors it needs and of which shape; this module finds them (through
``model.safetensors.index.json`` when present, else every ``*.safetensors`` file), checks them and
casts them. Every problem is a :class:`~latency_specialized.errors.CheckpointError` that names the
file or tensor and the fix: a missing tensor, a wrong shape, a truncated or corrupt file, an index
that points at a missing file.

MXFP4 (the compressed-tensors ``mxfp4-pack-quantized`` format): a weight ``<base>.weight`` may be
stored as ``<base>.weight_packed`` (uint8, two e2m1 codes per byte, low nibble first) and
``<base>.weight_scale`` (uint8 ue8m0 exponents, one per 32 values); it is dequantised on load.
``save_checkpoint(..., quantize=...)`` writes the weights it selects that way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

from latency_specialized.errors import CheckpointError
# The MXFP4 codec and names live in the generic quantized-weights layer; re-exported under the names this
# module has always exported (the same objects).
from latency_specialized.quant.checkpoint_io import (dequantize_stored, mxfp4_names, quantized_from_named, stored_format,
                                                  tensor_names)
from latency_specialized.quant.codecs import E2M1, mxfp4_dequantize, mxfp4_quantize

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

DTypeKind = str
"""'act' (cast to the activation dtype), 'float32' (fp32; fp64 in fp64 runs) or 'keep' (as stored)."""


# ---------------------------------------------------------------------------------------------- write
def save_checkpoint(directory: str | Path, named_tensors: Mapping[str, torch.Tensor],
                    config_json: Mapping[str, Any] | None = None, *, max_shard_bytes: int | None = None,
                    quantize: Callable[[str], bool] | None = None) -> list[Path]:
    """Write ``config.json`` (when given) and the tensors as safetensors into ``directory``.

    ``max_shard_bytes``: split into ``model-0000i-of-0000n.safetensors`` files of at most that many
    bytes each (a tensor larger than that gets a file of its own) plus ``model.safetensors.index.json``;
    default one ``model.safetensors``. ``quantize(name)``: store that ``*.weight`` as MXFP4. Tensors
    that share memory (expert slices of one stacked tensor) are copied. Returns the written files."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    if config_json is not None:
        (d / "config.json").write_text(json.dumps(dict(config_json), indent=2) + "\n")
        files.append(d / "config.json")
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in named_tensors.items():
        t = t.detach().to("cpu").contiguous()
        names = mxfp4_names(name) if quantize is not None and quantize(name) else None
        if names is not None:
            tensors[names[0]], tensors[names[1]] = mxfp4_quantize(t)
            continue
        storage = t.untyped_storage()
        # safetensors refuses tensors that share memory (views of one stacked expert tensor): copy those
        if storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    if max_shard_bytes is None:
        save_file(tensors, str(d / SINGLE), metadata={"format": "pt"})
        return files + [d / SINGLE]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(d / fname), metadata={"format": "pt"})
        files.append(d / fname)
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (d / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return files + [d / INDEX]


# ---------------------------------------------------------------------------------------------- read
@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` read."""

    config: dict[str, Any] | None
    """config.json (None when the directory has none)."""
    tensors: dict[str, torch.Tensor]
    """Every expected tensor, checked and cast (MXFP4 dequantised)."""
    unused: list[str] = field(default_factory=list)
    """Tensors in the checkpoint that were not expected (rotary caches, MTP layers, vision towers ...)."""


def open_safetensors(f: Path) -> Any:
    """``safe_open(f)``; a truncated or corrupt file raises CheckpointError naming it (not SafetensorError)."""
    from safetensors import SafetensorError, safe_open

    if not f.exists():
        raise CheckpointError(f"{f}: missing safetensors file: download or write the checkpoint again")
    try:
        return safe_open(str(f), framework="pt")
    except SafetensorError as e:
        why = " ".join(str(e).split())
        raise CheckpointError(f"{f}: not a readable safetensors file ({why}): the file is truncated or corrupt; "
                              "download or write it again") from None


def read_config(directory: str | Path) -> dict[str, Any] | None:
    """config.json of ``directory`` (None where there is none; CheckpointError for invalid JSON)."""
    path = Path(directory) / "config.json"
    if not path.exists():
        return None
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}): fix or rewrite it") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def tensor_files(directory: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (through the index when present)."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a directory: point at a Hugging Face model directory")
    index = d / INDEX
    if index.exists():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({type(e).__name__}: {e}): regenerate it") from e
        out = {k: d / v for k, v in wm.items()}
        for f in sorted(set(out.values())):
            if not f.exists():
                raise CheckpointError(f"{index} maps tensors to {f.name}, which is missing: download or write the "
                                      "checkpoint again")
        return out
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{d}: no *.safetensors files: point at a Hugging Face model directory")
    out = {}
    for f in files:
        with open_safetensors(f) as h:
            for k in h.keys():
                out[k] = f
    return out


def _cast(name: str, t: torch.Tensor, kind: DTypeKind, dtype: torch.dtype, where: Path) -> torch.Tensor:
    if kind == "keep":
        return t
    if not t.is_floating_point():
        raise CheckpointError(f"{where}: tensor {name} has dtype {t.dtype}, expected a float tensor")
    if kind == "act":
        return t.to(dtype)
    if kind == "float32":
        return t.to(torch.float64 if dtype == torch.float64 else torch.float32)
    raise ValueError(f"dtype kind {kind!r} of {name}: use 'act', 'float32' or 'keep'")


def read_stored(directory: str | Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of a checkpoint directory exactly as stored (no cast, no dequantisation: the
    quantized weights a program keeps as they are); a missing one raises CheckpointError naming it."""
    d = Path(directory)
    files = tensor_files(d)
    handles: dict[Path, Any] = {}
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name not in files:
            raise CheckpointError(f"{d}: missing tensor {name}: the checkpoint does not store it (another format?)")
        f = files[name]
        if f not in handles:
            handles[f] = open_safetensors(f)
        out[name] = handles[f].get_tensor(name)
    return out


def read_quantized(directory: str | Path, names: Mapping[str, str], fmt: str,
                   device: torch.device | str = "cpu") -> dict[str, Any]:
    """``names`` (official ``<base>.weight`` -> its ``<base>.weight`` in the checkpoint, e.g. with a layout prefix)
    read as stored in format ``fmt`` and kept quantized: official name -> ``quant.QuantizedWeight`` on ``device``
    (checked and scales validated by ``quant.quantized_from_named``; nothing dequantised)."""
    roles = {n: tensor_names(ck, fmt) for n, ck in names.items()}
    raw = read_stored(directory, [t for by in roles.values() for t in by.values()])
    official = {tensor_names(n, fmt)[r]: raw[t] for n, by in roles.items() for r, t in by.items()}
    return {n: quantized_from_named(official, n, fmt).to(device) for n in names}


def load_checkpoint(directory: str | Path, expected: Mapping[str, tuple[tuple[int, ...], DTypeKind]],
                    dtype: torch.dtype = torch.bfloat16, *, device: torch.device | str = "cpu",
                    strict: bool = False,
                    adjust: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> LoadedCheckpoint:
    """Read the ``expected`` tensors (name -> (shape, dtype kind)) of a checkpoint directory.

    Each is checked against its shape and cast by its kind (activation ``dtype``, fp32, or kept);
    a ``*.weight`` stored as MXFP4 (``weight_packed`` + ``weight_scale``) is dequantised. Tensors
    not expected are listed in ``unused`` (``strict=True``: a CheckpointError instead).
    ``adjust(name, tensor)``: an adapter's fix-up of a tensor as stored, before its shape check (a
    layout that older checkpoints use, e.g. another shape of the same values)."""
    d = Path(directory)
    config = read_config(d)
    files = tensor_files(d)
    handles: dict[Path, Any] = {}

    def read(name: str) -> torch.Tensor:
        f = files[name]
        if f not in handles:
            handles[f] = open_safetensors(f)
        try:
            return handles[f].get_tensor(name)
        except Exception as e:  # noqa: BLE001 - a corrupt payload: name the file, not a library internal
            raise CheckpointError(f"{f}: tensor {name} cannot be read ({type(e).__name__}: {e}): the file is "
                                  "truncated or corrupt; download or write it again") from None

    tensors: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for name, (shape, kind) in expected.items():
        shape = tuple(shape)
        mx = mxfp4_names(name)
        # a fused parameter (no '.weight') stored quantized: ModelOpt's NVFP4 experts (quant.tensor_names)
        fused = None if name.endswith(".weight") or name not in files else stored_format(name, files)
        if fused is not None:
            parts = [n for n in tensor_names(name, fused).values() if n in files]
            used.update(parts)
            where = files[name]
            t = dequantize_stored({n: read(n) for n in parts}, name, fused, shape)
        elif name in files:
            t = read(name)
            used.add(name)
            where = files[name]
        elif mx is not None and (mx[0] in files or mx[1] in files):
            for part in mx:
                if part not in files:
                    raise CheckpointError(f"{d}: missing tensor {part} (an MXFP4 weight needs both weight_packed and "
                                          "weight_scale): write the checkpoint again")
            q, s = read(mx[0]), read(mx[1])
            used.update(mx)
            where = files[mx[0]]
            want_q, want_s = (*shape[:-1], shape[-1] // 2), (*shape[:-1], shape[-1] // 32)
            if shape[-1] % 32 or tuple(q.shape) != want_q or tuple(s.shape) != want_s \
                    or q.dtype != torch.uint8 or s.dtype != torch.uint8:
                raise CheckpointError(f"{where}: MXFP4 tensors {mx[0]} / {mx[1]} have shapes {list(q.shape)} / "
                                      f"{list(s.shape)} ({q.dtype}, {s.dtype}); expected uint8 {list(want_q)} / "
                                      f"{list(want_s)} for {name} of shape {list(shape)}")
            t = mxfp4_dequantize(q, s, name=mx[1])
        else:
            raise CheckpointError(f"{d}: missing tensor {name} (shape {list(shape)}): the checkpoint does not match "
                                  "this config (another layer count, layout or model?)")
        if adjust is not None:
            t = adjust(name, t)
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{where}: tensor {name} has shape {list(t.shape)}, expected {list(shape)} for this "
                                  "config: the checkpoint was written for another config")
        tensors[name] = _cast(name, t, kind, dtype, where).to(device)
    unused = sorted(set(files) - used)
    if strict and unused:
        raise CheckpointError(f"{d}: unexpected tensors {unused[:4]}{' ...' if len(unused) > 4 else ''}: not part "
                              "of this config (wrong layer count or layout?)")
    return LoadedCheckpoint(config, tensors, unused)


__all__ = ["save_checkpoint", "load_checkpoint", "read_stored", "read_quantized", "LoadedCheckpoint", "read_config", "tensor_files",
           "open_safetensors", "mxfp4_dequantize", "mxfp4_quantize", "mxfp4_names", "E2M1", "INDEX"]
