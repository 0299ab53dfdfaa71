"""`latency-specialized make-checkpoint MODEL --size tiny DIR`: a random-weight Hugging Face checkpoint.

Writes ``config.json`` (official keys), ``model.safetensors`` (official tensor names) and a small
working tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) into DIR, offline. Adapters
provide ``write_checkpoint(directory, size=, seed=, dtype=, layout=, expert_format=)``.
"""

from __future__ import annotations

import argparse


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
    return p


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
    files = write(args.directory, **kw)
    total = sum(f.stat().st_size for f in files)
    print(f"wrote {adapter.name} ({args.size}, seed {args.seed}, {args.dtype}) to {args.directory}: "
          + ", ".join(f.name for f in files) + f" ({total / 2**20:.1f} MiB)")
    return 0
