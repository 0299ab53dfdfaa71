"""The layer bench's "ours": an adapter's composed program of TP-rank shapes in CUDA graphs, generically.

``LayerBenchHarness(adapter).build_ours(full, tp, kind, layers, batches, device, ...)`` builds what
``latency-specialized bench`` times as "ours" (``bench/layer_bench.py`` reaches it through the
adapter's ``layer_bench()`` hook): the adapter's ``ComposedProgram`` at **TP ``tp``, rank 0**, of
the spec ``adapter.bench_spec(full, tp, kind, layers)`` (``layers`` layers of one kind at the full
model's widths), with random weights of that rank's real shapes drawn on the GPU
(``random_weights.random_rank_weights``) and communication excluded (``ExcludedCommunicator``; the
all-reduce sites bound to the one-rank fused kernel). Its step also embeds, mixes, norms and runs a
small-vocabulary head, so the bench subtracts a 1-layer program's step from a K-layer one's.

What the adapter provides: ``composed_model(spec)`` (its pieces), ``bench_kinds()`` (the benchable
kinds by name: whether a kind reads a KV cache - then its cache holds ``max(contexts) + 1 + steps``
tokens per sequence in blocks of the kind's ``kv_block_size`` - and which layer it stands for),
``bench_spec(full, tp, kind, layers)`` (that kind's layers at their widths) and ``op_sites`` (plans of
the bench spec).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from latency_specialized.comm.base import ExcludedCommunicator
from latency_specialized.errors import UserError
from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
from latency_specialized.runtime.census import KernelCensus
from latency_specialized.runtime.composed import ComposedProgram
from latency_specialized.runtime.graph_runner import CUDAGraphRunner
from latency_specialized.runtime.harness import (LOCAL_ALLREDUCE, OutputRecorder, SpecBoundAdapter,
                                                exclude_communication, make_runner)
from latency_specialized.runtime.random_weights import quantize_routed_experts, random_rank_weights
from latency_specialized.runtime.states import ModelStates
from latency_specialized.trace import Trace


ROUTINGS: tuple[str, ...] = ("random", "shared", "scaled:X")
"""How ours' MoE layers route in the bench: ``random`` (random router weights: every row routes on its own
hidden state), ``shared`` (router weights zeroed: every row of every step takes the experts its layer's
selection bias ranks first, so a verification step's draft rows read the very experts of the request's first
row - the best case for speculative decoding, where the weights read do not grow with the rows) or ``scaled:X``
(0 < X < 1: router weights times X, so the selection bias decides part of the choice and rows share some of
their experts - between the two; the bench reports the distinct experts each cell read)."""


def routing_scale(routing: str) -> float:
    """The factor ``routing`` puts on ours' router weights (random 1, shared 0, ``scaled:X`` X); UserError naming
    the choices for anything else."""
    if routing == "random":
        return 1.0
    if routing == "shared":
        return 0.0
    head, _, x = routing.partition(":")
    try:
        scale = float(x) if head == "scaled" else None
    except ValueError:
        scale = None
    if scale is None or not 0.0 < scale < 1.0:
        raise UserError(f"routing '{routing}': choose one of random, shared, scaled:X (0 < X < 1, e.g. scaled:0.1)")
    return scale


def share_routing(weights: dict[Any, dict[str, dict[str, torch.Tensor]]], scale: float = 0.0) -> int:
    """Scale every FFN router weight of ``weights`` ({layer: {role: {local name: tensor}}}) by ``scale`` in place
    (0: zeroed; see ``ROUTINGS``); returns how many. A model without a router is refused: there is no routing to
    share."""
    n = 0
    for roles in weights.values():
        router = roles.get("ffn", {}).get("router") if isinstance(roles, dict) else None
        if router is not None:
            router.mul_(scale)
            n += 1
    if not n:
        raise UserError("routing 'shared' / 'scaled': these weights have no FFN router ('ffn' / 'router'); bench "
                        "this model with routing 'random'")
    return n


def bench_communicator(tp: int, routing: str) -> ExcludedCommunicator | None:
    """The stand-in group a one-GPU bench runs rank 0 of a TP program on (None at TP 1). Its stand-ins for the
    other ranks' slices of a gathered router are scaled like ours' router weights (``routing_scale``): zeros
    under ``shared`` - what zeroed router weights on every rank would give - so every row ranks the experts by
    the selection bias alone; random stand-ins there would differ per row and spread a verification step's rows
    over many experts again."""
    if tp <= 1:
        return None
    return ExcludedCommunicator(tp, stand_in_std=routing_scale(routing))


def check_routing(routing: str) -> None:
    routing_scale(routing)


@dataclass
class BuiltProgram:
    """One benched program with its buffers, runner, routing recorder and census."""

    spec: Any
    program: ComposedProgram
    buffers: DecodeBuffers
    runner: CUDAGraphRunner
    routing: OutputRecorder
    captured: bool = False
    capture_error: str | None = None
    census: KernelCensus = field(default_factory=KernelCensus)
    """Kernel nodes per site of each captured bucket (kernels with / without communication)."""


class ProgramVariant:
    """A layer-bench Variant over one built program at one batch bucket."""

    def __init__(self, name: str, built: BuiltProgram, batch: int, bucket: int, all_buckets: Sequence[int],
                 context: int | None = None):
        self.name, self.b, self.batch, self.bucket = name, built, batch, bucket
        self.context = 16 if context is None else context  # recurrent-only cells: any context (no KV cache read)
        self.layers = built.spec.num_layers
        self._all = tuple(all_buckets)
        self._load()

    def _load(self) -> None:
        b = self.batch
        g = torch.Generator().manual_seed(1000 + b)
        tokens = torch.randint(0, self.b.spec.vocab_size, (b,), generator=g)
        states = self.b.program.states
        slots = states.slots[:b]
        # ``context`` tokens cached per sequence (the new one goes at position ``context``): what attention reads
        self.b.buffers.load(tokens, [self.context] * b, [s.row for s in slots], states.block_table(slots, device="cpu"))

    def capture(self) -> dict[str, int] | None:
        if self.b.capture_error is not None:  # failed for an earlier batch: do not warm up and fail again
            self._load()
            raise RuntimeError(self.b.capture_error)
        if not self.b.captured:
            try:
                self.b.runner.capture(self._all)  # every bucket at once: largest first, one pool
            except Exception as e:
                self.b.capture_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                self._load()
                raise
            self.b.captured = True
        self._load()
        info = self.b.runner.captures.get(self.bucket)
        return dict(info.nodes) if (info and info.nodes) else None

    def site_kernels(self) -> dict[str, int] | None:
        """Kernel nodes per op site of this bucket's graph (None: not counted)."""
        c = self.b.census.kernels(self.bucket)
        return dict(c) if c is not None else None

    def replay(self) -> None:
        self.b.runner.replay(self.bucket)

    def eager(self) -> None:
        self.b.runner.body(self.bucket)

    def routing(self) -> list[torch.Tensor]:
        """Expert ids of every MoE layer from one eager step (outside the timed graphs)."""
        return [t[: self.batch] for t in self.b.routing.record(lambda: self.b.runner.body(self.bucket))]


