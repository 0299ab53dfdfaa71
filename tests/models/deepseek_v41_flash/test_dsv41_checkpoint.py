"""DeepSeek-V4.1-Flash checkpoint: FP8 32x32 (ue8m0) and FP4 e2m1 (scale per 32) dequantisation, edge codes,
NaN scales rejected, bad shapes named, save/load round trip in the official layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from latency_specialized.errors import CheckpointError
from latency_specialized.quant import codecs
from latency_specialized_models.deepseek_v41_flash import names as N
from latency_specialized_models.deepseek_v41_flash.spec import EngramSpec, tiny_spec


DS = {"block": (32, 32), "encoding": "ue8m0"}
"""The FP8 codec's arguments for DeepSeek-V4.1's dense weights (what ``names.load`` / ``names.save`` pass)."""


def e8m0(*bytes_: int) -> torch.Tensor:
    return torch.tensor(bytes_, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def test_e2m1_every_code_and_nibble_order():
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]      # 0.5: the subnormal; 6: the largest
    want = torch.tensor(mags + [-m for m in mags])
    codes = torch.arange(16)
    packed = (codes[0::2] | codes[1::2] << 4).to(torch.uint8).repeat(1, 2)      # low nibble = even column
    got = codecs.mxfp4_dequantize(packed.view(1, 16), e8m0(127))
    assert torch.equal(got[0], want.repeat(2)) and got[0, 8].item() == 0.0 and str(got[0, 8].item()) == "-0.0"
    for dt in (torch.int8, getattr(torch, "float4_e2m1fn_x2", torch.int8)):
        assert torch.equal(codecs.mxfp4_dequantize(packed.view(1, 16).view(dt), e8m0(127)), got)


def test_ue8m0_extremes_and_nan():
    s = codecs.ue8m0_decode(e8m0(0, 1, 126, 127, 128, 254))
    assert s.tolist() == [2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 2.0 ** 127]
    with pytest.raises(CheckpointError, match=r"wkv.scale: ue8m0 scale 255 \(NaN\)"):
        codecs.ue8m0_decode(e8m0(127, 255), "layers.0.attn.wkv.scale")
    with pytest.raises(CheckpointError, match="x.scale"):
        codecs.fp8_block_dequantize(torch.ones(32, 32).to(torch.float8_e4m3fn), e8m0(255).view(1, 1), **DS, name="x")


def test_fp8_blocks_are_32x32_with_partial_edges():
    torch.manual_seed(0)
    w = torch.randn(70, 40) * torch.logspace(-3, 3, 40)          # scales differ block to block
    q, s = codecs.fp8_block_quantize(w, **DS)    # names.save views the exponents as e8m0
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8 and s.shape == (3, 2)
    back = codecs.fp8_block_dequantize(q, s, **DS)
    blocks = s.view(torch.uint8).float()
    assert (blocks[:, 1] > blocks[:, 0]).all()                   # column blocks got their own exponent
    for rows in (slice(0, 32), slice(32, 64), slice(64, 70)):
        for cols in (slice(0, 32), slice(32, 40)):       # e4m3: 3 mantissa bits, relative to the block's amax
            assert (back[rows, cols] - w[rows, cols]).abs().max() <= 2 ** -4 * w[rows, cols].abs().max()
    # a single block: value = fp8 x 2^(b-127) exactly
    q1 = torch.full((32, 32), 448.0).to(torch.float8_e4m3fn)
    assert codecs.fp8_block_dequantize(q1, e8m0(130).view(1, 1), **DS).unique().tolist() == [448.0 * 8]


def test_fp4_quantize_round_trip_exact_on_grid():
    g = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]).repeat(4) * 2.0 ** -5
    w = torch.stack([g, -g])
    q, s = codecs.mxfp4_quantize(w)
    assert q.shape == (2, 16) and s.shape == (2, 1) and s.dtype == torch.uint8
    assert torch.equal(codecs.mxfp4_dequantize(q, s), w)
    assert torch.equal(codecs.mxfp4_dequantize(q, s.view(torch.float8_e8m0fnu)), w)      # as names.save stores it


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dsv41")
    # with Engram tables (the tiny spec has none: the reference and program refuse them; the I/O reads them)
    spec = tiny_spec().model_copy(update={"engram": EngramSpec(layers=(1, 4), num_embeddings=(997, 1009), max_ngram=3,
                                                               n_heads=2, head_dim=16)})
    named = N.random_weights(spec, 0, torch.float32)
    N.save(d, spec, named, "float32", quantize=lambda n: True)
    return d, spec, named


def test_save_writes_the_official_layout(tiny_dir):
    d, spec, named = tiny_dir
    stored = load_file(str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v41" and "text_config" in cfg
    assert stored["layers.2.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.2.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert stored["layers.0.ffn.experts.3.w2.weight"].dtype == torch.uint8
    assert stored["layers.0.ffn.experts.3.w2.weight"].shape == (spec.hidden_size, 16)
    assert stored["layers.0.ffn.experts.3.w2.scale"].shape == (spec.hidden_size, 1)
    assert stored["layers.0.ffn.experts.3.w2.scale"].dtype == torch.float8_e8m0fnu
    assert stored["layers.2.attn.compressor.wkv.weight"].dtype == torch.float32      # never quantised
    assert "layers.4.attn.compressor.wgate.weight" in stored and "layers.6.attn.compressor.wgate.weight" not in stored
    assert "layers.8.attn.indexer.wq_b.weight" in stored and "layers.8.attn.indexer.wk.weight" not in stored
    assert "layers.1.engram.embed.scale" in stored and stored["layers.0.hc_attn_fn"].dtype == torch.float32


def test_load_dequantises_to_the_saved_values(tiny_dir):
    d, spec, named = tiny_dir
    got_spec, got, _ = N.load(d, torch.float32)
    assert got_spec.model_copy(update={"variant": "tiny"}) == spec and set(got) == set(named)
    for n, t in named.items():
        storage = N.expected_tensors(spec)[n][2]
        tol = {"plain": 0.0, "fp8": 2 ** -4, "fp4": 0.26}[storage]
        assert ((got[n] - t).abs().max() <= tol * t.abs().max()).item(), n
    again, _, _ = N.load(d, torch.bfloat16)[1], None, None
    assert again["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16 and again["layers.0.hc_attn_fn"].dtype == torch.float32


def _rewrite(d, **changes):
    f = d / "model.safetensors"
    t = load_file(str(f))
    t.update(changes)
    save_file(t, str(f))


def test_nan_scale_and_bad_shapes_rejected(tiny_dir, tmp_path):
    src, spec, named = tiny_dir
    for case, change, match in (
            ("nan", {"layers.3.attn.wo_b.scale": e8m0(*[127] * 7, 255).view(2, 4)}, "layers.3.attn.wo_b.scale.*NaN"),
            ("shape", {"layers.3.attn.wo_b.scale": e8m0(127, 127).view(2, 1)}, "layers.3.attn.wo_b.scale"),
            ("packed", {"layers.0.ffn.experts.0.w1.weight": torch.zeros(32, 31, dtype=torch.uint8)},
             "layers.0.ffn.experts.0.w1.weight"),
            ("dtype", {"layers.0.attn.wkv.weight": torch.zeros(32, 64)}, "layers.0.attn.wkv.weight.*float8_e4m3fn")):
        d = tmp_path / case
        d.mkdir()
        for f in src.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        _rewrite(d, **change)
        with pytest.raises(CheckpointError, match=match):
            N.load(d, torch.float32)
