"""What the CPU (interpreter) and GPU tests of ``kernels/kda_verify_triton.py`` share: tolerances, the op's
positional arguments from a case, and the written-and-close check."""

from __future__ import annotations

import torch

TOL = {torch.float32: dict(out=(1e-4, 1e-5), tape=(1e-4, 1e-6)),
       torch.bfloat16: dict(out=(2e-2, 2e-2), tape=(2e-2, 1e-2))}
"""(rtol, atol) per activation dtype: outputs (after the gated RMSNorm, O(1)) and the fp32 tape vectors."""


def verify_args(inp, conv, state, rows, tape_state, tape_conv) -> tuple:
    """The positional arguments of ``kda_verify_*`` from a case's inputs, states and tapes."""
    return (inp["mixed_qkv"], conv, inp["conv_weight"], inp["f"], inp["A_log"], inp["dt_bias"], inp["beta_logit"],
            inp["g_out"], inp["norm_weight"], state, rows, tape_state, tape_conv)


def assert_written_close(got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float], what: str) -> None:
    """Every entry written (finite: the outputs and tapes start as NaN) and equal to ``want`` within ``tol``."""
    assert torch.isfinite(got).all(), f"{what}: an entry left unwritten (NaN) or not finite"
    torch.testing.assert_close(got.float(), want.float(), rtol=tol[0], atol=tol[1], msg=lambda m: f"{what}: {m}")