def _shared_gemm_note(plan: Any, bucket: int) -> str | None:
    """Which gemm kernels serve inside the fused shared-expert MLP: the plan's inner choices of that site
    (None: the model has no shared experts)."""
    c = next((c for c in plan.choices if c.site.name.endswith("moe.shared")), None)
    if c is None:
        return None  # no shared experts
    if c.impl is None or c.impl.name != "mlp.cutedsl_fused":
        return f"bucket {bucket}: moe.shared served by {c.impl.name if c and c.impl else 'nothing'}"
    inner = {role: ic.impl.name if ic.impl else "NONE" for role, ic in c.inner}
    gu, down = inner.get("gate_up", "NONE"), inner.get("down", "NONE")
    # a gate/up GEMV carries the activation in its epilogue (bf16: mlp.cutedsl_fused's rule, glu_fused)
    act = "SiTU-GLU in the GEMV epilogue" if gu == "gemm.cutedsl_gemv" else "SiTU-GLU kernel"
    return f"bucket {bucket}: moe.shared = mlp.cutedsl_fused with gate/up {gu}, {act}, down {down}"


def with_experts(spec: Any, experts: str | None) -> Any:
    """The bench spec with its routed experts kept in ``experts`` (``spec.with_expert_format``; None: as is);
    UserError where the spec cannot keep them quantized."""
    if not experts:
        return spec
    if not callable(getattr(spec, "with_expert_format", None)):
        raise UserError(f"--experts {experts}: the bench spec {type(spec).__name__} has no with_expert_format(fmt), "
                        "so its routed experts cannot stay quantized")
    return spec.with_expert_format(experts)


