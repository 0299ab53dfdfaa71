"""CPU tests of routed experts with a per-route result and the ``moe.finalize`` op family.

* ``experts_reference(..., per_route=True)``: row (m, j) is expert ids[m, j] applied to x[m],
  unweighted; weighting and summing the rows yourself gives the combined result;
* ``finalize_reference`` against a direct, route-by-route transcription of Muse Spark's
  input-scaled post-norm (transformers ``MuseSparkTextInputScaledRMSNorm``: ``z = round(e * (1 + g))``,
  ``z * rsqrt(mean(z^2) + eps)`` in fp32) and the fp32 weighted sum, in float64; the other gain modes;
  the TP order (all-reduce the per-route partial rows *before* the norm);
* registrations and support rules (the Triton kernel refuses the CPU, wide rows, many routes);
* the CuTe DSL per-route ``down`` variant compiles for sm_90a (PTX: no shared-memory combine);
* under the Triton interpreter (``tests/interpret.py``): ``moe.finalize.triton`` and the Triton fused
  experts' per-route mode against the references, outputs poisoned with NaN.

GPU cases at Muse Spark's TP8 shapes: ``tests/ops/test_moe_finalize_gpu.py``.
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest
import torch

from latency_specialized.ops.moe import experts_reference, finalize_reference
from latency_specialized.ops.registry import make_context
from latency_specialized.spec import ActivationSpec

from tests.interpret import run_interpreted

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
interpreted = pytest.mark.interpreter_case
"""Needs TRITON_INTERPRET=1 from the process start: collected only there (the driver below runs these)."""

SWIGLU = ActivationSpec(kind="swiglu")
SITU = ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)
MUSE_EPS = 1e-8


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _experts_case(seed, M, E=12, k=4, K=64, I=32, N=48, dtype=torch.bfloat16, same=False):
    g = _gen(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, K, generator=g) * K ** -0.5).to(dtype)
    w2 = (torch.randn(E, N, I, generator=g) * I ** -0.5).to(dtype)
    logits = torch.randn(1 if same else M, E, generator=g)
    ids = logits.topk(k, dim=-1).indices.expand(M, k).contiguous()
    w = torch.rand(M, k, generator=g) + 0.05
    return x, w / w.sum(-1, keepdim=True), ids, w13, w2


# ------------------------------------------------------------------------------ experts per route
@pytest.mark.parametrize("M,same", [(1, False), (5, False), (5, True)])
@pytest.mark.parametrize("act", [SWIGLU, SITU], ids=["swiglu", "situ"])
def test_experts_reference_per_route_weighted_and_summed_is_the_combined_result(M, same, act):
    x, w, ids, w13, w2 = _experts_case(M * 10 + same, M, same=same)
    rows = experts_reference(x, w, ids, w13, w2, act, per_route=True)
    assert rows.shape == (M, ids.shape[1], w2.shape[1]) and rows.dtype == x.dtype
    combined = experts_reference(x, w, ids, w13, w2, act)
    mine = (rows.float() * w.unsqueeze(-1)).sum(1).to(x.dtype)
    # the same fp32 terms, summed in another order: equal up to one bf16 rounding of the sum
    torch.testing.assert_close(mine.float(), combined.float(), rtol=8e-3, atol=1e-3)
    # fp32 activations: no rounding in between, equal to fp32 accumulation order
    x32, w13_32, w2_32 = x.float(), w13.float(), w2.float()
    rows32 = experts_reference(x32, w, ids, w13_32, w2_32, act, per_route=True)
    torch.testing.assert_close((rows32 * w.unsqueeze(-1)).sum(1), experts_reference(x32, w, ids, w13_32, w2_32, act),
                               rtol=1e-5, atol=1e-6)


def test_experts_reference_per_route_rows_are_the_selected_experts_unweighted():
    from latency_specialized.ops.activation import gated_activation

    M, k = 3, 4
    x, w, ids, w13, w2 = _experts_case(7, M, k=k)
    I = w13.shape[1] // 2
    rows = experts_reference(x, w, ids, w13, w2, SWIGLU, per_route=True)
    for m in range(M):
        for j in range(k):
            e = int(ids[m, j])
            gu = (x[m].float() @ w13[e].float().t()).to(x.dtype).float()
            h = gated_activation(gu[:I], gu[I:], SWIGLU).to(x.dtype).float()
            want = (h @ w2[e].float().t()).to(x.dtype)
            torch.testing.assert_close(rows[m, j].float(), want.float(), rtol=8e-3, atol=1e-3)
    # the weights are ignored: None, NaN or other weights give the same rows
    assert torch.equal(experts_reference(x, None, ids, w13, w2, SWIGLU, per_route=True), rows)
    assert torch.equal(experts_reference(x, torch.full_like(w, float("nan")), ids, w13, w2, SWIGLU,
                                         per_route=True), rows)
    out = torch.full_like(rows, float("nan"))
    assert experts_reference(x, w, ids, w13, w2, SWIGLU, per_route=True, out=out) is out
    assert torch.equal(out, rows)


# ------------------------------------------------------------------------------ finalize reference
def _transformers_style(y, weights, gain, eps, *, gain_before_norm=True, zero_centered=True):
    """Route by route, as the model writes it (float64 after the one rounding of the scaled row)."""
    M, k, N = y.shape
    out = torch.zeros(M, N, dtype=torch.float64)
    g = None if gain is None else (1.0 + gain.float() if zero_centered else gain.float())
    for m in range(M):
        for j in range(k):
            e = y[m, j]
            if g is not None and gain_before_norm:
                z = (e.float() * g).to(y.dtype).double()  # MuseSparkTextInputScaledRMSNorm: scale, round
            else:
                z = e.double()
            r = z / torch.sqrt(z.pow(2).mean() + eps)
            if g is not None and not gain_before_norm:
                r = r * g.double()
            out[m] += float(weights[m, j]) * r
    return out


def _finalize_case(seed, M, k, N, dtype=torch.bfloat16, gain_dtype=torch.bfloat16):
    g = _gen(seed)
    # route rows of very different scales (the norm removes it), one all-zero route (eps keeps it finite)
    scale = torch.exp(torch.randn(M, k, 1, generator=g) * 2)
    y = (torch.randn(M, k, N, generator=g) * scale).to(dtype)
    if M > 1:
        y[1, 0] = 0
    w = torch.rand(M, k, generator=g) + 0.05
    gain = (0.2 * torch.randn(N, generator=g)).to(gain_dtype)
    return y, w / w.sum(-1, keepdim=True), gain


MODES = [dict(gain_before_norm=True, zero_centered=True), dict(gain_before_norm=False, zero_centered=True),
         dict(gain_before_norm=True, zero_centered=False), dict(gain_before_norm=False, zero_centered=False)]


@pytest.mark.parametrize("mode", MODES, ids=["input_scaled_zc", "after_zc", "input_scaled", "after"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_finalize_reference_is_the_route_by_route_formula(mode, dtype):
    y, w, gain = _finalize_case(3, 4, 8, 96, dtype)
    got = finalize_reference(y, w, gain, MUSE_EPS, **mode)
    assert got.shape == (4, 96) and got.dtype == dtype
    want = _transformers_style(y, w, gain, MUSE_EPS, **mode)
    tol = dict(rtol=8e-3, atol=8e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), want, **tol)
    assert not got.isnan().any()


def test_finalize_reference_weightless_and_out():
    y, w, _ = _finalize_case(4, 3, 8, 64)
    got = finalize_reference(y, w, None, MUSE_EPS, gain_before_norm=False)
    torch.testing.assert_close(got.double(), _transformers_style(y, w, None, MUSE_EPS), rtol=8e-3, atol=8e-3)
    # the gain modes do not matter without a gain
    assert torch.equal(finalize_reference(y, w, None, MUSE_EPS), got)
    wide = torch.full((3, 80), float("nan"), dtype=y.dtype)
    out = wide[:, 8:72]  # a strided column slice
    assert finalize_reference(y, w, None, MUSE_EPS, out=out) is out and torch.equal(out, got)
    assert wide[:, :8].isnan().all() and wide[:, 72:].isnan().all()
    with pytest.raises(ValueError, match="M, top_k, N"):
        finalize_reference(y[0], w, None, MUSE_EPS)
    with pytest.raises(ValueError, match=r"gain \(63,\)"):
        finalize_reference(y, w, torch.zeros(63), MUSE_EPS)


def test_finalize_input_scaling_rounds_to_the_activation_dtype():
    """Input-scaled: the scaled row is rounded to bf16 before the norm (an fp32 scale differs)."""
    y, w, gain = _finalize_case(5, 8, 8, 512, gain_dtype=torch.float32)
    got = finalize_reference(y, w, gain, MUSE_EPS)
    g = 1.0 + gain
    r = y.float() * g
    unrounded = ((r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + MUSE_EPS)) * w.unsqueeze(-1)).sum(1)
    assert not torch.equal(got, unrounded.to(y.dtype))  # the rounding is visible ...
    torch.testing.assert_close(got.float(), unrounded, rtol=2e-2, atol=2e-2)  # ... at bf16 size


def test_tp_partial_rows_are_all_reduced_before_the_norm():
    """At TP > 1 each rank's experts see a slice of the expert width: its per-route rows are partial sums.
    finalize of the summed rows is the full model's result; the sum of per-rank finalizes is not."""
    M, E, k, K, I, N, tp = 4, 10, 4, 64, 32, 48, 2
    x, w, ids, w13, w2 = _experts_case(9, M, E=E, k=k, K=K, I=I, N=N, dtype=torch.float32)
    gain = 0.2 * torch.randn(N, generator=_gen(10))
    full = finalize_reference(experts_reference(x, w, ids, w13, w2, SWIGLU, per_route=True), w, gain, MUSE_EPS)
    s = I // tp
    parts = []
    for r in range(tp):
        gate, up = w13[:, r * s:(r + 1) * s], w13[:, I + r * s:I + (r + 1) * s]
        parts.append(experts_reference(x, w, ids, torch.cat([gate, up], 1).contiguous(),
                                       w2[:, :, r * s:(r + 1) * s].contiguous(), SWIGLU, per_route=True))
    reduced = finalize_reference(sum(parts), w, gain, MUSE_EPS)
    torch.testing.assert_close(reduced, full, rtol=1e-4, atol=1e-5)
    wrong = sum(finalize_reference(p, w, gain, MUSE_EPS) for p in parts)
    assert (wrong - full).abs().max() > 0.1


