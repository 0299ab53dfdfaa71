"""The vLLM binding contract: :mod:`latency_specialized.runtime.vllm_binding` (re-exported).

Adapters implement it and sit below this integration, so the contract is defined at the runtime layer;
the integration imports it from here as before.
"""

from latency_specialized.runtime.vllm_binding import (FUSED, STOCK, BindContext, DecodeStep, SiteChoice,  # noqa: F401
                                                      SiteTable, VllmBinding)

__all__ = ["FUSED", "STOCK", "BindContext", "DecodeStep", "SiteChoice", "SiteTable", "VllmBinding"]
