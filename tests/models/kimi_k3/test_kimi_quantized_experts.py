"""Kimi K3 with its routed experts kept MXFP4 end to end: the stored-layout operations TP and the pieces use
(``quant.layout``), the spec/site plumbing, checkpoints read as stored, ``generate --experts native`` and (on a
GPU) the program on the 4-bit kernels. The matrix's ``-mxfp4`` cells run program vs reference."""

from __future__ import annotations

import re

import pytest
import torch

from latency_specialized import hardware, quant
from latency_specialized.adapter_contract import SpecBoundAdapter
from latency_specialized.cli import main
from latency_specialized.errors import UserError
from latency_specialized.kernels import moe_experts_mma as experts_mma
from latency_specialized.kernels.compile_cache import cute_available
from latency_specialized.ops.plan import build_plan
from latency_specialized.plugins import get_registry
from latency_specialized.quant import layout
from latency_specialized.runtime.composed import shard_weight
from latency_specialized.runtime.pieces_api import WeightDecl

from tests.models.kept_experts import assert_program_binds_kept_experts, generate_in_one_graph, ids, site_format


def _q(shape: tuple[int, ...], fmt: str, seed: int) -> quant.QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    return quant.quantize_weight("x.weight", torch.randn(*shape, generator=g) * 0.1, fmt)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_narrow_cat_stack_are_the_dequantised_operations(fmt):
    a, b = _q((3, 48, 96), fmt, 1), _q((3, 80, 96), fmt, 2)
    da, db = a.dequantize(), b.dequantize()
    cut = layout.narrow(a, 2, 32, 64)                                     # K, on scale-group boundaries
    assert cut.shape == (3, 48, 64) and torch.equal(cut.dequantize(), da[..., 32:96])
    assert torch.equal(layout.narrow(a, 1, 5, 17).dequantize(), da[:, 5:22])   # rows: any cut
    assert torch.equal(layout.narrow(a, 0, 1, 2).dequantize(), da[1:3])        # experts (global scales too)
    if fmt == "mxfp4":  # one multiplier per tensor: only the scale-free format joins rows of two tensors
        assert torch.equal(layout.cat([a, b], 1).dequantize(), torch.cat([da, db], 1))
    ones = [_q((16, 64), fmt, s) for s in range(4)]
    st = layout.stack(ones)
    assert st.shape == (4, 16, 64) and torch.equal(st.dequantize(), torch.stack([o.dequantize() for o in ones]))


def test_layout_refusals_name_the_fix():
    a = _q((2, 16, 64), "mxfp4", 3)
    with pytest.raises(UserError, match="multiples of 32"):
        layout.narrow(a, 2, 0, 16)
    with pytest.raises(UserError, match="share format and shape"):
        layout.stack([a, _q((2, 16, 32), "mxfp4", 4)])
    n1, n2 = _q((16, 32), "nvfp4", 5), _q((16, 32), "nvfp4", 6)
    with pytest.raises(UserError, match="global scales"):
        layout.cat([n1, n2], 0)


def test_tp_shards_of_a_quantized_weight_are_the_shards_of_its_values():
    """``shard_weight`` (TP, with fused parts) cuts codes and scales, never dequantising."""
    q = _q((4, 256, 128), "mxfp4", 7)
    full = q.dequantize()
    down = WeightDecl("experts.w2", (4, 256, 128), split=2)
    gate_up = WeightDecl("experts.w13", (4, 256, 128), split=1, parts=(128, 128))
    for rank in range(2):
        s = shard_weight(down, q, rank, 2)
        assert isinstance(s, quant.QuantizedWeight) and torch.equal(s.dequantize(), full[..., rank * 64:(rank + 1) * 64])
        s = shard_weight(gate_up, q, rank, 2)
        want = torch.cat([full[:, rank * 64:(rank + 1) * 64], full[:, 128 + rank * 64:128 + (rank + 1) * 64]], 1)
        assert torch.equal(s.dequantize(), want)


def test_spec_and_sites_carry_the_kept_format():
    adapter = get_registry().adapter("kimi_k3")
    spec = adapter.spec("medium").with_expert_format("mxfp4")
    with pytest.raises(UserError, match="kept as 'fp8'"):
        spec.with_expert_format("fp8")
    with pytest.raises(UserError, match="scale groups"):  # tiny: 32-wide experts, TP 2 leaves 16
        adapter.spec("tiny").with_expert_format("mxfp4").shard(2)
    reg = get_registry().implementations
    # the mma experts where the CuTe DSL is installed (as on the H200), else the Triton 4-bit kernels; and those with
    # the mma kernel switched off (bench --ab)
    for mma_on in (True, False):
        for batch, triton_impl in ((1, "moe.experts.q4_gemv_triton"), (8, "moe.experts.q4_grouped_triton")):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(experts_mma, "ENABLED", mma_on)
                plan = build_plan(SpecBoundAdapter(adapter, spec), reg, hardware.for_arch("sm_90"), tp=1,
                                  batch=batch, dtype="bfloat16", variant="medium")
            experts = [c for c in plan.choices if c.site.name.endswith("moe.experts")]
            assert experts and all(c.site.ctx.attr("weight_format") == site_format("mxfp4") for c in experts)
            want = experts_mma.NAME if mma_on and cute_available() is True else triton_impl
            assert {c.impl.name for c in experts} == {want}


