"""Binding of the generic MoE adapter to vLLM's in-tree Qwen3-MoE module tree.

What it binds, per decoder layer (``model.model.layers[i]``):

* ``input_layernorm`` / ``post_attention_layernorm`` / ``model.norm``: RMSNorm weight + eps
  (``GemmaRMSNorm``: zero-centred gain);
* ``self_attn``: ``qkv_proj`` and ``o_proj`` weights (column / row parallel), per-head ``q_norm`` /
  ``k_norm``, and - always stock - ``rotary_emb`` and the ``attn`` layer (vLLM's paged KV cache and
  attention backend, fed by the step's forward context);
* ``mlp``: either the MoE block (``GateLinear`` router weight, ``MoERunner`` router semantics and
  unquantized ``w13`` / ``w2`` expert weights) or the dense ``Qwen3MoeMLP`` (``gate_up_proj`` /
  ``down_proj``).

Weights that are quantized, biased, padded, or expert-parallel make their op sites call the stock
module (recorded in the trace). Structural mismatches and GPUs (the binding has only been run on the
CPU build) are start-time problems.
"""

from __future__ import annotations

from typing import Any

import torch

from latency_specialized.adapter import ModelAdapter
from latency_specialized.runtime.vllm_binding import BindContext, SiteTable
from latency_specialized.runtime.vllm_weights import expert_weights, linear_weight
from latency_specialized.spec import ActivationSpec, RouterSpec

from latency_specialized_models.vllm_moe.program import (Attention, DenseMLP, Layer, Linear, MoE, Norm,
                                                         VllmMoEProgram, kind_of)

SWIGLU = ActivationSpec(kind="swiglu")


def _decoder(model: Any) -> Any:
    return getattr(model, "model", None)


def structure_problems(model: Any) -> list[str]:
    """What keeps ``model`` from being vLLM's Qwen3-MoE layout (empty: bindable)."""
    inner = _decoder(model)
    need = {"model.model": inner, "model.model.layers": getattr(inner, "layers", None),
            "model.model.norm": getattr(inner, "norm", None)}
    missing = [k for k, v in need.items() if v is None]
    if missing:
        return [f"{type(model).__name__} lacks {', '.join(missing)}: not vLLM's standard MoE decoder layout"]
    out = []
    for i, layer in enumerate(inner.layers):
        attn = getattr(layer, "self_attn", None)
        parts = {"input_layernorm": getattr(layer, "input_layernorm", None),
                 "post_attention_layernorm": getattr(layer, "post_attention_layernorm", None),
                 "self_attn.qkv_proj": getattr(attn, "qkv_proj", None), "self_attn.o_proj": getattr(attn, "o_proj", None),
                 "self_attn.rotary_emb": getattr(attn, "rotary_emb", None), "self_attn.attn": getattr(attn, "attn", None),
                 "mlp": getattr(layer, "mlp", None)}
        gone = [k for k, v in parts.items() if v is None]
        mlp = parts["mlp"]
        if mlp is not None and not (hasattr(mlp, "experts") or hasattr(mlp, "gate_up_proj")):
            gone.append("mlp.experts or mlp.gate_up_proj")
        if gone:
            out.append(f"layer {i} lacks {', '.join(gone)}: not vLLM's standard MoE decoder layout")
            break  # one layer says enough
    return out


def _norm(module: Any) -> Norm:
    zero_centered = type(module).__name__ == "GemmaRMSNorm"
    weight = getattr(module, "weight", None) if getattr(module, "has_weight", True) else None
    return Norm(module=module, weight=weight, eps=float(module.variance_epsilon), zero_centered=zero_centered)


def _linear(module: Any, tp: int) -> Linear:
    weight, why = linear_weight(module)
    reduces = bool(getattr(module, "reduce_results", False)) and tp > 1
    return Linear(module=module, weight=weight, why_stock=why, stock_reduces=reduces)


