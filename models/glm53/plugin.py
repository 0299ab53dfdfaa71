"""Entry point of the GLM-5.3 adapter (group `latency_specialized.adapters`)."""

from latency_specialized.plugins import hookimpl


@hookimpl
def register_adapters(register):
    from latency_specialized_models.glm53.adapter import Glm53Adapter

    register(Glm53Adapter())
