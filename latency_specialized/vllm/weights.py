"""A vLLM module's own weights in the layout the op families take: :mod:`latency_specialized.runtime.vllm_weights`
(re-exported; adapters' vLLM bindings use it too, so it is defined below them).
"""

from latency_specialized.runtime.vllm_weights import (RETAINED, RETAINED_W2, RETAINED_W13, expert_weights,  # noqa: F401
                                                      linear_weight, retain_loaded_weights)

__all__ = ["RETAINED", "RETAINED_W13", "RETAINED_W2", "expert_weights", "linear_weight", "retain_loaded_weights"]
