"""Generic safetensors I/O: round trips (one file, sharded with an index), dtype kinds, MXFP4 on load,
the composed model's name map end to end, and errors that name the file / tensor and the fix."""

from __future__ import annotations

import json

import pytest
import torch

from latency_specialized.errors import CheckpointError, UserError
from latency_specialized.runtime import checkpoint as ck
from latency_specialized.runtime.composed import expected_tensors, named_weights, weights_from_names

from tests.runtime.composed_toy import random_weights, toy_model


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed.weight": torch.randn(10, 64, generator=g).bfloat16(),
            "model.layers.0.bias": torch.randn(5, generator=g),
            "model.layers.0.experts.0.w1.weight": torch.randn(8, 64, generator=g) * 3,
            "model.layers.0.ids": torch.arange(6)}


EXPECTED = {"model.embed.weight": ((10, 64), "act"), "model.layers.0.bias": ((5,), "float32"),
            "model.layers.0.experts.0.w1.weight": ((8, 64), "act"), "model.layers.0.ids": ((6,), "keep")}


@pytest.mark.parametrize("shard", [None, 700])
def test_round_trip_one_file_and_sharded(tmp_path, shard):
    t = tensors(1)
    files = ck.save_checkpoint(tmp_path, t, {"model_type": "toy", "hidden_size": 64}, max_shard_bytes=shard)
    assert (tmp_path / "config.json") in files
    if shard:
        index = json.loads((tmp_path / ck.INDEX).read_text())
        assert len(set(index["weight_map"].values())) >= 2 and index["metadata"]["total_size"] > 0
    loaded = ck.load_checkpoint(tmp_path, EXPECTED, torch.float32)
    assert loaded.config == {"model_type": "toy", "hidden_size": 64} and loaded.unused == []
    assert loaded.tensors["model.embed.weight"].dtype == torch.float32                  # 'act' cast
    assert torch.equal(loaded.tensors["model.embed.weight"], t["model.embed.weight"].float())
    assert torch.equal(loaded.tensors["model.layers.0.bias"], t["model.layers.0.bias"])
    assert loaded.tensors["model.layers.0.ids"].dtype == torch.int64                    # 'keep'
    in64 = ck.load_checkpoint(tmp_path, EXPECTED, torch.float64)
    assert in64.tensors["model.layers.0.bias"].dtype == torch.float64                   # fp32 kind in fp64 runs


def test_mxfp4_weights_are_dequantised_and_unexpected_tensors_listed(tmp_path):
    t = tensors(2)
    name = "model.layers.0.experts.0.w1.weight"
    ck.save_checkpoint(tmp_path, {**t, "model.rotary.inv_freq": torch.ones(4)}, quantize=lambda n: n == name)
    with ck.open_safetensors(tmp_path / ck.SINGLE) as h:
        keys = set(h.keys())
    assert name not in keys and {name + "_packed", name + "_scale"} <= keys
    loaded = ck.load_checkpoint(tmp_path, EXPECTED, torch.float32)
    assert torch.equal(loaded.tensors[name], ck.mxfp4_dequantize(*ck.mxfp4_quantize(t[name])))
    assert loaded.unused == ["model.rotary.inv_freq"] and loaded.config is None
    with pytest.raises(CheckpointError, match="unexpected tensors"):
        ck.load_checkpoint(tmp_path, EXPECTED, torch.float32, strict=True)


def test_mxfp4_codec():
    g = torch.Generator().manual_seed(3)
    e = torch.randint(-4, 4, (3, 2, 1), generator=g).float()
    mags = torch.tensor(ck.E2M1)[torch.randint(0, 8, (3, 2, 32), generator=g)]
    sign = torch.where(torch.rand(3, 2, 32, generator=g) < 0.5, -1.0, 1.0)
    mags[..., 0] = 6.0                                     # every block reaches the top code: exact scale
    exact = (sign * mags * torch.exp2(e)).reshape(3, 64)
    q, s = ck.mxfp4_quantize(exact)
    assert q.shape == (3, 32) and s.shape == (3, 2) and q.dtype == s.dtype == torch.uint8
    assert torch.equal(ck.mxfp4_dequantize(q, s), exact)     # representable values: exact round trip
    one = torch.zeros(1, 32)
    one[0, 0], one[0, 1] = 1.0, -6.0                         # codes 2 and 8|7: low nibble first
    q1, s1 = ck.mxfp4_quantize(one)
    assert q1[0, 0].item() == (0xF << 4) | 0x2 and s1[0, 0].item() == 127 + 0
    w = torch.randn(2, 4, 64, generator=g)                   # stacked experts: leading dims kept
    assert ck.mxfp4_dequantize(*ck.mxfp4_quantize(w)).shape == (2, 4, 64)
    with pytest.raises(CheckpointError, match="divisible by 32"):
        ck.mxfp4_quantize(torch.randn(2, 48))
    from latency_specialized_models.kimi_k3 import checkpoint as kimi
    assert kimi.mxfp4_quantize is ck.mxfp4_quantize and kimi.mxfp4_dequantize is ck.mxfp4_dequantize


