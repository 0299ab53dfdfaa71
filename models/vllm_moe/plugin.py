"""Entry point of the generic vLLM MoE adapter (group `latency_specialized.adapters`)."""

from latency_specialized.plugins import hookimpl


@hookimpl
def register_adapters(register):
    from latency_specialized_models.vllm_moe.adapter import VllmMoEAdapter

    register(VllmMoEAdapter())
