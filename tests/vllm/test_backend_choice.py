"""Which decode backend a deployment runs: precedence, validation, and the auto no-op (no vLLM needed)."""

from __future__ import annotations

import pytest

from latency_specialized.errors import UserError
from latency_specialized.vllm import config as bc

NO_ENV: dict[str, str] = {}


def test_default_is_auto_and_leaves_additional_config_untouched():
    original = {"kda_decode_backend": "triton"}
    choice, out = bc.apply(original, environ=NO_ENV)
    assert (choice.value, choice.source) == ("auto", "default")
    assert out is original  # not even copied: a deployment without the flag is one without the plugin
    choice, out = bc.apply(None, environ=NO_ENV)
    assert choice.value == "auto" and out is None


def test_additional_config_key_selects_the_backend():
    choice, out = bc.apply({"decode_backend": "latency_specialized", "x": 1}, environ=NO_ENV)
    assert choice.ours and choice.source == "additional_config"
    assert out == {"decode_backend": "latency_specialized", "x": 1}


def test_flag_folds_into_the_key_and_is_labelled():
    merged = bc.merge_flag({"x": 1}, "latency-specialized")  # dashes are accepted like vLLM's own options
    assert merged == {"x": 1, "decode_backend": "latency_specialized"}
    choice, _ = bc.apply(merged, flag_given=True, environ=NO_ENV)
    assert choice.ours and choice.source == "flag"
    assert "--decode-backend" in choice.describe()


def test_flag_agreeing_with_additional_config_is_fine_contradicting_is_an_error():
    assert bc.merge_flag({"decode_backend": "auto"}, "auto") == {"decode_backend": "auto"}
    with pytest.raises(UserError, match="contradicts additional_config decode_backend='auto': set the backend in one place"):
        bc.merge_flag({"decode_backend": "auto"}, "latency_specialized")


def test_env_overrides_flag_and_additional_config():
    env = {bc.ENV: "auto"}
    choice, out = bc.apply({"decode_backend": "latency_specialized"}, flag_given=True, environ=env)
    assert (choice.value, choice.source) == ("auto", "env")
    assert out == {"decode_backend": "auto"}
    choice, out = bc.apply({}, environ={bc.ENV: "latency_specialized"})
    assert choice.ours and out == {"decode_backend": "latency_specialized"}
    # An empty variable is "unset", not a value.
    assert bc.apply({"decode_backend": "latency_specialized"}, environ={bc.ENV: " "})[0].source == "additional_config"


@pytest.mark.parametrize("where", ["additional_config", "env", "flag"])
def test_unknown_values_are_rejected_naming_the_valid_ones(where, monkeypatch):
    monkeypatch.setattr(bc, "intree_specialized_decode_present", lambda: False)  # vLLM 0.32: no in-tree reader
    with pytest.raises(UserError) as err:
        if where == "additional_config":
            bc.apply({"decode_backend": "fastest"}, environ=NO_ENV)
        elif where == "env":
            bc.apply({}, environ={bc.ENV: "fastest"})
        else:
            bc.merge_flag({}, "fastest")
    assert "'fastest' is not a decode backend: use one of auto, latency_specialized" in str(err.value)


def test_non_string_and_non_dict_values_are_rejected():
    with pytest.raises(UserError, match="must be a non-empty string"):
        bc.apply({"decode_backend": 3}, environ=NO_ENV)
    with pytest.raises(UserError, match="pass --additional-config as a JSON object"):
        bc.apply(["decode_backend"], environ=NO_ENV)


def test_intree_values_pass_through_when_vllm_ships_its_specialized_decode(monkeypatch):
    # vLLM >= 0.33 reads the same key for its own specialized decode: its values are vLLM's to judge,
    # and they are not ours, so our override stays off.
    monkeypatch.setattr(bc, "intree_specialized_decode_present", lambda: True)
    choice, out = bc.apply({"decode_backend": "specialized"}, environ=NO_ENV)
    assert choice.value == "specialized" and not choice.ours
    assert out == {"decode_backend": "specialized"}


def test_installed_vllm_has_no_intree_specialized_decode():
    # The installed CPU build is vLLM 0.32, which predates the in-tree specialized decode.
    assert not bc.intree_specialized_decode_present()
