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


def _fake_worker_module(seen: list):
    """A stand-in of vllm.v1.worker.gpu_worker whose load_model records the additional_config the
    model would be built with (vLLM builds the model inside load_model)."""

    class Worker:
        def __init__(self, extra):
            self.vllm_config = types.SimpleNamespace(additional_config=extra)
            self.model_runner = types.SimpleNamespace(get_model=lambda: "model")

        def load_model(self):
            extra = self.vllm_config.additional_config
            seen.append(dict(extra) if isinstance(extra, dict) else extra)
            return "loaded"

    return types.SimpleNamespace(Worker=Worker)


def test_worker_takes_our_value_out_before_the_model_is_built_and_installs_from_our_entry(monkeypatch):
    # A VllmConfig that never went through EngineArgs.create_engine_config still reaches the model
    # without decode_backend=latency_specialized (vLLM 0.33's in-tree reader runs in the model's __init__).
    from latency_specialized.vllm import config, install, worker

    monkeypatch.delenv(config.ENV, raising=False)
    monkeypatch.setitem(sys.modules, "vllm.platforms",
                        types.SimpleNamespace(current_platform=types.SimpleNamespace(is_cpu=lambda: False)))
    installed: list = []
    monkeypatch.setattr(install, "install", lambda model, cfg: installed.append((model, dict(cfg.additional_config))))
    seen: list = []
    module = _fake_worker_module(seen)
    worker.patch(module)

    live = {"decode_backend": "latency_specialized", "x": 1}
    w = module.Worker(live)
    assert w.load_model() == "loaded"
    carried = {"x": 1, "latency_specialized": {"decode_backend": "latency_specialized", "source": "additional_config"}}
    assert seen == [carried]  # what the model's __init__ got
    assert w.vllm_config.additional_config is live and live == carried  # rewritten in place
    assert installed == [("model", carried)]

    # The front process' form (our entry only) is what workers normally get: it switches ours on.
    seen.clear(), installed.clear()
    front = {"latency_specialized": {"decode_backend": "latency_specialized", "source": "flag"}}
    module.Worker(dict(front)).load_model()
    assert seen == [front] and installed == [("model", front)]

    # vLLM's in-tree decode chosen (vllm_specialized): vLLM's key says "on", our entry keeps ours off.
    monkeypatch.setattr(config, "intree_specialized_decode_present", lambda: True)
    seen.clear(), installed.clear()
    theirs = {"decode_backend": "latency_specialized",
              "latency_specialized": {"decode_backend": "vllm_specialized", "source": "flag"}}
    module.Worker(dict(theirs)).load_model()
    assert seen == [theirs] and installed == []


class _FakeEngineArgs:
    """The three EngineArgs methods the plugin wraps; create_engine_config returns what vLLM would
    build the VllmConfig (and so the model) from."""

    def __init__(self, additional_config=None):
        self.additional_config = additional_config if additional_config is not None else {}

    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--additional-config", type=json.loads, default=None)
        return parser

    @classmethod
    def from_cli_args(cls, args):
        return cls(args.additional_config)

    def create_engine_config(self, usage_context=None):
        return self.additional_config


def test_engine_args_flag_and_key_reach_vllm_carried_under_our_entry(monkeypatch):
    import argparse

    from latency_specialized.vllm import config, engine_args

    monkeypatch.delenv(config.ENV, raising=False)
    cls = type("EngineArgs", (_FakeEngineArgs,), {})
    engine_args.patch(types.SimpleNamespace(EngineArgs=cls))

    def built(argv):
        parser = cls.add_cli_args(argparse.ArgumentParser())
        return cls.from_cli_args(parser.parse_args(argv))

    ea = built(["--decode-backend", "latency_specialized", "--additional-config", '{"x": 1}'])
    first = ea.create_engine_config()
    assert first == {"x": 1, "latency_specialized": {"decode_backend": "latency_specialized", "source": "flag"}}
    assert ea.create_engine_config() == first  # a second call changes nothing, keeps the source

    ea = built(["--additional-config", '{"decode_backend": "latency_specialized"}'])
    assert ea.create_engine_config() == {"latency_specialized": {"decode_backend": "latency_specialized",
                                                                 "source": "additional_config"}}
    # vllm.LLM(additional_config=...) builds EngineArgs directly.
    assert cls(additional_config={"decode_backend": "latency_specialized"}).create_engine_config() == {
        "latency_specialized": {"decode_backend": "latency_specialized", "source": "additional_config"}}

    monkeypatch.setenv(config.ENV, "latency_specialized")
    assert built([]).create_engine_config() == {"latency_specialized": {"decode_backend": "latency_specialized",
                                                                        "source": "env"}}
    monkeypatch.delenv(config.ENV)

    # auto and unset: as before (unset: the very same object).
    assert built(["--decode-backend", "auto"]).create_engine_config() == {"decode_backend": "auto"}
    ea = built(["--additional-config", '{"y": 2}'])
    original = ea.additional_config
    assert ea.create_engine_config() is original and original == {"y": 2}


def test_models_without_a_binding_name_vllms_intree_decode_where_vllm_ships_it(monkeypatch):
    from latency_specialized.vllm import config, install

    monkeypatch.setattr(config, "intree_specialized_decode_present", lambda: True)
    for arch in ("KimiK3ForConditionalGeneration", "KimiLinearForCausalLM", "DeepseekV41ForCausalLM"):
        assert install._intree_hint([arch]) == ("; vLLM's own in-tree specialized decode serves this model on "
                                                "Blackwell: --decode-backend vllm_specialized")
    assert install._intree_hint(["GlmMoeDsaForCausalLM"]) == ""
    monkeypatch.setattr(config, "intree_specialized_decode_present", lambda: False)  # vLLM 0.32
    assert install._intree_hint(["KimiK3ForConditionalGeneration"]) == ""
