"""GPU tests of the routed experts' addend (``experts(..., addend=a)`` = ``experts(...) + a`` bit for bit,
``kernels/moe_addend.py``): the CuTe DSL ``down`` kernel adding it in its epilogue (batch 1 with PDL, several tokens,
an odd width), the Triton fused-MoE sum kernel adding it, a poisoned ``out`` fully written, and the shared experts'
side-stream join handed over uncalled inside a CUDA graph (replay equals eager, the join ordered before ``down``)."""

from __future__ import annotations

import pytest
import torch

from latency_specialized.spec import ActivationSpec

from gpu_helpers import graph_replay, random_experts, seeded_generator as _gen

pytestmark = pytest.mark.gpu

DEV = "cuda"
SWIGLU_CLAMP = ActivationSpec(kind="swiglu", clamp=10.0)
CASES = [
    # (name, E, K, I, N, top_k, M): DeepSeek-V4.1-Flash TP8 rank shapes at batch 1 and 8, an odd width
    ("dsv41_tp8_b1", 384, 5120, 288, 5120, 6, 1),
    ("dsv41_tp8_b8", 384, 5120, 288, 5120, 6, 8),
    ("odd_b5", 37, 512, 136, 200, 3, 5),
]


def _inputs(name, E, K, I, N, top_k, M):
    g = _gen(f"addend-{name}")
    w13, w2 = random_experts(E, 2 * I, K, g, torch.bfloat16, DEV), random_experts(E, N, I, g, torch.bfloat16, DEV)
    x = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    ids = torch.randn(M, E, generator=g, device=DEV).topk(top_k, dim=-1).indices
    w = torch.rand(M, top_k, generator=g, device=DEV) + 0.05
    a = torch.randn(M, N, generator=g, device=DEV).bfloat16()
    return x, w / w.sum(-1, keepdim=True), ids, w13, w2, a


@pytest.mark.parametrize("impl", ["cutedsl", "triton_fused"])
@pytest.mark.parametrize("name,E,K,I,N,top_k,M", CASES, ids=[c[0] for c in CASES])
def test_addend_equals_the_add_after_the_experts(impl, name, E, K, I, N, top_k, M):
    if impl == "cutedsl":
        from latency_specialized.kernels.moe_experts import experts
    else:
        from latency_specialized.kernels.moe_experts_triton import experts_triton as experts
    x, w, ids, w13, w2, a = _inputs(name, E, K, I, N, top_k, M)
    want = experts(x, w, ids, w13, w2, SWIGLU_CLAMP) + a
    got = experts(x, w, ids, w13, w2, SWIGLU_CLAMP, addend=a.clone())
    assert torch.equal(got, want)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    a0, calls = a.clone(), []

    def join():
        calls.append(1)
        return a

    assert experts(x, w, ids, w13, w2, SWIGLU_CLAMP, addend=join, out=out) is out
    torch.cuda.synchronize()
    assert calls == [1] and torch.equal(out, want) and torch.equal(a, a0)  # with out, the addend is only read


@pytest.mark.parametrize("name,E,K,I,N,top_k,M", CASES[:2], ids=[c[0] for c in CASES[:2]])
def test_side_stream_join_in_a_graph(name, E, K, I, N, top_k, M):
    """The plain MoE piece's pattern: the addend made on a side stream, its join called by the experts between
    their stages; captured, the graph's replay equals the eager result (so the join edge orders the add)."""
    from latency_specialized.kernels.moe_experts import experts
    from latency_specialized.runtime.side_stream import SideStream

    x, w, ids, w13, w2, a = _inputs(name, E, K, I, N, top_k, M)
    side = SideStream()
    want = experts(x, w, ids, w13, w2, SWIGLU_CLAMP) + a * 2
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    ws: dict = {}

    def step():
        pending = side.run(lambda t: t * 2, a)           # the "shared experts": a kernel on the side stream
        out.copy_(experts(x, w, ids, w13, w2, SWIGLU_CLAMP, addend=pending.join, workspace=ws))

    step()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    out.fill_(float("nan"))
    graph_replay(step)
    assert torch.equal(out, want)
