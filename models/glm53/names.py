"""GLM-5.3 checkpoint tensors: Hugging Face names (what transformers' ``GlmMoeDsaForCausalLM.save_pretrained`` writes:
experts one by one, ``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``), the map from the pieces'
weights onto them, loading (FP8 block-scaled weights dequantised), random weights and saving.

MTP: layer ``num_hidden_layers`` (DeepSeek-V3 layout, vLLM's ``DeepseekV32MTP``): ``enorm``, ``hnorm``, ``eh_proj
[H, 2H]``, ``shared_head.norm`` and a whole MoE decoder layer with its own indexer; its ``embed_tokens`` and
``shared_head.head`` are loaded where the checkpoint has them (vLLM shares the main model's otherwise). transformers
ignores that layer.

FP8 (DeepSeek-V3 layout): ``<base>.weight`` float8_e4m3fn ``[N, K]`` and ``<base>.weight_scale_inv`` fp32
``[ceil(N/128), ceil(K/128)]``; value = fp8 * scale of its 128x128 block, dequantised on load."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch

from latency_specialized.errors import CheckpointError
from latency_specialized.quant import codecs
from latency_specialized.runtime import random_weights as rw
from latency_specialized.runtime.checkpoint import load_checkpoint, read_config, save_checkpoint, tensor_files
from latency_specialized.runtime.composed import MODEL, ComposedModel
from latency_specialized.runtime.composed import expected_tensors as composed_expected
from latency_specialized.spec import MoESpec

from latency_specialized_models.glm53.config import config_from_spec, spec_from_config
from latency_specialized_models.glm53.spec import Glm53Spec

BLOCK = 128
ATTN = {"q_a_norm": "q_a_layernorm", "kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm",
        "indexer.q_proj": "indexer.wq_b", "indexer.k_proj": "indexer.wk"}
FFN = {"router": "gate.weight", "router_bias": "gate.e_score_correction_bias",
       "experts.w1": "experts.{e}.gate_proj.weight", "experts.w3": "experts.{e}.up_proj.weight",
       "experts.w2": "experts.{e}.down_proj.weight"}
RESIDUAL = {"input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight"}
MTP_OPTIONAL = ("embed_tokens.weight", "shared_head.head.weight")
"""MTP tensors loaded where present (else the main model's embedding / head serve)."""
FP8_SKIP = ("mlp.gate.", "weights_proj.", "eh_proj.", "embed_tokens.", "lm_head.", "shared_head.")


def composed(spec: Glm53Spec) -> ComposedModel:
    """The pieces of ``spec`` (unsharded: ``glm53.composed.composed_model``; imported here, it imports this module)."""
    from latency_specialized_models.glm53.composed import composed_model
    return composed_model(spec.full())


def tensor_name(layer: int, role: str, local: str) -> str:
    """Hugging Face name of the piece weight ``(layer, role, local)`` (``{e}``: one tensor per expert)."""
    if layer == MODEL:
        return {"embed": "model.embed_tokens.weight", "residual": "model.norm.weight", "head": "lm_head.weight"}[role]
    p = f"model.layers.{layer}."
    if role == "residual":
        return p + RESIDUAL[local]
    if role == "attn":
        if local == "indexer.k_norm_bias":
            return p + "self_attn.indexer.k_norm.bias"
        return f"{p}self_attn.{ATTN.get(local, local)}.weight"
    if local.startswith("shared."):
        return f"{p}mlp.shared_experts.{local[7:]}.weight"
    return p + "mlp." + FFN.get(local, local + ".weight")


def mtp_tensors(spec: Glm53Spec) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype kind) of the MTP layers' required tensors (empty without MTP)."""
    spec, H = spec.full(), spec.full().hidden_size
    if not spec.mtp.num_layers:
        return {}
    model = composed(spec)
    attn = next(lp.attention for lp in model.layers if getattr(lp.attention.indexer, "full", False))
    moe = next(lp.ffn for lp in model.layers if isinstance(lp.ffn.spec, MoESpec))
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for n in range(spec.num_layers, spec.num_layers + spec.mtp.num_layers):
        p = f"model.layers.{n}."
        out.update({p + "enorm.weight": ((H,), "act"), p + "hnorm.weight": ((H,), "act"),
                    p + "eh_proj.weight": ((H, 2 * H), "act"), p + "shared_head.norm.weight": ((H,), "act")})
        for role, decls in (("residual", model.residual.weights(spec, 1, "layer")), ("attn", attn.weights(spec, 1)),
                            ("ffn", moe.weights(spec, 1))):
            for d in decls:
                name = tensor_name(n, role, d.name)
                for e in range(d.shape[0]) if "{e}" in name else [None]:
                    out[name.format(e=e)] = (tuple(d.shape[1:]) if e is not None else tuple(d.shape), d.dtype)
    return out


