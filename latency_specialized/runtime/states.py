"""Caches and recurrent states of a composed model: allocated from the pieces' ``StateDecl``s.

    states = ModelStates.allocate(model, num_seqs=4, max_len=64, tp=1, block_size=16, dtype=torch.bfloat16,
                                  shuffle_seed=0)         # standalone: one slot per sequence
    states = ModelStates.external(model, {layer: {"k": k_cache, "v": v_cache}}, tp=tp)   # vLLM's own tensors
    rank_states = shard_states(model, states, rank, tp)   # a rank's copy of full (TP=1) states (a prefilled cache)

Layout per layer and state (``runtime/pieces_api.StateDecl``; shapes are this rank's):

* ``paged``: ``[num_blocks, block_size, *shape]`` addressed through block tables and slot mappings.
  Blocks come from a :class:`BlockAllocator`, in a shuffled order when asked (tests then exercise
  real paging rather than one contiguous range);
* ``rows``: ``[num_rows, *shape]``, one row per sequence; row 0 is the scratch row that padded batch
  rows read and write (``BufferSpec.pad_state``), so sequences get rows >= 1.

dtype ``act`` is the activation dtype, ``float32`` fp32 (fp64 in fp64 runs). Fresh states are zero
(vLLM starts recurrent states from zero). Every rank allocates its own shard: the pieces declare
per-rank shapes (``states(spec, tp)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Protocol, Sequence

import torch

from latency_specialized.errors import UserError
from latency_specialized.runtime.pieces_api import StateDecl
from latency_specialized.spec import ModelSpec


class ModelWithStates(Protocol):
    """What this module reads of a composed model (``runtime.composed.ComposedModel``). A protocol, not an
    import: composed.py imports this module, and an import back (even for annotations) is a cycle."""

    spec: ModelSpec

    def state_decls(self, tp: int = 1) -> Mapping[int, Mapping[str, Sequence[StateDecl]]]: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class SeqSlot:
    """Where one sequence keeps its state."""

    row: int
    """Row of the 'rows' states (>= 1; row 0 is padding scratch)."""
    blocks: tuple[int, ...]
    """KV blocks in order (capacity = len(blocks) * block_size tokens)."""


class BlockAllocator:
    """Hands out KV-cache block ids (optionally in a seeded random order) and takes them back."""

    def __init__(self, num_blocks: int, *, shuffle_seed: int | None = None):
        if num_blocks < 0:
            raise UserError(f"a block allocator of {num_blocks} blocks: use >= 0")
        order = list(range(num_blocks))
        if shuffle_seed is not None:
            order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
        self.num_blocks = num_blocks
        self._free = order

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> tuple[int, ...]:
        """``n`` free block ids (UserError naming the fix when fewer are left)."""
        if n > len(self._free):
            raise UserError(f"KV cache full: {n} blocks asked, {len(self._free)} of {self.num_blocks} free; "
                            "allocate the states with more blocks (num_blocks=) or free finished sequences")
        out, self._free = tuple(self._free[:n]), self._free[n:]
        return out

    def free(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        taken = set(self._free)
        bad = [b for b in blocks if not 0 <= b < self.num_blocks or b in taken]
        if bad:
            raise UserError(f"free of blocks {bad[:4]} that are not allocated (double free?)")
        self._free.extend(blocks)


def state_dtype(decl: StateDecl, dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of a declared state for activation dtype ``dtype``."""
    if decl.dtype == "act":
        return dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def flat_state_decls(model: "ModelWithStates", tp: int) -> dict[int, dict[str, StateDecl]]:
    """{layer: {state name: StateDecl}} of every layer with a state (names unique within a layer)."""
    out: dict[int, dict[str, StateDecl]] = {}
    for layer, by_role in model.state_decls(tp).items():
        flat: dict[str, StateDecl] = {}
        for role, decls in by_role.items():
            for d in decls:
                if d.name in flat:
                    raise UserError(f"layer {layer}: two pieces declare the state {d.name!r}; give them distinct names")
                flat[d.name] = d
        if flat:
            out[layer] = flat
    return out