def _router(runner: Any) -> tuple[RouterSpec | None, torch.Tensor | None, str]:
    """RouterSpec of a MoERunner's router, or why the stock MoE must serve."""
    r = getattr(runner, "router", None)
    if r is None:
        return None, None, "MoE runner has no router"
    if getattr(r, "custom_routing_function", None) is not None:
        return None, None, "custom routing function: the stock MoE serves"
    groups = getattr(r, "num_expert_group", None) or 1
    if getattr(r, "use_grouped_topk", False) and groups > 1:
        return None, None, f"grouped top-k ({groups} groups): the stock MoE serves"
    score = getattr(r, "scoring_func", "softmax")
    if score not in ("softmax", "sigmoid", "sqrtsoftplus"):
        return None, None, f"scoring function {score}: the stock MoE serves"
    scales = {float(getattr(r, "routed_scaling_factor", 1.0) or 1.0), float(getattr(runner, "routed_scaling_factor", 1.0))}
    if scales != {1.0}:
        # Where the scale is applied differs between vLLM's router classes; not bound yet.
        return None, None, "routed scaling factor != 1: the stock MoE serves"
    bias = getattr(r, "e_score_correction_bias", None)
    spec = RouterSpec(score_func=score, bias_corrected=bias is not None, renormalize=bool(r.renormalize), fp32=False)
    return spec, bias, ""


def _moe(block: Any, tp: int) -> MoE:
    runner = block.experts
    gate = getattr(runner, "gate", None) or getattr(block, "gate", None)
    routed = getattr(runner, "routed_experts", None)
    why = ""
    router, bias, why_router = _router(runner)
    cfg = getattr(routed, "moe_config", None) or getattr(runner, "moe_config", None)
    gate_w, why_gate = linear_weight(gate) if gate is not None else (None, "no router gate module")
    w13, w2, why_w = expert_weights(routed) if routed is not None else (None, None, "no routed experts")
    act = getattr(getattr(cfg, "activation", None), "value", str(getattr(cfg, "activation", "silu"))).lower()
    if getattr(runner, "shared_experts", None) is not None:
        why = "shared experts inside the MoE runner: the stock MoE serves"
    elif any(getattr(runner, t, None) is not None for t in ("routed_input_transform", "routed_output_transform")):
        why = "latent MoE transforms: the stock MoE serves"
    elif getattr(cfg, "ep_size", 1) > 1 or \
            getattr(routed, "local_num_experts", 0) != getattr(routed, "global_num_experts", 0):
        why = "expert parallelism (local experts != global experts): the stock MoE serves"
    elif getattr(cfg, "is_sequence_parallel", False):
        why = "sequence-parallel MoE: the stock MoE serves"
    elif getattr(cfg, "has_bias", False) or getattr(routed, "apply_router_weight_on_input", False):
        why = "expert biases or router weight on the input: the stock MoE serves"
    elif act != "silu" or any(getattr(cfg, k, None) is not None for k in ("swiglu_limit", "swiglu_alpha", "swiglu_beta")):
        why = f"expert activation {act} (with limits): the stock MoE serves"
    else:
        why = why_router or why_gate or why_w
    return MoE(module=block, gate=gate_w, w13=w13, w2=w2, router=router, bias=bias,
               top_k=int(getattr(getattr(runner, "router", None), "top_k", 0) or 0), activation=SWIGLU,
               why_stock=why, partial=tp > 1)


def _dense(mlp: Any, tp: int) -> DenseMLP:
    gu, why_gu = linear_weight(mlp.gate_up_proj)
    down, why_down = linear_weight(mlp.down_proj)
    why = why_gu or why_down
    if getattr(mlp, "expert_gate", None) is not None:
        why = "gated shared-expert MLP: the stock module serves"
    act = type(getattr(mlp, "act_fn", None)).__name__
    if act != "SiluAndMul":
        why = f"activation {act}: the stock module serves"
    return DenseMLP(module=mlp, w_gate_up=gu, w_down=down, activation=SWIGLU, why_stock=why, partial=tp > 1)


