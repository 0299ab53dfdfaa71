"""The generic vLLM MoE adapter without vLLM: spec from a config, op sites, checkpoint, start-time refusals."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from latency_specialized import hardware
from latency_specialized.adapter import ModelAdapter
from latency_specialized.cli import main as cli
from latency_specialized.errors import UserError
from latency_specialized.ops.plan import build_plan
from latency_specialized.plugins import get_registry
from latency_specialized.spec import DenseMLPSpec, MoESpec
from latency_specialized.vllm.install import _local_problems

from latency_specialized_models.vllm_moe.adapter import VllmMoEAdapter
from latency_specialized_models.vllm_moe.spec import QWEN3_30B_A3B, spec_from_config, tiny_spec


def test_registered_by_its_entry_point_and_found_by_architecture():
    reg = get_registry()
    assert reg.providers["vllm_moe"] == "vllm_moe" and not reg.failures
    assert reg.adapter_for_architecture(["Qwen3MoeForCausalLM"]).name == "vllm_moe"
    assert "vllm" in reg.adapter("vllm_moe").capabilities


def test_spec_of_the_written_checkpoint_equals_the_tiny_spec(tiny_checkpoint):
    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    spec = spec_from_config(cfg, "tiny")
    assert spec == tiny_spec().model_copy(update={"vocab_size": cfg["vocab_size"]})
    assert isinstance(spec.layers[0].ffn, DenseMLPSpec) and all(isinstance(l.ffn, MoESpec) for l in spec.layers[1:])
    assert spec.layers[1].ffn.router.score_func == "softmax" and spec.layers[1].ffn.router.renormalize
    # transformers >= 5 spells the expert count num_local_experts and moves rope_theta into rope_parameters.
    renamed = {k: v for k, v in cfg.items() if k not in ("num_experts", "rope_theta")}
    renamed.update(num_local_experts=cfg["num_experts"], rope_parameters={"rope_theta": cfg["rope_theta"]})
    assert spec_from_config(renamed, "tiny") == spec


def test_full_spec_is_qwen3_30b_a3b():
    spec = VllmMoEAdapter().spec("full")
    assert (spec.hidden_size, spec.num_layers, spec.vocab_size) == (2048, 48, 151936)
    moe = spec.layers[0].ffn
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate) == (128, 8, 768)
    assert spec.layers[0].attention.num_kv_heads == QWEN3_30B_A3B["num_key_value_heads"]


def test_config_without_required_fields_is_a_user_error():
    with pytest.raises(UserError, match="config lacks hidden_size"):
        spec_from_config({"num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10})


def test_plan_has_qk_norm_sites_and_a_replicated_router():
    reg = get_registry()
    plan = build_plan(reg.adapter("vllm_moe"), reg.implementations, hardware.for_arch("sm_90"), tp=2, batch=4,
                      dtype="bfloat16")
    names = [c.site.name for c in plan.choices]
    # the fused QK-norm + RoPE site first (it serves where a kernel does: sm_90), then the two unfused norms
    at = names.index("gqa+moe/attn.qkv_proj")
    assert names[at + 1:at + 4] == ["gqa+moe/attn.qk_prep", "gqa+moe/attn.q_norm", "gqa+moe/attn.k_norm"]
    assert plan.skipped_sites().keys() >= {"gqa+moe/attn.q_norm", "gqa+moe/attn.k_norm"}
    assert plan.choice("gqa+moe/moe.router_gemm").site.ctx.dim("N") == 128  # every rank scores all experts
    assert plan.counts()["unserved"] == 0 and plan.in_scope


def test_make_checkpoint_cli_writes_a_loadable_directory(tmp_path, capsys):
    assert cli(["make-checkpoint", "vllm_moe", str(tmp_path / "ck"), "--dtype", "float32"]) == 0
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["torch_dtype"] == "float32"
    from safetensors import safe_open
    from tokenizers import Tokenizer

    with safe_open(str(tmp_path / "ck" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        emb = f.get_tensor("model.embed_tokens.weight")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in keys and "model.layers.0.mlp.gate_proj.weight" in keys
    assert emb.shape == (cfg["vocab_size"], cfg["hidden_size"]) and emb.std() > 0.5
    tok = Tokenizer.from_file(str(tmp_path / "ck" / "tokenizer.json"))
    assert tok.decode(tok.encode("The quick brown fox").ids) == "The quick brown fox"
    with pytest.raises(UserError, match="one layout"):
        VllmMoEAdapter().write_checkpoint(tmp_path / "x", layout="kimi_linear")


def _vllm_config(architectures: list[str]) -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=architectures)))


class _SpecOnly(ModelAdapter):
    name = "spec_only_probe"
    hf_architectures = ("SpecOnlyForCausalLM",)


def test_architectures_without_a_binding_are_refused_with_the_reason(monkeypatch):
    problems, ctx, bound = _local_problems(object(), _vllm_config(["LlamaForCausalLM"]), 0)
    assert ctx is None and bound is None
    assert problems[0].startswith("no latency_specialized adapter serves architecture LlamaForCausalLM")
    assert "Qwen3MoeForCausalLM" in problems[0]
    monkeypatch.setitem(get_registry().adapters, _SpecOnly.name, _SpecOnly())
    problems, _, _ = _local_problems(object(), _vllm_config(["SpecOnlyForCausalLM"]), 0)
    assert problems == ["adapter spec_only_probe has no vLLM binding yet (capabilities: spec)"]
