"""Entry point of the Qwen3-MoE adapter (group `latency_specialized.adapters`)."""

from latency_specialized.plugins import hookimpl


@hookimpl
def register_adapters(register):
    from latency_specialized_models.qwen3_moe.adapter import Qwen3MoEAdapter

    register(Qwen3MoEAdapter())
