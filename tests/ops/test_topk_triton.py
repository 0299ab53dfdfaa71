"""``kernels.topk_triton.topk_select`` on the CPU: the Triton interpreter, the sm_90 compile, host checks.

The kernel cases (marker ``interpreter_case``) run in a child process started with ``TRITON_INTERPRET=1``
(``tests/interpret.py``; ``test_kernel_cases_under_the_interpreter`` drives them). The interpreter runs the
programs of a grid one after another, so the atomic tickets, slot counters and the last program's finish
run in one fixed order; the GPU tests (``test_topk_triton_gpu.py``) run them concurrently.

The rule checked: each row holds exactly the set ``topk_select_reference`` gives (the first k of a stable
descending sort of the candidates: ties go to the lowest positions, -0.0 ties +0.0, NaN above +inf; -inf
and positions past ``valid_lens`` are no candidates), compared as sorted rows, -1 past the candidate count;
and the selected values equal torch.topk's as multisets. ``out`` is poisoned first; the workspace must be
zero again after every call.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from latency_specialized.errors import UserError

from tests.interpret import run_interpreted

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (its interpreter runs the kernels on the CPU)")
interpreted = pytest.mark.interpreter_case


@pytest.mark.interpreter_driver
def test_kernel_cases_under_the_interpreter():
    run_interpreted(__file__, min_passed=11)


@pytest.fixture
def tk():
    from latency_specialized.kernels import topk_triton

    return topk_triton


def _scores(seed, M, N, *, quant=None, neg_inf_every=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, N, generator=g)
    if quant:  # few distinct values: most of a row ties
        x = (x * quant).round()
    if neg_inf_every:
        x[:, ::neg_inf_every] = float("-inf")
    return x


def check(tk, scores, lens, k, **call):
    """The kernel's rows equal the reference's as sets, and their values torch.topk's as multisets."""
    M, N = scores.shape
    lens = torch.as_tensor(lens, dtype=torch.int32)
    ws = tk.make_workspace(M, scores.device)
    out = torch.randint(-(2 ** 20), 2 ** 20, (M, k), dtype=torch.int32)
    got = tk.topk_select(scores, lens, k, out, workspace=ws, **call)
    assert got is out
    want = tk.topk_select_reference(scores, lens, k)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values), (got.sort(-1).values, want.sort(-1).values)
    assert not ws.any(), "the workspace must be zero again after a call"
    masked = scores.masked_fill(torch.arange(N)[None, :] >= lens.long()[:, None], float("-inf"))
    for m in range(M):
        live = got[m][got[m] >= 0].long()
        n = int((masked[m] != float("-inf")).sum())
        assert live.numel() == min(k, n)
        if live.numel():
            top = torch.topk(masked[m], live.numel()).values.sort().values
            torch.testing.assert_close(masked[m, live].sort().values, top, rtol=0, atol=0, equal_nan=True)
    return got


# ---------------------------------------------------------------------------------------------- interpreter
@interpreted
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_random_rows(tk, splits):
    """Continuous scores, N not a power of two, lengths 0 / < k / = k / k + 1 / N; several programs per row
    (and programs with nothing to do: 8 splits of a 3001-score row in 1024-score chunks)."""
    x = _scores(splits, 6, 3001)
    check(tk, x, [3001, 0, 63, 64, 65, 2500], 64, splits=splits)


@interpreted
@pytest.mark.parametrize("quant", [0.5, 4.0])
def test_many_ties(tk, quant):
    """Quantised scores: the k-th value ties hundreds of positions; the lowest ones must be taken (the
    position select of the last program, over positions wider than one 11-bit digit)."""
    x = _scores(10, 3, 4500, quant=quant)
    check(tk, x, [4500, 3000, 2049], 300, splits=4)


@interpreted
def test_all_equal(tk):
    """One value everywhere (the whole row in the threshold bin), +-0.0 mixed (equal values)."""
    x = torch.zeros(2, 2600)
    x[1, 1::2] = -0.0
    x[0] = 1.5
    check(tk, x, [2600, 2600], 100, splits=3)


@interpreted
def test_masked_entries_and_short_rows(tk):
    """-inf entries are no candidates: rows with fewer finite scores than k get -1 for the rest, as do rows
    with valid_lens < k, 0, or beyond N (clamped)."""
    x = _scores(11, 4, 2100, neg_inf_every=3)
    x[2, :] = float("-inf")
    x[2, 5] = 1.0
    check(tk, x, [2100, 90, 2100, 5000], 1000, splits=3)


@interpreted
def test_k_wider_than_the_row(tk):
    x = _scores(12, 2, 300)
    check(tk, x, [300, 17], 512, splits=2)


