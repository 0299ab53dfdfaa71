"""Kimi K3 checkpoints: write tiny, load, same logits; MXFP4 experts; bad checkpoints name the problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from latency_specialized.config_keys import UnknownConfigKeysWarning
from latency_specialized.errors import CheckpointError
from latency_specialized.plugins import get_registry

from latency_specialized_models.kimi_k3.checkpoint import load_checkpoint, mxfp4_dequantize, mxfp4_quantize
from latency_specialized_models.kimi_k3.composed import expected_tensors, random_weights
from latency_specialized_models.kimi_k3.reference import KimiK3Reference
from latency_specialized_models.kimi_k3.spec import tiny_spec


def _write(tmp_path, **kw):
    d = tmp_path / "ck"
    get_registry().adapter("kimi_k3").write_checkpoint(d, seed=5, **kw)
    return d


def _edit(d, fn):
    path = d / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def _edit_config(d, fn):
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("layout,prefix", [("kimi_k3", "language_model."), ("kimi_linear", "")])
def test_round_trip_same_weights_same_logits(tmp_path, layout, prefix):
    d = _write(tmp_path, layout=layout)
    names = load_file(str(d / "model.safetensors")).keys()
    assert prefix + "model.layers.3.self_attn.kv_b_proj.weight" in names
    assert prefix + "model.layers.1.block_sparse_moe.experts.15.w2.weight" in names
    assert prefix + "lm_head.weight" in names
    ck = load_checkpoint(d)
    spec = tiny_spec()
    assert ck.spec == spec and ck.layout == layout and ck.bos_token_id == 1 and ck.eos_token_id == 2
    w = random_weights(spec, seed=5)
    assert set(ck.weights) == set(w)
    for n, t in w.items():
        assert ck.weights[n].dtype == t.dtype and torch.equal(ck.weights[n], t), n
    ids = ck.tokenizer.encode("The quick brown fox").ids
    assert ck.tokenizer.decode(ids) == "The quick brown fox" and ck.tokenizer.get_vocab_size() == spec.vocab_size
    a, b = KimiK3Reference(spec, w), KimiK3Reference(ck.spec, ck.weights)
    ca, cb = a.new_cache(1, 16), b.new_cache(1, 16)
    assert torch.equal(a.prefill(ca, ca.slots[0], 0, ids), b.prefill(cb, cb.slots[0], 0, ids))
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert tok_cfg["bos_token"] == "[BOS]" and tok_cfg["eos_token"] == "[EOS]"


def test_mxfp4_experts_round_trip(tmp_path):
    d = _write(tmp_path, expert_format="mxfp4")
    raw = load_file(str(d / "model.safetensors"))
    key = "language_model.model.layers.2.block_sparse_moe.experts.4.w3"
    assert raw[key + ".weight_packed"].dtype == torch.uint8 and raw[key + ".weight_packed"].shape == (32, 16)
    assert raw[key + ".weight_scale"].shape == (32, 1)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["text_config"]["quantization_config"]["quant_method"] == "mxfp4"
    ck = load_checkpoint(d, dtype=torch.float32)
    assert ck.spec.routed_expert_format == "mxfp4"
    w = random_weights(ck.spec, seed=5)
    name = "model.layers.2.block_sparse_moe.experts.4.w3.weight"
    assert torch.equal(ck.weights[name], mxfp4_dequantize(*mxfp4_quantize(w[name])))
    assert torch.equal(ck.weights["model.layers.2.self_attn.q_proj.weight"],
                       w["model.layers.2.self_attn.q_proj.weight"].float())


def test_mxfp4_codec():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 64, generator=g) * torch.logspace(-3, 3, 6).unsqueeze(1)   # scales over 6 decades
    q, s = mxfp4_quantize(w)
    deq = mxfp4_dequantize(q, s)
    assert q.shape == (6, 32) and s.shape == (6, 2)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    scaled = (deq.view(6, 2, 32) / torch.exp2(s.float() - 127).unsqueeze(-1)).abs()
    assert torch.isin(scaled, grid).all()                                            # values on the e2m1 grid
    assert torch.equal(mxfp4_quantize(deq)[0], q)                                    # idempotent
    rel = ((deq - w).norm(dim=1) / w.norm(dim=1))
    assert (rel < 0.25).all()                                                        # ~4-bit accuracy


def _fails(d, match):
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(d)


def test_missing_tensor_is_named(tmp_path):
    d = _write(tmp_path)
    _edit(d, lambda t: t.pop("language_model.model.layers.4.self_attn.f_b_proj.weight"))
    _fails(d, r"missing tensor language_model\.model\.layers\.4\.self_attn\.f_b_proj\.weight")


def test_wrong_shape_is_named(tmp_path):
    d = _write(tmp_path)
    _edit(d, lambda t: t.__setitem__("language_model.model.layers.3.self_attn.kv_b_proj.weight", torch.zeros(8, 16)))
    _fails(d, r"kv_b_proj\.weight has shape \[8, 16\], expected \[128, 16\]")


def test_unexpected_tensor_is_named_and_extras_are_ignored(tmp_path):
    d = _write(tmp_path)
    _edit(d, lambda t: t.update({"vision_tower.patch_embed.proj.weight": torch.ones(2, 2),
                                 "language_model.model.layers.7.eh_proj.weight": torch.ones(2, 2)}))  # MTP layer
    ck = load_checkpoint(d)
    assert sorted(ck.ignored) == ["language_model.model.layers.7.eh_proj.weight", "vision_tower.patch_embed.proj.weight"]
    _edit(d, lambda t: t.update({"language_model.model.layers.2.self_attn.mystery.weight": torch.ones(2)}))
    _fails(d, r"unexpected tensor language_model\.model\.layers\.2\.self_attn\.mystery\.weight")


def test_mxfp4_missing_scale_is_named(tmp_path):
    d = _write(tmp_path, expert_format="mxfp4")
    _edit(d, lambda t: t.pop("language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_scale"))
    _fails(d, r"experts\.0\.w2\.weight_scale")


def test_config_problems_are_named(tmp_path):
    d = _write(tmp_path)
    _edit_config(d, lambda c: c["text_config"].__setitem__("rope_flavour", "yarn"))
    with pytest.warns(UnknownConfigKeysWarning, match=r"text_config\.rope_flavour"):
        load_checkpoint(d)  # an unknown key is ignored and named, not an error
    d = _write(tmp_path)
    _edit_config(d, lambda c: c["text_config"].__setitem__("hidden_size", 48))
    _fails(d, r"model\.embed_tokens\.weight has shape \[512, 64\], expected \[512, 48\]")
    _edit_config(d, lambda c: c["text_config"].__setitem__("moe_router_activation_func", "softmax"))
    _fails(d, r"moe_router_activation_func")
    d = _write(tmp_path)
    _edit_config(d, lambda c: c.__setitem__("surprise", 1))
    with pytest.warns(UnknownConfigKeysWarning, match=r"surprise"):
        load_checkpoint(d)
    (d / "config.json").unlink()
    _fails(d, r"no config\.json")


def test_expected_tensor_list_is_complete_for_tiny():
    exp = expected_tensors(tiny_spec())
    # embedding; per KDA layer 14 tensors, per MLA layer 8, each + 6 AttnRes/norm gains; dense MLP 3;
    # per MoE layer router 2 + latent 3 + 16 experts x 3 + shared 3; final mix 2 + norm 1; lm_head
    kda, mla, moe_layers = 5, 2, 6
    total = 1 + kda * (14 + 6) + mla * (8 + 6) + 3 + moe_layers * (2 + 3 + 48 + 3) + 3 + 1
    assert len(exp) == total
