"""Stock-composition Triton kernels vs their torch references.

Runs on the GPU (``-m gpu``) and, on a CPU with triton installed, under the Triton interpreter
(``TRITON_INTERPRET=1``, in a child process: ``tests/interpret.py``). Fresh random inputs each case,
outputs poisoned with NaN, bf16 tolerances.
"""

from __future__ import annotations


import pytest
import torch

from latency_specialized.ops.attention.kda import kda_decode_reference
from latency_specialized.ops.moe import experts_reference, route_reference
from latency_specialized.ops.norm import rmsnorm_reference
from latency_specialized.spec import ActivationSpec, RouterSpec

from tests.interpret import CASE, DRIVER, collected_ids, run_interpreted

try:
    import triton  # noqa: F401

    _HAVE_TRITON = True
except Exception:  # noqa: BLE001
    _HAVE_TRITON = False

DEVICES = [
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
    # collected only under TRITON_INTERPRET=1 from the process start (tests/conftest.py):
    # test_cpu_cases_under_the_interpreter runs these in a child process
    pytest.param("cpu", marks=pytest.mark.interpreter_case, id="interpret"),
]
INTERPRETED_FILES = ("tests/runtime/test_stock_kernels.py", "tests/runtime/test_stock_layer.py")
DRIVEN_FILES = INTERPRETED_FILES + ("tests/ops/test_mla_triton.py", "tests/ops/test_gqa_triton.py",
                                     "tests/ops/test_qk_norm_rope_gated_join.py", "tests/ops/test_moe_finalize.py")
"""Every file with interpreter cases (each has a driver test)."""


@pytest.mark.interpreter_driver
@pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (its interpreter runs the kernels on the CPU)")
def test_cpu_cases_under_the_interpreter():
    """The stock Triton kernels and the stock KDA+MoE layer on the CPU (Triton interpreter)."""
    run_interpreted(*INTERPRETED_FILES, min_passed=12)


@pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (its interpreter runs the kernels on the CPU)")
def test_interpreter_cases_are_collected_only_where_they_run():
    """Without TRITON_INTERPRET=1 a CPU run collects the drivers and none of the interpreter cases (so
    it shows no skips for them); with it, the cases and none of the drivers (no recursion)."""
    plain = set(collected_ids(*DRIVEN_FILES, interpreting=False))
    interp = set(collected_ids(*DRIVEN_FILES, interpreting=True))
    cases = set(collected_ids(*DRIVEN_FILES, interpreting=True, marks=f"{CASE} and not gpu"))
    drivers = set(collected_ids(*DRIVEN_FILES, interpreting=False, marks=f"{DRIVER} and not gpu"))
    assert {d.rsplit("::", 1)[1] for d in drivers} == {"test_cpu_cases_under_the_interpreter",
                                                       "test_kernel_cases_under_the_interpreter"}, drivers
    assert len(cases) >= 67, sorted(cases)                # 55 MLA + 12 stock kernel/layer cases
    assert not cases & plain, sorted(cases & plain)       # not collected, so not skipped, in a CPU run
    assert drivers <= plain and not drivers & interp      # a driver in the interpreting child would recurse
    assert interp == (plain - drivers) | cases            # nothing else differs between the two runs


