"""Test-only vLLM general plugin: records the ``additional_config`` a model class receives in ``__init__``.

vLLM 0.33's in-tree specialized decode reads ``vllm_config.additional_config["decode_backend"]`` in
the model's ``__init__``; this probe observes the same thing at the same moment, in whichever
process builds the model (a worker), on the vLLM 0.32 CPU build. Tests put it on ``PYTHONPATH``
with a ``*.dist-info`` declaring the entry point (:func:`install_probe`), so vLLM loads it in
every process like our own plugin. It wraps ``Qwen3MoeForCausalLM.__init__`` (the class of the
tiny test checkpoint) when vLLM imports that module; one JSON line per model built goes to
``$LS_PROBE_MODEL_CONFIG_FILE``.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

ENV = "LS_PROBE_MODEL_CONFIG_FILE"
MODULE = "vllm.model_executor.models.qwen3_moe"
CLASS = "Qwen3MoeForCausalLM"
ENTRY_POINT = "ls_model_config_probe"


def _record(path: str, cls_name: str, vllm_config) -> None:
    extra = getattr(vllm_config, "additional_config", None)
    line = json.dumps({"pid": os.getpid(), "class": cls_name,
                       "additional_config": extra if isinstance(extra, dict) else repr(extra)}, default=repr)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _wrap(module) -> None:
    cls = getattr(module, CLASS)
    if getattr(cls.__init__, "_ls_probe", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        _record(os.environ[ENV], type(self).__name__, kwargs.get("vllm_config"))
        original(self, *args, **kwargs)

    __init__._ls_probe = True
    cls.__init__ = __init__


def register() -> None:
    """vLLM general plugin entry point (every process; idempotent)."""
    if not os.environ.get(ENV):
        return
    from latency_specialized.vllm.import_hook import when_imported

    when_imported(MODULE, _wrap)


def install_probe(root: Path) -> str:
    """Write the probe's distribution metadata under ``root``; returns the PYTHONPATH that loads it."""
    dist = root / "ls_model_config_probe-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ls-model-config-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{ENTRY_POINT} = model_config_probe:register\n")
    here = str(Path(__file__).resolve().parent)
    return os.pathsep.join([str(root), here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
