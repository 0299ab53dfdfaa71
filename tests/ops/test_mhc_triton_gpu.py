"""residual.mhc.triton on the GPU: DeepSeek-V4.1-Flash seams (n = 4, H = 5120, fn [24, 20480] fp32), CUDA graphs.

Every case: fresh random inputs (streams, sublayer output, post, comb, carried pre, fn, base, scale, norm
weight); the kernel module's ``torch.empty`` poisoned with NaN (``out``, the coefficients, the partial
records) and ``out=`` NaN-filled; the first seam (no ``y``, no carried pre), a middle one, the last (no
``fn``); M = 1, 3, 8, 64 (one to sixteen row blocks), H = 5120, 1024 and 5000 (a partial last chunk); bf16
and fp32 streams. Compared with ``mhc_seam_reference`` end to end (per-dtype tolerance: a bf16 stream
element may round one ulp the other way) and, tightly, with the reference fed the streams the kernel
stored. Graphs: one captured seam replays bit-identically to the eager call for new inputs, twice in a row
(the counters reset by each launch); a captured chain first -> middle -> last seam equals the eager chain.
Run on the H200: ``pytest -m gpu tests/ops/test_mhc_triton_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.kernels import mhc_triton as mk
from latency_specialized.ops.residual_mhc import mhc_seam_reference

from gpu_helpers import graph_replay, seeded_generator as _gen

pytestmark = pytest.mark.gpu

DEV = "cuda"
N_STREAMS = 4
EPS = 1e-20        # DeepSeek-V4.1-Flash's rms_norm_eps (models/deepseek_v41_flash/spec.py), also the mix's
TOL = {torch.float32: dict(streams=(1e-5, 1e-5), x=(1e-4, 1e-4), coef=(1e-4, 1e-5), own_x=(1e-4, 1e-4)),
       torch.bfloat16: dict(streams=(2 ** -7, 1e-2), x=(2e-2, 2e-2), coef=(2e-2, 1e-2), own_x=(2 ** -6, 1e-3))}
"""(rtol, atol). fp32: the GPU's fp32 sums (and tl.exp / rsqrt) in another order than torch's."""




def _inputs(seed, M, H, dtype, *, y=True, pre=True, fn=True, n=N_STREAMS):
    g = _gen(seed, DEV)
    X = (2 + n) * n
    r = lambda *s: torch.randn(*s, generator=g, device=DEV)   # noqa: E731
    d = dict(streams=(r(M, n, H) * 2 + 0.3).to(dtype))
    d["fn"] = r(X, n * H) * (n * H) ** -0.5 * 4 if fn else None
    d["scale"] = torch.rand(3, generator=g, device=DEV) + 0.5 if fn else None
    d["base"] = r(X) * 0.5 if fn else None
    d["norm_weight"] = (1.0 + 0.2 * r(H)).to(dtype)
    d["pre"] = torch.rand(M, n, generator=g, device=DEV) + 0.1 if pre else None
    d["y"] = (r(M, H) * 3).to(dtype) if y else None
    d["post"] = torch.rand(M, n, generator=g, device=DEV) * 2 if y else None
    d["comb"] = torch.softmax(r(M, n, n) * 2, -1) if y else None
    return d


def _kw(d):
    return dict(pre=d["pre"], y=d["y"], post=d["post"], comb=d["comb"], rms_eps=EPS, hc_eps=1e-6, post_mult=2.0,
                sinkhorn_iters=20)


def _args(d):
    return d["fn"], d["scale"], d["base"], d["norm_weight"], EPS


def _close(got, want, own, dtype, y_none_streams=None):
    tol = TOL[dtype]
    scale = want[0].float().abs().max().item()
    assert not torch.isnan(got[0]).any(), "x left unwritten"
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=tol["x"][0], atol=tol["x"][1] * scale)
    torch.testing.assert_close(got[0].float(), own[0].float(), rtol=tol["own_x"][0], atol=tol["own_x"][1] * scale)
    for a, b, c in zip(got[1:], want[1:], own[1:]):
        if b is None:
            assert a is None
            continue
        assert not torch.isnan(a).any(), "a coefficient left unwritten"
        torch.testing.assert_close(a, b, rtol=tol["coef"][0], atol=tol["coef"][1])
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)


SEAMS = {"first": dict(y=False, pre=False), "middle": {}, "last": dict(fn=False)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("H", [5120, 1024, 5000])
@pytest.mark.parametrize("M", [1, 3, 8, 64])
@pytest.mark.parametrize("seam", sorted(SEAMS))
def test_matches_reference(poisoned, seam, M, H, dtype):
    d = _inputs(f"{seam}-{M}-{H}-{dtype}", M, H, dtype, **SEAMS[seam])
    s_ref, s_tri = d["streams"].clone(), d["streams"].clone()
    want = mhc_seam_reference(s_ref, *_args(d), **_kw(d))
    out = torch.full((M, H), float("nan"), device=DEV, dtype=dtype)
    got = mk.mhc_seam_triton(s_tri, *_args(d), **_kw(d), out=out)
    torch.cuda.synchronize()
    assert got[0] is out
    if d["y"] is None:
        assert torch.equal(s_tri, d["streams"])
    tol = TOL[dtype]
    torch.testing.assert_close(s_tri.float(), s_ref.float(), rtol=tol["streams"][0], atol=tol["streams"][1])
    own = mhc_seam_reference(s_tri.clone(), *_args(d), **dict(_kw(d), y=None, post=None, comb=None))
    _close(got, want, own, dtype)
    assert not mk.counter(s_tri.device).any()


@pytest.mark.parametrize("out_first", [False, True], ids=["out_loop", "out_loaded_first"])
@pytest.mark.parametrize("M", [1, 8, 64])
def test_graph_replay_equals_eager_twice(monkeypatch, M, out_first):
    """A captured seam (streams restored from a copy first: the seam writes them) replays the eager call's
    bits for new inputs copied into its buffers, and a second replay gives the same bits again; both right. Also
    with ``OUT_LOAD_FIRST`` (the tail's rescale of ``out`` loaded before the coefficients, one row per block)."""
    monkeypatch.setattr(mk, "OUT_LOAD_FIRST", out_first)
    H, dtype = 5120, torch.bfloat16
    d = _inputs(f"graph-{M}", M, H, dtype)
    src = d["streams"].clone()
    res = {}

    def step():
        d["streams"].copy_(src)
        res["out"] = mk.mhc_seam_triton(d["streams"], *_args(d), **_kw(d))

    g = graph_replay(step)
    new = _inputs(f"graph-{M}-new", M, H, dtype)
    for k, v in new.items():
        if k != "streams":
            d[k].copy_(v)
    src.copy_(new["streams"])
    g.replay()
    torch.cuda.synchronize()
    first = [t.clone() for t in res["out"]] + [d["streams"].clone()]
    g.replay()
    torch.cuda.synchronize()
    second = [t.clone() for t in res["out"]] + [d["streams"].clone()]
    s_eager = new["streams"].clone()
    eager = list(mk.mhc_seam_triton(s_eager, *_args(new), **_kw(new))) + [s_eager]
    torch.cuda.synchronize()
    for a, b, c in zip(first, second, eager):
        assert torch.equal(a, b), "two replays differ (a counter not reset?)"
        assert torch.equal(a, c), "replay differs from the eager call"
    want = mhc_seam_reference(new["streams"].clone(), *_args(new), **_kw(new))
    own = mhc_seam_reference(s_eager.clone(), *_args(new), **dict(_kw(new), y=None, post=None, comb=None))
    _close(first[:4], want, own, dtype)


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("M", [1, 8])
def test_captured_chain_of_seams_equals_eager(monkeypatch, pdl, M):
    """first (attention) -> middle (FFN) -> last seam as a model step runs them, the coefficients of one seam
    feeding the next, inside one graph: equal to the eager chain (launched without PDL), replay after replay.
    With ``PDL`` each seam launches early behind the torch kernel that makes its ``y`` (an add reading the seam
    before): a read of y, the streams or the coefficients ahead of its ``gdc_wait`` would change the bits."""
    H, dtype = 5120, torch.bfloat16
    a = _inputs("chain-a", M, H, dtype, y=False, pre=False)
    b = _inputs("chain-b", M, H, dtype)
    ys = [b["y"], (torch.randn(M, H, generator=_gen("chain-y", DEV), device=DEV) * 3).to(dtype)]
    src = a["streams"].clone()

    def chain(streams):
        x1, pre1, post1, comb1 = mk.mhc_seam_triton(streams, *_args(a), **_kw(a))
        x2, pre2, post2, comb2 = mk.mhc_seam_triton(streams, *_args(b), pre=pre1, y=ys[0] + x1, post=post1,
                                                    comb=comb1, rms_eps=EPS, hc_eps=1e-6, sinkhorn_iters=20)
        x3, *_ = mk.mhc_seam_triton(streams, None, None, None, b["norm_weight"], EPS, pre=pre2, y=ys[1] - x2,
                                    post=post2, comb=comb2, rms_eps=EPS, hc_eps=1e-6)
        return [x1, pre1, post1, comb1, x2, pre2, post2, comb2, x3, streams]

    res = {}

    def step():
        a["streams"].copy_(src)
        res["out"] = chain(a["streams"])

    monkeypatch.setattr(mk, "PDL", pdl)
    assert mk.pdl_enabled(src.device) == pdl, "PDL asked for but not available (sm_90+, Triton with gdc_wait)"
    g = graph_replay(step)
    outs = []
    for _ in range(2):
        g.replay()
        torch.cuda.synchronize()
        outs.append([t.clone() for t in res["out"]])
    monkeypatch.setattr(mk, "PDL", False)
    eager = chain(src.clone())
    torch.cuda.synchronize()
    for u, v, w in zip(outs[0], outs[1], eager):
        assert torch.equal(u, v) and torch.equal(u, w)


def mhc_timing(M: int = 1, H: int = 5120, *, rotations: int = 32, replays: int = 40) -> dict[str, float]:
    """Median us per middle seam (not a test): ours and the reference, each captured as ``rotations`` calls
    over distinct inputs (fn and streams rotated beyond the L2), CUDA events over replays. The full
    comparison with the stock stand-in and the block sweep: ``benchmarks/scripts/mhc_bench.py``."""
    from latency_specialized.bench.ops_bench_moe_kda import time_graph

    sets = [_inputs(f"time-{M}-{r}", M, H, torch.bfloat16) for r in range(rotations)]
    mk.counter(torch.device(DEV, torch.cuda.current_device()))
    res = {}
    for name, f in (("triton", mk.mhc_seam_triton), ("reference", mhc_seam_reference)):
        res[name] = time_graph(lambda r, f=f: f(sets[r]["streams"], *_args(sets[r]), **_kw(sets[r])), rotations,
                               replays=replays)
    return res
