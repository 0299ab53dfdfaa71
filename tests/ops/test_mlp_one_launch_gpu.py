"""GPU tests of ``mlp.triton_one_launch`` (one launch: gate/up GEMV, activation, grid barrier, down GEMV).

Shapes: DeepSeek-V4.1-Flash's TP8 shared expert (K 5120, I 288, SwiGLU clamped at 10), Kimi K3's (K 7168,
I 768 a rank, SiTU-GLU), GLM-5.3's (K 6144, I 256, SwiGLU) and an odd one (I and N not multiples of any block).
Every case: fresh random inputs, ``out`` poisoned with NaN and fully written, compared with ``mlp_reference`` at
bf16 tolerances (the two differ in fp32 summation order only, then one bf16 rounding each); CUDA-graph replay
equals eager bit for bit, over many replays (the barrier's counter must come back to 0 every time); calls on two
streams at once (each stream its own barrier words); a grid as large as the SM count.
Run on the H200: ``pytest -m gpu tests/ops/test_mlp_one_launch_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.ops.mlp import mlp_reference
from latency_specialized.spec import ActivationSpec

from gpu_helpers import graph_replay, seeded_generator

pytestmark = pytest.mark.gpu

DEV = "cuda"
SHAPES = {
    "deepseek_tp8": (5120, 288, ActivationSpec(kind="swiglu", clamp=10.0)),
    "kimi_tp8": (7168, 768, ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)),
    "glm_tp8": (6144, 256, ActivationSpec(kind="swiglu")),
    "odd": (1000, 44, ActivationSpec(kind="swiglu")),
}
"""(hidden K = N, intermediate I, activation)."""


def _case(name: str, M: int):
    K, I, act = SHAPES[name]
    g = seeded_generator(f"one-launch-{name}-{M}")
    x = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    w13 = (torch.randn(2 * I, K, generator=g, device=DEV) * K ** -0.5).bfloat16()
    w2 = (torch.randn(K, I, generator=g, device=DEV) * I ** -0.5).bfloat16()
    return x, w13, w2, act


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2 * scale)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("M", [1, 2, 3, 4])
def test_matches_the_reference_eager_and_replayed(name, M):
    from latency_specialized.kernels.mlp_one_launch_triton import _barrier_words, mlp_one_launch

    x, w13, w2, act = _case(name, M)
    want = mlp_reference(x, w13, w2, act)
    out = torch.full((M, w2.shape[0]), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert mlp_one_launch(x, w13, w2, act, out=out) is out
    torch.cuda.synchronize()
    assert not out.isnan().any()
    _close(out, want)
    eager = out.clone()
    out.fill_(float("nan"))
    graph_replay(lambda: mlp_one_launch(x, w13, w2, act, out=out))   # a capture stream new to it: words zeroed
    assert torch.equal(out, eager)
    # captured on a stream whose barrier words exist (warmed up on it, as the runtime's side stream is): the graph
    # holds no memset of them, so 200 replays pass only if every call leaves its counter at 0 itself
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mlp_one_launch(x, w13, w2, act, out=out)
        count, gen = _barrier_words(x.device)
    torch.cuda.synchronize()
    gen_before = int(gen.item())
    own = torch.cuda.CUDAGraph()
    with torch.cuda.graph(own, stream=side):
        mlp_one_launch(x, w13, w2, act, out=out)
    out.fill_(float("nan"))
    for _ in range(200):      # a barrier left half-open would hang or tear a later replay
        own.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert int(count.item()) == 0 and int(gen.item()) == gen_before + 200   # one barrier a replay, counter reset


def test_inputs_rewritten_between_replays_are_read():
    """The graph reads x and the weights at replay time (h and the output are not stale values of the capture)."""
    from latency_specialized.kernels.mlp_one_launch_triton import mlp_one_launch

    x, w13, w2, act = _case("deepseek_tp8", 2)
    out = torch.empty(2, w2.shape[0], dtype=torch.bfloat16, device=DEV)
    graph = graph_replay(lambda: mlp_one_launch(x, w13, w2, act, out=out))
    for step in range(5):
        x.copy_(torch.randn(x.shape, generator=seeded_generator(f"rewrite-{step}"), device=DEV).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        _close(out, mlp_reference(x, w13, w2, act))


def test_two_streams_at_once_keep_their_own_barriers():
    """The side-stream shape on two streams, 50 calls each, interleaved without synchronisation: each stream's
    results equal its eager result (a shared counter would open barriers early or never)."""
    from latency_specialized.kernels.mlp_one_launch_triton import mlp_one_launch

    cases = [_case("deepseek_tp8", 1), _case("glm_tp8", 4)]
    want = [mlp_one_launch(*c) for c in cases]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [torch.empty_like(w) for w in want]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(50):
        for s, c, o in zip(streams, cases, outs):
            with torch.cuda.stream(s):
                mlp_one_launch(*c, out=o)
    torch.cuda.synchronize()
    for o, w in zip(outs, want):
        assert torch.equal(o, w)


def test_every_sm_a_program_and_five_programs_agree():
    """The grid's size changes which program takes which block, not the sums (each block's order is fixed)."""
    from latency_specialized.hardware import sm_count
    from latency_specialized.kernels.mlp_one_launch_triton import mlp_one_launch

    x, w13, w2, act = _case("odd", 3)
    many = mlp_one_launch(x, w13, w2, act, programs=sm_count(x.device))
    few = mlp_one_launch(x, w13, w2, act, programs=5)
    _close(many, mlp_reference(x, w13, w2, act))
    assert not many.isnan().any()
    # the same tiles only where the tile choice is the same; otherwise the same values to summation order
    _close(few, many)
