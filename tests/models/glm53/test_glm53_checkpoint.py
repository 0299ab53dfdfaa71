"""GLM-5.3 checkpoints: names as transformers saves them, save/load round trip (MTP layer included), and FP8
e4m3 128x128 block-scaled weights dequantised on load (edge values, partial blocks, errors naming the tensor)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from latency_specialized.errors import CheckpointError
from latency_specialized.quant import codecs
from latency_specialized_models.glm53 import names
from latency_specialized_models.glm53.spec import tiny_spec

E4M3 = [0.0, -0.0, 448.0, -448.0, 2.0 ** -9, -(2.0 ** -9), 2.0 ** -6, 1.0, -1.75, 240.0]
"""e4m3 edge values: zeros, the max, the smallest subnormal, the smallest normal ..."""


def test_fp8_block_dequantize_edge_values():
    N, K = 130, 200   # partial edge blocks in both dimensions: scales [2, 2]
    vals = torch.tensor(E4M3)[torch.randint(0, len(E4M3), (N, K), generator=torch.Generator().manual_seed(0))]
    scale = torch.tensor([[2.0 ** -8, 3.0], [0.5, 1e-3]])
    w = codecs.fp8_block_dequantize(vals.to(torch.float8_e4m3fn), scale)  # the codec names.load uses
    block = torch.zeros(N, K, dtype=torch.long)
    block[:, 128:] += 1
    block[128:] += 2
    assert w.dtype == torch.float32 and torch.equal(w, vals * scale.flatten()[block])


def test_random_weights_save_load_round_trip_with_fp8(tmp_path):
    spec = tiny_spec()
    named = names.random_weights(spec, seed=3, dtype=torch.float32)
    assert set(named) == set(names.expected_tensors(spec)) and "model.layers.8.eh_proj.weight" in named
    fp8 = {"model.layers.4.mlp.experts.3.down_proj.weight", "model.layers.0.self_attn.q_b_proj.weight"}
    names.save(tmp_path, spec, named, "float32", quantize=fp8.__contains__)
    stored = load_file(tmp_path / "model.safetensors")
    assert all(stored[n].dtype == torch.float8_e4m3fn and n + "_scale_inv" in stored for n in fp8)
    loaded_spec, got, cfg = names.load(tmp_path, torch.float32)
    assert loaded_spec.model_copy(update={"weights": spec.weights, "variant": "tiny"}) == spec
    assert cfg["num_nextn_predict_layers"] == 1
    assert set(got) == set(named)
    for n, t in got.items():
        if n in fp8:   # e4m3: 3 mantissa bits, so within 1/16 of the block's amax-scaled value
            assert (t - named[n]).abs().max() <= named[n].abs().max() / 16
        else:
            assert torch.equal(t, named[n]), n


def test_fp8_errors_name_the_tensor(tmp_path):
    spec = tiny_spec()
    names.save(tmp_path, spec, names.random_weights(spec, dtype=torch.float32), "float32",
               quantize=lambda n: n == "model.layers.1.self_attn.o_proj.weight")
    f = tmp_path / "model.safetensors"
    t = load_file(f)
    n = "model.layers.1.self_attn.o_proj.weight"
    save_file({**t, n + "_scale_inv": torch.ones(3, 3)}, f)
    with pytest.raises(CheckpointError, match=f"{n}_scale_inv has shape"):
        names.load(tmp_path, torch.float32)
    save_file({**t, n: t[n].float()}, f)
    with pytest.raises(CheckpointError, match=f"{n} has dtype torch.float32 next to"):
        names.load(tmp_path, torch.float32)
    del t["model.layers.8.enorm.weight"]
    save_file(t, f)
    with pytest.raises(CheckpointError, match="missing tensor model.layers.8.enorm.weight"):
        names.load(tmp_path, torch.float32)
