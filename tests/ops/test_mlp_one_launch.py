"""``mlp.triton_one_launch`` on the CPU: its support rules, its tile choice, and its kernel under the Triton
interpreter against ``mlp_reference``.

The kernel cases (marker ``interpreter_case``) run in a child process started with ``TRITON_INTERPRET=1``
(``tests/interpret.py``). Every tensor is fp32 there (the interpreter's bf16 is unreliable), so the roundings the
contract asks for are identities and the kernel must equal the reference to fp32 summation order. Fresh random
inputs each case, ``out`` poisoned with NaN, odd widths (I and N not multiples of the blocks, K not of the chunk),
strided x rows and weight views. Two paths: several programs (the stages as two launches, as the interpreter
must run them) and one program (the one-launch path through its barrier, which must leave its counter at 0 and
bump the generation once). GPU cases: ``tests/ops/test_mlp_one_launch_gpu.py``.
"""

from __future__ import annotations

import importlib.util
import zlib

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.mlp import mlp_reference
from latency_specialized.ops.registry import make_context
from latency_specialized.spec import ActivationSpec

from tests.interpret import run_interpreted

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
interpreted = pytest.mark.interpreter_case
"""Needs TRITON_INTERPRET=1 from the process start: collected only there (the driver below runs these)."""

SWIGLU = ActivationSpec(kind="swiglu")
CLAMPED = ActivationSpec(kind="swiglu", clamp=1.5)
SITU = ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)
ACTS = pytest.mark.parametrize("act", [SWIGLU, CLAMPED, SITU], ids=["swiglu", "swiglu_clamp", "situ"])


def _case(seed: int, M: int, K: int, I: int, N: int, *, x_pad: int = 0, w_pad: int = 0):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(M, K + x_pad, generator=g) * 2
    w13 = torch.randn(2 * I, K + w_pad, generator=g) * K ** -0.5
    w2 = torch.randn(N, I + w_pad, generator=g) * I ** -0.5
    return xs[:, :K], w13[:, :K], w2[:, :I]


def _ctx(**kw):
    base = dict(arch="sm_90", dtype="bfloat16", tokens=1, dims={"N": 288, "K": 5120},
                attrs={"activation": "swiglu", "side_stream": True})
    attrs = {**base.pop("attrs"), **kw.pop("attrs", {})}
    base.update(kw)
    return make_context("mlp", attrs=attrs, **base)


def test_supports_names_the_switch_when_off(monkeypatch):
    from latency_specialized.kernels import mlp_one_launch_triton as mod

    monkeypatch.setattr(mod, "ENABLED", False)
    why = mod._supports(_ctx())
    if not _HAVE_TRITON:
        assert "triton" in why
        return
    assert "ENABLED" in why
    monkeypatch.setattr(mod, "ENABLED", True)
    assert mod._supports(_ctx()) is True
    assert "SIDE_STREAM_ONLY" in mod._supports(_ctx(attrs={"side_stream": False}))
    assert "token rows" in mod._supports(_ctx(tokens=mod.MAX_M + 1))
    assert "weights" in mod._supports(_ctx(attrs={"weight_format": "fp8-block-128"}))
    assert "activation" in mod._supports(_ctx(attrs={"activation": "gelu"}))
    assert "cpu" in mod._supports(_ctx(arch="cpu"))
    monkeypatch.setattr(mod, "SIDE_STREAM_ONLY", False)
    assert mod._supports(_ctx(attrs={"side_stream": False})) is True


def test_the_planner_prefers_it_only_when_switched_on(monkeypatch):
    if not _HAVE_TRITON:
        pytest.skip("needs triton (supports() refuses without it)")
    from latency_specialized.kernels import mlp_one_launch_triton as mod
    from latency_specialized.plugins import get_registry

    reg = get_registry().implementations
    monkeypatch.setattr(mod, "ENABLED", True)
    assert reg.select(_ctx())[0].name == mod.NAME
    monkeypatch.setattr(mod, "ENABLED", False)
    chosen, refusals = reg.select(_ctx())
    assert chosen.name != mod.NAME and any(name == mod.NAME and "ENABLED" in why for name, why in refusals)


