"""Synthetic histories: long-context matrix cells (32K / 128K tokens) without a long prefill.

A real prefill of 128K tokens is far too slow for the CPU run, and what a long-context cell checks is the
decode step over a long cache (page tables of ~32K entries, split reductions over 128K keys, long indexer
top-k), not the prefill. So a sequence's history is *synthetic*: every state of positions ``0..length-1``
(paged KV / MLA latents / indexer keys: those positions of its pages; per-row states - KDA recurrent and conv
states, windowed rings, pending compressor rows - its whole row) is drawn at random, at the scale its state
has after a short real prefill (:func:`state_scales`), and the decode steps start at position ``length``.

The reference and the program read the same states (the program's are ``runtime.states.shard_states`` of the
reference's), so one fill seeds both identically. A reference that keeps history beyond its ``ModelStates``
(DeepSeek-V4.1-Flash: raw rows and compressor inputs, re-pooled on every read) seeds it itself: it has a
``seed_history(states, slot, length, generator)`` method (:func:`seed_history` uses it); the generic fill
refuses states of a ``ModelStates`` subclass, naming that method.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from latency_specialized.errors import UserError
from latency_specialized.runtime.states import ModelStates, SeqSlot

SCALE_TOKENS = 16
"""Tokens of the short real prefill the states' scales are measured on."""


def _flat_positions(slot: SeqSlot, block_size: int, length: int, device: torch.device) -> torch.Tensor:
    """Cache row (``view(-1, ...)`` of a paged tensor) of each position ``0..length-1`` of ``slot``."""
    at = torch.arange(length, device=device)
    return torch.tensor(slot.blocks, dtype=torch.long, device=device)[at // block_size] * block_size + at % block_size


@functools.lru_cache(maxsize=8)
def _scales(ref: Any) -> dict[tuple[int, str], float]:
    st = ref.new_cache(1, SCALE_TOKENS, block_size=4)
    slot = st.slots[0]
    ids = torch.randint(3, ref.spec.vocab_size, (SCALE_TOKENS,), generator=torch.Generator().manual_seed(7))
    ref.prefill(st, slot, 0, ids)
    out: dict[tuple[int, str], float] = {}
    for layer, by_name in st.decls.items():
        for name, d in by_name.items():
            t = st.by_layer[layer][name]
            if d.kind == "paged":
                v = t.view(-1, *t.shape[2:])[_flat_positions(slot, st.block_size, SCALE_TOKENS, t.device)]
            else:
                v = t[slot.row]
            s = float(v.double().std()) if v.numel() > 1 else 0.0
            out[(layer, name)] = s if s > 0 and s == s and s != float("inf") else 1.0
    return out


def state_scales(ref: Any) -> dict[tuple[int, str], float]:
    """(layer, state) -> std of that state after a real prefill of ``SCALE_TOKENS`` tokens (1.0 where it stays
    zero): the scale a synthetic history is drawn at (memoised per reference)."""
    return _scales(ref)


def seed_states(ref: Any, states: ModelStates, slot: SeqSlot, length: int, generator: torch.Generator) -> None:
    """The generic synthetic history: ``slot``'s states of positions ``0..length-1`` (paged) and its rows drawn
    from N(0, scale^2) (``state_scales``). For references whose whole decode state is their ``ModelStates``."""
    if type(states) is not ModelStates:
        raise UserError(f"{ref.spec.name}: its reference keeps states of type {type(states).__name__}, more than "
                        "ModelStates, which a generic synthetic history cannot fill consistently: give the "
                        "reference a seed_history(states, slot, length, generator) method")
    if length > len(slot.blocks) * (states.block_size or 0) and any(
            d.kind == "paged" for by in states.decls.values() for d in by.values()):
        raise UserError(f"a history of {length} tokens: more than the slot's {len(slot.blocks)} blocks of "
                        f"{states.block_size} hold; allocate the states for the context")
    scales = state_scales(ref)
    dev = states.device
    flat = _flat_positions(slot, states.block_size or 1, length, dev) if states.block_size else None
    for layer, by_name in states.decls.items():
        for name, d in by_name.items():
            t, s = states.by_layer[layer][name], scales.get((layer, name), 1.0)
            if d.kind == "paged":
                rows = t.view(-1, *t.shape[2:])
                rows[flat] = (torch.randn(length, *t.shape[2:], generator=generator, dtype=torch.float32,
                                          device=dev) * s).to(t.dtype)
            else:
                t[slot.row] = (torch.randn(*t.shape[1:], generator=generator, dtype=torch.float32, device=dev)
                               * s).to(t.dtype)


def seed_history(ref: Any, states: ModelStates, slot: SeqSlot, length: int, generator: torch.Generator) -> None:
    """``slot`` of the reference's ``states`` (``ref.new_cache``) holds a synthetic history of ``length`` tokens,
    so its decode continues at position ``length``: the reference's own ``seed_history`` where it keeps history
    beyond its states, else :func:`seed_states`."""
    if hasattr(ref, "seed_history"):
        ref.seed_history(states, slot, length, generator)
    else:
        seed_states(ref, states, slot, length, generator)


def history_lengths(context: int, batch: int, prototypes: int = 4) -> list[int]:
    """Lengths of a long cell's sequences: ``context - k (k + 1) / 2`` for ``k = b % prototypes`` (the short
    cells' spread: context, -1, -3, -6), so a batch mixes lengths and page offsets."""
    return [context - k * (k + 1) // 2 for k in (b % prototypes for b in range(batch))]


def long_states(ref: Any, context: int, batch: int, max_len: int, seed: int, *,
                block_size: int = 4) -> tuple[ModelStates, list[int]]:
    """(states, lengths): ``batch`` sequences of up to ``max_len`` tokens (shuffled pages), sequence ``b`` with a
    synthetic history of ``history_lengths(context, batch)[b]`` tokens (:func:`seed_history`; seeded per
    sequence on the states' device, so every rank of a TP group builds the same states)."""
    lens = history_lengths(context, batch)
    states = ref.new_cache(batch, max_len, block_size=block_size, shuffle_seed=seed)
    for b, (slot, n) in enumerate(zip(states.slots, lens)):
        g = torch.Generator(device=states.device).manual_seed(seed * 1000 + b)
        seed_history(ref, states, slot, n, g)
    return states, lens


def states_bytes(states: Any) -> int:
    """Bytes of every tensor a states object holds (its ModelStates tensors and, for a reference's subclass,
    tensors among its other attributes: DeepSeek's per-sequence history)."""
    seen: set[int] = set()

    def walk(x: Any) -> int:
        if isinstance(x, torch.Tensor):
            key = x.untyped_storage().data_ptr()
            if key in seen:
                return 0
            seen.add(key)
            return x.untyped_storage().nbytes()
        if isinstance(x, dict):
            return sum(walk(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(walk(v) for v in x)
        if hasattr(x, "__dict__") and not isinstance(x, type):
            return sum(walk(v) for v in vars(x).values())
        return 0

    return walk(states.tensors()) + sum(walk(v) for k, v in vars(states).items() if k not in ("by_layer", "decls"))


__all__ = ["seed_states", "state_scales", "history_lengths", "long_states", "states_bytes", "SCALE_TOKENS"]
