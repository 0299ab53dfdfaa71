"""GPU tests of the MoE routing / routed-expert / KDA decode kernels and the side-stream helper.

Every case: fresh random inputs, outputs poisoned with NaN (or -1 ids) before the call and checked
to be fully written, compared with the plain-torch reference at per-dtype tolerances; CUDA-graph
replay must equal eager. Run on the H200: ``pytest -m gpu tests/ops/test_moe_kda_gpu.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from latency_specialized.ops.attention.kda import kda_decode_reference
from latency_specialized.ops.mlp import mlp_reference
from latency_specialized.ops.moe import experts_reference, route_reference
from latency_specialized.spec import ActivationSpec, RouterSpec

from gpu_helpers import graph_replay as _graph_replay, random_experts, seeded_generator as _gen

pytestmark = pytest.mark.gpu

DEV = "cuda"
SITU = ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)
SWIGLU_CLAMP = ActivationSpec(kind="swiglu", clamp=10.0)
SWIGLU = ActivationSpec(kind="swiglu")




# ----------------------------------------------------------------------------------------- router
ROUTER_CASES = [
    # (name, E, top_k, M, RouterSpec kwargs, logits dtype)
    ("k3_sigmoid", 896, 16, 1, dict(score_func="sigmoid"), torch.float32),
    ("k3_sigmoid_b7", 896, 16, 7, dict(score_func="sigmoid"), torch.float32),
    ("k3_sigmoid_b64", 896, 16, 64, dict(score_func="sigmoid"), torch.float32),
    ("dsv4_sqrtsoftplus", 384, 6, 5, dict(score_func="sqrtsoftplus", routed_scaling=1.5), torch.float32),
    ("muse_scaled_sigmoid_bf16", 250, 8, 9,
     dict(score_func="sigmoid", logit_scale=2 ** -2.5, renormalize_eps=1e-15), torch.bfloat16),
    ("softmax_nobias_odd", 37, 5, 3, dict(score_func="softmax", logit_scale=0.7, bias_corrected=False,
                                          renormalize_eps=1e-6, routed_scaling=2.5), torch.float32),
    ("glm_no_renorm", 256, 8, 2, dict(score_func="sigmoid", renormalize=False, routed_scaling=2.5), torch.float32),
    # sort kernel edges: one warp (E < 32), a partial last warp, the 1024-expert limit
    ("sort_one_warp", 20, 7, 3, dict(score_func="sigmoid"), torch.float32),
    ("sort_1024_k16", 1024, 16, 4, dict(score_func="sqrtsoftplus"), torch.float32),
    ("sort_odd_e_k1", 999, 1, 2, dict(score_func="sigmoid"), torch.float32),
]


def _router_kernels(E, top_k, router) -> list[bool]:
    """The kernels (sort=False: redux rounds; sort=True: sort + merge tree) that can route this router."""
    from latency_specialized.kernels.moe_router import sort_applies

    return [False] + ([True] if sort_applies(E, top_k, router.score_func) is None else [])


def _route_and_check(logits, bias, top_k, router, ids_dtype=torch.int64):
    """Every applicable router kernel vs the reference: exact ids, weights to fp32 rounding; the two
    kernels' weights bit-identical (same winner order, same renormalisation)."""
    from latency_specialized.kernels.moe_router import route

    M = logits.shape[0]
    rw, rids = route_reference(logits, bias, top_k, router)
    results = []
    for sort in _router_kernels(logits.shape[1], top_k, router):
        w = torch.full((M, top_k), float("nan"), device=DEV)
        ids = torch.full((M, top_k), -1, dtype=ids_dtype, device=DEV)
        route(logits, bias, top_k, router, out_weights=w, out_ids=ids, sort=sort)
        torch.cuda.synchronize()
        assert not torch.isnan(w).any(), f"router (sort={sort}) left weights unwritten"
        assert not (ids < 0).any(), f"router (sort={sort}) left ids unwritten"
        assert torch.equal(ids.long(), rids), f"ids differ (sort={sort}):\n{ids}\n{rids}"
        torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
        results.append((w, ids))
    for w, ids in results[1:]:
        assert torch.equal(w, results[0][0]) and torch.equal(ids, results[0][1])
    return results[-1]


