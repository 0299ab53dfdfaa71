"""Long check of an adapter's program against its reference on a GPU, generically: teacher-forced drift (bf16 or
fp32), recurrent/cache state drift, NaN/inf on every step, and free-running determinism.

The cross-model matrix (``testing/verify.py``) runs 2 fp32 steps of a tiny model. This runs many steps of a variant
whose widths the GPU kernels serve (default *medium*), each step replayed from one CUDA graph where the plan allows
it, so drift of fp32 recurrent states and bf16 rounding over thousands of steps shows up where it would in serving.

:func:`teacher_forced` - both sides decode the same fixed random token stream (their own argmax never feeds back),
from caches prefilled by the reference (sequences of different lengths). ``dtype``:

* ``bfloat16`` (as before): the program in bf16 against the bf16 reference, and with ``fp32_floor`` the bf16
  reference against an fp32 reference of the same (upcast) weights: the floor the program is judged against
  (random-weight MoE models amplify bf16 rounding: a routing flip changes a token's experts). ``floor_steps``
  keeps the fp32 reference for the first steps only (it must decode every token to keep its caches, so a floor
  "every M-th step" is not possible; a prefix is).
* ``float32``: the program with fp32 weights and activations (plan dtype float32; sites whose kernels take bf16
  only fall back to their references - ``LongCheck.reference_sites`` - and a plan that calls a torch reference
  runs eagerly, as ``generate --graphs auto`` does: references read values on the host) against the fp32
  reference. No separate floor: the fp32 reference is the comparison.

Per run: the largest ``max|program - reference| / max|reference|`` over steps, that ratio at the first and last
step, top-1 agreement, non-finite logits counted on every step (program and reference: must be 0; the run stops at
the first non-finite step), and at checkpoints (every ``state_every`` steps and at the end) the state drift: per
declared state (KDA recurrent state and conv tails, MLA / attention caches, ...) ``max|program - reference| /
max|reference|`` over the sequences' rows and KV blocks (``ModelStates``: the program updates the cache it was
given in place, the reference its own; both share one layout), plus the window's logit figures.

:func:`free_running` - determinism: a fresh program (same weights and prefilled states) decodes greedily (the
graph feeds each step's argmax back as the next input) ``runs`` times; the token streams and the logits' bits
must be identical.

What the adapter provides: ``spec(variant)``, ``reference(spec, seed=|weights=, dtype=, device=, tokenizer=)``
(with ``w``: its weights by checkpoint name, and ``new_cache`` / ``prefill`` / ``decode``), ``composed_model``,
``tensor_names`` (the routers' names, for ``router_scale``) and ``program(spec, weights=, plans=, cache=, trace=)``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from latency_specialized.spec import MAX_SPEC_TOKENS

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
"""Accepted spellings of the two modes."""


class NonFiniteError(AssertionError):
    """A NaN or inf in the logits or states of a long check (the run stopped at that step)."""


class NotDeterministicError(AssertionError):
    """Two free-running runs of a fresh program gave different tokens or logits."""


@dataclass
class LongCheck:
    batch: int
    steps: int
    router_scale: float
    max_rel_err: float
    """max over steps of max|program - reference| / max|reference logits| (the reference of ``dtype``)."""
    first_rel_err: float
    last_rel_err: float
    top1_agreement: float
    """program vs the reference of ``dtype``."""
    fast_steps: int
    seconds: float
    impls: dict[str, str]
    floor_max_rel_err: float | None = None
    """bf16 mode: the bf16 reference against the fp32 reference (same weights): what bf16 itself costs."""
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
    """Steps replayed from a captured CUDA graph (0 on the CPU, which runs eagerly, or where the plan calls a
    torch reference: ``eager_reason``)."""
    dtype: str = "bfloat16"
    """The program's (and its reference's) activation dtype."""
    floor_steps: int = 0
    """Steps the fp32 reference (floor) ran beside (bf16 mode; the floor figures are over these)."""
    steps_run: int = 0
    """Steps actually run (< steps: stopped at a non-finite step)."""
    nonfinite_logits: int = 0
    """NaN/inf logits of the program over every step run (must be 0)."""
    nonfinite_ref_logits: int = 0
    """NaN/inf logits of the references (must be 0)."""
    nonfinite_states: int = 0
    """NaN/inf state elements of the program at the checkpoints (must be 0)."""
    state_max_rel_err: float | None = None
    """max over checkpoints and states of the program's state against the reference's (same dtype)."""
    state_last_rel_err: float | None = None
    """That at the last checkpoint (the end)."""
    state_worst: str = ""
    """The state ('L<layer>.<name>') of ``state_max_rel_err``."""
    state_floor_max_rel_err: float | None = None
    """bf16 mode with the floor: the bf16 reference's state against the fp32 reference's, max over checkpoints."""
    checkpoints: list[dict] = field(default_factory=list)
    """Per checkpoint: step, the window's logit max rel err / top-1 / non-finite count since the last checkpoint,
    the state drift per state ('states'), its max and worst, and the floor's."""
    reference_sites: list[str] = field(default_factory=list)
    """Sites the program calls on a torch reference under this plan (fp32: the bf16-only kernels' sites)."""
    eager_reason: str = ""
    """Why the program ran eagerly on a GPU ('' when graphed or on the CPU)."""
    ms_per_step: dict[str, float] = field(default_factory=dict)
    """Wall time per step of each part: program, reference, floor (fp32 reference), compare, total."""

    @property
    def ok(self) -> bool:
        return not (self.nonfinite_logits or self.nonfinite_ref_logits or self.nonfinite_states) and \
            self.steps_run == self.steps


