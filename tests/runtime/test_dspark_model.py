"""``benchmarks/scripts/dspark_model.py`` (a MODEL of Kimi K3 TP8 decode speed with DSpark) on a synthetic bench
JSON and all-reduce table: the arithmetic against hand-computed values, interpolation only between measured k,
the policies per a, the files written with their 'MODEL, not a measurement' label."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scripts" / "dspark_model.py"


@pytest.fixture(scope="module")
def dm():
    spec = importlib.util.spec_from_file_location("dspark_model", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SITES = {"kda+moe/attn.allreduce": 1.0, "kda+moe/ffn.allreduce": 1.0, "kda+moe/moe.latent_allreduce": 1.0,
         "kda+moe/attn.kda": 1.0, "kda+moe/moe.all_gather": 0.0}
US = {"kda": {0: 100.0, 3: 110.0, 7: 130.0}, "mla": {0: 110.0, 3: 120.0, 7: 140.0}}


def _bench(tmp_path: Path) -> list[Path]:
    files = []
    for kind in ("kda", "mla"):
        cells = []
        for k, us in US[kind].items():
            ctx = None if kind == "kda" else 4096
            sites = {n.replace("kda+moe", f"{kind}+moe"): v for n, v in SITES.items()}
            cells.append({"kind": kind, "batch": 1, "context": ctx, "spec_tokens": k, "rows": 1 + k,
                          "ours": {"us": us, "site_kernels": sites, "noise": 0.01}})
            # other cells the model must ignore: batch 8, another context
            cells.append({"kind": kind, "batch": 8, "context": ctx, "spec_tokens": k, "rows": 8 * (1 + k),
                          "ours": {"us": 10 * us, "site_kernels": sites}})
            if ctx:
                cells.append({"kind": kind, "batch": 1, "context": 32768, "spec_tokens": k, "rows": 1 + k,
                              "ours": {"us": 5 * us, "site_kernels": sites}})
        p = tmp_path / f"bench_{kind}.json"
        p.write_text(json.dumps({"schema": 1, "machine": {"gpu": {"name": "NVIDIA H200"}, "git_commit": "abc"},
                                 "config": {"model": "kimi_k3", "tp": 8, "spec_tokens": [0, 3, 7]}, "cells": cells}))
        files.append(p)
    return files


def _ar(tmp_path: Path) -> Path:
    # world 2 one-shot: 6 us up to 14336 B, then linear to 10 us at 114688 B; other worlds/algos must be ignored
    rows = [{"world_size": 2, "algo": "one_shot", "tokens": 1, "message_bytes": 14336, "graph_us": 6.0},
            {"world_size": 2, "algo": "one_shot", "tokens": 8, "message_bytes": 114688, "graph_us": 10.0},
            {"world_size": 2, "algo": "two_stage", "tokens": 1, "message_bytes": 14336, "graph_us": 99.0},
            {"world_size": 4, "algo": "one_shot", "tokens": 1, "message_bytes": 14336, "graph_us": 99.0}]
    p = tmp_path / "ar.json"
    p.write_text(json.dumps({"device": "NVIDIA H200", "hidden": 7168, "multi_process": rows}))
    return p


def _ar_us(rows_, width):
    b = rows_ * width * 2
    return 6.0 if b <= 14336 else 6.0 + (b - 14336) / (114688 - 14336) * 4.0


def test_model_arithmetic_matches_a_hand_count(dm, tmp_path):
    cells, sources = dm.load_cells(_bench(tmp_path))
    ar = dm.allreduce_table(_ar(tmp_path))
    shape = dm.model_shape()
    assert shape["layers"] == {"kda": 69, "mla": 24} and shape["dense_layers"] == {"kda": 1}
    assert (shape["hidden"], shape["latent"]) == (7168, 3584)
    m = dm.build_model(cells, ar, shape, batch=1, context=4096)
    assert m["label"] == "MODEL, not a measurement" and m["measured_k"] == {"kda": [0, 3, 7], "mla": [0, 3, 7]}
    steps = {s["k"]: s for s in m["steps"]}
    assert sorted(steps) == list(range(8))  # 0..7: measured 0, 3, 7, the rest interpolated between them
    assert [k for k, s in steps.items() if s["interpolated"]] == [1, 2, 4, 5, 6]

    def hand(k, kda_us, mla_us):
        rows_ = 1 + k
        comm = 2 * _ar_us(rows_, 7168) + _ar_us(rows_, 3584)  # attn + ffn (hidden) + latent (3584) per layer
        return 69 * kda_us + 24 * mla_us + 93 * comm

    # k = 0: 1 row, every message <= 14336 B -> 3 x 6 us per layer
    assert hand(0, 100, 110) == pytest.approx(69 * 100 + 24 * 110 + 93 * 18.0)
    for k, kda_us, mla_us in ((0, 100, 110), (3, 110, 120), (7, 130, 140), (5, 120, 130),
                              (1, 100 + 10 / 3, 110 + 10 / 3)):
        assert steps[k]["step_us"] == pytest.approx(hand(k, kda_us, mla_us)), k
    # k = 7: 8 rows -> attn/ffn messages 114688 B (10 us), latent 57344 B (6 + 43008/100352 x 4)
    lat = 6.0 + (8 * 3584 * 2 - 14336) / (114688 - 14336) * 4.0
    assert steps[7]["comm_us"] == pytest.approx(93 * (20.0 + lat))
    assert steps[7]["kinds"]["kda"]["comm_sites_from"] == "bench cell"
    curve = {c["a"]: c for c in m["curve"]}
    assert curve[1]["best_k"] == 0 and curve[1]["tok_s_best_k"] == pytest.approx(1e6 / hand(0, 100, 110))
    assert curve[4]["best_k"] == 3 and curve[4]["tok_s_best_k"] == pytest.approx(4e6 / hand(3, 110, 120))
    assert curve[6]["best_k"] == 5 and curve[6]["best_k_interpolated"] is True
    assert curve[8]["best_k"] == 7 and curve[8]["tok_s_best_k"] == pytest.approx(8e6 / hand(7, 130, 140))
    for a, c in curve.items():
        assert c["tok_s_k7"] == pytest.approx(a * 1e6 / hand(7, 130, 140))
        assert c["vs_reference_best_k"] == pytest.approx(c["tok_s_best_k"] / 842.0)
    only = {c["a"]: c for c in dm.build_model(cells, ar, shape, context=4096, measured_only=True)["curve"]}
    assert [only[a]["best_k"] for a in range(1, 9)] == [0, 3, 3, 3, 7, 7, 7, 7]
    # hand numbers, written out: k = 0 step = 6900 + 2640 + 1674 us = 11214 us -> 89.2 tok/s at a = 1
    assert curve[1]["tok_s_best_k"] == pytest.approx(1e6 / 11214)


def test_only_measured_range_is_modelled_and_draft_time_adds(dm, tmp_path):
    cells, _ = dm.load_cells(_bench(tmp_path))
    cells = [c for c in cells if c["spec_tokens"] != 7]  # measured 0 and 3 only
    ar = dm.allreduce_table(_ar(tmp_path))
    m = dm.build_model(cells, ar, dm.model_shape(), context=4096, draft_us=500.0)
    assert [s["k"] for s in m["steps"]] == [0, 1, 2, 3]
    curve = {c["a"]: c for c in m["curve"]}
    assert curve[4]["best_k"] == 3 and curve[5]["best_k"] is None and curve[5]["tok_s_best_k"] is None
    assert all(c["tok_s_k7"] is None for c in m["curve"])
    s0 = m["steps"][0]
    assert s0["step_us"] == pytest.approx(69 * 100 + 24 * 110 + 93 * 18.0 + 500.0)
    with pytest.raises(SystemExit, match="context 8192"):
        dm.build_model(cells, ar, dm.model_shape(), context=8192)


def test_cli_writes_labelled_md_json_png(dm, tmp_path, capsys):
    files = _bench(tmp_path)
    rc = dm.main(["--bench", *map(str, files), "--allreduce", str(_ar(tmp_path)), "--context", "4096",
                  "--out", str(tmp_path / "out"), "--name", "m"])
    assert rc == 0
    md = (tmp_path / "out" / "m.md").read_text()
    assert "MODEL, NOT A MEASUREMENT" in md and "842 tok/s" in md and "interpolated" in md
    data = json.loads((tmp_path / "out" / "m.json").read_text())
    assert data["label"] == "MODEL, not a measurement" and data["reference_tok_s"] == 842.0
    assert len(data["curve"]) == 8 and data["allreduce"]["world"] == 2
    pytest.importorskip("matplotlib")
    assert (tmp_path / "out" / "m.png").stat().st_size > 1000


def test_the_stored_2_gpu_figures_load(dm):
    """The tree's 2-GPU all-reduce files (ours fused, NCCL + norm) load as tables, ours faster at 1 token."""
    root = SCRIPT.parents[2] / "benchmarks" / "results" / "h200x2"
    assert (root / "allreduce_x2.json").is_file(), "the committed 2-GPU all-reduce results are missing"
    ours = dm.allreduce_table(root / "allreduce_x2.json")
    nccl = dm.allreduce_table(root / "nccl_allreduce_norm.json")
    assert ours["world"] == nccl["world"] == 2 and nccl["algo"] == "nccl+norm"
    assert 0 < dm.allreduce_us(ours, 7168 * 2) < dm.allreduce_us(nccl, 7168 * 2)