@pytest.mark.parametrize("name,E,top_k,M,rkw,ldt", ROUTER_CASES, ids=[c[0] for c in ROUTER_CASES])
def test_router_matches_reference(name, E, top_k, M, rkw, ldt):
    g = _gen(name)
    router = RouterSpec(**rkw)
    logits = (torch.randn(M, E, generator=g, device=DEV) * 2).to(ldt)
    bias = torch.randn(E, generator=g, device=DEV) * 0.1
    _route_and_check(logits, bias, top_k, router)


@pytest.mark.parametrize("with_bias", [False, True])
def test_router_ties_go_to_lower_id(with_bias):
    g = _gen(7)
    router = RouterSpec(score_func="sigmoid")
    E, k, M = 896, 16, 6
    # four distinct logit values only: hundreds of exact ties at every rank
    logits = torch.randint(0, 4, (M, E), generator=g, device=DEV).float() * 0.25
    bias = (torch.randint(0, 2, (E,), generator=g, device=DEV).float() * 0.125) if with_bias else None
    _route_and_check(logits, bias, k, router)


def test_router_int32_ids_and_graph_replay():
    from latency_specialized.kernels.moe_router import route

    g = _gen(3)
    router = RouterSpec(score_func="sigmoid")
    E, k, M = 896, 16, 8
    logits = torch.randn(M, E, generator=g, device=DEV)
    bias = torch.randn(E, generator=g, device=DEV) * 0.1
    w_e, ids_e = _route_and_check(logits, bias, k, router, ids_dtype=torch.int32)
    for sort in _router_kernels(E, k, router):
        w = torch.full_like(w_e, float("nan"))
        ids = torch.full_like(ids_e, -1)
        _graph_replay(lambda: route(logits, bias, k, router, out_weights=w, out_ids=ids, sort=sort))
        assert torch.equal(w, w_e) and torch.equal(ids, ids_e)


# ---------------------------------------------------------------------------------------- experts
def _random_routing(M, E, k, g, *, same_for_all=False):
    logits = torch.randn(1 if same_for_all else M, E, generator=g, device=DEV)
    ids = logits.topk(k, dim=-1).indices.expand(M, k).contiguous()
    w = torch.rand(M, k, generator=g, device=DEV) + 0.05
    return w / w.sum(-1, keepdim=True), ids


def _expert_weights(E, I, K, N, dtype, g):
    return random_experts(E, 2 * I, K, g, dtype, DEV), random_experts(E, N, I, g, dtype, DEV)


EXPERT_CASES = [
    # (name, E, K, I, N, top_k, M, activation, dtype, same_for_all)
    ("k3_tp8_b1", 896, 3584, 384, 3584, 16, 1, SITU, torch.bfloat16, False),
    ("k3_tp8_b3", 896, 3584, 384, 3584, 16, 3, SITU, torch.bfloat16, False),
    ("k3_tp8_b64", 896, 3584, 384, 3584, 16, 64, SITU, torch.bfloat16, False),
    ("k3_tp16_b1", 896, 3584, 192, 3584, 16, 1, SITU, torch.bfloat16, False),
    ("odd_swiglu_b5", 37, 512, 136, 200, 3, 5, SWIGLU_CLAMP, torch.bfloat16, False),
    ("odd_all_same_b5", 37, 512, 136, 200, 3, 5, SWIGLU_CLAMP, torch.bfloat16, True),
    ("odd_situ_b1", 37, 512, 136, 200, 3, 1, SITU, torch.bfloat16, False),
    # rows wider than one gate_up pass (moe_experts.GU_MAX_KVEC): GLM-5.3 / DeepSeek-V4.1-Flash / Muse Spark TP8
    ("glm_tp8_b1", 256, 6144, 256, 6144, 8, 1, SWIGLU, torch.bfloat16, False),
    ("glm_tp8_b8", 256, 6144, 256, 6144, 8, 8, SWIGLU, torch.bfloat16, False),
    ("dsv41_tp8_b1", 384, 5120, 288, 5120, 6, 1, SWIGLU_CLAMP, torch.bfloat16, False),
    ("dsv41_tp8_b13", 384, 5120, 288, 5120, 6, 13, SWIGLU_CLAMP, torch.bfloat16, False),
    ("muse_tp8_b5_same", 256, 4096, 512, 4096, 8, 5, SWIGLU, torch.bfloat16, True),
]


