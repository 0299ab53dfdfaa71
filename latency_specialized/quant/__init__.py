"""Quantized weights, CPU side: format descriptions, pack/unpack, dequantising references, official-layout names.

Foundation layer (imports torch and ``errors`` only): the runtime's checkpoint reader, kernels and adapters
all use the same code. The formats (``FORMATS``; the table is in :mod:`latency_specialized.quant.formats`):

* ``mxfp4``          e2m1 + ue8m0 per 1x32, compressed-tensors names (Kimi K3 routed experts)
* ``mxfp4-deepseek`` the same numerics, ``<base>.weight`` + ``<base>.scale`` (DeepSeek-V4.1 routed experts)
* ``nvfp4``          e2m1 + e4m3 per 1x16 + fp32 ``weight_scale_2`` (+ ``input_scale``), ModelOpt (Muse Spark)
* ``fp8-block-128``  e4m3 + fp32 ``weight_scale_inv`` per 128x128 (GLM-5.3, DeepSeek-V3)
* ``fp8-block-32``   e4m3 + ue8m0 ``scale`` per 32x32 (DeepSeek-V4.1 dense weights)
"""

from latency_specialized.quant.checkpoint_io import (QuantizedWeight, dequantize_named, dequantize_stored, keep_quantized,
                                                     mxfp4_names, quantized_pair, quantize_named, quantize_weight, quantized_from_named,
                                                     stored_format, stored_tensors, tensor_names)
from latency_specialized.quant.codecs import (E2M1, E2M1_VALUES, dequantize, e2m1_decode, e2m1_encode,
                                              e4m3_decode, fp8_block_dequantize, fp8_block_quantize,
                                              mxfp4_dequantize, mxfp4_quantize, nvfp4_dequantize, nvfp4_quantize,
                                              pack_e2m1, quantize, ue8m0_decode, unpack_e2m1)
from latency_specialized.quant.formats import (FORMAT_FAMILIES, FORMATS, FP8_BLOCK_32, FP8_BLOCK_128, MXFP4,
                                               MXFP4_DEEPSEEK, NVFP4, QuantFormat)

__all__ = ["QuantFormat", "FORMATS", "FORMAT_FAMILIES", "MXFP4", "MXFP4_DEEPSEEK", "NVFP4", "FP8_BLOCK_128",
           "FP8_BLOCK_32", "E2M1", "E2M1_VALUES", "pack_e2m1", "unpack_e2m1", "e2m1_decode", "e2m1_encode",
           "ue8m0_decode", "e4m3_decode", "mxfp4_dequantize", "mxfp4_quantize", "nvfp4_dequantize",
           "nvfp4_quantize", "fp8_block_dequantize", "fp8_block_quantize", "dequantize", "quantize",
           "QuantizedWeight", "tensor_names", "mxfp4_names", "stored_tensors", "stored_format", "quantize_weight",
           "quantize_named", "quantized_from_named", "keep_quantized", "quantized_pair", "dequantize_named",
           "dequantize_stored"]
