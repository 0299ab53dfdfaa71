"""residual.mhc.triton on the CPU: the Triton interpreter, dispatch, errors, the sm_90 build and its registers.

The kernel cases (marker ``interpreter_case``) run in a child process started with ``TRITON_INTERPRET=1``
(``test_kernel_cases_under_the_interpreter``; why: ``tests/interpret.py``). Every case: fresh random
inputs (streams, sublayer output, post, comb, carried pre, fn, base, scale, norm weight); every
``torch.empty`` of the kernel module poisoned with NaN (``out``, the coefficients and the partial
records must all be written before anything reads them); compared with ``mhc_seam_reference`` on a
copy of the streams: the first seam (no ``y``, no carried ``pre``), a middle one, the last (no ``fn``),
H not a multiple of the chunk, M = 1, 3, 8, 64, several row blocks and chunk loops in the tail, fp32
(an fp32 tolerance: the kernel's sums run in its own order) and bf16 (the interpreter's bf16 rounding;
one ulp of the streams may flip, so a bf16 tolerance). The inputs other than the streams stay unchanged
and the row-block counters are back at 0. bf16 at DeepSeek-V4.1-Flash shapes and CUDA graphs:
``tests/ops/test_mhc_triton_gpu.py``.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.registry import make_context
from latency_specialized.ops.residual_mhc import mhc_seam_reference

from tests.interpret import run_interpreted

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (its interpreter runs the kernel on the CPU)")
interpreted = pytest.mark.interpreter_case
"""Needs TRITON_INTERPRET=1 from the process start: collected only there (the driver below runs these)."""

TOL = {torch.float32: dict(streams=(1e-6, 1e-6), x=(1e-5, 1e-5), coef=(1e-5, 1e-6), own_x=(1e-5, 1e-5)),
       torch.bfloat16: dict(streams=(2 ** -7, 1e-2), x=(2e-2, 2e-2), coef=(2e-2, 1e-2), own_x=(2 ** -6, 1e-3))}
"""(rtol, atol) per dtype. bf16: a streams element may round one ulp the other way (the fp32 sums run in
another order), which moves what is computed from it (and h and x round once each: 2 ulps of x); so the
coefficients and x are also checked tightly (``own_x``; fp32 for the coefficients) against the reference
fed the streams the kernel stored."""


@pytest.mark.interpreter_driver
def test_kernel_cases_under_the_interpreter():
    run_interpreted(__file__, min_passed=29)


@pytest.fixture
def mk():
    from latency_specialized.kernels import mhc_triton

    return mhc_triton




def _inputs(seed, M, n, H, dtype, *, y=True, pre=True, fn=True, weight=True):
    g = torch.Generator().manual_seed(seed)
    X = (2 + n) * n
    d = dict(streams=(torch.randn(M, n, H, generator=g) * 2 + 0.3).to(dtype))
    d["fn"] = torch.randn(X, n * H, generator=g) * (n * H) ** -0.5 * 4 if fn else None
    d["scale"] = torch.rand(3, generator=g) + 0.5 if fn else None
    d["base"] = torch.randn(X, generator=g) * 0.5 if fn else None
    d["norm_weight"] = (1.0 + 0.2 * torch.randn(H, generator=g)).to(dtype) if weight else None
    d["pre"] = torch.rand(M, n, generator=g) + 0.1 if pre else None
    d["y"] = (torch.randn(M, H, generator=g) * 3).to(dtype) if y else None
    d["post"] = torch.rand(M, n, generator=g) * 2 if y else None
    d["comb"] = torch.softmax(torch.randn(M, n, n, generator=g) * 2, -1) if y else None
    return d


def _run(mk, d, *, eps=1e-6, hc_eps=1e-6, iters=20, post_mult=2.0, out=False, **call):
    kw = dict(pre=d["pre"], y=d["y"], post=d["post"], comb=d["comb"], rms_eps=eps, hc_eps=hc_eps,
              post_mult=post_mult, sinkhorn_iters=iters)
    args = (d["fn"], d["scale"], d["base"], d["norm_weight"], eps)
    before = {k: v.clone() for k, v in d.items() if v is not None and k != "streams"}
    s_ref, s_tri = d["streams"].clone(), d["streams"].clone()
    want = mhc_seam_reference(s_ref, *args, **kw)
    dest = torch.full_like(d["streams"][:, 0], float("nan")) if out else None
    got = mk.mhc_seam_triton(s_tri, *args, **kw, out=dest, **call)
    if out:
        assert got[0] is dest
    tol = TOL[d["streams"].dtype]
    if d["y"] is None:
        assert torch.equal(s_tri, d["streams"]), "the first seam must not write the streams"
    torch.testing.assert_close(s_tri.float(), s_ref.float(), rtol=tol["streams"][0], atol=tol["streams"][1])
    assert not torch.isnan(got[0]).any(), "x left unwritten"
    scale = want[0].float().abs().max().item()
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=tol["x"][0], atol=tol["x"][1] * scale)
    own = mhc_seam_reference(s_tri.clone(), *args, **dict(kw, y=None, post=None, comb=None))
    torch.testing.assert_close(got[0].float(), own[0].float(), rtol=tol["own_x"][0], atol=tol["own_x"][1] * scale)
    for name, a, b, c in zip(("pre", "post", "comb"), got[1:], want[1:], own[1:]):
        if b is None:
            assert a is None, name
            continue
        assert not torch.isnan(a).any(), f"{name} left unwritten"
        torch.testing.assert_close(a, b, rtol=tol["coef"][0], atol=tol["coef"][1])
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    for k, v in before.items():
        assert torch.equal(d[k], v), f"{k} changed"
    assert not mk.counter(s_tri.device).any(), "a row-block counter was left non-zero"
    return got


SEAMS = {"first": dict(y=False, pre=False), "middle": {}, "last": dict(fn=False),
         "middle_no_weight": dict(weight=False), "first_with_fn_carried_pre": dict(y=False)}


@interpreted
@pytest.mark.parametrize("seam", sorted(SEAMS))
@pytest.mark.parametrize("M,H", [(1, 64), (3, 100), (8, 72)])
def test_matches_reference(mk, poisoned, seam, M, H):
    _run(mk, _inputs(M * 1000 + H, M, 4, H, torch.float32, **SEAMS[seam]))


@interpreted
@pytest.mark.parametrize("seam", ["first", "middle", "last"])
def test_bf16_matches_reference(mk, poisoned, seam):
    _run(mk, _inputs(7, 3, 4, 100, torch.bfloat16, **SEAMS[seam]))


@interpreted
@pytest.mark.parametrize("seam", ["middle", "last"])
def test_batch_64_several_row_blocks(mk, poisoned, seam):
    _run(mk, _inputs(64, 64, 4, 48, torch.float32, **SEAMS[seam]))


@interpreted
def test_tail_loops_and_odd_blocks(mk, poisoned, monkeypatch):
    """Chunks of 4 channels (25 chunks of H = 98, the last partial), 2 rows per block (M = 5: 3 blocks,
    the last half empty), the tail summing records 4 chunks at a time (32-float records with fn, 1-float
    without) and rescaling 32 elements at a time."""
    monkeypatch.setattr(mk, "OUT_TILE", 64)
    monkeypatch.setattr(mk, "RECORD_TILE", 2 * 4 * 32)
    _run(mk, _inputs(11, 5, 4, 98, torch.float32), block_m=2, block_h=4, num_warps=1)
    monkeypatch.setattr(mk, "RECORD_TILE", 2 * 4)
    _run(mk, _inputs(12, 5, 4, 98, torch.float32, fn=False), block_m=2, block_h=4, num_warps=1)


@interpreted
@pytest.mark.parametrize("n", [1, 2, 8])
def test_other_stream_counts(mk, poisoned, n):
    _run(mk, _inputs(n, 3, n, 40, torch.float32))


@interpreted
def test_out_eps_iters_and_a_second_call(mk, poisoned):
    """``out=`` is written; other epsilons, 1 and 3 Sinkhorn iterations; the same call twice gives the
    same bits (the counter left at 0 by the first)."""
    d = _inputs(5, 4, 4, 64, torch.float32)
    _run(mk, d, out=True, eps=1e-20, hc_eps=1e-3, iters=1, post_mult=1.5)
    a = _run(mk, d, iters=3)
    b = _run(mk, d, iters=3)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


@interpreted
@pytest.mark.parametrize("seam,iters", [("middle", 20), ("first", 3), ("last", 1), ("middle_no_weight", 2),
                                        ("first_with_fn_carried_pre", 1)])
def test_out_loaded_first_matches_reference(mk, poisoned, monkeypatch, seam, iters):
    """``OUT_LOAD_FIRST`` (one row, its 2-byte channels in one tile loaded before the coefficients): the same
    tolerances against the reference, every seam kind, 1 to 20 rounds; elsewhere (several rows, 4-byte rows, rows
    wider than one tile) the loop it replaces runs."""
    monkeypatch.setattr(mk, "OUT_LOAD_FIRST", True)
    assert mk.out_load_first(1, 1, 72, 2) and not mk.out_load_first(2, 1, 72, 2)
    assert not mk.out_load_first(1, 1, 72, 4) and not mk.out_load_first(1, 1, mk.OUT_ROW_TILE + 1, 2)
    _run(mk, _inputs(31 + iters, 1, 4, 72, torch.bfloat16, **SEAMS[seam]), iters=iters, block_h=8)
    _run(mk, _inputs(37 + iters, 1, 4, 100, torch.bfloat16, **SEAMS[seam]), iters=iters)


# ------------------------------------------------------------------ not interpreted
def test_errors_name_the_fix(mk):
    d = _inputs(1, 2, 3, 16, torch.float32)
    with pytest.raises(UserError, match="power of two"):
        mk.mhc_seam_triton(d["streams"], d["fn"], d["scale"], d["base"], None, 1e-6)
    d = _inputs(1, 2, 4, 16, torch.float32)
    with pytest.raises(UserError, match="fp32"):
        mk.mhc_seam_triton(d["streams"], d["fn"][:, :-1], d["scale"], d["base"], None, 1e-6)
    with pytest.raises(UserError, match="sinkhorn_iters"):
        mk.mhc_seam_triton(d["streams"], d["fn"], d["scale"], d["base"], None, 1e-6, sinkhorn_iters=0)
    with pytest.raises(UserError, match="post"):
        mk.mhc_seam_triton(d["streams"], d["fn"], d["scale"], d["base"], None, 1e-6, y=d["y"])
    with pytest.raises(UserError, match="out must be"):
        mk.mhc_seam_triton(d["streams"], None, None, None, None, 1e-6, out=torch.empty(2, 16, dtype=torch.bfloat16))
    with pytest.raises(UserError, match="contiguous"):
        mk.mhc_seam_triton(d["streams"].transpose(0, 1), None, None, None, None, 1e-6)


def _ctx(arch="sm_90", dtype="bfloat16", tokens=8, mix=True, **dims):
    d = dict(N=5120, streams=4, iters=20 if mix else 0)
    d.update(dims)
    return make_context("residual.mhc", arch=arch, dtype=dtype, tokens=tokens, dims=d, attrs={"mix": mix})


def test_supports_names_the_reason(mk):
    sup = mk.IMPLEMENTATIONS[0].supports
    assert sup(_ctx()) is True and sup(_ctx(mix=False)) is True and sup(_ctx("sm_100a", "float32")) is True
    assert "GPU" in sup(_ctx("cpu"))
    assert "power of two" in sup(_ctx(streams=3))
    assert "dtype" in sup(_ctx(dtype="float8_e4m3fn"))
    assert "rows" in sup(_ctx(tokens=mk.MAX_TOKENS + 1))
    assert "iters" in sup(_ctx(iters=0))


def test_dispatch_gpu_gets_the_kernel_cpu_the_reference():
    from latency_specialized.plugins import get_registry

    impls = get_registry().implementations
    for arch in ("sm_90", "sm_90a"):
        for mix in (True, False):
            chosen, _ = impls.select(_ctx(arch, mix=mix))
            assert chosen.name == "residual.mhc.triton", (arch, mix)
    chosen, refusals = impls.select(_ctx("cpu"))
    assert chosen.name == "residual.mhc.reference" and "residual.mhc.triton" in dict(refusals)
    chosen, refusals = impls.select(_ctx(streams=6))
    assert chosen.name == "residual.mhc.reference" and "streams=6" in dict(refusals)["residual.mhc.triton"]


def test_the_entry_point_takes_the_reference_call(mk):
    """The piece calls the op as the reference's signature: every parameter, in order, of the same kind."""
    sig = inspect.signature(mk.mhc_seam_triton).parameters
    ref = inspect.signature(mhc_seam_reference).parameters
    assert list(sig)[:len(ref)] == list(ref)
    for name, p in ref.items():
        assert sig[name].kind == p.kind and sig[name].default == p.default, name


