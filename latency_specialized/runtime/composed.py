"""The generic decode program: a model as pieces (docs/composition.md), one program for all of them.

    model = ComposedModel(spec, embedding, residual, layers=[LayerPieces(i, kind, attention, ffn)], head)
    sites = model.op_sites(rank_spec, parallel, tokens, arch, dtype)          # what the plan resolves
    weights = weights_from_names(model, checkpoint_tensors, tensor_name)      # {layer: {role: {local: t}}}
    program = ComposedProgram(model, weights, plans, states, comm=comm)       # a runtime DecodeProgram

Weights are addressed as ``(layer, role, local)``: ``layer`` the layer index (-1: model level),
``role`` the piece ('attn', 'ffn', 'residual' per layer; 'embed', 'head', 'residual' at -1) and
``local`` the piece-local name of its ``WeightDecl``. An adapter maps checkpoint names onto them with
``tensor_name(layer, role, local) -> str`` (``'{e}'`` in the name of an expert-stacked tensor,
``local`` starting with ``experts.``: the loader stacks ``e = 0 .. E-1``).

One step (``ComposedProgram.step``; rows ``[:bucket]`` of the static DecodeBuffers, padded rows
write no KV slot and use state row 0)::

    x = embedding(tokens); rs = residual.start(x)
    per layer (step.prefix = kind, step.layer = index):
        h = residual.before(rs, 'attn'); y = attention(h); residual.after(rs, 'attn', y)
        h = residual.before(rs, 'ffn');  y = ffn(h);       residual.after(rs, 'ffn', y)
    h = residual.finish(rs); logits = head(h)
    TP > 1: all-gather of the vocabulary slices (communication site 'lm_head.all_gather')
    -> static ``logits`` (fp32, NaN before the first step) and ``next_tokens`` (greedy argmax)

A verification step (speculative decoding: plans with ``tokens = bucket * (1 + k)``, ``k > 0``) runs
the same body over ``M = bucket * (1 + k)`` request-major rows, ``StepContext.spec_tokens = k``, with the
per-row meta of ``runtime/step_meta.py`` (each row a request of its own for paged attention; state rows
and ``accepted`` per request); the outputs are then request-major views ``[max_batch, 1 + k, ...]``. One
program serves one ``k`` (all its plans). A piece that keeps per-sequence recurrent states ('rows'
states) must verify itself (``spec_tokens >= k``: its own verification sites, e.g. KDA's tapes);
otherwise the program refuses naming it (:func:`verification_problems`).

A model without a head (``head=None``: the LM head is the host framework's, e.g. vLLM's
``compute_logits`` after its forward) stops after ``residual.finish``: its only output is the static
``hidden`` ``[max_batch, H]`` (activation dtype), the final hidden state - what vLLM's forward returns.

Pieces (the residual included) may define ``buffers(spec, max_rows, dtype, device) -> {name: tensor}``:
the program allocates them once, for its largest bucket, into ``StepContext.scratch`` (one tensor per
name; two pieces asking for one name with one shape share it). On CUDA devices the program creates
the side streams ``StepContext.streams['side']`` (where a plan site has attr ``side_stream``) and
``['router']`` (priority -1) before any capture.

Every op goes through the bucket's bound op table (``runtime/op_table.py``); the program itself
makes no host sync (a CPU reference the plan picks may). At TP > 1 the program keeps its rank's
shard of the full weights (``shard_weight`` by the declarations) unless ``weights_sharded``; the
states must be the rank's (``ModelStates.allocate(model, ..., tp=tp)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from latency_specialized.comm.base import LocalCommunicator
from latency_specialized.errors import UserError
from latency_specialized.ops.plan import Plan
from latency_specialized.ops.sites import OpSite, SiteBuilder
from latency_specialized.quant import layout as quant_layout
from latency_specialized.quant.checkpoint_io import QuantizedWeight
from latency_specialized.quant.formats import QuantFormat
from latency_specialized.runtime.communicators import SiteCommunicators
from latency_specialized.runtime.op_table import OpTable
from latency_specialized.runtime.pieces_api import LayerPieces, Piece, ResidualPiece, StateDecl, StepContext, WeightDecl
from latency_specialized.runtime.states import ModelStates, check_states
from latency_specialized.runtime.step_meta import VerifyRows
from latency_specialized.spec import ModelSpec, ParallelSpec
from latency_specialized.trace import Trace

MODEL = -1
"""Layer index of model-level weights (embedding, head, final residual weights)."""
LAYER_ROLES = ("residual", "attn", "ffn")
MODEL_ROLES = ("embed", "residual", "head")

WeightKey = tuple[int, str, str]
"""(layer or -1, role, piece-local name)."""
Weights = Mapping[int, Mapping[str, Mapping[str, torch.Tensor]]]
"""{layer or -1: {role: {local: tensor}}}."""
TensorName = Callable[[int, str, str], "str | None"]
"""Checkpoint name of (layer, role, local); None: not stored (fine for an optional weight)."""


# ---------------------------------------------------------------------------------------------- model
@dataclass(frozen=True)
class ComposedModel:
    """A model as pieces: what an adapter builds from its spec (see the module docstring).

    Layers of one ``kind`` share their site names, so they must use equal pieces (a piece stands
    for every layer of its kind).
    """

    spec: ModelSpec
    """The unsharded spec."""
    embedding: Piece
    residual: ResidualPiece
    layers: Sequence[LayerPieces]
    head: Piece | None
    """The LM head; None: the program stops at the final hidden state (see the module docstring)."""
    _kinds: dict[str, tuple[LayerPieces, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if self.spec.tp != 1:
            raise UserError(f"{self.spec.name}: build the composed model from the unsharded spec (it is for TP={self.spec.tp})")
        if not self.layers:
            raise UserError(f"{self.spec.name}: a composed model needs at least one layer")
        want = [l.index for l in self.spec.layers]
        got = [l.index for l in self.layers]
        if got != want:
            raise UserError(f"{self.spec.name}: layer pieces for layers {got[:8]}..., the spec has {want[:8]}...: "
                            "give one LayerPieces per spec layer, in order")
        for piece, role, what in ((self.embedding, "embed", "embedding"), (self.head, "head", "head")):
            if piece is None and role == "head":
                continue
            if getattr(piece, "role", None) != role:
                raise UserError(f"{self.spec.name}: the {what} piece has role {getattr(piece, 'role', None)!r}, "
                                f"needs {role!r}")
        kinds: dict[str, list[LayerPieces]] = {}
        for lp in self.layers:
            if getattr(lp.attention, "role", None) != "attn" or getattr(lp.ffn, "role", None) != "ffn":
                raise UserError(f"{self.spec.name}: layer {lp.index} needs an 'attn' piece then an 'ffn' piece "
                                f"(got roles {getattr(lp.attention, 'role', None)!r}, {getattr(lp.ffn, 'role', None)!r})")
            group = kinds.setdefault(lp.kind, [])
            if group and (group[0].attention != lp.attention or group[0].ffn != lp.ffn):
                raise UserError(f"{self.spec.name}: layers {group[0].index} and {lp.index} are both of kind "
                                f"{lp.kind!r} but have different pieces: give them different kinds")
            group.append(lp)
        object.__setattr__(self, "_kinds", {k: tuple(v) for k, v in kinds.items()})

    @property
    def kinds(self) -> dict[str, tuple[LayerPieces, ...]]:
        """Layer kind -> its layers, in order of first appearance."""
        return dict(self._kinds)

    # ------------------------------------------------------------------ sites
    def op_sites(self, spec: ModelSpec, parallel: ParallelSpec, tokens: int, arch: str, dtype: str, *,
                 context: int | None = None) -> list[OpSite]:
        """Sites of one decode step on one rank (``spec`` full or already sharded for ``parallel.tp``),
        in the pieces' order: per layer kind the residual's 'attn' sites, the attention's, the residual's
        'ffn' sites, the FFN's; then the residual's 'final' sites and the head's. An adapter's
        ``op_sites`` returns this, so the plan, ``explain`` and the program see one list. ``context``: the
        longest sequence the plan serves (``SiteBuilder``: the attention sites carry it)."""
        rank_spec = spec if spec.tp == parallel.tp else spec.shard(parallel.tp)
        b = SiteBuilder(arch, dtype, tokens, parallel.tp, context=context)
        self.embedding.sites(b, rank_spec)
        for kind, layers in self._kinds.items():
            b.prefix, b.layers = kind, tuple(l.index for l in layers)
            first = layers[0]
            self.residual.sites(b, rank_spec, "attn")
            first.attention.sites(b, rank_spec)
            self.residual.sites(b, rank_spec, "ffn")
            first.ffn.sites(b, rank_spec)
        b.prefix, b.layers = "", ()
        self.residual.sites(b, rank_spec, "final")
        if self.head is not None:
            self.head.sites(b, rank_spec)
        names = [s.name for s in b.sites]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise UserError(f"{self.spec.name}: pieces declare the sites {dup} twice: one definition per site")
        return b.sites

    # ------------------------------------------------------------------ weights / states
    def weight_decls(self, tp: int = 1) -> dict[WeightKey, WeightDecl]:
        """{(layer | -1, role, local): WeightDecl} of every weight the pieces read (full shapes)."""
        spec = self.spec
        out: dict[WeightKey, WeightDecl] = {}

        def add(layer: int, role: str, decls: Sequence[WeightDecl]) -> None:
            for d in decls:
                key = (layer, role, d.name)
                if key in out:
                    raise UserError(f"{spec.name}: the {role} piece of layer {layer} declares {d.name!r} twice")
                out[key] = d

        add(MODEL, "embed", self.embedding.weights(spec, tp))
        per_kind = {kind: (self.residual.weights(spec, tp, "layer"), ls[0].attention.weights(spec, tp),
                           ls[0].ffn.weights(spec, tp)) for kind, ls in self._kinds.items()}
        for lp in self.layers:
            res, attn, ffn = per_kind[lp.kind]
            add(lp.index, "residual", res)
            add(lp.index, "attn", attn)
            add(lp.index, "ffn", ffn)
        add(MODEL, "residual", self.residual.weights(spec, tp, "final"))
        if self.head is not None:
            add(MODEL, "head", self.head.weights(spec, tp))
        return out

    def stored_split_problems(self, tp: int) -> list[str]:
        """Why the weights kept in a stored format (``WeightDecl.stored``) cannot be cut for ``tp`` ranks: one line
        per declaration whose rank slice would end inside a scale block (a cut the program refuses); empty: they
        split (TP=1 never cuts)."""
        out: list[str] = []
        if tp == 1:
            return out
        for (layer, role, local), d in self.weight_decls(tp).items():
            if d.stored is None or d.split is None:
                continue
            dim = d.split % len(d.shape)
            fmt = QuantFormat.get(d.stored)
            block = {len(d.shape) - 1: fmt.block[1], len(d.shape) - 2: fmt.block[0]}.get(dim, 1)
            parts, n = _slices(d, d.shape[dim], tp, local)
            bad = [p for p in parts if (p // n) % block]
            if bad:
                out.append(f"{_where((layer, role, local))}: a rank's {bad[0] // n} of {bad[0]} values along dim "
                           f"{dim} cut its {fmt.name} {block}-value scale blocks")
        return out

    def state_decls(self, tp: int = 1) -> dict[int, dict[str, list[StateDecl]]]:
        """{layer: {role: [StateDecl]}} (this rank's shapes at ``tp``)."""
        per_kind = {kind: (list(ls[0].attention.states(self.spec, tp)), list(ls[0].ffn.states(self.spec, tp)))
                    for kind, ls in self._kinds.items()}
        return {lp.index: {"attn": per_kind[lp.kind][0], "ffn": per_kind[lp.kind][1]} for lp in self.layers}

    def pieces(self) -> list[Any]:
        """Every distinct piece object (embedding, residual, per kind attention and FFN, head)."""
        out: list[Any] = []
        for p in [self.embedding, self.residual, *(x for ls in self._kinds.values() for x in (ls[0].attention, ls[0].ffn)),
                  self.head]:
            if p is not None and not any(p is q for q in out):
                out.append(p)
        return out


# ---------------------------------------------------------------------------------------------- sharding
def _slices(decl: WeightDecl, size: int, tp: int, what: str) -> tuple[tuple[int, ...], int]:
    """(part sizes along the split dim, slices per part) of ``decl`` at ``tp``; UserError naming the fix."""
    reps = decl.replicas
    if reps < 1 or tp % reps:
        raise UserError(f"{what}: {reps} replicas per slice do not divide TP={tp}")
    n = tp // reps
    parts = tuple(decl.parts) or (size,)
    if sum(parts) != size:
        raise UserError(f"{what}: parts {list(parts)} do not add up to its {size} rows along dim {decl.split}")
    for p in parts:
        if p % n:
            raise UserError(f"TP={tp} not supported: {what} has {p} rows along dim {decl.split}, not divisible by "
                            f"{n}; pick a TP that divides them")
    return parts, n


def rank_shape(decl: WeightDecl, tp: int, what: str = "weight") -> tuple[int, ...]:
    """Shape of one rank's shard of ``decl`` at ``tp``."""
    if tp == 1 or decl.split is None:
        return tuple(decl.shape)
    dim = decl.split % len(decl.shape)
    parts, n = _slices(decl, decl.shape[dim], tp, what)
    shape = list(decl.shape)
    shape[dim] = sum(p // n for p in parts)
    return tuple(shape)


def shard_weight(decl: WeightDecl, tensor: torch.Tensor, rank: int, tp: int, what: str | None = None) -> torch.Tensor:
    """Rank ``rank``'s shard of the full ``tensor`` by ``decl`` (``split``, ``parts``, ``replicas``).

    Each part along ``split`` is cut into ``tp // replicas`` equal slices; the rank keeps slice
    ``rank // replicas`` of every part, concatenated (a contiguous copy: the rank's weight load).
    Unsplit (or TP=1): the tensor itself."""
    what = what or decl.name
    quantized = isinstance(tensor, QuantizedWeight)
    if tuple(tensor.shape) != tuple(decl.shape):
        raise UserError(f"{what} has shape {list(tensor.shape)}, the pieces declare {list(decl.shape)}: "
                        "the weights do not match this model's config")
    if tp == 1 or decl.split is None:
        return tensor
    if not 0 <= rank < tp:
        raise UserError(f"rank {rank} of TP={tp}")
    dim = decl.split % len(tensor.shape)
    parts, n = _slices(decl, tensor.shape[dim], tp, what)
    idx, out, at = rank // decl.replicas, [], 0
    for p in parts:
        per = p // n
        # a quantized weight is cut along the logical dim, each stored tensor at its own granularity
        out.append(quant_layout.narrow(tensor, dim, at + idx * per, per) if quantized
                   else tensor.narrow(dim, at + idx * per, per))
        at += p
    if quantized:
        return quant_layout.cat(out, dim)
    return (out[0] if len(out) == 1 else torch.cat(out, dim=dim)).contiguous()


def _as_declared(t: QuantizedWeight, decl: WeightDecl, what: str) -> "torch.Tensor | QuantizedWeight":
    """A quantized weight as its piece takes it: as stored where the declaration says that format
    (``WeightDecl.stored``), dequantised (fp32, before any TP cut) where it takes the activation dtype."""
    if decl.stored is None:
        return t.dequantize(torch.float32)
    if t.fmt.name.split("/")[0] != decl.stored:  # "<fmt>/rows": one scale per row (quant.layout.cat)
        raise UserError(f"{what} is stored as {t.fmt.name}, its piece takes {decl.stored}: the spec's stored formats "
                        "(MoESpec.expert_format, ModelSpec.linear_format) must name what the weights hold")
    return t


# ---------------------------------------------------------------------------------------------- names
def is_expert_stacked(local: str) -> bool:
    return local.startswith("experts.")


def weights_from_names(model: ComposedModel, named: Mapping[str, torch.Tensor], tensor_name: TensorName) -> dict[
        int, dict[str, dict[str, torch.Tensor]]]:
    """The nested weights ``{layer: {role: {local: tensor}}}`` of ``model`` from checkpoint tensors by name.

    ``tensor_name(layer, role, local)`` gives each declared weight's name; for an expert-stacked
    weight (``local`` 'experts.*') a name with ``'{e}'`` is read per expert and stacked ``[E, ...]``
    (a name without it is taken as already stacked). Raises UserError naming a missing tensor;
    optional weights may be absent (or mapped to None)."""
    out: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for (layer, role, local), d in model.weight_decls(1).items():
        name = tensor_name(layer, role, local)
        where = f"{'model' if layer == MODEL else f'layer {layer}'} {role}.{local}"
        if name is None:
            if d.optional:
                continue
            raise UserError(f"the name map gives no checkpoint tensor for {where}: map every required weight")
        if is_expert_stacked(local) and "{e}" in name:
            names = [name.format(e=e) for e in range(d.shape[0])]
            missing = [n for n in names if n not in named]
            if missing:
                if d.optional and len(missing) == len(names):
                    continue
                raise UserError(f"missing tensor {missing[0]} ({where}, expert {names.index(missing[0])} of "
                                f"{d.shape[0]}): the checkpoint does not match this config")
            parts = [named[n] for n in names]
            t = quant_layout.stack(parts, name) if isinstance(parts[0], QuantizedWeight) else torch.stack(parts)
        elif name in named:
            t = named[name]
        elif d.optional:
            continue
        else:
            raise UserError(f"missing tensor {name} ({where}, shape {list(d.shape)}): the checkpoint does not "
                            "match this config (wrong names or layer count?)")
        out.setdefault(layer, {}).setdefault(role, {})[local] = t
    return out


def named_weights(model: ComposedModel, weights: Weights, tensor_name: TensorName) -> dict[str, torch.Tensor]:
    """The inverse of :func:`weights_from_names`: checkpoint name -> tensor (experts unstacked where the
    name has ``'{e}'``). A tensor two keys share (a tied head) is written once."""
    out: dict[str, torch.Tensor] = {}
    for (layer, role, local), d in model.weight_decls(1).items():
        t = weights.get(layer, {}).get(role, {}).get(local)
        name = tensor_name(layer, role, local)
        if t is None or name is None:
            continue
        if is_expert_stacked(local) and "{e}" in name:
            for e in range(t.shape[0]):
                out[name.format(e=e)] = t[e]
        elif name not in out:
            out[name] = t
    return out


def expected_tensors(model: ComposedModel, tensor_name: TensorName) -> dict[str, tuple[tuple[int, ...], str]]:
    """Checkpoint name -> (full shape, dtype kind 'act' | 'float32') of every required weight: the
    ``expected`` argument of ``runtime.checkpoint.load_checkpoint``."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for (layer, role, local), d in model.weight_decls(1).items():
        name = tensor_name(layer, role, local)
        if name is None or d.optional:
            continue
        if is_expert_stacked(local) and "{e}" in name:
            for e in range(d.shape[0]):
                out[name.format(e=e)] = (tuple(d.shape[1:]), d.dtype)
        else:
            out[name] = (tuple(d.shape), d.dtype)
    return out


# ---------------------------------------------------------------------------------------------- program
class ComposedProgram:
    """The decode step of a :class:`ComposedModel` bound to plans per batch bucket (a runtime DecodeProgram).

    Parameters
    ----------
    model : the composed model (unsharded spec).
    weights : ``{layer | -1: {role: {local: tensor}}}``: full weights (this rank keeps its shard), or the
        rank's shard with ``weights_sharded=True``. A tied head (``head.tied``) without a weight of its
        own reads the embedding's.
    plans : one Plan or {bucket: Plan}, all for this model at TP = ``comm.world_size`` (1 without comm),
        built from ``model.op_sites``.
    states : this rank's :class:`~latency_specialized.runtime.states.ModelStates` (or ``{layer: {name:
        tensor}}``, wrapped by ``ModelStates.external``); updated in place by ``step``.
    comm : communicator of the all-reduce / all-gather sites (None: one rank).
    trace : records the implementation bound to every site.
    dtype : activation dtype (default: the embedding's).
    dcp : optional ``ops.attention.dcp.DcpGroup``: the paged KV caches of ``states`` hold only this rank's
        tokens of every sequence (decode context parallelism, vLLM's layout; ``runtime.dcp_states``), and the
        attention pieces merge their partial outputs across the group; every piece with paged states must
        serve it (``dcp_problems``). Plain decode steps only (no speculative tokens yet).
    """

    def __init__(self, model: ComposedModel, weights: Weights, plans: Plan | Mapping[int, Plan],
                 states: ModelStates | Mapping[int, Mapping[str, torch.Tensor]], *, comm: Any = None,
                 trace: Trace | None = None, weights_sharded: bool = False, dtype: torch.dtype | None = None,
                 dcp: Any = None):
        plans = {plans.bucket: plans} if isinstance(plans, Plan) else dict(plans)
        spec = model.spec
        if not plans:
            raise UserError(f"the {spec.name} program needs at least one plan (build_plan for its batch)")
        tp = next(iter(plans.values())).parallel.tp
        world = comm.world_size if comm is not None else 1
        if tp != world:
            raise UserError(f"plans are for TP={tp} but the communicator has {world} rank(s): build the plans with "
                            "the communicator's world size")
        for bucket, plan in plans.items():
            if plan.model != spec.name or plan.parallel.tp != tp or plan.bucket != bucket:
                raise UserError(f"plan {plan.model} TP={plan.parallel.tp} bucket {plan.bucket} does not fit "
                                f"{spec.name} at TP={tp}, bucket {bucket}: build one plan per bucket for this model")
            k = spec_tokens_of(plan)
            if k != spec_tokens_of(next(iter(plans.values()))):
                raise UserError(f"plans for {sorted({spec_tokens_of(p) for p in plans.values()})} speculative tokens "
                                "per step: one program serves one k (build one program per k)")
            want = [s.name for s in model.op_sites(spec, ParallelSpec(tp=tp), plan.tokens, plan.hardware.arch,
                                                   plan.dtype)]
            have = {c.site.name for c in plan.choices}
            missing = [n for n in want if n not in have]
            if missing:
                raise UserError(f"the plan of bucket {bucket} lacks the sites {missing[:6]} the pieces call: build it "
                                "with an adapter whose op_sites is this model's (ComposedModel.op_sites)")
        self.spec_tokens = k = spec_tokens_of(next(iter(plans.values())))
        """k: draft tokens per request of this program's steps (0: plain decode steps)."""
        problems = verification_problems(model, k, tp)
        if problems:
            raise UserError(f"{spec.name}: no verification steps with {k} speculative tokens: " + "; ".join(problems))
        if dcp is not None:
            problems = dcp_problems(model, k, tp)
            if problems:
                raise UserError(f"{spec.name}: no decode context parallelism: " + "; ".join(problems))
        self.dcp = dcp
        """The DCP group of the paged attention (None: every rank holds whole sequences)."""
        self.model, self.spec = model, spec
        self.tp, self.rank = tp, (comm.rank if comm is not None else 0)
        self.rank_spec = spec.shard(tp) if tp > 1 else spec
        self.comm = comm
        self._step_comm = comm if comm is not None else LocalCommunicator()

        rank_w = self._rank_weights(weights, weights_sharded)
        embed = rank_w[MODEL]["embed"].get("weight")
        if embed is None:
            raise UserError(f"{spec.name}: the embedding piece declares no 'weight': the program reads its device "
                            "and dtype from it")
        self.device = embed.device
        self.dtype = dtype if dtype is not None else embed.dtype
        rank_w = {i: {r: {n: self._cast(t, self._decls[(i, r, n)]) for n, t in by.items()} for r, by in roles.items()}
                  for i, roles in rank_w.items()}
        rs = self.rank_spec
        self.w_embed = model.embedding.arrange(rank_w[MODEL]["embed"], rs)
        self.w_head = model.head.arrange(rank_w[MODEL]["head"], rs) if model.head is not None else {}
        self.w_final = dict(rank_w[MODEL].get("residual", {}))
        self.w_layers: list[dict[str, dict[str, torch.Tensor]]] = []
        for lp in model.layers:
            w = rank_w.get(lp.index, {})
            self.w_layers.append({"residual": dict(w.get("residual", {})),
                                  "attn": lp.attention.arrange(w.get("attn", {}), rs),
                                  "ffn": lp.ffn.arrange(w.get("ffn", {}), rs)})

        if not isinstance(states, ModelStates):
            states = ModelStates.external(model, states, tp=tp)
        check_states(model, states, tp)
        if dcp is not None and states.block_size is not None:
            dcp.layout.check_block_size(states.block_size)
        self.states = states
        own = model.state_decls(tp)
        self._state_of: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
        """Per layer: (the attention's states, the FFN's states), each piece its own declared names."""
        for lp in model.layers:
            layer_states = states.layer(lp.index)
            self._state_of.append(tuple({d.name: layer_states[d.name] for d in own[lp.index][role]}  # type: ignore[misc]
                                        for role in ("attn", "ffn")))

        self.trace = trace if trace is not None else Trace()
        self.plans = dict(sorted(plans.items()))
        self.op_table = OpTable(self.plans, self.trace)
        """The bound ops per bucket; census, trace and bench instrument them through ``op_table.wrap``."""
        self.calls = self.op_table.calls
        """Op-site calls made by ``step`` (proof that the program, not the reference, ran)."""
        self.steps_run = 0
        """Completed ``step`` calls."""
        self.census: Any = None
        """Set by ``KernelCensus.instrument`` (it counts through ``op_table.wrap``)."""
        self.max_batch = max(self.plans)
        self.max_rows = max(p.tokens for p in self.plans.values())
        """Rows of the largest step (``max_batch * (1 + spec_tokens)``): what scratch and outputs hold."""

        self.scratch = self._buffers()
        self.logits: torch.Tensor | None = None
        self.next_tokens: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        """The final hidden state ``[max_rows, H]`` of a model without a head (else None)."""
        if model.head is not None:
            self.logits = torch.full((self.max_rows, spec.vocab_size), float("nan"), dtype=torch.float32,
                                     device=self.device)
            self.next_tokens = torch.zeros(self.max_rows, dtype=torch.int64, device=self.device)
        else:
            self.hidden = torch.zeros(self.max_rows, spec.hidden_size, dtype=self.dtype, device=self.device)
        self._verify_rows: VerifyRows | None = None
        """The per-row meta buffers of verification steps (made on the first step: they need the buffers'
        block-table width)."""
        self.streams: dict[str, Any] = {}
        """Side streams for the pieces (``StepContext.streams``), created before any capture."""
        if self.device.type == "cuda":
            from latency_specialized.runtime.side_stream import SideStream

            if any(c.site.ctx.attr("side_stream") for p in self.plans.values() for c in p.choices):
                self.streams["side"] = SideStream(self.device)
            self.streams["router"] = SideStream(self.device, priority=-1)
        # last (it may allocate peer-mapped memory; collective): the communicator of every all-reduce site
        self.site_comms = SiteCommunicators(self.plans, comm, self.device)
        """(bucket, site) -> communicator of the all-reduce sites; ``close()`` releases what it built."""
        self._site_comm = {b: (lambda site, _b=b: self.site_comms(_b, site)) for b in self.plans}

    # ------------------------------------------------------------------ construction helpers
    def _cast(self, t: torch.Tensor, d: WeightDecl) -> torch.Tensor:
        """``t`` in its declared storage dtype (the activation dtype, or fp32 - fp64 in fp64 runs). A quantized
        weight the piece takes as stored (``WeightDecl.stored``) stays so (the kernels and references dequantise
        it); ``_rank_weights`` dequantised the others."""
        if isinstance(t, QuantizedWeight) or not t.is_floating_point():
            return t
        want = self.dtype if d.dtype == "act" else (torch.float64 if self.dtype == torch.float64 else torch.float32)
        return t if t.dtype == want else t.to(want)

    def _rank_weights(self, weights: Weights, sharded: bool) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
        """This rank's weights by key, checked against the declarations (missing, unknown, shape)."""
        model, tp, rank = self.model, self.tp, self.rank
        self._decls = decls = model.weight_decls(tp)
        given = {(i, r, n): t for i, roles in weights.items() for r, by in roles.items() for n, t in by.items()}
        if getattr(model.head, "tied", False) and (MODEL, "head", "weight") not in given \
                and (MODEL, "embed", "weight") in given:
            given[(MODEL, "head", "weight")] = given[(MODEL, "embed", "weight")]
        unknown = sorted(set(given) - set(decls))
        if unknown:
            raise UserError(f"{model.spec.name}: weights {[_where(k) for k in unknown[:4]]} are not declared by the "
                            "pieces: fix the name map (or the pieces' options)")
        out: dict[int, dict[str, dict[str, torch.Tensor]]] = {MODEL: {r: {} for r in MODEL_ROLES}}
        for key, d in decls.items():
            t = given.get(key)
            if t is None:
                if d.optional:
                    continue
                raise UserError(f"{model.spec.name}: missing weight {_where(key)} (shape {list(d.shape)}): pass every "
                                "declared weight (weights_from_names maps a checkpoint onto them)")
            if isinstance(t, QuantizedWeight):
                t = _as_declared(t, d, _where(key))
            if sharded:
                want = rank_shape(d, tp, _where(key))
                if tuple(t.shape) != want:
                    raise UserError(f"{model.spec.name}: weight {_where(key)} has shape {list(t.shape)}, rank {rank} of "
                                    f"TP={tp} needs {list(want)}: pass the rank's shard (or weights_sharded=False)")
            else:
                t = shard_weight(d, t, rank, tp, _where(key))
            out.setdefault(key[0], {}).setdefault(key[1], {})[key[2]] = t
        return out

    def _buffers(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for piece in self.model.pieces():
            make = getattr(piece, "buffers", None)
            if make is None:
                continue
            for name, t in make(self.spec, self.max_rows, self.dtype, self.device).items():
                old = out.get(name)
                if old is not None and (old.shape != t.shape or old.dtype != t.dtype):
                    raise UserError(f"two pieces ask for the scratch buffer {name!r} with different shapes "
                                    f"({list(old.shape)} {old.dtype} vs {list(t.shape)} {t.dtype}): name them apart")
                out.setdefault(name, t)
        return out

    # ------------------------------------------------------------------ DecodeProgram protocol
    def prepare(self, bucket: int) -> None:
        """Warm every implementation of the bucket's plan (compile hooks) before any capture."""
        self.op_table.prepare(bucket)

    def state_tensors(self) -> Sequence[torch.Tensor]:
        return self.states.tensors()

    def outputs(self) -> Mapping[str, torch.Tensor]:
        """'logits' ``[rows, vocab]`` and 'next_tokens' ``[rows]`` (or 'hidden' ``[rows, H]``); in a
        verification program request-major views ``[max_batch, 1 + k, ...]``, so ``[:n]`` are n requests."""
        out = {"hidden": self.hidden} if self.hidden is not None else {"logits": self.logits,
                                                                        "next_tokens": self.next_tokens}
        if self.spec_tokens:
            T = 1 + self.spec_tokens
            out = {n: t.view(self.max_batch, T, *t.shape[1:]) for n, t in out.items()}
        return out

    def close(self) -> None:
        """Release the communication workspaces this program built (collective: every rank calls it)."""
        self.site_comms.close()

    @torch.no_grad()
    def step(self, buffers: Any, bucket: int) -> None:
        """One decode step over rows ``[:bucket]`` of ``buffers`` (a DecodeBuffers); a verification step
        (``spec_tokens > 0``) over the ``bucket * (1 + k)`` rows of requests ``[:bucket]``."""
        ops = self.op_table[bucket]
        model, k = self.model, self.spec_tokens
        if k:
            meta = self._verify_meta(buffers, bucket)
        else:
            meta = {"tokens": buffers.tokens[:bucket], "positions": buffers.positions[:bucket],
                    "slots": buffers.slot_mapping[:bucket], "seq_lens": buffers.seq_lens[:bucket],
                    "block_table": buffers.block_tables[:bucket], "rows": buffers.state_indices[:bucket],
                    "row_states": buffers.state_indices[:bucket]}   # one row per request: the same
        b = bucket * (1 + k)
        step = StepContext(ops=ops, meta=meta, rows=b, comm=self._step_comm, tp=self.tp, rank=self.rank,
                           spec=self.spec, rank_spec=self.rank_spec, scratch=self.scratch,
                           site_comm=self._site_comm[bucket], streams=self.streams, spec_tokens=k, dcp=self.dcp)
        residual = model.residual
        x = model.embedding.forward(step, self.w_embed, {}, meta["tokens"])
        rs = residual.start(step, x)
        for lp, w, (s_attn, s_ffn) in zip(model.layers, self.w_layers, self._state_of):
            step.prefix, step.layer = lp.kind, lp.index
            h = residual.before(step, rs, w["residual"], "attn")
            residual.after(step, rs, w["residual"], "attn", lp.attention.forward(step, w["attn"], s_attn, h))
            h = residual.before(step, rs, w["residual"], "ffn")
            residual.after(step, rs, w["residual"], "ffn", lp.ffn.forward(step, w["ffn"], s_ffn, h))
        step.prefix, step.layer = "", MODEL
        h = residual.finish(step, rs, self.w_final)
        if self.hidden is not None:  # no head: the final hidden state is the output
            self.hidden[:b].copy_(h)
            self.steps_run += 1
            return
        logits = model.head.forward(step, self.w_head, {}, h)
        if logits.shape[-1] != self.spec.vocab_size:  # this rank's vocabulary slice: every rank's, in rank order
            logits = ops.communicate("lm_head.all_gather", self.comm.all_gather, logits, dim=-1)
        self.logits[:b].copy_(logits)
        self.next_tokens[:b].copy_(logits.argmax(-1))
        self.steps_run += 1

    def _verify_meta(self, buffers: Any, bucket: int) -> dict[str, torch.Tensor]:
        if self._verify_rows is None:
            self._verify_rows = VerifyRows(self.max_batch, self.spec_tokens, buffers.block_tables.shape[1],
                                           self.device)
        return self._verify_rows.fill(buffers, bucket)


def spec_tokens_of(plan: Plan) -> int:
    """k of a plan: its ``tokens`` are ``bucket * (1 + k)`` (UserError for anything else)."""
    if plan.tokens < plan.bucket or plan.tokens % plan.bucket:
        raise UserError(f"plan of bucket {plan.bucket} has {plan.tokens} tokens per step, not bucket x (1 + k): "
                        "build it with build_plan(spec_tokens=k)")
    return plan.tokens // plan.bucket - 1


def verification_problems(model: ComposedModel, k: int, tp: int = 1) -> list[str]:
    """Why ``model`` cannot run verification steps of ``k`` draft tokens (empty: it can; k = 0: always).

    The program treats every row of a verification step as a request of its own (``runtime/step_meta.py``),
    which is exact for pieces without per-sequence states (projections, FFNs, residuals) and for paged
    attention (the ops write all rows' KV before any row attends). A piece with 'rows' states (a
    recurrence per sequence) must run its request's 1 + k tokens in order and roll back the rejected
    ones itself: it says so with ``spec_tokens >= k`` (KDA's verification sites and tapes)."""
    if k <= 0:
        return []
    out = []
    for kind, piece in _kind_pieces(model):
        rows = [d.name for d in piece.states(model.spec, tp) if d.kind == "rows"]
        have = getattr(piece, "spec_tokens", None)
        if not rows or (have or 0) >= k:
            continue
        name = type(piece).__name__
        fix = (f"build it with spec_tokens >= {k} (the adapter's spec for {k} speculative tokens)"
               if have is not None else "it has no verification path yet (speculative steps run stock)")
        out.append(f"layers of kind {kind!r}: the {name} piece keeps per-sequence states {rows} and verifies "
                   f"{have or 0} speculative tokens: {fix}")
    return out


def dcp_problems(model: ComposedModel, k: int = 0, tp: int = 1) -> list[str]:
    """Why ``model`` cannot run with its paged KV caches split across a DCP group (empty: it can). Every piece
    with paged states must read them through the group (``supports_dcp``: the GQA and dense MLA pieces); the
    'rows' states (recurrences, rings) stay whole on every rank. No verification steps with DCP yet."""
    out = [f"{k} speculative tokens: DCP serves plain decode steps only (build the program for k = 0)"] if k else []
    for kind, piece in _kind_pieces(model):
        paged = [d.name for d in piece.states(model.spec, tp) if d.kind == "paged"]
        if paged and not getattr(piece, "supports_dcp", False):
            out.append(f"layers of kind {kind!r}: the {type(piece).__name__} piece keeps paged states {paged} "
                       "and has no DCP path (GQAAttention and MLAAttention have one)")
    return out


def _kind_pieces(model: ComposedModel):
    """(layer kind, piece) for the attention and FFN piece of each layer kind (one instance serves every layer
    of its kind)."""
    for kind, layers in model.kinds.items():
        yield kind, layers[0].attention
        yield kind, layers[0].ffn


def _where(key: WeightKey) -> str:
    layer, role, local = key
    return f"{'model' if layer == MODEL else f'layer {layer}'} {role}.{local}"


__all__ = ["ComposedModel", "ComposedProgram", "LayerPieces", "MODEL", "dcp_problems", "shard_weight", "rank_shape",
           "spec_tokens_of", "verification_problems",
           "weights_from_names", "named_weights", "expected_tensors", "is_expert_stacked"]
