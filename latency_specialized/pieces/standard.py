"""The standard pieces of a spec: ``compose_standard(spec) -> ComposedModel``.

The one place that maps a spec's block kinds onto the pieces that define their op sites (one
definition per site kind): an adapter built from standard blocks gets its op sites from here
(``ModelAdapter.op_sites`` -> ``ModelAdapter.composed_model`` -> :func:`compose_standard`), and an
adapter with model-specific blocks composes the standard ones with its own (``attention=`` /
``ffn=`` / ``residual=`` / ``embedding=`` / ``head=``).

==============  =======================================================================
spec block      piece
==============  =======================================================================
``kda``         :class:`~latency_specialized.pieces.attention.kda.KDAAttention`
``mla``         :class:`~latency_specialized.pieces.attention.mla.MLAAttention`; with an indexer
                :class:`~latency_specialized.pieces.attention.sparse_mla.SparseMLAAttention` (layers
                that run their own indexer and layers that reuse one are different kinds)
``gqa``         :class:`~latency_specialized.pieces.attention.gqa.GQAAttention` (``qk_norm`` is the
                spec's weightless QK norm)
``sparse_mqa``  :class:`~latency_specialized.pieces.attention.sparse_mqa.SparseMQAAttention` for window-only
                layers; compressed layers need the model's KV / index sources and top-k: an adapter
                composes them (``attention=``)
``dense``       :class:`~latency_specialized.pieces.ffn.dense_mlp.DenseMLP`
``moe``         :class:`~latency_specialized.pieces.ffn.moe.RoutedMoE`, or with ``latent_dim``
                :class:`~latency_specialized.pieces.ffn.latent_moe.LatentMoE` (its defaults: the
                latent RMSNorm after the experts' all-reduce, none before them)
``pre_norm``    :class:`~latency_specialized.pieces.residual.prenorm.PreNormResidual`
``attnres``     :class:`~latency_specialized.pieces.residual.attnres.BlockAttnRes`
``mhc``         :class:`~latency_specialized.pieces.residual.mhc.MHCResidual`
``gated``       :class:`~latency_specialized.pieces.residual.gated.GatedResidual` (no post norms)
==============  =======================================================================

A block with no piece raises :class:`MissingPiece` (a UserError) naming the block, its layers and
the way out; a piece whose op family is not registered yet is refused by the planner
(``ops.plan.build_plan`` names the site and the family). Embedding and head: :class:`TokenEmbedding`
(no norm) and :class:`LMHead` (untied).

Layer kinds: layers are grouped by ``kind(layer)`` (default the spec's ``layer.kind``, e.g.
``'gqa+moe'``); every kind has one piece per role. Where layers of one spec kind need different
pieces (a sliding-window and a full GQA layer) and no ``kind`` is given, the layers whose pieces
differ from the kind's first layer get their own kind ``'<kind>@<first layer>'``.
"""

from __future__ import annotations

from typing import Any, Callable

from latency_specialized.errors import UserError
from latency_specialized.pieces.attention.gqa import GQAAttention
from latency_specialized.pieces.attention.kda import KDAAttention
from latency_specialized.pieces.attention.mla import MLAAttention
from latency_specialized.pieces.attention.sparse_mla import IndexerOptions, SparseMLAAttention, runs_own_indexer
from latency_specialized.pieces.attention.sparse_mqa import SparseMQAAttention
from latency_specialized.pieces.embedding import TokenEmbedding
from latency_specialized.pieces.ffn.dense_mlp import DenseMLP
from latency_specialized.pieces.ffn.latent_moe import LatentMoE
from latency_specialized.pieces.ffn.moe import RoutedMoE
from latency_specialized.pieces.lm_head import LMHead
from latency_specialized.pieces.residual.attnres import BlockAttnRes
from latency_specialized.pieces.residual.gated import GatedResidual
from latency_specialized.pieces.residual.mhc import MHCResidual
from latency_specialized.pieces.residual.prenorm import PreNormResidual
from latency_specialized.runtime.composed import ComposedModel
from latency_specialized.runtime.pieces_api import LayerPieces
from latency_specialized.spec import (DenseMLPSpec, GQAAttentionSpec, KDAAttentionSpec, LayerSpec, MLAAttentionSpec,
                                      ModelSpec, MoESpec, SparseMQAAttentionSpec)

PieceFor = Callable[[LayerSpec], Any]
"""A layer -> its piece for one role (attention or FFN)."""


class MissingPiece(UserError):
    """A spec block no standard piece implements yet."""


def _layers_of(spec: ModelSpec, pred: Callable[[LayerSpec], bool]) -> str:
    idx = [l.index for l in spec.layers if pred(l)]
    return f"layer {idx[0]}" if len(idx) == 1 else f"layers {idx[0]}..{idx[-1]} ({len(idx)})"


def _missing(spec: ModelSpec, what: str, where: str, arg: str) -> MissingPiece:
    return MissingPiece(f"{spec.name}: no standard piece for {what} ({where}) yet: compose it with a piece of your "
                        f"own (compose_standard(spec, {arg}=...)) or define the adapter's op_sites")


