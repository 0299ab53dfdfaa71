"""Plugin mechanics without starting an engine: light import, idempotent register, lazy hooks, trace file."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import types

from latency_specialized.trace import Trace
from latency_specialized.vllm import import_hook
from latency_specialized.vllm.trace_file import TraceWriter, trace_path


def test_register_is_light_and_idempotent():
    # In a fresh interpreter: register twice, then check that neither vLLM nor torch was imported
    # (the API server front-end and --help pay nothing for the plugin) and that the two hooks wait
    # for vLLM's own imports.
    code = (
        "import sys\n"
        "from latency_specialized.vllm.plugin import register\n"
        "register(); register()\n"
        "from latency_specialized.vllm import import_hook\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))\n"
        "print(heavy)\n"
        "print(sorted(import_hook._pending), [len(v) for _, v in sorted(import_hook._pending.items())])\n"
        "print(sum(f is import_hook._FINDER for f in sys.meta_path))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    heavy, pending, finders = out.strip().splitlines()
    assert heavy == "[]"
    assert pending == "['vllm.engine.arg_utils', 'vllm.v1.worker.gpu_worker'] [1, 1]"
    assert finders == "1"


def test_when_imported_runs_now_for_loaded_modules_and_after_import_otherwise(tmp_path, monkeypatch):
    seen: list[str] = []
    import_hook.when_imported("json", lambda m: seen.append(m.__name__))  # already imported: runs now
    assert seen == ["json"]
    pkg = tmp_path / "ls_hook_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import_hook.when_imported("ls_hook_probe_pkg", lambda m: setattr(m, "VALUE", m.VALUE + 1))
    assert "ls_hook_probe_pkg" not in sys.modules
    import ls_hook_probe_pkg  # noqa: E402 - the import is the test

    assert ls_hook_probe_pkg.VALUE == 42  # the callback ran after the module body, before use
    assert "ls_hook_probe_pkg" not in import_hook._pending


def test_trace_path_per_rank():
    assert str(trace_path("/t/trace.json", 0)) == "/t/trace.json"
    assert str(trace_path("/t/trace.json", 3)) == "/t/trace.json.rank3"
    assert str(trace_path("/t/trace-{rank}.json", 1)) == "/t/trace-1.json"


def test_trace_writer_flushes_the_last_step_without_another_step(tmp_path):
    trace = Trace()
    path = tmp_path / "sub" / "trace.json"
    writer = TraceWriter(trace, path, extra={"rank": 0, "model": "m"}, interval_s=0.1)
    try:
        assert json.loads(path.read_text())["summary"]["fast_steps"] == 0  # written at start
        for _ in range(3):
            with writer.lock:
                trace.fast(2, 2)
                writer.touched()
        with writer.lock:
            trace.stock("prefill or mixed step")
            writer.touched()
        deadline = time.monotonic() + 5
        data = {}
        while time.monotonic() < deadline:
            data = json.loads(path.read_text())
            if data["summary"]["stock_steps"] == 1:
                break
            time.sleep(0.05)
        assert data["summary"]["fast_steps"] == 3 and data["summary"]["stock_steps"] == 1
        assert data["rank"] == 0 and data["model"] == "m"
        assert [e["kind"] for e in data["events"]] == ["fast", "fast", "fast", "stock"]
        assert not list(path.parent.glob(".*.tmp")), "temp files must be renamed, not left behind"
    finally:
        writer.close()


def test_trace_writer_without_path_is_inert():
    writer = TraceWriter(Trace(), None)
    with writer.lock:
        writer.touched()
    writer.flush()
    writer.close()
    assert writer.path is None


def test_gpu_worker_patch_passes_through_unless_latency_specialized(monkeypatch):
    from latency_specialized.vllm import config, worker

    monkeypatch.delenv(config.ENV, raising=False)

    calls: list[str] = []

    class Worker:
        def __init__(self, cfg):
            self.vllm_config = cfg

        def load_model(self):
            calls.append("stock")
            return "loaded"

    module = types.SimpleNamespace(Worker=Worker)
    worker.patch(module)
    first = Worker.load_model
    worker.patch(module)  # idempotent
    assert Worker.load_model is first
    for cfg in (types.SimpleNamespace(additional_config={}), types.SimpleNamespace(additional_config=None),
                types.SimpleNamespace(additional_config={"decode_backend": "auto"})):
        assert Worker(cfg).load_model() == "loaded"
    assert calls == ["stock"] * 3
    assert worker.wants_override(types.SimpleNamespace(additional_config={"decode_backend": "latency_specialized"}))