@pytest.mark.parametrize("name,E,K,I,N,top_k,M,act,dtype,same", EXPERT_CASES, ids=[c[0] for c in EXPERT_CASES])
def test_experts_match_reference(name, E, K, I, N, top_k, M, act, dtype, same):
    from latency_specialized.kernels.moe_experts import experts

    g = _gen(name)
    w13, w2 = _expert_weights(E, I, K, N, dtype, g)
    x = torch.randn(M, K, generator=g, device=DEV).to(dtype)
    w, ids = _random_routing(M, E, top_k, g, same_for_all=same)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEV)
    experts(x, w, ids, w13, w2, act, out=out)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "experts left outputs unwritten"
    ref = experts_reference(x, w, ids, w13, w2, act)
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * scale)
    # deterministic: the same call again is bitwise identical
    again = experts(x, w, ids, w13, w2, act)
    assert torch.equal(again, out)


from latency_specialized.bench.ops_bench_moe_kda import EXPERT_VARIANTS  # noqa: E402

TUNING_VARIANTS = {k: v for k, v in EXPERT_VARIANTS.items() if v}
TUNING_VARIANTS["pdl"] = dict(pdl=True)


def tuning_changes_multi_token(variant: str) -> bool:
    return variant == "pdl"


# The multi-token path has its own tuning: only PDL changes it, so M=3 runs for that variant alone.
TUNING_CASES = [(v, m) for v in TUNING_VARIANTS for m in (1, 3) if m == 1 or tuning_changes_multi_token(v)]


@pytest.mark.parametrize("variant,M", TUNING_CASES)
def test_experts_tuning_variants_match_reference(variant, M):
    from latency_specialized.kernels.moe_experts import experts

    tuning = TUNING_VARIANTS[variant]
    g = _gen(f"variant-{variant}-{M}")
    E, K, I, N, k = 896, 3584, 384, 3584, 16
    w13, w2 = _expert_weights(E, I, K, N, torch.bfloat16, g)
    x = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    w, ids = _random_routing(M, E, k, g)
    ref = experts_reference(x, w, ids, w13, w2, SITU)
    scale = ref.float().abs().max().item()
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    experts(x, w, ids, w13, w2, SITU, out=out, **tuning)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * scale)
    # and inside a CUDA graph (PDL edges are captured as programmatic dependencies)
    replay = torch.full_like(out, float("nan"))
    ws: dict = {}
    _graph_replay(lambda: experts(x, w, ids, w13, w2, SITU, out=replay, workspace=ws, **tuning))
    assert torch.equal(replay, out)


@pytest.mark.parametrize("M,kvec", [(1, 5), (1, 1), (3, 5), (8, 13)])
def test_experts_in_uneven_passes_match_reference(M, kvec):
    """Rows in passes of ``gu_kvec`` vectors (Kimi K3's 14 vectors as 5 + 5 + 4, one per pass, 13 + 1):
    the partial dots add up to the one-pass result within bf16 rounding, in eager and graph replay."""
    from latency_specialized.kernels.moe_experts import experts

    g = _gen(f"passes-{M}-{kvec}")
    E, K, I, N, k = 64, 3584, 384, 1024, 8
    w13, w2 = _expert_weights(E, I, K, N, torch.bfloat16, g)
    x = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    w, ids = _random_routing(M, E, k, g)
    ref = experts_reference(x, w, ids, w13, w2, SITU)
    scale = ref.float().abs().max().item()
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    experts(x, w, ids, w13, w2, SITU, out=out, gu_kvec=kvec)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * scale)
    replay = torch.full_like(out, float("nan"))
    ws: dict = {}
    _graph_replay(lambda: experts(x, w, ids, w13, w2, SITU, out=replay, workspace=ws, gu_kvec=kvec))
    assert torch.equal(replay, out)


