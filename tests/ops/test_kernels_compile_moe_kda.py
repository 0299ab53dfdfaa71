"""CPU CI: the MoE router / routed-expert / KDA decode kernels compile for sm_90a without a GPU.

Each kernel is compiled with fake tensors and its PTX is checked for the instructions its design
relies on (16-byte global loads/stores, warp reductions, ballot-based leader search). Numerical
correctness is checked on the H200 by tests/ops/test_moe_kda_gpu.py.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels.compile_cache import cute_available
from latency_specialized.ops.registry import make_context
from latency_specialized.spec import ActivationSpec, RouterSpec

needs_cute = pytest.mark.skipif(cute_available() is not True, reason="nvidia-cutlass-dsl not installed")
SITU = ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)


@pytest.fixture(autouse=True)
def _sm90a(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.delenv("LS_KERNEL_CACHE_DIR", raising=False)  # always a fresh compile: we read its PTX


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx))


@needs_cute
def test_router_compiles_with_redux_topk():
    from latency_specialized.kernels import moe_router as mr

    cfg = mr.make_config(_meta(1, 896), _meta(896), 16, RouterSpec(score_func="sigmoid"), split=1)
    assert not cfg.sort  # an explicit split picks the rounds kernel
    ptx = mr.ptx_of(mr._compile(cfg))
    assert ptx is not None and ".target sm_90a" in ptx
    assert _count(ptx, r"redux\.sync\.max\.u32") >= 1  # ordered-key argmax
    assert _count(ptx, r"redux\.sync\.min\.s32") >= 1  # lower id wins ties
    assert ".local" not in ptx  # the 28 keys per lane stay in registers
    # PDL: the logits (another kernel's output) are read only after griddepcontrol.wait
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    # batch <= 16: 4 warps per token, each selects among 224 experts, warp 0 merges 64 candidates
    split = mr.make_config(_meta(8, 896), _meta(896), 16, RouterSpec(score_func="sigmoid"), sort=False)
    assert split.split == 4
    assert mr.make_config(_meta(64, 896), _meta(896), 16, RouterSpec(score_func="sigmoid"), sort=False).split == 1
    sptx = mr.ptx_of(mr._compile(split))
    assert _count(sptx, r"redux\.sync\.max\.u32") >= 2 and "bar.sync" in sptx and ".local" not in sptx
    assert sptx.index("griddepcontrol.wait") < sptx.index("ld.global")
    with pytest.raises(UserError, match="split"):
        mr.make_config(_meta(1, 896), _meta(896), 16, RouterSpec(score_func="softmax"), split=4)


@needs_cute
def test_router_sort_kernel_compiles_to_a_shuffle_network():
    """sort: one thread per expert; 15 bitonic stages per warp + 5 merge stages per tree level (2 shuffles
    each: key and id), one barrier per level, no local memory; chosen by default where it applies."""
    from latency_specialized.kernels import moe_router as mr

    sig = RouterSpec(score_func="sigmoid")
    for E, k, levels in ((896, 16, 5), (256, 8, 3), (20, 7, 0)):
        cfg = mr.make_config(_meta(1, E), _meta(E), k, sig)
        assert cfg.sort and cfg.split == 1, (E, k)
        ptx = mr.ptx_of(mr._compile(cfg))
        assert _count(ptx, r"shfl\.sync\.bfly") == 2 * (15 + 5 * levels) + 5, (E, k)  # + renormalising sum
        assert _count(ptx, r"bar\.sync") == levels and ".local" not in ptx and "redux.sync" not in ptx
        # PDL: only the bias (a weight) is read before griddepcontrol.wait, the logits after it; the
        # winners' scores come back from shared memory (one global read of the logits per expert)
        wait = ptx.index("griddepcontrol.wait")
        assert _count(ptx[:wait], r"ld\.global") == int(cfg.has_bias)
        assert _count(ptx, r"ld\.global") == 1 + int(cfg.has_bias)
    assert not mr.make_config(_meta(65, 896), _meta(896), 16, sig).sort  # above SORT_MAX_TOKENS
    for E, k, score, why in ((896, 17, "sigmoid", "top_k=17"), (1100, 8, "sigmoid", "E=1100"),
                             (64, 4, "softmax", "softmax")):
        assert not mr.make_config(_meta(1, E), _meta(E), k, RouterSpec(score_func=score)).sort
        with pytest.raises(UserError, match=why):
            mr.make_config(_meta(1, E), _meta(E), k, RouterSpec(score_func=score), sort=True)


@needs_cute
def test_experts_batch1_compiles_with_vector_loads():
    from latency_specialized.kernels import moe_experts as me

    cfg = me.make_config(1, 3584, 384, 3584, 16, torch.bfloat16, torch.int64, SITU)
    gu = me.ptx_of(me.compile_gate_up(cfg))
    dn = me.ptx_of(me.compile_down(cfg))
    rows_per_warp = cfg.gu_rows // cfg.gu_warps
    # gate + up rows: K/256 16-byte loads per lane each, all issued before the first use
    assert _count(gu, r"ld\.global[\w.:]*\.v4") >= 2 * (3584 // 256) * rows_per_warp
    assert _count(gu, r"ld\.shared\.v4") >= 3584 // 256  # token row staged in smem
    assert "vote.sync.ballot" not in gu  # batch-1 path: no leader search
    steps = -(-cfg.dn_rows // 2)  # I=384: 48 vectors per row = 16 lanes x 3, two rows per warp step
    assert _count(dn, r"ld\.global[\w.:]*\.v4") >= 3 * steps
    assert "shfl.sync.bfly" in dn
    assert ".local" not in gu and ".local" not in dn
    # batch-1 default (measured fastest on the H200): PDL between the kernels, plain 16-byte loads
    assert "griddepcontrol.launch_dependents" in gu and "griddepcontrol.wait" in dn
    # down lets the next kernel (PDL) launch once all its CTAs started (before its own wait for gate_up)
    assert cfg.dn_trigger and dn.index("griddepcontrol.launch_dependents") < dn.index("griddepcontrol.wait")


def test_experts_wide_rows_default_to_passes():
    """Rows wider than GU_MAX_KVEC vectors run in even passes (fewer vectors per pass at several tokens),
    and their down kernel takes WIDE_DOWN_ROWS rows at several tokens; Kimi K3's latent stays one pass."""
    from latency_specialized.kernels import moe_experts as me

    sw = ActivationSpec(kind="swiglu")
    for (K, M), (kvec, passes) in {(3584, 1): (0, 1), (3584, 8): (0, 1), (6144, 1): (12, 2), (6144, 8): (6, 4),
                                   (5120, 1): (10, 2), (5120, 64): (5, 4), (4096, 2): (6, 3)}.items():
        cfg = me.make_config(M, K, 256, 1024, 8, torch.bfloat16, torch.int64, sw)
        assert (cfg.gu_kvec, cfg.gu_passes) == (kvec, passes), (K, M)
        if M > 1:
            assert cfg.dn_rows == (me.WIDE_DOWN_ROWS if passes > 1 else max(8, me.one_wave_down_rows(1024, 132)))
    # an explicit value wins; one vector per pass is the finest split
    assert me.make_config(1, 3584, 384, 3584, 16, torch.bfloat16, torch.int64, SITU, gu_kvec=1).gu_passes == 14


