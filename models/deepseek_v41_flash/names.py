"""DeepSeek-V4.1-Flash checkpoint tensors: the official names (vLLM 0.33 ``load_weights`` before its mapper's
``model.`` prefix and ``.scale`` renames; transformers' V4 ``save_pretrained`` writes the same), loading with
dequantisation, random weights, saving in the official layout (vLLM ``quant_config.py``, ``expert_dtype="fp4"``):

* dense FP8: ``<base>.weight`` float8_e4m3fn ``[N, K]`` + ``<base>.scale`` float8_e8m0fnu ``[ceil(N/32), ceil(K/32)]``
  (ue8m0: byte b = 2^(b-127), 255 = NaN); value = fp8 * its 32x32 block's scale;
* routed experts FP4: ``<base>.weight`` ``[N, K/2]`` bytes (uint8 / int8 / float4_e2m1fn_x2; low nibble = even column,
  OCP MX order) + ``<base>.scale`` e8m0 ``[N, K/32]``;
* plain (vLLM: ``quant_config=None`` / parameters): compressor, indexer ``wk`` / ``weights_proj``, norms, ``hc_*``,
  ``attn_sink``, ``gate.bias`` (fp32 ones: ``hc_*``, sinks, bias), embed / head. Draft (``mtp.*``) / vision: not read.
"""

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


