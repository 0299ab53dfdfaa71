"""The Kimi K3 program in CUDA graphs: a runner for decode, and the "ours" side of the layer bench.

``make_runner`` wraps a :class:`KimiK3Program` (unchanged) into the runtime's CUDAGraphRunner: one
graph per batch bucket over static DecodeBuffers, the program's plans prepared before capture.

``build_ours`` builds what ``latency-specialized bench`` times as "ours": the program at **TP
``tp``, rank 0**, with random weights of that rank's real shapes drawn on the GPU (12 KDA heads,
expert intermediate 384, 112 router rows, 448 latent channels ... at TP8) and communication
excluded (``ExcludedCommunicator``; all-reduce sites bound to the one-rank fused kernel). So the
router and the latent down-projection run split across ranks, as the program runs them on a real
TP group. The step also embeds, mixes the final AttnRes, norms and runs a (small-vocabulary) head;
the bench subtracts a 1-layer program's step from a K-layer one's, so per-layer figures hold layers
only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from latency_specialized.comm.base import ExcludedCommunicator
from latency_specialized.errors import UserError
from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
from latency_specialized.runtime.census import KernelCensus
from latency_specialized.runtime.gate import DecodeGate
from latency_specialized.runtime.graph_runner import CUDAGraphRunner
from latency_specialized.spec import KDAAttentionSpec, MLAAttentionSpec, MoESpec
from latency_specialized.trace import Trace

from latency_specialized_models.kimi_k3.spec import KimiK3Spec, build_spec
from latency_specialized_models.kimi_k3.tp import shard_shape
from latency_specialized_models.kimi_k3.weights import expected_tensors, storage_dtype


def make_runner(program: Any, buffers: DecodeBuffers, *, buckets: Sequence[int] | None = None,
                trace: Trace | None = None, fallback: Callable[..., Any] | None = None,
                use_graphs: bool | None = None, preserve_state: bool = True) -> CUDAGraphRunner:
    """A graph runner over ``program`` for the buckets it has plans for (or ``buckets``)."""
    have = sorted(program.plans)
    chosen = tuple(sorted(buckets)) if buckets is not None else tuple(have)
    missing = [b for b in chosen if b not in program.plans]
    if missing:
        raise UserError(f"no plan for bucket(s) {missing}: build the program with plans for them (have {have})")
    gate = DecodeGate(max_batch=program.max_batch, buckets=chosen)
    return CUDAGraphRunner(program, buffers, gate=gate, trace=trace if trace is not None else program.trace,
                           fallback=fallback, use_graphs=use_graphs, preserve_state=preserve_state)


# ------------------------------------------------------------------------------------------ bench: "ours"
def bench_spec(full: KimiK3Spec, tp: int, kind: str, num_layers: int, *, vocab: int = 512) -> KimiK3Spec:
    """``num_layers`` layers of ``kind`` (+MoE) with Kimi K3's full widths (heads, experts, latent ...).

    The program runs it at TP ``tp`` (ExcludedCommunicator: rank 0, communication left out) on
    rank-shaped weights, so every kernel sees the real per-rank shapes of a TP-``tp`` shard.
    Routed experts bf16; a small vocabulary (the LM head is not part of a layer).
    """
    kda = next(l.attention for l in full.layers if isinstance(l.attention, KDAAttentionSpec))
    mla = next(l.attention for l in full.layers if isinstance(l.attention, MLAAttentionSpec))
    moe = next(l.ffn for l in full.layers if isinstance(l.ffn, MoESpec))
    spec = build_spec(variant=f"bench-{kind}x{num_layers}", hidden=full.hidden_size, vocab=vocab * tp,
                      num_layers=num_layers, mla_layers=tuple(range(num_layers)) if kind == "mla" else (),
                      kda_heads=kda.num_heads, head_dim=kda.head_dim, conv=kda.conv_kernel,
                      gate_lower_bound=kda.gate_lower_bound, mla_heads=mla.num_heads, q_lora=mla.q_lora_rank,
                      kv_lora=mla.kv_lora_rank, nope=mla.qk_nope_head_dim, rope=mla.qk_rope_head_dim,
                      v_dim=mla.v_head_dim, experts=moe.num_experts, top_k=moe.top_k, shared=moe.num_shared_experts,
                      expert_inter=moe.expert_intermediate, latent=moe.latent_dim, dense_layers=(),
                      dense_inter=moe.expert_intermediate, block_size=full.residual.block_size or 12,
                      max_context=full.max_context, eps=full.norm.eps, activation=moe.activation,
                      router=moe.router, latent_norm=full.latent_moe_norm, expert_format="bf16")
    spec.shard(tp)  # UserError naming the fix for a TP the model cannot be split by
    return spec


def bench_weights(spec: KimiK3Spec, device: torch.device, *, seed: int = 0, tp: int = 1,
                  dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random weights of rank 0's TP-``tp`` shard of ``spec`` by official name (``tp.shard_weights``
    names and shapes), drawn on ``device`` (GBs: the CPU would take minutes).

    Same scales as weights.random_weights (projections N(0, 1/fan_in of the full tensor), norm
    gains 1 + 0.1 N, ...), not the same values. Each layer's experts are views of one [E, ...]
    tensor per projection. The router weight is bf16, as the checkpoint stores it.
    """
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(shape, dt=dtype, scale=1.0, shift=0.0):
        t = torch.randn(shape, generator=g, device=device, dtype=torch.float32 if dt == torch.float64 else dt)
        return (t * scale + shift).to(dt) if (scale != 1.0 or shift != 0.0) else t.to(dt)

    out: dict[str, torch.Tensor] = {}
    expert_blocks: dict[str, dict[str, torch.Tensor]] = {}
    for name, ts in expected_tensors(spec).items():
        dt = storage_dtype(ts, dtype)
        shape = shard_shape(spec, name, tuple(ts.shape), tp)
        fan_in = ts.shape[-1] ** -0.5
        if ".experts." in name:
            prefix, rest = name.split(".experts.")
            e, proj = rest.split(".")[0], rest.split(".")[1]
            blocks = expert_blocks.setdefault(prefix, {})
            if proj not in blocks:
                n_exp = spec.layers[int(prefix.split(".")[2])].ffn.num_experts  # model.layers.<i>.block_sparse_moe
                blocks[proj] = randn((n_exp, *shape), scale=fan_in)
            out[name] = blocks[proj][int(e)]
            continue
        if ts.init in ("linear", "query", "conv"):
            out[name] = randn(shape, dt, scale=fan_in)
        elif ts.init == "norm":
            out[name] = randn(shape, dt, scale=0.1, shift=1.0)
        elif ts.init == "embed":
            out[name] = randn(shape, dt)
        elif ts.init == "a_log":
            out[name] = torch.log(0.5 + 1.5 * torch.rand(shape, generator=g, device=device)).to(dt)
        elif ts.init == "dt_bias":
            out[name] = randn(shape, dt, scale=0.5, shift=-2.0)
        elif ts.init == "bias":
            out[name] = randn(shape, dt, scale=0.1)
        else:
            raise ValueError(f"unknown init {ts.init} of {name}")
    return out