def standard_attention(spec: ModelSpec, layer: LayerSpec) -> Any:
    """The standard attention piece of ``layer`` (MissingPiece for a kind without one)."""
    a = layer.attention
    if isinstance(a, KDAAttentionSpec):
        return KDAAttention(a)
    if isinstance(a, MLAAttentionSpec):
        if a.indexer is not None:
            return SparseMLAAttention(a, norm_eps=spec.norm.eps,
                                      indexer=IndexerOptions(full=runs_own_indexer(a.indexer, layer.index)))
        return MLAAttention(a, norm_eps=spec.norm.eps)
    if isinstance(a, GQAAttentionSpec):
        return GQAAttention(a, qk_norm="weightless" if a.qk_norm else None)
    if isinstance(a, SparseMQAAttentionSpec) and a.compress_ratio == 0:
        return SparseMQAAttention(a, norm_eps=spec.norm.eps)
    if isinstance(a, SparseMQAAttentionSpec):
        where = _layers_of(spec, lambda l: getattr(l.attention, "compress_ratio", 0) > 0)
        raise MissingPiece(f"{spec.name}: sparse MQA with compressed KV ({where}) needs the model's KV sources, "
                           "top-k and RoPE base: compose it (compose_standard(spec, attention=...) with "
                           "SparseMQAAttention(a, topk=, kv_source=, rope_theta=))")
    raise _missing(spec, f"{a.kind} attention", _layers_of(spec, lambda l: l.attention.kind == a.kind), "attention")


def standard_ffn(spec: ModelSpec, layer: LayerSpec) -> Any:
    """The standard feed-forward piece of ``layer``."""
    f = layer.ffn
    if isinstance(f, DenseMLPSpec):
        return DenseMLP(f)
    if isinstance(f, MoESpec):
        return LatentMoE(f, norm_eps=spec.norm.eps) if f.latent_dim else RoutedMoE(f)
    raise _missing(spec, f"{f.kind} feed-forward", _layers_of(spec, lambda l: l.ffn.kind == f.kind),
                   "ffn")  # pragma: no cover - every FFN kind of the spec has a piece


def standard_residual(spec: ModelSpec) -> Any:
    """The standard residual piece of ``spec.residual``."""
    kind = spec.residual.kind
    if kind == "pre_norm":
        return PreNormResidual()
    if kind == "attnres":
        return BlockAttnRes.for_spec(spec)
    if kind == "mhc":
        return MHCResidual.for_spec(spec)
    if kind == "gated":
        return GatedResidual.for_spec(spec)
    raise _missing(spec, f"the {kind!r} residual", "every layer", "residual")  # pragma: no cover - every kind has one


def compose_standard(spec: ModelSpec, *, attention: PieceFor | None = None, ffn: PieceFor | None = None,
                     residual: Any = None, embedding: Any = None, head: Any = None,
                     kind: Callable[[LayerSpec], str] | None = None) -> ComposedModel:
    """``spec`` (unsharded) as standard pieces (see the module docstring).

    ``attention`` / ``ffn``: layer -> piece, used instead of the standard piece of that role (return
    ``standard_attention(spec, layer)`` / ``standard_ffn(spec, layer)`` to keep it for a layer);
    ``residual``, ``embedding``, ``head``: pieces used instead of the standard ones; ``kind``: layer ->
    layer kind (the prefix of its sites)."""
    if spec.tp != 1:
        raise UserError(f"{spec.name}: compose the standard pieces from the unsharded spec (it is for TP={spec.tp})")
    attn_for = attention or (lambda l: standard_attention(spec, l))  # noqa: E731
    ffn_for = ffn or (lambda l: standard_ffn(spec, l))
    res = residual if residual is not None else standard_residual(spec)
    canon: dict[Any, Any] = {}

    def once(piece: Any) -> Any:  # one piece object per distinct piece (equal pieces: the first one)
        try:
            return canon.setdefault(piece, piece)
        except TypeError:  # an unhashable piece stays as made
            return piece

    firsts: dict[str, list[tuple[Any, Any, str]]] = {}
    layers = []
    for layer in spec.layers:
        attn, ff = once(attn_for(layer)), once(ffn_for(layer))
        name = kind(layer) if kind is not None else layer.kind
        if kind is None:  # split a spec kind whose layers need different pieces
            groups = firsts.setdefault(name, [])
            for a0, f0, k0 in groups:
                if a0 == attn and f0 == ff:
                    name = k0
                    break
            else:
                if groups:
                    name = f"{name}@{layer.index}"
                groups.append((attn, ff, name))
        layers.append(LayerPieces(layer.index, name, attn, ff))
    return ComposedModel(spec, embedding if embedding is not None else TokenEmbedding(), res, layers,
                         head if head is not None else LMHead())


__all__ = ["MissingPiece", "compose_standard", "standard_attention", "standard_ffn", "standard_residual"]