# ------------------------------------------------------------------------------ registrations
def test_family_and_implementations_are_registered():
    from latency_specialized.ops.registry import FAMILIES
    from latency_specialized.plugins import get_registry

    assert "moe.finalize" in FAMILIES
    impls = get_registry().implementations
    assert impls.reference("moe.finalize").name == "moe.finalize.reference"
    names = [i.name for i in impls.family("moe.finalize")]
    assert names == ["moe.finalize.triton", "moe.finalize.reference"]
    cpu = make_context("moe.finalize", arch="cpu", dtype="bfloat16", tokens=1, dims=dict(N=4096, topk=8))
    chosen, refusals = impls.select(cpu)
    assert chosen.name == "moe.finalize.reference" and refusals[0][0] == "moe.finalize.triton"


def test_finalize_triton_supports_names_the_reason():
    from latency_specialized.kernels.moe_finalize_triton import MAX_N, MAX_TOPK, _supports

    def ctx(arch="sm_90", dtype="bfloat16", **dims):
        return make_context("moe.finalize", arch=arch, dtype=dtype, tokens=8,
                            dims=dims if dims else dict(N=4096, topk=8))

    if not _HAVE_TRITON:
        assert "triton" in _supports(ctx())
        return
    assert _supports(ctx()) is True  # Muse TP8 rank: N 4096, top-8
    assert _supports(ctx(dtype="float32")) is True
    assert "CUDA GPU" in _supports(ctx(arch="cpu"))
    assert "dtype float64" in _supports(ctx(dtype="float64"))
    assert f"> {MAX_N}" in _supports(ctx(N=MAX_N * 2, topk=8))
    assert f"> {MAX_TOPK}" in _supports(ctx(N=4096, topk=MAX_TOPK + 1))
    assert "no N" in _supports(ctx(K=4096))


