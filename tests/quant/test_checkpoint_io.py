"""Quantized weights by checkpoint name: the official tensor names, shapes and dtypes of each format, a
save -> safetensors -> load round trip, load-time rejection (NaN scales, wrong shapes / dtypes, a missing
companion) naming the tensor, and ``make-checkpoint --quant`` refusing adapters that cannot write it."""

from __future__ import annotations

from typing import Literal

import pytest
import torch
from safetensors.torch import load_file, save_file

from latency_specialized.errors import CheckpointError, UserError
from latency_specialized.ops.moe import experts_reference
from latency_specialized.quant import checkpoint_io as qio
from latency_specialized.quant import codecs as qc
from latency_specialized.quant import layout
from latency_specialized.quant.formats import FORMATS
from latency_specialized.spec import ActivationSpec

W = "model.layers.1.mlp.experts.3.down_proj.weight"
B = "model.layers.1.mlp.experts.3.down_proj"

OFFICIAL = {
    "mxfp4": {B + ".weight_packed": ((64, 64), torch.uint8), B + ".weight_scale": ((64, 4), torch.uint8)},
    "mxfp4-deepseek": {B + ".weight": ((64, 64), torch.float4_e2m1fn_x2),
                       B + ".scale": ((64, 4), torch.float8_e8m0fnu)},
    "nvfp4": {B + ".weight": ((64, 64), torch.uint8), B + ".weight_scale": ((64, 8), torch.float8_e4m3fn),
              B + ".weight_scale_2": ((), torch.float32), B + ".input_scale": ((), torch.float32)},
    "fp8-block-128": {B + ".weight": ((64, 128), torch.float8_e4m3fn),
                      B + ".weight_scale_inv": ((1, 1), torch.float32)},
    "fp8-block-32": {B + ".weight": ((64, 128), torch.float8_e4m3fn), B + ".scale": ((2, 4), torch.float8_e8m0fnu)},
}
"""What each official checkpoint stores for one [64, 128] weight (compressed-tensors, DeepSeek-V4.1, ModelOpt,
DeepSeek-V3 / GLM, DeepSeek-V4.1 dense)."""


@pytest.mark.parametrize("fmt", sorted(OFFICIAL))
def test_official_names_shapes_dtypes(fmt):
    assert qio.stored_tensors(W, (64, 128), fmt) == OFFICIAL[fmt]
    assert FORMATS[fmt].nbytes((64, 128)) == sum(
        torch.empty(s, dtype=d).numel() * torch.empty((), dtype=d).element_size() for s, d in OFFICIAL[fmt].values())


@pytest.mark.parametrize("fmt", sorted(OFFICIAL))
def test_save_load_round_trip_through_safetensors(tmp_path, gen, fmt):
    f = FORMATS[fmt]
    K = 96 if f.element == "e4m3" else 128        # fp8: a partial edge block along K
    named = {W: torch.randn(64, K, generator=gen), B.replace("down", "up") + ".weight": torch.randn(64, 128,
                                                                                              generator=gen),
             "model.norm.weight": torch.rand(64, generator=gen)}
    pick = {W, B.replace("down", "up") + ".weight"}
    out = qio.quantize_named(named, fmt, select=pick.__contains__)
    assert "model.norm.weight" in out and W not in out or f.suffix("weight") == "weight"
    for n, (shape, dt) in qio.stored_tensors(W, (64, K), fmt).items():
        assert tuple(out[n].shape) == shape and out[n].dtype == dt, n
    save_file(out, str(tmp_path / "m.safetensors"))
    back = load_file(str(tmp_path / "m.safetensors"))
    assert all(back[n].dtype == t.dtype for n, t in out.items())
    assert qio.stored_format(W, back) is f                                  # names + the weight's dtype decide
    assert qio.stored_format(W, set(back), [fmt]) is f                      # names alone, one candidate
    assert qio.stored_format(W, back, [fmt]) is f and qio.stored_format("model.norm.weight", back, [fmt]) is None
    deq = qio.dequantize_named(back, fmt, {W: (64, K)})
    assert set(deq) == set(named) and torch.equal(deq["model.norm.weight"], named["model.norm.weight"])
    qw = qio.quantized_from_named(back, W, fmt)
    assert qw.shape == (64, K) and qw.nbytes == f.nbytes((64, K))
    ref = qc.dequantize(f, *[v for k, v in qio.quantize_weight(W, named[W], f).tensors().items()
                             if not k.endswith("input_scale")])
    assert torch.equal(deq[W], ref) and torch.equal(qw.to("cpu").dequantize(), ref)
    assert qw.to("cpu").weight.dtype == back[qio.tensor_names(W, f)["weight"]].dtype   # kept quantized


