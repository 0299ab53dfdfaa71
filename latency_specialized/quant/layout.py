"""Logical-shape operations on a :class:`~latency_specialized.quant.checkpoint_io.QuantizedWeight` that keep it
quantized: TP slices (``narrow``), fused projections (``cat``), expert stacks (``stack``).

A quantized weight ``[..., N, K]`` is stored as codes (``[..., N, K/2]`` packed e2m1, ``[..., N, K]`` e4m3), block
scales ``[..., ceil(N/rows), ceil(K/cols)]`` and, for NVFP4, a per-tensor fp32 global scale ``[...]``. A cut along
a logical dimension is a cut of every stored tensor along the same dimension, scaled to its granularity: a
leading (expert) dimension cuts codes, scales and global scales alike; ``N`` cuts codes row for row and scales by
``block rows``; ``K`` cuts codes by 2 values per byte (packed) and scales by ``block cols``. A cut that is not on a
block boundary would need re-quantization and is refused (a UserError naming the sizes). Nothing is dequantised.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from latency_specialized.errors import UserError
from latency_specialized.quant.checkpoint_io import QuantizedWeight


def _bytes_op(op, ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``op`` (cat / stack / copy) over one-byte tensors through their uint8 view, the result viewed back: torch
    has no kernels for some of the stored dtypes (``float4_e2m1fn_x2``, ``float8_e8m0fnu``) on every device."""
    dt = ts[0].dtype
    if ts[0].element_size() != 1 or dt == torch.uint8:
        return op(list(ts))
    return op([t.view(torch.uint8) for t in ts]).view(dt)


def _units(q: QuantizedWeight, dim: int) -> tuple[int, int]:
    """(logical values per code element, logical values per scale element) along logical ``dim`` (>= 0)."""
    nd = len(q.shape)
    rows, cols = q.fmt.block
    if dim == nd - 1:
        return (2 if q.fmt.packed else 1), cols
    if dim == nd - 2:
        return 1, rows
    return 1, 1


def _dim(q: QuantizedWeight, dim: int) -> int:
    nd = len(q.shape)
    if not -nd <= dim < nd:
        raise UserError(f"{q.name}: dimension {dim} of a {nd}-d quantized weight")
    return dim % nd


