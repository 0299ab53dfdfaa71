"""A toy decode program for runtime tests: embedding + recurrent state + KV writes + a side stream.

Small enough for the CPU, yet it exercises everything the graph runner must get right: token and
position inputs, per-sequence recurrent state rows (``state_indices``), KV-cache writes at
``slot_mapping`` (padding writes nowhere), a side-stream branch joined back into the step, and
in-graph greedy sampling fed back as the next input.
"""

from __future__ import annotations

import torch

from latency_specialized.runtime.buffers import DecodeBuffers

VOCAB, HIDDEN = 64, 32


class ToyProgram:
    """DecodeProgram over toy weights; ``side_stream=True`` computes one branch on a side stream."""

    def __init__(self, *, max_batch: int, state_rows: int, kv_slots: int, device: str = "cpu",
                 side_stream: bool = False, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        dev = torch.device(device)
        self.max_batch = max_batch
        self.emb = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.5).to(dev)
        self.w1 = (torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5).to(dev)
        self.w2 = (torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5).to(dev)
        self.state = (torch.randn(state_rows, HIDDEN, generator=g) * 0.1).to(dev)
        # last KV row is the scratch slot that padding (slot -1) writes to
        self.kv = (torch.randn(kv_slots + 1, HIDDEN, generator=g) * 0.1).to(dev)
        self.logits = torch.full((max_batch, VOCAB), float("nan"), device=dev)
        self.next_tokens = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.side = torch.cuda.Stream(device=dev) if (side_stream and dev.type == "cuda") else None
        self.prepared: list[int] = []

    def prepare(self, bucket: int) -> None:
        self.prepared.append(bucket)

    def state_tensors(self):
        return [self.state, self.kv]

    def outputs(self):
        return {"logits": self.logits, "next_tokens": self.next_tokens}

    def step(self, buffers: DecodeBuffers, bucket: int) -> None:
        b = bucket
        tok, pos = buffers.tokens[:b], buffers.positions[:b]
        x = self.emb[tok] + torch.sin(pos.float() * 0.1).unsqueeze(-1)
        if self.side is not None:
            main = torch.cuda.current_stream()
            self.side.wait_stream(main)  # fork
            with torch.cuda.stream(self.side):
                shared = torch.tanh(x @ self.w2)
            main.wait_stream(self.side)  # join inside the capture
        else:
            shared = torch.tanh(x @ self.w2)
        idx = buffers.state_indices[:b].long()
        new_state = 0.9 * self.state[idx] + x
        self.state.index_copy_(0, idx, new_state)
        slots = buffers.slot_mapping[:b]
        slots = torch.where(slots >= 0, slots, torch.full_like(slots, self.kv.shape[0] - 1))
        self.kv.index_copy_(0, slots, x)
        h = new_state @ self.w1 + shared
        logits = h @ self.emb.t()
        self.logits[:b].copy_(logits)
        self.next_tokens[:b].copy_(logits.argmax(-1))


def reference_steps(prog: ToyProgram, tokens: list[int], positions: list[int], rows: list[int],
                    block_tables: list[list[int]], block_size: int, steps: int):
    """Unpadded per-sequence loop: logits per step and the final state/KV (on copies)."""
    state, kv = prog.state.clone(), prog.kv.clone()
    toks, poss = list(tokens), list(positions)
    all_logits = []
    for _ in range(steps):
        step_logits = []
        for i, r in enumerate(rows):
            x = prog.emb[toks[i]] + torch.sin(torch.tensor(poss[i], dtype=torch.float32, device=kv.device) * 0.1)
            shared = torch.tanh(x @ prog.w2)
            state[r] = 0.9 * state[r] + x
            slot = block_tables[i][poss[i] // block_size] * block_size + poss[i] % block_size
            kv[slot] = x
            logit = (state[r] @ prog.w1 + shared) @ prog.emb.t()
            step_logits.append(logit)
            toks[i] = int(logit.argmax())
            poss[i] += 1
        all_logits.append(torch.stack(step_logits))
    return all_logits, state, kv, toks, poss
