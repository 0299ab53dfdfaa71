"""Kimi K3 weights by their official checkpoint names: the expected list, and random weights.

Names are those of the published checkpoint's text model (``KimiLinearForCausalLM`` layout,
read off vLLM's ``kimi_k3`` loader and public checkpoint ledgers): ``model.layers.{i}.self_attn.q_proj.weight``,
``model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight``, ``lm_head.weight`` ... The
multimodal K3 checkpoint prefixes them with ``language_model.`` (see checkpoint.py). Routed
experts are ``w1`` (gate), ``w3`` (up), ``w2`` (down), as in vLLM's expert mapping.

Parameters that the checkpoint stores in fp32 (A_log, dt_bias, the short-conv taps, the KDA
output-norm gain, the router's score-correction bias) stay fp32 here (fp64 in fp64 runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from latency_specialized.spec import DenseMLPSpec, KDAAttentionSpec, MLAAttentionSpec, MoESpec

from latency_specialized_models.kimi_k3.spec import KimiK3Spec


@dataclass(frozen=True)
class TensorSpec:
    """Expected shape and storage class of one checkpoint tensor."""

    shape: tuple[int, ...]
    """Shape in the checkpoint."""
    fp32: bool = False
    """Stored in fp32 (kept at >= fp32 precision in memory)."""
    init: str = "linear"
    """How random weights are drawn: linear (std 1/sqrt(fan_in)), norm (1 + 0.1 N), embed (N(0,1)),
    query (AttnRes pseudo-query), conv, a_log, dt_bias, bias (router correction)."""


def layer_tensors(spec: KimiK3Spec, i: int) -> dict[str, TensorSpec]:
    """Every tensor of decoder layer ``i`` (names relative to the text model root)."""
    H = spec.hidden_size
    p = f"model.layers.{i}."
    out: dict[str, TensorSpec] = {
        p + "input_layernorm.weight": TensorSpec((H,), init="norm"),
        p + "post_attention_layernorm.weight": TensorSpec((H,), init="norm"),
        p + "self_attention_res_norm.weight": TensorSpec((H,), init="norm"),
        p + "self_attention_res_proj.weight": TensorSpec((1, H), init="query"),
        p + "mlp_res_norm.weight": TensorSpec((H,), init="norm"),
        p + "mlp_res_proj.weight": TensorSpec((1, H), init="query"),
    }
    layer = spec.layers[i]
    a = layer.attention
    s = p + "self_attn."
    if isinstance(a, KDAAttentionSpec):
        hd = a.num_heads * a.head_dim
        for n in ("q", "k", "v", "g"):
            out[s + f"{n}_proj.weight"] = TensorSpec((hd, H))
        out[s + "f_a_proj.weight"] = TensorSpec((a.decay_rank, H))
        out[s + "f_b_proj.weight"] = TensorSpec((hd, a.decay_rank))
        out[s + "b_proj.weight"] = TensorSpec((a.num_heads, H))
        for n in ("q", "k", "v"):
            out[s + f"{n}_conv1d.weight"] = TensorSpec((hd, 1, a.conv_kernel), fp32=True, init="conv")
        out[s + "A_log"] = TensorSpec((a.num_heads,), fp32=True, init="a_log")
        out[s + "dt_bias"] = TensorSpec((hd,), fp32=True, init="dt_bias")
        out[s + "o_norm.weight"] = TensorSpec((a.head_dim,), fp32=True, init="norm")
        out[s + "o_proj.weight"] = TensorSpec((H, hd))
    elif isinstance(a, MLAAttentionSpec):
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank:
            out[s + "q_a_proj.weight"] = TensorSpec((a.q_lora_rank, H))
            out[s + "q_a_layernorm.weight"] = TensorSpec((a.q_lora_rank,), init="norm")
            out[s + "q_b_proj.weight"] = TensorSpec((a.num_heads * qk, a.q_lora_rank))
        else:
            out[s + "q_proj.weight"] = TensorSpec((a.num_heads * qk, H))
        out[s + "kv_a_proj_with_mqa.weight"] = TensorSpec((a.kv_lora_rank + a.qk_rope_head_dim, H))
        out[s + "kv_a_layernorm.weight"] = TensorSpec((a.kv_lora_rank,), init="norm")
        out[s + "kv_b_proj.weight"] = TensorSpec((a.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank))
        out[s + "o_proj.weight"] = TensorSpec((H, a.num_heads * a.v_head_dim))
        if a.output_gate == "sigmoid":
            out[s + "g_proj.weight"] = TensorSpec((a.num_heads * a.v_head_dim, H))
    else:  # pragma: no cover - the spec builder only makes KDA and MLA layers
        raise TypeError(f"kimi_k3 has no {type(a).__name__} layers")
    f = layer.ffn
    if isinstance(f, DenseMLPSpec):
        m = p + "mlp."
        out[m + "gate_proj.weight"] = TensorSpec((f.intermediate, H))
        out[m + "up_proj.weight"] = TensorSpec((f.intermediate, H))
        out[m + "down_proj.weight"] = TensorSpec((H, f.intermediate))
    else:
        assert isinstance(f, MoESpec)
        m = p + "block_sparse_moe."
        width = f.latent_dim or H
        out[m + "gate.weight"] = TensorSpec((f.num_experts, H))
        out[m + "gate.e_score_correction_bias"] = TensorSpec((f.num_experts,), fp32=True, init="bias")
        if f.latent_dim:
            out[m + "routed_expert_down_proj.weight"] = TensorSpec((f.latent_dim, H))
            if spec.latent_moe_norm:
                out[m + "routed_expert_norm.weight"] = TensorSpec((f.latent_dim,), init="norm")
            out[m + "routed_expert_up_proj.weight"] = TensorSpec((H, f.latent_dim))
        for e in range(f.num_experts):
            out[m + f"experts.{e}.w1.weight"] = TensorSpec((f.expert_intermediate, width))
            out[m + f"experts.{e}.w3.weight"] = TensorSpec((f.expert_intermediate, width))
            out[m + f"experts.{e}.w2.weight"] = TensorSpec((width, f.expert_intermediate))
        if f.num_shared_experts:
            inter = f.num_shared_experts * f.expert_intermediate
            out[m + "shared_experts.gate_proj.weight"] = TensorSpec((inter, H))
            out[m + "shared_experts.up_proj.weight"] = TensorSpec((inter, H))
            out[m + "shared_experts.down_proj.weight"] = TensorSpec((H, inter))
    return out


def expected_tensors(spec: KimiK3Spec) -> dict[str, TensorSpec]:
    """Every tensor of the text model, in a fixed order (embedding, layers, final mix, norm, head)."""
    H, V = spec.hidden_size, spec.vocab_size
    out: dict[str, TensorSpec] = {"model.embed_tokens.weight": TensorSpec((V, H), init="embed")}
    for i in range(spec.num_layers):
        out.update(layer_tensors(spec, i))
    out["model.output_attn_res_norm.weight"] = TensorSpec((H,), init="norm")
    out["model.output_attn_res_proj.weight"] = TensorSpec((1, H), init="query")
    out["model.norm.weight"] = TensorSpec((H,), init="norm")
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = TensorSpec((V, H))
    return out


def storage_dtype(ts: TensorSpec, dtype: torch.dtype) -> torch.dtype:
    """In-memory dtype of a tensor for activation dtype ``dtype`` (fp32 parameters never go below fp32)."""
    if ts.fp32 and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def _draw(ts: TensorSpec, g: torch.Generator) -> torch.Tensor:
    shape = ts.shape
    if ts.init == "linear":
        return torch.randn(shape, generator=g) / shape[-1] ** 0.5
    if ts.init == "norm":
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if ts.init == "embed":
        return torch.randn(shape, generator=g)
    if ts.init == "query":
        # logits of the AttnRes softmax ~ N(0, 1): a mix that is neither uniform nor one-hot
        return torch.randn(shape, generator=g) / shape[-1] ** 0.5
    if ts.init == "conv":
        return torch.randn(shape, generator=g) / shape[-1] ** 0.5
    if ts.init == "a_log":
        # A in [0.5, 2]: with dt_bias below the decays stay mostly in (-2, 0], i.e. a state with
        # memory of tens of tokens - a harsher test of the recurrence than near-total forgetting.
        return torch.log(0.5 + 1.5 * torch.rand(shape, generator=g))
    if ts.init == "dt_bias":
        return -2.0 + 0.5 * torch.randn(shape, generator=g)
    if ts.init == "bias":
        return 0.1 * torch.randn(shape, generator=g)
    raise ValueError(f"unknown init {ts.init}")


def random_weights(spec: KimiK3Spec, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                   device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Random weights of ``spec`` by official name (deterministic in ``seed``; drawn on the CPU).

    Scales keep activations O(1) through every layer: projections N(0, 1/fan_in), norm gains
    1 + 0.1 N(0, 1), embeddings N(0, 1); never zeros.
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, ts in expected_tensors(spec).items():
        out[name] = _draw(ts, g).to(device=device, dtype=storage_dtype(ts, dtype))
    return out


def cast_weights(weights: dict[str, torch.Tensor], spec: KimiK3Spec, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """The same weights in activation dtype ``dtype`` (fp32 parameters kept >= fp32)."""
    exp = expected_tensors(spec)
    return {n: t.to(device=device if device is not None else t.device, dtype=storage_dtype(exp[n], dtype))
            for n, t in weights.items()}
