"""latency_specialized.config_keys: unknown keys -> one sorted warning; missing / contradictory keys -> named errors."""

from __future__ import annotations

import ast
import sys
import warnings
from pathlib import Path

import pytest

import latency_specialized.config_keys as config_keys_module
from latency_specialized.config_keys import ConfigKeys, UnknownConfigKeysWarning
from latency_specialized.errors import CheckpointError, UserError


def _unknown_warnings(fn):
    """Run fn with every warning recorded; the UnknownConfigKeysWarnings it issued and fn's result."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = fn()
    return [w for w in rec if issubclass(w.category, UnknownConfigKeysWarning)], out


def test_unknown_keys_of_every_section_in_one_sorted_warning():
    cfg = {"hidden_size": 8, "zeta": 1, "alpha": 2, "text_config": {"vocab_size": 3, "mystery": 4, "beta": 5}}
    keys = ConfigKeys("ck/config.json", "Model X")
    assert keys.section(cfg, {"hidden_size", "text_config"}) is cfg
    keys.section(cfg["text_config"], {"vocab_size"}, prefix="text_config.")
    assert keys.unknown == ("alpha", "text_config.beta", "text_config.mystery", "zeta")
    got, names = _unknown_warnings(keys.warn)
    assert names == ("alpha", "text_config.beta", "text_config.mystery", "zeta")
    assert len(got) == 1
    msg = str(got[0].message)
    assert msg == ("ck/config.json: Model X ignores 4 unknown config keys: "
                   "alpha, text_config.beta, text_config.mystery, zeta")
    assert issubclass(UnknownConfigKeysWarning, UserWarning)


def test_warns_once_and_not_at_all_without_unknown_keys():
    keys = ConfigKeys("c.json", "M")
    keys.section({"a": 1}, {"a"})
    got, names = _unknown_warnings(keys.warn)
    assert got == [] and names == ()
    keys.section({"a": 1, "b": 2}, {"a"})
    got, _ = _unknown_warnings(keys.warn)
    assert len(got) == 1 and str(got[0].message).endswith("ignores 1 unknown config key: b")
    got, names = _unknown_warnings(keys.warn)  # a second call repeats nothing
    assert got == [] and names == ("b",)


def test_warning_points_at_the_loaders_caller():
    def loader():
        keys = ConfigKeys("c.json", "M")
        keys.section({"odd": 1}, set())
        keys.warn()  # stacklevel 2: the line that called loader()

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        loader()
    assert len(rec) == 1 and rec[0].filename == __file__ and rec[0].lineno == line


def test_a_section_that_is_not_an_object_is_named():
    keys = ConfigKeys("c.json", "M")
    with pytest.raises(CheckpointError, match=r"c\.json: config key text_config is list, not an object"):
        keys.section([1, 2], {"a"}, prefix="text_config.")


def test_missing_required_keys_are_named():
    keys = ConfigKeys("c.json", "Model X")
    keys.require({"a": 1, "b": 0, "c": False}, ("a", "b", "c"))  # falsy values are present
    with pytest.raises(CheckpointError, match=r"^c\.json: config key text_config\.b is missing: Model X needs it$"):
        keys.require({"a": 1}, ("a", "b"), prefix="text_config.")
    with pytest.raises(CheckpointError, match=r"config key b is missing"):
        keys.require({"a": 1, "b": None}, ("a", "b"))  # null counts as missing
    with pytest.raises(CheckpointError, match=r"config keys b, c are missing: Model X needs them"):
        keys.require({"a": 1}, ("a", "b", "c"))
    with pytest.raises(CheckpointError, match=r"config key b is missing: set b to the width"):
        keys.require({}, ("b",), why="set b to the width")
    assert issubclass(CheckpointError, UserError)


def test_pick_reads_one_setting_spelled_two_ways():
    keys = ConfigKeys("c.json", "Model X")
    assert keys.pick({"max_position_embeddings": 10}, "max_position_embeddings", "model_max_length") == 10
    assert keys.pick({"model_max_length": 20}, "max_position_embeddings", "model_max_length") == 20
    assert keys.pick({"max_position_embeddings": 30, "model_max_length": 30},
                     "max_position_embeddings", "model_max_length") == 30
    assert keys.pick({"max_position_embeddings": None, "model_max_length": 40},
                     "max_position_embeddings", "model_max_length") == 40  # null is absent
    assert keys.pick({}, "max_position_embeddings", "model_max_length", default=4096) == 4096
    assert keys.pick({"x": None}, "x", default=None) is None


def test_pick_contradiction_names_both_keys_and_values():
    keys = ConfigKeys("c.json", "Model X")
    with pytest.raises(CheckpointError, match=r"^c\.json: config keys text_config\.max_position_embeddings = 4096 and "
                                              r"text_config\.model_max_length = 1048576 contradict each other"):
        keys.pick({"max_position_embeddings": 4096, "model_max_length": 1048576},
                  "max_position_embeddings", "model_max_length", prefix="text_config.", default=1)


def test_pick_without_default_names_the_missing_key():
    keys = ConfigKeys("c.json", "Model X")
    with pytest.raises(CheckpointError, match=r"config key p\.max_position_embeddings \(or p\.model_max_length\) "
                                              r"is missing: Model X needs it"):
        keys.pick({}, "max_position_embeddings", "model_max_length", prefix="p.")
    with pytest.raises(CheckpointError, match=r"config key hidden_size is missing"):
        keys.pick({"hidden_size": None}, "hidden_size")


def test_foundation_module_imports_only_errors_spec_and_the_standard_library():
    tree = ast.parse(Path(config_keys_module.__file__).read_text())
    allowed = {"latency_specialized.errors", "latency_specialized.spec"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "config_keys.py: use absolute imports"
            mods = [node.module or ""]
        else:
            continue
        for m in mods:
            ok = m in allowed or m.split(".")[0] in sys.stdlib_module_names
            assert ok, f"config_keys.py imports {m}: a foundation module may import only errors, spec and stdlib"