@dataclass
class Repeat:
    """Free-running determinism of one (dtype, batch)."""

    batch: int
    steps: int
    dtype: str
    runs: int
    tokens_identical: bool
    """Every run's token stream equals the first's, bit for bit."""
    logits_identical: bool
    """Every step's logits have the same bits in every run (a per-step checksum of their int32 views)."""
    first_mismatch_step: int | None
    distinct_tokens: int
    """Distinct tokens in the first run's stream (a stream stuck on one token would prove little)."""
    nonfinite_logits: int
    graph_steps: int
    seconds: float
    eager_reason: str = ""
    router_scale: float = 0.0

    @property
    def ok(self) -> bool:
        return self.tokens_identical and self.logits_identical and not self.nonfinite_logits


def router_names(adapter: Any, spec: Any) -> list[str]:
    """Checkpoint names of every FFN router weight (piece-local 'router')."""
    names = adapter.tensor_names(spec)
    return [n for (layer, role, local) in adapter.composed_model(spec).weight_decls(1)
            if role == "ffn" and local == "router" and (n := names(layer, role, local)) is not None]


def setup(adapter: Any, batch: int, steps: int, *, variant: str = "medium", device: str, seed: int, prompt: int,
          router_scale: float, fp32: bool = False, weights: dict[str, torch.Tensor] | None = None):
    """(spec, weights, reference, prefilled states, lengths, token stream) of one check (same draws for bf16
    and fp32). ``weights``: the bf16 weights an earlier ``setup`` of the same seed and ``router_scale`` returned
    (the same tensors again, without drawing them: random weights of a medium model take seconds to draw).
    ``fp32``: the reference (and its states) in fp32 over the upcast bf16 draws; the returned weights stay bf16."""
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


