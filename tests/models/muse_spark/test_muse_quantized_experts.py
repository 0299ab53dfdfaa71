"""Muse Spark with its routed experts kept NVFP4 (random weights): transformers' fused expert tensors
(``experts.gate_up_proj`` [E, 2I, L], ``experts.down_proj``) quantized once as wholes - one global scale per expert
for gate and up together, so the pieces' gate | up join needs no second multiplier - the reference computing with
exactly the kept values, the program binding them (4-bit kernels on the GPU: per-route rows for the per-expert
post-norm), ``generate --experts native``. Checkpoints in ModelOpt's layout of the fused tensors
(``make-checkpoint muse_spark --quant nvfp4``: codes under the parameter's name, ``<name>_weight_scale``,
``_weight_scale_2`` / ``_input_scale`` once per half of gate|up - vLLM 0.33 ``models/muse_spark/common``) load
dequantised, or kept as stored. The matrix's ``-nvfp4`` cells run program vs reference."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from latency_specialized import quant
from latency_specialized.cli import main
from latency_specialized.errors import CheckpointError
from latency_specialized.plugins import get_registry

from tests.models.kept_experts import assert_program_binds_kept_experts, generate_in_one_graph, ids

ADAPTER = get_registry().adapter("muse_spark")


def test_random_reference_keeps_the_fused_experts_it_computes_with():
    ref = ADAPTER.reference(ADAPTER.spec("tiny"), seed=5, dtype="float32", expert_format="native")
    kept = {n: w for n, w in ref.program_weights.items() if isinstance(w, quant.QuantizedWeight)}
    assert kept and all(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in kept)
    assert all(w.fmt.name == "nvfp4" and w.global_scale.shape == (w.shape[0],) for w in kept.values())
    assert all(torch.equal(w.dequantize(), ref.named[n]) for n, w in kept.items())
    # the norms beside them stay plain
    assert not any("post_expert_norm" in n for n in kept)
    assert_program_binds_kept_experts(ADAPTER, ref, "nvfp4")


def test_bf16_checkpoint_cannot_keep_nvfp4_experts(tmp_path):
    d = tmp_path / "muse"
    assert main(["make-checkpoint", "muse_spark", "--size", "tiny", str(d)]) == 0
    with pytest.raises(CheckpointError, match="gate_up_proj_weight_scale"):
        ADAPTER.reference(None, checkpoint=d, dtype="float32", expert_format="native")


def test_nvfp4_checkpoint_in_modelopts_fused_layout(tmp_path, capsys):
    d = tmp_path / "muse"
    assert main(["make-checkpoint", "muse_spark", "--size", "tiny", "--quant", "nvfp4", str(d)]) == 0
    stored = load_file(str(d / "model.safetensors"))
    gu = next(n for n in stored if n.endswith("experts.gate_up_proj"))
    E, two_i, half_k = stored[gu].shape
    assert stored[gu].dtype == torch.uint8 and stored[gu + "_weight_scale"].dtype == torch.float8_e4m3fn
    assert stored[gu + "_weight_scale"].shape == (E, two_i, half_k * 2 // 16)
    assert stored[gu + "_weight_scale_2"].shape == stored[gu + "_input_scale"].shape == (E, 2)
    down = gu.replace("gate_up_proj", "down_proj")
    assert stored[down + "_weight_scale_2"].shape == (E,)
    assert not any(n.endswith("post_expert_norm.weight_scale") for n in stored)
    ref = ADAPTER.reference(None, checkpoint=d, dtype="float32", expert_format="native")
    kept = ref.program_weights[gu]
    assert isinstance(kept, quant.QuantizedWeight) and kept.global_scale.shape == (E,)
    assert torch.equal(kept.weight.view(torch.uint8), stored[gu])
    assert torch.equal(kept.dequantize(), ref.named[gu])           # the loader's dequantised copy: the same values
    assert_program_binds_kept_experts(ADAPTER, ref, "nvfp4")
    args = ["--prompt-ids", "5,9,11", "--max-tokens", "5", "--batch", "2", "--device", "cpu", "--dtype", "float32"]
    assert main(["generate", "--model", "muse_spark", "--checkpoint", str(d), *args]) == 0
    plain = ids(capsys.readouterr().out)
    assert main(["generate", "--model", "muse_spark", "--checkpoint", str(d), "--experts", "native", *args]) == 0
    assert plain and ids(capsys.readouterr().out) == plain


def test_gate_and_up_halves_with_their_own_global_scales(tmp_path):
    """ModelOpt may calibrate the halves apart: dequantised at load half by half (exact); kept, refused (the kernels
    take one multiplier per expert) naming the fix."""
    d = tmp_path / "muse"
    assert main(["make-checkpoint", "muse_spark", "--size", "tiny", "--quant", "nvfp4", str(d)]) == 0
    stored = load_file(str(d / "model.safetensors"))
    gu = next(n for n in stored if n.endswith("experts.gate_up_proj"))
    base = quant.dequantize_stored(stored, gu, "nvfp4")
    stored[gu + "_weight_scale_2"][:, 1] *= 2
    save_file(stored, str(d / "model.safetensors"))
    got = quant.dequantize_stored(stored, gu, "nvfp4")
    half = got.shape[1] // 2
    assert torch.equal(got[:, :half], base[:, :half]) and torch.equal(got[:, half:], 2 * base[:, half:])
    ref = ADAPTER.reference(None, checkpoint=d, dtype="float32")
    assert torch.equal(ref.named[gu], got)
    with pytest.raises(CheckpointError, match="different global scales.*re-export"):
        ADAPTER.reference(None, checkpoint=d, dtype="float32", expert_format="native")


def test_generate_with_nvfp4_experts_on_the_cpu(capsys):
    assert main(["generate", "--model", "muse_spark", "--size", "tiny", "--experts", "native", "--prompt-ids",
                 "5,9,11", "--max-tokens", "4", "--show-plan", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "weight_format=nvfp4" in out and re.search(r"^\[0\] ids: ", out, flags=re.M)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_nvfp4_experts_run_on_the_4bit_kernels_in_one_graph(batch, capsys):
    base = ["generate", "--model", "muse_spark", "--size", "tiny", "--batch", str(batch), "--max-tokens", "8",
            "--prompt-ids", "1,40,41,42", "--show-plan", "--experts", "native"]
    out = generate_in_one_graph(base, "moe.experts.q4_gemv_triton", capsys)
    # the tiny widths (32) are below the grouped path's 128-wide K steps: the gemv path serves every batch
    assert "moe.experts.reference" not in out
