"""Shared helpers of the Qwen3-MoE tests: a random transformers model saved as a checkpoint, relative errors,
and a teacher-forced run of the composed program through the runtime's runner."""

from __future__ import annotations

import math

import torch

from latency_specialized import hardware
from latency_specialized.ops.plan import build_plan
from latency_specialized.plugins import get_registry
from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
from latency_specialized.runtime.gate import DecodeGate, StepState
from latency_specialized.runtime.graph_runner import CUDAGraphRunner


def adapter():
    return get_registry().adapter("qwen3_moe")


class SpecBound:
    """``adapter`` whose spec() is ``spec`` (a checkpoint's), for build_plan - as `generate` plans a checkpoint."""

    def __init__(self, adapter, spec):
        self.adapter, self._spec, self.name = adapter, spec, adapter.name

    def spec(self, variant="full"):
        return self._spec

    def __getattr__(self, item):
        return getattr(self.adapter, item)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max|got - want| / max|want| (NaN-free got)."""
    assert not torch.isnan(got).any()
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def hf_model(transformers, cfg: dict, seed: int = 0):
    """transformers' Qwen3MoeForCausalLM of ``cfg`` (fp32, eval) at serving-like scales: gains ~1, projections
    1/sqrt(fan-in) (its 0.02 init would make every logit ~0 and routing a coin toss)."""
    torch.manual_seed(seed)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    sd = {}
    for name, t in hf.state_dict().items():
        x = torch.randn(t.shape, generator=g)
        sd[name] = 1 + 0.2 * x if "norm" in name else x if "embed" in name else x / math.sqrt(t.shape[-1])
    if cfg.get("tie_word_embeddings"):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    hf.load_state_dict(sd)
    return hf


def teacher_forced(ad, spec, weights, seqs: list[torch.Tensor], starts: list[int], *, dtype=torch.float32,
                   device="cpu", arch="cpu"):
    """Decode every sequence token by token from empty caches (sequence b joins at step ``starts[b]``, leaves
    after its last token: the live batch changes, padded rows included) through the adapter's program in the
    runtime's eager runner. Returns {b: [T_b, vocab] logits} and the program."""
    B = len(seqs)
    plan = build_plan(SpecBound(ad, spec), get_registry().implementations, hardware.for_arch(arch), batch=B,
                      dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype], variant=spec.variant)
    ref = ad.reference(spec, weights=weights)
    cache = ref.new_cache(B, max(len(s) for s in seqs), block_size=4, shuffle_seed=7)
    program = ad.program(spec, plans=plan, cache=cache, reference=ref)
    bufs = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(cache.slots[0].blocks),
                                    block_size=4, pad_state=0), device)
    runner = CUDAGraphRunner(program, bufs, use_graphs=False, feed_back_tokens=False,
                             gate=DecodeGate(max_batch=plan.bucket, buckets=(plan.bucket,)))
    out: dict[int, list[torch.Tensor]] = {b: [] for b in range(B)}
    live_before: list[int] = []
    for step in range(max(s + len(q) for s, q in zip(starts, seqs))):
        live = [b for b in range(B) if starts[b] <= step < starts[b] + len(seqs[b])]
        toks = torch.stack([seqs[b][step - starts[b]] for b in live]).to(device)
        if live != live_before:   # the batch composition changed: host write of the live rows
            bufs.load(toks, [step - starts[b] for b in live], [cache.slots[b].row for b in live],
                      cache.block_table([cache.slots[b] for b in live], device="cpu"))
            live_before = live
        program.logits.fill_(float("nan"))
        res = runner.run(StepState(num_seqs=len(live)), tokens=toks)
        assert res.fast
        for i, b in enumerate(live):
            out[b].append(res.outputs["logits"][i].double().cpu())
    return {b: torch.stack(v) for b, v in out.items()}, program
