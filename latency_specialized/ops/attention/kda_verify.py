"""attention.kda_verify / attention.kda_accept: KDA in a speculative-decoding verification step.

A verification step feeds every request ``T = 1 + k`` tokens (the last accepted token and k draft
tokens), laid out request-major: request ``b``'s tokens are rows ``b*T .. b*T + k``, in order.
KDA is a recurrence, so the T tokens run in order per request (each token's output reads the state
its predecessors wrote), exactly as T single steps of ``attention.kda`` would.

Which prefix is accepted is known only after sampling, so the step must be able to roll back to the
state after any of its tokens. Rather than writing T snapshots of the fp32 state ``[H, Dv, Dk]``
(T times the state's bytes per step, see ``NOTES_verify.md``), the verification op leaves the live
states untouched and records a **tape** per token: the three vectors its state update is made of
(normalised key ``k``, decay multiplier ``exp(g)``, write ``v' = beta (v - S k)``) and its conv input.
:func:`kda_accept_reference` then rebuilds the state after the accepted prefix from the live state by
replaying those rank-1 updates with the very same fp32 operations - bit for bit the state T single
steps would have left after that prefix - and shifts the conv inputs in. The tape is kept per state
row (like the states), so accepting at the start of the next step works even if the batch was
reordered in between.

Tape (per layer, rows as ``state``; ``Tmax = 1 + max k``):

* ``tape_state`` ``[S, Tmax, H, 3, D]`` fp32: ``[..., 0, :]`` = k, ``[..., 1, :]`` = exp(g) (along
  keys), ``[..., 2, :]`` = v' (along values);
* ``tape_conv`` ``[S, Tmax, 3*H*D]`` in the conv state's dtype: each token's conv input (q|k|v before
  the conv).

Between a verification step and its accept the live states hold the state *before* the step; the
accept is what moves them on (also for a fully accepted step).
"""

from __future__ import annotations

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.attention.kda import kda_token_reference
from latency_specialized.ops.gemm import gemm_reference
from latency_specialized.ops.registry import Implementation, always

TAPE_PARTS = 3
"""Vectors per head and token in ``tape_state``: k, exp(g), v'."""


