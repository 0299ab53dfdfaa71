"""Built-in model adapters (import name ``latency_specialized_models``)."""
