"""CPU tests of the block-FP8 gemms (``gemm.fp8_w8a16_triton`` / ``gemm.fp8_w8a8_triton``, weights kept as stored).

* the reference takes a ``QuantizedWeight`` and equals the reference over the dequantised weight;
* dispatch: a site with ``weight_format`` fp8-block-* goes to the FP8 gemms on sm_90, never to a bf16 gemm; the
  reasons name the fix; bad weights (bf16, other formats, ue8m0 bytes the kernel cannot decode) are UserErrors;
* under the Triton interpreter (``tests/interpret.py``): the kernel's e4m3 rounding equals torch's for every e4m3
  value, midpoint and random values; both paths, both scale layouts (fp32 128 x 128, ue8m0 32 x 32), split-K 1 and
  several, odd M / N / K, residual, strided output rows, poisoned outputs: W8A16 matches the dequantising
  reference, W8A8 matches the reference over its own activation rounding and the dequantising one within
  e4m3's error; the split-K tickets are back at zero after every call and repeated calls are bit-identical;
* offline sm_90 compile (no GPU): W8A8 runs e4m3 x e4m3 ``wgmma``, W8A16 bf16 ``wgmma``, split-K an acq_rel ticket.
The GPU tests (``test_gemm_fp8_gpu.py``) repeat the numerics at real shard shapes and check graph replay.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.gemm import gemm_reference
from latency_specialized.ops.registry import make_context
from latency_specialized.quant.checkpoint_io import QuantizedWeight, quantize_weight

from tests.interpret import run_interpreted

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
interpreted = pytest.mark.interpreter_case

A16_TOL = 1.0 / 128
"""W8A16 vs the dequantising reference, max |diff| / max |ref|: one bf16 rounding of the output (2^-8 relative) plus
the fp32 sums in another order."""
A8_SELF_TOL = 1.0 / 128
"""W8A8 vs the reference over the same e4m3 activation codes and scales: as A16_TOL."""
A8_TOL = 6e-2
"""W8A8 vs the dequantising (bf16-activation) reference: e4m3 keeps 3 mantissa bits (<= 1/16 relative per
element, about 1/16 / sqrt(3) rms); over K terms the relative error of a sum stays near that rms."""


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weight(seed: int, N: int, K: int, fmt: str) -> QuantizedWeight:
    g = _gen(seed)
    # rows of different magnitudes: the per-block scales differ across blocks
    w = torch.randn(N, K, generator=g) * K ** -0.5 * torch.logspace(-1, 1, N).unsqueeze(1)
    return quantize_weight("layer.proj.weight", w, fmt)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


def _ctx(tokens: int, fmt: str | None = "fp8-block-128", arch: str = "sm_90a", N: int = 6144, K: int = 2048):
    attrs = {"weight_format": fmt} if fmt else {}
    return make_context("gemm", arch=arch, dtype="bfloat16", tokens=tokens, dims=dict(N=N, K=K), attrs=attrs)


# ------------------------------------------------------------------------------ reference
@pytest.mark.parametrize("fmt", ["fp8-block-128", "fp8-block-32"])
def test_reference_dequantises_block_fp8_weights(fmt):
    w = _weight(1, 96, 200, fmt)
    x = torch.randn(3, 200, generator=_gen(2)).bfloat16()
    r = torch.randn(3, 96, generator=_gen(3)).bfloat16()
    assert torch.equal(gemm_reference(x, w, residual=r), gemm_reference(x, w.dequantize(), residual=r))
    # e4m3 x a power-of-two scale is exact in bf16; e4m3 x an fp32 scale is not
    if fmt == "fp8-block-32":
        assert torch.equal(w.dequantize(torch.bfloat16).float(), w.dequantize())


# ------------------------------------------------------------------------------ dispatch
def test_fp8_sites_go_to_the_fp8_gemms_and_bf16_gemms_refuse():
    from latency_specialized.kernels import gemm_fp8_triton as f8
    from latency_specialized.plugins import get_registry

    from latency_specialized.kernels import gemm_fp8_mma
    from latency_specialized.kernels.compile_cache import cute_available

    impls = get_registry().implementations
    fp8_names = {f8.NAME_A16, f8.NAME_A8}
    # the CuTe DSL mma kernel first where it is installed (K % 64 == 0 here), else the Triton W8A16
    first = gemm_fp8_mma.NAME if cute_available() is True else f8.NAME_A16
    for fmt in f8.FORMATS:
        for m in (1, 8, 64):
            ctx = _ctx(m, fmt)
            ok = {i.name for i in impls.family("gemm") if i.supports(ctx) is True and not i.is_reference}
            assert ok == fp8_names | {first}, (fmt, m, ok)
            assert "block-FP8 gemms serve these" in impls.get("gemm.cublas").supports(ctx)
            assert impls.select(ctx)[0].name == first
    chosen, refusals = impls.select(_ctx(1, arch="cpu"))
    assert chosen.name == "gemm.reference" and any(n == f8.NAME_A8 and "CUDA" in why for n, why in refusals)
    # bf16 sites: the fp8 gemms refuse and say why
    # behind a norm site the norm-prologue variant serves up to NORM_MAX_M rows (0 since the H200 measured it slower
    # than the norm kernel + the gemm): then the plain gemm serves and the norm site runs
    assert impls.get(f8.NAME_A16_NORM).norm_prologue
    for m in (1, f8.NORM_MAX_M, f8.NORM_MAX_M + 1):
        behind = make_context("gemm", arch="sm_90a", dtype="bfloat16", tokens=max(m, 1), dims=dict(N=6144, K=2048),
                              attrs={"weight_format": "fp8-block-128", "norm_site": "attn.q_a_norm"})
        want = f8.NAME_A16_NORM if max(m, 1) <= f8.NORM_MAX_M else first
        assert impls.select(behind)[0].name == want, m
    assert "norm site only" in impls.get(f8.NAME_A16_NORM).supports(_ctx(1))
    for name in fp8_names:
        impl = impls.get(name)
        assert "reads block-FP8 weights" in impl.supports(_ctx(1, None))
        assert "M<=64" in impl.supports(_ctx(65))
        assert "reference serves" in impl.supports(_ctx(1, arch="cpu"))
        assert "sm_89+" in impl.supports(_ctx(1, arch="sm_80"))
        assert "4-bit" not in str(impl.supports(_ctx(1, "mxfp4"))) and impl.supports(_ctx(1, "mxfp4")) is not True


def test_fp8_gemms_refuse_bad_weights_with_the_fix():
    from latency_specialized.kernels import gemm_fp8_triton as f8

    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(UserError, match="bf16 gemms"):
        f8.gemm_fp8_w8a16(x, torch.randn(32, 64).bfloat16())  # type: ignore[arg-type]
    with pytest.raises(UserError, match="not a block-FP8 format"):
        f8.gemm_fp8_w8a16(x, quantize_weight("p.weight", torch.randn(32, 64), "mxfp4"))
    w = _weight(4, 32, 64, "fp8-block-32")
    for bad in (0, 250):
        s = w.scale.clone().view(torch.uint8)
        s[0, 0] = bad
        with pytest.raises(UserError, match="requantize"):
            f8.gemm_fp8_w8a8(x, QuantizedWeight(w.fmt, w.shape, w.weight, s.view(w.scale.dtype), name="p.weight"))
    with pytest.raises(UserError, match="does not match"):
        f8.gemm_fp8_w8a16(torch.randn(1, 96).bfloat16(), w)


@pytest.mark.parametrize("n,k,m", [(6144, 2048, 1), (2624, 6144, 8), (32768, 1280, 16), (5120, 8192, 64), (96, 200, 1)])
def test_default_split_fills_the_gpu_without_starving_the_pipeline(n, k, m):
    from latency_specialized.kernels.gemm_fp8_triton import SMS_H200, default_config

    cfg = default_config(n, k, m, 128)
    tiles, steps = -(-n // cfg.block_n), -(-k // 128)
    assert cfg.split_k == 1 or steps // cfg.split_k >= 4  # every split keeps 4+ K steps
    if tiles < SMS_H200 and steps >= 8:  # too few tiles alone: K is split
        assert cfg.split_k > 1
    assert tiles * cfg.split_k <= 2 * SMS_H200 + tiles  # no more than ~2 programs per SM


# ------------------------------------------------------------------------------ interpreter cases
if _HAVE_TRITON:
    import triton
    import triton.language as tl

    from latency_specialized.kernels.triton_fp8 import _round_e4m3

    @triton.jit
    def _rounding_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < n)
        tl.store(o_ptr + offs, _round_e4m3(v).to(tl.float8e4nv).to(tl.float32), mask=offs < n)


@interpreted
def test_kernel_rounding_to_e4m3_equals_torch():
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    g = _gen(5)
    x = torch.cat([grid, mids, mids * (1 + 1e-6), mids * (1 - 1e-6), torch.randn(4000, generator=g) * 60,
                   torch.randn(1000, generator=g) * 1e-2]).clamp(-448, 448)
    out = torch.full_like(x, float("nan"))
    _rounding_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    assert torch.equal(out, x.to(torch.float8_e4m3fn).float())


def _run(impl, x, w, *, residual=None, split=1, strided=False, block_k=None):
    from latency_specialized.kernels import gemm_fp8_triton as f8

    M, N = x.shape[0], w.shape[0]
    wide = torch.full((M, N + 24), float("nan")).bfloat16()
    out = wide[:, 8:8 + N] if strided else torch.full((M, N), float("nan")).bfloat16()
    cfg = f8.Fp8GemmConfig(block_n=32, split_k=split, block_k=block_k)
    y = impl(x, w, residual=residual, out=out, config=cfg)
    assert y.data_ptr() == out.data_ptr() and not y.isnan().any()
    if strided:
        assert wide[:, :8].isnan().all() and wide[:, 8 + N:].isnan().all()
    return y


CASES = [  # fmt, M, N, K, split
    ("fp8-block-128", 1, 160, 384, 1),
    ("fp8-block-128", 3, 72, 300, 3),
    ("fp8-block-128", 16, 130, 520, 2),
    ("fp8-block-128", 33, 40, 256, 2),
    ("fp8-block-32", 1, 70, 100, 1),
    ("fp8-block-32", 5, 96, 288, 3),
    ("fp8-block-32", 17, 40, 96, 2),
]


@interpreted
@pytest.mark.parametrize("fmt,M,N,K,split", CASES)
def test_w8a16_matches_the_dequantising_reference(fmt, M, N, K, split):
    from latency_specialized.kernels import gemm_fp8_triton as f8
    from latency_specialized.kernels.triton_common import _ZEROED

    w = _weight(10 + M, N, K, fmt)
    g = _gen(20 + M)
    x = torch.randn(M, K, generator=g).bfloat16()
    r = torch.randn(M, N, generator=g).bfloat16()
    ref = gemm_reference(x, w, residual=r)
    y = _run(f8.gemm_fp8_w8a16, x, w, residual=r, split=split, strided=True)
    assert _rel(y, ref) <= A16_TOL
    again = _run(f8.gemm_fp8_w8a16, x, w, residual=r, split=split)
    assert torch.equal(y, again)  # deterministic split-K
    tickets = [c for key, c in _ZEROED.items() if key[0].startswith("fp8_block_gemm.tiles@")]
    assert (tickets or split == 1) and all(int(c.abs().sum()) == 0 for c in tickets)  # split-K's tickets reset
    if fmt == "fp8-block-32":  # power-of-two scales folded into 128-wide steps: same result
        assert _rel(_run(f8.gemm_fp8_w8a16, x, w, residual=r, split=split, block_k=128 if K >= 128 else 64),
                    ref) <= A16_TOL


@interpreted
@pytest.mark.parametrize("fmt,M,N,K,split", CASES)
def test_w8a8_matches_the_reference_over_its_activation_rounding(fmt, M, N, K, split):
    from latency_specialized.kernels import gemm_fp8_triton as f8
    from latency_specialized.kernels.triton_fp8 import quantize_activations_reference

    w = _weight(30 + M, N, K, fmt)
    g = _gen(40 + M)
    x = torch.randn(M, K, generator=g).bfloat16()
    x[0, : K // 3] *= 50  # one token with a loud slice: per-(token, block) scales matter
    y = _run(f8.gemm_fp8_w8a8, x, w, split=split)
    q, sx = quantize_activations_reference(x, w.fmt.block[1])
    x_seen = q * sx.repeat_interleave(w.fmt.block[1], 1)[:, :K]
    assert _rel(y, x_seen @ w.dequantize().t()) <= A8_SELF_TOL
    assert _rel(y, gemm_reference(x, w)) <= A8_TOL


@interpreted
@pytest.mark.parametrize("fmt,M,N,K,split", [("fp8-block-128", 1, 160, 384, 2), ("fp8-block-32", 3, 70, 100, 1),
                                             ("fp8-block-128", 4, 96, 300, 3)])
def test_norm_prologue_matches_the_reference_norm_then_gemm(fmt, M, N, K, split):
    """``norm_weight``: x (strided rows: a column slice of a wider projection output, as MLA's q_a) RMS-normalised in
    the prologue, rounded to bf16 as the norm op stores it, then the gemm - the reference's norm prologue."""
    from latency_specialized.kernels import gemm_fp8_triton as f8

    w = _weight(70 + M, N, K, fmt)
    g = _gen(80 + M)
    wide = (torch.randn(M, K + 40, generator=g) * 3).bfloat16()
    x = wide[:, 16:16 + K]
    gain = (1 + 0.1 * torch.randn(K, generator=g)).bfloat16()
    ref = gemm_reference(x, w, norm_weight=gain, norm_eps=1e-5)
    out = torch.full((M, N), float("nan")).bfloat16()
    y = f8.gemm_fp8_w8a16(x, w, out=out, norm_weight=gain, norm_eps=1e-5,
                          config=f8.Fp8GemmConfig(block_n=32, split_k=split))
    assert not y.isnan().any() and _rel(y, ref) <= A16_TOL
    assert _rel(y, gemm_reference(x, w)) > 10 * A16_TOL   # the norm did something (x's rows are far from unit rms)


@interpreted
def test_w8a8_out_fp32_and_zero_rows():
    from latency_specialized.kernels import gemm_fp8_triton as f8

    w = _weight(50, 64, 256, "fp8-block-128")
    x = torch.zeros(2, 256).bfloat16()
    x[1] = torch.randn(256, generator=_gen(51)).bfloat16()
    y = f8.gemm_fp8_w8a8(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and torch.equal(y[0], torch.zeros(64))  # an all-zero token stays zero
    assert _rel(y[1:], gemm_reference(x[1:], w, out_dtype=torch.float32)) <= A8_TOL


# ------------------------------------------------------------------------------ offline compile
@pytest.mark.skipif(not _HAVE_TRITON, reason="triton not installed")
def test_fp8_kernel_compiles_for_hopper_with_the_intended_instructions():
    """sm_90 PTX without a GPU, specialized on the launch's arguments as the JIT does: W8A8 multiplies e4m3 x e4m3
    on wgmma (no per-weight conversion), W8A16 bf16 wgmma, the tiles arrive by pipelined 16-byte cp.async, split-K
    takes an acquire-release ticket and resets it."""
    from latency_specialized.kernels import triton_fp8 as k

    from tests.triton_offline import ptx_for_hopper, recorded_launches

    for fmt, kind in (("fp8-block-128", k.SCALE_FP32), ("fp8-block-32", k.SCALE_UE8M0)):
        w = _weight(60, 256, 512, fmt)
        for a8 in (False, True):
            for split in (1, 2):
                x, out = torch.randn(4, 512).bfloat16(), torch.empty(4, 256).bfloat16()
                with recorded_launches() as launches:
                    k.fp8_block_gemm(x, w.weight, w.scale.view(torch.uint8) if kind else w.scale, out,
                                     scale_kind=kind, scale_block=w.fmt.block, a8=a8, split_k=split, residual=out,
                                     block_k=None if a8 or not kind else 128)
                (ptx,) = ptx_for_hopper(launches).values()
                mma = "e4m3.e4m3" if a8 else "bf16.bf16"
                assert f"wgmma.mma_async.sync.aligned.m64n16k{32 if a8 else 16}.f32.{mma}" in ptx, (fmt, a8)
                assert ("atom.global.gpu.acq_rel.add" in ptx) == (split > 1)
                assert "cp.async.cg.shared.global" in ptx  # 16-byte asynchronous copies, pipelined over K
    # the norm prologue: an rsqrt of the rows' mean square before the pipelined K loop, bf16 wgmma as before
    w = _weight(61, 256, 512, "fp8-block-128")
    x, out = torch.randn(2, 512).bfloat16(), torch.empty(2, 256).bfloat16()
    with recorded_launches() as launches:
        k.fp8_block_gemm(x, w.weight, w.scale, out, scale_kind=k.SCALE_FP32, scale_block=w.fmt.block, a8=False,
                         norm_weight=torch.ones(512).bfloat16(), norm_eps=1e-6)
    (ptx,) = ptx_for_hopper(launches).values()
    assert "rsqrt.approx" in ptx and "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16" in ptx


@pytest.mark.skipif(not _HAVE_TRITON, reason="triton not installed")
def test_default_launch_configs_do_not_spill_on_hopper():
    """The sm_90 cubins of the heuristic configs (what plans run until the H200 fills ``TUNING``) use no stack: at
    M = 64 the 4-warp tile spilled (255 registers + 64-88 bytes of stack), hence 8 warps above 16 rows."""
    from latency_specialized.kernels import gemm_fp8_triton as f8

    from tests.triton_offline import recorded_launches, resource_usage

    for N, K, fmt in ((6144, 2048, "fp8-block-128"), (4096, 1280, "fp8-block-32")):
        w = _weight(62, N, K, fmt)
        with recorded_launches() as launches:
            for M, fn in ((1, f8.gemm_fp8_w8a16), (64, f8.gemm_fp8_w8a16), (64, f8.gemm_fp8_w8a8)):
                fn(torch.randn(M, K).bfloat16(), w, out=torch.empty(M, N).bfloat16())
            f8.gemm_fp8_w8a16(torch.randn(4, K).bfloat16(), w, out=torch.empty(4, N).bfloat16(),
                              norm_weight=torch.ones(K).bfloat16())
        usage = resource_usage(launches)
        assert len(usage) == 4 and all(stack == 0 for _, stack in usage.values()), usage


@pytest.mark.interpreter_driver
def test_kernel_cases_under_the_interpreter():
    run_interpreted(__file__, min_passed=19)
