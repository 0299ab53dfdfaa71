"""Where ptxas puts the PDL wait (``griddepcontrol.wait``, SASS ``ACQBULK``) relative to the weight loads a kernel
issues before it - offline, with the ptxas Triton ships (``latency_specialized.testing.offline_sass``).

The mma kernels request their first batch of weights before the wait so that the bytes are in flight while the
previous kernel finishes. In PTX they are; but ptxas hoists the wait above *non-coherent* (``ld.global.nc``) loads
and keeps it behind coherent ones. So with ``MmaConfig.prefetch`` (the first batch through the coherent path) the
loads stay ahead, without it (the dense gemms' default, as timed in session 33) the wait comes first. If a ptxas
release changes this, these tests say so.
"""

from __future__ import annotations

import pytest

from latency_specialized.kernels.compile_cache import cute_available

needs_cute = pytest.mark.skipif(cute_available() is not True, reason="nvidia-cutlass-dsl not installed")
WEIGHT_LOAD = "LDG.E.NA.LTC256B.128"
"""A 16-byte weight load (L1 no-allocate, 256-byte L2 prefetch; ``.CONSTANT`` when non-coherent)."""

PTX = """.version 8.4
.target sm_90a
.address_size 64
.visible .entry k(.param .u64 p, .param .u64 q)
{
  .reg .b64 %rd<4>;
  .reg .b32 %r<8>;
  ld.param.u64 %rd1, [p];
  ld.param.u64 %rd2, [q];
  LOAD {%r1,%r2,%r3,%r4}, [%rd1];
  griddepcontrol.wait;
  add.s32 %r5, %r1, %r2;
  add.s32 %r5, %r5, %r3;
  add.s32 %r5, %r5, %r4;
  st.global.b32 [%rd2], %r5;
  ret;
}
"""


def _loads_before_wait(order: list[str]) -> tuple[int, int]:
    """(weight loads before the first ACQBULK, all weight loads)."""
    loads = [i for i, op in enumerate(order) if op.startswith(WEIGHT_LOAD)]
    wait = order.index("ACQBULK")
    return sum(i < wait for i in loads), len(loads)


def test_ptxas_hoists_the_wait_above_noncoherent_loads_only():
    from latency_specialized.testing.offline_sass import sass_of

    nc = sass_of(PTX.replace("LOAD", "ld.global.nc.L1::no_allocate.L2::256B.v4.b32")).order
    coherent = sass_of(PTX.replace("LOAD", "ld.global.L1::no_allocate.L2::256B.v4.b32")).order
    assert _loads_before_wait(nc) == (0, 1)
    assert _loads_before_wait(coherent) == (1, 1)


@needs_cute
@pytest.mark.parametrize("prefetch", [False, True])
def test_mma_gemm_first_batch_ahead_of_the_wait_only_with_prefetch(sm90, prefetch):
    from latency_specialized.kernels.dsl_common import ptx_of
    from latency_specialized.kernels.gemm_small_m import MmaConfig, compile_mma
    from latency_specialized.kernels.mma_quant_weights import QuantCoding
    from latency_specialized.testing.offline_sass import sass_of

    for coding, k in ((None, 2048), (QuantCoding(True, (32, 32)), 1280)):
        cfg = MmaConfig(nt=1, wk=4, cb=4, pdl=True, prefetch=prefetch)
        before, total = _loads_before_wait(sass_of(ptx_of(compile_mma(k, cfg, False, coding=coding))).order)
        assert total >= 2 * cfg.cb
        assert before == (2 * cfg.cb if prefetch else 0), (coding, before, total)


@needs_cute
def test_mxfp4_experts_issue_their_first_batch_ahead_of_the_wait(sm90):
    """Kimi K3 TP8 batch 1, the default configs: gate_up's 16 loads (4 chunks x 2 m-tiles x rows g, g + 8) and
    down_sum's first route's 6 ahead of the wait - the fence that keeps ptxas from sinking them into the math, and
    PDL's wait where it is on."""
    from latency_specialized.kernels import moe_experts_mma as mm
    from latency_specialized.kernels.dsl_common import ptx_of
    from latency_specialized.testing.offline_sass import sass_of

    c13, c2 = mm.default_configs(1, 16, 896, 3584, 384, 3584, False)
    assert c13.prefetch and c2.prefetch
    for st, cfg in ((mm.ExpertsStage("gate_up", 3584, 768, 16, False, act="situ_glu", beta=4, beta_lin=25), c13),
                    (mm.ExpertsStage("down_sum", 384, 3584, 16, False), c2)):
        order = sass_of(ptx_of(mm.compile_stage(st, cfg))).order
        before, _ = _loads_before_wait(order)
        assert before == 2 * cfg.mt * cfg.cb, (st.stage, before)
        assert order.index("ACQBULK") < next(i for i, op in enumerate(order) if op.startswith("HMMA"))


@needs_cute
@pytest.mark.parametrize("prefetch", [False, True])
def test_gemv_batches_ahead_of_the_wait_only_with_prefetch(sm90, prefetch):
    """The CuTe DSL GEMV requests batches 0..L before its wait: in SASS only with ``GemvConfig.prefetch`` (a K with
    a ragged tail, lookahead 1: 2 batches of 8 vectors per row)."""
    from latency_specialized.kernels.dsl_common import ptx_of
    from latency_specialized.kernels.gemm_gemv import GemvConfig, compile_gemv
    from latency_specialized.testing.offline_sass import sass_of

    cfg = GemvConfig(lookahead=1, prefetch=prefetch)
    before, total = _loads_before_wait(sass_of(ptx_of(compile_gemv(7168 + 256, 1, cfg, False))).order)
    assert total > 2 * cfg.batch
    assert before == (2 * cfg.batch if prefetch else 0), (before, total)