@interpreted
def test_nan_and_infinities(tk):
    """NaN above +inf (torch's order), +inf, finite, then -inf (masked)."""
    x = _scores(13, 2, 1500)
    x[0, [3, 700, 1400]] = float("nan")
    x[0, [5, 800]] = float("inf")
    x[1, 10:20] = float("inf")
    check(tk, x, [1500, 1500], 8, splits=2)


@interpreted
def test_narrow_tiles(tk, monkeypatch):
    """Small tiles and chunks: many steps per chunk, per pass of the last program, and per compaction."""
    monkeypatch.setattr(tk, "TILE", 64)
    monkeypatch.setattr(tk, "MIN_CHUNK", 64)
    monkeypatch.setattr(tk, "CAND_TILE", 32)
    x = _scores(14, 3, 1000, quant=3.0)
    check(tk, x, [1000, 999, 130], 70, splits=5)
    check(tk, _scores(15, 3, 1000), [1000, 999, 130], 70, splits=5)


@interpreted
def test_default_workspace_is_reused(tk):
    """Two calls on the cached workspace (each leaves it zeroed) and strided rows of a wider buffer."""
    buf = _scores(16, 3, 2200)
    x = buf[:, 50:2150]
    assert x.stride(0) == 2200
    lens = torch.tensor([2100, 1200, 700], dtype=torch.int32)
    a = tk.topk_select(x, lens, 128)
    b = tk.topk_select(x, lens.long(), 128)
    want = tk.topk_select_reference(x, lens, 128).sort(-1).values
    assert torch.equal(a.sort(-1).values, want) and torch.equal(b.sort(-1).values, want)
    assert not tk._workspace(3, x.device).any()


# ---------------------------------------------------------------------------------------------- host side
def test_reference_rule():
    from latency_specialized.kernels.topk_triton import topk_select_reference

    x = torch.tensor([[1.0, 3.0, 3.0, float("-inf"), 3.0, 2.0], [0.0, -0.0, 0.0, 5.0, 1.0, 1.0]])
    got = topk_select_reference(x, torch.tensor([6, 5]), 3)
    assert got.tolist() == [[1, 2, 4], [3, 4, 0]]
    assert topk_select_reference(x, torch.tensor([2, 0]), 3).tolist() == [[1, 0, -1], [-1, -1, -1]]
    assert topk_select_reference(x, torch.tensor([6, 6]), 8)[0].tolist() == [1, 2, 4, 5, 0, -1, -1, -1]


def test_host_checks_raise_user_errors(tk):
    x = torch.randn(2, 100)
    lens = torch.tensor([100, 50])
    with pytest.raises(UserError, match="fp32"):
        tk.topk_select(x.double(), lens, 4)
    with pytest.raises(UserError, match="valid_lens"):
        tk.topk_select(x, lens[:1], 4)
    with pytest.raises(UserError, match="int32"):
        tk.topk_select(x, lens, 4, torch.empty(2, 4, dtype=torch.int64))
    with pytest.raises(UserError, match="positive"):
        tk.topk_select(x, lens, 0)
    with pytest.raises(UserError, match="workspace"):
        tk.topk_select(x, lens, 4, workspace=torch.zeros(2, 10, dtype=torch.int32))
    assert tk.topk_select(x[:, :0], lens, 3).tolist() == [[-1, -1, -1]] * 2


def test_splits_from_static_shapes(tk):
    assert tk.choose_splits(1, 131072, 132) == 128              # capped by MIN_CHUNK chunks
    assert tk.choose_splits(1, 4096, 132) == 4
    assert tk.choose_splits(8, 65536, 132) == 33
    assert tk.choose_splits(64, 16384, 132) == 5
    assert tk.choose_splits(64, 100, 132) == 1


def test_kernels_compile_for_hopper_without_a_gpu(tk):
    """Both kernels build for sm_90 at the GLM-5.3 / DeepSeek-V4.1 shapes (ptxas bundled with Triton), with
    the launches' own argument types; no local memory (spills)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.triton_offline import _signature, recorded_launches

    with recorded_launches() as launches:
        tk.topk_select(torch.randn(1, 131072), torch.tensor([131072], dtype=torch.int32), 2048)
        tk.topk_select(torch.randn(64, 8192), torch.full((64,), 8192), 512)
    assert {fn.fn.__name__ for fn, _, _ in launches} == {"hist_kernel", "collect_kernel"}
    seen = set()
    for fn, args, kw in launches:
        sig, const = _signature(fn, args, kw)
        key = (fn.fn.__name__, tuple(sorted(const.items())), tuple(sorted(sig.items())))
        if key in seen:
            continue
        seen.add(key)
        ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                             options=dict(num_warps=kw["num_warps"])).asm["ptx"]
        assert "ld.local" not in ptx and "st.local" not in ptx, fn.fn.__name__
        assert "atom.global.gpu.acq_rel" in ptx and "bar.sync" in ptx      # the ticket and the barrier before it