def test_nan_scales_rejected_at_load_naming_the_tensor(gen):
    w = torch.randn(32, 64, generator=gen)
    for fmt, role, poison in (("mxfp4", "scale", 0xFF), ("fp8-block-32", "scale", 0xFF), ("nvfp4", "scale", 0x7F),
                              ("nvfp4", "global_scale", None), ("fp8-block-128", "scale", None)):
        t = qio.quantize_weight(W, w, fmt).tensors()
        name = qio.tensor_names(W, fmt)[role]
        bad = t[name].clone()
        if poison is None:
            bad.view(-1)[0] = float("nan")
        else:
            bad.view(torch.uint8).view(-1)[-1] = poison
        with pytest.raises(CheckpointError, match=f"tensor {name.replace('.', '[.]')}: .*(NaN|non-finite)"):
            qio.quantized_from_named({**t, name: bad}, W, fmt)


def test_load_errors_name_the_tensor(gen):
    t = qio.quantize_weight(W, torch.randn(32, 64, generator=gen), "nvfp4").tensors()
    with pytest.raises(CheckpointError, match=rf"missing tensor {B}.weight_scale_2: a nvfp4 weight"):
        qio.quantized_from_named({k: v for k, v in t.items() if not k.endswith("_2")}, W, "nvfp4")
    with pytest.raises(CheckpointError, match=rf"tensor {B}.weight_scale has shape \[32, 2\], expected \[32, 4\]"):
        qio.quantized_from_named({**t, B + ".weight_scale": t[B + ".weight_scale"][:, :2]}, W, "nvfp4")
    with pytest.raises(CheckpointError, match=rf"tensor {B}.weight_scale has dtype torch.float32: a nvfp4 scale"):
        qio.quantized_from_named({**t, B + ".weight_scale": t[B + ".weight_scale"].float()}, W, "nvfp4")
    with pytest.raises(CheckpointError, match=rf"tensor {B}.weight has shape \[32, 32\], expected \[32, 48\]"):
        qio.quantized_from_named(t, W, "nvfp4", (32, 96))
    # the same bytes under the dtypes other writers use are accepted: int8 packed FP4, uint8 e8m0 scales
    d = qio.quantize_weight(W, torch.randn(32, 64, generator=gen), "mxfp4-deepseek").tensors()
    alt = {B + ".weight": d[B + ".weight"].view(torch.int8), B + ".scale": d[B + ".scale"].view(torch.uint8)}
    assert torch.equal(qio.quantized_from_named(alt, W, "mxfp4-deepseek").dequantize(),
                       qio.quantized_from_named(d, W, "mxfp4-deepseek").dequantize())


def test_runtime_load_checkpoint_rejects_a_nan_ue8m0_scale(tmp_path, gen):
    from latency_specialized.runtime.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(tmp_path, {W: torch.randn(8, 64, generator=gen)}, quantize=lambda n: True)
    f = tmp_path / "model.safetensors"
    t = load_file(str(f))
    t[B + ".weight_scale"][3, 1] = 255
    save_file(t, str(f))
    with pytest.raises(CheckpointError, match=rf"tensor {B}.weight_scale: ue8m0 scale 255 \(NaN\) at index \[3, 1\]"):
        load_checkpoint(tmp_path, {W: ((8, 64), "float32")})


# ------------------------------------------------------------------------------------------------ the CLI
def _one_error_line(capsys, args):
    from latency_specialized.cli import main

    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_make_checkpoint_quant_on_an_adapter_without_quant_support(capsys, tmp_path):
    d = tmp_path / "out"
    line = _one_error_line(capsys, ["make-checkpoint", "kimi_k3", str(d), "--quant", "nvfp4"])
    assert line == ("error: kimi_k3 cannot write --quant nvfp4 checkpoints: its write_checkpoint takes no quant= "
                    "argument (quantized formats it supports: none; it writes unquantized weights only, so drop "
                    "--quant)")
    assert not d.exists()                                   # refused before anything is written


