"""CPU tests of the gemm / norm / prefetch kernels: they compile for sm_90a without a GPU and their
PTX holds the instructions the design depends on; the dispatch (measured table -> supports ->
plan) and the host-side helpers behave. Runs in CI (no GPU); ~30-60 s, dominated by compiles.
"""

import json

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels.compile_cache import cute_available
from latency_specialized.ops.registry import make_context

from ptx_patterns import WEIGHT_LOAD, last_weight_load, loads_before_wait, weight_loads

needs_cute = pytest.mark.skipif(cute_available() is not True, reason="nvidia-cutlass-dsl not installed")


def _ptx(compiled) -> str:
    from latency_specialized.kernels.gemm_common import ptx_of

    p = ptx_of(compiled)
    assert p, "compile kept no PTX"
    assert "ld.local" not in p and "st.local" not in p, "registers spilled to local memory"
    return p


# ------------------------------------------------------------------------------- compiles
@needs_cute
def test_gemv_compiles_to_16_byte_streaming_loads(sm90):
    from latency_specialized.kernels.gemm_gemv import GemvConfig, compile_gemv

    p = _ptx(compile_gemv(1536, 1, GemvConfig(), False))
    assert weight_loads(p) == 1536 // 8 // 32               # one 16-B weight load per lane per 512 B of row
    assert "ld.global.nc.v4.b32" in p                       # activations: 16 B, L1-cached
    assert "shfl.sync.bfly" in p and "griddepcontrol.wait" in p
    # the PDL prologue: every weight load of the first batch is issued before the wait, coherent (prefetch)
    assert p.index("griddepcontrol.wait") > last_weight_load(p) and loads_before_wait(p) == 1536 // 8 // 32
    # ragged K (448 = 56 vectors: 1 full round + a predicated tail), two tokens, residual epilogue
    p2 = _ptx(compile_gemv(448, 2, GemvConfig(rows_per_warp=2, pdl=False), True))
    assert "@p ld.global.nc.L1::no_allocate" in p2 and "griddepcontrol" not in p2


@needs_cute
def test_gemv_lookahead_issues_more_batches_before_the_wait(sm90):
    """lookahead L: batches 0..L are requested before griddepcontrol.wait (same loads in total)."""
    from latency_specialized.kernels.gemm_gemv import GemvConfig, compile_gemv

    for cfg, pre in ((GemvConfig(), 8), (GemvConfig(lookahead=1), 16), (GemvConfig(batch=4, lookahead=2), 12)):
        p = _ptx(compile_gemv(7168, 1, cfg, False))
        assert weight_loads(p) == 7168 // 8 // 32, cfg.label()
        assert loads_before_wait(p) == pre, cfg.label()
    assert GemvConfig(lookahead=2).label() == "r1w4b8a2fp"


@needs_cute
def test_gemv_k_split_streams_a_part_of_k_per_warp(sm90):
    """k_split: each warp loads K/k_split of its row (fewer loads per warp, more warps per row), partial
    sums meet over one barrier; the heuristic uses it for few rows; bad shapes are refused."""
    from latency_specialized.kernels.gemm_gemv import GemvConfig, compile_gemv, default_config

    for ks in (2, 4):
        p = _ptx(compile_gemv(7168, 1, GemvConfig(k_split=ks), False))
        assert weight_loads(p) == 7168 // 8 // 32 // ks and p.count("bar.sync") == 1
    assert "bar.sync" not in _ptx(compile_gemv(7168, 1, GemvConfig(), False))
    assert GemvConfig(k_split=4).label() == "r1w4b8k4fp"
    assert default_config(560, 7168, 1).k_split == 4 and default_config(896, 3584, 2).k_split == 2
    assert default_config(6288, 7168, 1).k_split == 1 and default_config(1000, 448, 3).k_split == 1
    for bad, k in ((GemvConfig(k_split=4), 3584), (GemvConfig(warps=6, k_split=4), 7168),
                   (GemvConfig(k_split=2, ctas_per_sm=2), 7168)):
        with pytest.raises(ValueError, match="k_split"):
            compile_gemv(k, 1, bad, False)