def narrow(q: QuantizedWeight, dim: int, start: int, length: int) -> QuantizedWeight:
    """``q[..., start:start + length, ...]`` along logical ``dim`` (a contiguous copy of each stored tensor).
    ``start`` and ``length`` must fall on the format's block boundaries along that dimension."""
    d = _dim(q, dim)
    per_code, per_scale = _units(q, d)
    if start % per_scale or length % per_scale:
        raise UserError(f"{q.name}: a {q.fmt.name} weight {list(q.shape)} cannot be cut at {start}..{start + length} "
                        f"along dimension {d}: its scales cover {per_scale} values there; pick a TP whose slices are "
                        f"multiples of {per_scale}")
    shape = list(q.shape)
    shape[d] = length
    lead = d < len(q.shape) - 2
    cut = {"weight": _bytes_op(lambda ts: ts[0].narrow(d, start // per_code, length // per_code).contiguous(),
                               [q.weight]),
           "scale": _bytes_op(lambda ts: ts[0].narrow(d, start // per_scale, length // per_scale).contiguous(),
                              [q.scale])}
    for k in ("global_scale", "input_scale"):
        t = getattr(q, k)
        if t is not None:
            cut[k] = t.narrow(d, start, length).contiguous() if lead and t.dim() > d else t
    return replace(q, shape=tuple(shape), **cut)


def cut(t: "torch.Tensor | QuantizedWeight", dim: int, start: int, length: int) -> "torch.Tensor | QuantizedWeight":
    """``t`` narrowed along logical ``dim``: a view of a plain tensor, :func:`narrow` of a quantized one (e.g. the
    gate and up halves of a fused expert tensor, whichever way it is kept)."""
    return narrow(t, dim, start, length) if isinstance(t, QuantizedWeight) else t.narrow(dim, start, length)


def row_scaled(q: QuantizedWeight) -> QuantizedWeight:
    """``q`` with one scale per row instead of per ``rows``-row block (each row keeps its block's scale: exact), in
    the derived format ``<name>/rows`` (block ``(1, cols)``): how parts whose row counts end inside a block - a
    partial last block, e.g. DeepSeek's 576-row kv_a next to q_a, or a tiny model's 16-row experts - are joined
    along N. Formats with whole blocks only (e2m1's are one row already) come back unchanged."""
    rows, cols = q.fmt.block
    if rows == 1:
        return q
    if not q.fmt.partial_blocks:
        raise UserError(f"{q.name}: {q.fmt.name} stores whole {rows}-row blocks only; its scales cannot be split "
                        "per row")
    n = q.shape[-2]
    scale = _bytes_op(lambda ts: ts[0].repeat_interleave(rows, dim=-2).narrow(-2, 0, n).contiguous(), [q.scale])
    return replace(q, fmt=replace(q.fmt, name=q.fmt.name + "/rows", block=(1, cols)), scale=scale)


def paired_nibbles(q: QuantizedWeight) -> QuantizedWeight:
    """``q`` (MXFP4 / NVFP4) with its codes rearranged within each 32-bit word for the mma kernels' decode
    (``codecs.pair_codes``: about 25% fewer integer instructions per word), in the derived format ``<name>/pairs``.
    Same bytes, same scales, the same values (``dequantize`` undoes the rearrangement); kernels reading the
    checkpoint packing refuse it by name. Cuts, joins and stacks keep it (they move whole words)."""
    from latency_specialized.quant.codecs import pair_codes

    try:
        fmt = q.fmt.paired()
    except UserError as e:
        raise UserError(f"{q.name}: {e}") from None
    return replace(q, fmt=fmt, weight=pair_codes(q.weight))


def checkpoint_nibbles(q: QuantizedWeight) -> QuantizedWeight:
    """``q`` as checkpoints pack it: the inverse of :func:`paired_nibbles` (a copy), ``q`` itself if it is not
    paired - for a consumer that reads only the checkpoint packing (a peer library's kernels)."""
    from latency_specialized.quant.codecs import unpair_codes

    if q.fmt.packing != "paired":
        return q
    return replace(q, fmt=q.fmt.checkpoint_packing(), weight=unpair_codes(q.weight))


def take_rows(q: QuantizedWeight, index: torch.Tensor) -> QuantizedWeight:
    """Rows ``index`` of a ``[N, K]`` weight, in that order (e.g. a permutation of each head's channels): with one
    scale per row (:func:`row_scaled`: exact) unless every index stays inside whole blocks kept in order."""
    rows = q.fmt.block[0]
    if rows > 1:
        blocks = index.reshape(-1, rows) if index.numel() % rows == 0 else None
        whole = blocks is not None and bool((blocks[:, 0] % rows == 0).all()) and \
            bool((blocks - blocks[:, :1] == torch.arange(rows, device=index.device)).all())
        if not whole or q.shape[-2] % rows:
            q = row_scaled(q)
        else:   # block-aligned: move whole blocks, their scales with them
            pick = {"weight": _bytes_op(lambda ts: ts[0].index_select(-2, index).contiguous(), [q.weight]),
                    "scale": _bytes_op(lambda ts: ts[0].index_select(-2, blocks[:, 0] // rows).contiguous(), [q.scale])}
            return replace(q, shape=(*q.shape[:-2], index.numel(), q.shape[-1]), **pick)
    pick = {k: _bytes_op(lambda ts: ts[0].index_select(-2, index).contiguous(), [getattr(q, k)])
            for k in ("weight", "scale")}
    return replace(q, shape=(*q.shape[:-2], index.numel(), q.shape[-1]), **pick)


def cat(parts: Sequence[QuantizedWeight], dim: int) -> QuantizedWeight:
    """The parts joined along logical ``dim`` (e.g. gate | up rows of every expert: ``dim=1`` of ``[E, I, K]``).
    Parts share the format, the other dimensions and - when joined along ``N`` or ``K`` - their global scales
    (one multiplier per tensor; NVFP4 gate and up projections with different ``weight_scale_2`` are refused).
    Along N, parts whose rows end inside a scale block, or already scaled per row, are joined with one scale per row
    (:func:`row_scaled`: exact; formats with partial blocks)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    d = _dim(first, dim)
    rows = max(p.fmt.block[0] for p in parts)
    # a part already row-scaled (``take_rows``), or one ending inside a block: every part one scale per row
    if d == len(first.shape) - 2 and rows > 1 and first.fmt.partial_blocks \
            and (any(p.shape[d] % rows for p in parts[:-1]) or any(p.fmt.block[0] != rows for p in parts)):
        parts = [row_scaled(p) for p in parts]
        first = parts[0]
    for p in parts[1:]:
        if p.fmt != first.fmt or len(p.shape) != len(first.shape) or \
                any(p.shape[i] != first.shape[i] for i in range(len(first.shape)) if i != d):
            raise UserError(f"cannot join {p.name} {p.fmt.name} {list(p.shape)} to {first.name} {first.fmt.name} "
                            f"{list(first.shape)} along dimension {d}")
    per_code, per_scale = _units(first, d)
    for p in parts[:-1]:
        if p.shape[d] % per_scale:
            raise UserError(f"{p.name}: {p.shape[d]} values along dimension {d} end inside a {per_scale}-value scale "
                            "block: the join would need re-quantization")
    lead = d < len(first.shape) - 2
    out = {"weight": _bytes_op(lambda ts: torch.cat(ts, dim=d), [p.weight for p in parts]),
           "scale": _bytes_op(lambda ts: torch.cat(ts, dim=d), [p.scale for p in parts])}
    for k in ("global_scale", "input_scale"):
        ts = [getattr(p, k) for p in parts]
        if ts[0] is None:
            continue
        if lead:
            out[k] = torch.cat(ts, dim=d)
        elif k == "global_scale" and any(not torch.equal(t, ts[0]) for t in ts[1:]):
            raise UserError(f"{first.name}: joining {first.fmt.name} weights with different global scales "
                            f"({k}) along dimension {d} needs one multiplier per part; the kernels take one per "
                            "tensor (vLLM uses the first part's and warns): re-export with a shared global scale")
        else:
            out[k] = ts[0]
    shape = list(first.shape)
    shape[d] = sum(p.shape[d] for p in parts)
    return replace(first, shape=tuple(shape), **out)


def stack(parts: Sequence[QuantizedWeight], name: str | None = None) -> QuantizedWeight:
    """``[len(parts), ...]`` of same-shaped, same-format weights (the experts of one layer)."""
    first = parts[0]
    for p in parts[1:]:
        if p.fmt != first.fmt or p.shape != first.shape:
            raise UserError(f"cannot stack {p.name} {p.fmt.name} {list(p.shape)} with {first.name} "
                            f"{first.fmt.name} {list(first.shape)}: experts of one layer share format and shape")
    out = {"weight": _bytes_op(torch.stack, [p.weight for p in parts]),
           "scale": _bytes_op(torch.stack, [p.scale for p in parts])}
    for k in ("global_scale", "input_scale"):
        ts = [getattr(p, k) for p in parts]
        if ts[0] is not None:
            out[k] = torch.stack([t.reshape(()) if t.numel() == 1 and t.dim() <= 1 else t for t in ts])
    return replace(first, shape=(len(parts), *first.shape), name=name or first.name, **out)


__all__ = ["narrow", "cat", "stack", "row_scaled", "cut", "take_rows", "paired_nibbles"]
