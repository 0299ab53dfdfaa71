"""DeepSeek-V4.1-Flash checkpoint tensors: the official names (vLLM 0.33 ``load_weights`` before its mapper's ``model.``
prefix and ``.scale`` renames; transformers' V4 ``save_pretrained`` writes the same), loading with dequantisation, random
weights, saving in the official layout (vLLM ``quant_config.py``, ``expert_dtype="fp4"``): dense FP8 e4m3 ``<base>.weight
[N, K]`` + e8m0 ``<base>.scale [ceil(N/32), ceil(K/32)]`` (byte b = 2^(b-127), 255 = NaN); routed experts FP4 ``[N, K/2]``
bytes (uint8 / int8 / float4_e2m1fn_x2, low nibble = even column) + e8m0 ``[N, K/32]``; plain: compressor, indexer ``wk``
/ ``weights_proj``, norms, ``hc_*``, sinks, ``gate.bias`` (fp32: the last three), embed, head. Not read: mtp.*, vision."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch

from latency_specialized.errors import CheckpointError
from latency_specialized.quant import codecs
from latency_specialized.runtime.checkpoint import load_checkpoint, read_config
from latency_specialized.runtime.checkpoint import save_checkpoint, tensor_files

from latency_specialized_models.deepseek_v41_flash.config import config_from_spec, spec_from_config
from latency_specialized_models.deepseek_v41_flash.spec import DeepseekV41Spec

BLOCK = 32
Entry = tuple[tuple[int, ...], str, str]
"""(full shape, dtype kind 'act' | 'float32', storage 'plain' | 'fp8' | 'fp4')."""

FP8 = ("attn.wq_a.", "attn.wkv.", "attn.wq_b.", "attn.wo_a.", "attn.wo_b.", "attn.indexer.wq_b.", "shared_experts.",
       "engram.embed.", "engram.wkv.")
"""Name parts of the dense FP8 tensors (vLLM ``quant_config.py``); ``ffn.experts.*``: FP4; the rest plain."""


def expected_tensors(spec: DeepseekV41Spec) -> dict[str, Entry]:
    """Official name -> (shape, dtype kind, storage) of every backbone tensor of ``spec`` (unsharded): the pieces'
    weights (``composed.py``'s name map) plus the Engram tables and projections the program does not read."""
    from latency_specialized.runtime.composed import expected_tensors as composed_expected

    from latency_specialized_models.deepseek_v41_flash.composed import composed_model, tensor_name
    s = spec.full()
    out: dict[str, Entry] = {}
    for n, (shape, kind) in composed_expected(composed_model(s), tensor_name).items():
        storage = "fp4" if ".ffn.experts." in n else "fp8" if any(f in n for f in FP8) else "plain"
        out[n] = (shape, kind, storage)
    g, H, hc = s.engram, s.hidden_size, s.residual.streams or 1
    for i, rows in zip(g.layers, g.num_embeddings):
        # scale layout unseen in vLLM's text loader (raw bytes kept): taken as dense 32x32 blocks - check the release
        out.update({f"layers.{i}.engram.embed.weight": ((rows, g.head_dim), "act", "fp8"),
                    f"layers.{i}.engram.wkv.weight": ((H * (hc + 1), g.rows_per_token * g.head_dim), "act", "fp8"),
                    f"layers.{i}.engram.q_weight": ((hc, H), "act", "plain"),
                    f"layers.{i}.engram.k_weight": ((hc, H), "act", "plain")})
    return out


# formats: latency_specialized.quant's codecs ('fp8-block-32' / 'mxfp4-deepseek' numerics; scales written as
# float8_e8m0fnu, FP4 codes as uint8); a bad scale raises CheckpointError naming the tensor.
def scale_name(name: str) -> str:
    return name[: -len(".weight")] + ".scale"   # <base>.weight -> <base>.scale


def scale_shape(shape: tuple[int, ...], storage: str) -> tuple[int, ...]:
    return (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK)) if storage == "fp8" else (shape[0], shape[1] // BLOCK)


def load(directory: str | Path, dtype: torch.dtype = torch.bfloat16,
         device: Any = "cpu") -> tuple[DeepseekV41Spec, dict[str, torch.Tensor], dict]:
    """(spec, tensors by official name in ``dtype`` (fp32 ones in fp32), config) of a DeepSeek-V4.1 directory;
    FP8 / FP4 tensors (those stored with a ``.scale``) come dequantised. CheckpointError names file and fix."""
    cfg = read_config(d := Path(directory))
    if cfg is None:
        raise CheckpointError(f"{d}: no config.json: point at a DeepSeek-V4.1 model directory")
    spec = spec_from_config(cfg, where=str(d / "config.json"))
    expected, files = expected_tensors(spec), tensor_files(d)
    want: dict[str, tuple[tuple[int, ...], str]] = {}
    quant: dict[str, str] = {}
    for n, (shape, kind, storage) in expected.items():
        if storage != "plain" and scale_name(n) in files:
            quant[n] = storage
            want[n] = ((shape[0], shape[1] // 2) if storage == "fp4" else shape, "keep")
            want[scale_name(n)] = (scale_shape(shape, storage), "keep")
        else:
            want[n] = (shape, kind)
    got = load_checkpoint(d, want, dtype, device="cpu").tensors
    for n, storage in quant.items():
        w, s = got[n], got.pop(scale_name(n))
        ok = w.dtype == torch.float8_e4m3fn if storage == "fp8" else w.dtype in (
            torch.uint8, torch.int8, getattr(torch, "float4_e2m1fn_x2", torch.uint8))
        if not ok:
            raise CheckpointError(f"{files[n]}: tensor {n} has dtype {w.dtype} next to {scale_name(n)}: "
                                  + ("an FP8 weight must be float8_e4m3fn" if storage == "fp8" else
                                     "an FP4 expert weight must be packed bytes (uint8 / int8 / float4_e2m1fn_x2)"))
        v = (codecs.fp8_block_dequantize(w, s, (BLOCK, BLOCK), encoding="ue8m0", name=n[:-len(".weight")])
             if storage == "fp8" else codecs.mxfp4_dequantize(w, s, name=scale_name(n)))
        got[n] = v.to(torch.float32 if expected[n][1] == "float32" and dtype != torch.float64 else dtype)
    return spec, {n: t.to(device) for n, t in got.items()}, cfg


def random_weights(spec: DeepseekV41Spec, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                   device: Any = "cpu") -> dict[str, torch.Tensor]:
    """Random tensors by official name, O(1) activations: norms 1 + 0.1 N, projections N(0, 1/fan_in), embed N(0, 1),
    mHC fn 0.1/sqrt(fan_in) N, base/scale/sinks/biases 0.1-0.5 N; fp32 kinds stay fp32 (fp64 in fp64 runs)."""
    g, out = torch.Generator().manual_seed(seed), {}
    for n, (shape, kind, _) in expected_tensors(spec).items():
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        leaf = n.rsplit(".", 2)[-2] if n.endswith(".weight") else n.rsplit(".", 1)[-1]
        if leaf.endswith("norm") or leaf in ("q_weight", "k_weight"):
            x = 1 + 0.1 * x
        elif leaf.startswith("hc_") and leaf.endswith("_fn"):
            x = 0.1 * x / math.sqrt(shape[-1])
        elif leaf.startswith("hc_") or leaf in ("attn_sink", "bias"):
            x = (0.5 if leaf == "attn_sink" else 0.1) * x
        elif n != "embed.weight":
            x = x / math.sqrt(shape[-1])
        out[n] = x.to(device=device, dtype=dtype if kind == "act" or dtype == torch.float64 else torch.float32)
    return out


def save(directory: str | Path, spec: DeepseekV41Spec, named: dict[str, torch.Tensor], dtype: str = "bfloat16",
         quantize: Callable[[str], bool] | None = None) -> list[Path]:
    """Write ``config.json`` + safetensors in the official layout: 'act' tensors in ``dtype``, fp32 ones in fp32;
    ``quantize(name)`` true on an FP8 / FP4 tensor: store it so (``.weight`` + ``.scale``)."""
    from latency_specialized.runtime.random_weights import torch_dtype
    kinds, out = expected_tensors(spec), {}
    for n, t in named.items():
        shape, kind, storage = kinds.get(n, ((), "act", "plain"))
        if quantize is not None and storage != "plain" and quantize(n):
            q, sc = (codecs.fp8_block_quantize(t, (BLOCK, BLOCK), encoding="ue8m0") if storage == "fp8"
                     else codecs.mxfp4_quantize(t))   # fp8 ue8m0: the smallest 2^e keeping a block <= 448
            out[n], out[scale_name(n)] = q, sc.view(torch.float8_e8m0fnu)
            continue
        out[n] = t.to(torch_dtype(dtype) if kind == "act" else torch.float32)
    return save_checkpoint(directory, out, config_from_spec(spec, dtype))


__all__ = ["BLOCK", "expected_tensors", "load", "random_weights", "save", "scale_name"]
