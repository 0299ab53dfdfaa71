"""`latency-specialized make-checkpoint MODEL --size tiny DIR`: a random-weight Hugging Face checkpoint.

Writes ``config.json`` (official keys), ``model.safetensors`` (official tensor names) and a small
working tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) into DIR, offline. Adapters
provide ``write_checkpoint(directory, size=, seed=, dtype=, layout=, expert_format=)``.

``--quant mxfp4|nvfp4|fp8-block`` asks for a checkpoint whose quantized weights are stored as the model's
official release stores them (``latency_specialized.quant``: the adapter picks which weights, and for
``fp8-block`` its model's block size). It is passed as ``write_checkpoint(..., quant=...)``; an adapter whose
``write_checkpoint`` takes no ``quant`` - or declares other formats (``checkpoint_quant_formats``, or a
``Literal`` annotation of ``quant``) - is refused with a UserError naming what the model supports: never a
silent bf16 checkpoint.
"""

from __future__ import annotations

import argparse
import errno


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint (config, safetensors, tokenizer)")
    p.add_argument("model", help="adapter name (see `models`)")
    p.add_argument("directory", metavar="DIR", help="output directory (created if missing)")
    p.add_argument("--size", choices=["tiny"], default="tiny", help="architecture variant")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weight dtype")
    p.add_argument("--layout", default=None,
                   help="tensor/config layout (kimi_k3: the published multimodal layout, default; "
                        "kimi_linear: the text model alone)")
    p.add_argument("--experts", default=None, choices=["bf16", "mxfp4"], help="routed-expert storage format")
    p.add_argument("--quant", default=None, choices=QUANT_CHOICES,
                   help="store the weights the model's official release quantizes in that format (official names, "
                        "packing and scales; fp8-block: the model's block size)")
    return p


QUANT_CHOICES = ("mxfp4", "nvfp4", "fp8-block")
"""The ``--quant`` families (``latency_specialized.quant.FORMAT_FAMILIES``)."""


def supported_quant(adapter, write) -> tuple[str, ...]:
    """The ``--quant`` values ``adapter.write_checkpoint`` accepts: empty where it takes no ``quant``;
    else ``adapter.checkpoint_quant_formats``, or the values of a ``Literal`` annotation of ``quant``,
    or (neither declared) every choice."""
    import inspect
    import typing

    try:
        params = inspect.signature(write).parameters
    except (TypeError, ValueError):
        return ()
    if "quant" not in params:
        return ()
    declared = getattr(adapter, "checkpoint_quant_formats", None)
    if declared:
        return tuple(declared)
    try:
        hint = typing.get_type_hints(write).get("quant")
    except Exception:  # noqa: BLE001 - an annotation that does not evaluate: treat as undeclared
        hint = None
    values: list[str] = []
    stack = [hint]
    while stack:  # Literal[...], Optional[Literal[...]], Literal[...] | None
        h = stack.pop()
        if typing.get_origin(h) is typing.Literal:
            values += [v for v in typing.get_args(h) if isinstance(v, str)]
        else:
            stack += list(typing.get_args(h))
    return tuple(values) if values else QUANT_CHOICES


def _check_quant(adapter, write, quant: str) -> None:
    from latency_specialized.errors import UserError

    formats = supported_quant(adapter, write)
    if not formats:
        raise UserError(f"{adapter.name} cannot write --quant {quant} checkpoints: its write_checkpoint takes no "
                        "quant= argument (quantized formats it supports: none; it writes unquantized weights only, "
                        "so drop --quant)")
    if quant not in formats:
        raise UserError(f"{adapter.name} cannot write --quant {quant} checkpoints: use --quant "
                        f"{' or '.join(formats)} (the quantized formats it supports)")


_USER_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EISDIR, errno.ENOTDIR}


def _writable_directory(directory: str) -> None:
    """Create ``directory`` if missing; UserError naming the fix when it is a file or cannot be written."""
    import os
    from pathlib import Path

    from latency_specialized.errors import UserError

    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise UserError(f"{directory} is a file: give make-checkpoint a directory (it writes config.json, "
                        "model.safetensors and the tokenizer into it)")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {directory}: {e.strerror or e}: give make-checkpoint a writable "
                        "directory") from None
    if not os.access(d, os.W_OK | os.X_OK):
        raise UserError(f"cannot write into {directory}: permission denied: give make-checkpoint a writable "
                        "directory")


def run(args: argparse.Namespace) -> int:
    from latency_specialized.errors import UserError
    from latency_specialized.plugins import get_registry

    adapter = get_registry().adapter(args.model)
    write = getattr(adapter, "write_checkpoint", None)
    if write is None or "checkpoint" not in adapter.capabilities:
        raise UserError(f"{adapter.name} cannot write checkpoints (capabilities: {sorted(adapter.capabilities)})")
    kw = {"size": args.size, "seed": args.seed, "dtype": args.dtype}
    if args.layout:
        kw["layout"] = args.layout
    if args.experts:
        kw["expert_format"] = args.experts
    quant = getattr(args, "quant", None)
    if quant:
        _check_quant(adapter, write, quant)   # before the directory is created: a refusal writes nothing
        kw["quant"] = quant
    _writable_directory(args.directory)
    try:
        files = write(args.directory, **kw)
    except OSError as e:  # a full disk, a read-only mount, a checkpoint file that cannot be replaced
        if e.errno not in _USER_ERRNOS:
            raise
        raise UserError(f"cannot write the checkpoint into {args.directory}: {e.strerror or e}: "
                        "give make-checkpoint a writable directory") from None
    total = sum(f.stat().st_size for f in files)
    what = f"{args.size}, seed {args.seed}, {args.dtype}" + (f", {quant}" if quant else "")
    print(f"wrote {adapter.name} ({what}) to {args.directory}: "
          + ", ".join(f.name for f in files) + f" ({total / 2**20:.1f} MiB)")
    return 0
