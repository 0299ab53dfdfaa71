"""Both fused all-reduce kernels compile for sm_90a on this (GPU-less) machine, with the
instructions the protocol relies on and none it forbids."""

from __future__ import annotations

import re

import pytest

from latency_specialized.kernels.allreduce_common import FusedAllReduceConfig, cute_available

pytestmark = pytest.mark.skipif(cute_available() is not True, reason="nvidia-cutlass-dsl not installed")


@pytest.mark.parametrize("module", ["allreduce_lamport", "allreduce_two_stage"])
def test_compiles_for_hopper_with_unicast_system_scope_traffic(module, tmp_path, monkeypatch):
    import importlib

    mod = importlib.import_module(f"latency_specialized.kernels.{module}")
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the PTX file into the working directory
    # Kimi K3 shape: N=7168 bf16, TP=8 -> 896 vectors per row, one per thread, no predicates
    fn = mod.compile_for(FusedAllReduceConfig("bfloat16", 7168, 8), extra_options="--keep-ptx")
    ptx = fn.__ptx__
    assert ".target sm_90a" in ptx
    assert re.search(r"st\.relaxed\.sys\.global\.v4\.b32", ptx), "peer stores must be 128-bit, system scope"
    assert re.search(r"ld\.relaxed\.sys\.global\.v4\.b32", ptx), "spin loads must be 128-bit, system scope"
    assert "multimem" not in ptx, "NVLink multicast must stay off"
    assert "bar.sync" in ptx  # the CTA reduction of the norm; no grid-wide barrier exists
    assert "atom.global" in ptx  # the arrival counter that advances the slot rotation


def test_config_splits_rows_exactly_for_the_model_widths():
    for n in (7168, 5120, 8192, 6144):
        cfg = FusedAllReduceConfig("bfloat16", n, 8)
        threads, vpt = cfg.threads_and_vpt
        assert cfg.exact and threads % 32 == 0 and threads <= 1024 and threads * vpt == cfg.vecs
    tiny = FusedAllReduceConfig("bfloat16", 64, 2)
    assert tiny.threads_and_vpt == (32, 1) and not tiny.exact  # 8 vectors: predicated
