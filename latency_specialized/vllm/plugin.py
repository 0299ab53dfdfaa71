"""vLLM general plugin (entry point ``vllm.general_plugins: latency_specialized``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), possibly
several times. It is idempotent and light: it imports nothing of vLLM's model stack and does no
CUDA work; it only arranges for two small wraps to happen when vLLM itself imports the modules:

* ``vllm.engine.arg_utils``: ``--decode-backend`` and the ``decode_backend`` key
  (:mod:`latency_specialized.vllm.engine_args`);
* ``vllm.v1.worker.gpu_worker``: model-load hook of each worker (:mod:`latency_specialized.vllm.worker`).

With ``decode_backend`` unset or ``auto`` both wraps pass straight through: vLLM runs stock.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    """Install the lazy hooks (safe to call any number of times, in any vLLM process)."""
    global _registered
    if _registered:
        return
    from latency_specialized.vllm import engine_args, worker
    from latency_specialized.vllm.import_hook import when_imported

    when_imported("vllm.engine.arg_utils", engine_args.patch)
    when_imported("vllm.v1.worker.gpu_worker", worker.patch)
    _registered = True