def test_make_checkpoint_quant_is_passed_or_refused_by_the_declared_formats(capsys, tmp_path, monkeypatch):
    from latency_specialized.cli import main
    from latency_specialized.plugins import get_registry

    adapter = get_registry().adapter("kimi_k3")
    calls = []

    def write(self, directory, *, size="tiny", seed=0, dtype="bfloat16", layout=None, expert_format=None,
              quant: Literal["mxfp4"] | None = None):
        calls.append(quant)
        (tmp_path / "out" / "config.json").write_text("{}")
        return [tmp_path / "out" / "config.json"]

    monkeypatch.setattr(type(adapter), "write_checkpoint", write)
    line = _one_error_line(capsys, ["make-checkpoint", "kimi_k3", str(tmp_path / "no"), "--quant", "fp8-block"])
    assert line == ("error: kimi_k3 cannot write --quant fp8-block checkpoints: use --quant mxfp4 (the quantized "
                    "formats it supports)")
    assert main(["make-checkpoint", "kimi_k3", str(tmp_path / "out"), "--quant", "mxfp4"]) == 0
    assert calls == ["mxfp4"] and "mxfp4" in capsys.readouterr().out
    monkeypatch.setattr(type(adapter), "checkpoint_quant_formats", ("nvfp4", "fp8-block"), raising=False)
    line = _one_error_line(capsys, ["make-checkpoint", "kimi_k3", str(tmp_path / "no"), "--quant", "mxfp4"])
    assert line.endswith("use --quant nvfp4 or fp8-block (the quantized formats it supports)")


LAYOUTS = [(fmt, derived) for fmt in sorted(FORMATS) for derived in ("stored", "pairs", "rows")
           if derived != "pairs" or FORMATS[fmt].element == "e2m1"]
"""Each format as stored and in the derived layouts the kernels read (paired nibbles: e2m1 only; a scale per row)."""


@pytest.mark.parametrize("fmt,derived", LAYOUTS)
def test_experts_selects_the_stored_rows_of_each_expert(gen, fmt, derived):
    E, N, K = 5, 64, 128
    q = qio.quantize_weight("experts.w13", torch.randn(E, N, K, generator=gen), fmt)
    if derived != "stored":
        q = layout.paired_nibbles(q) if derived == "pairs" else layout.row_scaled(q)
    full = q.dequantize()
    idx = torch.tensor([4, 1, 1])
    picked = q.experts(idx)
    assert picked.shape == (3, N, K) and picked.fmt == q.fmt
    assert torch.equal(picked.dequantize(), full[idx])
    one = q.experts(2)
    assert one.shape == (1, N, K) and torch.equal(one.dequantize(), full[2:3])
    with pytest.raises(UserError, match=r"experts\(\) needs an \[E, N, K\] weight"):
        qio.quantize_weight("proj", torch.randn(N, K, generator=gen), fmt).experts(0)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_experts_reference_on_stored_weights_equals_it_on_their_dequantised_copies(gen, fmt):
    """The reference dequantises a stored weight one routed expert at a time: the same answer as on the whole fp32
    copy (what it did before), in its combined and per-route forms."""
    E, K, I, M, k = 6, 64, 32, 5, 2
    w13 = qio.quantize_weight("experts.w13", torch.randn(E, 2 * I, K, generator=gen) * K ** -0.5, fmt)
    w2 = qio.quantize_weight("experts.w2", torch.randn(E, K, I, generator=gen) * I ** -0.5, fmt)
    x = torch.randn(M, K, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)])
    weights = torch.rand(M, k, generator=gen)
    act = ActivationSpec(kind="swiglu")
    for per_route in (False, True):
        got = experts_reference(x, weights, ids, w13, w2, act, per_route=per_route)
        want = experts_reference(x, weights, ids, w13.dequantize(), w2.dequantize(), act, per_route=per_route)
        assert torch.equal(got, want)