def mode(dtype: str) -> str:
    """'bfloat16' | 'float32' from any accepted spelling (ValueError otherwise)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def reference_sites(plan: Any) -> list[str]:
    """Sites the program calls on a torch reference under ``plan``."""
    return sorted(c.site.name for c in plan.called_choices() if c.impl is not None and c.impl.is_reference)


def decide_graphs(graphs: str, device: str, plan: Any) -> tuple[bool, str]:
    """(replay from CUDA graphs, why not on a GPU): ``graphs`` 'auto' captures on a GPU unless the plan calls a torch
    reference (those read values on the host: the experts' loop, ...), 'on' always on a GPU, 'off' never."""
    if device != "cuda" or graphs == "off":
        return False, "" if device != "cuda" else "graphs off"
    refs = reference_sites(plan)
    if refs and graphs == "auto":
        more = " ..." if len(refs) > 4 else ""
        return False, f"{len(refs)} site(s) on torch references ({', '.join(refs[:4])}{more})"
    return True, ""


LIVE_PREFIX_STATES = ("pending",)
"""'rows' rings ``[r + MAX_SPEC_TOKENS, ...]`` (position p at p % their length) of which only the last ``length % r``
positions are live: sparse MQA's compressor ``pending`` rows (the tokens of the group not complete yet;
``pieces/attention/sparse_mqa.py``). The program writes every token's row there, the reference's ``fill`` only the
incomplete group's, so the rest holds dead rows of earlier groups on one side (measured on the CPU: rel err ~1.0 in
fp32 with the live rows equal)."""


def _live_ring_entries(t: torch.Tensor, row: int, length: int) -> torch.Tensor:
    """The live entries of a :data:`LIVE_PREFIX_STATES` ring ``t [rows, r + MAX_SPEC_TOKENS, ...]`` of a sequence of
    ``length`` tokens, oldest first."""
    ring = t.shape[1]
    r = ring - MAX_SPEC_TOKENS
    pos = torch.arange(length - length % r, length, device=t.device) % ring
    return t[row, pos]


def state_drift(got: Any, want: Any, slots: Sequence[Any],
                lengths: Sequence[int] | None = None) -> tuple[dict[str, float], int]:
    """({'L<layer>.<name>': max|got - want| / max|want|}, non-finite elements of ``got``) over the rows and KV blocks
    of ``slots`` of two ``ModelStates`` of one layout (row 0, the padding scratch, and unused blocks left out). A
    state that is zero in ``want``: its max |got| instead (0 where both are). With ``lengths`` (the sequences'
    lengths) the :data:`LIVE_PREFIX_STATES` are compared on their live entries only."""
    out: dict[str, float] = {}
    bad = 0
    dev = want.device
    rows = torch.tensor([s.row for s in slots], dtype=torch.long, device=dev)
    blocks = torch.tensor([b for s in slots for b in s.blocks], dtype=torch.long, device=dev)
    for layer in sorted(want.decls):
        for name, d in want.decls[layer].items():
            tg, tw = got.by_layer[layer][name], want.by_layer[layer][name]
            if d.kind == "rows" and name in LIVE_PREFIX_STATES and lengths is not None:
                parts = [(_live_ring_entries(tg, s.row, n), _live_ring_entries(tw, s.row, n))
                         for s, n in zip(slots, lengths)]
                a = torch.cat([x.reshape(-1) for x, _ in parts]).float()
                b = torch.cat([y.reshape(-1) for _, y in parts]).float().to(a.device)
            else:
                idx = rows if d.kind == "rows" else blocks
                a = tg.index_select(0, idx.to(tg.device)).float()
                b = tw.index_select(0, idx).float().to(a.device)
            bad += int((~torch.isfinite(a)).sum())
            if a.numel() == 0:
                out[f"L{layer}.{name}"] = 0.0
                continue
            diff, scale = (a - b).abs().max().item(), b.abs().max().item()
            out[f"L{layer}.{name}"] = diff / scale if scale > 0 else diff
    return out, bad


def _nanmax(xs: Sequence[float]) -> float:
    return max(xs, key=lambda e: (math.isnan(e), e)) if xs else float("nan")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _stats(got: torch.Tensor, want: torch.Tensor) -> list[torch.Tensor]:
    """[max|got - want|, max|want|, top-1 agreements, non-finite in got, non-finite in want] (device scalars)."""
    g, w = got.double(), want.double()
    return [(g - w).abs().max(), w.abs().max(), (got.argmax(-1) == want.argmax(-1)).sum().double(),
            (~torch.isfinite(got)).sum().double(), (~torch.isfinite(want)).sum().double()]


def _runner(adapter: Any, spec: Any, weights: Any, plan: Any, states: Any, first_ids: Any, lens: Any, device: Any,
            trace: Any, use_graphs: bool) -> Any:
    """The program over ``states`` (updated in place) behind decode buffers loaded with the sequences' lengths,
    rows and block tables, in a runner (captured when it graphs)."""
    from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
    from latency_specialized.runtime.harness import make_runner

    program = adapter.program(spec, weights=weights, plans=plan, cache=states, trace=trace)
    buffers = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(states.slots[0].blocks),
                                       block_size=states.block_size, pad_state=0), device)
    buffers.load(first_ids, lens, [s.row for s in states.slots], states.block_table(device="cpu"))
    runner = make_runner(program, buffers, trace=trace, use_graphs=use_graphs, preserve_state=True)
    if runner.use_graphs:
        runner.capture()
    return runner