def test_experts_graph_replay_equals_eager():
    from latency_specialized.kernels.moe_experts import experts

    g = _gen(11)
    E, K, I, N, k, M = 64, 1024, 384, 1024, 8, 6
    w13, w2 = _expert_weights(E, I, K, N, torch.bfloat16, g)
    x = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    w, ids = _random_routing(M, E, k, g)
    eager = experts(x, w, ids, w13, w2, SITU)
    out = torch.full_like(eager, float("nan"))
    ws: dict = {}
    graph = _graph_replay(lambda: experts(x, w, ids, w13, w2, SITU, out=out, workspace=ws))
    assert torch.equal(out, eager)
    # new routing written into the static buffers is picked up by the replay (no host state)
    new_w, new_ids = _random_routing(M, E, k, g)
    ids.copy_(new_ids)
    w.copy_(new_w)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, experts(x, w, ids, w13, w2, SITU))
    assert not torch.equal(out, eager)


# -------------------------------------------------------------------------------------------- KDA
def _kda_inputs(B, H, S, dtype, pdtype, g, D=128, W=4):
    HD = H * D
    r = lambda *s: torch.randn(*s, generator=g, device=DEV)  # noqa: E731
    return dict(
        mixed_qkv=r(B, 3 * HD).to(dtype),
        conv_state=r(S, 3 * HD, W - 1).to(dtype),
        conv_weight=(r(3 * HD, W) * 0.5).to(pdtype),
        f=r(B, HD).to(dtype),
        A_log=(r(H) * 0.5).to(pdtype),
        dt_bias=(r(HD) * 0.5).to(pdtype),
        beta_logit=r(B, H).to(dtype),
        g_out=r(B, HD).to(dtype),
        norm_weight=(1 + 0.1 * r(D)).to(pdtype),
        state=r(S, H, D, D) * 0.1,
        state_idx=torch.randperm(S, generator=g, device=DEV)[:B].to(torch.int32),
    )


KDA_CASES = [
    # (name, B, H, dtype, param dtype)
    ("k3_tp8_b1", 1, 12, torch.bfloat16, torch.float32),
    ("k3_tp8_b5", 5, 12, torch.bfloat16, torch.float32),
    ("k3_tp8_b64", 64, 12, torch.bfloat16, torch.float32),
    ("k3_tp16_b3", 3, 6, torch.bfloat16, torch.bfloat16),
    ("fp32_b4", 4, 3, torch.float32, torch.float32),
]


KDA_VARIANTS = {"rs1": dict(row_split=1, stage_smem=False), "rs2": dict(row_split=2, stage_smem=False),
                "smem": dict(row_split=1, stage_smem=True)}
"""State in registers (one CTA, or a 2-CTA cluster per head) or staged through shared memory."""


