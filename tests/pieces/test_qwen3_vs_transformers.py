"""The simple pieces composed as Qwen3-MoE vs transformers' Qwen3MoeForCausalLM (an implementation that
shares nothing with them): the program decodes token by token from empty caches, transformers runs
the whole sequence; every position's logits agree (fp32). Pins the math the Qwen3-MoE adapter builds
on: RMSNorm eps placement, QK-norm before NeoX RoPE, softmax scale, softmax top-k with norm_topk_prob."""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch

from latency_specialized import hardware
from latency_specialized.adapter import ModelAdapter
from latency_specialized.ops.plan import build_plan
from latency_specialized.pieces import DenseMLP, GQAAttention, LMHead, PreNormResidual, RoutedMoE, TokenEmbedding
from latency_specialized.plugins import get_registry
from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
from latency_specialized.runtime.composed import ComposedModel, ComposedProgram, LayerPieces, weights_from_names
from latency_specialized.runtime.states import ModelStates
from latency_specialized.spec import (DecodeScope, DenseMLPSpec, GQAAttentionSpec, LayerSpec, ModelSpec, MoESpec,
                                      NormSpec, RouterSpec)

transformers = pytest.importorskip("transformers")

CFG = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
           norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1, rms_norm_eps=1e-6,
           max_position_embeddings=128, tie_word_embeddings=False)


def composed() -> ComposedModel:
    attn = GQAAttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, qk_norm=True)
    moe = MoESpec(num_experts=8, top_k=2, num_shared_experts=0, expert_intermediate=32,
                  router=RouterSpec(score_func="softmax", bias_corrected=False, renormalize=True, fp32=False))
    ffns = [DenseMLPSpec(intermediate=96), moe, moe]
    spec = ModelSpec(name="qwen3_moe_toy", hidden_size=64, vocab_size=96, max_context=128, norm=NormSpec(eps=1e-6),
                     layers=tuple(LayerSpec(index=i, attention=attn, ffn=f) for i, f in enumerate(ffns)))
    a = GQAAttention(attn, qk_norm="weighted")
    layers = [LayerPieces(0, "gqa+dense", a, DenseMLP(ffns[0]))] + \
        [LayerPieces(i, "gqa+moe", a, RoutedMoE(moe, router_split=False)) for i in (1, 2)]
    return ComposedModel(spec, TokenEmbedding(), PreNormResidual(), layers, LMHead())


def hf_name(layer: int, role: str, local: str) -> str:
    if layer == -1:
        return {"embed": "model.embed_tokens.weight", "head": "lm_head.weight", "residual": "model.norm.weight"}[role]
    p = f"model.layers.{layer}."
    if role == "residual":
        return p + {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}[local] + ".weight"
    if role == "attn":
        return p + f"self_attn.{local}.weight"
    if local == "router":
        return p + "mlp.gate.weight"
    if local.startswith("experts."):
        return p + f"mlp.{local}"          # stacked [E, ...] (split off transformers' fused gate_up_proj below)
    return p + f"mlp.{local}.weight"


class Adapter(ModelAdapter):
    name: ClassVar[str] = "qwen3_moe_toy"

    def __init__(self, model):
        self.model = model

    def spec(self, variant="full"):
        return self.model.spec

    def scope(self):
        return DecodeScope(archs=("cpu",), tp_sizes=(1,), max_batch=4, dtypes=("float32",))

    def op_sites(self, *a):
        return self.model.op_sites(*a)


def test_composed_qwen3_moe_equals_transformers():
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**CFG)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    sd = {}
    for name, t in hf.state_dict().items():  # serving-like scales, not the 0.02 init (routing well separated)
        x = torch.randn(t.shape, generator=g)
        sd[name] = 1 + 0.2 * x if "norm" in name else (x if "embed" in name else x / math.sqrt(t.shape[-1]))
    hf.load_state_dict(sd)
    named = dict(sd)
    for i in (1, 2):
        gate_up = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"]              # [E, 2I, H]: gate rows, then up
        named[f"model.layers.{i}.mlp.experts.w1"], named[f"model.layers.{i}.mlp.experts.w3"] = gate_up.chunk(2, dim=1)
        named[f"model.layers.{i}.mlp.experts.w2"] = sd[f"model.layers.{i}.mlp.experts.down_proj"]
    model = composed()
    weights = weights_from_names(model, named, hf_name)
    B, T = 2, 7
    tokens = torch.randint(0, 96, (B, T), generator=g)
    with torch.no_grad():
        want = hf(tokens).logits.double()                                       # [B, T, vocab]
    plan = build_plan(Adapter(model), get_registry().implementations, hardware.for_arch("cpu"), batch=B,
                      dtype="float32")
    states = ModelStates.allocate(model, B, T, block_size=4, dtype=torch.float32, shuffle_seed=2)
    program = ComposedProgram(model, weights, plan, states)
    bufs = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(states.slots[0].blocks), block_size=4))
    bufs.load(tokens[:, 0], [0] * B, [s.row for s in states.slots], states.block_table())
    for t in range(T):
        bufs.metadata(plan.bucket)
        program.step(bufs, plan.bucket)
        got = program.logits[:B].double()
        err = ((got - want[:, t]).abs().max() / want[:, t].abs().max()).item()
        assert err <= 1e-5, f"position {t}: {err:.2e}"
        assert torch.equal(got.argmax(-1), want[:, t].argmax(-1))
        if t + 1 < T:
            bufs.advance(plan.bucket, torch.cat([tokens[:, t + 1], tokens.new_zeros(plan.bucket - B)]))
