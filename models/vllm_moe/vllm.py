"""Binding of the generic MoE adapter to vLLM's in-tree Qwen3-MoE module tree: vLLM's modules ->
the pieces' weights, for the runtime's ``ComposedProgram`` (``runtime/vllm_binding.VllmComposedStep``).

The program is :func:`~latency_specialized_models.vllm_moe.composed.composed_model` - the pieces
``models/qwen3_moe`` composes, head-less - bound to views of vLLM's own parameters (no copy; the
pieces' ``arrange`` keeps views of fused tensors as views) and vLLM's KV caches. Per decoder layer
``i`` (``model.model.layers[i]``) this rank's tensors map onto the pieces as

=====================  ===============================  =======================================================
piece weight           vLLM tensor (this rank's shard)  notes
=====================  ===============================  =======================================================
residual.input_norm    ``input_layernorm.weight``       RMSNorm (not zero-centred), eps = rms_norm_eps
residual.post_norm     ``post_attention_layernorm``     "
attn.q/k/v_proj        ``self_attn.qkv_proj``           row slices [q | k | v] of the fused weight (views)
attn.o_proj            ``self_attn.o_proj``
attn.q_norm / k_norm   ``self_attn.q_norm / k_norm``    per-head RMSNorm
ffn.router             ``mlp.gate`` (GateLinear)        replicated: ``RoutedMoE(router_split=False)``
ffn.experts.w1 / w3    ``mlp.experts`` w13 [E, 2I, H]   halves along dim 1 (views); w2 [E, H, I]
ffn.gate/up/down_proj  ``mlp.gate_up_proj / down_proj`` dense layers (``mlp_only_layers``)
embed.weight           ``model.embed_tokens.weight``    rows [:vocab] of the padded table; at TP > 1 the
                                                        vocab shards are all-gathered once (the piece is
                                                        replicated: the one copy this binding makes)
residual.norm (final)  ``model.norm.weight``
=====================  ===============================  =======================================================

On the CPU build vLLM repacks linear and expert weights after loading; the worker hook keeps the
loaded tensors (``runtime/vllm_weights.py``), which are the ones mapped here. The attention site
(``attn.gqa``) is served by vLLM's own ``Attention`` layer of each layer (``VllmAttention``: its paged
KV cache, backend kernels and metadata; impl 'stock' in the plan and the trace); the rotary embedding
is the GQA piece's (checked against vLLM's ``rotary_emb`` at start). Logits stay vLLM's.

Everything the pieces cannot take as vLLM laid it out (quantized / biased / repacked-and-not-retained
weights, expert parallelism, shared experts, another router or activation, scaled RoPE, sliding
windows or sinks, a structure that is not vLLM's Qwen3-MoE) is a start-time problem with the reason,
as are GPUs (the binding has only been run on the CPU build).
"""

from __future__ import annotations

from typing import Any

import torch

from latency_specialized.adapter import ModelAdapter
from latency_specialized.runtime.composed import MODEL
from latency_specialized.runtime.vllm_binding import BindContext, SiteTable, VllmAttention, VllmComposedStep
from latency_specialized.runtime.vllm_weights import expert_weights, linear_weight
from latency_specialized.spec import GQAAttentionSpec, ModelSpec, MoESpec

from latency_specialized_models.vllm_moe.composed import composed_model

ATTENTION_REASON = "vLLM's Attention layer owns the paged KV cache and its backend"


def _decoder(model: Any) -> Any:
    return getattr(model, "model", None)