def test_checkpoint_experts_are_kept_as_stored_and_generate_the_same_tokens(tmp_path, capsys):
    d = tmp_path / "k3"
    assert main(["make-checkpoint", "kimi_k3", "--size", "tiny", "--experts", "mxfp4", str(d)]) == 0
    adapter = get_registry().adapter("kimi_k3")
    ref = adapter.reference(None, checkpoint=d, dtype="float32", expert_format="native")
    kept = {n: w for n, w in ref.program_weights.items() if isinstance(w, quant.QuantizedWeight)}
    assert kept and all(".experts." in n for n in kept)
    from safetensors.torch import load_file

    stored = load_file(str(d / "model.safetensors"))
    name = next(iter(kept))
    assert torch.equal(kept[name].weight, stored["language_model." + name + "_packed"])
    assert torch.equal(kept[name].dequantize(), ref.w[name])   # the reference computes with the same values
    assert ref.spec.layers[1].ffn.expert_format == "mxfp4"
    # the program binds the stored experts, not the reference's dequantised copy (same values: the tokens below
    # alone could not tell)
    assert_program_binds_kept_experts(adapter, ref, "mxfp4")
    args = ["--prompt-ids", "5,9,11", "--max-tokens", "6", "--device", "cpu"]
    assert main(["generate", "--model", "kimi_k3", "--checkpoint", str(d), *args]) == 0
    plain = ids(capsys.readouterr().out)
    assert main(["generate", "--model", "kimi_k3", "--checkpoint", str(d), "--experts", "native", *args]) == 0
    native = ids(capsys.readouterr().out)
    assert plain and native == plain


def test_paired_expert_codes_switch_rearranges_once_and_keeps_the_tokens(tmp_path, capsys, monkeypatch):
    """``latent_moe.PAIR_EXPERT_CODES``: the sites name ``mxfp4/pairs`` (served by the 4-bit kernels at every bucket
    on sm_90), the program binds the experts in the paired layout (the same values), and ``generate`` gives the
    tokens it gives without the switch; ``checkpoint_nibbles`` (what the stock bench hands humming) undoes it."""
    from latency_specialized.pieces.ffn import latent_moe

    d = tmp_path / "k3"
    assert main(["make-checkpoint", "kimi_k3", "--size", "tiny", "--experts", "mxfp4", str(d)]) == 0
    args = ["generate", "--model", "kimi_k3", "--checkpoint", str(d), "--experts", "native", "--prompt-ids", "5,9,11",
            "--max-tokens", "6", "--device", "cpu"]
    monkeypatch.setattr(latent_moe, "PAIR_EXPERT_CODES", False)
    assert main(args) == 0
    plain = ids(capsys.readouterr().out)
    monkeypatch.setattr(latent_moe, "PAIR_EXPERT_CODES", True)
    adapter = get_registry().adapter("kimi_k3")
    spec = adapter.spec("medium").with_expert_format("mxfp4")
    reg = get_registry().implementations
    for batch in (1, 8, 64):
        plan = build_plan(SpecBoundAdapter(adapter, spec), reg, hardware.for_arch("sm_90"), tp=1, batch=batch,
                          dtype="bfloat16", variant="medium")
        experts = [c for c in plan.choices if c.site.name.endswith("moe.experts")]
        assert experts and all(c.site.ctx.attr("weight_format") == "mxfp4/pairs" for c in experts)
        assert all(c.impl.name != "moe.experts.reference" for c in experts), batch
    ref = adapter.reference(None, checkpoint=d, dtype="float32", expert_format="native")
    cpu_plan = build_plan(SpecBoundAdapter(adapter, ref.spec), reg, hardware.for_arch("cpu"), tp=1, batch=1,
                          dtype="float32", variant="tiny")
    program = adapter.program(ref.spec, plans=cpu_plan, cache=ref.new_cache(1, 16), reference=ref)
    ffn = [w["ffn"] for w in program.w_layers if "w13" in w.get("ffn", {})]
    assert ffn
    for f in ffn:
        assert f["w13"].fmt.name == "mxfp4/pairs" and f["w2"].fmt.packing == "paired"
        back = layout.checkpoint_nibbles(f["w2"])
        assert back.fmt.name == "mxfp4" and torch.equal(back.dequantize(), f["w2"].dequantize())
    assert main(args) == 0
    assert ids(capsys.readouterr().out) == plain


def test_experts_native_refusals(tmp_path, capsys):
    d = tmp_path / "bf16"
    assert main(["make-checkpoint", "kimi_k3", "--size", "tiny", str(d)]) == 0
    capsys.readouterr()
    rc = main(["generate", "--model", "kimi_k3", "--checkpoint", str(d), "--experts", "native", "--prompt-ids", "1,2"])
    assert rc == 2 and "drop --experts" in capsys.readouterr().err
    rc = main(["generate", "--model", "qwen3_moe", "--size", "tiny", "--experts", "native", "--prompt-ids", "1,2"])
    assert rc == 2 and "cannot keep its routed experts quantized" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_medium_model_runs_its_mxfp4_experts_on_the_4bit_kernels_in_one_graph(batch, capsys):
    """On a GPU the medium model with MXFP4 experts: every decode step replayed from a CUDA graph, the
    experts on the mma 4-bit kernels, the same tokens as eagerly. (The kernels' numerics against the
    dequantising reference: tests/ops/test_moe_experts_mma_gpu.py; program vs reference: the matrix's
    -mxfp4 cells. A bf16 run of ``--size medium`` is another model - unquantized random weights.)"""
    base = ["generate", "--model", "kimi_k3", "--size", "medium", "--batch", str(batch), "--max-tokens", "8",
            "--prompt-ids", "1,40,41,42", "--show-plan", "--experts", "native"]
    out = generate_in_one_graph(base, experts_mma.NAME, capsys)
    assert re.search(r"reference 0 \| unserved 0", out), out[-800:]
