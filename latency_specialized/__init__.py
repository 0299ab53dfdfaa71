"""latency-specialized: a small-batch, latency-first LLM decode backend for vLLM.

Layers (imports point down): integrations (``vllm/``, ``cli``, ``commands/``, ``bench/``) -> adapters
(``latency_specialized_models.*``) -> composition (``pieces/``) -> ``runtime`` (+ ``testing``, the plugin
registry) -> ``ops`` (+ ``adapter``) -> ``comm`` -> ``kernels`` -> foundation (``spec``, ``hardware``,
``trace``, ``errors``, ``contract``, ``plugins.hookspecs``). ``tests/foundation/test_layering.py`` holds
the map and enforces it.
"""

__version__ = "0.1.0"