@needs_cute
def test_gemv_glu_epilogue_streams_gate_and_up_rows(sm90):
    """GLU mode: two weight rows per output row, bf16-rounded sums, the activation, one bf16 store."""
    from latency_specialized.kernels.gemm_gemv import GemvConfig, compile_gemv
    from latency_specialized.kernels.gated_act import ActVariant

    var = ActVariant(256, "bfloat16", "situ_glu", beta=4.0, beta_lin=25.0)
    p = _ptx(compile_gemv(7168, 1, GemvConfig(), False, glu=var))
    assert weight_loads(p) == 2 * 7168 // 8 // 32
    assert "cvt.rn.bf16x2.f32" in p and "ex2.approx" in p and p.count("st.global.b16") == 1
    with pytest.raises(ValueError, match="GLU"):
        compile_gemv(7168, 1, GemvConfig(), True, glu=var)


@needs_cute
def test_gemv_fp32_output_stores_the_unrounded_accumulator(sm90):
    """Router logits: bf16 x bf16 -> fp32 (vLLM's GateLinear out_dtype); no rounding to bf16 on store."""
    from latency_specialized.kernels.gemm_gemv import GemvConfig, compile_gemv

    p = _ptx(compile_gemv(7168, 1, GemvConfig(), False, out_fp32=True))
    assert "st.global.b32" in p        # 4-byte stores of the fp32 sums
    assert "cvt.rn.bf16" not in p       # a bf16 output would round here
    with pytest.raises(ValueError, match="residual"):
        compile_gemv(7168, 1, GemvConfig(), True, out_fp32=True)


@needs_cute
def test_gemv_split_stores_fp32_head_rows_and_rounded_tail_rows(sm90):
    """moe.gate_down: router logits (fp32) and latent rows (bf16) from one weight stream."""
    from latency_specialized.kernels.gemm_gemv import GemvConfig, compile_gemv

    p = _ptx(compile_gemv(7168, 2, GemvConfig(), False, out_fp32=True, split=True))
    assert weight_loads(p) == 7168 // 8 // 32                   # one stream per row
    assert p.count("st.global.b32") == 2 and p.count("st.global.b16") == 2  # per token: one of each kind
    assert "cvt.rn.bf16" in p                                   # only the tail rows round
    with pytest.raises(ValueError, match="split"):
        compile_gemv(7168, 2, GemvConfig(), False, out_fp32=False, split=True)
    with pytest.raises(ValueError, match="residual"):
        compile_gemv(7168, 2, GemvConfig(), True, out_fp32=True, split=True)


@needs_cute
def test_gemv_norm_prologue_reduces_the_row_then_rounds_the_normed_x(sm90):
    """q_a_norm inside q_b_proj: each warp re-reads x for its sum of squares, scales by rsqrt and the
    gain, rounds to bf16 (the norm op's output), then the usual stream; x rows take a row stride."""
    from latency_specialized.kernels.gemm_gemv import GemvConfig, compile_gemv

    p = _ptx(compile_gemv(1536, 2, GemvConfig(rows_per_warp=2), False, norm=True))
    plain = _ptx(compile_gemv(1536, 2, GemvConfig(rows_per_warp=2), False))
    assert p.count("rsqrt") == 2 and "rsqrt" not in plain                 # one per token
    assert p.count("cvt.rn.bf16x2.f32") >= 2 * 1536 // 2 // 32             # normed x rounded per pair
    assert weight_loads(p) == weight_loads(plain)                          # the weight stream is unchanged
    assert p.index("griddepcontrol.wait") < p.index("rsqrt")                # x is read after the PDL wait
    with pytest.raises(ValueError, match="norm prologue"):
        compile_gemv(1536, 1, GemvConfig(), False, out_fp32=True, split=True, norm=True)


