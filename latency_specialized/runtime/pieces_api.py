"""The contract between the generic decode program and the layer pieces (docs/composition.md).

The runtime drives pieces through these protocols; ``latency_specialized/pieces/`` implements them
and adapters list them. Nothing here knows a model: a piece is described by what it declares
(op sites, weights, states) and by one forward written against bound ops.

Shapes: ``M`` = rows of the step (the batch bucket x (1 + speculative tokens)), ``H`` = hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Mapping, Protocol, Sequence, runtime_checkable

import torch

from latency_specialized.ops.sites import SiteBuilder
from latency_specialized.quant import layout as quant_layout
from latency_specialized.quant.checkpoint_io import QuantizedWeight
from latency_specialized.spec import ModelSpec

BoundOp = Callable[..., Any]
"""An op-family call as the plan bound it for one site (the family's calling convention)."""


@dataclass(frozen=True)
class WeightDecl:
    """One tensor a piece reads per layer (or per model, for model-level pieces)."""

    name: str
    """Piece-local name, e.g. 'q_proj' or 'experts.w1' (expert-stacked tensors start with 'experts.')."""
    shape: tuple[int, ...]
    """Full (unsharded) shape; expert-stacked tensors lead with the expert count."""
    split: int | None = None
    """Dimension TP splits into equal rank slices (None: every rank keeps it whole)."""
    parts: tuple[int, ...] = ()
    """Sizes along ``split`` of tensors fused in the checkpoint (e.g. q|k|v rows): each part is split
    on its own and the rank's slices are concatenated. Empty: one part."""
    dtype: Literal["act", "float32"] = "act"
    """Storage: the activation dtype, or fp32 whatever the activations are (gates, biases, A_log)."""
    optional: bool = False
    """Absent from a checkpoint is fine (the piece then runs without it)."""
    replicas: int = 1
    """Ranks that hold the same slice (KV heads past TP = num_kv_heads: ``tp // num_kv_heads``): the
    ``split`` dim is cut into ``tp // replicas`` slices and rank ``r`` keeps slice ``r // replicas``."""
    stored: str | None = None
    """The stored format the piece takes this weight in (a ``quant.QuantizedWeight`` is bound as it is: its
    site carries ``weight_format``); None: the activation dtype - a quantized weight given for it (e.g. an FP8
    checkpoint's ``kv_b`` for absorbed MLA) is dequantised when the program binds it."""


@dataclass(frozen=True)
class StateDecl:
    """One cache or recurrent state a piece keeps per layer (allocated by ``runtime/states.py``)."""

    name: str
    """Piece-local name, e.g. 'kv' (paged cache) or 'state' (recurrent rows)."""
    kind: Literal["paged", "rows"]
    """'paged': ``[num_blocks, block_size, *shape]`` addressed through block tables and slot mappings;
    'rows': ``[num_rows, *shape]``, one row per sequence (row 0 = padding scratch)."""
    shape: tuple[int, ...]
    """Per token ('paged') or per sequence row ('rows'), on this rank."""
    dtype: Literal["act", "float32"] = "act"
    """Storage dtype: the activation dtype, or fp32 (recurrent states)."""
    split: int | None = None
    """Dimension of ``shape`` TP splits into rank slices (None: every rank keeps the state whole); with
    ``parts`` and ``replicas`` as in :class:`WeightDecl`, so a rank's copy of a full (TP=1) state is
    generic (``runtime.states.shard_states``)."""
    parts: tuple[int, ...] = ()
    """Sizes along ``split`` of states fused per part (e.g. the q|k|v channels of a conv tail), at this
    declaration's TP; each part is split on its own. Empty: one part."""
    replicas: int = 1
    """Ranks that hold the same slice (KV heads past TP = num_kv_heads)."""


@dataclass
class StepContext:
    """What a piece's forward sees of one decode step (built by the program per step; static views).

    ``ops`` maps site names to bound ops; a piece calls ``step.op(role)`` which adds the layer kind
    prefix. ``meta`` holds the step's static inputs sliced to ``[:M]``: 'tokens', 'positions',
    'slots', 'seq_lens', 'block_table', 'rows' (state rows), 'row_states' (each row's state row: 'rows' itself
    in a plain step).

    A verification step (``spec_tokens = k > 0``, speculative decoding) has ``M = B * (1 + k)`` rows,
    request-major; its per-row meta makes every row a request of its own for paged attention
    (``runtime/step_meta.py``), while 'rows' (state rows) and 'accepted' (int32: draft tokens the
    request's previous verification step accepted, -1 where nothing is pending) are per request, ``[B]``.
    """

    ops: "BoundOps"
    meta: Mapping[str, torch.Tensor]
    rows: int
    """M: rows of this step."""
    comm: Any
    """Communicator of the all-reduce / all-gather sites (a LocalCommunicator on one rank)."""
    tp: int
    rank: int
    spec: ModelSpec
    """The unsharded spec."""
    rank_spec: ModelSpec
    """This rank's shard of the spec."""
    prefix: str = ""
    """The current layer kind ('' for model-level pieces); site names are f'{prefix}/{role}'."""
    layer: int = -1
    """Index of the current layer (-1 for model-level pieces)."""
    scratch: dict[str, torch.Tensor] = field(default_factory=dict)
    """Static buffers the program allocated for the pieces (``Piece.buffers``), by name."""
    memo: dict[Any, Any] = field(default_factory=dict)
    """Values derived from this step's meta, made once per step and shared by every layer that needs them
    (``once``); a new step starts with an empty memo."""
    site_comm: Callable[[str], Any] | None = None
    """Communicator of a communication site by full site name (the program's ``SiteCommunicators`` at
    this bucket: a symmetric-memory workspace where the plan picked a fused kernel); None: ``comm``."""
    spec_tokens: int = 0
    """k: draft tokens per request of this step (0: a plain decode step, one row per request)."""
    dcp: Any = None
    """The program's DCP group (``ops.attention.dcp.DcpGroup``): paged KV caches hold this rank's tokens only and
    the attention pieces that declare ``supports_dcp`` merge across the group; None: whole sequences here."""
    streams: dict[str, Any] = field(default_factory=dict)
    """Side streams the program created before capture (``runtime.side_stream.SideStream``), by name:
    'side' on CUDA devices where a plan site asks for one (attr ``side_stream``); empty on the CPU."""

    def site(self, role: str) -> str:
        return f"{self.prefix}/{role}" if self.prefix else role

    def op(self, role: str) -> BoundOp:
        return self.ops[self.site(role)]

    def once(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()`` the first time ``key`` is asked for in this step, the same value after: per-step metadata
        (e.g. the compressed-cache slots of one compression ratio) computed by the first layer that needs
        it instead of by every such layer - fewer kernels per step. ``key`` must name everything the value
        depends on besides the step's meta."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def skipped(self, role: str) -> bool:
        """True where the plan skips this site at this bucket (fused into another, or absorbed)."""
        return self.site(role) in self.ops.skipped

    def strided_rows(self, role: str) -> bool:
        """True where the site's implementation takes a column slice without a copy."""
        return self.site(role) in self.ops.strided_rows

    def strided_out(self, role: str) -> bool:
        """True where the site's implementation writes a column slice of a wider tensor in place."""
        return self.site(role) in self.ops.strided_out

    def contiguous_for(self, role: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the site takes it: as is where it reads strided rows (or already is contiguous)."""
        return x if x.is_contiguous() or self.strided_rows(role) else x.contiguous()

    def comm_at(self, site: str) -> Any:
        """The communicator the all-reduce site ``site`` (full name) runs on: pass it as the op's ``comm=``."""
        return self.site_comm(site) if self.site_comm is not None else self.comm

    def communicate(self, role: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)``: a communication call outside the plan (an all-gather), run as site
        ``f'{prefix}/{role}'`` so that the op table's hooks (census, trace) see it."""
        return self.ops.communicate(self.site(role), fn, *args, **kw)


def join(parts: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat(parts, dim)`` for a piece's ``arrange`` - but where the parts are adjacent slices, in
    order, of one tensor (a checkpoint's or vLLM's fused q|k|v, gate|up or w1|w3 weight handed over as
    views), the view of that tensor they cover: weights bound to a framework's own tensors stay views,
    no copy. Otherwise a new tensor (``torch.cat``). Quantized weights (``quant.QuantizedWeight``) are joined
    as stored (``quant.layout.cat``: codes and block scales along the logical dim)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, QuantizedWeight):
        return quant_layout.cat(parts, dim)  # type: ignore[arg-type]
    d = dim % first.dim()
    at = first.storage_offset()
    for t in parts:
        if (t.dtype != first.dtype or t.device != first.device or t.stride() != first.stride()
                or t.dim() != first.dim() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or any(t.shape[i] != first.shape[i] for i in range(t.dim()) if i != d)
                or t.storage_offset() != at):
            return torch.cat(list(parts), dim=dim)
        at += t.shape[d] * t.stride(d)
    shape = list(first.shape)
    shape[d] = sum(t.shape[d] for t in parts)
    return first.as_strided(shape, first.stride(), first.storage_offset())


def take_rows(w: "torch.Tensor | QuantizedWeight", index: torch.Tensor) -> "torch.Tensor | QuantizedWeight":
    """Rows ``index`` of a ``[N, K]`` weight in that order (a piece's channel permutation in ``arrange``): a plain
    tensor's ``index_select``, a quantized one's rows with their scales (``quant.layout.take_rows``: exact)."""
    if isinstance(w, QuantizedWeight):
        return quant_layout.take_rows(w, index)
    return w.index_select(0, index)


def row_blocks(w: "torch.Tensor | QuantizedWeight", n: int) -> "torch.Tensor | list[QuantizedWeight]":
    """A ``[n * R, K]`` weight as ``n`` row blocks ``[R, K]`` (a grouped projection's per-group weights; ``[g]`` picks
    one): a contiguous ``[n, R, K]`` tensor, or a list of quantized weights (row-scaled where R ends inside a scale
    block)."""
    if isinstance(w, QuantizedWeight):
        rows = w.shape[0] // n
        if rows % w.fmt.block[0]:  # blocks narrower than a scale block: one scale per row (exact)
            w = quant_layout.row_scaled(w)
        return [quant_layout.narrow(w, 0, g * rows, rows) for g in range(n)]
    return w.reshape(n, w.shape[0] // n, -1).contiguous()


def split_plain(parts: Sequence[str], spec: ModelSpec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(stored head, plain tail) of a fused projection's parts (in column order) under ``spec.linear_format``: where
    the release keeps the trailing parts plain and the others stored (GLM-5.3's indexer ``weights_proj`` after
    ``q_a | kv_a | wk``), the projection runs as two gemms into one output - the head in its stored format (half the
    bytes of its bf16 copy) and the tail in the activation dtype - instead of one dequantised gemm. ``(parts, ())``
    where nothing splits: no format, nothing plain or nothing stored, or plain parts not all at the end."""
    fmt = spec.linear_format
    plain = [fmt is not None and p in fmt.plain for p in parts]
    n = plain.index(True) if any(plain) else len(parts)
    if fmt is None or n in (0, len(parts)) or not all(plain[n:]):
        return tuple(parts), ()
    return tuple(parts[:n]), tuple(parts[n:])


def fused_gemm(step: "StepContext", role: str, h: torch.Tensor, w: Mapping[str, Any], key: str) -> torch.Tensor:
    """``h @ w[key]^T`` through site ``role`` - or, where the piece split the projection (:func:`split_plain`:
    ``w[key + '.plain']`` present), its stored head through ``role`` and its plain tail through ``role + '.plain'``,
    both written into one ``[M, N]`` output (column slices, in the fused order)."""
    tail = w.get(key + ".plain")
    if tail is None:
        return step.op(role)(h, w[key])
    head = w[key]
    n = head.shape[0]
    y = torch.empty(h.shape[0], n + tail.shape[0], dtype=h.dtype, device=h.device)
    step.op(role)(h, head, out=y[:, :n])
    step.op(role + ".plain")(h, tail, out=y[:, n:])
    return y


def with_stored(decls: Sequence[WeightDecl], spec: ModelSpec,
                projections: Mapping[str, Sequence[str]]) -> list[WeightDecl]:
    """``decls`` with ``stored`` set on the weights of every projection site that keeps its weight in the spec's
    stored format (``projections``: site role -> the piece-local weights it joins; ``ModelSpec.kept_linear``
    decides a site as a whole), so the program binds exactly what the sites' ``weight_format`` announces."""
    stored = {p: fmt for parts in projections.values() if (fmt := spec.kept_linear(*parts)) for p in parts}
    return [replace(d, stored=stored[d.name]) if d.name in stored else d for d in decls]


class BoundOps(Protocol):
    """One bucket's bound op table (``runtime/op_table.py``)."""

    skipped: Mapping[str, str]
    strided_rows: frozenset[str]
    strided_out: frozenset[str]

    def __getitem__(self, site: str) -> BoundOp: ...

    def communicate(self, site: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Run a communication call as ``site`` through the table's hooks (not a plan site)."""
        ...


@runtime_checkable
class Piece(Protocol):
    """A reusable part of a layer (attention, FFN) or of the model (embedding, LM head)."""

    role: str
    """'attn', 'ffn', 'embed' or 'head' (what the program hands it and takes from it)."""

    def sites(self, b: SiteBuilder, rank_spec: ModelSpec) -> None:
        """Add this piece's op sites to ``b`` (its prefix / layers are set by the caller)."""
        ...

    def weights(self, spec: ModelSpec, tp: int) -> Sequence[WeightDecl]:
        """The tensors it reads, by piece-local name, full shapes and TP split."""
        ...

    def states(self, spec: ModelSpec, tp: int) -> Sequence[StateDecl]:
        """Caches / recurrent states it keeps per layer (on this rank)."""
        ...

    def arrange(self, w: Mapping[str, torch.Tensor], rank_spec: ModelSpec) -> dict[str, torch.Tensor]:
        """This rank's weights (sharded) in the form the forward's op calls take."""
        ...

    def forward(self, step: StepContext, w: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
                h: torch.Tensor) -> torch.Tensor:
        """``h [M, H]`` (for 'embed': token ids ``[M]``) -> output ``[M, H]`` (a TP partial sum for
        row-parallel outputs; for 'head': logits ``[M, vocab / tp]``)."""
        ...


@runtime_checkable
class ResidualPiece(Protocol):
    """The model's residual scheme: how sublayer outputs join the stream and become inputs."""

    def sites(self, b: SiteBuilder, rank_spec: ModelSpec, where: Literal["attn", "ffn", "final"]) -> None:
        """Sites around one sublayer ('attn' / 'ffn', in the layer-kind prefix) or at the end ('final')."""
        ...

    def weights(self, spec: ModelSpec, tp: int, where: Literal["layer", "final"]) -> Sequence[WeightDecl]:
        """Per-layer residual weights (norms, mixing queries) or the final ones."""
        ...

    def buffers(self, spec: ModelSpec, max_rows: int, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """Static buffers the stream needs across layers (allocated once per program)."""
        ...

    def start(self, step: StepContext, x: torch.Tensor) -> Any:
        """The stream state after the embedding ``x [M, H]``."""
        ...

    def before(self, step: StepContext, rs: Any, w: Mapping[str, torch.Tensor], which: Literal["attn", "ffn"]) -> torch.Tensor:
        """The input of the sublayer ``which`` of layer ``step.layer``."""
        ...

    def after(self, step: StepContext, rs: Any, w: Mapping[str, torch.Tensor], which: Literal["attn", "ffn"],
              y: torch.Tensor) -> None:
        """Join the sublayer's output ``y`` (a TP partial sum) into the stream (the all-reduce sites)."""
        ...

    def finish(self, step: StepContext, rs: Any, w: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The final hidden state ``[M, H]`` (before the LM head)."""
        ...


@dataclass(frozen=True)
class LayerPieces:
    """One layer: its kind (prefix of its sites) and its two sublayer pieces."""

    index: int
    kind: str
    attention: Piece
    ffn: Piece
