"""Tensor-parallel shards of Kimi K3 weights and decode state (what one rank stores).

The split follows vLLM's Kimi K3 layers: column-parallel q/k/v/g/b/f_b projections, conv taps,
A_log and dt_bias of the rank's KDA heads (f_a replicated); the rank's MLA heads in q_b/kv_b/g
(the latent projections replicated); the rank's slice of every expert's and of the shared and
dense MLPs' intermediate width; row-parallel o_proj/down projections (partial sums, all-reduced);
the rank's hidden slice of the latent up-projection (vLLM's sharded latent-MoE tail) and its
vocabulary slice of the LM head. Unlike stock vLLM (which replicates them), the router and the
latent down-projection are split by output rows too: rank r scores experts r*E/tp.. and projects
latent channels r*L/tp.., and one all-gather joins them (ops/tp_moe.py). Norms, AttnRes, the
router's selection bias and the embedding are replicated. Names stay the official ones; shapes become per-rank.
"""

from __future__ import annotations

import re

import torch

from latency_specialized.spec import DenseMLPSpec, KDAAttentionSpec, MLAAttentionSpec, MoESpec

from latency_specialized_models.kimi_k3.cache import KimiK3Cache
from latency_specialized_models.kimi_k3.spec import KimiK3Spec


def _rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = t.shape[0] // tp
    return t[rank * n:(rank + 1) * n].contiguous()


def _cols(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = t.shape[1] // tp
    return t[:, rank * n:(rank + 1) * n].contiguous()


def shard_rule(spec: KimiK3Spec, name: str) -> str:
    """How rank r keeps tensor ``name`` at TP > 1: ``"rows"`` / ``"cols"`` (its equal slice of dim 0 / 1)
    or ``"full"`` (replicated). ``spec`` is the unsharded spec."""
    m = re.match(r"^model\.layers\.(\d+)\.(.*)$", name)
    rest = m.group(2) if m else name
    layer = spec.layers[int(m.group(1))] if m else None
    if layer is not None and rest.startswith("self_attn."):
        a, leaf = layer.attention, rest[len("self_attn."):]
        if isinstance(a, KDAAttentionSpec):
            if leaf in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "g_proj.weight", "b_proj.weight",
                        "f_b_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "A_log",
                        "dt_bias"):
                return "rows"
            if leaf == "o_proj.weight":
                return "cols"
        elif isinstance(a, MLAAttentionSpec):
            if leaf in ("q_b_proj.weight", "q_proj.weight", "kv_b_proj.weight", "g_proj.weight"):
                return "rows"
            if leaf == "o_proj.weight":
                return "cols"
        return "full"
    if layer is not None and isinstance(layer.ffn, DenseMLPSpec) and rest.startswith("mlp."):
        return "cols" if rest == "mlp.down_proj.weight" else "rows"
    if layer is not None and isinstance(layer.ffn, MoESpec) and rest.startswith("block_sparse_moe."):
        leaf = rest[len("block_sparse_moe."):]
        # router rows (experts) and latent down-projection rows (latent channels) are split too:
        # the program gathers both in one all-gather (ops/tp_moe.py)
        if re.match(r"^experts\.\d+\.w[13]\.weight$", leaf) or leaf in (
                "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight", "routed_expert_up_proj.weight",
                "gate.weight", "routed_expert_down_proj.weight"):
            return "rows"
        if re.match(r"^experts\.\d+\.w2\.weight$", leaf) or leaf == "shared_experts.down_proj.weight":
            return "cols"
        return "full"
    return "rows" if name == "lm_head.weight" else "full"


def shard_shape(spec: KimiK3Spec, name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """Shape of rank's shard of tensor ``name`` of full shape ``shape`` (see shard_rule)."""
    rule = shard_rule(spec, name) if tp > 1 else "full"
    dim = {"rows": 0, "cols": 1}.get(rule)
    if dim is None:
        return tuple(shape)
    out = list(shape)
    out[dim] //= tp
    return tuple(out)


def shard_weights(spec: KimiK3Spec, weights: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s weights at TP ``tp`` (official names, per-rank shapes); ``spec`` unsharded."""
    spec.shard(tp)  # raises the divisibility error naming the fix
    if tp == 1:
        return dict(weights)
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        how = shard_rule(spec, name)
        out[name] = _rows(t, rank, tp) if how == "rows" else _cols(t, rank, tp) if how == "cols" else t
    return out


def shard_cache(spec: KimiK3Spec, cache: KimiK3Cache, rank: int, tp: int) -> KimiK3Cache:
    """Rank ``rank``'s copy of ``cache``: its KDA heads (conv channels of q, k, v; state heads),
    the whole MLA latent cache (the latent is per token, not per head)."""
    if tp == 1:
        return cache.clone()
    conv, state = {}, {}
    for i, c in cache.conv.items():
        q, k, v = c.chunk(3, dim=1)
        conv[i] = torch.cat([_cols(x, rank, tp) for x in (q, k, v)], dim=1)
        state[i] = _cols(cache.state[i], rank, tp)
    return KimiK3Cache(conv, state, {i: kv.clone() for i, kv in cache.kv.items()}, cache.block_size, list(cache.slots))
