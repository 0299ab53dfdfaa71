"""Entry point of the Kimi K3 adapter (group `latency_specialized.adapters`).

Its op families (Block AttnRes mixing, ``residual.attnres``, included) are the backend's built-in ones.
"""

from latency_specialized.plugins import hookimpl


@hookimpl
def register_adapters(register):
    from latency_specialized_models.kimi_k3.adapter import KimiK3Adapter

    register(KimiK3Adapter())
