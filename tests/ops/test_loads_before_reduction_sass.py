"""The one-program-per-row Triton kernels at batch 1 issue every global load before their first block reduction.

A block reduction is a barrier (``BAR.SYNC``) that the compiler does not move a global load across, so a load written
after one starts only when the reduction is done: one more DRAM round trip, in series. Read off the sm_90a SASS that
Triton's own ptxas makes (no GPU; ``testing.offline_sass``), at Muse Spark's TP8 shapes, where the H200 profile showed
the gated joins and the experts' finalize latency-bound at batch 1, and in the MLA call's latent-tiled merge at Kimi K3
and GLM-5.3 TP8 shapes (``kernels/NOTES.md``, session 38): every LDG before the first BAR (or, in the one-warp QK
norm + RoPE, the first shuffle), and no spilled registers.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its ptxas)")


def _launches(call):
    from tests.triton_offline import recorded_launches

    with recorded_launches() as launches:
        call()
    return launches


def _loads_then_barriers(launches, reduction: tuple[str, ...] = ("BAR",)) -> list[tuple[str, str, int]]:
    """Per compiled kernel: the global-load / reduction / store sequence (``L`` / ``B`` / ``S``) and its stack bytes.
    ``reduction``: the opcodes that make a reduction wait - a block's barrier; in a one-warp program its shuffles
    (the shuffles of a block reduction's first, in-warp stage may interleave with loads: nothing waits there)."""
    from latency_specialized.testing.offline_sass import sass_of
    from tests.triton_offline import ptx_for_hopper, resource_usage

    stacks = resource_usage(launches)
    out = []
    for key, ptx in ptx_for_hopper(launches).items():
        code = "".join("L" if o.startswith("LDG") else "B" if o.startswith(reduction) else
                       "S" if o.startswith("STG") else "" for o in sass_of(ptx).order)
        out.append((key, code, stacks[key][1]))
    return out


def _check(launches, reduction: tuple[str, ...] = ("BAR",)) -> None:
    for key, code, stack in _loads_then_barriers(launches, reduction):
        assert "B" in code and "L" not in code[code.index("B"):], (key, code)
        assert stack == 0, (key, stack)


@pytest.mark.parametrize("post", ["weighted", "input_scaled", "weightless", "none"])
@pytest.mark.parametrize("gate", ["vector", "scalar", None])
def test_gated_join_loads_every_operand_before_its_first_reduction(post, gate):
    from latency_specialized.kernels.residual_gated_triton import gated_join_triton

    H = 8192   # Muse Spark's hidden size
    s, y = torch.randn(1, H).bfloat16(), torch.randn(1, H).bfloat16()
    w, pw = torch.randn(H).bfloat16(), torch.randn(H).bfloat16()
    g = {"vector": torch.randn(1, H), "scalar": torch.randn(1), None: None}[gate]
    _check(_launches(lambda: gated_join_triton(y, s, w, 1e-6, post=post, post_weight=pw, gate=g)))


@pytest.mark.parametrize("k,N", [(8, 4096), (6, 4096), (16, 2048)])
def test_finalize_loads_every_route_before_the_reduction(k, N):
    from latency_specialized.kernels.moe_finalize_triton import all_routes, finalize_triton

    assert all_routes(k, N)
    y, w, g = torch.randn(1, k, N).bfloat16(), torch.rand(1, k), torch.randn(N).bfloat16()
    _check(_launches(lambda: finalize_triton(y, w, g, 1e-6)))


def test_the_route_loop_is_what_the_tile_replaces():
    """The wide-token fallback still loads route j + 1 after route j's reduction (why the tile exists)."""
    from latency_specialized.kernels.moe_finalize_triton import all_routes, finalize_triton

    k, N = 8, 8192
    assert not all_routes(k, N)
    y, w, g = torch.randn(1, k, N).bfloat16(), torch.rand(1, k), torch.randn(N).bfloat16()
    [(_, code, stack)] = _loads_then_barriers(_launches(lambda: finalize_triton(y, w, g, 1e-6)))
    assert code.count("B") >= k and "L" in code[code.index("B"):] and stack == 0


@pytest.mark.parametrize("gains", [True, False])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_qk_norm_rope_loads_gains_and_angles_before_the_norm(gains, style):
    from latency_specialized.kernels.qk_norm_rope_triton import qk_norm_rope_triton

    qkv = torch.randn(1, (16 + 2 + 2) * 64).bfloat16()   # Muse Spark TP8: 16 query and 2 KV heads of 64
    w = {"q_weight": torch.randn(64).bfloat16(), "k_weight": torch.randn(64).bfloat16()} if gains else {}
    _check(_launches(lambda: qk_norm_rope_triton(qkv, 16, 2, 64, 1e-6, positions=torch.zeros(1, dtype=torch.long),
                                                 inv_freq=torch.rand(32), style=style, **w)), reduction=("SHFL",))


@pytest.mark.parametrize("heads,nope,v", [(12, 128, 128), (8, 192, 256)], ids=["kimi_k3_tp8", "glm53_tp8"])
def test_mla_latent_tiled_merge_loads_every_split_before_its_reductions(heads, nope, v, monkeypatch):
    """Batch 1, context 4096 (130 splits): the merge reads every split's m, l and partial columns before the max and
    the denominator (it read the partials after them: one more round trip in the MLA call's latency chain)."""
    import latency_specialized.kernels.mla_decode_triton as mla

    monkeypatch.setattr(mla, "sm_count", lambda device: 132)
    B, L, R, bs, ctx, d = 1, 512, 64, 64, 4096, torch.bfloat16
    nb = ctx // bs + 1
    q, kv = torch.randn(B, heads, nope + R).to(d), torch.randn(B, L + R).to(d)
    args = (q, kv[:, :L], kv[:, L:], torch.zeros(nb, bs, L + R, dtype=d), torch.zeros(B, dtype=torch.long),
            torch.arange(nb, dtype=torch.int32).repeat(B, 1), torch.full((B,), ctx, dtype=torch.int32),
            torch.randn(heads * (nope + v), L).to(d))
    launches = _launches(lambda: mla.mla_decode_triton(*args, qk_nope_head_dim=nope, v_head_dim=v,
                                                       kv_norm_weight=torch.ones(L, dtype=d)))
    merge = [x for x in launches if x[0].fn.__name__ == "merge_tiles_kernel"]
    assert len(merge) == 1 and merge[0][2]["S_TILE"] == merge[0][2]["S_PAD"]
    [(key, code, stack)] = _loads_then_barriers(merge)
    # the body: loads, then its reductions, then its partial output's store; what follows the store is the last
    # arriver's tail, which reads the other programs' outputs after the arrival (it must)
    body = code[:code.index("S")]
    assert "B" in body and "L" not in body[body.index("B"):] and stack == 0, (key, code, stack)


def test_sparse_mqa_combine_loads_partials_and_angles_before_its_reductions():
    """DeepSeek-V4.1-Flash TP8, batch 1: the sparse MQA combine reads every split's m, l and partial channels, the
    sink and the angle inputs before its max / denominator reductions (it read the partials and angles after them).
    After the first barrier only sin / cos's large-argument path reads its constant table (libdevice)."""
    import latency_specialized.kernels.sparse_mqa_triton as smq
    from latency_specialized.testing.offline_sass import sass_of
    from tests.ops.test_sparse_mqa_triton import DSV4_TP8, make_case
    from tests.triton_offline import ptx_for_hopper, resource_usage

    args, kw, _ = make_case(801, [1], dtype=torch.bfloat16, sinks=True, norm=True, kv_norm=True, **dict(DSV4_TP8, K=512))
    combine = [x for x in _launches(lambda: smq.sparse_mqa_decode_triton(*args, **kw))
               if x[0].fn.__name__ == "combine_kernel"]
    [(key, ptx)] = ptx_for_hopper(combine).items()
    order = [o for o in sass_of(ptx).order if o.startswith(("LDG", "BAR"))]
    late = [o for o in order[order.index(next(o for o in order if o.startswith("BAR"))):] if o.startswith("LDG")]
    assert len(late) <= 2 and all(o == "LDG.E.CONSTANT" for o in late), (key, order)
    assert resource_usage(combine)[key][1] == 0


@pytest.mark.parametrize("ratio", [1, 2])
def test_sparse_mqa_compressor_pools_without_barriers_and_loads_before_its_norm(ratio):
    """DeepSeek-V4.1-Flash's compressor (D 512, RoPE 64) at batch 1: the ratio-2 pool of two rows is elementwise (it
    pooled a [2, D] tile with axis-0 reductions: ~30 barriers in series), and the norm gain, the RoPE angles and the
    cache slot are read up front (they were read after the norm's reduction). Two barriers are left: the norm's
    reduction, and the one before the RoPE partner is read back from the row just stored."""
    import re

    import latency_specialized.kernels.sparse_mqa_triton as smq
    from tests.ops.test_sparse_mqa_triton import make_compress_case

    args, kw, _ = make_compress_case(900, 1, D=512, R=64, ratio=ratio, dtype=torch.bfloat16)
    [(key, code, stack)] = _loads_then_barriers(_launches(lambda: smq.sparse_mqa_compress_triton(*args, **kw)))
    assert code.count("B") == 2 and re.fullmatch(r"[LS]*L[LS]*BS+B[LS]+", code), (key, code)
