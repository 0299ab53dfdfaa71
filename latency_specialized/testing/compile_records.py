"""Files of the kernels a GPU run compiled: ``{"triton": [...], "cute": [...]}`` (``testing.triton_specs`` and
``testing.cute_units`` records), JSON, gzip-compressed for a ``.gz`` path. Every list is deduplicated and sorted, so
that a committed file changes only where the kernels did."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Iterable

KINDS = ("triton", "cute")


def merge(parts: Iterable[dict[str, list[dict[str, Any]]]]) -> dict[str, list[dict[str, Any]]]:
    """One record set from several (workers, suite parts), each kind deduplicated and sorted."""
    out: dict[str, dict[str, dict[str, Any]]] = {k: {} for k in KINDS}
    for part in parts:
        for kind in KINDS:
            for r in part.get(kind, ()):
                out[kind].setdefault(json.dumps(r, sort_keys=True), r)
    return {k: [v[key] for key in sorted(v)] for k, v in out.items()}


def save(records: dict[str, list[dict[str, Any]]], path: Path) -> None:
    body = json.dumps(merge([records]), indent=0, sort_keys=True).encode()
    path.write_bytes(gzip.compress(body, mtime=0) if path.suffix == ".gz" else body)


def load(path: Path) -> dict[str, list[dict[str, Any]]]:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return merge([json.loads(raw)])
