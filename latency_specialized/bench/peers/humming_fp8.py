"""Peer: vLLM 0.33's humming path for a block-FP8 linear layer on Hopper, bf16 activations (W8A16): 128 x 128 fp32
blocks (GLM-5.3) and DeepSeek-V4.1-Flash's 32 x 32 ue8m0 blocks as MXFP8 (``MX_BLOCK``).

What it stands for (read in the vllm-0.33.0 wheel; ``NOTES.md`` beside this file)
--------------------------------------------------------------------------------
``kernels/linear/__init__.py::_POSSIBLE_FP8_BLOCK_KERNELS[CUDA]`` lists FlashInfer-DeepGEMM, DeepGEMM, CUTLASS block
FP8, B12x, Marlin, Humming, Triton, torch; ``prioritize_humming`` moves Humming just ahead of Marlin on capability
9.0. DeepGEMM needs the ``deep_gemm`` package; CUTLASS block FP8 is vLLM's own ``_C`` (W8A8: activations quantized
per token and 128-group, then a CUTLASS sm90 block-scaled GEMM) - the first of the list a plain vLLM install on an
H200 runs, and not runnable here (vLLM's CUDA build pins torch 2.14). ``bench/stock/fp8_block.py`` stands in for
it (cuBLAS's block-scaled FP8 GEMM through torch, the same 1 x 128 / 128 x 128 recipe). This peer is the next one
that runs on Hopper with packages we can carry: ``scaled_mm/humming.py::HummingFP8ScaledMMLinearKernel``, what
vLLM runs where the first ones are absent (and what ``--linear-backend humming`` selects).

Load (:meth:`HummingFp8BlockLinear.prepare`), as ``process_weights_after_loading`` does: quant config
``{"quant_method": "humming", "dtype": "float8e4m3", "scale_dtype": float32, "weight_scale_type": "block",
"weight_scale_group_size_n": 128, "weight_scale_group_size": 128}``; ``convert_linear_layer_to_humming_standard``
(the e4m3 weight viewed as int32 ``[N, K/4]``, ``weight_scale_inv`` as ``weight_scale``);
``prepare_humming_linear_layer_config`` (``BaseWeightSchema.from_config`` -> ``convert_humming``; input schema
``HummingInputSchema()`` = bf16; ``prepare_and_transform_humming_tensors(pad_n_to_multiple=256,
pad_k_to_multiple=128)``); compute config ``{"use_batch_invariant": false, "use_f16_accum": false, "gemm_type":
"dense"}``; ``create_humming_locks`` (int32 zeros, 8 per SM).

Call (``apply_humming_linear``): one ``humming_forward(layer_config, inputs=x, weight, weight_scale, ..., locks,
compute_config)``, no tuning config (humming's heuristics for the dense GEMM), output ``[M, N]`` bf16.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from latency_specialized.bench.peers.humming_mxfp4 import import_humming, humming_runtime_info
from latency_specialized.errors import UserError

BLOCK = (128, 128)
MX_BLOCK = (32, 32)
"""DeepSeek-V4.1-Flash's dense blocks: vLLM 0.33 serves them as MXFP8 (one ue8m0 per 32 values of a row,
``ModelOptLinearMethod(kMxfp8Static, kMxfp8Dynamic)``); on an H200 the first of ``_POSSIBLE_MXFP8_KERNELS[CUDA]`` that
runs is ``MarlinMxfp8LinearKernel`` (W8A16, vLLM's ``_C``: not loadable here); humming's MXFP8 with bf16 activations
(the same W8A16 numerics) is the peer this bench can run."""
PAD_N_TO_MULTIPLE = 256
PAD_K_TO_MULTIPLE = 128
FEATURE = "vLLM 0.33's HummingFP8ScaledMMLinearKernel (block FP8 linear, bf16 activations) on SM90"


def _scale_config(N: int, K: int, scale: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
    """humming's weight-scale config and scale tensor for the checkpoint's block scales (see ``prepare``)."""
    if scale.dtype == torch.float32:
        want = (-(-N // BLOCK[0]), -(-K // BLOCK[1]))
        if tuple(scale.shape) != want:
            raise UserError(f"humming fp8 peer: 128 x 128 scales must be fp32 {list(want)}, got {tuple(scale.shape)}")
        return ({"weight_scale_type": "block", "weight_scale_group_size_n": BLOCK[0],
                 "weight_scale_group_size": BLOCK[1]}, scale.contiguous())
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        rows, cols = MX_BLOCK
        want = (-(-N // rows), K // cols)
        if K % cols or tuple(scale.shape) != want:
            raise UserError(f"humming fp8 peer: 32 x 32 ue8m0 scales must be {list(want)} with K % 32 == 0, got "
                            f"{tuple(scale.shape)} (K={K})")
        per_row = scale.view(torch.uint8).repeat_interleave(rows, 0)[:N].contiguous().view(torch.float8_e8m0fnu)
        return {"weight_scale_type": "group", "group_size": cols, "scale_dtype": "float8e8m0"}, per_row
    raise UserError(f"humming fp8 peer: scales must be fp32 (128 x 128) or ue8m0 (32 x 32), got {scale.dtype}")


class HummingFp8BlockLinear:
    """``y = x @ deq(W)^T`` through humming, prepared once from the checkpoint's e4m3 weight and fp32 block scales."""

    def __init__(self) -> None:
        self._prepared = False

    def prepare(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> "HummingFp8BlockLinear":
        """weight [N, K] float8_e4m3fn (CUDA); weight_scale_inv [ceil(N/128), ceil(K/128)] fp32 (128 x 128 blocks),
        or ue8m0 (uint8 / float8_e8m0fnu) [ceil(N/32), K/32] (DeepSeek-V4.1's 32 x 32 blocks: repeated over each
        block's rows into MXFP8's one scale per 32 values of a row, as vLLM does at load)."""
        import_humming()
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or not weight.is_cuda:
            raise UserError(f"humming fp8 peer: weight must be a CUDA [N, K] float8_e4m3fn, got {weight.dtype} "
                            f"{tuple(weight.shape)} on {weight.device}")
        N, K = weight.shape
        if K % 4:
            raise UserError(f"humming fp8 peer: K={K} must be a multiple of 4 (the int32 view of the codes)")
        config, scale = _scale_config(N, K, weight_scale_inv)
        from humming import dtypes
        from humming.forward import humming_forward
        from humming.schema import BaseWeightSchema, HummingInputSchema
        from humming.transform import prepare_and_transform_humming_tensors

        dev = weight.device
        bf16 = torch.bfloat16
        with torch.cuda.device(dev):
            config.setdefault("scale_dtype", dtypes.DataType.from_torch_dtype(scale.dtype))  # as vLLM's configs
            schema = BaseWeightSchema.from_config({"quant_method": "humming", "dtype": "float8e4m3", **config})
            src = {"weight": weight.contiguous().view(N, -1).view(torch.int32), "weight_scale": scale}
            hw_schema, conv = schema.convert_humming(tensors=src, shape_n_stacks=[N], shape_k_stacks=[K],
                                                     param_dtype=bf16)
            hi_schema, in_tensors = HummingInputSchema().convert_humming(tensors=src, shape_n_stacks=[N],
                                                                         shape_k_stacks=[K], param_dtype=bf16)
            conv.update(in_tensors)
            if not hi_schema.is_compatible_with(hw_schema, bf16):
                raise UserError("humming: bf16 activations are not compatible with e4m3 block weights on "
                                f"{torch.cuda.get_device_name(dev)} (vLLM would fall back to another input dtype; "
                                "this peer mirrors the bf16 path only)")
            cfg, tensors = prepare_and_transform_humming_tensors(
                tensors=conv, shape_n=N, shape_k=K, weight_schema=hw_schema, input_schema=hi_schema,
                pad_n_to_multiple=PAD_N_TO_MULTIPLE, pad_k_to_multiple=PAD_K_TO_MULTIPLE, has_bias=False,
                torch_dtype=bf16, device=dev)
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self._forward = humming_forward
        self._cfg = cfg
        self._w = tensors
        self._hadamard = int(getattr(hw_schema, "hadamard_block_size", 0) or 0)
        self._compute = json.dumps({"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "dense"})
        self._locks = torch.zeros(sms * 8, dtype=torch.int32, device=dev)
        self._n = N
        self._prepared = True
        return self

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] bf16 -> [M, N] bf16 (``out`` written when given)."""
        if not self._prepared:
            raise UserError("HummingFp8BlockLinear: call prepare(weight, weight_scale_inv) first")
        w = self._w
        y = self._forward(self._cfg, inputs=x, weight=w["weight"], weight_scale=w.get("weight_scale"),
                          zero_point=w.get("zero_point"), bias=None, weight_scale_2=w.get("weight_scale_2"),
                          input_scale=None, input_scale_2=None, hadamard_block_size=self._hadamard,
                          locks=self._locks, compute_config=self._compute)
        y = y[:, : self._n]
        if out is not None:
            out.copy_(y)
            return out
        return y

    def describe(self) -> dict[str, Any]:
        info = humming_runtime_info()
        info["feature"] = FEATURE
        return info


__all__ = ["HummingFp8BlockLinear", "FEATURE"]
