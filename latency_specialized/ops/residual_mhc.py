"""residual.mhc: one seam of manifold-constrained hyper-connections (mHC) with a carried pre-mix.

The residual is ``n`` parallel streams ``R [M, n, H]``. Every sublayer ``s`` (attention, FFN) has a
mixing projection ``fn_s [(2 + n) n, n H]`` (fp32), a bias ``base_s [(2 + n) n]`` and three scales
``scale_s [3]``. One call is the *seam* in front of a sublayer (or, without ``fn``, at the end of the
model)::

    x, next_pre, post, comb = mhc_seam(streams, fn, scale, base, norm_weight, norm_eps,
                                       pre=..., y=..., post=..., comb=...)

1. **post** (with ``y``, the previous sublayer's output summed over ranks, and that sublayer's
   ``post [M, n]`` / ``comb [M, n, n]``): ``R'_j = sum_i comb[i, j] R_i + post_j * y`` for every
   stream ``j`` (fp32, one rounding to the streams' dtype), written into ``streams`` in place;
2. **coefficients** (with ``fn``) from the updated streams, flattened ``r = R'.view(M, n H)`` (fp32):
   ``mix = (r @ fn^T) * rsqrt(mean(r^2) + rms_eps)``;
   ``pre = sigmoid(mix[:n] scale[0] + base[:n]) + hc_eps``;
   ``post = post_mult * sigmoid(mix[n:2n] scale[1] + base[n:2n])``;
   ``comb = Sinkhorn(mix[2n:].view(n, n) scale[2] + base[2n:])``: a row softmax ``+ hc_eps``, one column
   normalisation ``c / (sum_rows c + hc_eps)``, then ``sinkhorn_iters - 1`` rounds of row then column
   normalisation (the same ``+ hc_eps`` in each denominator): a doubly stochastic mixing matrix;
3. **collapse** with the *carried* pre-mix ``pre`` - the coefficients the previous seam computed
   (None: stream 0, the model's first seam, where every stream still holds the embedding):
   ``h = sum_i pre_i R'_i`` (fp32, rounded to the streams' dtype);
4. **norm**: ``x = rmsnorm(h, norm_weight, norm_eps)`` (the ``norm`` family's reference rounding).

Returns ``(x [M, H], next_pre [M, n], post [M, n], comb [M, n, n])`` (the coefficients fp32); without
``fn`` (the model's last seam) only the post, the collapse with the carried ``pre`` and the final norm
run and the three coefficients are None.

This is the "delayed" form vLLM 0.33 serves for its mHC model (``kernels/mhc/torch.py``:
``mhc_pre_delayed_torch`` and ``mhc_post_torch``): a sublayer's input is collapsed with the pre-mix
of the seam before it, and the final hidden state with the last FFN seam's pre-mix (no learned head).
The reference is a torch composition without host syncs (graph-capturable). On CUDA GPUs
``residual.mhc.triton`` (``kernels/mhc_triton.py``) runs the whole seam in one launch.
"""

from __future__ import annotations

import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels.mhc_triton import IMPLEMENTATIONS as _TRITON
from latency_specialized.ops.norm import rmsnorm_reference
from latency_specialized.ops.registry import Implementation, always

__all__ = ["IMPLEMENTATIONS", "mhc_seam_reference", "mhc_mix_width", "sinkhorn"]