class ShapedAdapter:
    """The Kimi adapter with another spec: plans get the rank-shaped dims (what the kernels see)."""

    def __init__(self, base: Any, spec: KimiK3Spec):
        self._base, self._spec = base, spec
        self.name = base.name

    def spec(self, variant: str = "full") -> KimiK3Spec:
        return self._spec

    def scope(self):
        return self._base.scope()

    def op_sites(self, *args: Any, **kw: Any):
        return self._base.op_sites(*args, **kw)


@dataclass
class _Built:
    spec: KimiK3Spec
    program: Any
    buffers: DecodeBuffers
    runner: CUDAGraphRunner
    recorded: list[torch.Tensor] = field(default_factory=list)
    recording: bool = False
    captured: bool = False
    capture_error: str | None = None
    census: KernelCensus = field(default_factory=KernelCensus)
    """Kernel nodes per site of each captured bucket (kernels with / without communication)."""


class ProgramVariant:
    """A layer-bench Variant over one built program at one batch bucket."""

    def __init__(self, name: str, built: _Built, batch: int, bucket: int, all_buckets: Sequence[int],
                 context: int | None = None):
        self.name, self.b, self.batch, self.bucket = name, built, batch, bucket
        self.context = 16 if context is None else context  # KDA cells: any context (no KV cache read)
        self.layers = built.spec.num_layers
        self._all = tuple(all_buckets)
        self._load()

    def _load(self) -> None:
        b = self.batch
        g = torch.Generator().manual_seed(1000 + b)
        tokens = torch.randint(0, self.b.spec.vocab_size, (b,), generator=g)
        cache = self.b.program.cache
        slots = cache.slots[:b]
        # ``context`` tokens cached per sequence (the new one goes at position ``context``): what MLA reads
        self.b.buffers.load(tokens, [self.context] * b, [s.row for s in slots],
                            cache.block_table(slots, device="cpu"))

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
        self.b.recorded.clear()
        self.b.recording = True
        try:
            self.b.runner.body(self.bucket)
            torch.cuda.synchronize()
        finally:
            self.b.recording = False
        return [t[: self.batch] for t in self.b.recorded]


LOCAL_ALLREDUCE = "allreduce.cutedsl_local"
"""The one-rank fused residual (+RMSNorm) implementation of the ``allreduce`` family."""