def stored_fp8(name: str) -> bool:
    """Stored e4m3 + ``weight_scale_inv`` in the FP8 release: the projections, not FP8_SKIP's (router, heads ...)."""
    return name.endswith(("proj.weight", "_mqa.weight", ".wq_b.weight", ".wk.weight")) and \
        not any(k in name for k in FP8_SKIP)


def expected_tensors(spec: Glm53Spec) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (full shape, dtype kind 'act' | 'float32') of every tensor the model needs (MTP layers included)."""
    return {**composed_expected(composed(spec), tensor_name), **mtp_tensors(spec)}


def load(directory: str | Path, dtype: torch.dtype = torch.bfloat16,
         device: Any = "cpu") -> tuple[Glm53Spec, dict[str, torch.Tensor], dict]:
    """(spec, tensors by Hugging Face name, config) of a GLM-5.3 model directory (CheckpointError naming the
    file or tensor); FP8 block-scaled weights come dequantised to ``dtype``."""
    d = Path(directory)
    cfg = read_config(d)
    if cfg is None:
        raise CheckpointError(f"{d}: no config.json: point at a Hugging Face model directory")
    spec = spec_from_config(cfg, where=str(d / "config.json"))
    expected, files = expected_tensors(spec), tensor_files(d)
    last = f"model.layers.{spec.num_layers + spec.mtp.num_layers - 1}."
    want = dict(expected)
    want.update({last + n: ((spec.vocab_size, spec.hidden_size), "act")
                 for n in MTP_OPTIONAL if spec.mtp.num_layers and last + n in files})
    fp8 = {n: n + "_scale_inv" for n in want if n + "_scale_inv" in files}
    for n, s in fp8.items():
        shape = want[n][0]
        want[s] = (tuple(math.ceil(x / BLOCK) for x in shape), "keep")
        want[n] = (shape, "keep")
    got = load_checkpoint(d, want, dtype, device="cpu").tensors
    for n, s in fp8.items():
        if got[n].dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{files[n]}: tensor {n} has dtype {got[n].dtype} next to {s}: a block-scaled "
                                  "weight must be float8_e4m3fn")
        kind = expected.get(n, ("", "act"))[1]
        got[n] = codecs.fp8_block_dequantize(got[n], got.pop(s), (BLOCK, BLOCK), name=n).to(
            torch.float32 if kind == "float32" else dtype)
    return spec, {n: t.to(device) for n, t in got.items()}, cfg


def random_weights(spec: Glm53Spec, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                   device: Any = "cpu") -> dict[str, torch.Tensor]:
    """Random tensors by Hugging Face name (``runtime.random_weights``: gains ~1 + small noise, projections
    1/sqrt(fan-in), biases small), the MTP layers' included."""
    named = rw.random_weights(composed(spec), tensor_name, seed=seed, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(seed + 1)
    for n, (shape, kind) in mtp_tensors(spec).items():
        leaf = n.rsplit(".", 2)[-2] if n.endswith(".weight") else n.rsplit(".", 1)[-1]
        init = "norm" if leaf.endswith("norm") else "bias" if leaf.endswith("bias") else "linear"
        dt = torch.float32 if kind == "float32" and dtype in (torch.bfloat16, torch.float16) else dtype
        named[n] = rw.draw(init, shape, g).to(device=device, dtype=dt)
    return named


def save(directory: str | Path, spec: Glm53Spec, named: dict[str, torch.Tensor], dtype: str = "bfloat16",
         quantize: Callable[[str], bool] | None = None) -> list[Path]:
    """Write ``config.json`` + safetensors: 'act' tensors in ``dtype``, fp32 ones in fp32; ``quantize(name)``:
    store that 2-D weight FP8 block-scaled."""
    kinds, out = expected_tensors(spec), {}
    for n, t in named.items():
        if quantize is not None and quantize(n):
            out[n], out[n + "_scale_inv"] = codecs.fp8_block_quantize(t, (BLOCK, BLOCK), name=n)
            continue
        out[n] = t.to(rw.torch_dtype(dtype) if kinds.get(n, ((), "act"))[1] == "act" else torch.float32)
    return save_checkpoint(directory, out, config_from_spec(spec, dtype))


__all__ = ["composed", "expected_tensors", "load", "mtp_tensors", "stored_fp8",
           "random_weights", "save", "tensor_name"]
