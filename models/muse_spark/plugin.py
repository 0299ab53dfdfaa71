"""Entry point of the Muse Spark adapter (group `latency_specialized.adapters`)."""

from latency_specialized.plugins import hookimpl


@hookimpl
def register_adapters(register):
    from latency_specialized_models.muse_spark.adapter import MuseSparkAdapter

    register(MuseSparkAdapter())
