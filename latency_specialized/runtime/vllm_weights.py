"""Access to a vLLM module's own weights in the layout the op families take.

Used by the vLLM integration (``latency_specialized/vllm/worker.py``: ``retain_loaded_weights``) and
by adapters' vLLM bindings (``linear_weight``, ``expert_weights``), so it sits at the runtime layer,
below both; ``latency_specialized.vllm.weights`` re-exports it.

vLLM's CPU build repacks weights after loading: every unquantized linear layer for oneDNN/sgl
kernels, replacing ``layer.weight`` with an empty tensor
(``dispatch_cpu_unquantized_gemm(remove_weight=True)``), and the routed experts into a blocked
VNNI layout of the same shape (``cpu_prepack_moe_weight``). ``retain_loaded_weights()`` is active
only around the model load of a worker that runs latency_specialized: it keeps a reference to the
very tensors vLLM loaded (``layer._ls_weight``, ``experts._ls_w13`` / ``_ls_w2``) before the repack
replaces them. No copy is made by us; the cost is that the loaded tensors stay alive next to
vLLM's packed ones (CPU only; on GPUs the parameters are used in place).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

RETAINED = "_ls_weight"
RETAINED_W13, RETAINED_W2 = "_ls_w13", "_ls_w2"


def _stash(layer: torch.nn.Module, names: tuple[tuple[str, str, int], ...]) -> None:
    for param, stash, dims in names:
        w = getattr(layer, param, None)
        if isinstance(w, torch.Tensor) and w.dim() == dims and not w.is_meta:
            setattr(layer, stash, w.detach())


@contextlib.contextmanager
def _stash_before(cls: type, names: tuple[tuple[str, str, int], ...]) -> Iterator[None]:
    original = cls.process_weights_after_loading

    def process_weights_after_loading(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        _stash(layer, names)
        return original(self, layer, *args, **kwargs)

    cls.process_weights_after_loading = process_weights_after_loading
    try:
        yield
    finally:
        cls.process_weights_after_loading = original


@contextlib.contextmanager
def retain_loaded_weights(enabled: bool = True) -> Iterator[None]:
    """While active, unquantized linear layers and routed experts keep their loaded weights."""
    if not enabled:
        yield
        return
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    with _stash_before(UnquantizedLinearMethod, (("weight", RETAINED, 2),)), \
            _stash_before(UnquantizedFusedMoEMethod, (("w13_weight", RETAINED_W13, 3), ("w2_weight", RETAINED_W2, 3))):
        yield


def linear_weight(layer: Any) -> tuple[torch.Tensor | None, str]:
    """The [N, K] weight of a vLLM linear layer as loaded (the parameter itself, or the tensor the CPU build's
    repack replaced, kept by ``retain_loaded_weights``: never a copy), or (None, why not).

    Only unquantized layers without bias qualify: the gemm family computes x @ W^T (+ residual).
    """
    method = getattr(layer, "quant_method", None)
    if method is not None and type(method).__name__ != "UnquantizedLinearMethod":
        return None, f"quantized ({type(method).__name__})"
    if getattr(layer, "bias", None) is not None:
        return None, "has a bias"
    w = getattr(layer, RETAINED, None)
    if w is None:
        w = getattr(layer, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.numel() == 0:
        return None, "weight repacked by vLLM and not retained"
    return w, ""


def expert_weights(routed_experts: Any) -> tuple[torch.Tensor | None, torch.Tensor | None, str]:
    """(w13 [E, 2I, K], w2 [E, N, I], '') of unquantized routed experts as loaded, or (None, None, why)."""
    method = getattr(routed_experts, "quant_method", None)
    if method is not None and type(method).__name__ != "UnquantizedFusedMoEMethod":
        return None, None, f"quantized experts ({type(method).__name__})"
    w13 = getattr(routed_experts, RETAINED_W13, None)
    w2 = getattr(routed_experts, RETAINED_W2, None)
    if w13 is None or w2 is None:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():  # the CPU build prepacks in place of the loaded layout
            return None, None, "experts prepacked by vLLM's CPU build and not retained"
        w13, w2 = getattr(routed_experts, "w13_weight", None), getattr(routed_experts, "w2_weight", None)
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor) or w13.dim() != 3 or w2.dim() != 3:
        return None, None, "expert weights not in [E, 2I, K] / [E, N, I] layout"
    if w13.shape[0] != w2.shape[0] or w13.shape[1] != 2 * w2.shape[2] or w13.shape[2] != w2.shape[1]:
        return None, None, f"expert weights padded or transposed ({tuple(w13.shape)}, {tuple(w2.shape)})"
    return w13, w2, ""
