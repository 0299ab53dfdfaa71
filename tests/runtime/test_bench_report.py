"""Bench bookkeeping on the CPU: roofline bytes from the spec, per-layer arithmetic, report files,
and `bench --compare` flagging only regressions beyond the measured noise."""

from __future__ import annotations

import json

import pytest

from latency_specialized.bench import report
from latency_specialized.bench.layer_bench import Measured, layer_bytes, per_layer
from latency_specialized.cli import main
from latency_specialized.hardware import roofline_bandwidth
from latency_specialized.plugins import get_registry


def _full():
    return get_registry().adapter("kimi_k3").spec("full")


def test_kda_layer_bytes_match_hand_count_at_tp8():
    full = _full()
    li = next(l.index for l in full.layers if l.attention.kind == "kda" and l.ffn.kind == "moe")
    b = layer_bytes(full, li, 8, batch=1, context=None, distinct_experts=16)
    # routed experts: 16 x 3 x 3072 x 3584 x 2 B / 8; shared: 3 x 6144 x 7168 x 2 / 8
    assert b["routed_experts"] == pytest.approx(16 * 3 * 3072 * 3584 * 2 / 8)
    assert b["shared_experts"] == pytest.approx(3 * 6144 * 7168 * 2 / 8)
    assert b["router"] == pytest.approx((896 * 7168 * 2 + 896 * 4) / 8)  # bf16 weight, fp32 bias
    # KDA state: 12 heads x 128 x 128 fp32, read + written, per sequence
    assert b["kda_state"] == pytest.approx(12 * 128 * 128 * 4 * 2 + 3 * 12 * 128 * 3 * 2 * 2)
    assert b["total"] == pytest.approx(sum(v for k, v in b.items() if k != "total"))
    # PERF.md: ~290 MB -> ~68 us for the BF16 KDA layer at TP8 batch 1 (their count includes
    # replicated-as-stock pieces); ours must be of that order
    assert 120e6 < b["total"] < 320e6
    us = b["total"] / roofline_bandwidth() * 1e6
    assert 25 < us < 110  # ~68 us on an H200 (and off the GPU), ~97 us on an H100
    b64 = layer_bytes(full, li, 8, batch=64, context=None, distinct_experts=610)
    assert b64["routed_experts"] / b["routed_experts"] == pytest.approx(610 / 16)
    assert b64["kda_state"] == pytest.approx(64 * b["kda_state"])


def test_per_layer_subtracts_the_one_layer_baseline():
    k = Measured("ours[3]", 3, nodes={"kernel": 3 * 11 + 9}, rounds=[3 * 100.0 + 20.0, 3 * 102.0 + 20.0])
    one = Measured("ours[1]", 1, nodes={"kernel": 11 + 9}, rounds=[100.0 + 20.0, 102.0 + 20.0])
    r = per_layer(k, one)
    assert r["us"] == pytest.approx(101.0) and r["kernels"] == pytest.approx(11)
    s = per_layer(Measured("stock", 3, nodes={"kernel": 60}, rounds=[600.0, 606.0]), None)
    assert s["us"] == pytest.approx(201.0) and s["kernels"] == 20 and s["noise"] == pytest.approx(0.01)
    bad = per_layer(k, Measured("ours[1]", 1, error="not capturable"))
    assert bad["us"] is None and "not capturable" in bad["error"]


def _result(us_ours, noise=0.02):
    cells = []
    for i, b in enumerate((1, 8, 64)):
        cells.append({"kind": "kda", "batch": b, "context": None,
                      "ours": {"us": us_ours[i], "noise": noise, "kernels": 12.0, "graph": True},
                      "stock": {"us": 2 * us_ours[i], "noise": noise, "kernels": 20.0},
                      "roofline": {"us": 0.8 * us_ours[i], "bytes": 1e8, "distinct_experts": 16.0 * b},
                      "fraction": 0.8, "stock_fraction": 0.4, "speedup": 2.0})
    return {"schema": 1, "machine": {"gpu": {"name": "NVIDIA H200", "sm": "sm_90"}, "git_commit": "abc"},
            "config": {"model": "kimi_k3", "tp": 8, "layers": 3, "iters": 40, "rounds": 2, "dtype": "bfloat16",
                       "hbm_tb_s": 4.3, "comm": "Communication excluded (one GPU)."},
            "notes": ["note"], "cells": cells}


def test_markdown_json_plot_written(tmp_path):
    res = _result([70.0, 110.0, 400.0])
    report.write_json(res, tmp_path / "r.json")
    md = report.write_markdown(res, tmp_path / "r.md").read_text()
    assert "| kda | 64 | any | 400.0 |" in md and "2.00x" in md and "NVIDIA H200" in md
    assert json.loads((tmp_path / "r.json").read_text())["cells"][0]["ours"]["us"] == 70.0
    pytest.importorskip("matplotlib")
    png = report.write_plot(res, tmp_path / "r.png")
    assert png is not None and png.stat().st_size > 1000


def test_compare_flags_only_regressions_beyond_noise(tmp_path, capsys):
    a = _result([70.0, 110.0, 400.0], noise=0.02)
    b = _result([70.5, 125.0, 380.0], noise=0.02)  # +0.7% (noise), +13.6% (regression), -5% (faster)
    text, regs = report.compare(a, b)
    assert [(r["batch"], r["verdict"]) for r in regs] == [(8, "REGRESSION")]
    assert "same (within noise)" in text and "faster" in text
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    report.write_json(a, pa)
    report.write_json(b, pb)
    assert main(["bench", "--compare", str(pa), str(pb)]) == 1
    assert "1 regression(s)" in capsys.readouterr().out
    assert main(["bench", "--compare", str(pa), str(pa)]) == 0


def test_compare_bad_file_is_a_user_error(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    assert main(["bench", "--compare", str(bad), str(bad)]) == 2
    assert "cells" in capsys.readouterr().err


def test_mla_cells_cache_holds_every_replayed_step():
    """Each replay advances the positions in the graph: an MLA cell's cache must hold them all."""
    from latency_specialized.bench.layer_bench import BenchConfig, steps_per_cell

    cfg = BenchConfig(iters=40, rounds=2, warmup=5)
    assert steps_per_cell(cfg) >= 2 * (5 + 40) + 1
    assert steps_per_cell(BenchConfig(iters=1, rounds=3, warmup=0)) >= 3 * 6 + 1  # eager fallback: 6 per round


def test_machine_info_takes_the_commit_it_is_given(monkeypatch):
    """A device copy's .git can be stale: LS_GIT_COMMIT / LS_GIT_DIRTY win over it."""
    from latency_specialized.bench.machine import machine_info

    monkeypatch.setenv("LS_GIT_COMMIT", "0123abc")
    monkeypatch.setenv("LS_GIT_DIRTY", "0")
    m = machine_info()
    assert m["git_commit"] == "0123abc" and m["git_dirty"] is False
