"""On the real engine (vLLM 0.32 CPU build): whichever way ``latency_specialized`` is switched on -
``--decode-backend``, ``--additional-config``, ``$LATENCY_SPECIALIZED_DECODE_BACKEND``, or
``vllm.LLM(additional_config=...)`` - the config the model class receives in ``__init__`` holds no
``decode_backend`` entry with our value (vLLM 0.33's in-tree specialized decode reads exactly that
entry there and would switch its own executor on), and our override still installs and serves
decode steps (the workers read the choice from our own entry).

A test plugin (:mod:`model_config_probe`) records ``additional_config`` at ``Qwen3MoeForCausalLM.__init__``;
a control run with our plugin left out (``VLLM_PLUGINS``) shows the probe does see vLLM's key when
nobody moves it. All engines of the module start at once (~3 min on 2 cores) and stop at teardown.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from model_config_probe import ENTRY_POINT
from model_config_probe import ENV as PROBE_ENV
from model_config_probe import install_probe, read_records
from vllm_harness import START_TIMEOUT_S, Server, base_env, read_trace

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MARKER = {"probe_marker": 7}  # a key of the user's own: must reach the model unchanged
WAYS = {
    "flag": (("--decode-backend", "latency_specialized"), {}),
    "additional_config": (("--additional-config", json.dumps({"decode_backend": "latency_specialized", **MARKER})), {}),
    "env": ((), {"LATENCY_SPECIALIZED_DECODE_BACKEND": "latency_specialized"}),
}


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("intree-key")
    pythonpath = install_probe(root / "probe")
    files = {way: {"probe": root / f"{way}.probe.jsonl", "trace": root / f"{way}.trace.json"}
             for way in (*WAYS, "llm", "no_plugin")}

    def env_of(way: str, **extra: str) -> dict[str, str]:
        return base_env(PYTHONPATH=pythonpath, **{PROBE_ENV: str(files[way]["probe"])},
                        LATENCY_SPECIALIZED_TRACE_FILE=str(files[way]["trace"]), **extra)

    servers = {way: Server(way, tiny_checkpoint, root / f"{way}.log", args, env=env_of(way, **extra))
               for way, (args, extra) in WAYS.items()}
    logs = {name: open(root / f"{name}.log", "w") for name in ("llm", "no_plugin")}

    def llm_run(name: str, env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(Path(__file__).with_name("llm_script.py")), str(tiny_checkpoint),
                                 json.dumps({"decode_backend": "latency_specialized", **MARKER}),
                                 str(root / f"{name}.json")],
                                stdout=logs[name], stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)

    runs = {"llm": llm_run("llm", env_of("llm")),
            # vLLM loads only the plugins VLLM_PLUGINS names: the probe, not ours.
            "no_plugin": llm_run("no_plugin", env_of("no_plugin", VLLM_PLUGINS=ENTRY_POINT))}
    try:
        for s in servers.values():
            s.start()
        yield {"servers": servers, "files": files, "runs": runs, "root": root}
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
        for f in logs.values():
            f.close()
        for s in servers.values():
            s.stop()


def _finish_run(engines, name: str) -> str:
    """Wait for an LLM script run; returns its log (fails the test if it did not succeed)."""
    proc, log_path = engines["runs"][name], engines["root"] / f"{name}.log"
    try:
        rc = proc.wait(timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"vllm.LLM script {name} still running:\n" + log_path.read_text()[-3000:])
    log = log_path.read_text()
    assert rc == 0, log[-3000:]
    assert len(json.loads((engines["root"] / f"{name}.json").read_text())["token_ids"]) == 8
    return log


def _check_model_saw_no_decode_backend(records: list[dict], source: str, marker: bool) -> None:
    assert records, "the probe recorded no model construction"
    for r in records:
        extra = r["additional_config"]
        assert isinstance(extra, dict), r
        assert extra.get("decode_backend") != "latency_specialized", r  # what vLLM 0.33's reader switches on
        assert "decode_backend" not in extra, r
        # ...and the choice is carried under our own entry instead, labelled with where it came from.
        assert extra["latency_specialized"] == {"decode_backend": "latency_specialized", "source": source}, r
        if marker:
            assert extra["probe_marker"] == 7, r


@pytest.mark.parametrize("way", list(WAYS))
def test_model_init_never_sees_our_value_under_decode_backend_on_the_server(engines, way):
    server = engines["servers"][way]
    server.wait_ready()
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    assert len(server.post("/v1/completions", body)["choices"][0]["text"]) > 0
    files = engines["files"][way]
    _check_model_saw_no_decode_backend(read_records(files["probe"]), way, marker=way == "additional_config")
    # The override was installed from our entry and served decode steps.
    trace = read_trace(files["trace"], min_fast=1)
    assert trace.get("summary", {}).get("fast_steps", 0) >= 1, trace.get("summary")
    assert trace["backend"] == "latency_specialized" and trace["model"] == "vllm_moe"
    assert "decode override installed for vllm_moe" in server.log()


def test_model_init_never_sees_our_value_under_decode_backend_with_vllm_llm(engines):
    _finish_run(engines, "llm")
    files = engines["files"]["llm"]
    _check_model_saw_no_decode_backend(read_records(files["probe"]), "additional_config", marker=True)
    trace = json.loads(files["trace"].read_text())  # written at exit
    assert trace["summary"]["fast_steps"] >= 1, trace["summary"]


def test_control_without_our_plugin_the_model_does_see_decode_backend(engines):
    # The probe is not blind: with our plugin kept from loading (VLLM_PLUGINS), the user's key reaches
    # the model as written - which is what vLLM 0.33's in-tree reader would act on.
    log = _finish_run(engines, "no_plugin")
    records = read_records(engines["files"]["no_plugin"]["probe"])
    assert records, "the probe recorded no model construction"
    for r in records:
        assert r["additional_config"] == {"decode_backend": "latency_specialized", **MARKER}, r
    assert "latency_specialized:" not in log  # our plugin did not run
    assert not engines["files"]["no_plugin"]["trace"].exists()
