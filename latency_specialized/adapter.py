"""The adapter base class every model subclasses: the contract, plus op sites from the spec's pieces.

An adapter names its model, gives its architecture (:meth:`ModelAdapter.spec`), says what its
fast path supports (:meth:`scope`), and lists the op sites of one decode step
(:meth:`op_sites`; the default composes the standard pieces of the spec's layer kinds,
``pieces.standard.compose_standard``, and lists their sites - one definition per site kind - so an
adapter built from standard blocks needs nothing more to be planned). Adapters that can run also
provide a reference, a program and a vLLM binding; ``capabilities`` says which exist so that the
test matrix and the CLI only ask for what is there (the contract and its hooks:
``adapter_contract.AdapterContract``, which is what the planner and the registry hold).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

from latency_specialized.adapter_contract import AdapterContract, Capability, Variant
from latency_specialized.errors import UserError
from latency_specialized.spec import KDAAttentionSpec, LinearFormat, MLAAttentionSpec, ModelSpec, MoESpec, ParallelSpec

__all__ = ["ModelAdapter", "AdapterContract", "BenchKind", "Capability", "Variant", "is_routed_expert", "keep_experts",
           "kept_expert_format", "kept_linear_format", "tiny_only", "with_program_weights", "RUNNABLE"]

RUNNABLE: frozenset[str] = frozenset({"spec", "reference", "program", "checkpoint"})
"""The capabilities of an adapter that runs standalone (add ``quantized_experts``, ``vllm`` as they apply)."""


def kept_expert_format(model: str, asked: str | None, native: str, kept: tuple[str, ...], where: str) -> str | None:
    """The format a model's routed experts stay in on the device (``reference(expert_format=)``, ``generate
    --experts``): None (dequantised at load), or ``asked`` - 'native' meaning ``native``, the format ``where`` stores
    them in - where the adapter keeps that format (``kept``); a UserError naming the choices otherwise."""
    if asked is None:
        return None
    fmt = native if asked == "native" else asked
    if fmt not in kept:
        raise UserError(f"{model} keeps its routed experts as {' / '.join(kept) or 'bf16'} only ({where} stores them "
                        f"as {native}); use --experts native with such a checkpoint, or drop --experts")
    return fmt


def tiny_only(model: str, size: str, params: str, weights: Any = None, *, random: bool = False) -> None:
    """Refuse what only the tiny model can have: a ``make-checkpoint --size`` other than tiny, or (``random=True``)
    random weights (``weights`` None) for the full model - ``params``: its parameter count, for the message."""
    if random and weights is None and size == "full":
        raise UserError(f"no random weights for the full {model} ({params}): pass --checkpoint or use --size tiny")
    if not random and size != "tiny":
        raise UserError(f"{model}: only --size tiny checkpoints can be made (the full model has {params} parameters)")


def with_program_weights(reference: Any, program_weights: dict[str, Any] | None) -> Any:
    """``reference`` carrying the weights its program binds (``keep_experts``' third result; None: its own), which
    ``ComposedAdapter.program`` reads."""
    reference.program_weights = program_weights
    return reference


FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
"""transformers' fused expert tensors (``[E, 2I, K]`` / ``[E, K, I]``, no ``.weight``: e.g. Muse Spark)."""


def is_routed_expert(name: str) -> bool:
    """A routed expert's projection by checkpoint name (``...experts.{e}....weight``, or transformers' fused
    ``...experts.gate_up_proj`` / ``down_proj``; shared experts are named ``shared_experts``, without the dot)."""
    return ".experts." in name and (name.endswith(".weight") or name.endswith(FUSED_EXPERTS))


def kept_linear_format(model: str, asked: str | None, native: LinearFormat | None, where: str) -> LinearFormat | None:
    """How a model's dense projections stay on the device (``reference(linear_format=)``, ``generate --linears``):
    None (dequantised at load), or ``native`` - the format ``where`` stores them in - for 'native' (or its format's
    name); a UserError naming the choice otherwise."""
    if asked is None:
        return None
    if native is None:
        raise UserError(f"{model} keeps its dense projections in the activation dtype only: drop --linears")
    if asked not in ("native", native.format):
        raise UserError(f"{model} keeps its dense projections as {native.format} only ({where} stores them so): use "
                        "--linears native, or drop --linears")
    return native


def _keep(model: str, named: dict[str, Any], program: dict[str, Any], picked: list[str], fmt: str, *,
          checkpoint: Any, dtype: Any, device: Any, what: str, flag: str) -> dict[str, Any]:
    """``named`` (a reference's weights) with ``picked`` as it computes with them, ``program`` updated in place with
    them kept as ``fmt`` stores them: read again as stored from ``checkpoint`` (``named`` is the loader's
    dequantised copy: the same values), or - random weights - quantized once, the reference taking exactly those
    values (``quant.quantized_pair``)."""
    if checkpoint is not None:
        from latency_specialized.runtime.checkpoint import read_quantized

        try:  # fused parameters (no '.weight') have ModelOpt's names in the formats that define them
            program.update(read_quantized(checkpoint, {n: n for n in picked}, fmt, device))
        except ValueError as e:
            raise UserError(f"{model}: the checkpoint stores its {what} fused ({e}): drop {flag} (dequantised at "
                            "load)") from None
        return named
    from latency_specialized.quant import quantized_pair

    # a quantized weight is named ``<base>.weight``: fused expert tensors get the suffix for the codec and back
    alias = {n: n if n.endswith(".weight") else n + ".weight" for n in picked}
    back = {a: n for n, a in alias.items()}
    ref, kept = quantized_pair({alias.get(n, n): t for n, t in named.items()}, fmt, back.__contains__,
                               dtype=dtype, device=device)
    program.update({back[n]: t for n, t in kept.items() if n in back})
    return {back.get(n, n): t for n, t in ref.items()}


def keep_experts(model: str, spec: ModelSpec, named: dict[str, Any], asked: str | None, native: str,
                 kept: tuple[str, ...], *, checkpoint: Any = None, dtype: Any, device: Any,
                 is_expert: Callable[[str], bool] = is_routed_expert, linears: str | None = None,
                 native_linears: LinearFormat | None = None, is_linear: Callable[[str], bool] | None = None
                 ) -> tuple[ModelSpec, dict[str, Any], dict[str, Any] | None]:
    """(spec, reference weights, program weights or None) of a reference whose routed experts - and, with
    ``linears``, its dense projections - stay quantized as stored.

    :func:`kept_expert_format` resolves ``asked``, :func:`kept_linear_format` ``linears`` (``native_linears``: how
    the release stores them; ``is_linear(name)``: the checkpoint names stored so). From ``checkpoint``, the weights
    are read again as stored (codes and scales untouched) beside ``named`` (the loader's dequantised copy: the same
    values); from random ``named``, they are quantized once, the reference then computing with exactly those
    values. The spec says the formats (``with_expert_format`` / ``with_linear_format``: the sites'
    ``weight_format``)."""
    where = "the checkpoint" if checkpoint is not None else "the release"
    fmt = kept_expert_format(model, asked, native, kept, where)
    lin = kept_linear_format(model, linears, native_linears, where)
    if fmt is None and lin is None:
        return spec, named, None
    program: dict[str, Any] = {}
    kw = {"checkpoint": checkpoint, "dtype": dtype, "device": device}
    if fmt is not None:
        experts = [n for n, t in named.items() if is_expert(n) and t.dim() >= 2]  # not their norms' gains
        named = _keep(model, named, program, experts, fmt, what="routed experts", flag="--experts", **kw)
        spec = spec.with_expert_format(fmt)
    if lin is not None:
        if is_linear is None:
            raise UserError(f"{model}: keeping dense projections needs the names the release stores quantized "
                            "(keep_experts(is_linear=))")
        picked = [n for n, t in named.items() if is_linear(n) and not is_expert(n) and t.dim() == 2]
        named = _keep(model, named, program, picked, lin.format, what="dense projections", flag="--linears", **kw)
        spec = spec.with_linear_format(lin)
    return spec, named, {**named, **program}


@dataclass(frozen=True)
class BenchKind:
    """One layer kind of the layer bench (``latency-specialized bench --kinds NAME``): an adapter's
    :meth:`ModelAdapter.bench_kinds` maps each name to one of these. Plain data: the bench reads it, and
    the adapter's ``bench_spec(full, tp, NAME, layers)`` builds "ours" for the same name."""

    layer: int
    """Index of the layer of the full spec this kind stands for: its widths give the stock composition's
    shapes and the roofline bytes (``bench.layer_bench.layer_bytes``)."""
    context: bool
    """True: the layer reads a KV cache, so the bench measures one cell per ``--context`` (the cache holds
    ``max(contexts) + 1 + steps`` tokens per sequence); False: a fixed-size state, one cell per batch."""
    stock: str
    """The bench's stock composition of the layer (``bench/stock/compositions.py``): ``kda_moe`` /
    ``mla_moe`` (Kimi K3's KDA / MLA + latent MoE), ``gqa_moe`` (GQA, windowed or not, + MoE) or ``dsa_moe``
    (MLA with a DSA indexer and sparse attention + MoE)."""
    kv_block_size: int = 16
    """Paged KV-cache block size (tokens) of both variants (context kinds; vLLM's default 16, MLA 64)."""
    router_weight_bytes: int = 2
    """Bytes per router weight element that the roofline counts and stock stores (4: a model whose
    router weight is kept in fp32, as vLLM's GateLinear with ``params_dtype=float32``)."""
    stock_options: Mapping[str, Any] = field(default_factory=dict)
    """Model facts the stock composition needs beyond the generic spec (keywords of its options, e.g.
    ``bench.stock.gqa_moe.StockGQAOptions``: rope layout, sandwich norms, residual gate)."""
    notes: tuple[str, ...] = ()
    """Notes printed with the results whenever this kind is benched."""


_DEFAULT_STOCK = {"kda": "kda_moe", "mla": "mla_moe", "gqa": "gqa_moe"}
"""Attention kind -> the stock composition the default :meth:`ModelAdapter.bench_kinds` names."""


class ModelAdapter(AdapterContract):
    """Base class of every adapter (built-in or third-party): the contract with the standard op sites."""

    def composed_model(self, spec: ModelSpec) -> Any:
        """The model as pieces (a ``runtime.composed.ComposedModel``) of the unsharded ``spec``; default:
        the standard pieces of its layer kinds (``pieces.standard.compose_standard``, which names what has
        no piece yet)."""
        from latency_specialized.pieces.standard import compose_standard

        return compose_standard(spec)

    def op_sites(self, spec: ModelSpec, parallel: ParallelSpec, tokens: int, arch: str, dtype: str, *,
                 context: int | None = None) -> list[Any]:
        """Op sites of one decode step on one rank: the sites of :meth:`composed_model` (``spec`` full or
        sharded for ``parallel.tp``; a sharded spec is composed from this adapter's unsharded one)."""
        full = spec
        if spec.tp != 1:
            full = self.spec(spec.variant)  # type: ignore[arg-type]
            if full.tp != 1 or full.shard(spec.tp) != spec:
                raise UserError(f"{self.name}: op sites of a spec sharded for TP={spec.tp} that is not this adapter's "
                                f"{spec.variant!r} spec: pass the unsharded spec")
        return self.composed_model(full).op_sites(spec, parallel, tokens, arch, dtype, context=context)

    def layer_bench(self) -> Any:
        """The layer bench's "ours": the generic harness over this adapter's pieces and its ``bench_spec`` (an
        adapter without ``bench_spec`` has none: the contract's error)."""
        from latency_specialized.runtime.layer_harness import LayerBenchHarness

        if not callable(getattr(self, "bench_spec", None)):
            return super().layer_bench()
        return LayerBenchHarness(self)

    def bench_kinds(self) -> dict[str, BenchKind]:
        """The layer kinds ``latency-specialized bench`` can measure for this model, by ``--kinds`` name.

        Default: one kind per attention kind of the full spec that has a stock composition, named after
        it (``kda``, ``mla``, ``gqa``), standing for its first layer with a MoE; KDA layers keep a
        fixed-size state (no context axis), the others read a KV cache (MLA: vLLM's block size 64).
        An adapter whose layers of one attention kind differ (windowed vs full attention) overrides it."""
        out: dict[str, BenchKind] = {}
        for layer in self.spec("full").layers:
            a = layer.attention
            if not isinstance(layer.ffn, MoESpec) or a.kind in out or a.kind not in _DEFAULT_STOCK:
                continue
            out[a.kind] = BenchKind(layer=layer.index, context=not isinstance(a, KDAAttentionSpec),
                                    stock=_DEFAULT_STOCK[a.kind],
                                    kv_block_size=64 if isinstance(a, MLAAttentionSpec) else 16)
        return out


class ComposedAdapter(ModelAdapter):
    """An adapter whose program is the generic ``ComposedProgram`` over checkpoint tensors by name (Qwen3-MoE,
    Muse Spark): it gives :meth:`composed_model` and :meth:`tensor_names` (``(layer, role, local) -> name``);
    this class gives the program, the matrix's verification and the op sites of any spec the pieces were
    composed for (bench specs included)."""

    verify_rel_tol: ClassVar[float | None] = None
    """The matrix's fp32 bound for this model (None: ``testing.verify``'s default); a model whose tiny
    reference amplifies rounding sets its own, with the measurement in its notes."""

    def tensor_names(self, spec: ModelSpec) -> Any:
        raise NotImplementedError(f"{self.name}: a ComposedAdapter names its tensors (tensor_names)")

    def program_tensors(self, named: Mapping[str, Any]) -> Mapping[str, Any]:
        """The tensors the name map reads, from the checkpoint's (default: as they are; e.g. halves of a fused
        tensor added as views)."""
        return named

    def op_sites(self, spec: ModelSpec, parallel: ParallelSpec, tokens: int, arch: str, dtype: str,
                 **kw: Any) -> list[Any]:
        return self.composed_model(spec).op_sites(spec, parallel, tokens, arch, dtype, **kw)

    def program(self, spec: ModelSpec, *, plans: Any, cache: Any, reference: Any = None,
                weights: Mapping[str, Any] | None = None, trace: Any = None, comm: Any = None, dcp: Any = None,
                **_: Any) -> Any:
        """``ComposedProgram`` over ``cache`` (this rank's states); full weights by name (``reference.named``
        or ``weights``); ``dcp``: the DCP group of a cache split by token (``ComposedProgram``'s)."""
        from latency_specialized.runtime.composed import ComposedProgram, weights_from_names

        if weights is None:
            if reference is None:
                raise UserError(f"{self.name} program needs weights: pass reference= or weights=")
            # the routed experts kept quantized where the reference was built so (else the reference's own)
            weights = getattr(reference, "program_weights", None) or reference.named
        model = self.composed_model(spec)
        nested = weights_from_names(model, self.program_tensors(weights), self.tensor_names(spec))
        return ComposedProgram(model, nested, plans, cache, comm=comm, trace=trace, dcp=dcp)

    def verify_cell(self, cell: Any, comm: Any = None) -> Any:
        """One matrix cell: the program vs the reference (``testing/verify.py``)."""
        from latency_specialized.testing.verify import REL_TOL, verify_cell

        return verify_cell(self, cell, comm, rel_tol=self.verify_rel_tol or REL_TOL)


__all__ += ["ComposedAdapter"]
