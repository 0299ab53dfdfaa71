"""Entry point of the DeepSeek-V4.1-Flash adapter (group `latency_specialized.adapters`)."""

from latency_specialized.plugins import hookimpl


@hookimpl
def register_adapters(register):
    from latency_specialized_models.deepseek_v41_flash.adapter import DeepseekV41FlashAdapter

    register(DeepseekV41FlashAdapter())
