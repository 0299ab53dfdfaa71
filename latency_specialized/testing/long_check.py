"""Long teacher-forced check of an adapter's program against its reference on a GPU (bf16), generically.

The cross-model matrix (``testing/verify.py``) runs 2 fp32 steps of a tiny model. This runs many
bf16 steps of a variant whose widths the GPU kernels serve (default *medium*: every site on a
kernel or a sync-free composition), each step replayed from one CUDA graph, so drift of fp32
recurrent states and bf16 rounding over hundreds of steps shows up where it would in serving.

Teacher forcing: both sides decode the same fixed random token stream (their own argmax never feeds
back), from caches prefilled by the reference (sequences of different lengths). Reported per run:
the largest ``max|program - reference| / max|reference|`` over steps, that ratio at the first and
last step (drift), and top-1 agreement; with ``fp32_floor`` also the same figures for the bf16
reference against an fp32 reference (random-weight MoE models amplify bf16 rounding: a routing flip
changes a token's experts), the floor the program should be judged against.

What the adapter provides: ``spec(variant)``, ``reference(spec, seed=|weights=, dtype=, device=,
tokenizer=)`` (with ``w``: its weights by checkpoint name), ``composed_model``, ``tensor_names``
(the routers' names, for ``router_scale``) and ``program(spec, weights=, plans=, cache=, trace=)``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch


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


def router_names(adapter: Any, spec: Any) -> list[str]:
    """Checkpoint names of every FFN router weight (piece-local 'router')."""
    names = adapter.tensor_names(spec)
    return [n for (layer, role, local) in adapter.composed_model(spec).weight_decls(1)
            if role == "ffn" and local == "router" and (n := names(layer, role, local)) is not None]


def setup(adapter: Any, batch: int, steps: int, *, variant: str = "medium", device: str, seed: int, prompt: int,
          router_scale: float, fp32: bool = False, weights: dict[str, torch.Tensor] | None = None):
    """(spec, weights, reference, prefilled states, lengths, token stream) of one check (same draws for bf16
    and fp32). ``weights``: the bf16 weights an earlier ``setup`` of the same seed and ``router_scale`` returned
    (the same tensors again, without drawing them: random weights of a medium model take seconds to draw)."""
    spec = adapter.spec(variant)
    w = weights
    if w is None:
        w = adapter.reference(spec, seed=seed, dtype="bfloat16", device=device, tokenizer=False).w
        if router_scale != 1.0:
            for name in router_names(adapter, spec):
                w[name] = w[name] * router_scale
    ref = adapter.reference(spec, weights={k: v.float() for k, v in w.items()} if fp32 else w, tokenizer=False)
    g = torch.Generator().manual_seed(seed + batch)
    lens = [prompt - (b % 4) for b in range(batch)]
    states = ref.new_cache(batch, prompt + steps + 1, block_size=16, shuffle_seed=seed)
    for slot, n in zip(states.slots, lens):
        ref.prefill(states, slot, 0, torch.randint(3, spec.vocab_size, (n,), generator=g))
    stream = torch.randint(3, spec.vocab_size, (steps, batch), generator=g).to(device)
    return spec, w, ref, states, lens, stream


def teacher_forced(adapter: Any, batch: int, steps: int, *, variant: str = "medium", device: str = "cuda",
                   seed: int = 0, prompt: int = 12, say: Callable[[str], None] = print, fp32_floor: bool = False,
                   router_scale: float = 1.0) -> LongCheck:
    """Run ``steps`` teacher-forced decode steps of the program and the reference at ``batch``.

    ``fp32_floor``: also run the reference in fp32 (same weights, upcast) from the same prompts and
    report how far the bf16 reference itself is from it (the noise floor of bf16 with these random
    weights) and how far the program is from it.
    ``router_scale``: multiplies the router weights; 0 fixes the routing by the selection bias (every
    token picks the same experts, no routing flips), which isolates the kernels' numerics from the
    way random routing amplifies any rounding difference.
    Cost: on the H200, 256 steps of a 4-layer medium model at batch 64 with the floor took 62 s
    (2026-11-29; the reference decoding all sequences at once).
    """
    from latency_specialized import hardware
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
    from latency_specialized.runtime.gate import StepState
    from latency_specialized.runtime.harness import SpecBoundAdapter, make_runner
    from latency_specialized.trace import Trace

    t0 = time.perf_counter()
    kw = dict(variant=variant, device=device, seed=seed, prompt=prompt, router_scale=router_scale)
    spec, w, ref, states, lens, stream = setup(adapter, batch, steps, **kw)
    ref32 = states32 = None
    if fp32_floor:
        _, _, ref32, states32, _, _ = setup(adapter, batch, steps, **kw, fp32=True, weights=w)
    reg = get_registry()
    hw = hardware.probe() if device == "cuda" else hardware.for_arch("cpu")
    plan = build_plan(SpecBoundAdapter(adapter, spec), reg.implementations, hw, tp=1, batch=batch, dtype="bfloat16")
    trace = Trace()
    program = adapter.program(spec, weights=w, plans=plan, cache=states.clone(), trace=trace)
    buffers = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(states.slots[0].blocks),
                                       block_size=states.block_size, pad_state=0), device)
    buffers.load(stream[0], lens, [s.row for s in states.slots], states.block_table(device="cpu"))
    # on a GPU every site runs a kernel or a sync-free composition, so the check runs the graphed step
    # serving would run (one CUDA graph per step); the CPU runs it eagerly
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
        want_all.append(ref.decode(states, states.slots, positions, stream[t]).float().cpu())
        if ref32 is not None:
            w32_all.append(ref32.decode(states32, states32.slots, positions, stream[t]).float().cpu())
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


def graph_replay_equals_eager(adapter: Any, batch: int, steps: int = 6, *, device: str = "cuda",
                              graphs: tuple[bool, ...] = (True, False)) -> Any:
    """The medium model's whole decode step from one captured CUDA graph equals the eager run, ``steps``
    teacher-forced steps at ``batch`` (logits within bf16 noise, next tokens equal, no NaN through a poisoned
    logits buffer, every step fast and replayed). Returns the plan (callers check what serves it).
    ``graphs=(False,)`` runs the eager side alone (a CPU smoke run of this check's plumbing)."""
    from latency_specialized import hardware
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
    from latency_specialized.runtime.gate import StepState
    from latency_specialized.runtime.harness import SpecBoundAdapter, make_runner
    from latency_specialized.trace import Trace

    spec, w, _, cache, lens, stream = setup(adapter, batch, steps, device=device, seed=0, prompt=12,
                                            router_scale=0.0)
    plan = build_plan(SpecBoundAdapter(adapter, spec), get_registry().implementations, hardware.probe(), tp=1,
                      batch=batch, dtype="bfloat16")
    runs = []
    for use_graphs in graphs:
        trace = Trace()
        prog = adapter.program(spec, weights=w, plans=plan, cache=cache.clone(), trace=trace)
        buf = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(cache.slots[0].blocks),
                                       block_size=cache.block_size, pad_state=0), device)
        buf.load(stream[0], lens, [s.row for s in cache.slots], cache.block_table(device="cpu"))
        runner = make_runner(prog, buf, use_graphs=use_graphs, preserve_state=True)
        if use_graphs:
            assert runner.capture()
        runs.append((prog, runner, trace))
    (pg, rg, tg), (_, re_, _) = runs[0], runs[-1]
    for t in range(steps):
        pg.logits.fill_(float("nan"))
        r = rg.run(StepState(num_seqs=batch), tokens=stream[t])
        e = re_.run(StepState(num_seqs=batch), tokens=stream[t]) if len(runs) > 1 else r
        assert r.graph == graphs[0] and r.fast and not torch.isnan(r.outputs["logits"][:batch]).any()
        torch.testing.assert_close(r.outputs["logits"][:batch], e.outputs["logits"][:batch], rtol=1e-3, atol=1e-3)
        assert torch.equal(r.outputs["next_tokens"][:batch], e.outputs["next_tokens"][:batch]), t
    assert tg.summary()["fast_steps"] == steps and (tg.summary()["captures"] >= 1 or not graphs[0])
    return plan


def as_dict(r: LongCheck) -> dict:
    return asdict(r)


__all__ = ["LongCheck", "teacher_forced", "setup", "router_names", "as_dict", "graph_replay_equals_eager"]