@pytest.mark.parametrize("variant", list(KDA_VARIANTS))
@pytest.mark.parametrize("name,B,H,dtype,pdtype", KDA_CASES, ids=[c[0] for c in KDA_CASES])
def test_kda_matches_reference(name, B, H, dtype, pdtype, variant):
    from latency_specialized.kernels.kda_decode import kda_decode

    g = _gen(name)
    S = 2 * B + 3
    inp = _kda_inputs(B, H, S, dtype, pdtype, g)
    ref_in = {k: v.clone() for k, v in inp.items()}
    out = torch.full((B, H * 128), float("nan"), dtype=dtype, device=DEV)
    kda_decode(**inp, num_heads=H, out=out, **KDA_VARIANTS[variant])
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "kda left outputs unwritten"
    ref = kda_decode_reference(**ref_in, num_heads=H)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype != torch.float32 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    # fp32 state: updated rows match, untouched rows are bit-identical. With bf16 activations the
    # conv output is rounded to bf16 (as the reference does); a different fp32 summation order can
    # land a value on the other side of a rounding boundary (1 bf16 ulp = 2^-8 relative), which moves
    # that row of v' k^T by ~4e-3 * |v'||k|: hence 1e-3 for bf16 (seen: 2e-4 max on 103/25M elements).
    stol = dict(rtol=1e-3, atol=1e-3) if dtype != torch.float32 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(inp["state"], ref_in["state"], **stol)
    untouched = torch.ones(S, dtype=torch.bool, device=DEV)
    untouched[inp["state_idx"].long()] = False
    assert torch.equal(inp["state"][untouched], _kda_inputs(B, H, S, dtype, pdtype, _gen(name))
                       ["state"][untouched])
    assert torch.equal(inp["conv_state"], ref_in["conv_state"])
    if variant == "smem":  # the same arithmetic in the same order as the register variant: bit-identical
        reg_in = _kda_inputs(B, H, S, dtype, pdtype, _gen(name))
        reg_out = kda_decode(**reg_in, num_heads=H, row_split=1, stage_smem=False)
        assert torch.equal(out, reg_out) and torch.equal(inp["state"], reg_in["state"])


@pytest.mark.parametrize("variant", list(KDA_VARIANTS))
def test_kda_graph_replay_equals_eager(variant):
    from latency_specialized.kernels.kda_decode import kda_decode

    g = _gen(5)
    B, H, S = 8, 12, 20
    inp = _kda_inputs(B, H, S, torch.bfloat16, torch.float32, g)
    eager_in = {k: v.clone() for k, v in inp.items()}
    eager = kda_decode(**eager_in, num_heads=H, **KDA_VARIANTS[variant])
    graph_in = {k: v.clone() for k, v in inp.items()}
    out = torch.full_like(eager, float("nan"))
    snapshot = {k: v.clone() for k, v in graph_in.items()}

    def step():
        kda_decode(**graph_in, num_heads=H, out=out, **KDA_VARIANTS[variant])

    # warm-up + capture each ran the step (in place); restore the states before the measured replay
    gr = _graph_replay(step)
    for k in ("state", "conv_state"):
        graph_in[k].copy_(snapshot[k])
    gr.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert torch.equal(graph_in["state"], eager_in["state"])
    assert torch.equal(graph_in["conv_state"], eager_in["conv_state"])


@pytest.mark.parametrize("variant", list(KDA_VARIANTS))
@pytest.mark.parametrize("B,H,dtype", [(1, 12, torch.bfloat16), (5, 12, torch.bfloat16), (64, 12, torch.bfloat16),
                                       (3, 3, torch.float32)])
def test_kda_fused_decay_input_matches_reference(B, H, dtype, variant):
    """f_b_weight given: f is the low-rank f_a (a strided column slice, as in the fused in_proj output)
    and the kernel computes the decay input round(f_a @ f_b^T) itself."""
    from latency_specialized.kernels.kda_decode import kda_decode

    g = _gen(f"fused{B}{H}{variant}")
    S, R, HD = 2 * B + 3, 128, H * 128
    inp = _kda_inputs(B, H, S, dtype, torch.float32, g)
    wide = torch.randn(B, 4 * HD + R + 16, generator=g, device=DEV).to(dtype)  # [.. | f_a | ..] like in_proj
    f_a = wide[:, 4 * HD:4 * HD + R]
    f_b = (torch.randn(HD, R, generator=g, device=DEV) * R ** -0.5).to(dtype)
    inp["f"] = f_a
    ref_in = {k: v.clone() for k, v in inp.items()}
    out = torch.full((B, HD), float("nan"), dtype=dtype, device=DEV)
    kda_decode(**inp, num_heads=H, out=out, f_b_weight=f_b, **KDA_VARIANTS[variant])
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "kda left outputs unwritten"
    ref = kda_decode_reference(**ref_in, num_heads=H, f_b_weight=f_b)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype != torch.float32 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    # the decay input is rounded like the gemm's output: a summation-order difference can move it by
    # one bf16 ulp (2^-8 relative), which moves the decayed state by ~exp(g) * 2^-8 * |g| -> 1e-2 for bf16
    stol = dict(rtol=1e-2, atol=1e-2) if dtype != torch.float32 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(inp["state"], ref_in["state"], **stol)
    assert torch.equal(inp["conv_state"], ref_in["conv_state"])
    assert torch.equal(f_a, wide[:, 4 * HD:4 * HD + R])  # input untouched


