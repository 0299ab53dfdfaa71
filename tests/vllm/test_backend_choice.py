"""Which decode backend a deployment runs: precedence, validation, the auto no-op, and how the choice
is carried so that vLLM 0.33's in-tree reader of ``additional_config["decode_backend"]`` never sees
our value (no vLLM needed)."""

from __future__ import annotations

import pytest

from latency_specialized.errors import UserError
from latency_specialized.vllm import config as bc

NO_ENV: dict[str, str] = {}


def carried(source: str) -> dict:
    return {"decode_backend": "latency_specialized", "source": source}


def intree_reader_sees(additional_config) -> str:
    """What vLLM 0.33's in-tree specialized decode reads (the value that switches it on is
    'latency_specialized'; anything missing reads as 'auto')."""
    return additional_config.get("decode_backend", "auto") if isinstance(additional_config, dict) else "auto"


def test_default_is_auto_and_leaves_additional_config_untouched():
    original = {"kda_decode_backend": "triton"}
    choice, out = bc.apply(original, environ=NO_ENV)
    assert (choice.value, choice.source) == ("auto", "default")
    assert out is original  # not even copied: a deployment without the flag is one without the plugin
    choice, out = bc.apply(None, environ=NO_ENV)
    assert choice.value == "auto" and out is None


def test_additional_config_key_selects_the_backend():
    original = {"decode_backend": "latency_specialized", "x": 1}
    choice, out = bc.apply(original, environ=NO_ENV)
    assert choice.ours and choice.source == "additional_config"
    # Carried under our own entry, not under vLLM's key; other keys kept; the caller's dict untouched.
    assert out == {"x": 1, "latency_specialized": carried("additional_config")}
    assert original == {"decode_backend": "latency_specialized", "x": 1}
    assert bc.resolve(out, environ=NO_ENV).ours  # what the workers read


def test_flag_folds_into_the_key_and_is_labelled():
    merged = bc.merge_flag({"x": 1}, "latency-specialized")  # dashes are accepted like vLLM's own options
    assert merged == {"x": 1, "decode_backend": "latency_specialized"}
    choice, out = bc.apply(merged, flag_given=True, environ=NO_ENV)
    assert choice.ours and choice.source == "flag"
    assert "--decode-backend" in choice.describe()
    assert out == {"x": 1, "latency_specialized": carried("flag")}


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
    assert choice.ours and out == {"latency_specialized": carried("env")}
    # env=auto over a config already carried as ours: back to vLLM's key, our entry gone.
    choice, out = bc.apply({"latency_specialized": carried("flag")}, environ=env)
    assert choice.value == "auto" and out == {"decode_backend": "auto"}
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


@pytest.mark.parametrize("way", ["flag", "additional_config", "env"])
def test_our_value_never_reaches_the_intree_reader_and_reapplying_changes_nothing(way, monkeypatch):
    # vLLM 0.33's in-tree decode switches its own executor on for decode_backend == 'latency_specialized'
    # (in the model's __init__): whichever way ours was asked for, the config vLLM gets holds no such entry.
    monkeypatch.setattr(bc, "intree_specialized_decode_present", lambda: True)
    user = {"kda_decode_backend": "triton"}
    env = NO_ENV
    if way == "flag":
        user = bc.merge_flag(user, "latency_specialized")
    elif way == "additional_config":
        user = {**user, "decode_backend": "latency_specialized"}
    else:
        env = {bc.ENV: "latency_specialized"}
    choice, out = bc.apply(user, flag_given=way == "flag", environ=env)
    assert choice.ours and choice.source == way
    assert "decode_backend" not in out and intree_reader_sees(out) == "auto"
    assert out == {"kda_decode_backend": "triton", "latency_specialized": carried(way)}
    # A second create_engine_config (or a worker) resolves the same choice, same source, same config.
    again_choice, again = bc.apply(out, environ=env)
    assert (again_choice.value, again_choice.source) == ("latency_specialized", way)
    assert again == out


def test_auto_reaches_vllm_as_auto(monkeypatch):
    monkeypatch.setattr(bc, "intree_specialized_decode_present", lambda: True)
    for user, env in (({"decode_backend": "auto"}, NO_ENV), ({}, {bc.ENV: "auto"}),
                      (bc.merge_flag({}, "auto"), NO_ENV)):
        choice, out = bc.apply(user, environ=env)
        assert choice.value == "auto" and out == {"decode_backend": "auto"}
        assert intree_reader_sees(out) == "auto" and not bc.resolve(out, environ=NO_ENV).ours


