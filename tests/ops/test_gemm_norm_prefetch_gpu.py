"""GPU tests of the gemm (GEMV, small-M, split-K), fused RMSNorm and L2-prefetch kernels (H200).

Every case: fresh random inputs (a new seed per test, printed on failure), the output poisoned
with NaN before the call (every element must be written), per-dtype tolerances against the fp32
reference of the op family, odd sizes (N not a multiple of the tile, ragged K, M not a multiple
of 8), and CUDA-graph replay == eager. Run with ``make test-gpu`` (``pytest -m gpu``).
"""

import os

import pytest
import torch

from latency_specialized.ops.allreduce import allreduce_residual_rmsnorm_reference
from latency_specialized.ops.gemm import gemm_reference
from latency_specialized.ops.norm import rmsnorm_reference

from gpu_helpers import graph_replay as _graph_replay

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}


@pytest.fixture(autouse=True)
def _seed(request):
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield seed


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str, seed: int) -> None:
    assert out.shape == ref.shape, what
    assert torch.isfinite(out).all(), f"{what}: unwritten (NaN) or non-finite elements (seed {seed})"
    o, r = out.double(), ref.double()
    rel = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
    worst = ((o - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
    tol = TOL[dtype]
    assert rel <= tol and worst <= 4 * tol, f"{what}: rel err {rel:.3g}, worst {worst:.3g} > {tol} (seed {seed})"


def _nan(shape, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def _graph_equals_eager(fn, out: torch.Tensor) -> None:
    """Capture ``fn`` (which writes ``out``), replay it on a poisoned ``out``: same bits as eager."""
    fn()
    torch.cuda.synchronize()
    eager = out.clone()
    g = _graph_replay(fn)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), "graph replay differs from eager"


# ------------------------------------------------------------------------------------- gemm
def _gemm_inputs(m, n, k, residual):
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 0.05).to(torch.bfloat16)
    r = torch.randn(m, n, device="cuda").to(torch.bfloat16) if residual else None
    return x, w, r


GEMV_CASES = [(1, 7168, 1536, False), (2, 6284, 7168, True), (3, 1000, 448, True), (4, 37, 224, False),
              (1, 513, 128, True), (2, 112, 7168, False)]
SMALL_M_CASES = [(1, 7168, 1536, True), (5, 1000, 448, False), (8, 2304, 1536, True), (9, 37, 224, True),
                 (16, 6284, 7168, False)]
SPLITK_CASES = [(1, 112, 7168, False), (17, 1000, 448, True), (33, 7168, 1536, False), (64, 448, 7168, True),
                (64, 6284, 7168, False)]


def _gemv_cfgs():
    from latency_specialized.kernels.gemm_gemv import GemvConfig

    return (GemvConfig(rows_per_warp=1), GemvConfig(rows_per_warp=2, pdl=False),
            GemvConfig(rows_per_warp=2, lookahead=1), GemvConfig(batch=4, lookahead=2),
            GemvConfig(k_split=2), GemvConfig(warps=8, rows_per_warp=2, k_split=4, batch=4),
            GemvConfig(rows_per_warp=2, lookahead=1, prefetch=True))


def _small_m_cfgs(m, n, k):
    from latency_specialized.kernels.gemm_small_m import MmaConfig, default_config

    nt = 1 if m <= 8 else 2
    return (default_config(n, k, m), MmaConfig(nt=nt, wk=1, cb=2), MmaConfig(nt=nt, wk=4, cb=3))


def _splitk_cfgs(m, n, k):
    from latency_specialized.kernels.gemm_small_m import MmaConfig
    from latency_specialized.kernels.gemm_splitk import splitk_config

    nt = -(-m // 8)
    return (splitk_config(n, k, m), MmaConfig(nt=nt, mt=2, wk=2, sk=4, cb=2), MmaConfig(nt=nt, mt=1, wk=4, sk=2, cb=4))


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Compile every kernel this module uses in parallel when a disk cache is configured (H200 runs)."""
    from latency_specialized.kernels import compile_cache
    from latency_specialized.kernels.gemm_gemv import compile_gemv
    from latency_specialized.kernels.gemm_small_m import compile_mma

    if not torch.cuda.is_available() or compile_cache.disk_dir() is None:
        yield
        return
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_%d%da" % torch.cuda.get_device_capability())
    units = [(compile_gemv, (k, m, c, res)) for m, n, k, res in GEMV_CASES for c in _gemv_cfgs() if c.splits(k)]
    units += [(compile_mma, (k, c, res)) for m, n, k, res in SMALL_M_CASES for c in _small_m_cfgs(m, n, k)]
    units += [(compile_mma, (k, c, res)) for m, n, k, res in SPLITK_CASES for c in _splitk_cfgs(m, n, k)]
    units += [(compile_gemv if kind == "gemv" else compile_mma,
               (k, m, _persistent_cfg(kind, m), res) if kind == "gemv" else (k, _persistent_cfg(kind, m), res))
              for kind, m, n, k, res in PERSISTENT_CASES]
    compile_cache.precompile(units)
    yield


@pytest.mark.parametrize("m,n,k,residual", GEMV_CASES)
def test_gemv_matches_reference(m, n, k, residual, _seed):
    from latency_specialized.kernels.gemm_gemv import gemm_gemv

    x, w, r = _gemm_inputs(m, n, k, residual)
    ref = gemm_reference(x, w, residual=r)
    for cfg in [c for c in _gemv_cfgs() if c.splits(k)]:
        out = _nan((m, n))
        gemm_gemv(x, w, residual=r, out=out, config=cfg)
        _close(out, ref, torch.bfloat16, f"gemv {cfg.label()} M={m} N={n} K={k}", _seed)


@pytest.mark.parametrize("m,n,k,residual", SMALL_M_CASES)
def test_small_m_matches_reference(m, n, k, residual, _seed):
    from latency_specialized.kernels.gemm_small_m import gemm_small_m

    x, w, r = _gemm_inputs(m, n, k, residual)
    ref = gemm_reference(x, w, residual=r)
    for cfg in _small_m_cfgs(m, n, k):
        out = _nan((m, n))
        gemm_small_m(x, w, residual=r, out=out, config=cfg)
        _close(out, ref, torch.bfloat16, f"small_m {cfg.label()} M={m} N={n} K={k}", _seed)


@pytest.mark.parametrize("m,n,k,residual", SPLITK_CASES)
def test_splitk_matches_reference_and_is_deterministic(m, n, k, residual, _seed):
    from latency_specialized.kernels.gemm_splitk import gemm_splitk

    x, w, r = _gemm_inputs(m, n, k, residual)
    ref = gemm_reference(x, w, residual=r)
    for cfg in _splitk_cfgs(m, n, k):
        out = _nan((m, n))
        gemm_splitk(x, w, residual=r, out=out, config=cfg)
        _close(out, ref, torch.bfloat16, f"splitk {cfg.label()} M={m} N={n} K={k}", _seed)
        again = _nan((m, n))
        gemm_splitk(x, w, residual=r, out=again, config=cfg)
        assert torch.equal(out, again), f"splitk {cfg.label()} is not deterministic"


PERSISTENT_CASES = [("gemv", 1, 7168, 1536, True), ("gemv", 2, 3206, 7168, False), ("mma", 3, 7168, 1536, True),
                    ("mma", 12, 7000, 448, False)]


def _persistent_cfg(kind, m):
    from latency_specialized.kernels.gemm_gemv import GemvConfig
    from latency_specialized.kernels.gemm_small_m import MmaConfig

    if kind == "gemv":
        return GemvConfig(rows_per_warp=m, ctas_per_sm=2)
    return MmaConfig(nt=-(-m // 8), wk=4, ctas_per_sm=1)


@pytest.mark.parametrize("kind,m,n,k,residual", PERSISTENT_CASES)
def test_persistent_variants_match_reference(kind, m, n, k, residual, _seed):
    """ctas_per_sm > 0: a capped grid whose CTAs walk several row groups / tiles."""
    from latency_specialized.kernels.gemm_gemv import gemm_gemv
    from latency_specialized.kernels.gemm_small_m import gemm_small_m

    x, w, r = _gemm_inputs(m, n, k, residual)
    cfg = _persistent_cfg(kind, m)
    out = _nan((m, n))
    (gemm_gemv if kind == "gemv" else gemm_small_m)(x, w, residual=r, out=out, config=cfg)
    _close(out, gemm_reference(x, w, residual=r), torch.bfloat16, f"{kind} {cfg.label()} M={m} N={n}", _seed)
    _graph_equals_eager(lambda: (gemm_gemv if kind == "gemv" else gemm_small_m)(x, w, residual=r, out=out,
                                                                                  config=cfg), out)


@pytest.mark.parametrize("m,n_gate,n_latent", [(1, 112, 448), (2, 112, 448), (2, 56, 224), (1, 37, 203),
                                              (3, 112, 448), (4, 112, 448)])
def test_gate_down_split_gemv_matches_reference_and_replays(m, n_gate, n_latent, _seed):
    """moe.gate_down: fp32 router logits + bf16 latent from one GEMV == the two gemm references."""
    from latency_specialized.kernels.gemm_gemv import gate_down_gemv
    from latency_specialized.ops.moe import gate_down_reference

    k = 7168
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = (torch.randn(n_gate + n_latent, k, device="cuda") * k ** -0.5).bfloat16()
    ref_logits, ref_latent = gate_down_reference(x, w, n_gate)
    logits, latent = _nan((m, n_gate), torch.float32), _nan((m, n_latent))
    gate_down_gemv(x, w, n_gate, logits_out=logits, latent_out=latent)
    assert logits.dtype == torch.float32 and latent.dtype == torch.bfloat16
    _close(logits, ref_logits, torch.bfloat16, f"gate_down logits M={m}", _seed)
    # fp32 logits: only the summation order differs from the fp32 reference (no rounding to bf16)
    assert (logits - ref_logits).abs().max().item() <= 1e-4 * ref_logits.abs().max().item()
    _close(latent, ref_latent, torch.bfloat16, f"gate_down latent M={m}", _seed)
    both = torch.cat([logits, latent.float()], dim=1)

    def run():
        gate_down_gemv(x, w, n_gate, logits_out=logits, latent_out=latent)
        both.copy_(torch.cat([logits, latent.float()], dim=1))

    _graph_equals_eager(run, both)


@pytest.mark.parametrize("m,k_split", [(1, 4), (2, 2), (1, 1), (4, 4)])
def test_gate_down_writes_into_strided_slices_of_wider_buffers(m, k_split, _seed):
    """The program's TP path: logits and latent land in this rank's column slices of the gathered
    buffers (row strides 4x wider); the rest of the buffers stays untouched."""
    from latency_specialized.kernels.gemm_gemv import GemvConfig, gemv_split
    from latency_specialized.ops.moe import gate_down_reference

    k, n_gate, n_latent, ranks, rank = 7168, 112, 448, 4, 1
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = (torch.randn(n_gate + n_latent, k, device="cuda") * k ** -0.5).bfloat16()
    ref_logits, ref_latent = gate_down_reference(x, w, n_gate)
    lbuf, xbuf = _nan((m, ranks * n_gate), torch.float32), _nan((m, ranks * n_latent))
    lo, xo = lbuf[:, rank * n_gate:(rank + 1) * n_gate], xbuf[:, rank * n_latent:(rank + 1) * n_latent]
    gemv_split(x, w, n_gate, head_out=lo, tail_out=xo, config=GemvConfig(k_split=k_split))
    assert (lo - ref_logits).abs().max().item() <= 1e-4 * ref_logits.abs().max().item()
    _close(xo, ref_latent, torch.bfloat16, f"gate_down strided latent M={m}", _seed)
    assert torch.isnan(lbuf[:, :rank * n_gate]).all() and torch.isnan(lbuf[:, (rank + 1) * n_gate:]).all()
    assert torch.isnan(xbuf[:, :rank * n_latent]).all() and torch.isnan(xbuf[:, (rank + 1) * n_latent:]).all()


@pytest.mark.parametrize("smem", [False, True], ids=["per_warp", "norm_smem"])
@pytest.mark.parametrize("m,n,k,width", [(1, 2304, 1536, 3648), (2, 2304, 1536, 3648), (2, 1152, 1536, 1536),
                                         (3, 200, 264, 304), (1, 6144, 2048, 2624), (4, 300, 1000, 1000)])
def test_gemv_norm_prologue_matches_norm_then_gemm(m, n, k, width, smem, _seed, monkeypatch):
    """gemm(x, W, norm_weight=g) == gemm_reference(rmsnorm_reference(x, g), W) for x a column slice of a
    wider row (MLA: q_a inside the fused [q_a | kv_a | gate] output), and graph replay == eager - with the
    prologue in every warp and once per CTA in shared memory (``NORM_SMEM``; GLM-5.3's q_b at 2048 x 6144)."""
    from latency_specialized.kernels import gemm_gemv as G
    from latency_specialized.kernels.gemm_gemv import gemm_gemv

    monkeypatch.setattr(G, "NORM_SMEM", smem)

    wide = torch.randn(m, width, device="cuda").bfloat16()
    x = wide[:, :k]
    w = (torch.randn(n, k, device="cuda") * k ** -0.5).bfloat16()
    g = (1 + 0.1 * torch.randn(k, device="cuda")).bfloat16()
    from latency_specialized.kernels.gemm_gemv import GemvConfig

    ref = gemm_reference(x, w, norm_weight=g, norm_eps=1e-6)
    # the default config, and K split over warps (each warp normalises with the whole row's statistics)
    cfgs = [None] + ([GemvConfig(k_split=2), GemvConfig(warps=6, k_split=3)] if k % 768 == 0 else [])
    cfgs += [GemvConfig(ctas_per_sm=2), GemvConfig(rows_per_warp=2, lookahead=1)] if smem else []
    for cfg in cfgs:
        out = _nan((m, n))
        gemm_gemv(x, w, out=out, norm_weight=g, norm_eps=1e-6, config=cfg)
        _close(out, ref, torch.bfloat16, f"gemv+norm {cfg} M={m} N={n} K={k} stride {width}", _seed)
        _graph_equals_eager(lambda: gemm_gemv(x, w, out=out, norm_weight=g, norm_eps=1e-6, config=cfg), out)


@pytest.mark.parametrize("impl,m", [("small_m", 4), ("splitk", 4), ("splitk", 8), ("splitk", 16), ("small_m", 3)])
def test_mma_fp32_output_matches_reference(impl, m, _seed):
    """Router logits on the tensor-core kernels: fp32 out == the fp32 reference up to summation order."""
    from latency_specialized.kernels import gemm_small_m, gemm_splitk

    k, n = 7168, 112
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = (torch.randn(n, k, device="cuda") * k ** -0.5).bfloat16()
    ref = gemm_reference(x, w, out_dtype=torch.float32)
    out = _nan((m, n), torch.float32)
    fn = gemm_small_m.gemm_small_m if impl == "small_m" else gemm_splitk.gemm_splitk
    fn(x, w, out=out, out_dtype=torch.float32)
    assert torch.isfinite(out).all(), f"{impl} M={m}: unwritten elements (seed {_seed})"
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-4, f"{impl} M={m}: fp32 logits rel err {err:.3g} (seed {_seed})"
    _graph_equals_eager(lambda: fn(x, w, out=out, out_dtype=torch.float32), out)


@pytest.mark.parametrize("impl", ["gemv", "small_m", "splitk"])
def test_gemm_graph_replay_equals_eager(impl):
    from latency_specialized.kernels import gemm_gemv, gemm_small_m, gemm_splitk
    from latency_specialized.kernels.gemm_small_m import MmaConfig

    m = {"gemv": 2, "small_m": 11, "splitk": 40}[impl]
    x, w, r = _gemm_inputs(m, 7168, 1536, True)
    out = _nan((m, 7168))
    fns = {
        "gemv": lambda: gemm_gemv.gemm_gemv(x, w, residual=r, out=out),
        "small_m": lambda: gemm_small_m.gemm_small_m(x, w, residual=r, out=out),
        "splitk": lambda: gemm_splitk.gemm_splitk(x, w, residual=r, out=out,
                                                  config=MmaConfig(nt=5, mt=2, wk=4, sk=2, cb=2)),
    }
    _graph_equals_eager(fns[impl], out)


def test_dispatched_gemm_per_site_matches_reference(_seed):
    """Whatever the committed table dispatches for Kimi K3 TP8 at M=1 and 32 runs correctly."""
    from latency_specialized import hardware
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry

    reg = get_registry()
    for batch in (1, 32):
        plan = build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.probe(), tp=8, batch=batch)
        seen = set()
        for ch in plan.choices:
            if ch.site.family != "gemm" or ch.impl is None:
                continue
            n, k = ch.site.ctx.dim("N"), ch.site.ctx.dim("K")
            if (n, k, ch.impl.name) in seen:
                continue
            seen.add((n, k, ch.impl.name))
            x, w, _ = _gemm_inputs(plan.tokens, n, k, False)
            out = _nan((plan.tokens, n))
            ch.impl.fn(x, w, out=out)
            _close(out, gemm_reference(x, w), torch.bfloat16, f"{ch.site.name} via {ch.impl.name}", _seed)


# ------------------------------------------------------------------------------------- norm
NORM_CASES = [
    # n, dtype, rows, residual, weight, zero_centered, gate, cluster
    (7168, torch.bfloat16, 1, True, True, False, False, 1),
    (7168, torch.bfloat16, 64, True, True, False, False, 2),
    (7168, torch.bfloat16, 3, True, True, False, False, 4),
    (3584, torch.bfloat16, 64, False, True, False, False, 1),
    (1536, torch.bfloat16, 5, False, True, True, False, 2),
    (512, torch.bfloat16, 33, True, True, False, False, 1),
    (128, torch.bfloat16, 12 * 7, False, True, False, True, 1),
    (4096, torch.float32, 9, True, True, True, True, 2),
    (1024, torch.float16, 17, True, False, False, False, 1),
    (2048, torch.bfloat16, 2, False, False, False, True, 1),
]


@pytest.mark.parametrize("n,dtype,rows,residual,weight,zc,gate,cluster", NORM_CASES)
def test_rmsnorm_matches_reference(n, dtype, rows, residual, weight, zc, gate, cluster, _seed):
    from latency_specialized.kernels.rmsnorm import NormConfig, rmsnorm_cute

    x = torch.randn(rows, n, device="cuda").to(dtype)
    r = torch.randn(rows, n, device="cuda").to(dtype) if residual else None
    g = torch.randn(rows, n, device="cuda").to(dtype) if gate else None
    w = (0.2 * torch.randn(n, device="cuda") + (0.0 if zc else 1.0)).to(dtype) if weight else None
    ref = rmsnorm_reference(x, w, 1e-5, residual=r, zero_centered=zc, gate=g)
    out = _nan((rows, n), dtype)
    got = rmsnorm_cute(x, w, 1e-5, residual=r, zero_centered=zc, gate=g, out=out, config=NormConfig(cluster=cluster))
    if residual:
        (y, h), (ry, rh) = got, ref
        assert torch.equal(h, rh), "new residual must be bit-exact with the unfused add"
    else:
        y, ry = got, ref
    assert y.data_ptr() == out.data_ptr()
    _close(y, ry, dtype, f"rmsnorm N={n} {dtype} rows={rows} c{cluster}", _seed)


def test_rmsnorm_3d_input_and_graph_replay():
    from latency_specialized.kernels.rmsnorm import NormConfig, rmsnorm_cute

    x = torch.randn(4, 3, 7168, device="cuda").to(torch.bfloat16)
    r = torch.randn(4, 3, 7168, device="cuda").to(torch.bfloat16)
    w = torch.randn(7168, device="cuda").to(torch.bfloat16)
    out = _nan((4, 3, 7168))
    _graph_equals_eager(lambda: rmsnorm_cute(x, w, 1e-5, residual=r, out=out, config=NormConfig(cluster=2)), out)


# Kimi K3 MLA: q_a_norm / kv_a_norm read column slices of the fused [M, 1536 + 512 + 64] projection
STRIDED_NORM_CASES = [(m, lo, hi) for m in (1, 2, 7, 64) for lo, hi in ((1536, 2048), (0, 1536))]


@pytest.mark.parametrize("m,lo,hi", STRIDED_NORM_CASES)
def test_rmsnorm_strided_rows_match_reference_and_contiguous_copy(m, lo, hi, _seed):
    from latency_specialized.kernels.rmsnorm import rmsnorm_cute

    t = torch.randn(m, 2112, device="cuda").to(torch.bfloat16)
    t0 = t.clone()
    x = t[:, lo:hi]
    n = hi - lo
    assert x.is_contiguous() == (m == 1)  # M >= 2: strided rows (the strided_x variant)
    w = (0.2 * torch.randn(n, device="cuda") + 1.0).to(torch.bfloat16)
    out = _nan((m, n))
    y = rmsnorm_cute(x, w, 1e-5, out=out)
    assert y.data_ptr() == out.data_ptr()
    _close(y, rmsnorm_reference(x, w, 1e-5), torch.bfloat16, f"strided rmsnorm M={m} cols {lo}:{hi}", _seed)
    copy = _nan((m, n))
    rmsnorm_cute(x.contiguous(), w, 1e-5, out=copy)
    assert torch.equal(y, copy), "strided rows must give the contiguous copy's bits (same kernel math)"
    fresh = rmsnorm_cute(x, w, 1e-5)  # no out: a fresh contiguous y
    assert fresh.is_contiguous() and torch.equal(fresh, copy)
    torch.cuda.synchronize()
    assert torch.equal(t, t0), "the input tensor must not be written"


def test_rmsnorm_strided_rows_with_residual_cluster_and_graph_replay(_seed):
    from latency_specialized.kernels.rmsnorm import NormConfig, rmsnorm_cute

    t = torch.randn(5, 7168 + 64, device="cuda").to(torch.bfloat16)
    t0 = t.clone()
    x = t[:, 64:]                                   # block mode over a 2-CTA cluster, strided rows
    r = torch.randn(5, 7168, device="cuda").to(torch.bfloat16)
    w = torch.randn(7168, device="cuda").to(torch.bfloat16)
    out = _nan((5, 7168))
    y, h = rmsnorm_cute(x, w, 1e-5, residual=r, out=out, config=NormConfig(cluster=2))
    ry, rh = rmsnorm_reference(x, w, 1e-5, residual=r)
    assert torch.equal(h, rh), "new residual must be bit-exact with the unfused add"
    _close(y, ry, torch.bfloat16, "strided rmsnorm + residual c2", _seed)
    cy, ch = rmsnorm_cute(x.contiguous(), w, 1e-5, residual=r, config=NormConfig(cluster=2))
    assert torch.equal(y, cy) and torch.equal(h, ch)
    _graph_equals_eager(lambda: rmsnorm_cute(x, w, 1e-5, residual=r, out=out, config=NormConfig(cluster=2)), out)
    assert torch.equal(t, t0)


def test_allreduce_local_matches_reference(_seed):
    from latency_specialized.comm.base import LocalCommunicator
    from latency_specialized.kernels.rmsnorm import allreduce_residual_rmsnorm_local

    p = torch.randn(8, 7168, device="cuda").to(torch.bfloat16)
    r = torch.randn(8, 7168, device="cuda").to(torch.bfloat16)
    w = torch.randn(7168, device="cuda").to(torch.bfloat16)
    y, h = allreduce_residual_rmsnorm_local(p, r, w, 1e-5, comm=LocalCommunicator())
    ry, rh = allreduce_residual_rmsnorm_reference(p, r, w, 1e-5, comm=LocalCommunicator())
    assert torch.equal(h, rh)
    _close(y, ry, torch.bfloat16, "allreduce local", _seed)
    none, h2 = allreduce_residual_rmsnorm_local(p, r, None, 1e-5)
    assert none is None and torch.equal(h2, rh)


# --------------------------------------------------------------------------------- prefetch
def test_prefetch_changes_nothing_and_captures_in_a_graph():
    from latency_specialized.kernels.gemm_gemv import gemm_gemv
    from latency_specialized.kernels.prefetch import L2Prefetcher, prefetch_l2_cute

    x = torch.randn(1, 1536, device="cuda").to(torch.bfloat16)
    w = (torch.randn(7168, 1536, device="cuda") * 0.05).to(torch.bfloat16)
    before = w.clone()
    prefetch_l2_cute([w, x], max_bytes=8 << 20)
    pf = L2Prefetcher([w])
    assert pf.bytes == w.numel() * 2
    out = _nan((1, 7168))

    def step():
        pf.start()
        torch.cuda._sleep(20000)
        pf.join()
        gemm_gemv(x, w, out=out)

    _graph_equals_eager(step, out)
    assert torch.equal(w, before)
    torch.testing.assert_close(out.float(), gemm_reference(x, w).float(), rtol=1e-2, atol=1e-2)