def structure_problems(model: Any) -> list[str]:
    """What keeps ``model`` from being vLLM's Qwen3-MoE layout (empty: bindable)."""
    inner = _decoder(model)
    need = {"model.model": inner, "model.model.layers": getattr(inner, "layers", None),
            "model.model.norm": getattr(inner, "norm", None),
            "model.model.embed_tokens": getattr(inner, "embed_tokens", None)}
    missing = [k for k, v in need.items() if v is None]
    if missing:
        return [f"{type(model).__name__} lacks {', '.join(missing)}: not vLLM's standard MoE decoder layout"]
    out = []
    for i, layer in enumerate(inner.layers):
        attn = getattr(layer, "self_attn", None)
        parts = {"input_layernorm": getattr(layer, "input_layernorm", None),
                 "post_attention_layernorm": getattr(layer, "post_attention_layernorm", None),
                 "self_attn.qkv_proj": getattr(attn, "qkv_proj", None), "self_attn.o_proj": getattr(attn, "o_proj", None),
                 "self_attn.q_norm": getattr(attn, "q_norm", None), "self_attn.k_norm": getattr(attn, "k_norm", None),
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


# ---------------------------------------------------------------------------------------------- checks
def _norm_problem(where: str, module: Any, spec: ModelSpec) -> str | None:
    if type(module).__name__ not in ("RMSNorm", "GemmaRMSNorm"):
        return f"{where} is a {type(module).__name__}, not an RMSNorm"
    if not getattr(module, "has_weight", True) or getattr(module, "weight", None) is None:
        return f"{where} has no weight (the pre-norm pieces read one)"
    if (type(module).__name__ == "GemmaRMSNorm") != spec.norm.zero_centered:
        return f"{where} is a {type(module).__name__}: its gain centring differs from the spec's norm"
    if float(module.variance_epsilon) != spec.norm.eps:
        return f"{where} eps {module.variance_epsilon} differs from the config's rms_norm_eps {spec.norm.eps}"
    return None


def _attention_problems(i: int, attn: Any, a: GQAAttentionSpec, local: GQAAttentionSpec, spec: ModelSpec) -> list[str]:
    out: list[str] = []
    p = f"layer {i} self_attn"
    for name in ("qkv_proj", "o_proj"):
        w, why = linear_weight(getattr(attn, name))
        if w is None:
            out.append(f"{p}.{name}: {why} (the composed program reads unquantized, bias-free weights)")
    for name in ("q_norm", "k_norm"):
        why = _norm_problem(f"{p}.{name}", getattr(attn, name), spec)
        if why:
            out.append(why)
    if (int(attn.q_size), int(attn.kv_size), int(attn.head_dim)) != \
            (local.num_heads * local.head_dim, local.num_kv_heads * local.head_dim, a.head_dim):
        out.append(f"{p}: q/kv sizes {attn.q_size}/{attn.kv_size} differ from the config's heads at this TP")
    rope = attn.rotary_emb
    if type(rope).__name__ != "RotaryEmbedding":
        out.append(f"{p}.rotary_emb is a {type(rope).__name__}: the GQA piece applies plain (unscaled) RoPE only")
    elif (int(rope.rotary_dim), bool(rope.is_neox_style)) != (a.head_dim, True) or \
            a.rope_theta is None or float(rope.base) != float(a.rope_theta):
        out.append(f"{p}.rotary_emb (rotary_dim {rope.rotary_dim}, neox {rope.is_neox_style}, base {rope.base}) "
                   f"differs from the piece's NeoX RoPE over {a.head_dim} channels, theta {a.rope_theta}")
    layer, impl = attn.attn, getattr(attn.attn, "impl", None)
    scale = a.softmax_scale if a.softmax_scale is not None else a.head_dim ** -0.5
    window = getattr(impl, "sliding_window", None)
    if (int(layer.num_heads), int(layer.num_kv_heads), int(layer.head_size)) != \
            (local.num_heads, local.num_kv_heads, a.head_dim):
        out.append(f"{p}.attn heads {layer.num_heads}/{layer.num_kv_heads} x {layer.head_size} differ from the config's")
    if impl is not None and abs(float(impl.scale) - scale) > 1e-12 * scale:
        out.append(f"{p}.attn softmax scale {impl.scale} differs from the piece's {scale}")
    if window not in (None, -1) or getattr(impl, "sinks", None) is not None or \
            getattr(impl, "alibi_slopes", None) is not None or getattr(impl, "logits_soft_cap", 0) not in (None, 0):
        out.append(f"{p}.attn has a sliding window, sinks, ALiBi or a logit soft cap: the plan's attention site "
                   "declares none")
    if getattr(layer, "kv_sharing_target_layer_name", None) is not None:
        out.append(f"{p}.attn shares another layer's KV cache: every layer keeps its own state here")
    return out


def _router_problems(where: str, runner: Any, f: MoESpec) -> list[str]:
    r = getattr(runner, "router", None)
    if r is None:
        return [f"{where} has no router"]
    out = []
    if getattr(r, "custom_routing_function", None) is not None:
        out.append(f"{where} routes with a custom function")
    if getattr(r, "use_grouped_topk", False) and (getattr(r, "num_expert_group", None) or 1) > 1:
        out.append(f"{where} routes with grouped top-k")
    score = getattr(r, "scoring_func", "softmax")
    scales = {float(getattr(r, "routed_scaling_factor", 1.0) or 1.0), float(getattr(runner, "routed_scaling_factor", 1.0))}
    if score != f.router.score_func or scales != {1.0} or getattr(r, "e_score_correction_bias", None) is not None \
            or bool(r.renormalize) != f.router.renormalize or int(getattr(r, "top_k", 0) or 0) != f.top_k:
        out.append(f"{where} router ({score}, top-{getattr(r, 'top_k', '?')}, renormalize {r.renormalize}, scaling "
                   f"{sorted(scales)}, bias {getattr(r, 'e_score_correction_bias', None) is not None}) differs from "
                   f"the config's {f.router.score_func} top-{f.top_k}")
    return out


def _moe_problems(i: int, block: Any, f: MoESpec, tp: int) -> list[str]:
    where = f"layer {i} mlp"
    runner = block.experts
    gate = getattr(runner, "gate", None) or getattr(block, "gate", None)
    routed = getattr(runner, "routed_experts", None)
    cfg = getattr(routed, "moe_config", None) or getattr(runner, "moe_config", None)
    act = getattr(getattr(cfg, "activation", None), "value", str(getattr(cfg, "activation", "silu"))).lower()
    out = _router_problems(where, runner, f)
    if getattr(runner, "shared_experts", None) is not None:
        out.append(f"{where} has shared experts inside the MoE runner (the plan's MoE has none)")
    if any(getattr(runner, t, None) is not None for t in ("routed_input_transform", "routed_output_transform")):
        out.append(f"{where} has latent MoE transforms")
    if getattr(cfg, "ep_size", 1) > 1 or getattr(routed, "local_num_experts", 0) != getattr(routed, "global_num_experts", 0):
        out.append(f"{where}: expert parallelism (local experts != global experts) is not bound")
    if getattr(cfg, "is_sequence_parallel", False):
        out.append(f"{where}: sequence-parallel MoE is not bound")
    if getattr(cfg, "has_bias", False) or getattr(routed, "apply_router_weight_on_input", False):
        out.append(f"{where} has expert biases or applies the router weight on the input")
    if act != "silu" or any(getattr(cfg, k, None) is not None for k in ("swiglu_limit", "swiglu_alpha", "swiglu_beta")):
        out.append(f"{where} expert activation {act} (with limits) is not the plan's SwiGLU")
    if gate is None:
        out.append(f"{where} has no router gate module")
    else:
        w, why = linear_weight(gate)
        if w is None:
            out.append(f"{where}.gate: {why} (the composed program reads unquantized weights)")
    if routed is None:
        out.append(f"{where} has no routed experts")
    else:
        w13, w2, why = expert_weights(routed)
        if w13 is None:
            out.append(f"{where}.experts: {why} (the composed program reads unquantized [E, 2I, H] "
                       "experts)")
        elif (w13.shape[0], w13.shape[1], w2.shape[2]) != (f.num_experts, 2 * f.expert_intermediate // tp,
                                                           f.expert_intermediate // tp):
            out.append(f"{where}.experts hold {tuple(w13.shape)} / {tuple(w2.shape)}, not the config's "
                       f"{f.num_experts} experts of width {f.expert_intermediate} / TP {tp}")
    return out


def _dense_problems(i: int, mlp: Any) -> list[str]:
    out = []
    for name in ("gate_up_proj", "down_proj"):
        w, why = linear_weight(getattr(mlp, name))
        if w is None:
            out.append(f"layer {i} mlp.{name}: {why} (the composed program reads unquantized weights)")
    if getattr(mlp, "expert_gate", None) is not None:
        out.append(f"layer {i} mlp is a gated shared-expert MLP")
    act = type(getattr(mlp, "act_fn", None)).__name__
    if act != "SiluAndMul":
        out.append(f"layer {i} mlp activation {act} is not the plan's SwiGLU")
    return out


def layout_problems(model: Any, spec: ModelSpec, tp: int) -> list[str]:
    """What of vLLM's modules the pieces cannot take as laid out (empty: bindable). Stops at the first
    layer with a problem (the others are built alike)."""
    inner = _decoder(model)
    rank_spec = spec.shard(tp) if tp > 1 else spec
    out: list[str] = []
    emb = inner.embed_tokens
    method = type(getattr(emb, "quant_method", None)).__name__
    if method != "UnquantizedEmbeddingMethod":
        out.append(f"model.embed_tokens is quantized ({method})")
    if getattr(emb, "num_added_embeddings", 0):
        out.append("model.embed_tokens has added (LoRA) vocabulary rows")
    if len(inner.layers) != spec.num_layers:
        out.append(f"{len(inner.layers)} decoder layers, the config has {spec.num_layers}")
        return out
    why = _norm_problem("model.norm", inner.norm, spec)
    if why:
        out.append(why)
    for i, layer in enumerate(inner.layers):
        L, local = spec.layers[i], rank_spec.layers[i]
        found: list[str] = []
        for name in ("input_layernorm", "post_attention_layernorm"):
            why = _norm_problem(f"layer {i} {name}", getattr(layer, name), spec)
            if why:
                found.append(why)
        found += _attention_problems(i, layer.self_attn, L.attention, local.attention, spec)
        is_moe = hasattr(layer.mlp, "experts")
        if is_moe != isinstance(L.ffn, MoESpec):
            found.append(f"layer {i} mlp is {'an MoE' if is_moe else 'a dense MLP'}, the config says otherwise")
        elif is_moe:
            found += _moe_problems(i, layer.mlp, L.ffn, tp)
        else:
            found += _dense_problems(i, layer.mlp)
        if found:
            out += found
            break
    return out


# ---------------------------------------------------------------------------------------------- weights
def piece_weights(model: Any, spec: ModelSpec, tp: int, comm: Any = None) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    """This rank's weights ``{layer | MODEL: {role: {local: tensor}}}`` of :func:`composed_model`: views of
    vLLM's parameters (see the module docstring), except the all-gathered embedding at TP > 1."""
    inner = _decoder(model)
    emb = inner.embed_tokens.weight.detach()
    if tp > 1:
        emb = comm.all_gather(emb, dim=0)  # vocab shards, in rank order: the (padded) table
    out: dict[int, dict[str, dict[str, torch.Tensor]]] = {
        MODEL: {"embed": {"weight": emb[: spec.vocab_size]}, "residual": {"norm": inner.norm.weight.detach()}}}
    for i, layer in enumerate(inner.layers):
        a = layer.self_attn
        qkv, _ = linear_weight(a.qkv_proj)
        o, _ = linear_weight(a.o_proj)
        q, kv = int(a.q_size), int(a.kv_size)
        attn = {"q_proj": qkv[:q], "k_proj": qkv[q:q + kv], "v_proj": qkv[q + kv:q + 2 * kv], "o_proj": o,
                "q_norm": a.q_norm.weight.detach(), "k_norm": a.k_norm.weight.detach()}
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            runner = mlp.experts
            gate = getattr(runner, "gate", None) or getattr(mlp, "gate", None)
            router, _ = linear_weight(gate)
            w13, w2, _ = expert_weights(runner.routed_experts)
            inter = w2.shape[2]
            ffn = {"router": router, "experts.w1": w13[:, :inter], "experts.w3": w13[:, inter:], "experts.w2": w2}
        else:
            gate_up, _ = linear_weight(mlp.gate_up_proj)
            down, _ = linear_weight(mlp.down_proj)
            inter = down.shape[1]
            ffn = {"gate_proj": gate_up[:inter], "up_proj": gate_up[inter:], "down_proj": down}
        out[i] = {"residual": {"input_norm": layer.input_layernorm.weight.detach(),
                               "post_norm": layer.post_attention_layernorm.weight.detach()},
                  "attn": attn, "ffn": ffn}
    return out


def attention_layers(model: Any) -> dict[int, Any]:
    """Layer index -> vLLM ``Attention`` module (``self_attn.attn``)."""
    return {i: layer.self_attn.attn for i, layer in enumerate(_decoder(model).layers)}


# ---------------------------------------------------------------------------------------------- binding
class VllmMoEBinding:
    """:class:`latency_specialized.runtime.vllm_binding.VllmBinding` of the generic MoE adapter.

    ``adapter``: the VllmMoEAdapter that made it (its ``for_config`` gives the plan's adapter; the
    binding does not import the adapter module, which imports this one)."""

    def __init__(self, adapter: Any):
        self.adapter = adapter
        self.attention: VllmAttention | None = None
        """vLLM's Attention layers as the ``attn.gqa`` implementation (made by :meth:`stock_sites`)."""

    def plan_adapter(self, ctx: BindContext) -> ModelAdapter:
        return self.adapter.for_config(ctx.vllm_config.model_config.hf_text_config)

    def _spec(self, ctx: BindContext) -> ModelSpec:
        return self.plan_adapter(ctx).spec("full")

    def problems(self, ctx: BindContext) -> list[str]:
        out = []
        if ctx.hardware.is_gpu:
            out.append(f"the {ctx.adapter.name} vLLM binding has only been validated on the CPU build "
                       f"({ctx.hardware.arch} pending)")
        structure = structure_problems(ctx.model)
        if structure:
            return out + structure
        return out + layout_problems(ctx.model, self._spec(ctx), ctx.deployment.tp)

    def stock_sites(self, ctx: BindContext, sites: SiteTable) -> None:
        """``attn.gqa`` of every layer kind: vLLM's Attention layer (its paged KV cache and backend)."""
        self.attention = VllmAttention(attention_layers(ctx.model))
        for kind in self._spec(ctx).layer_kinds():
            sites.serve_stock(f"{kind}/attn.gqa", self.attention, ATTENTION_REASON)

    def bind(self, ctx: BindContext, sites: SiteTable) -> VllmComposedStep:
        tp = ctx.deployment.tp
        spec = self._spec(ctx)
        comm = None
        if tp > 1:
            from vllm.distributed.parallel_state import get_tp_group

            from latency_specialized.comm.base import TorchDistributedCommunicator

            comm = TorchDistributedCommunicator(get_tp_group().device_group)
        if self.attention is None:
            self.stock_sites(ctx, sites)
        assert self.attention is not None
        layers = attention_layers(ctx.model)
        return VllmComposedStep(composed_model(spec), piece_weights(ctx.model, spec, tp, comm), sites, self.attention,
                                metadata_layer=layers[min(layers)].layer_name, comm=comm)
