"""Quantized weights by checkpoint tensor name: which tensors a format stores for ``<base>.weight``, their
shapes and dtypes, reading them into a :class:`QuantizedWeight` (checked; kept quantized, on any device),
and the whole-dict helpers loaders and writers use::

    stored = stored_tensors("model.layers.0.mlp.experts.3.down_proj.weight", (H, I), "nvfp4")
    #  {'...down_proj.weight': ((H, I/2), torch.uint8), '...down_proj.weight_scale': ((H, I/16), float8_e4m3fn),
    #   '...down_proj.weight_scale_2': ((), float32), '...down_proj.input_scale': ((), float32)}
    out = quantize_named(named, "nvfp4", select=is_expert)         # for save_checkpoint
    qw = quantized_from_named(tensors, name, "nvfp4", shape)       # keep it quantized (qw.to("cuda"))
    w = dequantize_named(tensors, "nvfp4", shapes)[name]           # the fp32 reference

Every problem with stored tensors is a CheckpointError naming the tensor: a missing companion, a wrong
shape or dtype, a NaN scale.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping

import torch

from latency_specialized.errors import CheckpointError, UserError
from latency_specialized.quant import codecs
from latency_specialized.quant.formats import FORMATS, QuantFormat, Role

WEIGHT = ".weight"

_ACCEPTED: dict[torch.dtype, tuple[torch.dtype, ...]] = {
    torch.uint8: (torch.uint8, torch.int8, torch.float4_e2m1fn_x2),
    torch.float4_e2m1fn_x2: (torch.uint8, torch.int8, torch.float4_e2m1fn_x2),
    torch.float8_e8m0fnu: (torch.uint8, torch.float8_e8m0fnu),
    torch.float8_e4m3fn: (torch.float8_e4m3fn,),
    torch.float32: (torch.float32,),
}
"""Stored dtype a format writes -> the dtypes a loader accepts for it (the same bytes under another name:
vLLM views float8_e8m0fnu scales as uint8 and packed FP4 as float4_e2m1fn_x2)."""


FUSED_PAIR = "gate_up_proj"
"""transformers' fused gate|up expert parameter (``experts.gate_up_proj [E, 2I, K]``): ModelOpt stores its
per-tensor scales once per half (``[E, 2]``: vLLM 0.33 ``models/muse_spark/common/moe.py``)."""


def tensor_names(weight_name: str, fmt: QuantFormat | str) -> dict[Role, str]:
    """Role -> checkpoint tensor name of ``<base>.weight`` stored as ``fmt``; of a fused parameter without
    ``.weight`` (transformers' ``experts.gate_up_proj`` / ``down_proj``), ModelOpt's ``<name>`` + ``<name>_<suffix>``
    (vLLM 0.33 ``models/muse_spark/common/omni.py``) for formats whose codes are named ``weight``."""
    f = QuantFormat.get(fmt)
    if weight_name.endswith(WEIGHT):
        base = weight_name[: -len(WEIGHT)]
        return {role: f"{base}.{suffix}" for role, suffix in f.suffixes}
    if dict(f.suffixes).get("weight") != "weight":
        raise ValueError(f"{weight_name!r}: no known tensor names for a fused parameter stored as {f.name}; "
                         "quantized tensors are named after a '<base>.weight'")
    return {role: weight_name if role == "weight" else f"{weight_name}_{suffix}" for role, suffix in f.suffixes}


def mxfp4_names(name: str) -> tuple[str, str] | None:
    """(packed, scale) tensor names of an MXFP4-stored (compressed-tensors) ``<base>.weight``; None for other
    names (the helper ``runtime.checkpoint`` has always exported)."""
    if not name.endswith(WEIGHT):
        return None
    n = tensor_names(name, "mxfp4")
    return n["weight"], n["scale"]


def stored_tensors(weight_name: str, shape: tuple[int, ...],
                   fmt: QuantFormat | str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Checkpoint name -> (shape, dtype as written) of the tensors storing ``weight_name [..., N, K]``."""
    f = QuantFormat.get(fmt)
    shapes, names = f.stored_shapes(tuple(shape)), tensor_names(weight_name, f)
    dtypes: dict[Role, torch.dtype] = {"weight": f.weight_dtype, "scale": f.scale_dtype,
                                       "global_scale": torch.float32, "input_scale": torch.float32}
    return {names[r]: (shapes[r], dtypes[r]) for r in names}


def stored_format(weight_name: str, available: Iterable[str] | Mapping[str, object],
                  formats: Iterable[QuantFormat | str] | None = None) -> QuantFormat | None:
    """The format (of ``formats``, default all) in which ``available`` (the checkpoint's names, or a mapping
    name -> tensor) stores ``weight_name``: every tensor the format needs is present, and - where tensors are
    given - the stored weight's dtype is one the format accepts (that is what separates ``mxfp4-deepseek``
    from ``fp8-block-32``, which share their names). None where the weight is stored unquantized; the first
    match in ``formats`` order wins."""
    have = available if isinstance(available, (set, frozenset, Mapping)) else set(available)
    for cand in (formats if formats is not None else FORMATS.values()):
        f = QuantFormat.get(cand)
        try:
            names = tensor_names(weight_name, f)
        except ValueError:  # a fused parameter this format has no names for
            continue
        if not all(n in have for r, n in names.items() if r != "input_scale"):
            continue
        stored = have[names["weight"]] if isinstance(have, Mapping) else None
        if stored is not None and getattr(stored, "dtype", None) is not None \
                and stored.dtype not in _ACCEPTED.get(f.weight_dtype, ()):  # type: ignore[attr-defined]
            continue
        return f
    return None


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight in its stored form: the tensors exactly as the checkpoint holds them, and its format.

    ``to(device)`` moves it without dequantising (kernels read ``weight`` / ``scale`` / ``global_scale``);
    ``dequantize()`` is the fp32 reference."""

    fmt: QuantFormat
    shape: tuple[int, ...]
    """Logical ``[..., N, K]``."""
    weight: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    name: str = "weight"
    """The ``<base>.weight`` it stores (for messages)."""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = codecs.dequantize(self.fmt, self.weight, self.scale, self.global_scale, name=self.name)
        return w if dtype == torch.float32 else w.to(dtype)

    def experts(self, index: torch.Tensor | int) -> "QuantizedWeight":
        """The experts ``index`` selects along the leading dimension of an ``[E, N, K]`` weight, as a compact copy
        of their stored tensors (an int: that one expert, the dimension kept as 1): what a reference dequantises
        when it must not hold every expert's fp32 copy at once (a rank's whole MoE, dequantised, is gigabytes)."""
        if len(self.shape) < 3:
            raise UserError(f"{self.name}: experts() needs an [E, N, K] weight, got the shape {self.shape}")
        E = self.shape[0]
        idx = torch.tensor([index]) if isinstance(index, int) else index
        idx = idx.to(self.weight.device)

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            # per-expert tensors lead with E; a per-tensor (0-d) scale is shared by every expert
            if t is None or t.dim() == 0 or t.shape[0] != E:
                return t
            return t.view(torch.uint8)[idx].view(t.dtype) if t.element_size() == 1 else t[idx]

        return replace(self, shape=(int(idx.numel()), *self.shape[1:]), weight=pick(self.weight),
                       scale=pick(self.scale), global_scale=pick(self.global_scale),
                       input_scale=pick(self.input_scale))

    def contiguous(self) -> "QuantizedWeight":
        """Itself with every stored tensor contiguous (what a piece's ``arrange`` asks of any weight), the bytes as
        stored (copied through a uint8 view: torch has no copy kernel for some stored dtypes, e.g. float4)."""
        def c(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.is_contiguous():
                return t
            return t.view(torch.uint8).contiguous().view(t.dtype) if t.element_size() == 1 else t.contiguous()

        return replace(self, weight=c(self.weight), scale=c(self.scale), global_scale=c(self.global_scale),
                       input_scale=c(self.input_scale))

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        move = {k: getattr(self, k).to(device) for k in ("weight", "scale", "global_scale", "input_scale")
                if getattr(self, k) is not None}
        return replace(self, **move)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint name -> tensor (what :func:`quantize_named` writes for it; a fused gate|up parameter's
        per-tensor scales once per half, as ModelOpt: :data:`FUSED_PAIR`)."""
        names = tensor_names(self.name, self.fmt)
        got = {"weight": self.weight, "scale": self.scale, "global_scale": self.global_scale,
               "input_scale": self.input_scale}
        if self.name.endswith(FUSED_PAIR):
            got.update({r: torch.stack([got[r], got[r]], -1) for r in ("global_scale", "input_scale")
                        if got[r] is not None})
        return {names[r]: got[r] for r in names if got[r] is not None}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def quantize_weight(weight_name: str, w: torch.Tensor, fmt: QuantFormat | str, *,
                    input_amax: float = 8.0) -> QuantizedWeight:
    """``w [..., N, K]`` stored as ``fmt``. NVFP4's ``input_scale`` (ModelOpt: calibrated activation amax /
    2688) is ``input_amax / 2688`` - a random checkpoint has no calibration; 8 covers the activations of the
    tiny models (an activation block's e4m3 scale then stays above e4m3's subnormals down to amax ~0.005)."""
    f = QuantFormat.get(fmt)
    parts = codecs.quantize(f, w.detach(), name=weight_name)
    inp = None
    if f.input_scale:
        inp = torch.full(tuple(w.shape[:-2]), input_amax / (codecs.E2M1_MAX * codecs.E4M3_MAX), dtype=torch.float32)
    return QuantizedWeight(f, tuple(w.shape), parts["weight"], parts["scale"], parts.get("global_scale"), inp,
                           weight_name)


def quantize_named(named: Mapping[str, torch.Tensor], fmt: QuantFormat | str,
                   select: Callable[[str], bool] | None = None, *, input_amax: float = 8.0) -> dict[str, torch.Tensor]:
    """``named`` with every selected ``*.weight`` (default: every ``*.weight`` of 2+ dims) replaced by the
    tensors ``fmt`` stores for it, in the official names and dtypes; everything else passed through."""
    f = QuantFormat.get(fmt)
    out: dict[str, torch.Tensor] = {}
    for n, t in named.items():
        pick = select(n) if select is not None else (n.endswith(WEIGHT) and t.dim() >= 2)
        if not pick:
            out[n] = t
            continue
        out.update(quantize_weight(n, t.detach().to("cpu"), f, input_amax=input_amax).tensors())
    return out


def _check(f: QuantFormat, role: Role, name: str, t: torch.Tensor, want: tuple[int, ...]) -> None:
    ok = _ACCEPTED.get({"weight": f.weight_dtype, "scale": f.scale_dtype}.get(role, torch.float32), ())
    if t.dtype not in ok:
        raise CheckpointError(f"tensor {name} has dtype {t.dtype}: a {f.name} {role.replace('_', ' ')} is stored as "
                              f"{' / '.join(str(d).replace('torch.', '') for d in ok)}")
    if tuple(t.shape) != tuple(want) and not (role in ("global_scale", "input_scale") and want == ()
                                               and t.numel() == 1):
        raise CheckpointError(f"tensor {name} has shape {list(t.shape)}, expected {list(want)} ({f.name}, "
                              f"block {f.block[0]}x{f.block[1]}): the checkpoint was written for another config "
                              "or block size")


def _logical_shape(f: QuantFormat, weight_name: str, stored: torch.Tensor) -> tuple[int, ...]:
    if stored.dim() < 2:
        raise CheckpointError(f"tensor {weight_name}: a {f.name} weight is a matrix [..., N, K], got shape "
                              f"{list(stored.shape)}")
    s = tuple(stored.shape)
    return (*s[:-1], s[-1] * 2) if f.packed else s


def _one_per_tensor(named: Mapping[str, torch.Tensor], names: Mapping[Role, str],
                    want: Mapping[Role, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """A fused gate|up parameter's per-half scales ``[..., 2]`` (:data:`FUSED_PAIR`) as one per tensor: the global
    scale where both halves share it (the kernels take one multiplier per expert; vLLM keeps the gate's and warns),
    a CheckpointError otherwise; the input scale (kept, not used to dequantise) as their maximum, as vLLM."""
    out: dict[str, torch.Tensor] = {}
    for role in ("global_scale", "input_scale"):
        n = names.get(role)  # type: ignore[call-overload]
        t = named.get(n) if n is not None else None
        if t is None or tuple(t.shape) != (*want[role], 2):  # type: ignore[index]
            continue
        if role == "global_scale" and not torch.equal(t[..., 0], t[..., 1]):
            raise CheckpointError(f"tensor {n}: the gate and up halves have different global scales; the kernels take "
                                  "one per expert (vLLM uses the gate's and warns): re-export with a shared global scale "
                                  "or load without --experts (dequantised at load, exact)")
        out[n] = t[..., 0].contiguous() if role == "global_scale" else t.amax(-1)
    return out


def quantized_from_named(named: Mapping[str, torch.Tensor], weight_name: str, fmt: QuantFormat | str,
                         shape: tuple[int, ...] | None = None) -> QuantizedWeight:
    """The stored tensors of ``weight_name`` in ``named`` (checkpoint names), checked against ``fmt`` and the
    logical ``shape`` (default: implied by the stored weight). Scales are decoded once here, so a NaN ue8m0 /
    e4m3 / fp32 scale fails at load, naming its tensor."""
    f = QuantFormat.get(fmt)
    names = tensor_names(weight_name, f)
    missing = [n for r, n in names.items() if n not in named and r != "input_scale"]
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]}: a {f.name} weight {weight_name} needs "
                              f"{', '.join(n for r, n in names.items() if r != 'input_scale')}; write the checkpoint "
                              "again")
    w = named[names["weight"]]
    logical = tuple(shape) if shape is not None else _logical_shape(f, names["weight"], w)
    try:
        want = f.stored_shapes(logical)
    except Exception as e:  # noqa: BLE001 - a shape this format cannot store: name the tensor
        raise CheckpointError(f"tensor {weight_name}: {e}") from None
    named = {**named, **_one_per_tensor(named, names, want)}
    for role, n in names.items():
        if n in named:
            _check(f, role, n, named[n], want[role])
    g = named.get(names["global_scale"]) if "global_scale" in names else None
    inp = named.get(names["input_scale"]) if "input_scale" in names else None
    if g is not None and g.dim() != len(want["global_scale"]):
        g = g.reshape(want["global_scale"])
    scale = named[names["scale"]]
    # validate every scale now (load time), not at first use
    if f.scale == "ue8m0":
        codecs.ue8m0_decode(scale, names["scale"])
    elif f.scale == "e4m3":
        codecs.e4m3_decode(scale, names["scale"])
    else:
        codecs.fp32_scale_decode(scale, names["scale"])
    if g is not None:
        codecs.fp32_scale_decode(g, names["global_scale"])
    return QuantizedWeight(f, logical, w, scale, g, inp, weight_name)


