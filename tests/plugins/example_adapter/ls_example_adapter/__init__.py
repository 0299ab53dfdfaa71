"""Example third-party adapter: a GQA + MoE decoder built only from the backend's generic blocks.

Everything a new model needs to be listed, scope-checked and planned is a spec, a scope and one
hookimpl; the standard op sites are derived from the spec.
"""

from latency_specialized.adapter import ModelAdapter
from latency_specialized.plugins import hookimpl
from latency_specialized.spec import (DecodeScope, GQAAttentionSpec, LayerSpec, ModelSpec, MoESpec, RouterSpec)


class ToyGQAMoEAdapter(ModelAdapter):
    name = "toy_gqa_moe"
    description = "Example third-party adapter: 4-layer GQA + MoE"
    hf_architectures = ("ToyGQAMoEForCausalLM",)

    def spec(self, variant="full"):
        hidden = 256 if variant == "full" else 64
        attn = GQAAttentionSpec(num_heads=8, num_kv_heads=4, head_dim=hidden // 8)
        moe = MoESpec(num_experts=8, top_k=2, num_shared_experts=0, expert_intermediate=hidden,
                      router=RouterSpec(score_func="softmax", bias_corrected=False))
        layers = tuple(LayerSpec(index=i, attention=attn, ffn=moe) for i in range(4))
        return ModelSpec(name=self.name, variant=variant, hidden_size=hidden, vocab_size=1024, max_context=8192,
                         layers=layers)

    def scope(self):
        return DecodeScope(archs=("cpu", "sm_90"), tp_sizes=(1, 2, 4), max_batch=32)


@hookimpl
def register_adapters(register):
    register(ToyGQAMoEAdapter())