def test_errors_name_the_file_tensor_and_fix(tmp_path):
    t = tensors(4)
    ck.save_checkpoint(tmp_path / "a", t)
    with pytest.raises(CheckpointError, match=r"missing tensor model.layers.0.other \(shape \[3\]\)"):
        ck.load_checkpoint(tmp_path / "a", {**EXPECTED, "model.layers.0.other": ((3,), "act")})
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor model.layers.0.bias has shape \[5\], "
                                              r"expected \[6\]"):
        ck.load_checkpoint(tmp_path / "a", {**EXPECTED, "model.layers.0.bias": ((6,), "float32")})
    with pytest.raises(CheckpointError, match="expected a float tensor"):
        ck.load_checkpoint(tmp_path / "a", {**EXPECTED, "model.layers.0.ids": ((6,), "act")})
    # truncated file: named, with the fix
    data = (tmp_path / "a" / ck.SINGLE).read_bytes()
    (tmp_path / "a" / ck.SINGLE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors file .*truncated or "
                                              r"corrupt; download or write it again"):
        ck.load_checkpoint(tmp_path / "a", EXPECTED)
    # an index that points at a missing shard
    ck.save_checkpoint(tmp_path / "b", t, max_shard_bytes=700)
    shard = sorted((tmp_path / "b").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"maps tensors to {shard.name}, which is missing"):
        ck.load_checkpoint(tmp_path / "b", EXPECTED)
    # MXFP4 weight with its scale missing
    name = "model.layers.0.experts.0.w1.weight"
    packed, _ = ck.mxfp4_quantize(t[name])
    ck.save_checkpoint(tmp_path / "c", {k: v for k, v in t.items() if k != name} | {name + "_packed": packed})
    with pytest.raises(CheckpointError, match=f"missing tensor {name}_scale"):
        ck.load_checkpoint(tmp_path / "c", EXPECTED)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        ck.load_checkpoint(tmp_path / "d", EXPECTED)
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        ck.load_checkpoint(tmp_path / "c" / "..", {})


def tensor_name(layer: int, role: str, local: str) -> str:
    """A Hugging Face-like name map of the toy (experts per index with '{e}')."""
    if layer == -1:
        return {"embed": "model.embed_tokens.weight", "head": "lm_head.weight", "residual": "model.norm.weight"}[role]
    if local.startswith("experts."):
        return f"model.layers.{layer}.mlp.experts.{{e}}.{local.split('.')[1]}.weight"
    return f"model.layers.{layer}.{role}.{local}"


def test_composed_name_map_round_trip_through_a_sharded_checkpoint(tmp_path):
    model = toy_model()
    w = random_weights(model, 6, torch.bfloat16)
    named = named_weights(model, w, tensor_name)
    assert "model.layers.1.mlp.experts.7.w2.weight" in named and named["model.layers.1.mlp.experts.7.w2.weight"].shape \
        == (64, 32)
    expected = expected_tensors(model, tensor_name)
    assert set(expected) == set(named) and expected["model.layers.2.attn.sinks"] == ((4,), "float32")
    ck.save_checkpoint(tmp_path, named, {"architectures": ["Toy"]}, max_shard_bytes=200_000)
    loaded = ck.load_checkpoint(tmp_path, expected, torch.bfloat16, strict=True)
    back = weights_from_names(model, loaded.tensors, tensor_name)
    for (layer, role, local) in model.weight_decls(1):
        got, want = back[layer][role][local], w[layer][role][local]
        assert got.dtype == want.dtype and torch.equal(got, want), (layer, role, local)
    del loaded.tensors["model.layers.3.mlp.experts.5.w3.weight"]
    with pytest.raises(UserError, match=r"missing tensor model.layers.3.mlp.experts.5.w3.weight \(layer 3 ffn.experts.w3, "
                                        r"expert 5 of 8\)"):
        weights_from_names(model, loaded.tensors, tensor_name)