def tape_shapes(num_heads: int, head_dim: int, spec_tokens: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-row shapes of (``tape_state``, ``tape_conv``) for up to ``spec_tokens`` draft tokens per step."""
    T = 1 + spec_tokens
    return (T, num_heads, TAPE_PARTS, head_dim), (T, 3 * num_heads * head_dim)


def _check_tape(tape_state: torch.Tensor, tape_conv: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
                tokens: int) -> None:
    H, D = state.shape[1], state.shape[3]
    if tape_state.dtype != torch.float32 or tuple(tape_state.shape[2:]) != (H, TAPE_PARTS, D):
        raise UserError(f"kda verify: tape_state is {tape_state.dtype} {list(tape_state.shape)}; allocate it as "
                        f"fp32 [rows, 1 + k, {H}, {TAPE_PARTS}, {D}] (ops.attention.kda_verify.tape_shapes)")
    if tape_conv.dtype != conv_state.dtype or tape_conv.shape[2] != conv_state.shape[1]:
        raise UserError(f"kda verify: tape_conv is {tape_conv.dtype} {list(tape_conv.shape)}; allocate it as "
                        f"{conv_state.dtype} [rows, 1 + k, {conv_state.shape[1]}] like the conv state")
    if tape_state.shape[0] != state.shape[0] or tape_conv.shape[0] != state.shape[0]:
        raise UserError(f"kda verify: the tapes have {tape_state.shape[0]} / {tape_conv.shape[0]} rows but the state has "
                        f"{state.shape[0]}: give the tapes one row per state row")
    if tokens > tape_state.shape[1] or tokens > tape_conv.shape[1]:
        raise UserError(f"kda verify: {tokens} tokens per request but the tapes hold {tape_state.shape[1]}: "
                        "allocate them for 1 + the most speculative tokens per step")


def kda_verify_reference(mixed_qkv: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
                         f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, beta_logit: torch.Tensor,
                         g_out: torch.Tensor, norm_weight: torch.Tensor, state: torch.Tensor,
                         state_idx: torch.Tensor, tape_state: torch.Tensor, tape_conv: torch.Tensor, *,
                         num_heads: int, eps: float = 1e-5, gate_lower_bound: float = -5.0,
                         scale: float | None = None, f_b_weight: torch.Tensor | None = None) -> torch.Tensor:
    """KDA over ``T = R / B`` tokens per request, in order; the live states are read, not written.

    Parameters
    ----------
    mixed_qkv : [R, 3*H*D] q|k|v projections before the conv, R = B*T rows, request-major.
    conv_state : [S, 3*H*D, W-1] conv inputs before the step (read only here).
    conv_weight, A_log, dt_bias, norm_weight : as in ``attention.kda``.
    f : [R, H*D] decay input, or with ``f_b_weight`` [H*D, Rk] the low-rank f_a [R, Rk].
    beta_logit : [R, H]. g_out : [R, H*D].
    state : [S, H, D, D] fp32 states before the step (read only here).
    state_idx : [B] int state row of each request (padding requests may share a scratch row).
    tape_state : [S, Tmax, H, 3, D] fp32, tape_conv : [S, Tmax, 3*H*D]: entries ``[state_idx[b], :T]``
        are written (see the module docstring); ``Tmax >= T``.

    Returns
    -------
    [R, H*D] in mixed_qkv.dtype: every token's output, the same rows as the inputs.
    """
    B = state_idx.shape[0]
    R = mixed_qkv.shape[0]
    if B == 0 or R % B:
        raise UserError(f"kda verify: {R} token rows for {B} requests; pass 1 + k rows per request, request-major")
    T = R // B
    _check_tape(tape_state, tape_conv, conv_state, state, T)
    idx = state_idx.long()
    conv, S = conv_state[idx], state[idx]
    out = torch.empty(B, T, mixed_qkv.shape[1] // 3, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    for t in range(T):
        # token t of every request; sliced out contiguous so each token runs on exactly the tensors a
        # single decode step of B rows would see (same roundings, bit for bit)
        x = mixed_qkv[t::T].contiguous()
        ft = f[t::T].contiguous()
        if f_b_weight is not None:
            ft = gemm_reference(ft, f_b_weight)
        tok = kda_token_reference(x, conv, conv_weight, ft, A_log, dt_bias, beta_logit[t::T].contiguous(),
                                  g_out[t::T].contiguous(), norm_weight, S, num_heads=num_heads, eps=eps,
                                  gate_lower_bound=gate_lower_bound, scale=scale)
        out[:, t] = tok.out
        conv, S = tok.conv, tok.state
        tape_state[idx, t] = torch.stack([tok.k, tok.decay, tok.v_new], dim=-2)
        tape_conv[idx, t] = x.to(tape_conv.dtype)
    return out.view(R, -1)


def kda_accept_reference(conv_state: torch.Tensor, state: torch.Tensor, state_idx: torch.Tensor,
                         accepted: torch.Tensor, tape_state: torch.Tensor, tape_conv: torch.Tensor) -> None:
    """Move each request's live states on to the end of its accepted prefix (in place, no host sync).

    Parameters
    ----------
    conv_state : [S, 3*H*D, W-1], state : [S, H, D, D] fp32: the live states, as the verification step
        left them (the state before that step); updated in place at ``state_idx``.
    state_idx : [B] int state row of each request.
    accepted : [B] int32 draft tokens accepted per request, ``j`` in ``-1 .. T-1`` of its last
        verification step: the state becomes the one after its tokens ``0..j`` (j = 0: the first token
        only; j = k: all). ``-1`` leaves the row as it is (nothing pending: a request fresh from
        prefill, or a padding row).
    tape_state, tape_conv : the tapes the verification step wrote; only entries ``<= j`` are read.
    """
    _check_tape(tape_state, tape_conv, conv_state, state, 0)
    idx = state_idx.long()
    j = accepted.long()
    B, Tmax = idx.shape[0], tape_state.shape[1]

    # recurrent state: replay the rank-1 updates of tokens 0..j with the verification step's operations
    # (decay multiply, then add v' k^T), so the result is bit for bit the one T single steps leave; a
    # token past j is never mixed in (``where`` selects, so even a NaN there cannot leak)
    S = state[idx]
    tape = tape_state[idx]  # [B, Tmax, H, 3, D]
    for t in range(Tmax):
        k, decay, v_new = tape[:, t].unbind(-2)
        nxt = S * decay.unsqueeze(-2)
        nxt = nxt + v_new.unsqueeze(-1) * k.unsqueeze(-2)
        S = torch.where((t <= j).view(B, 1, 1, 1), nxt, S)
    state[idx] = S

    # conv state: the last W-1 inputs of [conv_state, x_0 .. x_j]; a gather reads only those columns
    window = torch.cat([conv_state[idx], tape_conv[idx].transpose(1, 2)], dim=-1)  # [B, C, W-1+Tmax]
    W1 = conv_state.shape[-1]
    cols = (j + 1).view(B, 1, 1) + torch.arange(W1, device=idx.device).view(1, 1, W1)
    conv_state[idx] = torch.gather(window, -1, cols.expand(B, window.shape[1], W1))


IMPLEMENTATIONS = [
    Implementation("attention.kda_verify", "attention.kda_verify.reference", kda_verify_reference, always,
                   priority=-100, is_reference=True,
                   description="torch: the 1 + k tokens in order (attention.kda math), per-token tape, states untouched"),
    Implementation("attention.kda_accept", "attention.kda_accept.reference", kda_accept_reference, always,
                   priority=-100, is_reference=True,
                   description="torch: replay the tape's rank-1 updates up to the accepted token, shift conv"),
]
