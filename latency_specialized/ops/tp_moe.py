"""TP-split MoE routing and input projection: no rank duplicates compute or weight loads.

Stock TP replicates the router GEMM ([E, K] weights) and the latent down-projection ([L, K]) on
every rank. Here rank ``r`` stores and reads only its slice - experts ``r*E/W .. (r+1)*E/W`` of
the router and latent channels ``r*L/W .. (r+1)*L/W`` of the projection - and one all-gather
assembles the full logits and the full latent on every rank::

    weights, ids, latent = tp_route(x, router_shard, bias, top_k, router, comm=comm,
                                    latent_shard=latent_shard)

Both results travel in ONE all-gather (packed as bytes: fp32 logits next to bf16 latent, moved
bit-exactly). Every rank then runs the same top-k on the same bits, so the selection is
identical on every rank; it equals the replicated computation whenever the sliced GEMM gives
the same logits as the full one (each logit is the same K-long dot product either way).
"""

from __future__ import annotations

from typing import Callable

import torch

from latency_specialized.comm.base import Communicator, ExcludedCommunicator, LocalCommunicator
from latency_specialized.errors import UserError
from latency_specialized.ops.gemm import gemm_reference
from latency_specialized.ops.moe import route_reference
from latency_specialized.spec import RouterSpec


def shard_range(total: int, rank: int, world_size: int, what: str = "rows") -> tuple[int, int]:
    """[start, end) of ``rank``'s equal slice of ``total``; UserError when it does not divide."""
    if total % world_size:
        raise UserError(f"{what}: {total} not divisible by TP={world_size}: pick a TP that divides {total}")
    per = total // world_size
    return rank * per, (rank + 1) * per


def shard_rows(weight: torch.Tensor, rank: int, world_size: int, what: str = "weight") -> torch.Tensor:
    """The rows of ``weight`` [R, K] that ``rank`` stores (a contiguous copy: that rank's weight load)."""
    lo, hi = shard_range(weight.shape[0], rank, world_size, what)
    return weight[lo:hi].contiguous()


def router_logits(x: torch.Tensor, router_weight: torch.Tensor, fp32: bool = True) -> torch.Tensor:
    """Router logits [M, E'] of ``x`` [M, K] over the experts of ``router_weight`` [E', K].

    fp32: the GEMM runs in fp32 (RouterSpec.fp32) and the logits stay fp32; otherwise the
    activation dtype GEMM reference (fp32 accumulate, one rounding).
    """
    if fp32:
        return x.float() @ router_weight.float().t()
    return gemm_reference(x, router_weight)


def _pack(parts: list[torch.Tensor]) -> torch.Tensor:
    """[M, sum of byte widths] uint8: the rows of every part side by side, bits unchanged."""
    return torch.cat([p.contiguous().view(torch.uint8) for p in parts], dim=-1)


def _unpack(gathered: torch.Tensor, world_size: int, widths: list[tuple[int, torch.dtype]]) -> list[torch.Tensor]:
    """Inverse of gathering ``_pack`` over ranks: per part [M, world_size * width] in rank order."""
    M = gathered.shape[0]
    row_bytes = sum(w * torch.empty(0, dtype=dt).element_size() for w, dt in widths)
    per_rank = gathered.reshape(M, world_size, row_bytes)
    out, at = [], 0
    for width, dt in widths:
        nbytes = width * torch.empty(0, dtype=dt).element_size()
        out.append(per_rank[:, :, at:at + nbytes].contiguous().view(dt).reshape(M, world_size * width))
        at += nbytes
    return out


def gather_parts(comm: Communicator, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's ``parts`` ([M, w_i] each, any dtypes) concatenated along the last dim, in rank order.

    One all-gather for all parts: their rows are packed side by side as bytes (bits unchanged) and
    unpacked after. The bench's ExcludedCommunicator gathers each part on its own (its stand-in
    slices of the other ranks are random values of each part's dtype and scale).
    """
    if comm.world_size == 1:
        return list(parts)
    if isinstance(comm, ExcludedCommunicator):
        return [comm.all_gather(p, dim=-1) for p in parts]
    widths = [(p.shape[1], p.dtype) for p in parts]
    return _unpack(comm.all_gather(_pack(parts), dim=-1), comm.world_size, widths)


def tp_moe_input(x: torch.Tensor, router_shard: torch.Tensor, *, comm: Communicator | None = None,
                 latent_shard: torch.Tensor | None = None, router_fp32: bool = True,
                 gemm: Callable[..., torch.Tensor] = gemm_reference) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full router logits and latent input from per-rank slices, with one all-gather.

    Parameters
    ----------
    x : [M, K] the (normed) hidden states, identical on every rank.
    router_shard : [E / W, K] this rank's rows of the router weight.
    latent_shard : [L / W, K] this rank's rows of the latent down-projection, or None.
    gemm : projection implementation for the latent slice (the plan's choice; the reference by default).

    Returns
    -------
    (logits [M, E] fp32 if router_fp32 else x.dtype, latent [M, L] in x.dtype or None),
    bit-identical on every rank.
    """
    comm = comm or LocalCommunicator()
    parts = [router_logits(x, router_shard, router_fp32)]
    if latent_shard is not None:
        parts.append(gemm(x, latent_shard))
    gathered = gather_parts(comm, parts)
    return gathered[0], (gathered[1] if latent_shard is not None else None)


def tp_route(x: torch.Tensor, router_shard: torch.Tensor, bias: torch.Tensor | None, top_k: int, router: RouterSpec, *,
             comm: Communicator | None = None, latent_shard: torch.Tensor | None = None,
             route: Callable[..., tuple[torch.Tensor, torch.Tensor]] = route_reference,
             gemm: Callable[..., torch.Tensor] = gemm_reference):
    """TP-split routing (+ latent projection): each rank scores / projects only its slice.

    Parameters
    ----------
    x : [M, K]; router_shard : [E / W, K]; bias : [E] selection bias (or None);
    latent_shard : [L / W, K] or None; route : the moe.router implementation (same signature as
    ``route_reference``), run on the gathered logits identically on every rank.

    Returns
    -------
    (weights [M, top_k] fp32, ids [M, top_k] int64, latent [M, L] or None).
    """
    logits, latent = tp_moe_input(x, router_shard, comm=comm, latent_shard=latent_shard,
                                  router_fp32=router.fp32, gemm=gemm)
    if bias is not None and bias.shape[-1] != logits.shape[-1]:
        raise UserError(f"router bias has {bias.shape[-1]} experts, gathered logits {logits.shape[-1]}: pass the "
                        f"full [E] bias on every rank (it is {logits.shape[-1]} x 4 bytes)")
    weights, ids = route(logits, bias, top_k, router)
    return weights, ids, latent
