"""`bench --experts mxfp4`: the layer bench's cells with routed experts kept quantized, on the CPU (issue 24).

"Ours" over the small Kimi K3 bench spec of ``test_bench_spec`` with its experts kept MXFP4: random weights
quantized once (``runtime.random_weights.quantize_routed_experts``), the program binding ``QuantizedWeight``
experts, its ``moe.experts`` site carrying ``weight_format`` (served by the reference on the CPU, by the 4-bit
kernels on the H200), the same codes handed to stock (``expert_weights``); the cell's roofline counts 4.25 bits a
routed-expert value. Stock's MXFP4 path is humming (GPU only): on the CPU it must refuse with the fix.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.bench.layer_bench import BenchConfig, _cell, bench_notes, layer_bytes
from latency_specialized.errors import UserError
from latency_specialized.quant.checkpoint_io import QuantizedWeight

from tests.runtime.test_bench_spec import ADAPTER, _build_fake_stock, _Small, cpu_bench  # noqa: F401 (fixture)


def test_layer_bytes_count_the_stored_bits_of_quantized_experts():
    full = ADAPTER.spec("full")
    li = next(i for i, layer in enumerate(full.layers) if layer.ffn.kind == "moe")
    bf16 = layer_bytes(full, li, 8, 1, None, 16.0)
    q4 = layer_bytes(full, li, 8, 1, None, 16.0, expert_format="mxfp4")
    assert q4["routed_experts"] == pytest.approx(bf16["routed_experts"] * 4.25 / 16)
    assert {k: v for k, v in q4.items() if k not in ("routed_experts", "total")} == \
        {k: v for k, v in bf16.items() if k not in ("routed_experts", "total")}
    notes = bench_notes(full, {}, 8, "mxfp4")
    assert any("MXFP4 in both variants" in n and "4.25 bits" in n for n in notes)


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_mxfp4_cells_bind_quantized_experts_and_count_their_bytes(kind, cpu_bench):
    full = ADAPTER.spec("full")
    small = _Small()
    bk = small.bench_kinds()[kind]
    cfg = BenchConfig(model="kimi_k3", tp=1, batches=(2,), contexts=(8,), kinds=(kind,), layers=2, iters=2,
                      rounds=2, warmup=0, experts="mxfp4")
    contexts, context = ((8,), 8) if bk.context else ((), None)
    cpu = torch.device("cpu")
    ours = small.layer_bench().build_ours(full, 1, kind, 2, cfg.batches, cpu, say=lambda s: None, contexts=contexts,
                                          steps=40, experts="mxfp4")
    prog = ours.built[2].program
    w13, w2 = prog.w_layers[0]["ffn"]["w13"], prog.w_layers[0]["ffn"]["w2"]
    # the experts in the paired layout (pieces.ffn.latent_moe.PAIR_EXPERT_CODES), same bytes per value
    assert isinstance(w13, QuantizedWeight) and isinstance(w2, QuantizedWeight) and w13.fmt.name == "mxfp4/pairs"
    site = next(c for p in prog.plans.values() for c in p.choices if c.site.name.endswith("moe.experts"))
    assert site.site.ctx.attr("weight_format") == "mxfp4/pairs"
    pairs = ours.expert_weights(2)
    assert all(isinstance(a, QuantizedWeight) and isinstance(b, QuantizedWeight) for a, b in pairs)
    cell = _cell(cfg, full, bk, kind, 2, context, ours, lambda s: None, _build_fake_stock, device=cpu)
    assert cell["ours"]["us"] and cell["ours"]["us"] > 0
    r = cell["roofline"]
    f = full.layers[bk.layer].ffn  # the roofline is the full model's layer at this TP
    per_expert = 3 * f.expert_intermediate * f.latent_dim * 4.25 / 8
    assert r["breakdown"]["routed_experts"] == pytest.approx(r["distinct_experts"] * per_expert)
    assert prog.calls[f"{kind}+moe/moe.experts"] > 0
    ours.close()


def test_stock_mxfp4_experts_need_humming_and_refuse_other_formats():
    from latency_specialized.bench.stock.compositions import COMPOSITIONS
    from latency_specialized.bench.stock.layers import _humming_experts
    from latency_specialized.quant.checkpoint_io import quantize_weight
    from latency_specialized.spec import ActivationSpec

    situ = ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)
    w13 = quantize_weight("e.w13.weight", torch.randn(2, 64, 64), "mxfp4")
    w2 = quantize_weight("e.w2.weight", torch.randn(2, 64, 32), "mxfp4")
    with pytest.raises(UserError, match="humming"):  # not installed here: the error names the package
        _humming_experts(w13, w2, situ)
    nv = quantize_weight("e.w13.weight", torch.randn(2, 64, 64), "nvfp4")
    with pytest.raises(UserError, match="MXFP4 only"):
        _humming_experts(nv, nv, situ)
    # only the Kimi K3 compositions run quantized experts as stock does; the bench refuses the others up front
    assert {n for n, c in COMPOSITIONS.items() if "mxfp4" in c.expert_formats} == {"kda_moe", "mla_moe"}


def test_experts_flag_reaches_the_config(monkeypatch):
    from latency_specialized.commands import bench as cmd

    seen = {}

    def fake_run_bench(cfg, say, checkpoint):
        seen["cfg"] = cfg
        raise SystemExit(0)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("latency_specialized.bench.layer_bench.run_bench", fake_run_bench)
    import argparse

    parser = cmd.add_parser(argparse.ArgumentParser().add_subparsers())
    args = parser.parse_args(["--model", "kimi_k3", "--kinds", "kda", "--experts", "mxfp4"])
    with pytest.raises(SystemExit):
        cmd.run(args)
    assert seen["cfg"].experts == "mxfp4"
