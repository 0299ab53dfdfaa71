"""`make-checkpoint qwen3_moe` writes the Hugging Face layout (config.json + model.safetensors with the official
names) that transformers loads as is; our loader reads it back bit for bit; broken checkpoints are named."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from latency_specialized.cli import main
from latency_specialized.errors import CheckpointError
from latency_specialized.runtime.composed import expected_tensors

from latency_specialized_models.qwen3_moe.composed import composed_model, random_weights, tensor_name_for
from latency_specialized_models.qwen3_moe.spec import variant_spec

from tests.models.qwen3_moe.helpers import adapter, rel


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_moe_tiny")
    assert main(["make-checkpoint", "qwen3_moe", str(d), "--size", "tiny", "--seed", "4", "--dtype", "float32"]) == 0
    return d


def test_writes_the_official_layout(ckpt):
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    names = set(load_file(ckpt / "model.safetensors"))
    spec = variant_spec("tiny")
    assert names == set(expected_tensors(composed_model(spec), tensor_name_for(spec)))
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.mlp.gate_proj.weight",
            "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.7.down_proj.weight",
            "model.layers.2.self_attn.q_norm.weight", "model.layers.2.post_attention_layernorm.weight"} <= names


def test_round_trip_through_our_loader(ckpt):
    ref = adapter().reference(None, checkpoint=ckpt, dtype="float32")
    assert ref.spec == variant_spec("tiny").model_copy(update={"variant": "full"})
    want = random_weights(variant_spec("tiny"), 4, torch.float32)
    assert ref.named.keys() == want.keys() and all(torch.equal(ref.named[n], want[n]) for n in want)
    assert ref.tokenizer is None and ref.bos_token_id is None


def test_transformers_loads_it_and_agrees(ckpt):
    transformers = pytest.importorskip("transformers")
    hf, info = transformers.Qwen3MoeForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ref = adapter().reference(None, checkpoint=ckpt, dtype="float32")
    ids = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(0))
    cache = ref.new_cache(1, 9)
    with torch.no_grad():
        assert rel(ref.prefill(cache, cache.slots[0], 0, ids), hf.eval()(ids[None]).logits[0]) <= 1e-4


def test_broken_checkpoints_name_the_problem(ckpt, tmp_path):
    tensors = load_file(ckpt / "model.safetensors")
    cfg = json.loads((ckpt / "config.json").read_text())
    d = tmp_path / "missing"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in tensors.items() if k != "model.layers.2.mlp.experts.3.up_proj.weight"},
              str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor model.layers.2.mlp.experts.3.up_proj.weight"):
        adapter().reference(None, checkpoint=d, dtype="float32")
    (d / "config.json").write_text(json.dumps(dict(cfg, moe_intermediate_size=16)))
    with pytest.raises(CheckpointError, match=r"experts.0.gate_proj.weight has shape \[32, 64\], expected \[16, 64\]"):
        adapter().reference(None, checkpoint=d, dtype="float32")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        adapter().reference(None, checkpoint=d, dtype="float32")


def test_only_tiny_hf_checkpoints(tmp_path, capsys):
    assert main(["make-checkpoint", "qwen3_moe", str(tmp_path), "--layout", "kimi_k3"]) == 2
    assert "one layout (Hugging Face Qwen3-MoE)" in capsys.readouterr().err
    with pytest.raises(Exception, match="only --size tiny"):
        adapter().write_checkpoint(tmp_path, size="medium")