class ModelStates:
    """Per-layer decode state of a composed model (see the module docstring).

    Use :meth:`allocate` (standalone) or :meth:`external` (given tensors, e.g. vLLM's caches).
    """

    def __init__(self, tensors: Mapping[int, Mapping[str, torch.Tensor]], decls: Mapping[int, Mapping[str, StateDecl]],
                 *, block_size: int | None, slots: Sequence[SeqSlot] = (), allocator: BlockAllocator | None = None,
                 tp: int = 1):
        self.by_layer: dict[int, dict[str, torch.Tensor]] = {i: dict(t) for i, t in tensors.items()}
        """layer -> state name -> tensor."""
        self.decls = {i: dict(d) for i, d in decls.items()}
        self.block_size = block_size
        """Tokens per KV block (None: no paged state)."""
        self.slots: list[SeqSlot] = list(slots)
        """Sequences allocated here (standalone), in order."""
        self.allocator = allocator
        self.tp = tp

    # ------------------------------------------------------------------ construction
    @classmethod
    def allocate(cls, model: "ModelWithStates", num_seqs: int, max_len: int, *, tp: int = 1, block_size: int = 16,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 shuffle_seed: int | None = None, num_blocks: int | None = None,
                 num_rows: int | None = None) -> "ModelStates":
        """Zero state for ``num_seqs`` sequences of up to ``max_len`` tokens each (this rank's shard at ``tp``).

        ``num_blocks`` (default: exactly what the sequences need) and ``num_rows`` (default
        ``num_seqs + 1``) size the pool; ``shuffle_seed`` hands the blocks out in a random order.
        """
        if num_seqs < 0 or max_len < 1 or block_size < 1:
            raise UserError(f"states need >= 0 sequences, a length and a block size >= 1 "
                            f"(got {num_seqs}, {max_len}, {block_size})")
        if max_len > model.spec.max_context:
            raise UserError(f"max_len {max_len} beyond the model context {model.spec.max_context}: ask for fewer tokens")
        per_seq = cdiv(max_len, block_size)
        blocks = num_seqs * per_seq if num_blocks is None else num_blocks
        rows = num_seqs + 1 if num_rows is None else num_rows
        if rows < num_seqs + 1:
            raise UserError(f"{rows} state rows for {num_seqs} sequences: row 0 is padding scratch, use >= {num_seqs + 1}")
        decls = flat_state_decls(model, tp)
        tensors: dict[int, dict[str, torch.Tensor]] = {}
        for layer, by_name in decls.items():
            tensors[layer] = {}
            for name, d in by_name.items():
                lead = (blocks, block_size) if d.kind == "paged" else (rows,)
                tensors[layer][name] = torch.zeros(*lead, *d.shape, dtype=state_dtype(d, dtype), device=device)
        alloc = BlockAllocator(blocks, shuffle_seed=shuffle_seed)
        slots = [SeqSlot(row=s + 1, blocks=alloc.allocate(per_seq)) for s in range(num_seqs)]
        return cls(tensors, decls, block_size=block_size, slots=slots, allocator=alloc, tp=tp)

    @classmethod
    def external(cls, model: "ModelWithStates", tensors: Mapping[int, Mapping[str, torch.Tensor]], *,
                 tp: int = 1) -> "ModelStates":
        """The model's states over given tensors (vLLM's own caches), checked against the declarations.

        Paged tensors are ``[num_blocks, block_size, *shape]`` (views are fine: e.g. ``kv[0]`` / ``kv[1]``
        of vLLM's ``[2, num_blocks, block_size, heads, head_dim]`` layer cache); the block size is
        read off them (one for all). No sequences are allocated here: the caller owns the block tables.
        """
        decls = flat_state_decls(model, tp)
        block_size: int | None = None
        for layer, by_name in decls.items():
            have = tensors.get(layer, {})
            for name, d in by_name.items():
                t = have.get(name)
                if t is None:
                    raise UserError(f"layer {layer}: no tensor for the state {name!r} ({d.kind} {list(d.shape)} per "
                                    f"{'token' if d.kind == 'paged' else 'row'}): pass every declared state")
                _check_shape(layer, name, d, t, tp)
                if d.kind == "paged":
                    if block_size is not None and t.shape[1] != block_size:
                        raise UserError(f"layer {layer} state {name!r} has block size {t.shape[1]}, others "
                                        f"{block_size}: use one block size for every paged cache")
                    block_size = int(t.shape[1])
            extra = sorted(set(have) - set(by_name))
            if extra:
                raise UserError(f"layer {layer}: states {extra} are not declared by its pieces (declared: "
                                f"{sorted(by_name)})")
        stray = sorted(set(tensors) - set(decls))
        if stray and any(tensors[i] for i in stray):
            raise UserError(f"states given for layers {stray}, which declare none")
        return cls({i: {n: tensors[i][n] for n in d} for i, d in decls.items()}, decls, block_size=block_size, tp=tp)

    # ------------------------------------------------------------------ access
    def layer(self, index: int) -> dict[str, torch.Tensor]:
        """State name -> tensor of layer ``index`` (empty for a stateless layer)."""
        return self.by_layer.get(index, {})

    def tensors(self) -> list[torch.Tensor]:
        """Every state tensor (what a decode step mutates in place)."""
        return [t for i in sorted(self.by_layer) for t in self.by_layer[i].values()]

    @property
    def device(self) -> torch.device:
        for t in self.tensors():
            return t.device
        return torch.device("cpu")

    @property
    def capacity(self) -> int:
        """Tokens each allocated sequence can hold."""
        return len(self.slots[0].blocks) * (self.block_size or 0) if self.slots else 0

    def block_table(self, slots: Sequence[SeqSlot] | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """``[n, blocks_per_seq]`` int32 block table of ``slots`` (default: every allocated sequence)."""
        slots = self.slots if slots is None else list(slots)
        return torch.tensor([list(s.blocks) for s in slots], dtype=torch.int32,
                            device=device if device is not None else self.device)

    def clone(self, *, paged: bool = True) -> "ModelStates":
        """A deep copy of every tensor (same slots): run two implementations from one starting state. The copy
        is of this class (a subclass keeps the constructor's arguments) and gets :meth:`copy_history`.

        ``paged=False``: the paged caches are shared, not copied - a snapshot to roll sequences back to with
        ``copy_sequence(..., paged=False)``, where what the paged caches hold past the rollback point is written
        again before anything reads it (a verification step's rejected drafts): copying every block of a long
        history per draft is what made the long-context verification cells slow and large."""
        def copy(d: StateDecl, t: torch.Tensor) -> torch.Tensor:
            return t if d.kind == "paged" and not paged else t.clone()

        out = type(self)({i: {n: copy(self.decls[i][n], t) for n, t in by.items()} for i, by in self.by_layer.items()},
                         self.decls, block_size=self.block_size, slots=self.slots, allocator=None, tp=self.tp)
        self.copy_history(out)
        return out

    def copy_history(self, out: "ModelStates") -> None:
        """Hand ``out`` (a fresh :meth:`clone` of these states) what a subclass keeps per sequence beyond the
        state tensors - a reference's own history of every row - so that a snapshot restores it too (the
        verification steps roll back to one). These states keep nothing more: nothing to copy."""

    def extended(self, model: "ModelWithStates", dtype: torch.dtype) -> "ModelStates":
        """These states plus zero tensors for the 'rows' states ``model`` declares and they lack (the rollback
        tapes of a model built for verification steps, over states its plain model prefilled); the tensors
        they have are shared, not copied. ``dtype``: the activation dtype. A missing paged state: UserError."""
        decls = flat_state_decls(model, self.tp)
        per_row = [self.by_layer[i][n] for i, by in self.decls.items() for n, d in by.items() if d.kind == "rows"]
        num_rows = per_row[0].shape[0] if per_row else None
        out = {i: dict(by) for i, by in self.by_layer.items()}
        for layer, by_name in decls.items():
            for name, d in by_name.items():
                if name in out.get(layer, {}):
                    continue
                if d.kind != "rows" or num_rows is None:
                    raise UserError(f"layer {layer}: the states lack {name!r} ({d.kind}): only per-row states can be "
                                    "added; allocate the states from the model (ModelStates.allocate)")
                out.setdefault(layer, {})[name] = torch.zeros(num_rows, *d.shape, dtype=state_dtype(d, dtype),
                                                              device=self.device)
        return ModelStates(out, decls, block_size=self.block_size, slots=self.slots, allocator=self.allocator,
                           tp=self.tp)

    def copy_sequence(self, dst: SeqSlot, src: "ModelStates", src_slot: SeqSlot, tokens: int, *,
                      paged: bool = True) -> None:
        """Copy one sequence's state from ``src`` (same model and TP): its 'rows' states row by row and the
        paged blocks holding its first ``tokens`` tokens (a batch of many sequences from a few prefilled ones);
        ``paged=False``: the 'rows' states only (a rollback to a ``clone(paged=False)`` snapshot)."""
        if src.block_size != self.block_size:
            raise UserError(f"copy between states of block sizes {src.block_size} and {self.block_size}: use one")
        n_blocks = cdiv(tokens, self.block_size or 1)
        if n_blocks > min(len(dst.blocks), len(src_slot.blocks)):
            raise UserError(f"copy of {tokens} tokens: more than the slots' {len(dst.blocks)} / "
                            f"{len(src_slot.blocks)} blocks hold")
        def blocks(a: torch.Tensor, b: torch.Tensor) -> None:
            for k in range(n_blocks):
                a[dst.blocks[k]] = b[src_slot.blocks[k]]

        copy_slot_states(self, src, dst, src_slot, blocks if paged else None)


def copy_slot_states(dst: ModelStates, src: ModelStates, dst_slot: SeqSlot, src_slot: SeqSlot,
                     copy_paged: Callable[[torch.Tensor, torch.Tensor], None] | None) -> None:
    """One sequence's declared states from ``src`` into ``dst`` (same declarations): the 'rows' states row to
    row, each paged one by ``copy_paged(dst tensor, src tensor)`` (which tokens go where is the caller's; None:
    the paged ones are left as they are)."""
    for layer, by_name in dst.decls.items():
        for name, d in by_name.items():
            a, b = dst.by_layer[layer][name], src.by_layer[layer][name]
            if d.kind == "rows":
                a[dst_slot.row] = b[src_slot.row]
            elif copy_paged is not None:
                copy_paged(a, b)


def rank_slice(t: torch.Tensor, dim: int, parts: Sequence[int], slices: int, index: int) -> torch.Tensor:
    """Slice ``index`` of ``slices`` equal slices of every part (sizes ``parts``) of ``t`` along ``dim``,
    concatenated: a new contiguous tensor (one TP rank's shard)."""
    out, at = [], 0
    for p in parts:
        if p % slices:
            raise UserError(f"TP not supported: {p} rows along dim {dim} do not split into {slices} equal slices")
        per = p // slices
        out.append(t.narrow(dim, at + index * per, per))
        at += p
    return torch.cat(out, dim=dim) if len(out) > 1 else out[0].clone(memory_format=torch.contiguous_format)


def shard_states(model: "ModelWithStates", states: ModelStates, rank: int, tp: int) -> ModelStates:
    """Rank ``rank``'s copy of full (TP=1) ``states`` at ``tp`` (same slots): every state its declaration
    splits (``StateDecl.split``, ``parts``, ``replicas``) cut to the rank's slice, the others copied whole.
    TP=1: a clone. Runs a reference's prefilled cache through the rank programs of a TP group."""
    if states.tp != 1:
        raise UserError(f"shard_states takes full (TP=1) states, got states of TP={states.tp}")
    if tp == 1:
        return states.clone()
    if not 0 <= rank < tp:
        raise UserError(f"rank {rank} of TP={tp}")
    full, mine = flat_state_decls(model, 1), flat_state_decls(model, tp)
    out: dict[int, dict[str, torch.Tensor]] = {}
    for layer, by_name in mine.items():
        out[layer] = {}
        for name, d in by_name.items():
            t, f = states.layer(layer)[name], full[layer][name]
            if d.split is None:
                shard = t.clone()
            else:
                dim = (2 if d.kind == "paged" else 1) + d.split % len(d.shape)
                n = tp // d.replicas
                shard = rank_slice(t, dim, tuple(f.parts) or (t.shape[dim],), n, rank // d.replicas)
            _check_shape(layer, name, d, shard, tp)
            out[layer][name] = shard
    return ModelStates(out, mine, block_size=states.block_size, slots=states.slots, allocator=None, tp=tp)


def _check_shape(layer: int, name: str, d: StateDecl, t: torch.Tensor, tp: int) -> None:
    lead = 2 if d.kind == "paged" else 1
    if t.dim() != lead + len(d.shape) or tuple(t.shape[lead:]) != tuple(d.shape):
        what = "[num_blocks, block_size, " if d.kind == "paged" else "[num_rows, "
        raise UserError(f"layer {layer} state {name!r} has shape {list(t.shape)}, this rank needs "
                        f"{what}{', '.join(map(str, d.shape))}] at TP={tp}: pass the rank's shard "
                        "(ModelStates.allocate(model, ..., tp=tp))")


def check_states(model: "ModelWithStates", states: ModelStates, tp: int) -> None:
    """UserError naming the fix where ``states`` lacks a declared state or has another shape."""
    for layer, by_name in flat_state_decls(model, tp).items():
        have = states.layer(layer)
        for name, d in by_name.items():
            if name not in have:
                raise UserError(f"layer {layer}: the states lack {name!r}: allocate them from the same model "
                                "(ModelStates.allocate / ModelStates.external)")
            _check_shape(layer, name, d, have[name], tp)


__all__ = ["ModelStates", "BlockAllocator", "SeqSlot", "copy_slot_states", "flat_state_decls", "state_dtype", "check_states",
           "shard_states",
           "rank_slice"]