@needs_cute
def test_experts_wide_rows_compile_in_passes():
    """K 6144 at batch 1 in two passes of 12 vectors: every gate and up vector is still one 16-byte load
    (2 x 24 per row), the token row staged once, and the partial dots of a pass add in registers; at
    several tokens the passes keep their running dots in shared memory (32-bit shared stores)."""
    from latency_specialized.kernels import moe_experts as me

    sw = ActivationSpec(kind="swiglu")
    cfg = me.make_config(1, 6144, 256, 6144, 8, torch.bfloat16, torch.int64, sw)
    assert cfg.gu_passes == 2
    gu = me.ptx_of(me.compile_gate_up(cfg))
    assert _count(gu, r"ld\.global[\w.:]*\.v4") >= 2 * (6144 // 256) * (cfg.gu_rows // cfg.gu_warps)
    assert _count(gu, r"ld\.shared\.v4") >= 6144 // 256
    assert ".local" not in gu
    multi = me.make_config(8, 6144, 256, 6144, 8, torch.bfloat16, torch.int64, sw)
    gm = me.ptx_of(me.compile_gate_up(multi))
    one = me.ptx_of(me.compile_gate_up(dataclasses.replace(multi, gu_kvec=0)))
    assert multi.gu_passes == 4 and "vote.sync.ballot" in gm and ".local" not in gm
    # the running dots (g, u) of passes 1-3: one more (paired) shared store each, beyond the one-pass build's
    assert _count(gm, r"st\.shared[\w.]*") >= _count(one, r"st\.shared[\w.]*") + 3


@needs_cute
def test_experts_multi_token_compiles_with_leader_search():
    from latency_specialized.kernels import moe_experts as me

    cfg = me.make_config(8, 512, 128, 256, 4, torch.bfloat16, torch.int32, ActivationSpec(kind="swiglu", clamp=7.0))
    gu = me.ptx_of(me.compile_gate_up(cfg))
    dn = me.ptx_of(me.compile_down(cfg))
    assert "vote.sync.ballot" in gu and "popc" in gu  # experts shared by tokens are found and read once
    assert "griddepcontrol.launch_dependents" in dn  # the next kernel may launch early (dn_trigger)
    assert "bar.sync" in gu
    assert _count(dn, r"ld\.global[\w.:]*\.v4") >= 2
    # weights are read once: no L1 allocation, 256-byte L2 prefetch
    assert "ld.global.L1::no_allocate.L2::256B.v4" in gu and "ld.global.L1::no_allocate.L2::256B.v4" in dn
    assert ".local" not in gu and ".local" not in dn


@needs_cute
def test_kda_compiles_streaming_state_once():
    from latency_specialized.kernels import kda_decode as kd

    H = 12
    cfg = kd.make_config(_meta(1, 3 * H * 128, dtype=torch.bfloat16), _meta(4, 3 * H * 128, 3, dtype=torch.bfloat16),
                         _meta(3 * H * 128, 4), _meta(4, H, 128, 128), _meta(1, dtype=torch.int32), _meta(H),
                         num_heads=H, eps=1e-5, gate_lower_bound=-5.0, scale=None)
    ptx = kd.ptx_of(kd._compile(cfg))
    # 64 KiB of state per head: 256 threads x 16 loads and 16 stores of 16 bytes, nothing else
    assert _count(ptx, r"ld\.global[\w.:]*\.v4\.[fbu]32") == 16
    assert _count(ptx, r"st\.global\.v4\.[fbu]32") == 16
    assert "shfl.sync.bfly" in ptx
    # PDL: all 16 state loads are requested before griddepcontrol.wait, every activation read after it
    wait = ptx.index("griddepcontrol.wait")
    assert _count(ptx[:wait], r"ld\.global[\w.:]*\.v4\.[fbu]32") == 16
    assert _count(ptx[:wait], r"ld\.global[\w.:]*\.(u16|b16)") == 0


@needs_cute
def test_kda_staged_variant_copies_state_through_shared_memory():
    from latency_specialized.kernels import kda_decode as kd

    H = 12
    args = (_meta(64, 3 * H * 128, dtype=torch.bfloat16), _meta(80, 3 * H * 128, 3, dtype=torch.bfloat16),
            _meta(3 * H * 128, 4), _meta(80, H, 128, 128), _meta(64, dtype=torch.int32), _meta(H))
    cfg = kd.make_config(*args, num_heads=H, eps=1e-5, gate_lower_bound=-5.0, scale=None, stage_smem=True)
    ptx = kd.ptx_of(kd._compile(cfg))
    # 256 threads x 16 asynchronous 16-byte copies into shared memory, all requested before the PDL
    # wait; the state goes back out with 16 vector stores per thread; no register spills
    wait = ptx.index("griddepcontrol.wait")
    assert _count(ptx[:wait], r"cp\.async\.cg\.shared\.global") == 16
    assert _count(ptx, r"cp\.async\.cg\.shared\.global") == 16
    assert "cp.async.wait_group 0" in ptx and ptx.index("cp.async.wait_group 0") > wait
    assert _count(ptx, r"ld\.global[\w.:]*\.v4\.[fbu]32") == 0
    assert _count(ptx, r"st\.global\.v4\.[fbu]32") == 16
    assert _count(ptx, r"ld\.shared\.v4\.[fbu]32") >= 16
    assert ".local" not in ptx
    with pytest.raises(UserError, match="row_split=1"):
        kd.make_config(*args, num_heads=H, eps=1e-5, gate_lower_bound=-5.0, scale=None, stage_smem=True, row_split=2)


@needs_cute
@pytest.mark.parametrize("staged", [False, True])
def test_kda_fused_decay_input_compiles(staged):
    from latency_specialized.kernels import kda_decode as kd

    H = 12
    args = (_meta(64, 3 * H * 128, dtype=torch.bfloat16), _meta(80, 3 * H * 128, 3, dtype=torch.bfloat16),
            _meta(3 * H * 128, 4), _meta(80, H, 128, 128), _meta(64, dtype=torch.int32), _meta(H))
    cfg = kd.make_config(*args, num_heads=H, eps=1e-5, gate_lower_bound=-5.0, scale=None, stage_smem=staged,
                         decay_rank=128)
    ptx = kd.ptx_of(kd._compile(cfg))
    wait = ptx.index("griddepcontrol.wait")
    # f_b_proj fused: 16 16-byte loads of the thread's f_b row + 16 of f_a, all after the PDL wait;
    # the state traffic is unchanged
    v4 = r"ld\.global[\w.:]*\.v4\.[fbu]32"
    assert _count(ptx, v4) == (0 if staged else 16) + 32 and _count(ptx[:wait], v4) == (0 if staged else 16)
    assert _count(ptx, r"st\.global\.v4\.[fbu]32") == 16


def test_fused_decay_checks_name_the_fix():
    from latency_specialized.kernels import kda_decode as kd

    x = torch.empty(2, 3 * 128, dtype=torch.bfloat16)
    with pytest.raises(UserError, match="f_b_proj as a gemm"):
        kd._check_fused_decay(torch.empty(2, 100, dtype=torch.bfloat16), torch.empty(128, 100, dtype=torch.bfloat16),
                              x, 1)
    with pytest.raises(UserError, match="activation dtype"):
        kd._check_fused_decay(torch.empty(2, 128, dtype=torch.bfloat16), torch.empty(128, 128), x, 1)
    wide = torch.empty(2, 130, dtype=torch.bfloat16)
    with pytest.raises(UserError, match="16-byte aligned rows"):
        kd._check_fused_decay(wide[:, 1:129], torch.empty(128, 128, dtype=torch.bfloat16), x, 1)
    assert kd._check_fused_decay(torch.empty(2, 128, dtype=torch.bfloat16), torch.empty(128, 128, dtype=torch.bfloat16),
                                 x, 1) == 128


def test_configs_reject_unsupported_shapes_with_a_fix():
    from latency_specialized.kernels import kda_decode as kd
    from latency_specialized.kernels import moe_experts as me
    from latency_specialized.kernels import moe_router as mr

    with pytest.raises(UserError, match="multiple of 256"):
        me.make_config(1, 3000, 384, 3584, 16, torch.bfloat16, torch.int64, SITU)
    with pytest.raises(UserError, match="reference"):
        me.make_config(1, 3584, 384, 3584, 16, torch.float32, torch.int64, SITU)
    with pytest.raises(UserError, match="top_k"):
        mr.make_config(_meta(1, 64), None, 40, RouterSpec(score_func="sigmoid"))
    with pytest.raises(UserError, match="head_dim"):
        kd.make_config(_meta(1, 3 * 4 * 64), _meta(2, 3 * 4 * 64, 3), _meta(3 * 4 * 64, 4), _meta(2, 4, 64, 64),
                       _meta(1, dtype=torch.int32), _meta(4), num_heads=4, eps=1e-5, gate_lower_bound=-5.0, scale=None)


def test_supports_names_the_reason():
    from latency_specialized.kernels import kda_decode as kd
    from latency_specialized.kernels import moe_experts as me
    from latency_specialized.kernels import moe_router as mr

    dims = dict(E=896, topk=16, N=384, K=3584)
    cpu = make_context("moe.experts", arch="cpu", dtype="bfloat16", tokens=1, dims=dims)
    assert "sm_90" in me._supports(cpu)
    if cute_available() is not True:
        pytest.skip("nvidia-cutlass-dsl not installed: every supports() names that instead")
    assert me._supports(make_context("moe.experts", arch="sm_90", dtype="bfloat16", tokens=1, dims=dims)) is True
    assert "K=3000" in me._supports(make_context("moe.experts", arch="sm_90", dtype="bfloat16", tokens=1,
                                                 dims=dict(dims, K=3000)))
    assert "top_k" in mr._supports(make_context("moe.router", arch="sm_90", dtype="bfloat16", tokens=4,
                                                dims=dict(E=896, topk=40)))
    assert "head_dim" in kd._supports(make_context("attention.kda", arch="sm_90", dtype="bfloat16", tokens=1,
                                                   dims=dict(heads=12, head_dim=64, conv=4)))


def test_side_stream_needs_cuda():
    from latency_specialized.runtime.side_stream import SideStream

    if torch.cuda.is_available():
        pytest.skip("CUDA present: covered by tests/ops/test_moe_kda_gpu.py")
    with pytest.raises(UserError, match="CUDA"):
        SideStream()


def test_compile_options_keep_ptx_out_of_the_working_tree(tmp_path, monkeypatch):
    from latency_specialized.kernels import moe_router as mr

    opts = mr._compile_options("sm_90a")
    assert "--dump-dir" in opts and os.getcwd() not in opts.split("--dump-dir")[1]