BF16 = dict(rtol=2e-2, atol=2e-2)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rand(*shape, gen, dtype=torch.bfloat16, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_blocks,write_idx,has_delta", [(0, -1, True), (3, -1, True), (2, 2, False)])
def test_attn_res_matches_reference(device, num_blocks, write_idx, has_delta):
    from latency_specialized.bench.stock.norms import attn_res, attn_res_reference

    g = _gen(num_blocks * 7 + write_idx + 3)
    M, N = 3, 448 if device == "cpu" else 7168
    prefix = _rand(M, N, gen=g, device=device)
    delta = _rand(M, N, gen=g, device=device) if has_delta else None
    blocks = _rand(M, 4, N, gen=g, device=device)
    nw, qk, ow = (_rand(N, gen=g, dtype=torch.float32, device=device) for _ in range(3))
    p_ref, b_ref = prefix.clone(), blocks.clone()
    ref = attn_res_reference(p_ref, delta, b_ref, nw, qk, ow, num_blocks, write_idx, 1e-5, 1e-5)
    out = torch.full_like(prefix, float("nan"))
    attn_res(prefix, delta, blocks, nw, qk, ow, num_blocks, write_idx, 1e-5, 1e-5, out=out)
    torch.testing.assert_close(out.float(), ref.float(), **BF16)
    # one bf16 rounding of the same fp32 sum (the interpreter may round differently by one ulp)
    torch.testing.assert_close(prefix, p_ref, rtol=8e-3, atol=1e-6)
    torch.testing.assert_close(blocks, b_ref, rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_rmsnorm_and_gated_rmsnorm(device):
    from latency_specialized.bench.stock.norms import gated_rmsnorm, rmsnorm

    g = _gen(11)
    x = _rand(5, 600, gen=g, device=device)[:, :576]  # strided rows
    w = _rand(576, gen=g, device=device)
    out = torch.full((5, 576), float("nan"), dtype=torch.bfloat16, device=device)
    rmsnorm(x, w, 1e-5, out=out)
    torch.testing.assert_close(out.float(), rmsnorm_reference(x, w, 1e-5).float(), **BF16)
    H, D = 3, 128
    xg = _rand(4, 2 * H * D, gen=g, device=device)
    o, gate = xg[:, : H * D], xg[:, H * D:]
    wn = _rand(D, gen=g, dtype=torch.float32, device=device)
    out2 = torch.full((4, H * D), float("nan"), dtype=torch.bfloat16, device=device)
    gated_rmsnorm(o, gate, wn, D, 1e-5, out=out2)
    ref = rmsnorm_reference(o.reshape(4, H, D), wn, 1e-5, gate=gate.reshape(4, H, D)).reshape(4, H * D)
    torch.testing.assert_close(out2.float(), ref.float(), **BF16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B", [1, 5])
def test_kda_conv_recurrent_norm_equals_op_reference(device, B):
    from latency_specialized.bench.stock.kda import conv_update, recurrent_kda
    from latency_specialized.bench.stock.norms import gated_rmsnorm

    g = _gen(100 + B)
    H, D, W, S = 2, 128, 4, B + 3
    HD = H * D
    mixed = _rand(B, 3 * HD, gen=g, device=device)
    conv_state = _rand(S, 3 * HD, W - 1, gen=g, device=device)
    conv_w = _rand(3 * HD, W, gen=g, device=device, scale=0.5)
    f = _rand(B, HD, gen=g, device=device)
    A_log = _rand(H, gen=g, dtype=torch.float32, device=device, scale=0.3)
    dt_bias = _rand(HD, gen=g, dtype=torch.float32, device=device, scale=0.3)
    beta = _rand(B, H, gen=g, device=device)
    g_out = _rand(B, HD, gen=g, device=device)
    norm_w = _rand(D, gen=g, dtype=torch.float32, device=device)
    state = _rand(S, H, D, D, gen=g, dtype=torch.float32, device=device, scale=0.1)
    idx = torch.randperm(S, generator=g)[:B].to(torch.int32).to(device)
    cs_ref, st_ref = conv_state.clone(), state.clone()
    ref = kda_decode_reference(mixed, cs_ref, conv_w, f, A_log, dt_bias, beta, g_out, norm_w, st_ref, idx,
                               num_heads=H, eps=1e-5, gate_lower_bound=-5.0)
    conv = torch.full((B, 3 * HD), float("nan"), dtype=torch.bfloat16, device=device)
    conv_update(mixed, conv_state, conv_w, idx, out=conv)
    o = torch.full((B, HD), float("nan"), dtype=torch.bfloat16, device=device)
    recurrent_kda(conv, f, A_log, dt_bias, beta, state, idx, num_heads=H, lower_bound=-5.0, out=o)
    y = torch.full((B, HD), float("nan"), dtype=torch.bfloat16, device=device)
    gated_rmsnorm(o, g_out, norm_w, D, 1e-5, out=y)
    torch.testing.assert_close(y.float(), ref.float(), **BF16)
    torch.testing.assert_close(conv_state, cs_ref, rtol=0, atol=0)
    # fp32 state, but fed by bf16 q/k/v: a one-ulp difference in the conv rounding moves it by ~1e-3
    torch.testing.assert_close(state, st_ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M", [1, 6])
def test_topk_align_fused_moe_equals_experts_reference(device, M):
    from latency_specialized.bench.stock.moe import (AlignBuffers, AlignSizes, grouped_topk, moe_align,
                                                     moe_gemm, moe_sum, situ_and_mul)

    g = _gen(200 + M)
    E, k, K, I = 24, 4, 128, 64
    router = RouterSpec(score_func="sigmoid", bias_corrected=True, renormalize=True, routed_scaling=1.0)
    act = ActivationSpec(kind="situ_glu", beta=4.0, beta_lin=25.0)
    logits = _rand(M, E, gen=g, dtype=torch.float32, device=device)
    bias = _rand(E, gen=g, dtype=torch.float32, device=device, scale=0.1)
    w_ref, ids_ref = route_reference(logits, bias, k, router)
    w = torch.full((M, k), float("nan"), device=device)
    ids = torch.full((M, k), -1, dtype=torch.int32, device=device)
    grouped_topk(logits, bias, k, weights=w, ids=ids)
    assert torch.equal(ids.long(), ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)

    sizes = AlignSizes(pairs=M * k, experts=E, block_m=16)
    buf = moe_align(ids, AlignBuffers.allocate(sizes, device))
    n_pad = int(buf.num_padded)
    sorted_ids = buf.sorted_ids[:n_pad].cpu()
    real = sorted_ids[sorted_ids < M * k]
    assert sorted(real.tolist()) == list(range(M * k))  # every pair exactly once
    flat = ids.flatten().cpu()
    for blk in range(n_pad // 16):
        rows = sorted_ids[blk * 16:(blk + 1) * 16]
        rows = rows[rows < M * k]
        assert bool((flat[rows] == int(buf.expert_ids[blk])).all())

    x = _rand(M, K, gen=g, device=device)
    w13 = _rand(E, 2 * I, K, gen=g, device=device, scale=K ** -0.5)
    w2 = _rand(E, K, I, gen=g, device=device, scale=I ** -0.5)
    ref = experts_reference(x, w_ref, ids_ref, w13, w2, act)
    gu = torch.full((M * k, 2 * I), float("nan"), dtype=torch.bfloat16, device=device)
    moe_gemm(x, w13, buf, k, out=gu, a_per_pair=False)
    h = torch.full((M * k, I), float("nan"), dtype=torch.bfloat16, device=device)
    situ_and_mul(gu, 4.0, 25.0, out=h)
    y_pairs = torch.full((M * k, K), float("nan"), dtype=torch.bfloat16, device=device)
    moe_gemm(h, w2, buf, k, out=y_pairs, a_per_pair=True, topk_weights=w.flatten())
    y = torch.full((M, K), float("nan"), dtype=torch.bfloat16, device=device)
    moe_sum(y_pairs, k, out=y)
    torch.testing.assert_close(y.float(), ref.float(), **BF16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "addend"])
def test_moe_sum_adds_an_addend_after_rounding_the_sum(device, accumulate):
    """``moe_sum`` (every Triton fused-MoE path's last kernel): the sum over a token's pairs in fp32, in pair order,
    rounded; with ``accumulate`` its destination holds an addend and gets ``round(round(sum) + addend)`` - what
    ``y + shared`` gave as a kernel of its own (``kernels/moe_addend.py``). Bit-exact against that order."""
    from latency_specialized.kernels.triton_moe import moe_sum

    g = _gen(300)
    M, k, N = 3, 6, 1100                                   # N over one 1024-wide block: a masked tail
    yp = _rand(M * k, N, gen=g, device=device)
    addend = _rand(M, N, gen=g, device=device)
    def rnd(t):  # the interpreter converts fp32 -> bf16 by truncation, the GPU to nearest even
        return (t.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16) if device == "cpu" \
            else t.to(torch.bfloat16)

    acc = yp.view(M, k, N)[:, 0].float()
    for j in range(1, k):
        acc = acc + yp.view(M, k, N)[:, j].float()
    want = rnd(rnd(acc).float() + addend.float()) if accumulate else rnd(acc)
    y = addend.clone() if accumulate else torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device)
    assert moe_sum(yp, k, out=y, accumulate=accumulate) is y
    assert torch.equal(y, want)
