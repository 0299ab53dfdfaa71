"""latency-specialized: a small-batch, latency-first LLM decode backend for vLLM.

Layers (imports point down): integrations (``vllm/``, ``cli``) -> adapters
(``latency_specialized_models.*``) -> ``runtime`` -> ``ops`` -> ``comm`` -> ``kernels`` ->
foundation (``spec``, ``hardware``, ``trace``, ``plugins``).
"""

__version__ = "0.1.0"