def bind_layers(model: Any, tp: int) -> tuple[list[Layer], Norm]:
    """The bound layers and final norm of a vLLM Qwen3-MoE-style model (see module docstring)."""
    inner = _decoder(model)
    layers = []
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        attention = Attention(qkv=_linear(attn.qkv_proj, tp), o_proj=_linear(attn.o_proj, tp),
                              q_norm=_norm(q_norm) if q_norm is not None else None,
                              k_norm=_norm(k_norm) if k_norm is not None else None,
                              rotary=attn.rotary_emb, attn=attn.attn, q_size=int(attn.q_size),
                              kv_size=int(attn.kv_size), head_dim=int(attn.head_dim))
        ffn: Any = _moe(layer.mlp, tp) if hasattr(layer.mlp, "experts") else _dense(layer.mlp, tp)
        layers.append(Layer(index=i, kind=kind_of(ffn), input_norm=_norm(layer.input_layernorm), attention=attention,
                            post_norm=_norm(layer.post_attention_layernorm), ffn=ffn))
    return layers, _norm(inner.norm)


class VllmMoEBinding:
    """:class:`latency_specialized.runtime.vllm_binding.VllmBinding` of the generic MoE adapter.

    ``adapter``: the VllmMoEAdapter that made it (its ``for_config`` gives the plan's adapter; the
    binding does not import the adapter module, which imports this one)."""

    def __init__(self, adapter: Any):
        self.adapter = adapter

    def plan_adapter(self, ctx: BindContext) -> ModelAdapter:
        return self.adapter.for_config(ctx.vllm_config.model_config.hf_text_config)

    def problems(self, ctx: BindContext) -> list[str]:
        out = []
        if ctx.hardware.is_gpu:
            out.append(f"the {ctx.adapter.name} vLLM binding has only been validated on the CPU build "
                       f"({ctx.hardware.arch} pending)")
        return out + structure_problems(ctx.model)

    def bind(self, ctx: BindContext, sites: SiteTable) -> VllmMoEProgram:
        tp = ctx.deployment.tp
        layers, final_norm = bind_layers(ctx.model, tp)
        for layer in layers:
            k, a = layer.kind, layer.attention
            for role, lin in (("attn.qkv_proj", a.qkv), ("attn.o_proj", a.o_proj)):
                if lin.weight is None:
                    sites.force_stock(f"{k}/{role}", lin.why_stock)
            sites.force_stock(f"{k}/attn.gqa", "vLLM's Attention layer owns the paged KV cache and its backend")
            roles = ("moe.router_gemm", "moe.router", "moe.experts") if isinstance(layer.ffn, MoE) else ("mlp",)
            if layer.ffn.why_stock:
                for role in roles:
                    sites.force_stock(f"{k}/{role}", layer.ffn.why_stock)
        sites.force_stock("lm_head", "logits stay vLLM's (compute_logits runs after the forward)")
        # The program fuses each layer's input norm (and the final norm) into the previous layer's
        # ffn.allreduce; only the first layer runs its attn.norm site on its own.
        for prev, layer in zip(layers, layers[1:]):
            if layer.kind != layers[0].kind:
                sites.fuse(f"{layer.kind}/attn.norm", f"{prev.kind}/ffn.allreduce")
        sites.fuse("final_norm", f"{layers[-1].kind}/ffn.allreduce")
        comm = None
        if tp > 1:
            from vllm.distributed.parallel_state import get_tp_group

            from latency_specialized.comm.base import TorchDistributedCommunicator

            comm = TorchDistributedCommunicator(get_tp_group().device_group)
        return VllmMoEProgram(embed=_decoder(ctx.model).embed_input_ids, layers=layers, final_norm=final_norm,
                              sites=sites, comm=comm)
