"""Entry point of the Kimi K3 adapter (group `latency_specialized.adapters`).

Besides the adapter it registers the reference of the Kimi-only op family ``residual.attnres``
(Block AttnRes mixing), so a deployment that blocks this plugin loses the family with the model.
"""

from latency_specialized.plugins import hookimpl


@hookimpl
def register_adapters(register):
    from latency_specialized_models.kimi_k3.adapter import KimiK3Adapter

    register(KimiK3Adapter())


@hookimpl
def register_implementations(register):
    from latency_specialized_models.kimi_k3.attnres import IMPLEMENTATIONS

    for impl in IMPLEMENTATIONS:
        register(impl)
