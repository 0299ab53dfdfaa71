"""CPU tests of the routed experts' addend (``kernels/moe_addend.py``): the reference's ``addend=`` equals the add
after it bit for bit, a join is called once and only where the last stage reads it, misuse names the fix; and the
plain MoE piece gives the same bits with its shared experts added inside the experts op or after it.
GPU kernels (CuTe DSL down, Triton sum): ``test_moe_addend_gpu.py``; the Triton sum under the interpreter:
``tests/runtime/test_stock_kernels.py``."""

from __future__ import annotations

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels.moe_addend import accumulate_target, add_addend, resolve_addend
from latency_specialized.ops.moe import experts_reference
from latency_specialized.pieces.ffn import moe as moe_piece
from latency_specialized.spec import ActivationSpec

SWIGLU = ActivationSpec(kind="swiglu", clamp=10.0)


def _case(M: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    E, k, K, I = 12, 3, 64, 32
    x = torch.randn(M, K, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, K, generator=g) * K ** -0.5).to(dtype)
    w2 = (torch.randn(E, K, I, generator=g) * I ** -0.5).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    wts = torch.rand(M, k, generator=g)
    addend = torch.randn(M, K, generator=g).to(dtype)
    return x, wts, ids, w13, w2, addend


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("M", [1, 5])
def test_reference_addend_equals_the_add_after_it(M, dtype):
    x, wts, ids, w13, w2, a = _case(M, 10 + M, dtype)
    routed = experts_reference(x, wts, ids, w13, w2, SWIGLU)
    calls = []

    def join():
        calls.append(1)
        return a.clone()

    fused = experts_reference(x, wts, ids, w13, w2, SWIGLU, addend=join)
    assert torch.equal(fused, routed + a)      # round(round(routed) + a): torch's own add of two tensors
    assert calls == [1]
    out = torch.full_like(routed, float("nan"))
    got = experts_reference(x, wts, ids, w13, w2, SWIGLU, addend=a, out=out)
    assert got is out and torch.equal(out, routed + a)


def test_misuse_names_the_fix():
    x, wts, ids, w13, w2, a = _case(2, 3)
    with pytest.raises(UserError, match="per_route"):
        experts_reference(x, wts, ids, w13, w2, SWIGLU, per_route=True, addend=a)
    with pytest.raises(UserError, match=r"addend must be \[2, 64\]"):
        experts_reference(x, wts, ids, w13, w2, SWIGLU, addend=a[:, :32])
    with pytest.raises(UserError, match="addend must be"):
        resolve_addend(lambda: a.float(), 2, 64, torch.bfloat16, "t")


def test_accumulate_target_uses_the_addend_memory_without_out():
    a = torch.randn(3, 8).to(torch.bfloat16)
    assert accumulate_target(a, None, 3, 8, a.dtype, "t") is a                # no copy kernel
    out = torch.full((3, 8), float("nan"), dtype=torch.bfloat16)
    assert accumulate_target(lambda: a, out, 3, 8, a.dtype, "t") is out and torch.equal(out, a)
    assert accumulate_target(None, out, 3, 8, a.dtype, "t") is None
    y = torch.randn(3, 8).to(torch.bfloat16)
    want = y + a
    assert add_addend(y, a, "t") is y and torch.equal(y, want)


def test_plain_moe_piece_same_bits_with_the_shared_add_inside_the_experts(monkeypatch):
    from tests.pieces.helpers import make_step, piece_sites, rank_weights
    from tests.pieces.test_moe_piece import CASES, spec_for, weights

    piece = CASES["sigmoid-bias-shared"]
    spec = spec_for(piece.spec)
    w, x = weights(piece, spec, 5)
    x = x.to(torch.bfloat16)
    rw = {k: v.to(torch.bfloat16) if v.dtype == torch.float32 and not k.endswith("bias") else v
          for k, v in rank_weights(piece, spec, w, 0, 1).items()}
    seen = []

    def run(fused: bool):
        monkeypatch.setattr(moe_piece, "ADD_SHARED_IN_EXPERTS", fused)
        step = make_step(piece_sites(piece, spec, 1, 5), spec, 5)
        site = next(s for s in step.ops if s.endswith("moe.experts"))

        def spy(*a, _f=step.ops[site], **kw):
            seen.append("addend" in kw)
            return _f(*a, **kw)

        step.ops[site] = spy
        return piece.forward(step, rw, {}, x)

    fused, after = run(True), run(False)
    assert seen == [True, False]
    assert torch.equal(fused, after) and not torch.isnan(fused).any()