def teacher_forced(adapter: Any, batch: int, steps: int, *, variant: str = "medium", device: str = "cuda",
                   seed: int = 0, prompt: int = 12, say: Callable[[str], None] = print, fp32_floor: bool = False,
                   router_scale: float = 1.0, dtype: str = "bfloat16", floor_steps: int | None = None,
                   state_every: int = 500, progress_every: int = 64, graphs: str = "auto",
                   on_checkpoint: Callable[[dict], None] | None = None) -> LongCheck:
    """Run ``steps`` teacher-forced decode steps of the program and the reference at ``batch`` (module docstring).

    ``dtype``: 'bfloat16' (program and reference in bf16) or 'float32' (both in fp32; no floor).
    ``fp32_floor`` (bf16): also run the reference in fp32 (same weights, upcast) from the same prompts and
    report how far the bf16 reference itself is from it (the noise floor of bf16 with these random
    weights) and how far the program is from it; ``floor_steps``: for the first that many steps only (None: all).
    ``router_scale``: multiplies the router weights; 0 fixes the routing by the selection bias (every
    token picks the same experts, no routing flips), which isolates the kernels' numerics from the
    way random routing amplifies any rounding difference.
    ``state_every``: steps between state checkpoints (and one at the end); ``progress_every``: steps between
    progress lines (with the time per step and an estimate of the time left). ``on_checkpoint(partial)``: called at
    every checkpoint with the figures so far (batch, dtype, steps run, max rel err, top-1, non-finite counts, the
    checkpoints), so a caller can save them before a time limit ends the run.
    Cost: on the H200, 256 bf16 steps of a 4-layer medium model with the floor took 31 / 22 / 50 s at batch
    1 / 8 / 64 (2026-11-30; mostly the references, which decode all sequences at once).
    """
    from latency_specialized import hardware
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime.gate import StepState
    from latency_specialized.runtime.harness import SpecBoundAdapter
    from latency_specialized.trace import Trace

    dtype = mode(dtype)
    fp32 = dtype == "float32"
    t0 = time.perf_counter()
    kw = dict(variant=variant, device=device, seed=seed, prompt=prompt, router_scale=router_scale)
    spec, w, ref, states, lens, stream = setup(adapter, batch, steps, **kw, fp32=fp32)
    ref32 = states32 = None
    n_floor = 0
    if fp32_floor and not fp32:
        n_floor = steps if floor_steps is None else max(0, min(int(floor_steps), steps))
        if n_floor:
            _, _, ref32, states32, _, _ = setup(adapter, batch, steps, **kw, fp32=True, weights=w)
    reg = get_registry()
    hw = hardware.probe() if device == "cuda" else hardware.for_arch("cpu")
    plan = build_plan(SpecBoundAdapter(adapter, spec), reg.implementations, hw, tp=1, batch=batch, dtype=dtype)
    refs = reference_sites(plan)
    use_graphs, eager_reason = decide_graphs(graphs, device, plan)
    trace = Trace()
    pstates = states.clone()  # the program updates these in place; the reference its own ``states``
    runner = _runner(adapter, spec, ref.w if fp32 else w, plan, pstates, stream[0], lens, device, trace, use_graphs)
    say(f"  batch {batch} {dtype}: set up in {time.perf_counter() - t0:.1f} s ({'graphed' if use_graphs else 'eager'}"
        f"{': ' + eager_reason if eager_reason else ''}; fp32 floor for {n_floor} steps)")
    positions = list(lens)
    graph_steps = 0
    errs: list[float] = []
    agree = bad = bad_ref = 0
    floor_errs: list[float] = []
    p32_errs: list[float] = []
    floor_agree = p32_agree = decisive = decisive_agree = 0
    checkpoints: list[dict] = []
    win_errs: list[float] = []
    win_agree = win_bad = 0
    spent = {"program": 0.0, "reference": 0.0, "floor": 0.0, "compare": 0.0}
    t_loop = time.perf_counter()
    steps_run = 0
    nonfinite_states = 0
    for t in range(steps):
        ta = time.perf_counter()
        res = runner.run(StepState(num_seqs=batch), tokens=stream[t])
        _sync(device)
        tb = time.perf_counter()
        graph_steps += int(res.graph)
        got = res.outputs["logits"][:batch]
        want = ref.decode(states, states.slots, positions, stream[t])
        _sync(device)
        tc = time.perf_counter()
        w32 = None
        if ref32 is not None and t < n_floor:
            w32 = ref32.decode(states32, states32.slots, positions, stream[t])
            _sync(device)
        td = time.perf_counter()
        parts = _stats(got, want)
        if w32 is not None:
            wd, fd = want.double(), w32.double()
            noise = (wd - fd).abs().max()
            top2 = fd.topk(2, dim=-1).values
            sure = (top2[:, 0] - top2[:, 1]) > 2 * noise
            p_hit = got.argmax(-1) == w32.argmax(-1)
            parts += _stats(want, w32)[:3] + _stats(got, w32)[:3] + [sure.sum().double(), (p_hit & sure).sum().double(),
                                                                      (~torch.isfinite(w32)).sum().double()]
        v = torch.stack(parts).tolist()
        e = v[0] / v[1] if v[1] > 0 else float("nan")
        e = e if v[3] == 0 else float("nan")
        errs.append(e)
        win_errs.append(e)
        agree += int(v[2])
        win_agree += int(v[2])
        bad += int(v[3])
        win_bad += int(v[3])
        bad_ref += int(v[4])
        if w32 is not None:
            floor_errs.append(v[5] / v[6])
            floor_agree += int(v[7])
            p32_errs.append(v[8] / v[9])
            p32_agree += int(v[10])
            decisive += int(v[11])
            decisive_agree += int(v[12])
            bad_ref += int(v[13])
        te = time.perf_counter()
        spent["program"] += tb - ta
        spent["reference"] += tc - tb
        spent["floor"] += td - tc
        spent["compare"] += te - td
        positions = [p + 1 for p in positions]
        steps_run = t + 1
        stop = bool(v[3] or v[4]) or (w32 is not None and bool(v[13]))
        floor_end = ref32 is not None and steps_run == n_floor
        if stop or steps_run % state_every == 0 or steps_run == steps or floor_end:
            drift, nf = state_drift(pstates, states, states.slots, positions)
            nonfinite_states += nf
            worst = max(drift, key=lambda k: (math.isnan(drift[k]), drift[k])) if drift else ""
            cp = {"step": steps_run, "logits_max_rel_err": _nanmax(win_errs),
                  "top1": win_agree / (len(win_errs) * batch),
                  "nonfinite_logits": win_bad, "state_max_rel_err": drift[worst] if worst else None,
                  "state_worst": worst, "nonfinite_states": nf, "states": drift}
            if ref32 is not None and steps_run <= n_floor:
                fl = state_drift(states, states32, states.slots, positions)[0]
                cp["state_floor_max_rel_err"] = max(fl.values()) if fl else None
            checkpoints.append(cp)
            if on_checkpoint is not None:
                on_checkpoint({"batch": batch, "steps": steps, "dtype": dtype, "router_scale": router_scale,
                               "steps_run": steps_run, "max_rel_err": _nanmax(errs),
                               "top1_agreement": agree / (steps_run * batch), "nonfinite_logits": bad,
                               "nonfinite_ref_logits": bad_ref, "nonfinite_states": nonfinite_states + nf,
                               "seconds": round(time.perf_counter() - t0, 1), "checkpoints": list(checkpoints)})
            win_errs, win_agree, win_bad = [], 0, 0
            if nf:
                stop = True
        if floor_end:  # the floor's prefix is over: its reference and states are no longer needed
            ref32 = states32 = None
        if steps_run % progress_every == 0 or stop or steps_run == steps:
            el = time.perf_counter() - t_loop
            per = el / steps_run
            say(f"  batch {batch} {dtype}: step {steps_run}/{steps} ({time.perf_counter() - t0:.0f} s, "
                f"{per * 1e3:.1f} ms/step, ~{per * (steps - steps_run):.0f} s left), top-1 so far "
                f"{agree / (steps_run * batch):.4f}, max rel err so far {_nanmax(errs):.3e}, non-finite "
                f"{bad}/{bad_ref}")
        if stop:
            say(f"  batch {batch} {dtype}: NON-FINITE values at step {steps_run} (program logits {bad}, reference "
                f"logits {bad_ref}, program states {nonfinite_states}): stopped")
            break
    s = trace.summary()
    n = steps_run * batch
    nf_ = len(floor_errs) * batch
    sm = [c["state_max_rel_err"] for c in checkpoints if c["state_max_rel_err"] is not None]
    worst_cp = max(checkpoints, key=lambda c: (math.isnan(c["state_max_rel_err"] or 0.0),
                                               c["state_max_rel_err"] or 0.0)) if checkpoints else None
    sf = [c["state_floor_max_rel_err"] for c in checkpoints if c.get("state_floor_max_rel_err") is not None]
    ms = {k: round(v / max(steps_run, 1) * 1e3, 2) for k, v in spent.items()}
    ms["total"] = round((time.perf_counter() - t_loop) / max(steps_run, 1) * 1e3, 2)
    return LongCheck(batch, steps, router_scale, _nanmax(errs), errs[0], errs[-1], agree / n, s["fast_steps"],
                     round(time.perf_counter() - t0, 1),
                     {c.site.name: c.impl.name for c in plan.choices if c.impl is not None},
                     max(floor_errs) if floor_errs else None, floor_agree / nf_ if floor_errs else None,
                     max(p32_errs) if p32_errs else None, p32_agree / nf_ if p32_errs else None,
                     decisive / nf_ if floor_errs else None, (decisive_agree / decisive) if decisive else None,
                     graph_steps=graph_steps, dtype=dtype, floor_steps=len(floor_errs), steps_run=steps_run,
                     nonfinite_logits=bad, nonfinite_ref_logits=bad_ref, nonfinite_states=nonfinite_states,
                     state_max_rel_err=_nanmax(sm) if sm else None,
                     state_last_rel_err=checkpoints[-1]["state_max_rel_err"] if checkpoints else None,
                     state_worst=f"{worst_cp['state_worst']} @ step {worst_cp['step']}" if worst_cp else "",
                     state_floor_max_rel_err=max(sf) if sf else None, checkpoints=checkpoints,
                     reference_sites=refs, eager_reason=eager_reason, ms_per_step=ms)


