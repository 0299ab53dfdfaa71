"""DeepSeek-V4.1-Flash with its routed experts kept FP4 (``mxfp4-deepseek``) end to end: checkpoints read as stored
(codes and e8m0 scales untouched), random weights quantized once (the reference computes with exactly the kept
values), the spec / sites carrying the format, ``generate --experts native`` and (on a GPU) the program on the 4-bit
kernels in one graph. The matrix's ``-mxfp4-deepseek`` cells run program vs reference."""

from __future__ import annotations

import pytest
import torch

from latency_specialized import quant
from latency_specialized.cli import main
from latency_specialized.errors import UserError
from latency_specialized.plugins import get_registry
from latency_specialized.testing.matrix import Cell, cell_plan

from tests.models.kept_experts import assert_program_binds_kept_experts, generate_in_one_graph, ids

ADAPTER = get_registry().adapter("deepseek_v41_flash")


def test_random_reference_keeps_the_experts_it_computes_with():
    ref = ADAPTER.reference(ADAPTER.spec("tiny"), seed=3, dtype="float32", expert_format="native")
    kept = {n: w for n, w in ref.program_weights.items() if isinstance(w, quant.QuantizedWeight)}
    experts = [n for n in ref.named if ".ffn.experts." in n and n.endswith(".weight")]
    assert set(kept) == set(experts) and all(w.fmt.name == "mxfp4-deepseek" for w in kept.values())
    assert all(torch.equal(kept[n].dequantize(), ref.named[n]) for n in experts)
    assert all(not isinstance(w, quant.QuantizedWeight) for n, w in ref.program_weights.items() if n not in kept)
    moe = [layer.ffn for layer in ref.spec.layers if layer.ffn.kind == "moe"]
    assert moe and all(f.expert_format == "mxfp4-deepseek" for f in moe)
    assert_program_binds_kept_experts(ADAPTER, ref, "mxfp4-deepseek")
    with pytest.raises(UserError, match="mxfp4-deepseek only"):
        ADAPTER.reference(ADAPTER.spec("tiny"), seed=3, dtype="float32", expert_format="nvfp4")


def test_checkpoint_experts_are_kept_as_stored_and_generate_the_same_tokens(tmp_path, capsys):
    d = tmp_path / "ds"
    assert main(["make-checkpoint", "deepseek_v41_flash", "--size", "tiny", str(d)]) == 0
    ref = ADAPTER.reference(None, checkpoint=d, dtype="float32", expert_format="native")
    kept = {n: w for n, w in ref.program_weights.items() if isinstance(w, quant.QuantizedWeight)}
    assert kept and all(".ffn.experts." in n for n in kept)
    from safetensors.torch import load_file

    stored = load_file(str(d / "model.safetensors"))
    name = next(iter(kept))
    assert torch.equal(kept[name].weight.view(torch.uint8), stored[name].view(torch.uint8))
    assert torch.equal(kept[name].scale.view(torch.uint8), stored[name[:-len(".weight")] + ".scale"].view(torch.uint8))
    assert torch.equal(kept[name].dequantize(), ref.named[name])
    args = ["--prompt-ids", "5,9,11", "--max-tokens", "6", "--device", "cpu"]
    assert main(["generate", "--model", "deepseek_v41_flash", "--checkpoint", str(d), *args]) == 0
    plain = ids(capsys.readouterr().out)
    assert main(["generate", "--model", "deepseek_v41_flash", "--checkpoint", str(d), "--experts", "native",
                 *args]) == 0
    native = ids(capsys.readouterr().out)
    assert plain and native == plain


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_medium_model_runs_its_fp4_experts_on_the_4bit_kernels_in_one_graph(batch, capsys):
    """On a GPU the medium model with FP4 experts: every decode step replayed from a CUDA graph, the experts on the
    mma 4-bit kernels, the same tokens as eagerly (numerics vs the dequantising reference: the matrix cells and
    tests/ops/test_moe_experts_mma_gpu.py)."""
    base = ["generate", "--model", "deepseek_v41_flash", "--size", "medium", "--batch", str(batch), "--max-tokens", "8",
            "--prompt-ids", "1,40,41,42", "--show-plan", "--experts", "native"]
    generate_in_one_graph(base, "moe.experts.mma", capsys)  # K 1024, I 256: the mma kernel's 128-wide steps


def test_checkpoint_dense_projections_kept_fp8_where_every_part_is(tmp_path, capsys):
    """``--linears native``: the FP8 32x32 projections stay as stored (q_b with the indexer's rope-leading rows moved
    with their scales, the grouped o_a one weight per group, o_b, shared experts, ``in_proj``'s q_a | kv - its plain
    compressor / indexer-weights tail a bf16 gemm of its own). fp32: the same tokens as dequantised at load."""
    d = tmp_path / "ds"
    assert main(["make-checkpoint", "deepseek_v41_flash", "--size", "tiny", str(d)]) == 0
    ref = ADAPTER.reference(None, checkpoint=d, dtype="float32", expert_format="native", linear_format="native")
    kept = {n for n, w in ref.program_weights.items() if isinstance(w, quant.QuantizedWeight)}
    assert {n for n in kept if ".ffn.experts." not in n} and not any("compressor" in n for n in kept)
    assert all(ref.program_weights[n].fmt.name == "fp8-block-32" for n in kept if ".ffn.experts." not in n)
    cell = Cell(ADAPTER.name, 1, 1, 8, 0, experts="mxfp4-deepseek", linears="fp8-block-32")
    program = ADAPTER.program(ref.spec, plans=cell_plan(ADAPTER, get_registry().implementations, cell),
                              cache=ref.new_cache(1, 16), reference=ref)
    attn = {lp.kind: w["attn"] for lp, w in zip(program.model.layers, program.w_layers)}
    for kind, w in attn.items():
        assert isinstance(w["q_b_proj"], quant.QuantizedWeight) and isinstance(w["o_b_proj"], quant.QuantizedWeight)
        assert all(isinstance(g, quant.QuantizedWeight) for g in w["o_a_proj"])
        assert isinstance(w["in_proj"], quant.QuantizedWeight)
        assert isinstance(w.get("in_proj.plain"), torch.Tensor) == (".src" in kind or ".idx" in kind), kind
    args = ["--prompt-ids", "5,9,11", "--max-tokens", "6", "--device", "cpu", "--dtype", "float32"]
    assert main(["generate", "--model", "deepseek_v41_flash", "--checkpoint", str(d), *args]) == 0
    plain = ids(capsys.readouterr().out)
    assert main(["generate", "--model", "deepseek_v41_flash", "--checkpoint", str(d), "--experts", "native",
                 "--linears", "native", *args]) == 0
    assert plain and ids(capsys.readouterr().out) == plain


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_medium_model_runs_its_fp8_projections_on_the_fp8_gemm_in_one_graph(batch, capsys):
    """The release's whole format on a GPU (FP4 experts, FP8 32x32 projections): one CUDA graph per step with the
    block-FP8 gemm serving the kept projections, the same tokens as eagerly."""
    base = ["generate", "--model", "deepseek_v41_flash", "--size", "medium", "--batch", str(batch), "--max-tokens", "8",
            "--prompt-ids", "1,40,41,42", "--show-plan", "--experts", "native", "--linears", "native"]
    generate_in_one_graph(base, "gemm.fp8_w8a16_mma", capsys)  # every K of the medium model is a multiple of 64