def expected_tensors(spec: DeepseekV41Spec) -> dict[str, Entry]:
    """Official name -> (shape, dtype kind, storage) of every backbone tensor of ``spec`` (unsharded)."""
    s = spec.full()
    H, V, hc = s.hidden_size, s.vocab_size, s.residual.streams or 1
    mix = s.hyper.mix_width(hc)
    out: dict[str, Entry] = {"embed.weight": ((V, H), "act", "plain"), "head.weight": ((V, H), "act", "plain"),
                             "norm.weight": ((H,), "act", "plain")}
    for layer in s.layers:
        i, a, f = layer.index, layer.attention, layer.ffn
        p, D, heads = f"layers.{i}.", a.head_dim, a.num_heads  # type: ignore[union-attr]
        t: dict[str, Entry] = {"attn_norm.weight": ((H,), "act", "plain"), "ffn_norm.weight": ((H,), "act", "plain")}
        for sub in ("attn", "ffn"):
            t.update({f"hc_{sub}_fn": ((mix, hc * H), "float32", "plain"), f"hc_{sub}_base": ((mix,), "float32", "plain"),
                      f"hc_{sub}_scale": ((3,), "float32", "plain")})
        t.update({
            "attn.wq_a.weight": ((a.q_lora_rank, H), "act", "fp8"), "attn.q_norm.weight": ((a.q_lora_rank,), "act", "plain"),
            "attn.wkv.weight": ((D, H), "act", "fp8"), "attn.kv_norm.weight": ((D,), "act", "plain"),
            "attn.wq_b.weight": ((heads * D, a.q_lora_rank), "act", "fp8"),
            # wo_a: one [o_lora, heads*D/groups] block per group, stacked (vLLM runs it as a bmm over the groups)
            "attn.wo_a.weight": ((a.o_groups * a.o_lora_rank, heads * D // a.o_groups), "act", "fp8"),
            "attn.wo_b.weight": ((H, a.o_groups * a.o_lora_rank), "act", "fp8"),
            "attn.attn_sink": ((heads,), "float32", "plain")})
        if i in s.kv_source_layers:
            t.update({"attn.compressor.wkv.weight": ((D, H), "act", "plain"),
                      "attn.compressor.norm.weight": ((D,), "act", "plain")})
            if a.compress_ratio > 1:  # ratio 1 pools single tokens: the checkpoint carries no gate (vLLM)
                t["attn.compressor.wgate.weight"] = ((D, H), "act", "plain")
        if a.indexer is not None:
            ih, idim = a.indexer.num_heads, a.indexer.head_dim
            t.update({"attn.indexer.wq_b.weight": ((ih * idim, a.q_lora_rank), "act", "fp8"),
                      "attn.indexer.weights_proj.weight": ((ih, H), "act", "plain")})
            if i in s.kv_source_layers:  # only the K-cache owner maps the compressed latent to index keys
                t.update({"attn.indexer.wk.weight": ((idim, D), "act", "plain"),
                          "attn.indexer.k_norm.weight": ((idim,), "act", "plain")})
        E, I = f.num_experts, f.expert_intermediate  # type: ignore[union-attr]
        t.update({"ffn.gate.weight": ((E, H), "act", "plain"), "ffn.gate.bias": ((E,), "float32", "plain")})
        for e in range(E):
            t.update({f"ffn.experts.{e}.w1.weight": ((I, H), "act", "fp4"),
                      f"ffn.experts.{e}.w3.weight": ((I, H), "act", "fp4"),
                      f"ffn.experts.{e}.w2.weight": ((H, I), "act", "fp4")})
        if f.num_shared_experts:  # type: ignore[union-attr]
            Is = I * f.num_shared_experts  # type: ignore[union-attr]
            t.update({"ffn.shared_experts.w1.weight": ((Is, H), "act", "fp8"),
                      "ffn.shared_experts.w3.weight": ((Is, H), "act", "fp8"),
                      "ffn.shared_experts.w2.weight": ((H, Is), "act", "fp8")})
        if i in s.engram.layers:
            g = s.engram
            rows = g.num_embeddings[g.layers.index(i)]
            # The table's scale layout is not visible in vLLM's text loader (ParallelEngramEmbedding keeps the
            # raw bytes): taken here as the dense 32x32 blocks - check against the released checkpoint.
            t.update({"engram.embed.weight": ((rows, g.head_dim), "act", "fp8"),
                      "engram.wkv.weight": ((H * (hc + 1), g.rows_per_token * g.head_dim), "act", "fp8"),
                      "engram.q_weight": ((hc, H), "act", "plain"), "engram.k_weight": ((hc, H), "act", "plain")})
        out.update({p + k: v for k, v in t.items()})
    return out


def scale_name(name: str) -> str:
    return name[: -len(".weight")] + ".scale"   # <base>.weight -> <base>.scale


def scale_shape(shape: tuple[int, ...], storage: str) -> tuple[int, ...]:
    return (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK)) if storage == "fp8" else (shape[0], shape[1] // BLOCK)


# ------------------------------------------------------------------------------------------------ formats
# the shared codecs of latency_specialized.quant ('fp8-block-32' and 'mxfp4-deepseek'), with this loader's names
def _scale_of(name: str) -> str:
    return scale_name(name) if name.endswith(".weight") else name


def ue8m0_decode(scale: torch.Tensor, name: str = "scale") -> torch.Tensor:
    """float8_e8m0fnu / uint8 exponents -> fp32 2^(b-127); CheckpointError naming ``name`` on a NaN scale (255)."""
    return codecs.ue8m0_decode(scale, name)


def fp8_dequantize(w: torch.Tensor, scale: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """``w [N, K]`` float8_e4m3fn with ue8m0 ``scale [ceil(N/32), ceil(K/32)]`` -> fp32 ``[N, K]``."""
    return codecs.fp8_block_dequantize(w, scale, (BLOCK, BLOCK), encoding="ue8m0", name=_scale_of(name)[:-6])


def fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (float8_e4m3fn, float8_e8m0fnu scales of the 32x32 blocks: the smallest 2^e keeping <= 448)."""
    q, s = codecs.fp8_block_quantize(w, (BLOCK, BLOCK), encoding="ue8m0")
    return q, s.view(torch.float8_e8m0fnu)


def fp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """``packed [N, K/2]`` (two e2m1 codes a byte, low nibble first) + ue8m0 ``scale [N, K/32]`` -> fp32 ``[N, K]``."""
    return codecs.mxfp4_dequantize(packed, scale, name=_scale_of(name))


def fp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (uint8 codes ``[N, K/2]``, float8_e8m0fnu scales ``[N, K/32]``), OCP MX rounding."""
    q, s = codecs.mxfp4_quantize(w)
    return q, s.view(torch.float8_e8m0fnu)


# ------------------------------------------------------------------------------------------------ load / save
def load(directory: str | Path, dtype: torch.dtype = torch.bfloat16,
         device: Any = "cpu") -> tuple[DeepseekV41Spec, dict[str, torch.Tensor], dict]:
    """(spec, tensors by official name in ``dtype`` (fp32 ones in fp32), config) of a DeepSeek-V4.1 directory;
    FP8 / FP4 tensors (those stored with a ``.scale``) come dequantised. CheckpointError names file and fix."""
    d = Path(directory)
    cfg = read_config(d)
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
        v = fp8_dequantize(w, s, n) if storage == "fp8" else fp4_dequantize(w, s, n)
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
            out[n], out[scale_name(n)] = (fp8_quantize if storage == "fp8" else fp4_quantize)(t)
            continue
        out[n] = t.to(torch_dtype(dtype) if kind == "act" else torch.float32)
    return save_checkpoint(directory, out, config_from_spec(spec, dtype))


__all__ = ["BLOCK", "expected_tensors", "fp4_dequantize", "fp4_quantize", "fp8_dequantize", "fp8_quantize", "load",
           "random_weights", "save", "scale_name", "ue8m0_decode"]
