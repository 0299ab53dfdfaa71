"""``kernels.topk_triton.topk_select`` on the GPU: many programs per row running at once, CUDA graphs.

The rule (as in ``test_topk_triton.py``): every row holds exactly the set of ``topk_select_reference`` (the
first k of a stable descending sort: ties to the lowest positions), compared as sorted rows, and its values
equal ``torch.topk``'s as multisets. Scores: continuous, quantised (the k-th value tied over thousands of
positions), with -inf (masked) entries; valid_lens 0 / < k / = k / > N; N not a power of two; M = 1, 3, 8,
64; k = 512, 2048. The workspace is zero after every call; a captured call replays for new scores and
lengths exactly as the eager call selects, and two replays agree.
Run on the H200: ``pytest -m gpu tests/ops/test_topk_triton_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.kernels import topk_triton as tk

from gpu_helpers import graph_replay, seeded_generator as _gen

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _scores(seed, M, N, kind):
    g = _gen(seed)
    x = torch.randn(M, N, generator=g, device=DEV)
    if kind == "quantised":        # 9 distinct values: huge ties at the threshold
        x = (x * 2).round().clamp(-4, 4)
    elif kind == "masked":         # a third of the entries -inf, one row almost all
        x = x.masked_fill(torch.rand(M, N, generator=g, device=DEV) < 0.33, float("-inf"))
        x[-1, 7:] = float("-inf")
    elif kind == "bf16":           # bf16-rounded logits: small ties, like the indexer's
        x = x.bfloat16().float()
    return x


def _lens(M, N, k, seed):
    special = [N, 0, k - 1, k, k + 1, N - 1, N + 1000, N // 3]
    if M <= len(special):
        return torch.tensor(([N] + special)[:M], dtype=torch.int32, device=DEV)
    g = _gen(seed)
    rest = torch.randint(0, N + 1, (M - len(special),), generator=g, device=DEV)
    return torch.cat([torch.tensor(special, device=DEV), rest]).to(torch.int32)


def _check(x, lens, k, got):
    M, N = x.shape
    want = tk.topk_select_reference(x, lens, k)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    masked = x.masked_fill(torch.arange(N, device=DEV)[None, :] >= lens.long()[:, None], float("-inf"))
    n = (masked != float("-inf")).sum(-1)
    assert torch.equal((got >= 0).sum(-1), n.clamp(max=k).to((got >= 0).sum(-1).dtype))
    for m in range(M):
        live = got[m][got[m] >= 0].long()
        if live.numel():
            top = torch.topk(masked[m], live.numel()).values.sort().values
            assert torch.equal(masked[m, live].sort().values, top), f"row {m}"


@pytest.mark.parametrize("kind", ["random", "quantised", "masked", "bf16"])
@pytest.mark.parametrize("k", [512, 2048])
@pytest.mark.parametrize("M,N", [(1, 4096), (1, 131072), (3, 5000), (8, 65537), (64, 16384), (64, 100003)])
def test_matches_the_reference(M, N, k, kind):
    x = _scores(f"{M}{N}{k}{kind}", M, N, kind)
    lens = _lens(M, N, k, f"l{M}{N}{k}")
    out = torch.randint(-(2 ** 20), 2 ** 20, (M, k), dtype=torch.int32, device=DEV)
    ws = tk.make_workspace(M, DEV)
    got = tk.topk_select(x, lens, k, out, workspace=ws)
    torch.cuda.synchronize()
    assert got is out
    _check(x, lens, k, got)
    assert not ws.any(), "the workspace must be zero again after a call"


@pytest.mark.parametrize("splits", [1, 7, 256])
def test_forced_splits(splits):
    """One program per row, a few, and more programs than the row has chunks (idle programs take tickets)."""
    x = _scores(f"s{splits}", 5, 30001, "quantised")
    lens = torch.tensor([30001, 2047, 0, 20000, 9999], dtype=torch.int32, device=DEV)
    _check(x, lens, 2048, tk.topk_select(x, lens, 2048, splits=splits))


@pytest.mark.parametrize("M", [1, 8, 64])
def test_graph_replay_equals_eager(M):
    N, k = 32768, 2048
    x = _scores(f"g0{M}", M, N, "random")
    lens = _lens(M, N, k, f"gl0{M}")
    out = torch.empty(M, k, dtype=torch.int32, device=DEV)
    fn = lambda: tk.topk_select(x, lens, k, out)  # noqa: E731
    g = graph_replay(fn)
    for seed, kind in (("g1", "random"), ("g2", "quantised")):
        x.copy_(_scores(f"{seed}{M}", M, N, kind))
        lens.copy_(_lens(M, N, k, f"{seed}l{M}"))
        g.replay()
        torch.cuda.synchronize()
        first = out.sort(-1).values.clone()
        g.replay()
        torch.cuda.synchronize()
        second = out.sort(-1).values.clone()
        eager = tk.topk_select(x, lens, k).sort(-1).values
        torch.cuda.synchronize()
        assert torch.equal(first, second) and torch.equal(first, eager)
        _check(x, lens, k, out)
    assert not tk._workspace(M, x.device).any()