def bench_kind(adapter: Any, kind: str, contexts: Sequence[int]) -> Any:
    """The adapter's bench kind ``kind`` (``adapter.bench_kinds()``); UserError naming the kinds it has, or the
    missing ``--context`` of a kind with a KV cache."""
    kinds = adapter.bench_kinds()
    if kind not in kinds:
        raise UserError(f"bench kind {kind!r}: {adapter.name} has {', '.join(kinds) or 'no benchable kinds'}")
    bk = kinds[kind]
    if bk.context and not contexts:
        raise UserError(f"the {kind} bench needs --context (cached tokens per sequence), e.g. 4096,32768")
    return bk


class OursBench:
    """K-layer and 1-layer rank-shaped programs with a graph runner each (see the module docstring)."""

    def __init__(self, adapter: Any, full: Any, tp: int, kind: str, layers: int, batches: Sequence[int],
                 device: torch.device, *, seed: int = 0, say: Callable[[str], None] = print,
                 contexts: Sequence[int] = (), steps: int = 256, routing: str = "random",
                 experts: str | None = None):
        from latency_specialized import hardware
        from latency_specialized.ops.plan import build_plan
        from latency_specialized.plugins import get_registry

        check_routing(routing)
        bk = bench_kind(adapter, kind, contexts)
        # a fixed-size state (no context axis): any context; a KV cache: paged, of the longest context, the
        # adapter's block size, blocks handed out in a shuffled order. Every replay advances the positions
        # in the graph (a cell reloads them once, then replays ``steps`` times): the cache holds that
        # many tokens more, or the last replays would index past the block table
        max_len, block = (max(contexts) + 1 + steps, bk.kv_block_size) if bk.context else (4096, 16)
        reg = get_registry()
        hw = hardware.probe()
        self.kind, self.batches = kind, tuple(batches)
        self.notes: list[str] = []
        self.built: dict[int, BuiltProgram] = {}
        self.experts = experts
        for n_layers in (layers, 1):
            spec = with_experts(adapter.bench_spec(full, tp, kind, n_layers), experts)
            model = adapter.composed_model(spec)
            # plans made for the stand-in communicator (its all-reduce sites are then rebound to the one-rank
            # kernel: exclude_communication); the program refuses a plan its communicator cannot run
            comm = bench_communicator(tp, routing)
            plans = {}
            for b in self.batches:
                plan = build_plan(SpecBoundAdapter(adapter, spec), reg.implementations, hw, tp=tp, batch=b,
                                  dtype="bfloat16", comm=comm)
                plans[plan.bucket] = plan
            weights = random_rank_weights(model, tp, device=device, seed=seed + n_layers)
            if experts:
                quantize_routed_experts(weights, experts)
            if routing != "random":
                share_routing(weights, routing_scale(routing))
            states = ModelStates.allocate(model, max(self.batches), max_len, tp=tp, block_size=block, device=device,
                                          shuffle_seed=seed if bk.context else None)
            for t in states.tensors():  # a live state, not zeros
                t.normal_(0.0, 0.05)
            trace = Trace()
            program = ComposedProgram(model, weights, plans, states, comm=comm, trace=trace, weights_sharded=True)
            del weights  # the program holds the arranged (stacked) copies
            excluded = exclude_communication(program) if tp > 1 else 0
            buffers = DecodeBuffers(BufferSpec(max_batch=program.max_batch,
                                               max_blocks_per_seq=len(states.slots[0].blocks), block_size=block,
                                               pad_state=0), device=device)
            runner = make_runner(program, buffers, buckets=sorted(plans), trace=trace, preserve_state=False)
            # the router sites' expert ids, copied out of one eager step (the roofline counts distinct experts)
            built = BuiltProgram(spec, program, buffers, runner, OutputRecorder(program, "/moe.router", lambda o: o[1]))
            built.census.instrument(program)  # last: it wraps the rebound sites too
            self.built[n_layers] = built
            if n_layers == layers:
                self._notes(plans, tp, excluded, program, kind)
            torch.cuda.synchronize()
            say(f"  built {n_layers}-layer program ({torch.cuda.memory_allocated() / 2**30:.1f} GiB on the GPU)")
        self.layers = layers
        self.description = (f"ComposedProgram x {layers} (+1) {kind}+moe layers, TP{tp} rank shapes, "
                            f"buckets {sorted(self.built[layers].program.plans)}")

    def _notes(self, plans: dict[int, Any], tp: int, excluded: int, program: ComposedProgram, kind: str) -> None:
        for bucket in (min(plans), max(plans)):
            p = plans[bucket]
            impls = sorted({f"{c.site.name.split('/')[-1]}={c.impl.name}" for c in p.choices if c.impl})
            self.notes.append(f"ours plan, bucket {bucket} (TP{tp} plan, rank 0): " + ", ".join(impls))
            shared = _shared_gemm_note(p, bucket)
            if shared is not None:
                self.notes.append(shared)
        sites = {c.site.name.split("/")[-1] for p in plans.values() for c in p.choices}
        latent = any("latent" in s for s in sites)       # the latent MoE's split down-projection (Kimi K3, Muse)
        gathers = sorted(s for s in sites if "all_gather" in s)
        if excluded:
            self.notes.append(
                f"Ours runs the TP{tp} program of rank 0 with communication excluded: its {excluded} all-reduce "
                f"sites run the one-rank implementation ({LOCAL_ALLREDUCE}, the fused residual(+RMSNorm) kernel, "
                "where the site fuses a residual or a norm; a sum-only all-reduce is left out entirely, no kernel, "
                "as stock's)"
                + (f", and its all-gathers ({', '.join(gathers)}) copy the rank's slice into a static buffer whose "
                   "other slices hold random stand-ins" if gathers else "") + "."
                + (" Router and latent down-projection are split across ranks in ours (1/TP of the weights per "
                   "rank, + one all-gather), replicated in stock (no gather)." if latent else ""))
        overlap = "router, latent down-projection and routed experts" if latent else "router and routed experts"
        if "side" in program.streams:
            self.notes.append(f"Shared experts run on a side stream (a parallel branch of the graph), overlapping "
                              f"{overlap}.")
        if "router" in program.streams:
            self.notes.append("From batch 2 the router GEMM runs on a second side stream beside the "
                              + ("latent down-projection (both read only the normed hidden state); joined "
                                 "before the all-gather and the router." if latent else
                                 "rest of the FFN's input work; joined before the router.")
                              + (" KDA layers: the f_b_proj gemm (decay input) runs inside the KDA kernel."
                                 if kind == "kda" else ""))

    def variants(self, batch: int, context: int | None = None) -> tuple[ProgramVariant, ProgramVariant]:
        """(K-layer, 1-layer) variants at ``batch`` (context kinds: ``context`` cached tokens per sequence)."""
        out = []
        for n in (self.layers, 1):
            built = self.built[n]
            bucket = next(b for b in sorted(built.program.plans) if b >= batch)
            out.append(ProgramVariant(f"ours[{n}]", built, batch, bucket, sorted(built.program.plans), context))
        return out[0], out[1]

    def expert_weights(self, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Routed-expert weights (w13 [E, 2I, L], w2 [E, L, I]) of the K-layer program's layers (``QuantizedWeight``
        where the bench keeps them quantized: ``experts``)."""
        layers = self.built[self.layers].program.w_layers
        return [(layers[i % len(layers)]["ffn"]["w13"], layers[i % len(layers)]["ffn"]["w2"]) for i in range(copies)]

    def close(self) -> None:
        self.built.clear()


class LayerBenchHarness:
    """What an adapter's ``layer_bench()`` hook returns: ``build_ours`` over that adapter's pieces."""

    def __init__(self, adapter: Any):
        self.adapter = adapter

    def build_ours(self, full: Any, tp: int, kind: str, layers: int, batches: Sequence[int], device: torch.device,
                   *, seed: int = 0, say: Callable[[str], None] = print, contexts: Sequence[int] = (),
                   steps: int = 256, routing: str = "random", experts: str | None = None) -> OursBench:
        """Entry point used by ``bench/layer_bench.py``; ``kind``: a name of ``adapter.bench_kinds()``;
        ``steps``: decode steps one cell runs after loading its positions (a context kind's KV cache holds
        ``max(contexts) + 1 + steps`` tokens); ``routing``: one of ``ROUTINGS``; ``experts``: a stored format the
        routed experts are kept in (random weights quantized once; None: bf16)."""
        return OursBench(self.adapter, full, tp, kind, layers, batches, device, seed=seed, say=say,
                         contexts=contexts, steps=steps, routing=routing, experts=experts)


__all__ = ["LayerBenchHarness", "OursBench", "ProgramVariant", "BuiltProgram", "ROUTINGS", "bench_communicator",
           "routing_scale", "share_routing", "with_experts"]