def test_block_choice_is_static_and_pow2(mk):
    for M in (1, 2, 3, 8, 9, 64, 512):
        tm, ch, nw = mk.choose_blocks(M, 5120)
        assert tm & (tm - 1) == 0 and ch & (ch - 1) == 0 and tm <= 8 and nw in (4, 8)
        assert -(-M // tm) <= mk.MAX_ROW_BLOCKS


def test_kernel_compiles_for_hopper_without_a_gpu(mk):
    """The launches the CPU wrapper makes at DeepSeek-V4.1-Flash shapes (H = 5120, n = 4; first / middle /
    last seams; M = 1, 8, 64; bf16 and fp32) build for sm_90 (Triton's bundled ptxas): types, constexpr use,
    tile shapes. Needs a process that is not interpreting."""
    import os

    from tests.triton_offline import compile_for_hopper, recorded_launches

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("compiles only where triton was imported without the interpreter")
    cases = [(1, torch.bfloat16, "middle"), (8, torch.bfloat16, "first"), (64, torch.bfloat16, "middle"),
             (64, torch.bfloat16, "last"), (3, torch.float32, "middle_no_weight")]
    with recorded_launches() as launches:
        for M, dtype, seam in cases:
            d = _inputs(M, M, 4, 5120, dtype, **SEAMS[seam])
            mk.mhc_seam_triton(d["streams"], d["fn"], d["scale"], d["base"], d["norm_weight"], 1e-20, pre=d["pre"],
                               y=d["y"], post=d["post"], comb=d["comb"], rms_eps=1e-20)
    assert len(launches) == len(cases), "one launch per seam"
    assert compile_for_hopper(launches) == {}


@pytest.mark.parametrize("out_first", [False, True], ids=["out_loop", "out_loaded_first"])
def test_hopper_build_spills_no_registers(mk, monkeypatch, out_first):
    """The seams of the sm_90 build above, at every DeepSeek-V4.1-Flash batch of ``choose_blocks``, through
    ptxas with Triton's own flags: no spill, and few enough registers at 8 warps for two programs per SM
    (the M = 64 grid is about five waves of them; one per SM doubles that). Also with ``OUT_LOAD_FIRST`` (a
    whole 5120-channel row of ``out`` and its gain held across the coefficients at M 1 and 8)."""
    monkeypatch.setattr(mk, "OUT_LOAD_FIRST", out_first)
    import os
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from tests.triton_offline import _signature, recorded_launches

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("compiles only where triton was imported without the interpreter")
    cases = [(M, seam) for M in (1, 8, 64) for seam in ("first", "middle", "last")]
    with recorded_launches() as launches:
        for M, seam in cases:
            d = _inputs(M, M, 4, 5120, torch.bfloat16, **SEAMS[seam])
            mk.mhc_seam_triton(d["streams"], d["fn"], d["scale"], d["base"], d["norm_weight"], 1e-20, pre=d["pre"],
                               y=d["y"], post=d["post"], comb=d["comb"], rms_eps=1e-20)
    assert len(launches) == len(cases)
    for (M, seam), (fn, args, kw) in zip(cases, launches):
        sig, const = _signature(fn, args, kw)
        assert const["OUT_FIRST"] == (out_first and M == 1), (M, seam, const["OUT_FIRST"])
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": kw["num_warps"]})
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.ptx")
            with open(src, "w") as f:
                f.write(k.asm["ptx"])
            log = subprocess.run([get_ptxas(90).path, "-lineinfo", "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a",
                                  src, "-o", src + ".o"], capture_output=True, text=True, check=True).stderr
        assert "0 bytes spill stores, 0 bytes spill loads" in log, (M, seam, log)
        regs = int(log.split("Used ")[1].split(" registers")[0])
        print(f"registers out_first={out_first} M={M} {seam}: {regs}")
        assert regs * 32 * kw["num_warps"] * (2 if kw["num_warps"] == 8 else 1) <= 65536, (M, seam, regs)


@pytest.mark.parametrize("M", [1, 8])
def test_pdl_wait_follows_the_fn_loads_and_precedes_the_rest(mk, monkeypatch, M):
    """With ``PDL`` (the sm_90a SASS, offline): the middle seam issues its fn slice (16-byte loads: 24 rows x 4
    streams x the chunk's channels over the program's threads) before the grid-dependency wait (``ACQBULK``) and no
    other global access: the streams, y, the coefficients and the counters are read and anything is written only
    after the previous kernel has finished. Without ``PDL``: no wait at all."""
    import os

    from latency_specialized.testing.offline_sass import sass_of
    from tests.triton_offline import ptx_for_hopper, recorded_launches

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("compiles only where triton was imported without the interpreter")
    orders = {}
    for pdl in (False, True):
        monkeypatch.setattr(mk, "pdl_enabled", lambda device, on=pdl: on)
        with recorded_launches() as launches:
            d = _inputs(M, M, 4, 5120, torch.bfloat16, **SEAMS["middle"])
            mk.mhc_seam_triton(d["streams"], d["fn"], d["scale"], d["base"], d["norm_weight"], 1e-20, pre=d["pre"],
                               y=d["y"], post=d["post"], comb=d["comb"], rms_eps=1e-20)
        assert launches[0][2].get("launch_pdl", False) == pdl
        (ptx,) = ptx_for_hopper(launches).values()
        orders[pdl] = sass_of(ptx).order
    assert "ACQBULK" not in orders[False]
    order = orders[True]
    wait = order.index("ACQBULK")
    assert order.count("ACQBULK") == 1
    before = [op for op in order[:wait] if op.startswith(("LDG", "STG", "ATOM", "RED", "LD.", "ST."))]
    assert before and all(op.startswith("LDG.E.128") for op in before), before
    _, ch, nw = mk.choose_blocks(M, 5120)
    assert len(before) == 24 * 4 * ch // (32 * nw * 4), before
