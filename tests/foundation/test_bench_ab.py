"""`bench --ab`: variant parsing, settings checks, interleaved runs in child processes, the summary (no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from latency_specialized.bench import ab
from latency_specialized.errors import UserError


def test_parse_variants_and_settings():
    v = ab.parse_variant("rounds:latency_specialized.kernels.moe_router.SORT_MAX_TOKENS=0,env.LS_GEMM_TABLE=/tmp/t.json")
    assert v.name == "rounds"
    assert v.settings == (ab.Setting("latency_specialized.kernels.moe_router", "SORT_MAX_TOKENS", 0),
                          ab.Setting("env", "LS_GEMM_TABLE", "/tmp/t.json"))
    assert ab.parse_variant("base") == ab.Variant("base")
    assert ab.parse_variant("x:a.b.FLAG=True").settings[0].value is True
    assert ab.parse_variant("x:a.b.NAME=abc").settings[0].value == "abc"  # not a literal: a string
    for bad in ("", ":a.B=1", "x:novalue", "x:NOMODULE=1", "bad name:a.B=1"):
        with pytest.raises(UserError):
            ab.parse_variant(bad)


def test_settings_are_checked_before_any_run():
    ab.check_settings(ab.parse_variant("ok:latency_specialized.kernels.gemm_gemv.SMALL_N_ROWS=0"))
    with pytest.raises(UserError, match="no attribute SMAL_N_ROWS.*SMALL_N_ROWS"):
        ab.check_settings(ab.parse_variant("typo:latency_specialized.kernels.gemm_gemv.SMAL_N_ROWS=0"))
    with pytest.raises(UserError, match="cannot import"):
        ab.check_settings(ab.parse_variant("m:no_such_pkg.mod.X=1"))


def test_child_process_applies_the_settings_before_running_the_command(tmp_path):
    """The child entry point sets the attribute and the environment, then runs the CLI with argv."""
    probe = tmp_path / "probe.py"
    probe.write_text("import json, os, sys\n"
                     "import latency_specialized.kernels.gemm_gemv as g\n"
                     "print(json.dumps([g.SMALL_N_ROWS, os.environ.get('LS_AB_PROBE')]))\n")
    v = ab.parse_variant("p:latency_specialized.kernels.gemm_gemv.SMALL_N_ROWS=7,env.LS_AB_PROBE=yes")
    payload = {"settings": [[s.target, s.name, s.value] for s in v.settings], "argv": ["models"]}
    code = ("import json, sys, runpy; from latency_specialized.bench import ab; "
            f"ab.apply_settings([ab.Setting(*s) for s in {payload['settings']!r}]); runpy.run_path({str(probe)!r})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == [7, "yes"]
    cmd = ab.child_command(v, ["models"])
    assert cmd[:3] == [sys.executable, "-m", "latency_specialized.bench.ab"] and json.loads(cmd[3])["argv"] == ["models"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    assert r.returncode == 0 and "kimi_k3" in r.stdout  # the child ran `latency-specialized models`


def _fake_result(us_by_cell):
    """Cells keyed (kind, batch, context) or (kind, batch, context, k draft tokens)."""
    return {"cells": [{"kind": key[0], "batch": key[1], "context": key[2], "spec_tokens": key[3] if len(key) > 3 else 0,
                       "ours": {"us": us}} for key, us in us_by_cell.items()]}


def test_runs_interleave_and_the_summary_judges_against_the_spread(tmp_path):
    variants = [ab.parse_variant("base"), ab.parse_variant("fast:latency_specialized.kernels.gemm_gemv.SMALL_N_ROWS=0")]
    times = {("base", 0): 100.0, ("fast", 0): 95.0, ("base", 1): 101.0, ("fast", 1): 95.5}
    calls = []

    def runner(cmd):
        payload = json.loads(cmd[3])
        argv = payload["argv"]
        stem, out = argv[argv.index("--name") + 1], argv[argv.index("--out") + 1]
        _, name, r = stem.split("_")
        calls.append(stem)
        cells = {("kda", 1, None): times[(name, int(r))], ("mla", 1, 4096): 120.0 + int(r),
                 ("kda", 1, None, 7): 150.0 + int(r)}
        with open(os.path.join(out, f"{stem}.json"), "w") as f:
            json.dump(_fake_result(cells), f)
        return 0

    res = ab.run_ab(variants, ["bench", "--kinds", "kda"], tmp_path, repeat=2, say=lambda m: None, runner=runner)
    assert calls == ["ab_base_0", "ab_fast_0", "ab_base_1", "ab_fast_1"]  # interleaved
    text = ab.summarize(variants, res)
    kda = next(l for l in text.splitlines() if l.startswith("| kda | 1 | any | 0 |"))
    mla = next(l for l in text.splitlines() if l.startswith("| mla | 1 | 4096 | 0 |"))
    assert "100.5 [100.0, 101.0]" in kda and "-5.2 us" in kda and kda.endswith("faster |")
    assert mla.endswith("same |")  # identical medians
    # a verification cell (k = 7) is a row of its own, not mixed into the single step's runs
    spec = next(l for l in text.splitlines() if l.startswith("| kda | 1 | any | 7 |"))
    assert "150.5 [150.0, 151.0]" in spec and spec.endswith("same |")
    with pytest.raises(UserError, match="at least two"):
        ab.run_ab(variants[:1], [], tmp_path, runner=runner)
    with pytest.raises(UserError, match="failed"):
        ab.run_ab(variants, [], tmp_path, repeat=1, say=lambda m: None, runner=lambda cmd: 3)
