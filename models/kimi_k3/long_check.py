"""Long teacher-forced check of the Kimi K3 program against the reference on a GPU (bf16).

The cross-model matrix (verify.py) runs 2 fp32 steps of the tiny model. This runs many bf16 steps
of a *medium* model whose widths the GPU kernels serve (KDA head_dim 128, latent 512 = 2 x 256,
128 experts -> the 4-warp router, SiTU-GLU experts through the CuTe DSL kernels at 1-2 tokens and
the Triton fused MoE from 4, AttnRes / fused residual kernels; projections of off-table shapes on
cuBLAS; MLA on its reference), so drift of the fp32 KDA states and bf16 rounding over hundreds of
steps shows up where it would in serving.

Teacher forcing: both sides decode the same fixed random token stream (their own argmax never feeds
back), from caches prefilled by the reference (sequences of different lengths). The reference
computes in fp32 and rounds to bf16 where the program rounds, so differences are kernel
accumulation order and the program's fused roundings. Reported per run: the largest
``max|program - reference| / max|reference|`` over steps, that ratio at the first and last step
(drift), and top-1 agreement of the logits; with ``fp32_floor`` also the same figures for the bf16
reference against an fp32 reference (random-weight MoE models amplify bf16 rounding: a routing
flip changes a token's experts), the floor the program should be judged against.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from latency_specialized_models.kimi_k3.spec import KimiK3Spec, build_spec, mla_layer_indices


def medium_spec() -> KimiK3Spec:
    """4 layers (KDA+dense, 2 x KDA+MoE, MLA+MoE), hidden 1024, widths the GPU kernels serve."""
    return build_spec(variant="gpu-check", hidden=1024, vocab=2048, num_layers=4,
                      mla_layers=mla_layer_indices(4, 4), kda_heads=8, head_dim=128, mla_heads=8, q_lora=256,
                      kv_lora=128, nope=64, rope=32, v_dim=64, experts=128, top_k=8, shared=1, expert_inter=256,
                      latent=512, dense_inter=1024, block_size=2, max_context=4096, expert_format="bf16")


@dataclass
class LongCheck:
    batch: int
    steps: int
    router_scale: float
    max_rel_err: float
    """max over steps of max|program - reference| / max|reference logits| (bf16 reference)."""
    first_rel_err: float
    last_rel_err: float
    top1_agreement: float
    """program vs the bf16 reference."""
    fast_steps: int
    seconds: float
    impls: dict[str, str]
    floor_max_rel_err: float | None = None
    """The bf16 reference against the fp32 reference (same weights): what bf16 itself costs."""
    floor_top1: float | None = None
    prog_vs_fp32_max_rel_err: float | None = None
    prog_vs_fp32_top1: float | None = None


def teacher_forced(batch: int, steps: int, *, device: str = "cuda", seed: int = 0, prompt: int = 12,
                   say: Callable[[str], None] = print, fp32_floor: bool = False,
                   router_scale: float = 1.0) -> LongCheck:
    """Run ``steps`` teacher-forced decode steps of the program and the reference at ``batch``.

    ``fp32_floor``: also run the reference in fp32 (same weights, upcast) from the same prompts and
    report how far the bf16 reference itself is from it (the noise floor of bf16 with these random
    weights) and how far the program is from it.
    ``router_scale``: multiplies the router weights; 0 fixes the routing by the selection bias (every
    token picks the same experts, no routing flips), which isolates the kernels' numerics from the
    way random routing amplifies any rounding difference.
    """
    from latency_specialized import hardware
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
    from latency_specialized.runtime.gate import DecodeGate, StepState
    from latency_specialized.runtime.graph_runner import CUDAGraphRunner
    from latency_specialized.trace import Trace

    from latency_specialized_models.kimi_k3.graphed import _ShapedAdapter
    from latency_specialized_models.kimi_k3.program import KimiK3Program
    from latency_specialized_models.kimi_k3.reference import KimiK3Reference
    from latency_specialized_models.kimi_k3.weights import random_weights

    t0 = time.perf_counter()
    spec = medium_spec()
    w = random_weights(spec, seed=seed, dtype=torch.bfloat16, device=device)
    if router_scale != 1.0:
        for name in [n for n in w if n.endswith("block_sparse_moe.gate.weight")]:
            w[name] = w[name] * router_scale
    ref = KimiK3Reference(spec, w)
    g = torch.Generator().manual_seed(seed + batch)
    lens = [prompt - (b % 4) for b in range(batch)]
    cache = ref.new_cache(batch, prompt + steps + 1, block_size=16, shuffle_seed=seed)
    for slot, n in zip(cache.slots, lens):
        ref.prefill(cache, slot, 0, torch.randint(3, spec.vocab_size, (n,), generator=g))
    stream = torch.randint(3, spec.vocab_size, (steps, batch), generator=g).to(device)
    ref32 = cache32 = None
    if fp32_floor:
        ref32 = KimiK3Reference(spec, {k: v.float() for k, v in w.items()})
        cache32 = ref32.new_cache(batch, prompt + steps + 1, block_size=16, shuffle_seed=seed)
        g32 = torch.Generator().manual_seed(seed + batch)
        for slot, n in zip(cache32.slots, lens):
            ref32.prefill(cache32, slot, 0, torch.randint(3, spec.vocab_size, (n,), generator=g32))
    reg = get_registry()
    hw = hardware.probe() if device == "cuda" else hardware.for_arch("cpu")
    plan = build_plan(_ShapedAdapter(reg.adapter("kimi_k3"), spec), reg.implementations, hw, tp=1, batch=batch,
                      dtype="bfloat16")
    trace = Trace()
    program = KimiK3Program(spec, w, plan, cache.clone(), trace=trace)
    buffers = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(cache.slots[0].blocks),
                                       block_size=cache.block_size, pad_state=0), device)
    buffers.load(stream[0], lens, [s.row for s in cache.slots], cache.block_table(device="cpu"))
    # eager: the MLA layer runs its reference (host sync), which a CUDA graph cannot capture
    runner = CUDAGraphRunner(program, buffers, trace=trace, use_graphs=False, feed_back_tokens=False,
                             gate=DecodeGate(max_batch=plan.bucket, buckets=(plan.bucket,)))
    positions = list(lens)
    errs, agree = [], 0
    floor, floor_agree, p32, p32_agree = [], 0, [], 0

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()

    for t in range(steps):
        got = runner.run(StepState(num_seqs=batch), tokens=stream[t]).outputs["logits"]
        want = ref.decode(cache, cache.slots, positions, stream[t])
        errs.append(rel(got, want))
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        if ref32 is not None:
            w32 = ref32.decode(cache32, cache32.slots, positions, stream[t])
            floor.append(rel(want, w32))
            floor_agree += int((want.argmax(-1) == w32.argmax(-1)).sum())
            p32.append(rel(got, w32))
            p32_agree += int((got.argmax(-1) == w32.argmax(-1)).sum())
        positions = [p + 1 for p in positions]
        if (t + 1) % 64 == 0:
            say(f"  batch {batch}: step {t + 1}/{steps}, max rel err so far {max(errs):.2e}, "
                f"top-1 {agree / ((t + 1) * batch):.4f}")
    s = trace.summary()
    n = steps * batch
    return LongCheck(batch, steps, router_scale, max(errs), errs[0], errs[-1], agree / n, s["fast_steps"],
                     round(time.perf_counter() - t0, 1),
                     {c.site.name: c.impl.name for c in plan.choices if c.impl is not None},
                     max(floor) if floor else None, floor_agree / n if floor else None,
                     max(p32) if p32 else None, p32_agree / n if p32 else None)


def as_dict(r: LongCheck) -> dict:
    return asdict(r)
