"""Decode step of vLLM's Qwen3-MoE-style model composed from the backend's op families.

Per layer (pre-norm, residual stream ``r``)::

    x = norm(h)                                  attn.norm (first layer; later ones are fused below)
    qkv = gemm(x, W_qkv); q, k = per-head norm   attn.qkv_proj, attn.q_norm, attn.k_norm
    q, k = rotary(q, k); o = attention(q, k, v)  stock vLLM modules (paged KV cache)
    p = gemm(o, W_o)                             attn.o_proj (a partial sum when TP > 1)
    x, r = allreduce + residual + norm(p, r)     attn.allreduce (post-attention norm)
    logits = gemm(x, W_gate); w, ids = route     moe.router_gemm, moe.router
    p = experts(x, w, ids, W13, W2)              moe.experts   (dense layers: mlp)
    x, r = allreduce + residual + norm(p, r)     ffn.allreduce (next layer's input norm / final norm)

A site whose :class:`SiteTable` entry is "stock" calls the vLLM module instead; a stock module
that already all-reduced its output (row-parallel linear, MoE block) is combined with a local
communicator so nothing is summed twice. The result is the hidden state after the final norm,
exactly what the stock ``forward`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from latency_specialized.comm.base import Communicator, LocalCommunicator
from latency_specialized.runtime.vllm_binding import SiteTable
from latency_specialized.spec import ActivationSpec, RouterSpec

_LOCAL = LocalCommunicator()


@dataclass(frozen=True, eq=False)  # holds tensors: identity, not elementwise, equality
class Norm:
    """A bound vLLM RMSNorm."""

    module: Any
    weight: torch.Tensor | None
    eps: float
    zero_centered: bool


@dataclass(frozen=True, eq=False)
class Linear:
    """A bound vLLM linear layer; ``weight`` None means the stock module serves (``why_stock``)."""

    module: Any
    weight: torch.Tensor | None
    why_stock: str
    stock_reduces: bool
    """The stock module all-reduces its output (row parallel, TP > 1)."""


@dataclass(frozen=True, eq=False)
class Attention:
    qkv: Linear
    o_proj: Linear
    q_norm: Norm | None
    k_norm: Norm | None
    rotary: Any
    attn: Any
    q_size: int
    kv_size: int
    head_dim: int


@dataclass(frozen=True, eq=False)
class MoE:
    """A bound MoE block (``why_stock`` non-empty: the stock block serves all its sites)."""

    module: Any
    gate: torch.Tensor | None
    w13: torch.Tensor | None
    w2: torch.Tensor | None
    router: RouterSpec | None
    bias: torch.Tensor | None
    top_k: int
    activation: ActivationSpec
    why_stock: str
    partial: bool
    """Our experts output is a TP partial sum (the intermediate dim is split)."""


@dataclass(frozen=True, eq=False)
class DenseMLP:
    module: Any
    w_gate_up: torch.Tensor | None
    w_down: torch.Tensor | None
    activation: ActivationSpec
    why_stock: str
    partial: bool


@dataclass(frozen=True, eq=False)
class Layer:
    index: int
    kind: str
    """Layer kind of the plan ('gqa+moe', 'gqa+dense'): prefix of its op sites."""
    input_norm: Norm
    attention: Attention
    post_norm: Norm
    ffn: MoE | DenseMLP


def kind_of(ffn: MoE | DenseMLP) -> str:
    return "gqa+moe" if isinstance(ffn, MoE) else "gqa+dense"


class VllmMoEProgram:
    """``step(input_ids, positions, batch) -> hidden_states`` over the bound vLLM modules."""

    def __init__(self, *, embed: Callable[[torch.Tensor], torch.Tensor], layers: list[Layer], final_norm: Norm,
                 sites: SiteTable, comm: Communicator | None):
        self.embed, self.layers, self.final_norm, self.sites = embed, layers, final_norm, sites
        self.comm = comm or _LOCAL

    # ------------------------------------------------------------------ pieces
    def _norm(self, b: int, site: str, norm: Norm, x: torch.Tensor, residual: torch.Tensor | None = None):
        fn = self.sites.fn(b, site)
        if fn is None:
            return norm.module(x) if residual is None else norm.module(x, residual)
        return fn(x, norm.weight, norm.eps, residual=residual, zero_centered=norm.zero_centered)

    def _linear(self, b: int, site: str, lin: Linear, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(y, y still needs the TP all-reduce)."""
        fn = self.sites.fn(b, site)
        if fn is None or lin.weight is None:
            return lin.module(x)[0], False
        return fn(x, lin.weight), True

    def _add_norm(self, b: int, site: str, y: torch.Tensor, partial: bool, residual: torch.Tensor,
                  norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(sum_ranks(y) + residual), sum_ranks(y) + residual)."""
        comm = self.comm if partial else _LOCAL
        fn = self.sites.fn(b, site)
        if fn is not None:
            return fn(y, residual, norm.weight, norm.eps, comm=comm, zero_centered=norm.zero_centered)
        if partial and self.comm.world_size > 1:
            from vllm.distributed import tensor_model_parallel_all_reduce

            y = tensor_model_parallel_all_reduce(y)
        return norm.module(y, residual)

    def _attention(self, b: int, layer: Layer, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, bool]:
        a, k = layer.attention, layer.kind
        qkv, _ = self._linear(b, f"{k}/attn.qkv_proj", a.qkv, x)
        q, kk, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        if a.q_norm is not None:
            q = self._norm(b, f"{k}/attn.q_norm", a.q_norm, q.reshape(q.shape[0], -1, a.head_dim)).reshape(q.shape)
        if a.k_norm is not None:
            kk = self._norm(b, f"{k}/attn.k_norm", a.k_norm, kk.reshape(kk.shape[0], -1, a.head_dim)).reshape(kk.shape)
        q, kk = a.rotary(positions, q, kk)
        o = a.attn(q, kk, v)
        return self._linear(b, f"{k}/attn.o_proj", a.o_proj, o)

    def _ffn(self, b: int, layer: Layer, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        f, k = layer.ffn, layer.kind
        if isinstance(f, MoE):
            gemm, route, experts = (self.sites.fn(b, f"{k}/{r}") for r in ("moe.router_gemm", "moe.router", "moe.experts"))
            if gemm is None or route is None or experts is None:
                return f.module(x), False
            weights, ids = route(gemm(x, f.gate), f.bias, f.top_k, f.router)
            return experts(x, weights, ids, f.w13, f.w2, f.activation), f.partial
        mlp = self.sites.fn(b, f"{k}/mlp")
        if mlp is None:
            return f.module(x), False
        return mlp(x, f.w_gate_up, f.w_down, f.activation), f.partial

    # ------------------------------------------------------------------ step
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: int) -> torch.Tensor:
        """Hidden states [tokens, hidden] after the final norm for a pure decode step of ``batch`` sequences."""
        b = self.sites.bucket(batch)
        h = self.embed(input_ids)
        first = self.layers[0]
        x, residual = self._norm(b, f"{first.kind}/attn.norm", first.input_norm, h), h
        for i, layer in enumerate(self.layers):
            y, partial = self._attention(b, layer, x, positions)
            x, residual = self._add_norm(b, f"{layer.kind}/attn.allreduce", y, partial, residual, layer.post_norm)
            y, partial = self._ffn(b, layer, x)
            nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            x, residual = self._add_norm(b, f"{layer.kind}/ffn.allreduce", y, partial, residual, nxt)
        return x