def test_tiles_give_one_block_a_program_within_the_register_budget():
    from latency_specialized.kernels.mlp_one_launch_triton import PRODUCT_ELEMS, tiles

    # DeepSeek-V4.1-Flash TP8 shared expert on 132 SMs: I 288 over K 5120, then N 5120 over I 288
    assert tiles(1, 288, 5120, 132) == (4, 2048)
    assert tiles(1, 5120, 288, 132) == (64, 128)
    for m in (1, 2, 3, 4):
        for rows, width, programs in ((288, 5120, 132), (5120, 288, 132), (7, 33, 3), (1, 8, 1)):
            r, bk = tiles(m, rows, width, programs)
            assert r & (r - 1) == 0 and bk & (bk - 1) == 0 and bk >= 16
            assert -(-rows // r) <= max(programs, -(-rows // 64))
            m_pad = 1 << (m - 1).bit_length()
            assert m_pad * r * bk <= max(PRODUCT_ELEMS, m_pad * r * 16)


def test_argument_checks_name_the_fix():
    from latency_specialized.kernels.mlp_one_launch_triton import MAX_M, mlp_one_launch

    x, w13, w2 = _case(0, 1, 32, 16, 24)
    with pytest.raises(UserError, match="do not chain"):
        mlp_one_launch(x, w13[:, :16], w2, SWIGLU)
    with pytest.raises(UserError, match="cutedsl_fused serves more"):
        mlp_one_launch(torch.zeros(MAX_M + 1, 32), w13, w2, SWIGLU)
    with pytest.raises(UserError, match="stored format"):
        mlp_one_launch(x, w13.double(), w2, SWIGLU)
    with pytest.raises(UserError, match="contiguous"):
        mlp_one_launch(torch.zeros(1, 64)[:, ::2], w13, w2, SWIGLU)
    with pytest.raises(UserError, match="out must be"):
        mlp_one_launch(x, w13, w2, SWIGLU, out=torch.zeros(1, 23))


@pytest.mark.interpreter_driver
@pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (its interpreter runs the kernels on the CPU)")
def test_kernel_cases_under_the_interpreter():
    run_interpreted(__file__, min_passed=14)


@interpreted
@ACTS
@pytest.mark.parametrize("M,K,I,N,programs", [(1, 96, 24, 40, 5), (3, 200, 36, 72, 4), (4, 64, 8, 130, 7),
                                              (2, 48, 20, 33, 1)])
def test_matches_the_reference(act, M, K, I, N, programs):
    from latency_specialized.kernels.mlp_one_launch_triton import _barrier_words, mlp_one_launch

    x, w13, w2 = _case(zlib.crc32(f"{M}-{K}-{I}-{N}-{act.kind}-{act.clamp}".encode()), M, K, I, N)
    out = torch.full((M, N), float("nan"))
    count, gen = _barrier_words(x.device)
    gen_before = int(gen.item())
    got = mlp_one_launch(x, w13, w2, act, out=out, programs=programs)
    assert got is out and not out.isnan().any()
    torch.testing.assert_close(out, mlp_reference(x, w13, w2, act), rtol=1e-5, atol=1e-5)
    assert int(count.item()) == 0                                     # every call leaves the counter at 0
    assert int(gen.item()) == gen_before + (programs == 1)           # one barrier a one-launch call


@interpreted
def test_strided_rows_and_weight_views():
    from latency_specialized.kernels.mlp_one_launch_triton import mlp_one_launch

    x, w13, w2 = _case(77, 3, 80, 12, 50, x_pad=24, w_pad=8)
    assert x.stride(0) == 104 and w13.stride(0) == 88 and w2.stride(0) == 20
    big = torch.full((3, 64), float("nan"))
    out = big[:, 7:57]
    mlp_one_launch(x, w13, w2, SITU, out=out, programs=3)
    torch.testing.assert_close(out, mlp_reference(x, w13, w2, SITU), rtol=1e-5, atol=1e-5)
    assert big[:, :7].isnan().all() and big[:, 57:].isnan().all()  # nothing written outside out


@interpreted
def test_clamp_binds():
    """Inputs large enough that the clamp changes the result: the clamped and unclamped kernels differ as the
    references do."""
    from latency_specialized.kernels.mlp_one_launch_triton import mlp_one_launch

    x, w13, w2 = _case(5, 2, 64, 16, 24)
    x = x * 8
    clamped = mlp_one_launch(x, w13, w2, CLAMPED, programs=2)
    plain = mlp_one_launch(x, w13, w2, SWIGLU, programs=2)
    torch.testing.assert_close(clamped, mlp_reference(x, w13, w2, CLAMPED), rtol=1e-5, atol=1e-5)
    assert (clamped - plain).abs().max() > 1e-2


def test_hopper_builds_without_spills_and_with_the_barrier():
    """The one-launch kernel compiles for sm_90 at DeepSeek-V4.1-Flash's TP8 shared-expert shape (K 5120, I 288)
    and Kimi K3's SiTU-GLU, M 1..4, on 132 programs (launches recorded, not run): no stack frame (spilled
    registers), and its PTX holds the barrier's GPU-scope acquire / release operations. Needs a process that is not
    interpreting."""
    import os

    if not _HAVE_TRITON:
        pytest.skip("needs triton")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("compiles only where triton was imported without the interpreter")
    from latency_specialized.kernels.mlp_one_launch_triton import mlp_one_launch

    from tests.triton_offline import ptx_for_hopper, recorded_launches, resource_usage

    with recorded_launches() as launches:
        for m in (1, 2, 3, 4):
            for act in (CLAMPED, SITU):
                x = torch.zeros(m, 5120, dtype=torch.bfloat16)
                mlp_one_launch(x, torch.zeros(576, 5120, dtype=torch.bfloat16),
                               torch.zeros(5120, 288, dtype=torch.bfloat16), act, programs=132)
    assert len(launches) == 8
    usage = resource_usage(launches)
    assert all(stack == 0 for _, stack in usage.values()), usage
    for key, ptx in ptx_for_hopper(launches).items():
        # the arrival, the reset, the last arriver's release of the generation, the others' acquiring reads of it
        # (Triton lowers an atomic add of 0 to an acquiring load, an unread add to a reduction)
        for op in ("atom.global.gpu.acq_rel.add", "atom.global.gpu.relaxed.exch", "red.global.gpu.release.add",
                   "ld.global.gpu.acquire"):
            assert op in ptx, (key, op)
        assert "ld.global.cg" in ptx, key          # h read from L2: other SMs wrote it in this launch