def _bits(logits: torch.Tensor) -> torch.Tensor:
    """A checksum of the bits of fp32 ``logits`` [B, V] (position-weighted sum of their int32 views; int64)."""
    x = logits.float().contiguous().view(torch.int32).to(torch.int64)
    wgt = torch.arange(1, x.numel() + 1, device=x.device, dtype=torch.int64).view_as(x)
    return (x * wgt).sum()


def free_running(adapter: Any, batch: int, steps: int, *, variant: str = "medium", device: str = "cuda",
                 seed: int = 0, prompt: int = 12, dtype: str = "bfloat16", router_scale: float = 0.0, runs: int = 2,
                 graphs: str = "auto", say: Callable[[str], None] = print) -> Repeat:
    """Determinism: ``runs`` fresh programs over the same weights and prefilled states each decode ``steps`` greedy
    steps (the token of step t+1 is the argmax of step t, fed back by the graph itself); their token streams must
    be identical, and every step's logits bit for bit (``Repeat``; the caller asserts ``ok``)."""
    from latency_specialized import hardware
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime.gate import StepState
    from latency_specialized.runtime.harness import SpecBoundAdapter
    from latency_specialized.trace import Trace

    dtype = mode(dtype)
    fp32 = dtype == "float32"
    t0 = time.perf_counter()
    spec, w, ref, states, lens, stream = setup(adapter, batch, steps, variant=variant, device=device, seed=seed,
                                               prompt=prompt, router_scale=router_scale, fp32=fp32)
    weights = ref.w if fp32 else w
    hw = hardware.probe() if device == "cuda" else hardware.for_arch("cpu")
    plan = build_plan(SpecBoundAdapter(adapter, spec), get_registry().implementations, hw, tp=1, batch=batch,
                      dtype=dtype)
    use_graphs, eager_reason = decide_graphs(graphs, device, plan)
    streams, sums = [], []
    bad = graph_steps = 0
    for r in range(runs):
        trace = Trace()
        runner = _runner(adapter, spec, weights, plan, states.clone(), stream[0], lens, device, trace, use_graphs)
        toks = torch.empty(steps, batch, dtype=torch.int64, device=device)
        chk = torch.empty(steps, dtype=torch.int64, device=device)
        nonfin = torch.zeros((), dtype=torch.int64, device=device)
        for t in range(steps):
            res = runner.run(StepState(num_seqs=batch))  # no tokens: the previous step's argmax (fed back)
            graph_steps += int(res.graph)
            toks[t] = res.outputs["next_tokens"][:batch]
            lg = res.outputs["logits"][:batch]
            chk[t] = _bits(lg)
            nonfin += (~torch.isfinite(lg)).sum()
            if (t + 1) % 500 == 0:
                say(f"  repeat batch {batch} {dtype}: run {r + 1}/{runs} step {t + 1}/{steps} "
                    f"({time.perf_counter() - t0:.0f} s)")
        bad += int(nonfin)
        streams.append(toks.cpu())
        sums.append(chk.cpu())
        del runner
        if device == "cuda":
            torch.cuda.empty_cache()
    tok_same = all(torch.equal(streams[0], s_) for s_ in streams[1:])
    bits_same = all(torch.equal(sums[0], s_) for s_ in sums[1:])
    first = None
    for s_, c_ in zip(streams[1:], sums[1:]):
        diff = ((s_ != streams[0]).any(-1) | (c_ != sums[0])).nonzero()
        if len(diff):
            first = int(diff[0]) if first is None else min(first, int(diff[0]))
    out = Repeat(batch, steps, dtype, runs, tok_same, bits_same, first, int(torch.unique(streams[0]).numel()), bad,
                 graph_steps, round(time.perf_counter() - t0, 1), eager_reason, router_scale)
    say(f"  repeat batch {batch} {dtype}: {runs} runs x {steps} steps, tokens identical {tok_same}, logits bits "
        f"identical {bits_same}, {out.distinct_tokens} distinct tokens, non-finite {bad}, {out.seconds} s")
    return out


