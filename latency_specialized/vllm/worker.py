"""Hook model loading in vLLM workers (every rank; the CPU worker inherits the GPU worker's method).

vLLM's workers load their model in ``vllm.v1.worker.gpu_worker.Worker.load_model`` (``CPUWorker``
and the other platform workers inherit it). The worker module is imported only after vLLM loaded
the general plugins of the worker process (``WorkerWrapperBase.init_worker`` resolves the worker
class by name afterwards), so the plugin wraps that method when the module is imported. The wrap
reads the choice from where the front process carried it (``additional_config["latency_specialized"]``,
see :mod:`latency_specialized.vllm.config`; a ``VllmConfig`` that never went through
``EngineArgs.create_engine_config`` is rewritten the same way here, in place, *before* vLLM builds
the model, so vLLM 0.33's in-tree specialized decode never reads our value). For
``latency_specialized`` it

* keeps the loaded weights alive through the CPU build's repack (see
  :mod:`latency_specialized.vllm.weights`), then
* runs vLLM's load, then installs the decode override (:func:`latency_specialized.vllm.install.install`).

Any other backend value calls vLLM's method and nothing else.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from latency_specialized.vllm import config as backend_config

_MARK = "__latency_specialized_wrapped__"


def backend_of(vllm_config: Any) -> backend_config.BackendChoice:
    """This deployment's decode backend, from our additional_config entry (rewriting it in place first
    if the config still holds the user's ``decode_backend`` form)."""
    return backend_config.apply_in_place(getattr(vllm_config, "additional_config", None))


def wants_override(vllm_config: Any) -> bool:
    """True when this deployment's decode backend is latency_specialized."""
    return backend_of(vllm_config).ours


def patch(gpu_worker: ModuleType) -> None:
    """Wrap ``Worker.load_model`` (idempotent; called when vLLM imports vllm.v1.worker.gpu_worker)."""
    worker_cls = gpu_worker.Worker
    if getattr(worker_cls.load_model, _MARK, False):
        return
    original = worker_cls.load_model

    @functools.wraps(original)
    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        vllm_config = getattr(self, "vllm_config", None)
        if vllm_config is None or not wants_override(vllm_config):
            return original(self, *args, **kwargs)
        from vllm.platforms import current_platform

        from latency_specialized.vllm.install import install
        from latency_specialized.vllm.weights import retain_loaded_weights

        with retain_loaded_weights(enabled=current_platform.is_cpu()):
            result = original(self, *args, **kwargs)
        install(self.model_runner.get_model(), vllm_config)
        return result

    setattr(load_model, _MARK, True)
    worker_cls.load_model = load_model