def test_experts_implementations_serve_per_route_sites():
    """per_route is a site attr; no moe.experts implementation refuses a site for it (each one's answer is
    the same with and without it)."""
    from latency_specialized.plugins import get_registry

    dims = dict(E=256, topk=8, N=512, K=4096)  # Muse Spark TP8 rank: latent 4096, expert width 4096 / 8
    impls = get_registry().implementations.family("moe.experts")
    assert {"moe.experts.cutedsl", "moe.experts.triton_fused", "moe.experts.reference"} <= {i.name for i in impls}
    for tokens in (1, 4, 8, 64):
        for act in ("swiglu", "situ_glu"):
            def ctx(pr):
                return make_context("moe.experts", arch="sm_90", dtype="bfloat16", tokens=tokens, dims=dims,
                                    attrs=dict(activation=act, per_route=pr))
            for impl in impls:
                assert impl.supports(ctx(True)) == impl.supports(ctx(False)), (impl.name, tokens, act)


needs_cute = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed")


@needs_cute
@pytest.mark.parametrize("M", [1, 8])
def test_cutedsl_per_route_down_compiles_without_the_combine(monkeypatch, M):
    """per_route is a compile-time flag of ``down`` only: no shared-memory accumulators, no barrier, no
    weights read; gate_up is the very same compiled kernel."""
    from latency_specialized.kernels import moe_experts as me
    from latency_specialized.kernels.compile_cache import cute_available

    if cute_available() is not True:
        pytest.skip("nvidia-cutlass-dsl not usable here")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.delenv("LS_KERNEL_CACHE_DIR", raising=False)
    base = me.make_config(M, 4096, 512, 4096, 8, torch.bfloat16, torch.int64, SWIGLU)
    pr = me.make_config(M, 4096, 512, 4096, 8, torch.bfloat16, torch.int64, SWIGLU, per_route=True)
    assert pr.per_route and not base.per_route
    assert me.compile_gate_up(pr) is me.compile_gate_up(base)
    dn, dn_pr = me.ptx_of(me.compile_down(base)), me.ptx_of(me.compile_down(pr))
    assert "bar.sync" in dn and "st.shared" in dn
    assert "bar.sync" not in dn_pr and "st.shared" not in dn_pr and ".local" not in dn_pr
    v4 = r"ld\.global[\w.:]*\.v4"
    assert len(re.findall(v4, dn_pr)) == len(re.findall(v4, dn))  # the same weight / h stream
    # the routing weights are not read (ids, counts, members, weights and h stay)
    assert len(re.findall(r"ld\.global", dn_pr)) < len(re.findall(r"ld\.global", dn))
    if M == 1:
        assert "griddepcontrol.wait" in dn_pr  # the batch-1 PDL edge is unchanged