def check(results: Sequence[Any]) -> None:
    """Raise (NonFiniteError / NotDeterministicError) naming every failed run of ``results``."""
    nonfinite = [r for r in results if isinstance(r, LongCheck) and not r.ok]
    if nonfinite:
        raise NonFiniteError("; ".join(f"batch {r.batch} {r.dtype}: {r.nonfinite_logits} non-finite program logits, "
                                       f"{r.nonfinite_ref_logits} reference logits, {r.nonfinite_states} state "
                                       f"elements (stopped after {r.steps_run}/{r.steps} steps)" for r in nonfinite))
    varied = [r for r in results if isinstance(r, Repeat) and not r.ok]
    if varied:
        raise NotDeterministicError("; ".join(f"batch {r.batch} {r.dtype}: tokens identical {r.tokens_identical}, "
                                              f"logits identical {r.logits_identical} (first differing step "
                                              f"{r.first_mismatch_step}), non-finite {r.nonfinite_logits}"
                                              for r in varied))


def _e(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def _p(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(title: str, header: str, runs: Sequence[LongCheck | dict], repeats: Sequence[Repeat | dict] = ()) -> str:
    """A results page like benchmarks/results/h200/*_long_check.md: one row per run (drift, floor, state drift,
    non-finite counts, graph steps, cost), the per-checkpoint drift of every run, the sites on references,
    and the determinism table."""
    rs = [r if isinstance(r, dict) else asdict(r) for r in runs]
    ps = [r if isinstance(r, dict) else asdict(r) for r in repeats]
    out = [f"# {title}", "", header, ""] if header else [f"# {title}", ""]
    if rs:
        out += ["| dtype | batch | steps | routing | program vs its ref: logits rel err (first / last step) | top-1 | "
                "bf16 ref vs fp32 ref (floor): rel err | top-1 | program vs fp32 ref: rel err | top-1 | "
                "decisive tokens | "
                "program top-1 on them | state rel err: max (last checkpoint) | worst state | state floor | "
                "non-finite (logits / ref / states) | graph steps | ms/step (program / ref / floor) | seconds |",
                "|" + "---|" * 19]
        for r in rs:
            routing = ("fixed by the bias (router x0)" if r["router_scale"] == 0
                       else f"random (router x{r['router_scale']:g})")
            floor = f"{_e(r['floor_max_rel_err'])} ({r['floor_steps']} steps)" if r.get("floor_steps") else "-"
            ms = r.get("ms_per_step") or {}
            out.append(
                f"| {'fp32' if r['dtype'] == 'float32' else 'bf16'} | {r['batch']} | {r['steps_run']}/{r['steps']} | "
                f"{routing} | {_e(r['max_rel_err'])} ({_e(r['first_rel_err'])} / {_e(r['last_rel_err'])}) | "
                f"{_p(r['top1_agreement'])} | {floor} | {_p(r['floor_top1'])} | {_e(r['prog_vs_fp32_max_rel_err'])} | "
                f"{_p(r['prog_vs_fp32_top1'])} | {_p(r['decisive_fraction'])} | {_p(r['decisive_top1'])} | "
                f"{_e(r['state_max_rel_err'])} ({_e(r['state_last_rel_err'])}) | {r['state_worst'] or '-'} | "
                f"{_e(r['state_floor_max_rel_err'])} | {r['nonfinite_logits']} / {r['nonfinite_ref_logits']} / "
                f"{r['nonfinite_states']} | {r['graph_steps']}/{r['steps_run']} | "
                f"{ms.get('program', 0):.1f} / {ms.get('reference', 0):.1f} / {ms.get('floor', 0):.1f} | "
                f"{r['seconds']} |")
        out += ["", "Drift by checkpoint (logits: max rel err and top-1 over the steps since the previous checkpoint; "
                "state: max over the declared states, program vs its reference):", "",
                "| dtype | batch | step | logits rel err | top-1 | state rel err | worst state | state floor | "
                "non-finite |",
                "|" + "---|" * 9]
        for r in rs:
            for c in r["checkpoints"]:
                out.append(f"| {'fp32' if r['dtype'] == 'float32' else 'bf16'} | {r['batch']} | {c['step']} | "
                           f"{_e(c['logits_max_rel_err'])} | {_p(c['top1'])} | {_e(c['state_max_rel_err'])} | "
                           f"{c['state_worst'] or '-'} | {_e(c.get('state_floor_max_rel_err'))} | "
                           f"{c['nonfinite_logits']} / {c['nonfinite_states']} |")
        seen = set()
        for r in rs:
            key = (r["dtype"], r["batch"])
            if key in seen:
                continue
            seen.add(key)
            how = "graphed" if r["graph_steps"] else f"eager ({r['eager_reason'] or 'CPU'})"
            sites = r["reference_sites"]
            listed = ", ".join(sites) if len(sites) <= 12 else f"{len(sites)} sites (every one: a CPU plan)"
            out.append("")
            out.append(f"{'fp32' if r['dtype'] == 'float32' else 'bf16'} batch {r['batch']}: {how}; sites on torch "
                       f"references: {listed or 'none'}.")
    if ps:
        out += ["", "Determinism (fresh program, same weights and prefilled states, free-running greedy decode: step "
                "t+1's token is step t's argmax, fed back in the graph; runs compared bit for bit):", "",
                "| dtype | batch | steps | runs | tokens identical | logits bits identical | first differing step | "
                "distinct tokens | non-finite | graph steps | seconds |", "|" + "---|" * 11]
        for p in ps:
            out.append(f"| {'fp32' if p['dtype'] == 'float32' else 'bf16'} | {p['batch']} | {p['steps']} | "
                       f"{p['runs']} | {'yes' if p['tokens_identical'] else '**NO**'} | "
                       f"{'yes' if p['logits_identical'] else '**NO**'} | "
                       f"{'-' if p['first_mismatch_step'] is None else p['first_mismatch_step']} | "
                       f"{p['distinct_tokens']} | {p['nonfinite_logits']} | "
                       f"{p['graph_steps']}/{p['steps'] * p['runs']} | "
                       f"{p['seconds']} |")
    return "\n".join(out) + "\n"


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


def as_dict(r: LongCheck | Repeat) -> dict:
    return asdict(r)


__all__ = ["LongCheck", "Repeat", "teacher_forced", "free_running", "setup", "router_names", "as_dict",
           "graph_replay_equals_eager", "state_drift", "check", "markdown", "NonFiniteError", "NotDeterministicError",
           "reference_sites", "decide_graphs", "mode", "DTYPES", "LIVE_PREFIX_STATES"]
