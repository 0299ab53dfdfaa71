"""The API server's command line with the plugin: --help lists the option, bad values are refused
with a message naming the fix, and an out-of-scope deployment fails at start listing every
missing requirement. All processes of the module start at once (bounded waits, loopback only).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from vllm_harness import SERVER_MODULE, Server, base_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CLI_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def launched(tiny_checkpoint, tmp_path_factory):
    """Every process of this module, started concurrently (each test waits for its own)."""
    logs = tmp_path_factory.mktemp("server-start")
    model = str(tiny_checkpoint)

    def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", SERVER_MODULE, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env or base_env(), stdin=subprocess.DEVNULL,
                                start_new_session=True)

    # float16 and 2 speculative tokens: both outside vllm_moe's scope (bfloat16/float32, 0 tokens).
    # TP=2 (two CPU workers, one core each) so that both ranks must fail, together, with one message.
    cpus = sorted(os.sched_getaffinity(0))
    bind = f"{cpus[0]}|{cpus[1 % len(cpus)]}"
    out_of_scope = Server("out-of-scope", tiny_checkpoint, logs / "out_of_scope.log",
                          ("--decode-backend", "latency_specialized", "--dtype", "float16", "--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}',
                           "--tensor-parallel-size", "2"),
                          env=base_env(VLLM_CPU_OMP_THREADS_BIND=bind, VLLM_CPU_NUM_OF_RESERVED_CPU="0"))
    procs = {
        "help": cli("--help"),
        "bad_flag": cli("--model", model, "--decode-backend", "fastest"),
        "bad_config": cli("--model", model, "--additional-config", '{"decode_backend": "fastest"}'),
        "conflict": cli("--model", model, "--decode-backend", "latency_specialized",
                        "--additional-config", '{"decode_backend": "auto"}'),
    }
    procs["inspect"] = subprocess.Popen([sys.executable, "-m", "latency_specialized.vllm.inspect_tree", model, "--dtype",
                                         "float32"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                        env=base_env(), stdin=subprocess.DEVNULL, start_new_session=True)
    out_of_scope.start()
    try:
        yield procs, out_of_scope
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)
        out_of_scope.stop()


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=CLI_TIMEOUT_S)
    return proc.returncode, out


def test_help_lists_decode_backend(launched):
    rc, out = _finish(launched[0]["help"])
    assert rc == 0, out[-2000:]
    # vLLM's --help lists config groups; ours names the option and its values.
    assert "DecodeBackend" in out and "--decode-backend {auto,latency_specialized}" in out


def test_bad_flag_value_is_refused_by_the_parser(launched):
    rc, out = _finish(launched[0]["bad_flag"])
    assert rc == 2
    # Newer argparse versions quote the choices; accept both spellings.
    pattern = r"argument --decode-backend: invalid choice: 'fastest' \(choose from '?auto'?, '?latency_specialized'?\)"
    assert re.search(pattern, out), out[-2000:]


def test_bad_additional_config_value_is_refused_before_the_engine_starts(launched):
    rc, out = _finish(launched[0]["bad_config"])
    assert rc != 0
    assert ("additional_config['decode_backend']='fastest' is not a decode backend: "
            "use one of auto, latency_specialized") in out
    assert "EngineCore" not in out  # refused while building the config, no engine was started


def test_flag_contradicting_additional_config_is_refused(launched):
    rc, out = _finish(launched[0]["conflict"])
    assert rc != 0
    assert "--decode-backend latency_specialized contradicts additional_config decode_backend='auto'" in out


def test_out_of_scope_deployment_fails_at_start_listing_every_missing_requirement(launched):
    server = launched[1]
    rc = server.wait_exit()
    log = server.log()
    assert rc != 0, log[-3000:]
    expected = ("vllm_moe: outside the latency_specialized scope: dtype float16 not supported (use bfloat16, float32); "
                "2 speculative tokens not supported (use one of [0]) (or run stock vLLM with --decode-backend auto)")
    assert expected in log, log[-3000:]
    for rank in (0, 1):  # every rank raised the same collective verdict
        assert any(f"Worker_TP{rank}" in line and expected in line for line in log.splitlines()), rank
    assert "Application startup complete" not in log


def test_inspect_tree_prints_the_in_tree_module_tree(launched):
    rc, out = _finish(launched[0]["inspect"])
    assert rc == 0, out[-2000:]
    report = json.loads(out[out.index("{\n \"model\""):])
    assert report["stages"]["class"] == "Qwen3MoeForCausalLM -> vllm.model_executor.models.qwen3_moe.Qwen3MoeForCausalLM"
    tree = report["tree"]
    for line in ("model.layers.1.mlp: Qwen3MoeSparseMoeBlock", "model.layers.1.mlp.experts: MoERunner",
                 "model.layers.0.self_attn.qkv_proj: QKVParallelLinear", "model.norm: RMSNorm"):
        assert line in tree, tree
