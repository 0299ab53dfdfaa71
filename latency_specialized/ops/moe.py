"""moe: routing and routed experts for the decode regime.

``route`` turns router logits into top-k weights and expert ids (sigmoid, sqrtsoftplus or
softmax scores; bias-corrected selection; renormalise; scaling). ``experts`` runs only the
selected experts and combines them with the routing weights; with ``per_route=True`` it returns
each route's expert output instead ([M, top_k, N], unweighted), for models that normalise every
expert's output before the weighted sum (Muse Spark's per-expert post-norm): ``finalize`` then
applies that norm per route and the weighted fp32 sum over the routes. At TP > 1 each rank's
per-route rows are partial sums over its slice of the expert width: they are all-reduced *before*
``finalize`` (the norm of a sum is not the sum of norms). ``gate_down`` (latent MoE) computes
the router logits and the latent down-projection, which read the same hidden state, from one
concatenated weight: a kernel can then stream both weights in one launch.
"""

from __future__ import annotations

import torch

from latency_specialized.kernels.moe_addend import Addend, add_addend, check_addend_use
from latency_specialized.ops.activation import gated_activation
from latency_specialized.ops.registry import Implementation, always
from latency_specialized.quant.checkpoint_io import QuantizedWeight
from latency_specialized.spec import ActivationSpec, RouterSpec


def router_scores(logits: torch.Tensor, router: RouterSpec) -> torch.Tensor:
    """Per-expert scores [M, E] in fp32 from logits [M, E]."""
    z = logits.float() * router.logit_scale
    if router.score_func == "sigmoid":
        return torch.sigmoid(z)
    if router.score_func == "sqrtsoftplus":
        return torch.sqrt(torch.nn.functional.softplus(z))
    return torch.softmax(z, dim=-1)


def route_reference(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, router: RouterSpec):
    """Top-k routing.

    Parameters
    ----------
    logits : [M, E] router logits. bias : [E] selection bias (noaux_tc) or None.

    Returns
    -------
    weights [M, top_k] fp32 and ids [M, top_k] int64. Selection uses score + bias; weights use
    the unbiased score, renormalised (sum + eps) and scaled. Ties go to the lower expert id.
    """
    scores = router_scores(logits, router)
    sel = scores + bias.float() if (bias is not None and router.bias_corrected) else scores
    # Stable tie-break toward the lower id: sort descending with stable sort.
    ids = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = scores.gather(-1, ids)
    if router.renormalize:
        w = w / (w.sum(-1, keepdim=True) + router.renormalize_eps)
    return w * router.routed_scaling, ids


def _expert_fp32(w: torch.Tensor | QuantizedWeight, e: int) -> torch.Tensor:
    """Expert ``e`` of an ``[E, N, K]`` weight as fp32 ``[N, K]``; a stored (quantised) weight is dequantised one
    expert at a time, so the reference never holds every expert's fp32 copy."""
    if isinstance(w, QuantizedWeight):
        return w.experts(e).dequantize()[0]
    return w[e].float()


