"""GLM-5.3 in its released FP8: ``make-checkpoint glm53 --quant fp8-block`` stores the projections e4m3 + 128x128
``weight_scale_inv`` (not the router, the indexer's head weights, the MTP ``eh_proj``, embeddings, heads); the loader
dequantises them; ``--experts native`` keeps the routed experts FP8 as stored for the program (``fp8-block-128``:
``moe.experts.fp8_triton`` on the GPU, the reference on the CPU) with the same tokens; ``--linears native`` keeps the
dense projections FP8 too (the block-FP8 gemms), but ``kv_b`` (absorbed MLA takes bf16: dequantised at bind); the
full layers' fused ``qkv_a`` splits its bf16 ``weights_proj`` tail off into a second gemm (``pieces_api.split_plain``).
The matrix's ``-fp8-block-128`` cells (and ``-dense-fp8-block-128``: both) run program vs reference."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from latency_specialized import quant
from latency_specialized.cli import main
from latency_specialized.plugins import get_registry

from latency_specialized import hardware
from latency_specialized.adapter_contract import SpecBoundAdapter
from latency_specialized.ops.plan import build_plan

from tests.models.kept_experts import generate_in_one_graph, ids

ADAPTER = get_registry().adapter("glm53")


def test_fp8_checkpoint_layout_and_kept_experts(tmp_path, capsys):
    d = tmp_path / "glm"
    assert main(["make-checkpoint", "glm53", "--size", "tiny", "--quant", "fp8-block", str(d)]) == 0
    stored = load_file(str(d / "model.safetensors"))
    fp8 = {n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn}
    assert all(n + "_scale_inv" in stored for n in fp8)
    for must in ("self_attn.q_a_proj.", "self_attn.kv_a_proj_with_mqa.", "self_attn.kv_b_proj.", "self_attn.o_proj.",
                 "indexer.wq_b.", "indexer.wk.", "mlp.experts.0.up_proj.", "mlp.shared_experts.down_proj.",
                 "mlp.gate_proj."):
        assert any(must in n for n in fp8), must
    for plain in ("mlp.gate.weight", "weights_proj.", "eh_proj.", "embed_tokens.", "lm_head."):
        assert not any(plain in n for n in fp8), plain
    ref = ADAPTER.reference(None, checkpoint=d, dtype="float32", expert_format="native")
    kept = {n: w for n, w in ref.program_weights.items() if isinstance(w, quant.QuantizedWeight)}
    assert kept and all(".mlp.experts." in n for n in kept)
    assert all(w.fmt.name == "fp8-block-128" for w in kept.values())
    name = next(iter(kept))
    assert torch.equal(kept[name].weight.view(torch.uint8), stored[name].view(torch.uint8))
    assert torch.equal(kept[name].dequantize(), ref.named[name])
    assert all(layer.ffn.expert_format == "fp8-block-128" for layer in ref.spec.layers if layer.ffn.kind == "moe")
    args = ["--prompt-ids", "5,9,11", "--max-tokens", "6", "--batch", "2", "--device", "cpu"]
    assert main(["generate", "--model", "glm53", "--checkpoint", str(d), *args]) == 0
    plain_ids = ids(capsys.readouterr().out)
    assert main(["generate", "--model", "glm53", "--checkpoint", str(d), "--experts", "native", *args]) == 0
    assert plain_ids and ids(capsys.readouterr().out) == plain_ids


def test_fp8_checkpoint_keeps_its_dense_projections(tmp_path, capsys):
    d = tmp_path / "glm"
    assert main(["make-checkpoint", "glm53", "--size", "tiny", "--quant", "fp8-block", str(d)]) == 0
    stored = load_file(str(d / "model.safetensors"))
    ref = ADAPTER.reference(None, checkpoint=d, dtype="float32", expert_format="native", linear_format="native")
    assert ref.spec.linear_format == ADAPTER.native_linears
    kept = {n for n, w in ref.program_weights.items() if isinstance(w, quant.QuantizedWeight)}
    for must in ("self_attn.q_b_proj.", "self_attn.o_proj.", "indexer.wq_b.", "mlp.shared_experts.gate_proj.",
                 "mlp.down_proj.", "self_attn.kv_b_proj."):
        assert any(must in n for n in kept), must
    assert not any("weights_proj" in n or "mlp.gate.weight" in n for n in kept)
    name = next(n for n in kept if "o_proj" in n)
    assert torch.equal(ref.program_weights[name].weight.view(torch.uint8), stored[name].view(torch.uint8))
    # the sites: FP8 where every part of the weight is, the activation dtype elsewhere
    plan = build_plan(SpecBoundAdapter(ADAPTER, ref.spec), get_registry().implementations, hardware.for_arch("cpu"),
                      tp=1, batch=2, dtype="float32", variant="tiny")
    fmt = {c.site.name: c.site.ctx.attr("weight_format") for c in plan.choices}
    assert fmt["mla+dense/attn.q_b_proj"] == fmt["mla+dense/attn.o_proj"] == fmt["mla+dense/mlp"] == "fp8-block-128"
    assert fmt["mla+moe/moe.shared"] == fmt["mla.reuse+moe/attn.qkv_a_proj"] == "fp8-block-128"
    # the full layers' q_a | kv_a | wk FP8, the indexer's bf16 weights_proj after them in a gemm of its own
    assert fmt["mla+moe/attn.qkv_a_proj"] == "fp8-block-128" and fmt["mla+moe/attn.qkv_a_proj.plain"] is None
    assert "mla.reuse+moe/attn.qkv_a_proj.plain" not in fmt
    program = ADAPTER.program(ref.spec, plans=plan, cache=ref.new_cache(2, 16), reference=ref)
    full, reuse = (next(w["attn"] for lp, w in zip(program.model.layers, program.w_layers) if lp.kind == k)
                   for k in ("mla+moe", "mla.reuse+moe"))
    assert isinstance(full["q_b"], quant.QuantizedWeight) and isinstance(full["o"], quant.QuantizedWeight)
    assert isinstance(reuse["qkv_a"], quant.QuantizedWeight)
    assert isinstance(full["qkv_a"], quant.QuantizedWeight) and isinstance(full["qkv_a.plain"], torch.Tensor)
    assert isinstance(full["kv_b"], torch.Tensor) and "qkv_a.plain" not in reuse
    # fp32: the dequantised weights are the stored values exactly, so the tokens are the same
    args = ["--prompt-ids", "5,9,11", "--max-tokens", "6", "--batch", "2", "--device", "cpu", "--dtype", "float32"]
    assert main(["generate", "--model", "glm53", "--checkpoint", str(d), *args]) == 0
    plain_ids = ids(capsys.readouterr().out)
    assert main(["generate", "--model", "glm53", "--checkpoint", str(d), "--experts", "native", "--linears", "native",
                 *args]) == 0
    assert plain_ids and ids(capsys.readouterr().out) == plain_ids


def test_linears_native_needs_an_adapter_that_keeps_them(capsys):
    rc = main(["generate", "--model", "kimi_k3", "--size", "tiny", "--linears", "native", "--prompt-ids", "1,2"])
    assert rc == 2 and "drop --linears" in capsys.readouterr().err


def test_bf16_checkpoint_cannot_keep_fp8_experts(tmp_path, capsys):
    d = tmp_path / "bf16"
    assert main(["make-checkpoint", "glm53", "--size", "tiny", str(d)]) == 0
    capsys.readouterr()
    rc = main(["generate", "--model", "glm53", "--checkpoint", str(d), "--experts", "native", "--prompt-ids", "1,2"])
    assert rc == 2 and "weight_scale_inv" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_fp8_experts_run_on_the_fp8_kernel_in_one_graph(batch, capsys):
    """On a GPU the tiny model with FP8 experts (row-scaled: 16-wide experts end inside a 128-row block): every decode
    step from one CUDA graph on ``moe.experts.fp8_triton``, the same tokens as eagerly."""
    base = ["generate", "--model", "glm53", "--size", "tiny", "--batch", str(batch), "--max-tokens", "8",
            "--prompt-ids", "1,40,41,42", "--show-plan", "--experts", "native"]
    generate_in_one_graph(base, "moe.experts.fp8_triton", capsys)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_fp8_projections_run_on_the_fp8_gemm_in_one_graph(batch, capsys):
    """The release's whole format on a GPU: experts and dense projections FP8, every step from one CUDA graph on the
    block-FP8 gemm, the same tokens as eagerly."""
    base = ["generate", "--model", "glm53", "--size", "tiny", "--batch", str(batch), "--max-tokens", "8",
            "--prompt-ids", "1,40,41,42", "--show-plan", "--experts", "native", "--linears", "native"]
    out = generate_in_one_graph(base, "gemm.fp8_w8a16_mma", capsys)
    # the tiny model's K = 16 / 32 sites (q_b, the shared expert's down) are the Triton kernel's (K % 64 != 0)
    assert "moe.experts.fp8_triton" in out and "gemm.fp8_w8a16_triton" in out