def test_kda_fused_decay_graph_replay_equals_eager():
    from latency_specialized.kernels.kda_decode import kda_decode

    g = _gen(11)
    B, H, S, R = 8, 12, 20, 128
    inp = _kda_inputs(B, H, S, torch.bfloat16, torch.float32, g)
    inp["f"] = torch.randn(B, R, generator=g, device=DEV).bfloat16()
    f_b = (torch.randn(H * 128, R, generator=g, device=DEV) * R ** -0.5).bfloat16()
    eager_in = {k: v.clone() for k, v in inp.items()}
    eager = kda_decode(**eager_in, num_heads=H, f_b_weight=f_b)
    graph_in = {k: v.clone() for k, v in inp.items()}
    out = torch.full_like(eager, float("nan"))
    snapshot = {k: v.clone() for k, v in graph_in.items()}
    gr = _graph_replay(lambda: kda_decode(**graph_in, num_heads=H, out=out, f_b_weight=f_b))
    for k in ("state", "conv_state"):
        graph_in[k].copy_(snapshot[k])
    gr.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(graph_in["state"], eager_in["state"])


# ------------------------------------------------------------------------------------ side stream
def _shared_mlp(x, w13, w2, act):
    gu = torch.nn.functional.linear(x, w13)
    inter = w13.shape[0] // 2
    from latency_specialized.ops.activation import gated_activation

    h = gated_activation(gu[:, :inter], gu[:, inter:], act).to(x.dtype)
    return torch.nn.functional.linear(h, w2)


def test_side_stream_shared_expert_in_graph():
    from latency_specialized.kernels.moe_experts import experts
    from latency_specialized.runtime.side_stream import SideStream

    g = _gen(21)
    M, H_, Is, E, K, I, k = 4, 2048, 512, 32, 1024, 256, 4
    x = torch.randn(M, H_, generator=g, device=DEV).bfloat16()
    xl = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    sw13 = (torch.randn(2 * Is, H_, generator=g, device=DEV) * H_ ** -0.5).bfloat16()
    sw2 = (torch.randn(K, Is, generator=g, device=DEV) * Is ** -0.5).bfloat16()
    w13, w2 = _expert_weights(E, I, K, K, torch.bfloat16, g)
    w, ids = _random_routing(M, E, k, g)
    side = SideStream()
    result = {}

    def step():
        pending = side.run(_shared_mlp, x, sw13, sw2, SITU)
        routed = experts(xl, w, ids, w13, w2, SITU)
        shared = pending.join()
        result["y"] = routed + shared

    gr = _graph_replay(step)
    y_graph = result["y"].clone()
    gr.replay()
    torch.cuda.synchronize()
    expect = (experts_reference(xl, w, ids, w13, w2, SITU).float()
              + mlp_reference(x, sw13, sw2, SITU).float())
    scale = expect.abs().max().item()
    torch.testing.assert_close(result["y"].float(), expect, rtol=3e-2, atol=3e-2 * scale)
    assert torch.equal(result["y"], y_graph)


def test_side_stream_join_orders_work():
    """Side work that is slow must still be complete when the main stream reads it after join."""
    from latency_specialized.runtime.side_stream import SideStream

    side = SideStream()
    a = torch.randn(4096, 4096, device=DEV)
    before = torch.cuda.current_stream()
    pending = side.run(lambda t: [t @ t for _ in range(4)][-1], a)
    out = pending.join()
    assert torch.cuda.current_stream() == before
    total = out.sum()  # on the main stream, after join
    torch.cuda.synchronize()
    assert math.isfinite(total.item())
    torch.testing.assert_close(out, a @ a, rtol=1e-3, atol=1e-2)
