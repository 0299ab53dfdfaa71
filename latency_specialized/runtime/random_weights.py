"""Random weights of a composed model, from its pieces' ``WeightDecl``s (tests, demos, benches).

    named = random_weights(model, tensor_name, seed=0, dtype=torch.bfloat16)   # checkpoint name -> tensor
    rank = random_rank_weights(model, tp=8, device="cuda")                     # {layer: {role: {local}}}, rank 0

Scales keep activations O(1) through every layer, never zeros. How a weight is drawn (its *init*)
follows from its piece-local name (:func:`weight_init`):

* ``linear`` (everything else: projections, experts, AttnRes queries, conv taps, heads): N(0, 1/fan_in),
  fan_in = the last dimension of the full tensor;
* ``norm`` (a name ending in ``norm``): gains 1 + 0.1 N(0, 1);
* ``embed`` (the embedding's ``weight``): N(0, 1);
* ``a_log`` (``A_log``): log(A), A uniform in [0.5, 2] (with ``dt_bias`` the recurrent decays stay
  mostly in (-2, 0]: a state with a memory of tens of tokens);
* ``dt_bias``: -2 + 0.5 N(0, 1); ``bias`` (other names ending in ``bias``): 0.1 N(0, 1).

Storage: the activation dtype, or fp32 for weights declared ``float32`` when the activations are
bf16 / fp16 (the checkpoint's precision is kept). :func:`random_weights` draws on the CPU from one
seeded generator, tensor after tensor (deterministic in ``seed`` and in the draw order: an adapter
may give its checkpoint's order, ``order``), expert-stacked weights expert by expert under their
``'{e}'`` names. :func:`random_rank_weights` draws one rank's shard shapes directly on a device
(the full model's weights would not fit one GPU; same scales, not the same values), each expert
stack as one tensor.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch

from latency_specialized.errors import UserError
from latency_specialized.runtime.composed import ComposedModel, TensorName, is_expert_stacked, rank_shape
from latency_specialized.runtime.pieces_api import WeightDecl

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of an activation-dtype name ('bfloat16', 'float32', ...); UserError naming the choices."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise UserError(f"dtype {name!r} not supported: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def weight_init(role: str, local: str) -> str:
    """How the piece weight ``(role, local)`` is drawn (see the module docstring)."""
    leaf = local.rsplit(".", 1)[-1]
    if leaf.endswith("norm"):
        return "norm"
    if role == "embed":
        return "embed"
    special = {"A_log": "a_log", "dt_bias": "dt_bias"}.get(leaf)
    if special is not None:
        return special
    return "bias" if leaf.endswith("bias") else "linear"


def storage_dtype(decl: WeightDecl, dtype: torch.dtype) -> torch.dtype:
    """In-memory dtype of a declared weight for activation dtype ``dtype``."""
    return torch.float32 if decl.dtype == "float32" and dtype in (torch.bfloat16, torch.float16) else dtype


def draw(init: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """One fp32 CPU tensor of ``shape`` drawn by ``init`` from ``g``."""
    if init == "linear":
        return torch.randn(shape, generator=g) / shape[-1] ** 0.5
    if init == "norm":
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if init == "embed":
        return torch.randn(shape, generator=g)
    if init == "a_log":
        return torch.log(0.5 + 1.5 * torch.rand(shape, generator=g))
    if init == "dt_bias":
        return -2.0 + 0.5 * torch.randn(shape, generator=g)
    if init == "bias":
        return 0.1 * torch.randn(shape, generator=g)
    raise ValueError(f"unknown init {init!r}")


def named_decls(model: ComposedModel, tensor_name: TensorName) -> dict[str, tuple[tuple[int, ...], WeightDecl, str]]:
    """Checkpoint name -> (shape, declaration, init) of every required weight, in declaration order
    (experts unstacked where the name has ``'{e}'``; a name two weights share, a tied head, once)."""
    out: dict[str, tuple[tuple[int, ...], WeightDecl, str]] = {}
    for (layer, role, local), d in model.weight_decls(1).items():
        name = tensor_name(layer, role, local)
        if name is None or d.optional:
            continue
        init = weight_init(role, local)
        if is_expert_stacked(local) and "{e}" in name:
            for e in range(d.shape[0]):
                out.setdefault(name.format(e=e), (tuple(d.shape[1:]), d, init))
        else:
            out.setdefault(name, (tuple(d.shape), d, init))
    return out


def random_weights(model: ComposedModel, tensor_name: TensorName, *, seed: int = 0,
                   dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                   order: Callable[[str], Any] | None = None) -> dict[str, torch.Tensor]:
    """Random weights of ``model`` by checkpoint name, drawn on the CPU (see the module docstring);
    ``order``: sort key of the names, the draw order (default: the declarations')."""
    g = torch.Generator().manual_seed(seed)
    decls = named_decls(model, tensor_name)
    names = sorted(decls, key=order) if order is not None else list(decls)
    out = {}
    for name in names:
        shape, d, init = decls[name]
        out[name] = draw(init, shape, g).to(device=device, dtype=storage_dtype(d, dtype))
    return {name: out[name] for name in decls}


def random_rank_weights(model: ComposedModel, tp: int, *, device: torch.device | str, seed: int = 0,
                        dtype: torch.dtype = torch.bfloat16, rank: int = 0) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    """Random weights of one rank's shard shapes at ``tp`` (``rank_shape``), drawn on ``device``: the
    ``weights_sharded=True`` input of ``ComposedProgram`` (every rank's shapes are rank 0's)."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed + rank)

    def randn(shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=dev, dtype=torch.float32 if dt == torch.float64 else dt)

    tied = getattr(model.head, "tied", False)
    out: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for (layer, role, local), d in model.weight_decls(tp).items():
        if d.optional or (tied and role == "head" and local == "weight"):  # a tied head reads the embedding
            continue
        shape, dt, init = rank_shape(d, tp, f"layer {layer} {role}.{local}"), storage_dtype(d, dtype), weight_init(role, local)
        if init == "a_log":
            t = torch.log(0.5 + 1.5 * torch.rand(shape, generator=g, device=dev))
        else:
            scale, shift = {"linear": (d.shape[-1] ** -0.5, 0.0), "norm": (0.1, 1.0), "embed": (1.0, 0.0),
                            "dt_bias": (0.5, -2.0), "bias": (0.1, 0.0)}[init]
            t = randn(shape, dt)
            t = t * scale + shift if (scale != 1.0 or shift != 0.0) else t
        out.setdefault(layer, {}).setdefault(role, {})[local] = t.to(dt)
    return out


def quantize_routed_experts(weights: dict[int, dict[str, dict[str, Any]]], fmt: str, *, chunk: int = 64) -> int:
    """In place: every stacked routed-expert weight (local name ``experts.*``, ``[E, N, K]``) of ``weights`` (the
    nested ``{layer: {role: {local: tensor}}}`` of :func:`random_rank_weights`) replaced by a ``QuantizedWeight`` of
    ``fmt`` holding the same values rounded to the format, ``chunk`` experts at a time (the fp32 scratch of a whole
    Kimi K3 expert stack would be several GB). Returns how many tensors were quantized."""
    from latency_specialized.quant import layout
    from latency_specialized.quant.checkpoint_io import QuantizedWeight, quantize_weight

    done = 0
    for layer, roles in weights.items():
        for role, by in roles.items():
            for local, t in list(by.items()):
                if not local.startswith("experts.") or isinstance(t, QuantizedWeight):
                    continue
                name = f"layers.{layer}.{role}.{local}.weight"
                q = layout.cat([quantize_weight(name, t[i:i + chunk], fmt) for i in range(0, t.shape[0], chunk)], 0)
                if q.input_scale is not None:
                    q = replace(q, input_scale=q.input_scale.to(t.device))
                by[local] = q
                del t
                done += 1
    return done


__all__ = ["random_weights", "random_rank_weights", "quantize_routed_experts", "weight_init", "storage_dtype", "draw",
           "named_decls", "torch_dtype", "DTYPES"]
