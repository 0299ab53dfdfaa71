"""The vLLM binding contract: :mod:`latency_specialized.runtime.vllm_binding` (re-exported).

Adapters implement it and sit below this integration, so the contract is defined at the runtime layer;
the integration imports it from here as before. ``SiteChoice`` is the planner's
(``latency_specialized.ops.plan.SiteChoice``): what serves a site is the plan's choice, with
``stock`` set where vLLM's own module serves it.
"""

from latency_specialized.runtime.vllm_binding import (STOCK, BindContext, DecodeStep, SiteChoice,  # noqa: F401
                                                      SiteTable, VllmAttention, VllmBinding, VllmComposedStep)

__all__ = ["STOCK", "BindContext", "DecodeStep", "SiteChoice", "SiteTable", "VllmAttention", "VllmBinding",
           "VllmComposedStep"]
