"""`bench --spec-tokens`: the layer bench's verification cells on the CPU (issue 25).

"Ours" for k > 0 (``layer_bench.build_spec_ours``) over a bench spec of tiny widths: the Kimi K3 bench spec
``with_spec_tokens(k)``, plans with ``tokens = bucket x (1 + k)``, the KDA verify/accept sites called (not
``attn.kda``), routing over all ``batch x (1 + k)`` rows; one cell per k through ``layer_bench._cell`` (eager,
host-timed on the CPU: the figures mean nothing, the wiring does) with a torch stand-in for the stock
composition (its Triton kernels need a GPU); ``add_verify_ratios`` against the k = 0 cell of the same run, the
report's verification table / JSON / plot, the CLI flag's checks. The GPU bench times the same objects at
full widths.
"""

from __future__ import annotations

import json

import pytest
import torch

from latency_specialized.bench import report
from latency_specialized.bench.layer_bench import (BenchConfig, _cell, add_verify_ratios, build_spec_ours,
                                                   verify_bytes)
from latency_specialized.cli import main
from latency_specialized.hardware import roofline_bandwidth
from latency_specialized.plugins import get_registry

ADAPTER = get_registry().adapter("kimi_k3")
TOP_K = 4


class _Small(type(ADAPTER)):
    def bench_spec(self, full, tp, kind, num_layers, *, vocab=512):
        from latency_specialized_models.kimi_k3.spec import build_spec

        return build_spec(variant=f"bench-{kind}x{num_layers}", hidden=64, vocab=vocab, num_layers=num_layers,
                          mla_layers=tuple(range(num_layers)) if kind == "mla" else (), kda_heads=8, head_dim=16,
                          mla_heads=8, q_lora=32, kv_lora=16, nope=8, rope=8, v_dim=8, experts=16, top_k=TOP_K,
                          shared=2, expert_inter=32, latent=32, dense_layers=(), dense_inter=32, block_size=3,
                          max_context=4096, expert_format="bf16")


class _FakeStock:
    """A torch stand-in of a stock composition at ``rows`` rows (records the rows it was built for)."""

    built_rows: list[int] = []

    def __init__(self, rows: int, copies: int):
        _FakeStock.built_rows.append(rows)
        self.x = torch.randn(rows, 64)
        self.w = torch.randn(64, 64)
        self.ids = [torch.randint(0, 16, (rows, TOP_K), generator=torch.Generator().manual_seed(i))
                    for i in range(copies)]

    def step(self) -> None:
        for _ in self.ids:
            self.x = torch.tanh(self.x @ self.w)

    def routed_ids(self) -> list[torch.Tensor]:
        return self.ids


def _build_fake_stock(full, bk, tp, batch, context, copies, device, *, experts=None):
    return _FakeStock(batch, copies)


