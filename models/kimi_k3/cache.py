"""Decode state of Kimi K3 sequences: KDA conv tails and recurrent states, the paged MLA latent cache.

Layout (shared by the reference and the program, and what vLLM keeps per layer):

* KDA layer ``i``: ``conv[i]`` ``[rows, 3*H*D, W-1]`` (activation dtype, the last W-1 inputs of q|k|v,
  oldest first) and ``state[i]`` ``[rows, H, D, D]`` fp32 (``[value, key]``). Row 0 is the scratch
  row that padded batch rows read and write (``BufferSpec.pad_state``); sequences use rows >= 1.
* MLA layer ``i``: ``kv[i]`` ``[num_blocks, block_size, kv_lora + rope]`` (activation dtype): per
  token the RMS-normed latent ``c`` followed by the (unrotated) rope key. Sequences own blocks
  through a block table; blocks are handed out in a shuffled order when asked, so tests exercise
  real paging rather than one contiguous range.

Fresh sequences start from zero state, as in vLLM (no initial state).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from latency_specialized.errors import UserError
from latency_specialized.spec import KDAAttentionSpec, MLAAttentionSpec

from latency_specialized_models.kimi_k3.spec import KimiK3Spec, cdiv


@dataclass(frozen=True)
class SeqSlot:
    """Where one sequence keeps its state."""

    row: int
    """Recurrent-state row (>= 1; row 0 is padding scratch)."""
    blocks: tuple[int, ...]
    """KV blocks in order (capacity = len(blocks) * block_size tokens)."""


@dataclass
class KimiK3Cache:
    """Per-layer decode state of a set of sequences (see the module docstring)."""

    conv: dict[int, torch.Tensor]
    """KDA layer -> conv tails [rows, 3*H*D, W-1]."""
    state: dict[int, torch.Tensor]
    """KDA layer -> recurrent states [rows, H, D, D] (fp32, fp64 in fp64 runs)."""
    kv: dict[int, torch.Tensor]
    """MLA layer -> paged latent cache [num_blocks, block_size, kv_lora + rope]."""
    block_size: int
    """Tokens per KV block."""
    slots: list[SeqSlot] = field(default_factory=list)
    """The sequences allocated by :meth:`for_sequences`, in order."""

    @classmethod
    def for_sequences(cls, spec: KimiK3Spec, num_seqs: int, max_len: int, *, block_size: int = 16,
                      dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                      state_dtype: torch.dtype | None = None, shuffle_seed: int | None = None) -> "KimiK3Cache":
        """Zero state for ``num_seqs`` sequences of up to ``max_len`` tokens each.

        ``shuffle_seed`` hands the KV blocks out in a random order (paging exercised); None keeps
        each sequence's blocks contiguous.
        """
        if num_seqs < 1 or max_len < 1 or block_size < 1:
            raise UserError(f"cache needs >= 1 sequence, length and block size (got {num_seqs}, {max_len}, {block_size})")
        if max_len > spec.max_context:
            raise UserError(f"max_len {max_len} beyond the model context {spec.max_context}: ask for fewer tokens")
        if state_dtype is None:
            state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        rows = num_seqs + 1
        per_seq = cdiv(max_len, block_size)
        num_blocks = num_seqs * per_seq
        conv, state, kv = {}, {}, {}
        for layer in spec.layers:
            a = layer.attention
            if isinstance(a, KDAAttentionSpec):
                hd = a.num_heads * a.head_dim
                conv[layer.index] = torch.zeros(rows, 3 * hd, a.conv_kernel - 1, dtype=dtype, device=device)
                state[layer.index] = torch.zeros(rows, a.num_heads, a.head_dim, a.head_dim, dtype=state_dtype,
                                                 device=device)
            elif isinstance(a, MLAAttentionSpec):
                kv[layer.index] = torch.zeros(num_blocks, block_size, a.latent_width, dtype=dtype, device=device)
        order = list(range(num_blocks))
        if shuffle_seed is not None:
            order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
        slots = [SeqSlot(row=s + 1, blocks=tuple(order[s * per_seq:(s + 1) * per_seq])) for s in range(num_seqs)]
        return cls(conv, state, kv, block_size, slots)

    @property
    def capacity(self) -> int:
        """Tokens each allocated sequence can hold."""
        return len(self.slots[0].blocks) * self.block_size if self.slots else 0

    def block_table(self, slots: list[SeqSlot] | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """``[n, blocks_per_seq]`` int32 block table of ``slots`` (default: every sequence)."""
        slots = self.slots if slots is None else slots
        dev = device if device is not None else self.device
        return torch.tensor([list(s.blocks) for s in slots], dtype=torch.int32, device=dev)

    @property
    def device(self) -> torch.device:
        for d in (self.state, self.kv):
            for t in d.values():
                return t.device
        return torch.device("cpu")

    def tensors(self) -> list[torch.Tensor]:
        """Every state tensor (what a decode step mutates in place)."""
        return [*self.conv.values(), *self.state.values(), *self.kv.values()]

    def clone(self) -> "KimiK3Cache":
        """A deep copy (same slots): run two implementations from the same starting state."""
        return KimiK3Cache({k: v.clone() for k, v in self.conv.items()}, {k: v.clone() for k, v in self.state.items()},
                           {k: v.clone() for k, v in self.kv.items()}, self.block_size, list(self.slots))