def exclude_communication(program: Any) -> int:
    """Bind every all-reduce site of ``program`` to the one-rank fused kernel (communication left
    out, for the one-GPU bench); returns the number of sites rebound.

    The rank's partial sums are added to the residual as if the other ranks contributed zero: the
    kernel does the same memory traffic as the real fused all-reduce minus the peer exchange.
    """
    from latency_specialized.plugins import get_registry

    # the one-rank fused kernel, reached through its op family's registry (adapters import no kernels)
    one_rank = get_registry().implementations.get(LOCAL_ALLREDUCE).fn
    rebound: list[str] = []

    def hook(site: str, bucket: int, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not site.endswith("allreduce"):
            return fn

        def local(partial, residual, weight, eps, *, comm=None, _fn=one_rank, **kw):
            return _fn(partial, residual, weight, eps, comm=None, **kw)

        rebound.append(site)
        return local

    program.op_table.wrap(hook)
    return len(rebound)


def _shared_gemm_note(plan: Any, spec: KimiK3Spec, arch: str, bucket: int) -> str:
    """Which gemm kernels serve inside the fused shared-expert MLP: the plan's inner choices of that site."""
    c = next((c for c in plan.choices if c.site.name.endswith("moe.shared")), None)
    if c is None or c.impl is None or c.impl.name != "mlp.cutedsl_fused":
        return f"bucket {bucket}: moe.shared served by {c.impl.name if c and c.impl else 'nothing'}"
    inner = {role: ic.impl.name if ic.impl else "NONE" for role, ic in c.inner}
    gu, down = inner.get("gate_up", "NONE"), inner.get("down", "NONE")
    # a gate/up GEMV carries the activation in its epilogue (bf16: mlp.cutedsl_fused's rule, glu_fused)
    act = "SiTU-GLU in the GEMV epilogue" if gu == "gemm.cutedsl_gemv" else "SiTU-GLU kernel"
    return f"bucket {bucket}: moe.shared = mlp.cutedsl_fused with gate/up {gu}, {act}, down {down}"


class OursBench:
    """K-layer and 1-layer rank-shaped programs with a graph runner each (see the module docstring)."""

    def __init__(self, full: KimiK3Spec, tp: int, kind: str, layers: int, batches: Sequence[int],
                 device: torch.device, *, seed: int = 0, say: Callable[[str], None] = print,
                 contexts: Sequence[int] = (), steps: int = 256):
        from latency_specialized import hardware
        from latency_specialized.ops.plan import build_plan
        from latency_specialized.plugins import get_registry
        from latency_specialized_models.kimi_k3.cache import KimiK3Cache
        from latency_specialized_models.kimi_k3.program import KimiK3Program

        if kind not in ("kda", "mla"):
            raise UserError(f"bench kind {kind!r}: use kda or mla")
        if kind == "mla" and not contexts:
            raise UserError("the MLA bench needs --context (cached tokens per sequence), e.g. 4096,32768")
        # KDA: a fixed-size state, any context; MLA: a paged latent cache of the longest context, vLLM's
        # MLA block size 64, blocks handed out in a shuffled order. Every replay advances the positions
        # in the graph (a cell reloads them once, then replays ``steps`` times): the cache holds that
        # many tokens more, or the last replays would index past the block table
        max_len, block = (max(contexts) + 1 + steps, 64) if kind == "mla" else (4096, 16)
        reg = get_registry()
        base = reg.adapter("kimi_k3")
        hw = hardware.probe()
        self.kind, self.batches = kind, tuple(batches)
        self.notes: list[str] = []
        self.built: dict[int, _Built] = {}
        for n_layers in (layers, 1):
            spec = bench_spec(full, tp, kind, n_layers)
            adapter = ShapedAdapter(base, spec)
            # plans made for the stand-in communicator (its all-reduce sites are then rebound to the one-rank
            # kernel: exclude_communication); the program refuses a plan its communicator cannot run
            comm = ExcludedCommunicator(tp) if tp > 1 else None
            plans = {}
            for b in self.batches:
                plan = build_plan(adapter, reg.implementations, hw, tp=tp, batch=b, dtype="bfloat16", comm=comm)
                plans[plan.bucket] = plan
            weights = bench_weights(spec, device, seed=seed + n_layers, tp=tp)
            cache = KimiK3Cache.for_sequences(spec.shard(tp), max(self.batches), max_len, block_size=block,
                                              device=device, shuffle_seed=seed if kind == "mla" else None)
            for t in cache.tensors():  # a live state, not zeros
                t.normal_(0.0, 0.05)
            trace = Trace()
            program = KimiK3Program(spec, weights, plans, cache, trace=trace, comm=comm, weights_sharded=True)
            del weights  # the program holds the arranged (stacked) copies
            excluded = exclude_communication(program) if tp > 1 else 0
            buffers = DecodeBuffers(BufferSpec(max_batch=program.max_batch,
                                               max_blocks_per_seq=len(cache.slots[0].blocks), block_size=block,
                                               pad_state=0), device=device)
            runner = make_runner(program, buffers, buckets=sorted(plans), trace=trace, preserve_state=False)
            built = _Built(spec, program, buffers, runner)
            self._record_routing(built, kind)
            built.census.instrument(program)  # last: it wraps the rebound sites too
            self.built[n_layers] = built
            if n_layers == layers:
                for bucket in (min(plans), max(plans)):
                    p = plans[bucket]
                    impls = sorted({f"{c.site.name.split('/')[-1]}={c.impl.name}" for c in p.choices if c.impl})
                    self.notes.append(f"ours plan, bucket {bucket} (TP{tp} plan, rank 0): " + ", ".join(impls))
                    self.notes.append(_shared_gemm_note(p, spec.shard(tp), hw.arch, bucket))
                if excluded:
                    self.notes.append(
                        f"Ours runs the TP{tp} program of rank 0 with communication excluded: its {excluded} all-reduce "
                        "sites run the one-rank fused residual(+RMSNorm) kernel (allreduce.cutedsl_local) and its "
                        "all-gathers (router logits + latent input, LM head) copy the rank's slice into a static "
                        "buffer whose other slices hold random stand-ins. Router and latent down-projection are "
                        "split across ranks in ours (1/TP of the weights per rank, + one all-gather), replicated in "
                        "stock (no gather).")
                if built.program.side is not None:
                    self.notes.append("Shared experts run on a side stream (a parallel branch of the graph), "
                                      "overlapping router, latent down-projection and routed experts.")
                if built.program.router_side is not None:
                    self.notes.append("From batch 2 the router GEMM runs on a second side stream beside the "
                                      "latent down-projection (both read only the normed hidden state); joined "
                                      "before the all-gather and the router. KDA layers: the f_b_proj gemm "
                                      "(decay input) runs inside the KDA kernel.")
            torch.cuda.synchronize()
            say(f"  built {n_layers}-layer program ({torch.cuda.memory_allocated() / 2**30:.1f} GiB on the GPU)")
        self.layers = layers
        self.description = (f"KimiK3Program x {layers} (+1) {kind}+moe layers, TP{tp} rank shapes, "
                            f"buckets {sorted(self.built[layers].program.plans)}")

    @staticmethod
    def _record_routing(built: _Built, kind: str) -> None:
        # Instrument the router site of every bucket: while ``recording`` (an eager step outside the
        # timed graphs) its expert ids are copied out, so the roofline can count distinct experts.
        router = f"{kind}+moe/moe.router"

        def hook(site: str, bucket: int, fn: Callable[..., Any]) -> Callable[..., Any]:
            if site != router:
                return fn

            def wrapped(*args: Any, _fn=fn, **kw: Any):
                out = _fn(*args, **kw)
                if built.recording:
                    built.recorded.append(out[1].detach().clone())
                return out

            return wrapped

        built.program.op_table.wrap(hook)

    def variants(self, batch: int, context: int | None = None) -> tuple[ProgramVariant, ProgramVariant]:
        """(K-layer, 1-layer) variants at ``batch`` (MLA: ``context`` cached tokens per sequence)."""
        out = []
        for n in (self.layers, 1):
            built = self.built[n]
            bucket = next(b for b in sorted(built.program.plans) if b >= batch)
            out.append(ProgramVariant(f"ours[{n}]", built, batch, bucket, sorted(built.program.plans), context))
        return out[0], out[1]

    def expert_weights(self, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Routed-expert weights (w13 [E, 2I, L], w2 [E, L, I]) of the K-layer program's layers."""
        layers = self.built[self.layers].program.layers
        return [(layers[i % len(layers)].ffn["w13"], layers[i % len(layers)].ffn["w2"]) for i in range(copies)]

    def close(self) -> None:
        self.built.clear()


def build_ours(full: KimiK3Spec, tp: int, kind: str, layers: int, batches: Sequence[int], device: torch.device,
               *, seed: int = 0, say: Callable[[str], None] = print, contexts: Sequence[int] = (),
               steps: int = 256) -> OursBench:
    """Entry point used by ``latency_specialized.bench.layer_bench``; ``steps``: decode steps one cell
    runs after loading its positions (the MLA cache holds ``max(contexts) + 1 + steps`` tokens)."""
    return OursBench(full, tp, kind, layers, batches, device, seed=seed, say=say, contexts=contexts, steps=steps)