@needs_cute
def test_gemv_norm_in_shared_memory_normalises_once_per_cta(sm90):
    """``NORM_SMEM``: the CTA's threads sum the row's squares (one barrier), write the rounded row to shared memory
    (16-byte stores, a barrier), and the stream reads x there - no x or gain global load and no scaling per weight
    vector; the weight stream and the PDL order are unchanged. K split over warps, persistent CTAs and a tail K too."""
    from latency_specialized.kernels.gemm_gemv import NORM_SMEM_MAX_BYTES, GemvConfig, compile_gemv

    for k, m, cfg in [(2048, 1, GemvConfig()), (1536, 3, GemvConfig(k_split=2)), (1280, 2, GemvConfig(ctas_per_sm=2)),
                      (1000, 4, GemvConfig(rows_per_warp=2, lookahead=1))]:
        p = _ptx(compile_gemv(k, m, cfg, False, norm=True, norm_smem=True))
        per_warp = _ptx(compile_gemv(k, m, cfg, False, norm=True))
        threads = 32 * cfg.warps
        per_thread = -(-(k // 8) // threads)                                  # row vectors a thread normalises
        # (the helpers' inline asm: "op {" / "op [" with a space; the compiler's own shared accesses use a tab)
        assert p.count("st.shared.v4.b32 [") == m * per_thread
        assert p.count("ld.shared.v4.b32 {") == m * -(-(k // 8) // 32) // cfg.k_split   # the stream's x: its part
        assert p.count("cvt.rn.bf16x2.f32") == 4 * m * per_thread             # each row rounded once per CTA
        assert p.count("cvt.rn.bf16x2.f32") < per_warp.count("cvt.rn.bf16x2.f32")
        assert p.count("rsqrt") == m
        assert weight_loads(p) == weight_loads(per_warp)
        assert p.index("griddepcontrol.wait") < p.index("st.shared.v4")       # x is read after the PDL wait
    with pytest.raises(ValueError, match="shared-memory norm"):
        compile_gemv(NORM_SMEM_MAX_BYTES // 2 + 8, 1, GemvConfig(), False, norm=True, norm_smem=True)
    with pytest.raises(ValueError, match="shared-memory norm"):
        compile_gemv(1536, 1, GemvConfig(), False, norm_smem=True)


@needs_cute
def test_mma_fp32_output_stores_the_unrounded_sums(sm90):
    """Router logits on the tensor-core kernels (split-K from M=4): fp32 stores, no bf16 rounding."""
    from latency_specialized.kernels.gemm_small_m import MmaConfig, compile_mma

    cfg = MmaConfig(nt=1, mt=1, wk=4, sk=2, cb=4)
    p, plain = _ptx(compile_mma(7168, cfg, False, out_fp32=True)), _ptx(compile_mma(7168, cfg, False))
    assert "st.global.f32" in p or "st.global.b32" in p
    assert "cvt.rn.bf16" not in p and "cvt.rn.bf16" in plain
    with pytest.raises(ValueError, match="residual"):
        compile_mma(7168, cfg, True, out_fp32=True)


@needs_cute
def test_small_m_compiles_to_mma_sync_with_register_fragments(sm90):
    from latency_specialized.kernels.gemm_small_m import MmaConfig, compile_mma

    p = _ptx(compile_mma(1536, MmaConfig(nt=2, wk=4, cb=4), True))
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in p
    assert weight_loads(p) and "ld.global.nc.v4.b32" in p
    assert "bar.sync" in p                                   # warps' partial tiles meet in shared memory
    assert "ldmatrix" not in p                               # fragments come straight from global loads
    # 48 chunks over 4 warps = 12 per warp, 2 rows each, 2 mma per chunk and n-tile
    assert weight_loads(p) == 12 * 2 and p.count("mma.sync") == 12 * 2 * 2


@needs_cute
def test_splitk_compiles_to_cluster_dsmem_reduction(sm90):
    from latency_specialized.kernels.gemm_small_m import MmaConfig, compile_mma

    p = _ptx(compile_mma(448, MmaConfig(nt=8, mt=2, wk=2, sk=4, cb=2), False))
    assert "barrier.cluster.arrive.release" in p and "barrier.cluster.wait.acquire" in p
    assert "mapa.shared::cluster" in p and "ld.shared::cluster.f32" in p
    assert "atom." not in p                                  # no atomics: fixed-order (deterministic) sums


@needs_cute
def test_rmsnorm_variants_compile(sm90):
    from latency_specialized.kernels.rmsnorm import NormConfig, NormVariant, compile_norm

    block = _ptx(compile_norm(NormVariant(7168, "bfloat16", True, True, False, False, True), NormConfig(cluster=2)))
    assert WEIGHT_LOAD in block and "ld.global.nc.v4.b32" in block and "st.global.v4.b32" in block
    assert "st.shared::cluster.f32" in block and "barrier.cluster" in block and "rsqrt.approx" in block
    assert "cvt.rn.bf16x2.f32" in block                     # h rounded to bf16 before the norm
    assert block.index("griddepcontrol.wait") > block.index(WEIGHT_LOAD)  # weights before the PDL wait
    gated = _ptx(compile_norm(NormVariant(128, "bfloat16", False, True, False, True, True), NormConfig()))
    assert "ex2.approx" in gated and "bar.sync" not in gated  # warp mode: shuffles only
    fp32 = _ptx(compile_norm(NormVariant(512, "float32", True, True, True, False, True), NormConfig()))
    assert "cvt.rn.bf16x2" not in fp32 and "st.global.v4.b32" in fp32


@needs_cute
def test_rmsnorm_strided_x_variant_compiles(sm90):
    """Strided x rows (column slices of the fused MLA projection): a separate variant reading the
    row stride from x's runtime layout; the contiguous variant keeps its compile key."""
    from latency_specialized.kernels import compile_cache
    from latency_specialized.kernels.rmsnorm import NAME, NormConfig, NormVariant, compile_norm

    cases = [(NormVariant(512, "bfloat16", False, True, False, False, True, strided_x=True), NormConfig()),   # warp
             (NormVariant(1536, "bfloat16", False, True, False, False, True, strided_x=True), NormConfig()),  # block
             (NormVariant(7168, "bfloat16", True, True, False, False, True, strided_x=True), NormConfig(cluster=2))]
    for var, cfg in cases:
        p = _ptx(compile_norm(var, cfg))
        assert "_param_0[24]" in p and "_param_0+16]" in p  # x: pointer, M, dynamic row stride
        assert "ld.global.nc.v4.b32" in p and "st.global.v4.b32" in p
    contiguous = _ptx(compile_norm(NormVariant(512, "bfloat16", False, True, False, False, True), NormConfig()))
    assert "_param_0[16]" in contiguous and "_param_0+16]" not in contiguous
    keys = [k for k in compile_cache._CACHE if k[0] == NAME]
    assert any(("strided_x", True) in k for k in keys)
    assert not any(("strided_x", False) in k for k in keys)  # contiguous keys as before the strided variant


@needs_cute
def test_prefetch_compiles_to_bulk_l2_prefetch(sm90):
    from latency_specialized.kernels.prefetch import compile_prefetch

    p = _ptx(compile_prefetch())
    assert "cp.async.bulk.prefetch.L2.global" in p


@needs_cute
def test_disk_cache_round_trip(sm90, tmp_path, monkeypatch):
    """An exported object loads back as a callable and a second process-level lookup hits the disk."""
    from latency_specialized.kernels import compile_cache
    from latency_specialized.kernels.prefetch import compile_prefetch

    monkeypatch.setenv("LS_KERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_cache, "_CACHE", {})
    compile_prefetch()
    objs = list(tmp_path.rglob("*.o"))
    assert len(objs) == 1
    monkeypatch.setattr(compile_cache, "_CACHE", {})
    n_log = len(compile_cache.COMPILE_LOG)
    fn = compile_prefetch()
    assert callable(fn)
    assert compile_cache.COMPILE_LOG[n_log][0].endswith("(disk)")


# ------------------------------------------------------------------------------- dispatch
def _ctx(n, k, m, arch="sm_90", dtype="bfloat16"):
    return make_context("gemm", arch=arch, dtype=dtype, tokens=m, dims={"N": n, "K": k})


@pytest.fixture
def table(tmp_path, monkeypatch):
    from latency_specialized.kernels import tuning

    t = {"margin": 0.03, "entries": {
        "7168,1536,1": {"winner": "gemm.cutedsl_gemv", "times_us": {"gemm.cublas": 10.0, "gemm.cutedsl_gemv": 6.0,
                                                                     "gemm.cutedsl_small_m": 6.5},
                        "configs": {"gemm.cutedsl_gemv": {"rows_per_warp": 2, "warps": 4, "batch": 8, "pdl": True}}},
        "7168,1536,32": {"winner": "gemm.cublas", "times_us": {"gemm.cublas": 9.8, "gemm.cutedsl_splitk": 11.2},
                         "notes": {"gemm.cutedsl_gemv": "not applicable"}}}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(t))
    monkeypatch.setattr(tuning, "load_table", lambda path=None, _t=t: _t)
    return t


def test_supports_follows_the_measured_winner(table, monkeypatch):
    from latency_specialized.kernels import gemm_gemv, gemm_small_m, gemm_splitk, tuning

    monkeypatch.setattr("latency_specialized.kernels.compile_cache.cute_available", lambda: True)
    assert gemm_gemv._supports(_ctx(7168, 1536, 1)) is True
    assert gemm_small_m._supports(_ctx(7168, 1536, 1)) == "GEMV kernel faster at N=7168,K=1536,M=1 (6.0 us vs 6.5 us)"
    # M=20..32 use the M=32 bucket, where cuBLAS won
    assert gemm_splitk._supports(_ctx(7168, 1536, 24)) == "cuBLAS faster at N=7168,K=1536,M=24 (9.8 us vs 11.2 us)"
    assert "no H200 measurement for N=1000,K=1536,M=1" in gemm_gemv._supports(_ctx(1000, 1536, 1))
    assert "bench-ops" in gemm_gemv._supports(_ctx(1000, 1536, 1))
    assert "no measured table for sm_100" in gemm_small_m._supports(_ctx(7168, 1536, 1, arch="sm_100"))
    assert "bf16" in gemm_small_m._supports(_ctx(7168, 1536, 1, dtype="float32"))
    assert "M<=4" in gemm_gemv._supports(_ctx(7168, 1536, 8))
    assert "M<=64" in gemm_splitk._supports(_ctx(7168, 1536, 128))
    assert "K % 32" in gemm_small_m._supports(_ctx(7168, 1544, 2))
    assert tuning.config_for("gemm.cutedsl_gemv", 7168, 1536, 1, gemm_gemv.GemvConfig).rows_per_warp == 2
    assert [tuning.m_bucket(m) for m in (1, 2, 3, 5, 9, 17, 33, 64, 65)] == [1, 2, 4, 8, 16, 32, 64, 64, None]


def test_plan_picks_the_table_winner(table, monkeypatch):
    """explain/plan: the winner serves the site; the losers' refusals name the measured times."""
    from latency_specialized import hardware
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry

    monkeypatch.setattr("latency_specialized.kernels.compile_cache.cute_available", lambda: True)
    reg = get_registry()
    plan = build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.for_arch("sm_90"), tp=8, batch=1)
    o_proj = [c for c in plan.choices if c.site.family == "gemm" and c.site.ctx.dim("N") == 7168
              and c.site.ctx.dim("K") == 1536]
    assert o_proj, "kimi_k3 TP8 has an o_proj site of N=7168, K=1536"
    for c in o_proj:
        assert c.impl.name == "gemm.cutedsl_gemv"
    plan32 = build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.for_arch("sm_90"), tp=8, batch=32)
    c = [c for c in plan32.choices if c.site.family == "gemm" and c.site.ctx.dim("K") == 1536
         and c.site.ctx.dim("N") == 7168][0]
    assert c.impl.name == "gemm.cublas"
    assert ("gemm.cutedsl_splitk", "cuBLAS faster at N=7168,K=1536,M=32 (9.8 us vs 11.2 us)") in c.refusals


def test_norm_site_credit_hands_the_site_to_the_norm_prologue(monkeypatch):
    """``NORM_SITE_CREDIT_US``: behind a norm site, the GEMV (norm prologue) serves a cell it lost by less than the
    credit - the small-M winner then refuses naming why -, not one it lost by more, and nothing changes without a
    norm site or with the credit at 0 (the default). The set of prologue implementations matches the registry."""
    from latency_specialized.kernels import gemm_gemv, gemm_small_m, tuning
    from latency_specialized.plugins import get_registry

    t = {"margin": 0.03, "entries": {
        "8192,1280,1": {"winner": "gemm.cutedsl_small_m", "times_us": {"gemm.cublas": 7.8, "gemm.cutedsl_gemv": 6.7,
                                                                        "gemm.cutedsl_small_m": 6.5},
                        "configs": {"gemm.cutedsl_gemv": {"rows_per_warp": 1}, "gemm.cutedsl_small_m": {"wk": 8}}},
        "8192,1280,2": {"winner": "gemm.cutedsl_small_m", "times_us": {"gemm.cublas": 7.8, "gemm.cutedsl_gemv": 9.0,
                                                                        "gemm.cutedsl_small_m": 6.5},
                        "configs": {"gemm.cutedsl_gemv": {"rows_per_warp": 1}, "gemm.cutedsl_small_m": {"wk": 8}}}}}
    monkeypatch.setattr(tuning, "load_table", lambda path=None, _t=t: _t)
    monkeypatch.setattr("latency_specialized.kernels.compile_cache.cute_available", lambda: True)

    def ctx(m, norm):
        return make_context("gemm", arch="sm_90", dtype="bfloat16", tokens=m, dims={"N": 8192, "K": 1280},
                            attrs={"norm_site": "attn.q_norm"} if norm else {})

    assert gemm_small_m._supports(ctx(1, True)) is True                           # credit 0: as measured
    monkeypatch.setattr(tuning, "NORM_SITE_CREDIT_US", 1.5)
    assert gemm_gemv._supports(ctx(1, True)) is True
    assert "normalises its input itself" in gemm_small_m._supports(ctx(1, True))
    assert gemm_small_m._supports(ctx(1, False)) is True                          # no norm site: the winner
    assert gemm_small_m._supports(ctx(2, True)) is True                           # lost by 2.5 us > the credit
    prologue = {i.name for i in get_registry().implementations.family("gemm") if i.norm_prologue}
    assert tuning.NORM_PROLOGUE_IMPLS <= prologue and "gemm.cutedsl_small_m" not in prologue


def test_build_gemm_table_keeps_cublas_within_the_noise_margin():
    from latency_specialized.bench.ops_bench_gemm_norm import build_gemm_table

    def row(m, ours_us, err=None):
        v = {"cublas": {"impl": "gemm.cublas", "us": 10.0},
             "gemv[a]": {"impl": "gemm.cutedsl_gemv", "config": {"rows_per_warp": 1}, "us": ours_us + 1},
             "gemv[b]": {"impl": "gemm.cutedsl_gemv", "config": {"rows_per_warp": 2}, "us": ours_us}}
        if err:
            v["small_m[x]"] = {"impl": "gemm.cutedsl_small_m", "error": err}
        return {"op": "site", "shape": {"N": 64, "K": 128}, "m": m, "variants": v}

    t = build_gemm_table([row(1, 9.9), row(2, 5.0, err="wrong result"), row(3, 1.0)], {"device": "X"})
    e1, e2 = t["entries"]["64,128,1"], t["entries"]["64,128,2"]
    assert e1["winner"] == "gemm.cublas"                    # 1% faster is noise: cuBLAS kept
    assert e2["winner"] == "gemm.cutedsl_gemv" and e2["configs"]["gemm.cutedsl_gemv"] == {"rows_per_warp": 2}
    assert e2["times_us"]["gemm.cutedsl_gemv"] == 5.0 and "wrong result" in e2["notes"]["gemm.cutedsl_small_m"]
    assert "64,128,3" not in t["entries"]                   # only measured buckets enter the table


def test_committed_table_is_well_formed():
    from latency_specialized.kernels import tuning

    t = tuning.load_table()
    assert t is not None, "latency_specialized/kernels/tuning/h200_gemm.json is committed and must load"
    assert t["arch"] == "sm_90" and t["entries"]
    for key, e in t["entries"].items():
        n, k, m = map(int, key.split(","))
        assert m in tuning.M_BUCKETS
        assert e["winner"] in e["times_us"], key
        if e["winner"] != "gemm.cublas":   # a kernel only wins by more than the margin, with its config
            assert e["times_us"][e["winner"]] < e["times_us"]["gemm.cublas"] * (1 - t["margin"]) + 1e-9, key
            assert e["winner"] in e["configs"], key


# --------------------------------------------------------------------------- host helpers
def test_gemm_argument_checks_name_the_fix():
    from latency_specialized.kernels.gemm_common import check_gemm_args

    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert check_gemm_args(x, w, None, None, kmult=32) == (2, 8, 64)
    with pytest.raises(UserError, match="gemm.cublas"):
        check_gemm_args(x.float(), w.float(), None, None, kmult=8)
    with pytest.raises(UserError, match="K % 32"):
        check_gemm_args(x[:, :40], w[:, :40], None, None, kmult=32)
    with pytest.raises(UserError, match="nn.Linear"):
        check_gemm_args(x, w[:, :32], None, None, kmult=8)
    with pytest.raises(UserError, match="contiguous"):
        check_gemm_args(torch.zeros(64, 2, dtype=torch.bfloat16).t(), w, None, None, kmult=8)
    with pytest.raises(UserError, match="residual"):
        check_gemm_args(x, w, torch.zeros(2, 7, dtype=torch.bfloat16), None, kmult=8)


def test_rmsnorm_x_layouts_and_checks_name_the_fix():
    from latency_specialized.kernels import rmsnorm

    bf = torch.bfloat16
    t = torch.zeros(4, 2112, dtype=bf)
    x2, strided = rmsnorm._rows(t[:, 1536:2048], 512)
    assert strided and x2.stride() == (2112, 1) and x2.data_ptr() == t[:, 1536:].data_ptr()
    assert rmsnorm._rows(t[:, :1536], 1536)[1]
    assert rmsnorm._rows(t[:1, 1536:2048], 512)[1] is False  # M = 1: already contiguous
    assert rmsnorm._rows(t[:, :512].contiguous(), 512)[1] is False
    x3, strided = rmsnorm._rows(torch.zeros(2, 3, 2112, dtype=bf)[..., :512], 512)  # leading dims merge
    assert strided and x3.shape == (6, 512) and x3.stride() == (2112, 1)
    bad = {"column stride": t[:, ::2],
           "misaligned row start": t[:, 1:513],
           "row bytes % 16": torch.zeros(4, 516, dtype=bf)[:, :512],
           "overlapping rows": torch.zeros(1, 512, dtype=bf).expand(4, 512)}
    for what, x in bad.items():
        with pytest.raises(UserError, match=r"contiguous\(\)"):
            rmsnorm._rows(x, x.shape[-1])
        with pytest.raises(UserError, match="16-byte aligned rows"):  # through the public entry, before a compile
            rmsnorm.rmsnorm_cute(x, None, 1e-5)
    with pytest.raises(UserError, match="does not view"):
        rmsnorm._rows(torch.zeros(3, 2, 2112, dtype=bf)[..., :512].transpose(0, 1), 512)
    with pytest.raises(UserError, match="16-byte aligned x"):
        rmsnorm._rows(torch.zeros(1032, dtype=bf)[1:1 + 2 * 512].view(2, 512), 512)
    with pytest.raises(UserError, match="residual"):  # residual/gate/out stay contiguous-only
        rmsnorm.rmsnorm_cute(t[:, :512], None, 1e-5, residual=t[:, 512:1024])


def test_norm_and_allreduce_supports():
    from latency_specialized.kernels import rmsnorm

    ctx = make_context("allreduce", arch="sm_90", dtype="bfloat16", tokens=4, world_size=8, dims={"N": 7168})
    assert "world_size=8" in rmsnorm._ar_supports(ctx)
    one = make_context("allreduce", arch="sm_90", dtype="bfloat16", tokens=4, world_size=1, dims={"N": 7168})
    assert rmsnorm._ar_supports(one) is cute_available()
    odd = make_context("norm", arch="sm_90", dtype="bfloat16", tokens=4, dims={"N": 7164})
    assert "N % 8" in rmsnorm._norm_supports(odd)
    assert "sm_90" in rmsnorm._norm_supports(make_context("norm", arch="cpu", dtype="bfloat16", tokens=1,
                                                          dims={"N": 7168}))
    with pytest.raises(UserError, match="world_size=2"):
        rmsnorm.allreduce_residual_rmsnorm_local(torch.zeros(1, 8), torch.zeros(1, 8), None, 1e-5,
                                                 comm=type("C", (), {"world_size": 2})())


def test_prefetch_table_caps_and_aligns():
    from latency_specialized.kernels.prefetch import build_table

    a = torch.empty(1000, dtype=torch.bfloat16)            # 2000 B
    b = torch.empty(4096, dtype=torch.float32)             # 16384 B
    t = build_table([a, b])
    assert t.dtype == torch.int64 and t.shape == (2, 2)
    assert all(int(x) % 16 == 0 for x in t[:, 0]) and all(int(x) % 16 == 0 for x in t[:, 1])
    assert int(t[1, 1]) == 16384 and int(t[0, 1]) <= 2000
    capped = build_table([a, b], max_bytes=4000)
    assert int(capped[:, 1].sum()) <= 4000
    with pytest.raises(UserError, match="contiguous"):
        build_table([torch.empty(8, 8).t()])


def test_bench_registry_and_markdown():
    from latency_specialized.bench import ops_bench

    fams = ops_bench.families()
    assert {"gemm", "norm", "prefetch"} <= set(fams)

    @ops_bench.register_cases("unit_test_family")
    def cases(settings):
        return []

    ops_bench.register_cases("unit_test_family")(cases)      # idempotent
    assert len(ops_bench.CASES["unit_test_family"]) == 1
    row = {"op": "o", "shape": {"N": 1}, "m": 1, "bytes": 4.3e6, "floor_us": 1.0, "baseline": "cublas",
           "variants": {"cublas": {"us": 2.0, "roofline": 0.5}, "k[a]": {"us": 1.25, "roofline": 0.8},
                        "k[b]": {"error": "boom"}}}
    md = ops_bench.to_markdown("gemm", [row])
    assert "| o | N=1 | 1 | 4.3 | 1.00 | 2.00 | 50% | k[a] | 1.25 | 80% | 1.60 | k[b] |" in md


def test_bench_gemm_cases_cover_the_model_shapes():
    from latency_specialized.bench.ops_bench_gemm_norm import gemm_shapes, gemm_variant_configs

    shapes = gemm_shapes("kimi_k3", (8,))
    assert (7168, 1536) in shapes                             # kda o_proj at TP8
    names = {impl for impl, _ in gemm_variant_configs(7168, 1536, 1)}
    assert names == {"gemm.cutedsl_gemv", "gemm.cutedsl_small_m", "gemm.cutedsl_splitk"}
    assert {impl for impl, _ in gemm_variant_configs(7168, 1536, 64)} == {"gemm.cutedsl_splitk"}
    for impl, cfg in gemm_variant_configs(112, 7168, 32):
        assert cfg.nt * 8 >= 32 and cfg.sk <= 8


def test_bench_gemm_shapes_include_the_gemms_inside_other_implementations():
    """The fused MLP's gate/up and down are planned from the same table as the gemm sites: the bench measures
    them too (DeepSeek-V4.1-Flash's shared expert at TP8: [2 x 288, 5120] and [5120, 288])."""
    from latency_specialized.bench.ops_bench_gemm_norm import gemm_shapes, shapes_missing_from_table

    shapes = gemm_shapes("deepseek_v41_flash", (8,))
    assert any(s.endswith("moe.shared/gate_up@tp8") for s in shapes[(576, 5120)])
    assert any(s.endswith("moe.shared/down@tp8") for s in shapes[(5120, 288)])
    cell = {"winner": "gemm.cublas", "times_us": {}, "configs": {}}
    table = {"entries": {f"{n},{k},{m}": cell for n, k in shapes for m in (1, 2)}}
    del table["entries"]["576,5120,2"]
    assert shapes_missing_from_table("deepseek_v41_flash", (8,), (1,), table) == ()
    assert shapes_missing_from_table("deepseek_v41_flash", (8,), (1, 2), table) == ((576, 5120),)
    # M 3 is bucket 4, which this table lacks for every shape
    assert shapes_missing_from_table("deepseek_v41_flash", (8,), (3,), table) == tuple(sorted(shapes))


@needs_cute
def test_persistent_variants_compile(sm90):
    """ctas_per_sm > 0: CTAs loop over row groups / tiles (grid capped at launch)."""
    from latency_specialized.kernels.gemm_gemv import GemvConfig, compile_gemv
    from latency_specialized.kernels.gemm_small_m import MmaConfig, compile_mma

    g = _ptx(compile_gemv(1536, 1, GemvConfig(ctas_per_sm=4), False))
    m = _ptx(compile_mma(1536, MmaConfig(nt=1, wk=4, ctas_per_sm=1), True))
    for p in (g, m):
        assert "griddepcontrol.wait" in p and p.count("bra") >= 2   # the tile loop's back edge
    assert m.count("bar.sync") >= 2                                   # buffer reuse fenced between tiles
