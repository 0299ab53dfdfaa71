"""The long check's modes (``testing/long_check.py``, issue 25) on the CPU with Kimi K3's tiny model: bf16 against
the bf16 reference with a partial fp32 floor, fp32 against the fp32 reference, state drift at checkpoints, NaN/inf
on every step (a poisoned program stops the run and fails it), free-running determinism (and that a perturbed
second program is caught), and ``benchmarks/scripts/long_check.py`` writing its JSON and markdown. The H200 runs
(4,000 steps of the medium model) are the script's; see models/kimi_k3/NOTES.md."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from latency_specialized.plugins import get_registry
from latency_specialized.testing import long_check as lc

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "scripts" / "long_check.py"
QUIET = dict(say=lambda s: None)


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's ops are far too small for threads (testing/verify.py runs them single-threaded too)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def kimi():
    return get_registry().adapter("kimi_k3")


class Tampered:
    """``adapter`` whose programs get weights changed by ``change(weights, index)`` (index: programs built so far)."""

    def __init__(self, adapter, change):
        self._a, self._change, self.built = adapter, change, 0

    def __getattr__(self, name):
        return getattr(self._a, name)

    def program(self, spec, *, weights, **kw):
        weights = self._change(dict(weights), self.built, spec, self._a)
        self.built += 1
        return self._a.program(spec, weights=weights, **kw)


def embed_name(adapter, spec) -> str:
    return adapter.tensor_names(spec)(-1, "embed", "weight")


def test_bf16_with_a_floor_prefix_and_fp32_against_the_fp32_reference():
    r = lc.teacher_forced(kimi(), 2, 6, variant="tiny", device="cpu", router_scale=0.0, fp32_floor=True,
                          floor_steps=4, state_every=2, **QUIET)
    assert r.ok and r.dtype == "bfloat16" and r.steps_run == 6 and r.fast_steps == 6
    assert r.nonfinite_logits == r.nonfinite_ref_logits == r.nonfinite_states == 0
    assert r.floor_steps == 4 and r.floor_max_rel_err is not None and 0 < r.decisive_fraction <= 1
    assert r.top1_agreement == 1.0 and r.max_rel_err < 2e-2  # CPU: the references serve every site
    assert [c["step"] for c in r.checkpoints] == [2, 4, 6]
    states = r.checkpoints[-1]["states"]
    assert any(k.endswith(".state") for k in states) and any(k.endswith(".kv") for k in states)  # KDA and MLA
    assert all(math.isfinite(v) for v in states.values())
    # the program's states (fp32 KDA states, bf16 caches) stay within summation-order noise of the reference's
    assert r.state_max_rel_err < 1e-4 and r.state_last_rel_err <= r.state_max_rel_err
    # the floor's state (bf16 reference vs fp32 reference) only while it ran: bf16 rounding, far above the program's
    assert r.checkpoints[1]["state_floor_max_rel_err"] > 10 * r.state_max_rel_err
    assert "state_floor_max_rel_err" not in r.checkpoints[2]
    assert set(r.ms_per_step) >= {"program", "reference", "floor", "total"} and r.ms_per_step["floor"] > 0

    f = lc.teacher_forced(kimi(), 2, 4, variant="tiny", device="cpu", router_scale=0.0, dtype="fp32",
                          fp32_floor=True, state_every=3, **QUIET)
    assert f.ok and f.dtype == "float32" and f.floor_steps == 0 and f.floor_max_rel_err is None
    assert f.top1_agreement == 1.0 and f.max_rel_err < 5e-5  # verify.REL_TOL: summation order only
    assert [c["step"] for c in f.checkpoints] == [3, 4] and f.state_max_rel_err < 1e-4
    assert f.reference_sites and f.eager_reason == ""  # the CPU: eager, references everywhere


def test_a_nan_stops_the_run_and_fails_it():
    def poison(w, i, spec, a):
        w[embed_name(a, spec)] = torch.full_like(w[embed_name(a, spec)], float("nan"))
        return w

    r = lc.teacher_forced(Tampered(kimi(), poison), 2, 5, variant="tiny", device="cpu", router_scale=0.0,
                          state_every=100, **QUIET)
    assert not r.ok and r.steps_run == 1 and r.nonfinite_logits == 2 * kimi().spec("tiny").vocab_size
    assert r.nonfinite_ref_logits == 0 and math.isnan(r.max_rel_err)
    assert r.checkpoints and r.checkpoints[-1]["step"] == 1 and r.nonfinite_states > 0  # the state at the stop
    with pytest.raises(lc.NonFiniteError, match="non-finite program logits"):
        lc.check([r])


def test_free_running_repeats_are_identical_and_a_difference_is_caught():
    p = lc.free_running(kimi(), 2, 6, variant="tiny", device="cpu", **QUIET)
    assert p.ok and p.tokens_identical and p.logits_identical and p.first_mismatch_step is None
    assert p.distinct_tokens > 1 and p.nonfinite_logits == 0
    lc.check([p])

    def nudge(w, i, spec, a):  # the second program's embedding scaled by 1 + 2^-6: same model, other bits
        if i:
            w[embed_name(a, spec)] = w[embed_name(a, spec)] * (1 + 2 ** -6)
        return w

    q = lc.free_running(Tampered(kimi(), nudge), 2, 6, variant="tiny", device="cpu", **QUIET)
    assert not q.logits_identical and q.first_mismatch_step == 0
    with pytest.raises(lc.NotDeterministicError):
        lc.check([q])
    assert "**NO**" in lc.markdown("t", "", [], [q])


def test_script_writes_json_and_markdown_for_both_modes_and_the_repeats(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("long_check_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "tiny.json"
    rc = script.main(["--model", "kimi_k3", "--variant", "tiny", "--device", "cpu", "--runs", "2:3:0",
                      "--dtypes", "bf16,fp32", "--floor-steps", "2", "--state-every", "2", "--repeat-batches", "1,2",
                      "--repeat-steps", "3", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert "partial" not in data  # written at every checkpoint while a run is under way, dropped once it is done
    assert [(r["dtype"], r["batch"], r["steps_run"]) for r in data["runs"]] == [("bfloat16", 2, 3), ("float32", 2, 3)]
    assert [c["step"] for c in data["runs"][0]["checkpoints"]] == [2, 3] and data["runs"][0]["floor_steps"] == 2
    assert [(p["batch"], p["tokens_identical"], p["logits_identical"]) for p in data["repeats"]] == \
        [(1, True, True), (2, True, True)]
    md = (tmp_path / "tiny.md").read_text()
    assert "| bf16 | 2 | 3/3 |" in md and "| fp32 | 2 | 3/3 |" in md and "Drift by checkpoint" in md
    assert "Determinism" in md and md.count("| yes | yes |") == 2
    printed = capsys.readouterr().out
    assert "long check passed" in printed and "per step" in printed
    with pytest.raises(SystemExit, match="max_context"):
        script.main(["--model", "kimi_k3", "--variant", "tiny", "--device", "cpu", "--runs", "1:4090:0",
                     "--out", str(tmp_path / "x.json")])
