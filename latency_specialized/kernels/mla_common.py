"""Host-side pieces every MLA decode implementation shares (contract: ``ops/attention/mla.py``).

The torch implementations of the ``attention.mla`` family (``ops/attention/mla.py``) and the Triton
kernel (``kernels/mla_decode_triton.py``, its unfused path and epilogue) check shapes, normalise the
raw latent, write the new latents and finish the output through these functions, so that every
implementation applies the contract's steps 0, 1 and 4 the same way (and checks the optional RoPE
arguments alike). They sit at the kernel layer so that a kernel can use them without importing the ops
layer.
"""

from __future__ import annotations

import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels.norm_reference import rmsnorm_reference


def latent_widths(q: torch.Tensor, kv_c: torch.Tensor, kv_cache: torch.Tensor, nope: int) -> tuple[int, int]:
    """(L, R): kv_lora and rope widths of a call, checked against the cache (every MLA implementation)."""
    L, R = kv_c.shape[-1], q.shape[-1] - nope
    if kv_cache.shape[-1] != L + R:
        raise ValueError(f"kv_cache width {kv_cache.shape[-1]} != kv_lora {L} + rope {R}")
    return L, R


def check_kv_norm(q: torch.Tensor, kv_c: torch.Tensor, kv_norm_weight: torch.Tensor) -> None:
    """Shape/dtype checks of the fused kv_a RMSNorm (every MLA implementation; host metadata only).

    The normed latent is rounded to ``kv_c``'s dtype by the reference and to the activation dtype by the
    kernels, so both must be q's; the weight is [L] in that dtype too (the model's kv_a_layernorm)."""
    L = kv_c.shape[-1]
    if kv_c.dtype != q.dtype:
        raise UserError(f"attention.mla: with kv_norm_weight the raw latent kv_c must be in q's dtype {q.dtype} "
                        f"(got {kv_c.dtype}): pass the kv_a projection's output slice as is")
    if kv_norm_weight.shape != (L,):
        raise UserError(f"attention.mla: kv_norm_weight has shape {tuple(kv_norm_weight.shape)}, needs [{L}] "
                        f"(kv_lora, the width of kv_c): pass the layer's kv_a_layernorm weight")
    if kv_norm_weight.dtype != q.dtype:
        raise UserError(f"attention.mla: kv_norm_weight dtype {kv_norm_weight.dtype} != q dtype {q.dtype}: "
                        f"cast the kv_a_layernorm weight to the activation dtype once, at load")
    if kv_norm_weight.device != kv_c.device:
        raise UserError(f"attention.mla: kv_norm_weight is on {kv_norm_weight.device}, kv_c on {kv_c.device}: "
                        "move the weight with the model")


def normed_latent(q: torch.Tensor, kv_c: torch.Tensor, kv_norm_weight: torch.Tensor | None,
                  kv_norm_eps: float) -> torch.Tensor:
    """``kv_c`` itself without a norm weight, else its RMSNorm by the norm family's reference (the
    contract's step 0: a torch composition of the fused norm, shared by the torch implementations)."""
    if kv_norm_weight is None:
        return kv_c
    check_kv_norm(q, kv_c, kv_norm_weight)
    return rmsnorm_reference(kv_c, kv_norm_weight, kv_norm_eps)


def check_rope(q: torch.Tensor, k_pe: torch.Tensor, nope: int, positions: torch.Tensor | None,
               rope_inv_freq: torch.Tensor | None) -> bool:
    """Whether a call rotates (``positions`` given), after the shape/dtype checks of the RoPE arguments
    (every MLA implementation; host metadata only, no sync). The rotation covers the whole rope part: q's
    last ``R`` channels per head and ``k_pe``, so ``rope_inv_freq`` has ``R / 2`` entries."""
    if positions is None and rope_inv_freq is None:
        return False
    if positions is None or rope_inv_freq is None:
        raise UserError("attention.mla: RoPE needs both positions [B] and rope_inv_freq [rope / 2] "
                        "(or neither, for NoPE MLA)")
    B, R = q.shape[0], q.shape[-1] - nope
    if positions.shape != (B,) or positions.is_floating_point() or positions.is_complex():
        raise UserError(f"attention.mla: positions {tuple(positions.shape)} {positions.dtype}; needs [{B}] int "
                        "(one token position per row, as the step's positions)")
    if rope_inv_freq.shape != (R // 2,) or 2 * rope_inv_freq.shape[0] != R or rope_inv_freq.dtype != torch.float32:
        raise UserError(f"attention.mla: rope_inv_freq {tuple(rope_inv_freq.shape)} {rope_inv_freq.dtype}; needs "
                        f"[{R // 2}] float32 (rope {R} / 2: the whole rope part rotates), e.g. ops.rope.rope_inv_freq")
    if k_pe.shape[-1] != R:
        raise ValueError(f"k_pe width {k_pe.shape[-1]} != rope {R}")
    for name, t in (("positions", positions), ("rope_inv_freq", rope_inv_freq)):
        if t.device != q.device:
            raise UserError(f"attention.mla: {name} is on {t.device}, q on {q.device}: pass the step's tensors")
    return True


def rotate_pairs(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``x [B, heads, 2 len(inv_freq)]`` rotated at ``positions [B]``: the torch paths below the op layer
    (the Triton MLA's unfused path). The same operations in the same order as ``ops.rope.apply_rope`` over
    a whole-width rope part (fp32 math, one rounding to x's dtype; a CPU test checks the two bit for bit),
    which the ops layer's implementations call directly."""
    half = inv_freq.shape[0]
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq.float().unsqueeze(0)   # [B, half]
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def finish_output(o: torch.Tensor, gate: torch.Tensor | None, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """Output gate, the one rounding, optional destination (step 4 of the contract)."""
    if gate is not None:
        o = o * torch.sigmoid(gate.float())
    y = o.to(dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


def write_new_latents(flat: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``flat[slot_mapping[b]] = new[b]`` for slots >= 0, without a host sync.

    Boolean-mask indexing would read the mask on the host. Instead every padding row (slot < 0) is
    pointed at the first live row's slot *with that row's value*: duplicate indices of one
    ``index_put_`` then carry identical values, so the result is deterministic. With no live row
    at all, every row rewrites slot 0 with its current value (a no-op)."""
    slots = slot_mapping.long()
    live = slots >= 0
    # first live row (0 if none); index_select, not t[first]: a 0-d tensor index reads it on the host
    first = torch.argmax(live.to(torch.int32)).view(1)
    any_live = live.any()
    target = torch.where(live, slots, slots.index_select(0, first).clamp(min=0))
    filler = torch.where(any_live, new.index_select(0, first)[0], flat[0])          # [L + R]
    flat.index_put_((target,), torch.where(live.unsqueeze(-1), new, filler))