def test_vllm_specialized_selects_vllms_intree_decode_and_keeps_ours_off(monkeypatch):
    monkeypatch.setattr(bc, "intree_specialized_decode_present", lambda: True)
    assert bc.choices() == ("auto", "latency_specialized", "vllm_specialized")
    for user, env, source in (({"decode_backend": "vllm-specialized"}, NO_ENV, "additional_config"),
                              ({}, {bc.ENV: "vllm_specialized"}, "env")):
        choice, out = bc.apply(user, environ=env)
        assert choice.intree and not choice.ours and choice.source == source
        # vLLM's key gets vLLM's spelling of "on"; our entry says it is vLLM's, so our workers stay off.
        assert intree_reader_sees(out) == "latency_specialized"
        assert out["latency_specialized"] == {"decode_backend": "vllm_specialized", "source": source}
        assert not bc.resolve(out, environ=NO_ENV).ours and bc.resolve(out, environ=NO_ENV).intree
        assert bc.apply(out, environ=env)[1] == out
    merged = bc.merge_flag({}, "vllm_specialized")
    assert bc.apply(merged, flag_given=True, environ=NO_ENV)[1] == {
        "decode_backend": "latency_specialized", "latency_specialized": {"decode_backend": "vllm_specialized",
                                                                         "source": "flag"}}
    # vLLM's own value written next to our flag for theirs would name two backends: refused.
    with pytest.raises(UserError, match="--decode-backend vllm_specialized contradicts additional_config "
                                        "decode_backend='latency_specialized'"):
        bc.merge_flag({"decode_backend": "latency_specialized"}, "vllm_specialized")


def test_vllm_specialized_is_refused_where_vllm_has_no_intree_decode(monkeypatch):
    monkeypatch.setattr(bc, "intree_specialized_decode_present", lambda: False)
    assert bc.choices() == ("auto", "latency_specialized")
    with pytest.raises(UserError, match="'vllm_specialized' selects vLLM's in-tree specialized decode, which the "
                                        "installed vLLM does not ship .*use one of auto, latency_specialized"):
        bc.apply({"decode_backend": "vllm_specialized"}, environ=NO_ENV)
    with pytest.raises(UserError, match="does not ship"):
        bc.merge_flag({}, "vllm_specialized")


def test_other_values_are_rejected_even_where_vllm_ships_its_intree_decode(monkeypatch):
    # vLLM 0.33's reader accepts auto and latency_specialized only: nothing else is passed through.
    monkeypatch.setattr(bc, "intree_specialized_decode_present", lambda: True)
    with pytest.raises(UserError, match="'specialized' is not a decode backend: use one of auto, "
                                        "latency_specialized, vllm_specialized"):
        bc.apply({"decode_backend": "specialized"}, environ=NO_ENV)


def test_our_entry_is_checked_against_vllms_key():
    with pytest.raises(UserError, match=r"additional_config decode_backend='auto' contradicts "
                                        r"additional_config\['latency_specialized'\]"):
        bc.apply({"decode_backend": "auto", "latency_specialized": carried("flag")}, environ=NO_ENV)
    with pytest.raises(UserError, match=r"additional_config\['latency_specialized'\] must be a dict"):
        bc.apply({"latency_specialized": "yes"}, environ=NO_ENV)
    with pytest.raises(UserError, match="is not a decode backend"):
        bc.apply({"latency_specialized": {"decode_backend": "fastest"}}, environ=NO_ENV)


def test_apply_in_place_rewrites_the_live_dict_and_leaves_auto_alone():
    live = {"decode_backend": "latency_specialized", "x": 1}
    assert bc.apply_in_place(live, environ=NO_ENV).ours
    assert live == {"x": 1, "latency_specialized": carried("additional_config")}
    assert bc.apply_in_place(live, environ=NO_ENV).ours and live == {"x": 1, "latency_specialized":
                                                                     carried("additional_config")}
    untouched = {"y": 2}
    assert bc.apply_in_place(untouched, environ=NO_ENV).value == "auto" and untouched == {"y": 2}
    assert bc.apply_in_place(None, environ={bc.ENV: "latency_specialized"}).ours


def test_installed_vllm_has_no_intree_specialized_decode():
    # The installed CPU build is vLLM 0.32, which predates the in-tree specialized decode.
    assert not bc.intree_specialized_decode_present()