@pytest.fixture
def cpu_bench(monkeypatch):
    from latency_specialized import hardware as hw

    monkeypatch.setattr(hw, "probe", lambda: hw.for_arch("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    _FakeStock.built_rows = []
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_spec_cells_time_the_verification_program_against_the_single_step(kind, cpu_bench, tmp_path):
    full = ADAPTER.spec("full")
    small = _Small()
    bk = small.bench_kinds()[kind]
    cfg = BenchConfig(model="kimi_k3", tp=1, batches=(1, 2), contexts=(8,), kinds=(kind,), layers=2, iters=2,
                      rounds=2, warmup=0, spec_tokens=(3,))
    assert cfg.spec_ks() == (0, 3)
    contexts = (8,) if bk.context else ()
    context = 8 if bk.context else None
    cpu = torch.device("cpu")
    say = lambda s: None  # noqa: E731
    plain = small.layer_bench().build_ours(full, 1, kind, 2, cfg.batches, cpu, say=say, contexts=contexts, steps=40)
    spec = build_spec_ours(small, full, 1, kind, 2, cfg.batches, cpu, 3, say=say, contexts=contexts, steps=40)
    # the program the runtime builds for k = 3: plans of bucket x 4 tokens, the spec built for 3 drafts
    prog = spec.built[2].program
    assert prog.spec_tokens == 3 and spec.built[2].spec.spec_tokens == 3
    assert {b: p.tokens for b, p in prog.plans.items()} == {1: 4, 2: 8}
    assert spec.built[2].buffers.spec.spec_tokens == 3 and "verification steps of k = 3" in spec.description
    cells = []
    for k, ours in ((0, plain), (3, spec)):
        for batch in cfg.batches:
            cells.append(_cell(cfg, full, bk, kind, batch, context, ours, say, _build_fake_stock, spec_tokens=k,
                               device=cpu))
    # stock ran at batch x (1 + k) rows
    assert _FakeStock.built_rows == [1, 2, 4, 8]
    calls = prog.calls
    if kind == "kda":  # the verification path ran: verify + accept, never the single-token KDA op
        assert calls[f"{kind}+moe/attn.kda_verify"] > 0 and calls[f"{kind}+moe/attn.kda_accept"] > 0
        assert calls.get(f"{kind}+moe/attn.kda", 0) == 0
        assert any("attn.kda_verify=attention.kda_verify.reference" in n for n in spec.notes)
    else:
        assert calls[f"{kind}+moe/attn.mla"] > 0
    assert all(n.startswith("[k=3] ") for n in spec.notes)
    add_verify_ratios(cells)
    for c in cells:
        assert c["rows"] == c["batch"] * (1 + c["spec_tokens"])
        assert c["ours"]["us"] is not None and c["ours"]["us"] > 0 and c["ours"]["graph"] is False
    spec_cells = [c for c in cells if c["spec_tokens"]]
    assert [(c["batch"], c["rows"]) for c in spec_cells] == [(1, 4), (2, 8)]
    for c in spec_cells:
        v = c["verify"]
        single = next(s for s in cells if not s["spec_tokens"] and s["batch"] == c["batch"])
        assert v["ratio"] > 0 and v["ratio"] == pytest.approx(c["ours"]["us"] / single["ours"]["us"])
        assert v["stock_ratio"] > 0 and v["rows"] == c["rows"] and v["target_ratio"] == 1.3
        assert v["extra_us"] == pytest.approx(c["ours"]["us"] - single["ours"]["us"])
        assert v["extra_us_per_row"] == pytest.approx(v["extra_us"] / (c["rows"] - c["batch"]))
        # distinct experts of all rows (4 per row of 16): at least the single step's count is possible, never more
        # than rows x top-k or the experts there are
        assert 1 <= c["roofline"]["distinct_experts"] <= min(16, c["rows"] * TOP_K)
        assert v["distinct_experts"] == c["roofline"]["distinct_experts"]
        assert "extra_expert_us" in v and v["kernels"] is None  # no graph on the CPU: no kernel counts
        tape = verify_bytes(full, bk.layer, 1, c["batch"], 3)
        assert ("kda_tape" in c["roofline"]["breakdown"]) == (kind == "kda") == bool(tape)
    # the report: the single steps in the main table, the verification cells in their own table
    res = {"schema": 1, "machine": {}, "config": {"model": "kimi_k3", "tp": 1, "spec_tokens": [0, 3]},
           "notes": [], "cells": cells}
    md = report.to_markdown(res)
    assert "## Verification steps" in md and "verification / single step" in md
    row = next(l for l in md.splitlines() if l.startswith(f"| {kind} | 1 | ") and "| 3 | 4 |" in l)
    assert f"**{spec_cells[0]['verify']['ratio']:.2f}x**" in row and ("(yes)" in row or "(no)" in row)
    main_rows = [l for l in md.split("## Verification")[0].splitlines() if l.startswith(f"| {kind} |")]
    assert len(main_rows) == 2  # k = 0 cells only
    report.write_json(res, tmp_path / "r.json")
    back = json.loads((tmp_path / "r.json").read_text())
    assert back["cells"][2]["verify"]["ratio"] > 0 and back["cells"][2]["rows"] == 4
    pytest.importorskip("matplotlib")
    png = report.write_plot(res, tmp_path / "r.png")
    assert png is not None and png.stat().st_size > 1000
    plain.close()
    spec.close()


def test_verify_ratio_and_extra_rows_arithmetic():
    def cell(k, us, experts, kernels, stock_us):
        return {"kind": "kda", "batch": 1, "context": None, "spec_tokens": k, "rows": 1 + k,
                "ours": {"us": us, "kernels": kernels, "noise": 0.01}, "stock": {"us": stock_us},
                "roofline": {"us": 50.0 + experts, "distinct_experts": experts,
                             "breakdown": {"routed_experts": experts * 4.3e6}}}

    cells = add_verify_ratios([cell(0, 100.0, 16, 15, 180.0), cell(7, 124.0, 100, 40, 700.0)])
    v = cells[1]["verify"]
    assert v["ratio"] == pytest.approx(1.24) and v["meets_target"] is True
    assert v["extra_us"] == pytest.approx(24.0) and v["extra_us_per_row"] == pytest.approx(24.0 / 7)
    # 84 experts x 4.3 MB over the rooflines' bandwidth (this GPU's; the H200's 4.3 TB/s without one: 84 us)
    assert v["extra_experts"] == 84 and v["extra_expert_us"] == pytest.approx(84 * 4.3e6 / roofline_bandwidth() * 1e6)
    assert v["stock_ratio"] == pytest.approx(700 / 180) and v["extra_kernels"] == 25
    assert "verify" not in cells[0]
    lone = add_verify_ratios([cell(3, 120.0, 40, 20, 300.0)])[0]["verify"]
    assert "no k = 0 cell" in lone["error"]
    # compare keys verification cells apart from single steps
    res = {"cells": cells}
    _, regs = report.compare(res, res)
    assert regs == []


def test_spec_tokens_flag_checks(capsys):
    assert main(["bench", "--model", "kimi_k3", "--kinds", "kda", "--spec-tokens", "-1"]) == 2
    assert "draft-token counts >= 0" in capsys.readouterr().err
    assert main(["bench", "--model", "kimi_k3", "--kinds", "kda", "--spec-tokens", "x"]) == 2
    if not torch.cuda.is_available():  # the flag parses; the bench itself then asks for a GPU
        assert main(["bench", "--model", "kimi_k3", "--kinds", "kda", "--spec-tokens", "0,3,7"]) == 2
        assert "CUDA GPU" in capsys.readouterr().err


def test_shared_routing_reads_the_single_steps_experts_in_every_row(cpu_bench):
    """``--routing shared`` (``layer_harness.share_routing``): ours' routers zeroed, so every row of a
    verification step takes the experts its layer's selection bias ranks first - the distinct experts of a
    k = 3 step at batch 2 (8 rows) are the single step's top-k, where random routing spreads them."""
    full = ADAPTER.spec("full")
    small = _Small()
    bk = small.bench_kinds()["mla"]
    cfg = BenchConfig(model="kimi_k3", tp=1, batches=(2,), contexts=(8,), kinds=("mla",), layers=2, iters=2,
                      rounds=2, warmup=0, spec_tokens=(3,), routing="shared")
    cpu = torch.device("cpu")
    say = lambda s: None  # noqa: E731
    distinct = {}
    for routing in ("random", "shared", "scaled:0.3"):
        plain = small.layer_bench().build_ours(full, 1, "mla", 2, cfg.batches, cpu, say=say, contexts=(8,),
                                               steps=40, routing=routing)
        spec = build_spec_ours(small, full, 1, "mla", 2, cfg.batches, cpu, 3, say=say, contexts=(8,), steps=40,
                               routing=routing)
        for k, ours in ((0, plain), (3, spec)):
            cell = _cell(cfg, full, bk, "mla", 2, 8, ours, say, _build_fake_stock, spec_tokens=k, device=cpu)
            distinct[routing, k] = cell["roofline"]["distinct_experts"]
    assert distinct["shared", 0] == distinct["shared", 3] == TOP_K
    assert distinct["random", 3] > TOP_K  # 8 rows on random routers spread over more of the 16 experts
    # router weights scaled down: the bias decides part of the choice, the rows share some experts
    assert TOP_K < distinct["scaled:0.3", 3] < distinct["random", 3]


def test_routing_choices_are_checked(capsys):
    from latency_specialized.bench.layer_bench import routing_note
    from latency_specialized.errors import UserError
    from latency_specialized.runtime.layer_harness import share_routing

    harness = ADAPTER.layer_bench()
    assert routing_note(harness, "random") == []
    assert "zeroed" in routing_note(harness, "shared")[0]
    with pytest.raises(UserError, match="choose one of random, shared, scaled:X"):
        routing_note(harness, "hashed")
    for bad in ("scaled:0", "scaled:1", "scaled:x", "scaled"):
        with pytest.raises(UserError, match="0 < X < 1"):
            routing_note(harness, bad)
    assert "scaled by 0.1" in routing_note(harness, "scaled:0.1")[0]

    class _Old:
        def build_ours(self, full, tp, kind, layers, batches, device, *, seed=0, say=print, contexts=(), steps=256):
            raise AssertionError("not called")

    with pytest.raises(UserError, match="takes no routing= keyword"):
        routing_note(_Old(), "shared")
    with pytest.raises(UserError, match="no FFN router"):
        share_routing({0: {"attn": {"q_proj": torch.zeros(2)}}})


def test_shared_routing_gathers_zero_logits_for_the_other_ranks():
    """At TP > 1 the router is split across ranks and all-gathered; the one-GPU bench's stand-in group fills
    the other ranks' slices. Under ``--routing shared`` they must be zeros (what zeroed router weights give on
    every rank), or every row sees its own random logits and a verification step's rows spread over many
    experts again (the first H200 run of ``--routing shared`` at TP8: 92 distinct experts at k = 7, not 16)."""
    from latency_specialized.runtime.layer_harness import bench_communicator

    assert bench_communicator(1, "shared") is None and bench_communicator(1, "random") is None
    assert bench_communicator(8, "scaled:0.25").stand_in_std == 0.25
    mine = torch.zeros(3, 5)  # rank 0's zeroed-router logits, 3 rows
    shared = bench_communicator(8, "shared").all_gather(mine)
    assert shared.shape == (3, 40) and torch.count_nonzero(shared) == 0
    spread = bench_communicator(8, "random").all_gather(mine)
    assert torch.count_nonzero(spread[:, 5:]) == 3 * 35 and not torch.equal(spread[0, 5:], spread[1, 5:])
