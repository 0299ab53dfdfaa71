"""kernels.kda_verify_triton on a GPU at Kimi K3's TP8 rank shapes (12 heads x 128, conv 4, decay rank 128):
the Triton verify against the torch reference (outputs and tapes per dtype), the Triton accept against the
reference accept on the same tape (bit for bit), both captured in one CUDA graph (replay == eager, no host
sync). Fresh random inputs, scattered state rows, NaN-poisoned tapes and outputs. Every candidate config the
bench sweeps (``candidate_configs``: fused / hoist_fb / prologue at several blocks) is checked the same way, so a
pick from the bench's timings is a tested launch.
"""

from __future__ import annotations

import functools

import pytest
import torch

from latency_specialized.ops.attention.kda_verify import kda_accept_reference, kda_verify_reference, tape_shapes

from tests.ops.kda_verify_cases import TOL, assert_written_close, verify_args

pytestmark = pytest.mark.gpu

H, D, W, RANK = 12, 128, 4, 128


def _case(seed: int, B: int, T: int, dtype: torch.dtype, *, tmax: int = 8):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hd = H * D
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    rows_total = B + 3
    rows = torch.randperm(rows_total, generator=g, device="cuda")[:B].to(torch.int32)
    R = B * T
    inp = dict(mixed_qkv=rnd(R, 3 * hd).to(dtype), conv_weight=rnd(3 * hd, W) / W ** 0.5, f=rnd(R, RANK).to(dtype),
               A_log=torch.log(0.5 + 1.5 * torch.rand(H, generator=g, device="cuda")), dt_bias=-2.0 + 0.5 * rnd(hd),
               beta_logit=rnd(R, H).to(dtype), g_out=rnd(R, hd).to(dtype), norm_weight=1.0 + 0.1 * rnd(D))
    kw = dict(num_heads=H, eps=1e-5, gate_lower_bound=-5.0, f_b_weight=(rnd(hd, RANK) / RANK ** 0.5).to(dtype))
    conv = rnd(rows_total, 3 * hd, W - 1).to(dtype)
    state = 0.3 * rnd(rows_total, H, D, D)
    ts, tc = tape_shapes(H, D, tmax - 1)
    tape_state = torch.full((rows_total, *ts), float("nan"), device="cuda")
    tape_conv = torch.full((rows_total, *tc), float("nan"), dtype=dtype, device="cuda")
    return inp, kw, conv, state, rows, tape_state, tape_conv


def _check_verify_then_accept(seed: int, B: int, k: int, dtype: torch.dtype, verify, accept) -> None:
    """``verify`` (kda_verify_triton's arguments) against the reference: outputs and tapes within the verify's
    tolerances, the live states untouched; then ``accept`` of the kernel's own tape equal to the reference
    replay of that tape bit for bit."""
    T = 1 + k
    inp, kw, conv, state, rows, tape_state, tape_conv = _case(seed, B, T, dtype)
    conv0, state0 = conv.clone(), state.clone()
    ref_ts, ref_tc = tape_state.clone(), tape_conv.clone()
    want = kda_verify_reference(*verify_args(inp, conv, state, rows, ref_ts, ref_tc), **kw)
    got = verify(*verify_args(inp, conv, state, rows, tape_state, tape_conv), **kw)
    tol = TOL[dtype]
    assert_written_close(got, want, tol["out"], "outputs")
    idx = rows.long()
    assert_written_close(tape_state[idx, :T], ref_ts[idx, :T], tol["tape"], "tape_state")
    assert torch.equal(tape_conv[idx, :T], ref_tc[idx, :T]), "tape_conv is a cast of the inputs: exact"
    assert torch.equal(state, state0) and torch.equal(conv, conv0), "verify must leave the live states alone"
    accepted = torch.randint(-1, T, (B,), device="cuda", dtype=torch.int32)
    accepted[0] = k  # at least one full acceptance
    ref_conv, ref_state = conv.clone(), state.clone()
    kda_accept_reference(ref_conv, ref_state, rows, accepted, tape_state, tape_conv)
    accept(conv, state, rows, accepted, tape_state, tape_conv)
    assert torch.equal(state, ref_state) and torch.equal(conv, ref_conv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("B,k", [(1, 3), (1, 7), (8, 7), (64, 3), (64, 7)])
def test_verify_and_accept_match_the_references(B, k, dtype):
    from latency_specialized.kernels.kda_verify_triton import kda_accept_triton, kda_verify_triton

    _check_verify_then_accept(100 * B + k, B, k, dtype, kda_verify_triton, kda_accept_triton)


def _config_cases() -> list:
    """Every candidate config the bench sweeps, at the B it is listed for (bf16 at k = 7 and 3, fp32 at k = 3)."""
    from latency_specialized.kernels.kda_verify_triton import candidate_configs

    cases = []
    for B in (1, 8, 64):
        for c in candidate_configs(B, H, D):
            cases += [pytest.param(B, k, dt, c, id=f"B{B}-k{k}-{n}-{c.name.replace(' ', '_')}")
                      for k, dt, n in ((7, torch.bfloat16, "bf16"), (3, torch.bfloat16, "bf16"),
                                       (3, torch.float32, "fp32"))]
    return cases


@pytest.mark.parametrize("B,k,dtype,config", _config_cases())
def test_candidate_configs_match_the_references(B, k, dtype, config):
    """``kda_verify_triton_with`` / ``kda_accept_triton_with`` under each candidate (the shared checks above)."""
    from latency_specialized.kernels.kda_verify_triton import kda_accept_triton_with, kda_verify_triton_with

    _check_verify_then_accept(100 * B + k + 7, B, k, dtype, functools.partial(kda_verify_triton_with, config),
                              functools.partial(kda_accept_triton_with, config))


@pytest.mark.parametrize("prologue", [False, True], ids=["default", "prologue"])
def test_verify_then_accept_capture_in_one_graph_and_replay_equals_eager(prologue):
    from latency_specialized.kernels.kda_verify_triton import (VerifyConfig, kda_accept_triton_with,
                                                               kda_verify_triton_with)

    config = VerifyConfig(32, 4, prologue=True) if prologue else None
    kda_verify_triton = functools.partial(kda_verify_triton_with, config)
    kda_accept_triton = functools.partial(kda_accept_triton_with, config)

    B, k = 8, 7
    T = 1 + k
    inp, kw, conv, state, rows, tape_state, tape_conv = _case(7, B, T, torch.bfloat16)
    accepted = torch.tensor([7, 0, 3, -1, 5, 7, 1, 2], device="cuda", dtype=torch.int32)
    c0, s0 = conv.clone(), state.clone()

    def step():
        out = kda_verify_triton(*verify_args(inp, conv, state, rows, tape_state, tape_conv), **kw)
        kda_accept_triton(conv, state, rows, accepted, tape_state, tape_conv)
        return out

    eager = step()
    e_conv, e_state = conv.clone(), state.clone()
    conv.copy_(c0), state.copy_(s0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (compiles) outside the capture
        step()
    torch.cuda.current_stream().wait_stream(s)
    conv.copy_(c0), state.copy_(s0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    conv.copy_(c0), state.copy_(s0)
    tape_state.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(conv, e_conv) and torch.equal(state, e_state)
