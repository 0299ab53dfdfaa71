"""CLI: models, explain, and one-line errors naming the fix (exit 2, no traceback) for user mistakes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from latency_specialized.cli import main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "latency_specialized.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_models_lists_the_four_builtin_adapters(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("kimi_k3", "deepseek_v41_flash", "muse_spark", "glm53"):
        assert name in out
    assert "FAILED" not in out


def test_explain_kimi_tp8_prints_every_site_with_reasons(capsys):
    assert main(["explain", "--model", "kimi_k3", "--tp", "8", "--batch", "4", "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: kimi_k3 (full) on sm_90")
    for site in ("kda+moe/attn.kda", "mla+moe/attn.mla", "kda+moe/moe.experts", "kda+dense/mlp", "lm_head"):
        assert site in out
    assert "unserved: 0" in out


def test_explain_json(capsys):
    import json

    assert main(["explain", "--model", "kimi_k3", "--tp", "16", "--batch", "64", "--arch", "sm_100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tp"] == 16 and data["bucket"] == 64 and data["in_scope"]


@pytest.mark.parametrize("args,message", [
    (["explain", "--model", "llama9"], "error: unknown model 'llama9': installed adapters are"),
    (["explain", "--model", "kimi_k3", "--tp", "5", "--arch", "sm_90"],
     "error: TP=5 not supported: kimi_k3 needs 96 KDA heads divisible by TP"),
    (["explain", "--model", "kimi_k3", "--batch", "65", "--arch", "sm_90"],
     "error: batch 65 beyond the scope: use 1..64 (larger batches run stock)"),
    (["explain", "--model", "kimi_k3", "--arch", "sm_42"], "error: unknown arch 'sm_42': use one of cpu, sm_80"),
])
def test_user_errors_are_one_line_and_name_the_fix(args, message):
    out = _run(*args)
    assert out.returncode == 2
    assert out.stderr.startswith(message), out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_argparse_errors_exit_nonzero():
    out = _run("explain")
    assert out.returncode == 2 and "--model" in out.stderr