def experts_reference(x: torch.Tensor, weights: torch.Tensor | None, ids: torch.Tensor, w_gate_up: torch.Tensor,
                      w_down: torch.Tensor, activation: ActivationSpec, *, per_route: bool = False,
                      out: torch.Tensor | None = None, addend: Addend = None) -> torch.Tensor:
    """Routed experts over the selected experts only.

    Parameters
    ----------
    x : [M, K]; weights, ids : [M, top_k]; w_gate_up : [E, 2*I, K]; w_down : [E, N, I]. Either weight
        may be a ``quant.QuantizedWeight`` (4-bit experts kept as stored): it is dequantised here, exactly
        (e2m1 x a power of two or an e4m3 x fp32 product is what the kernels multiply by), one routed expert at a
        time.
    per_route : return every route's expert output instead of the combination (``weights`` is
        then ignored and may be None). out : optional destination of the result's shape.
    addend : [M, N] added to the combination (a plain MoE's shared experts), or a callable returning it (a side
        stream's join); ``kernels/moe_addend.py`` has the contract (rounding: ``round(round(routed) + addend)``).

    Returns
    -------
    ``per_route=False``: [M, N] in x.dtype: sum_j weights[m, j] * expert_{ids[m, j]}(x[m]),
    accumulated in fp32. ``per_route=True``: [M, top_k, N] in x.dtype, row (m, j) =
    expert_{ids[m, j]}(x[m]) (not multiplied by the routing weight), each rounded once to x.dtype
    as the combined form rounds it before weighting.
    """
    check_addend_use(addend, per_route, "moe.experts.reference")
    M = x.shape[0]
    top_k = ids.shape[1]
    inter = w_gate_up.shape[1] // 2
    N = w_down.shape[1]
    if per_route:
        y = torch.zeros(M, top_k, N, dtype=x.dtype, device=x.device)
    else:
        y = torch.zeros(M, N, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[rows].float()
        gu = (xe @ _expert_fp32(w_gate_up, e).t()).to(x.dtype).float()
        h = gated_activation(gu[:, :inter], gu[:, inter:], activation).to(x.dtype).float()
        ye = (h @ _expert_fp32(w_down, e).t()).to(x.dtype)
        if per_route:
            y[rows, slot] = ye
        else:
            y.index_add_(0, rows, ye.float() * weights[rows, slot].unsqueeze(-1).float())
    y = y.to(x.dtype)
    if not per_route:
        add_addend(y, addend, "moe.experts.reference")
    if out is not None:
        out.copy_(y)
        return out
    return y


def finalize_reference(y: torch.Tensor, weights: torch.Tensor, gain: torch.Tensor | None, eps: float, *,
                       gain_before_norm: bool = True, zero_centered: bool = True,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-route RMSNorm of the routed experts' outputs, then their weighted sum (``moe.finalize``).

    Parameters
    ----------
    y : [M, top_k, N] per-route expert outputs (``experts(..., per_route=True)``; at TP > 1 already
        all-reduced over the ranks: each route's full row). Unit stride in N; other strides free.
    weights : [M, top_k] routing weights (fp32; another dtype is read as fp32).
    gain : [N] norm gain shared by every route, or None (weightless norm).
    eps : the norm's epsilon (Muse Spark: 1e-8).
    gain_before_norm : True: "input-scaled" norm, ``z = round(r * g)`` to y.dtype, then
        ``z * rsqrt(mean(z^2) + eps)`` (Muse Spark, transformers ``MuseSparkTextInputScaledRMSNorm``);
        False: ``r * rsqrt(mean(r^2) + eps) * g``. Unused without a gain.
    zero_centered : the gain is stored zero-centred: ``g = 1 + gain`` (else ``g = gain``).
    out : optional [M, N] destination (rows may be strided).

    Returns
    -------
    [M, N] in y.dtype: sum_j weights[m, j] * norm(y[m, j]), everything after the (optional) input
    scaling in fp32, one rounding at the end.
    """
    if y.dim() != 3 or tuple(weights.shape) != tuple(y.shape[:2]):
        raise ValueError(f"moe.finalize: y {tuple(y.shape)} and weights {tuple(weights.shape)} must be "
                         "[M, top_k, N] and [M, top_k]")
    if gain is not None and tuple(gain.shape) != (y.shape[-1],):
        raise ValueError(f"moe.finalize: gain {tuple(gain.shape)} must be [{y.shape[-1]}]")
    r = y.float()
    g = None
    if gain is not None:
        g = 1.0 + gain.float() if zero_centered else gain.float()
        if gain_before_norm:
            r = (r * g).to(y.dtype).float()
    r = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    if g is not None and not gain_before_norm:
        r = r * g
    o = (r * weights.float().unsqueeze(-1)).sum(1).to(y.dtype)
    if out is not None:
        out.copy_(o)
        return out
    return o


def gate_down_reference(x: torch.Tensor, weight: torch.Tensor, n_gate: int, *, logits_out: torch.Tensor | None = None,
                        latent_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits and latent input of a latent MoE from one weight ``[W_gate; W_down]``.

    Parameters
    ----------
    x : [M, K] normed hidden state.
    weight : [n_gate + n_latent, K]: the router weight's rows (this rank's experts), then the latent
        down-projection's rows (this rank's latent channels).
    n_gate : router rows. logits_out / latent_out : optional destinations.

    Returns
    -------
    logits [M, n_gate] in fp32 (at least: vLLM's GateLinear, bf16 x bf16 -> fp32, no rounding) and
    latent [M, n_latent] in x.dtype (one rounding): exactly the two gemm sites' results.
    """
    from latency_specialized.ops.gemm import gemm_reference

    if not 0 < n_gate < weight.shape[0]:
        raise ValueError(f"gate_down: n_gate={n_gate} must be inside the {weight.shape[0]} weight rows")
    logits = gemm_reference(x, weight[:n_gate], out=logits_out, out_dtype=torch.promote_types(x.dtype, torch.float32))
    latent = gemm_reference(x, weight[n_gate:], out=latent_out)
    return logits, latent


IMPLEMENTATIONS = [
    Implementation("moe.gate_down", "moe.gate_down.reference", gate_down_reference, always, priority=-100,
                   is_reference=True, description="two fp32-accumulated matmuls over row slices of the weight"),
    Implementation("moe.router", "moe.router.reference", route_reference, always, priority=-100,
                   is_reference=True, description="torch scores + stable sort top-k"),
    Implementation("moe.experts", "moe.experts.reference", experts_reference, always, priority=-100,
                   is_reference=True, description="loop over the selected experts (host sync: not graphable)"),
    Implementation("moe.finalize", "moe.finalize.reference", finalize_reference, always, priority=-100,
                   is_reference=True, description="torch per-route RMSNorm (optional input/output gain) + fp32 weighted sum"),
]
