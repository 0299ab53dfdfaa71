"""Muse Spark with its routed experts kept NVFP4 (random weights): transformers' fused expert tensors
(``experts.gate_up_proj`` [E, 2I, L], ``experts.down_proj``) quantized once as wholes - one global scale per expert
for gate and up together, so the pieces' gate | up join needs no second multiplier - the reference computing with
exactly the kept values, the program binding them (4-bit kernels on the GPU: per-route rows for the per-expert
post-norm), ``generate --experts native``. A checkpoint's fused layout cannot be read quantized yet: refused with
the fix. The matrix's ``-nvfp4`` cells run program vs reference."""

from __future__ import annotations

import re

import pytest
import torch

from latency_specialized import quant
from latency_specialized.cli import main
from latency_specialized.errors import UserError
from latency_specialized.plugins import get_registry

from tests.models.kept_experts import assert_program_binds_kept_experts, generate_in_one_graph

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


def test_checkpoint_fused_experts_refused_with_the_fix(tmp_path):
    d = tmp_path / "muse"
    assert main(["make-checkpoint", "muse_spark", "--size", "tiny", str(d)]) == 0
    with pytest.raises(UserError, match="fused.*drop --experts"):
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
