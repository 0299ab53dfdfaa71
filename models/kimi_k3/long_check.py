"""Long teacher-forced check of the Kimi K3 program against the reference on a GPU (bf16).

The cross-model matrix (verify.py) runs 2 fp32 steps of the tiny model. This runs many bf16 steps
of a *medium* model whose widths the GPU kernels serve (KDA head_dim 128, latent 512 = 2 x 256,
128 experts -> the 4-warp router, SiTU-GLU experts through the CuTe DSL kernels at 1-2 tokens and
the Triton fused MoE from 4, AttnRes / fused residual kernels; projections of off-table shapes on
cuBLAS; MLA on a sync-free GPU implementation), each step replayed from one CUDA graph, so drift
of the fp32 KDA states and bf16 rounding over hundreds of steps shows up where it would in serving.

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

from latency_specialized_models.kimi_k3.spec import medium_spec


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
    decisive_fraction: float | None = None
    """Share of (step, sequence) whose fp32-reference top-1 leads its runner-up by more than twice that
    step's bf16 noise (max |bf16 reference - fp32 reference| logit): a token bf16 cannot flip."""
    decisive_top1: float | None = None
    """Top-1 agreement of the program with the fp32 reference on those decisive tokens only (with
    random weights most tokens are near-ties, where any bf16 rounding decides; reported beside the
    raw agreement, not instead of it)."""
    graph_steps: int = 0
    """Steps replayed from a captured CUDA graph (all of them on a GPU; 0 on the CPU, which runs eagerly)."""


def _setup(batch: int, steps: int, *, device: str, seed: int, prompt: int, router_scale: float, fp32: bool = False):
    """Reference, prefilled cache and token stream of one check (the same draws for bf16 and fp32)."""
    from latency_specialized_models.kimi_k3.reference import KimiK3Reference
    from latency_specialized_models.kimi_k3.weights import random_weights

    spec = medium_spec()
    w = random_weights(spec, seed=seed, dtype=torch.bfloat16, device=device)
    if router_scale != 1.0:
        for name in [n for n in w if n.endswith("block_sparse_moe.gate.weight")]:
            w[name] = w[name] * router_scale
    ref = KimiK3Reference(spec, {k: v.float() for k, v in w.items()} if fp32 else w)
    g = torch.Generator().manual_seed(seed + batch)
    lens = [prompt - (b % 4) for b in range(batch)]
    cache = ref.new_cache(batch, prompt + steps + 1, block_size=16, shuffle_seed=seed)
    for slot, n in zip(cache.slots, lens):
        ref.prefill(cache, slot, 0, torch.randint(3, spec.vocab_size, (n,), generator=g))
    stream = torch.randint(3, spec.vocab_size, (steps, batch), generator=g).to(device)
    return spec, w, ref, cache, lens, stream


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
    Cost: until 2026-11-29 the reference decoded sequence by sequence (~3.6 s per step at batch 64
    with the floor on the H200, so 256 steps did not fit a 10-minute device call; spawning reference
    workers on the same GPU was slower still: they time-slice it). ``decode`` now runs all sequences
    at once (KDA per state row, MLA per sequence): 3.8x faster on the CPU at batch 16; on the H200
    256 steps at batch 64 with the floor took 62 s (2026-11-29).
    """
    from latency_specialized import hardware
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
    from latency_specialized.runtime.gate import StepState
    from latency_specialized.trace import Trace

    from latency_specialized_models.kimi_k3.graphed import ShapedAdapter, make_runner
    from latency_specialized_models.kimi_k3.program import KimiK3Program

    t0 = time.perf_counter()
    kw = dict(batch=batch, steps=steps, device=device, seed=seed, prompt=prompt, router_scale=router_scale)
    spec, w, ref, cache, lens, stream = _setup(**kw)
    ref32 = cache32 = None
    if fp32_floor:
        _, _, ref32, cache32, _, _ = _setup(**kw, fp32=True)
    reg = get_registry()
    hw = hardware.probe() if device == "cuda" else hardware.for_arch("cpu")
    plan = build_plan(ShapedAdapter(reg.adapter("kimi_k3"), spec), reg.implementations, hw, tp=1, batch=batch,
                      dtype="bfloat16")
    trace = Trace()
    program = KimiK3Program(spec, w, plan, cache.clone(), trace=trace)
    buffers = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(cache.slots[0].blocks),
                                       block_size=cache.block_size, pad_state=0), device)
    buffers.load(stream[0], lens, [s.row for s in cache.slots], cache.block_table(device="cpu"))
    # on a GPU every site of the medium model runs a kernel or a sync-free composition, so the check runs
    # the graphed step serving would run (one CUDA graph per step); the CPU runs it eagerly
    runner = make_runner(program, buffers, trace=trace, use_graphs=device == "cuda", preserve_state=True)
    if runner.use_graphs:
        runner.capture()
    positions = list(lens)
    graph_steps = 0
    got_all, want_all, w32_all = [], [], []
    for t in range(steps):
        # clone: the program's logits are a static buffer (on the CPU .float().cpu() would alias it)
        res = runner.run(StepState(num_seqs=batch), tokens=stream[t])
        graph_steps += int(res.graph)
        got_all.append(res.outputs["logits"][:batch].float().cpu().clone())
        want_all.append(ref.decode(cache, cache.slots, positions, stream[t]).float().cpu())
        if ref32 is not None:
            w32_all.append(ref32.decode(cache32, cache32.slots, positions, stream[t]).float().cpu())
        positions = [p + 1 for p in positions]
        if (t + 1) % 64 == 0:
            n_ = (t + 1) * batch
            say(f"  batch {batch}: step {t + 1}/{steps} ({time.perf_counter() - t0:.0f} s), top-1 so far "
                f"{sum(int((g_.argmax(-1) == w_.argmax(-1)).sum()) for g_, w_ in zip(got_all, want_all)) / n_:.4f}")

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()

    def top1(a: torch.Tensor, b: torch.Tensor) -> int:
        return int((a.argmax(-1) == b.argmax(-1)).sum())

    errs = [rel(g_, w_) for g_, w_ in zip(got_all, want_all)]
    agree = sum(top1(g_, w_) for g_, w_ in zip(got_all, want_all))
    floor = [rel(w_, f_) for w_, f_ in zip(want_all, w32_all)]
    floor_agree = sum(top1(w_, f_) for w_, f_ in zip(want_all, w32_all))
    p32 = [rel(g_, f_) for g_, f_ in zip(got_all, w32_all)]
    p32_agree = sum(top1(g_, f_) for g_, f_ in zip(got_all, w32_all))
    decisive = decisive_agree = 0
    for g_, w_, f_ in zip(got_all, want_all, w32_all):
        noise = (w_.double() - f_.double()).abs().max()
        top2 = f_.double().topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > 2 * noise
        decisive += int(sure.sum())
        decisive_agree += int(((g_.argmax(-1) == f_.argmax(-1)) & sure).sum())
    s = trace.summary()
    n = steps * batch
    return LongCheck(batch, steps, router_scale, max(errs), errs[0], errs[-1], agree / n, s["fast_steps"],
                     round(time.perf_counter() - t0, 1),
                     {c.site.name: c.impl.name for c in plan.choices if c.impl is not None},
                     max(floor) if floor else None, floor_agree / n if floor else None,
                     max(p32) if p32 else None, p32_agree / n if p32 else None,
                     decisive / n if floor else None, (decisive_agree / decisive) if decisive else None,
                     graph_steps=graph_steps)


def as_dict(r: LongCheck) -> dict:
    return asdict(r)
