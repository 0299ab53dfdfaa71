"""Plugin discovery through the entry-point group: built-ins, an installed third-party adapter,
broken plugins reported by name without taking the others down, blocking by env var."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from latency_specialized.errors import PluginError
from latency_specialized.plugins import get_registry, hookimpl
from latency_specialized.plugins.manager import build_registry

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
BUILTIN_ADAPTERS = {"kimi_k3", "deepseek_v41_flash", "muse_spark", "glm53"}


def test_builtin_adapters_and_ops_load_through_entry_points():
    reg = get_registry()
    assert BUILTIN_ADAPTERS <= set(reg.adapters), reg.failures
    assert {"builtin_ops", "kimi_k3"} <= set(reg.loaded)
    assert reg.providers["kimi_k3"] == "kimi_k3"  # registered by its own entry point, like a third party
    assert reg.implementations.get("gemm.reference").provider == "builtin_ops"
    assert not reg.failures, reg.failures


def test_adapter_lookup_by_name_or_architecture():
    reg = get_registry()
    assert reg.adapter("kimi-k3").name == "kimi_k3"
    assert reg.adapter("KimiK3ForConditionalGeneration").name == "kimi_k3"
    assert reg.adapter_for_architecture(["Unknown", "KimiK3ForConditionalGeneration"]).name == "kimi_k3"
    assert reg.adapter_for_architecture(["Unknown"]) is None


def test_block_env_skips_a_plugin(monkeypatch):
    monkeypatch.setenv("LATENCY_SPECIALIZED_BLOCK_PLUGINS", "glm53, muse_spark")
    reg = build_registry()
    assert "glm53" not in reg.adapters and "muse_spark" not in reg.adapters
    assert sorted(reg.blocked) == ["glm53", "muse_spark"]
    assert "kimi_k3" in reg.adapters


class _BadAdapterPlugin:
    @hookimpl
    def register_adapters(self, register):
        register("not an adapter")


class _MisnamedHook:
    @hookimpl
    def register_adapter(self, register):  # typo: check_pending() must catch it
        pass


def test_invalid_registrations_are_reported_per_plugin():
    reg = build_registry(extra_plugins=[("bad_adapter", _BadAdapterPlugin()), ("typo", _MisnamedHook())])
    errors = {f.name: f.error for f in reg.failures}
    assert "not a named ModelAdapter" in errors["bad_adapter"]
    assert "register_adapter" in errors["typo"]
    assert "kimi_k3" in reg.adapters  # the others still loaded


def _install(dist: Path, target: Path) -> None:
    """Build a wheel of a test distribution and install it into ``target`` (not into the venv)."""
    wheels = target.parent / f"wheels-{dist.name}"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(dist)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
                    *map(str, wheels.glob("*.whl"))], check=True)


@pytest.fixture(scope="module")
def third_party_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site") / "site"
    _install(PLUGINS / "example_adapter", site)
    _install(PLUGINS / "broken_plugin", site)
    return site


def _cli(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-m", "latency_specialized.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_installed_third_party_adapter_is_discovered_listed_and_planned(third_party_site):
    out = _cli(third_party_site, "models", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    names = {a["name"] for a in data["adapters"]}
    assert "toy_gqa_moe" in names and BUILTIN_ADAPTERS <= names
    toy = next(a for a in data["adapters"] if a["name"] == "toy_gqa_moe")
    assert toy["provider"] == "toy_gqa_moe" and toy["scope"]["tp"] == [1, 2, 4]

    plan = _cli(third_party_site, "explain", "--model", "toy_gqa_moe", "--tp", "2", "--batch", "3", "--arch", "sm_90")
    assert plan.returncode == 0, plan.stderr
    assert "gqa+moe/attn.gqa" in plan.stdout and "bucket 4" in plan.stdout


def test_broken_plugins_are_named_and_do_not_take_others_down(third_party_site):
    out = _cli(third_party_site, "models")
    assert out.returncode == 0, out.stderr
    assert "FAILED plugin broken_adapter: ModuleNotFoundError: No module named 'this_dependency_is_not_installed'" in out.stdout
    assert "FAILED plugin misnamed_hook:" in out.stdout and "register_adapter" in out.stdout
    assert "toy_gqa_moe" in out.stdout and "kimi_k3" in out.stdout


def test_plugin_error_is_a_user_error():
    from latency_specialized.errors import UserError

    # The CLI prints UserErrors as one line without a traceback; a plugin error must be one.
    assert issubclass(PluginError, UserError)