# ------------------------------------------------------------------------------ Triton interpreter
@pytest.mark.interpreter_driver
@pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (its interpreter runs the kernels on the CPU)")
def test_kernel_cases_under_the_interpreter():
    run_interpreted(__file__, min_passed=23)


@interpreted
@pytest.mark.parametrize("mode", MODES + [None], ids=["input_scaled_zc", "after_zc", "input_scaled", "after",
                                                     "weightless"])
@pytest.mark.parametrize("M,k,N", [(1, 8, 256), (5, 3, 200)])
@pytest.mark.parametrize("tile", [True, False], ids=["all_routes", "route_loop"])
def test_finalize_triton_matches_reference(mode, M, k, N, tile, monkeypatch):
    """Both forms: the token's route rows as one tile (every load before the reduction) and the route loop that
    wider tokens take (``ALL_ROUTES_MAX`` 0 forces it)."""
    from latency_specialized.kernels import moe_finalize_triton as mf
    from latency_specialized.kernels.moe_finalize_triton import finalize_triton

    assert os.environ.get("TRITON_INTERPRET") == "1"
    if not tile:
        monkeypatch.setattr(mf, "ALL_ROUTES_MAX", 0)
    assert mf.all_routes(k, 1 << (N - 1).bit_length()) is tile
    # fp32 rows (the interpreter's bf16 casts are unreliable): the kernel's arithmetic is dtype-generic
    y, w, gain = _finalize_case(M * 100 + k, M, k, N, dtype=torch.float32, gain_dtype=torch.float32)
    kw = mode or {}
    g = gain if mode is not None else None
    want = finalize_reference(y, w, g, MUSE_EPS, **kw)
    out = torch.full((M, N), float("nan"))
    assert finalize_triton(y, w, g, MUSE_EPS, out=out, **kw) is out
    assert not out.isnan().any(), "output left unwritten"
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@interpreted
def test_finalize_triton_strided_inputs_and_output_bf16():
    from latency_specialized.kernels.moe_finalize_triton import finalize_triton

    M, k, N = 3, 8, 128
    y, w, gain = _finalize_case(31, M, k, N, dtype=torch.bfloat16)
    big = torch.full((M, k + 1, N + 16), float("nan"), dtype=torch.bfloat16)
    big[:, 1:, 16:] = y
    ys = big[:, 1:, 16:]  # strided routes and rows
    ws = torch.cat([torch.full((M, 1), float("nan")), w], 1)[:, 1:]
    wide = torch.full((M, N + 8), float("nan"), dtype=torch.bfloat16)
    out = wide[:, 8:]
    finalize_triton(ys, ws, gain, MUSE_EPS, out=out)
    assert not out.isnan().any() and wide[:, :8].isnan().all()
    want = finalize_reference(y, w, gain, MUSE_EPS)
    # one bf16 rounding of the scaled row may differ by an ulp under the interpreter: bf16 tolerance
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


