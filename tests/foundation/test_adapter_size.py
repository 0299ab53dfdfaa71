"""The adapters the issues cap stay within their line budgets (tests excluded): what a user adds for a model of this
kind is its own facts, everything generic lives in ``latency_specialized`` (issues 22 and 23: <= 800 lines)."""

from __future__ import annotations

from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parents[2] / "models"
CAPS = {"glm53": 800, "muse_spark": 800}


@pytest.mark.parametrize("model", sorted(CAPS))
def test_adapter_within_its_line_budget(model):
    files = sorted((MODELS / model).rglob("*.py"))
    lines = sum(len(p.read_text().splitlines()) for p in files)
    assert files and lines <= CAPS[model], f"models/{model}: {lines} lines > {CAPS[model]}: move generic code out"