def mhc_mix_width(streams: int) -> int:
    """Rows of a seam's mixing projection: ``n`` pre, ``n`` post and ``n * n`` comb logits."""
    return (2 + streams) * streams


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``[..., n, n]`` logits -> the (nearly) doubly stochastic matrix of step 2 (fp32)."""
    if iters < 1:
        raise UserError(f"residual.mhc: sinkhorn_iters={iters}; use at least 1")
    c = torch.softmax(logits.float(), dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def _check(streams: torch.Tensor, fn: torch.Tensor | None, scale: torch.Tensor | None, base: torch.Tensor | None,
           pre: torch.Tensor | None, y: torch.Tensor | None, post: torch.Tensor | None,
           comb: torch.Tensor | None) -> None:
    if streams.dim() != 3:
        raise UserError(f"residual.mhc: streams must be [M, n, H], got {tuple(streams.shape)}")
    M, n, H = streams.shape
    if fn is not None:
        if scale is None or base is None:
            raise UserError("residual.mhc: a seam with fn needs its scale [3] and base too")
        if tuple(fn.shape) != (mhc_mix_width(n), n * H):
            raise UserError(f"residual.mhc: fn has shape {tuple(fn.shape)}, {n} streams of {H} need "
                            f"[{mhc_mix_width(n)}, {n * H}]")
        if tuple(scale.shape) != (3,) or tuple(base.shape) != (mhc_mix_width(n),):
            raise UserError(f"residual.mhc: scale {tuple(scale.shape)} / base {tuple(base.shape)}: need [3] / "
                            f"[{mhc_mix_width(n)}]")
    if pre is not None and tuple(pre.shape) != (M, n):
        raise UserError(f"residual.mhc: carried pre-mix has shape {tuple(pre.shape)}, need [{M}, {n}]")
    if y is not None:
        if tuple(y.shape) != (M, H):
            raise UserError(f"residual.mhc: sublayer output has shape {tuple(y.shape)}, need [{M}, {H}]")
        if post is None or comb is None or tuple(post.shape) != (M, n) or tuple(comb.shape) != (M, n, n):
            raise UserError("residual.mhc: a seam after a sublayer needs that sublayer's post [M, n] and comb "
                            "[M, n, n] (returned by the seam in front of it)")


def mhc_seam_reference(streams: torch.Tensor, fn: torch.Tensor | None, scale: torch.Tensor | None,
                       base: torch.Tensor | None, norm_weight: torch.Tensor | None, norm_eps: float, *,
                       pre: torch.Tensor | None = None, y: torch.Tensor | None = None,
                       post: torch.Tensor | None = None, comb: torch.Tensor | None = None,
                       rms_eps: float = 1e-6, hc_eps: float = 1e-6, post_mult: float = 2.0,
                       sinkhorn_iters: int = 20, out: torch.Tensor | None = None):
    """One mHC seam (see the module docstring for the four steps).

    Parameters
    ----------
    streams : [M, n, H] residual streams (activation dtype), updated in place by the post (step 1).
    fn : [(2 + n) n, n H] fp32 mixing projection of the sublayer behind the seam, or None (last seam).
    scale : [3] fp32; base : [(2 + n) n] fp32 (None with ``fn`` None).
    norm_weight : [H] RMSNorm gain of the collapsed input (None: weightless); norm_eps its epsilon.
    pre : [M, n] fp32 carried pre-mix (None: stream 0).
    y : [M, H] output of the sublayer in front of the seam (summed over ranks), or None (first seam);
        post : [M, n], comb : [M, n, n] that sublayer's coefficients (from the seam in front of it).
    out : optional [M, H] destination of ``x``.

    Returns
    -------
    (x [M, H] in streams.dtype, next_pre, post, comb) - the coefficients fp32, None without ``fn``.
    """
    _check(streams, fn, scale, base, pre, y, post, comb)
    M, n, H = streams.shape
    if y is not None:
        assert post is not None and comb is not None
        mixed = torch.einsum("mij,mih->mjh", comb.float(), streams.float())           # sum_i comb[i, j] R_i
        streams.copy_((mixed + post.float().unsqueeze(-1) * y.float().unsqueeze(1)).to(streams.dtype))
    next_pre = new_post = new_comb = None
    if fn is not None:
        assert scale is not None and base is not None
        r = streams.reshape(M, n * H).float()
        mix = (r @ fn.float().t()) * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + rms_eps)
        sc, bs = scale.float(), base.float()
        next_pre = torch.sigmoid(mix[:, :n] * sc[0] + bs[:n]) + hc_eps
        new_post = torch.sigmoid(mix[:, n:2 * n] * sc[1] + bs[n:2 * n]) * post_mult
        new_comb = sinkhorn(mix[:, 2 * n:].view(M, n, n) * sc[2] + bs[2 * n:].view(1, n, n), sinkhorn_iters, hc_eps)
    if pre is None:
        h = streams[:, 0]
    else:
        h = (pre.float().unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)
    x = rmsnorm_reference(h, norm_weight, norm_eps, out=out)
    return x, next_pre, new_post, new_comb


IMPLEMENTATIONS = [
    Implementation("residual.mhc", "residual.mhc.reference", mhc_seam_reference, always, priority=-100,
                   is_reference=True, description="torch mHC seam: post, Sinkhorn coefficients, carried-pre collapse, "
                                                  "RMSNorm (fp32, no host sync)"),
    *_TRITON,   # residual.mhc.triton (kernels/mhc_triton.py): the seam in one launch on CUDA GPUs
]