@interpreted
@pytest.mark.parametrize("M", [1, 6])
def test_triton_experts_per_route_matches_reference(M):
    from latency_specialized.kernels.moe_experts_triton import experts_triton

    x, w, ids, w13, w2 = _experts_case(40 + M, M, E=24, k=4, K=128, I=64, N=96)
    ids = ids.to(torch.int32)
    want = experts_reference(x, w, ids.long(), w13, w2, SITU, per_route=True)
    out = torch.full((M, 4, 96), float("nan"), dtype=torch.bfloat16)
    assert experts_triton(x, w, ids, w13, w2, SITU, per_route=True, out=out) is out
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    # weights are ignored; the combined mode is unchanged
    assert torch.equal(experts_triton(x, None, ids, w13, w2, SITU, per_route=True), out)
    comb = experts_triton(x, w, ids, w13, w2, SITU)
    torch.testing.assert_close(comb.float(), experts_reference(x, w, ids.long(), w13, w2, SITU).float(),
                               rtol=2e-2, atol=2e-2)
    # a strided destination (a [M, k, N] slice of a wider buffer)
    wide = torch.full((M, 4, 128), float("nan"), dtype=torch.bfloat16)
    experts_triton(x, w, ids, w13, w2, SITU, per_route=True, out=wide[:, :, 16:112])
    assert torch.equal(wide[:, :, 16:112], out) and wide[:, :, :16].isnan().all() and wide[:, :, 112:].isnan().all()