def dequantize_stored(named: Mapping[str, torch.Tensor], weight_name: str, fmt: QuantFormat | str,
                      shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The fp32 values of ``weight_name`` stored as ``fmt`` in ``named`` (checked as :func:`quantized_from_named`);
    a fused gate|up parameter whose halves have their own global scales (:data:`FUSED_PAIR`) half by half (exact)."""
    f = QuantFormat.get(fmt)
    names = tensor_names(weight_name, f)
    g = named.get(names["global_scale"]) if "global_scale" in names else None
    if weight_name.endswith(FUSED_PAIR) and g is not None and g.shape[-1:] == (2,) \
            and not torch.equal(g[..., 0], g[..., 1]):
        q = quantized_from_named({**named, names["global_scale"]: g[..., 0]}, weight_name, f, shape)
        half = q.shape[-2] // 2
        return torch.cat([codecs.dequantize(f, q.weight[..., rows, :], q.scale[..., rows, :], g[..., i], name=q.name)
                          for i, rows in ((0, slice(0, half)), (1, slice(half, None)))], -2)
    return quantized_from_named(named, weight_name, f, shape).dequantize()


def _stored_bases(named: Mapping[str, torch.Tensor], f: QuantFormat) -> list[str]:
    """The ``<base>.weight`` names ``named`` stores in ``f`` (those whose scale tensor is present)."""
    scale_suffix = "." + (f.suffix("scale") or "")
    return [n[: -len(scale_suffix)] + WEIGHT for n in named if n.endswith(scale_suffix)]


def keep_quantized(named: Mapping[str, torch.Tensor], fmt: QuantFormat | str,
                   shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, "torch.Tensor | QuantizedWeight"]:
    """``named`` with every ``fmt``-stored weight replaced by one :class:`QuantizedWeight` under its
    ``<base>.weight`` name (checked, scales validated; nothing dequantised); its stored companions removed,
    everything else passed through. The kept-quantized counterpart of :func:`dequantize_named`."""
    f = QuantFormat.get(fmt)
    out: dict[str, torch.Tensor | QuantizedWeight] = dict(named)
    for wn in _stored_bases(named, f):
        qw = quantized_from_named(named, wn, f, (shapes or {}).get(wn))
        for n in tensor_names(wn, f).values():
            out.pop(n, None)
        out[wn] = qw
    return out


def quantized_pair(named: Mapping[str, torch.Tensor], fmt: QuantFormat | str, select: Callable[[str], bool], *,
                   dtype: torch.dtype, device: torch.device | str = "cpu"
                   ) -> tuple[dict[str, torch.Tensor], dict[str, "torch.Tensor | QuantizedWeight"]]:
    """The selected ``*.weight`` tensors of ``named`` quantized to ``fmt`` once, as two views of the same values:
    (for a reference: every weight in ``dtype`` with the selected ones dequantised - exactly what the codes
    hold; for a program: the same dict with the selected ones kept as :class:`QuantizedWeight`), both on
    ``device``. Random-weight models use it so that program and reference see identical weights."""
    f = QuantFormat.get(fmt)
    picked = {n: t for n, t in named.items() if select(n)}
    stored = quantize_named(picked, f, select=lambda n: True)
    deq = dequantize_named(stored, f, dtype=torch.float32)
    ref = {n: (deq[n].to(dtype=dtype, device=device) if n in picked else t) for n, t in named.items()}
    kept = {n: (v.to(device) if isinstance(v, QuantizedWeight) else v)
            for n, v in keep_quantized(stored, f).items()}
    return ref, {**ref, **kept}


def dequantize_named(named: Mapping[str, torch.Tensor], fmt: QuantFormat | str,
                     shapes: Mapping[str, tuple[int, ...]] | None = None,
                     dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """``named`` (checkpoint names) with every ``fmt``-stored weight - a ``<base>.weight`` whose scale tensor
    is present - replaced by its dequantised ``<base>.weight`` in ``dtype``; its stored companions removed,
    everything else passed through. ``shapes``: logical shapes to check against (by weight name)."""
    f = QuantFormat.get(fmt)
    out = dict(named)
    for wn in _stored_bases(named, f):
        qw = quantized_from_named(named, wn, f, (shapes or {}).get(wn))
        for n in tensor_names(wn, f).values():
            out.pop(n, None)
        out[wn] = qw.dequantize(dtype)
    return out


__all__ = ["FUSED_PAIR", "tensor_names", "mxfp4_names", "stored_tensors", "stored_format", "QuantizedWeight", "quantize_weight",
           "quantize_named", "quantized_from_named", "dequantize_stored", "keep_quantized", "quantized_pair", "dequantize_named"]
