"""The Triton split-KV GQA kernel's lse output (``gqa_decode_triton(..., lse=)``) and the DCP partial built on
it (``attention.dcp.gqa_partial_triton``), under the Triton interpreter on the CPU.

As ``test_gqa_triton.py``: the kernel cases (marker ``interpreter_case``) need ``TRITON_INTERPRET=1`` from
the process start, so a plain CPU run deselects them and the driver runs them in a child process. Checked
against ``gqa_partial_reference`` (o and lse): one split (the split kernel normalises) and several (the
merge kernel), sinks, padding rows (lse -inf, o 0), rows without keys but with a sink (lse = the sink);
then every rank of a DCP group through the Triton partial, merged, against single-rank attention.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.attention.dcp import (DcpLayout, gqa_partial_reference, gqa_partial_triton, local_seq_lens,
                                                    local_slot_mapping)
from latency_specialized.ops.attention.dcp_merge import dcp_merge_reference

from tests.interpret import run_interpreted
from tests.ops.test_dcp_layout import LENGTH_SETS, close, finish, make_case, new_token_ok, rank_partial, rank_state
from tests.ops.test_dcp_layout import single_rank

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (its interpreter runs the kernels on the CPU)")
interpreted = pytest.mark.interpreter_case


@pytest.mark.interpreter_driver
def test_kernel_cases_under_the_interpreter():
    run_interpreted(__file__, min_passed=24)


def _small_tiles(monkeypatch) -> None:
    """16-position tiles and chunks: several tiles and live splits per sequence at these short lengths."""
    from latency_specialized.kernels import gqa_decode_triton as gk

    monkeypatch.setattr(gk, "TILE_BYTES", 16)
    monkeypatch.setattr(gk, "MIN_CHUNK", 16)


@interpreted
@pytest.mark.parametrize("splits,d_block", [(1, 0), (3, 0), (3, 8)], ids=["direct", "merge", "merge-d8"])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lse_output_matches_the_partial_reference(splits, d_block, sinks, dtype, monkeypatch):
    """merge-d8: the merge in 8-column blocks (``MERGE_D_BLOCK``); only the first block's program stores the lse."""
    from latency_specialized.kernels import gqa_decode_triton as gk

    _small_tiles(monkeypatch)
    monkeypatch.setattr(gk, "MERGE_D_BLOCK", d_block)
    lens = (0, 1, 17, 50, 33)
    case = make_case("gqa", 40 + splits, lens, dtype=dtype, sinks=sinks)
    lay = DcpLayout(2, 1)   # rank 1: row 1 (one token, on rank 0) has no key here
    st_ref, st_tri = rank_state(case, lay, 40), rank_state(case, lay, 40)
    sk = case["extra"]["sinks"]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    call = dict(sinks=sk, **case["new"],
                slot_mapping=local_slot_mapping(seq_lens.long() - 1, st_ref["table"], 4, lay))
    o_ref, lse_ref = gqa_partial_reference(case["q"], *st_ref["caches"], st_ref["table"], local_seq_lens(seq_lens, lay),
                                           **call)
    o, lse = gqa_partial_triton(case["q"], *st_tri["caches"], st_tri["table"], local_seq_lens(seq_lens, lay),
                                num_splits=splits, **call)
    assert new_token_ok(case, st_tri)
    assert o.dtype == torch.float32 and lse.shape == lse_ref.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    fin = torch.isfinite(lse_ref)
    assert torch.allclose(lse[fin], lse_ref[fin], rtol=tol, atol=tol)
    assert torch.allclose(o, o_ref, rtol=tol, atol=tol)
    if not sinks:
        assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[1]).all() and (o[:2] == 0).all()
    else:   # a row without keys: the sink alone in the denominator
        assert torch.allclose(lse[0], sk.float(), atol=1e-6) and (o[:2] == 0).all()


@interpreted
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("batch", sorted(LENGTH_SETS))
@pytest.mark.parametrize("opts", [{}, dict(sinks=True)], ids=["plain", "sinks"])
def test_triton_partials_merged_equal_single_rank(opts, batch, world, monkeypatch):
    _small_tiles(monkeypatch)
    for i, lens in enumerate(LENGTH_SETS[batch]):
        seed = 300 + 10 * batch + world + i
        case = make_case("gqa", seed, lens, **opts)
        want = single_rank(case, seed)
        parts = []
        for r in range(world):
            lay = DcpLayout(world, r)
            st = rank_state(case, lay, seed)
            parts.append(rank_partial(case, lay, st, gqa_partial_triton))   # fused KV write on the owner
            assert new_token_ok(case, st), (lens, r)
        merged, _ = dcp_merge_reference(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        close(finish(case, merged), want, case["dtype"])


def test_lse_argument_errors_name_the_fix():
    from latency_specialized.kernels.gqa_decode_triton import gqa_decode_triton

    q = torch.randn(2, 4, 16)
    kc = torch.randn(3, 4, 2, 16)
    bt = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(UserError, match="lse must be"):
        gqa_decode_triton(q, kc, kc.clone(), bt, torch.ones(2, dtype=torch.int32), lse=torch.empty(2, 4).half())


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("sinks", [False, True])
def test_lse_output_on_the_gpu_at_model_shapes(batch, sinks):
    """bf16 tensor-core dots, head_dim 128, group 8, the default split count (many splits at batch 1:
    the merge kernel's lse) over a DCP rank's slice of long sequences."""
    g = torch.Generator().manual_seed(batch)
    Hq, KV, D, bs, world = 16, 2, 128, 16, 2
    lens = torch.randint(1, 6000, (batch,), generator=g)
    lens[0] = 1   # a row whose only token lives on rank 0: nothing on rank 1
    lay = DcpLayout(world, 1)
    local = local_seq_lens(lens, lay)
    width = int(local.max()) // bs + 2
    nb = batch * width + 1
    table = torch.randperm(nb, generator=g)[:batch * width].view(batch, width).to(torch.int32)
    kc = torch.randn(nb, bs, KV, D, generator=g).to(torch.bfloat16)
    vc = torch.randn(nb, bs, KV, D, generator=g).to(torch.bfloat16)
    q = torch.randn(batch, Hq, D, generator=g).to(torch.bfloat16)
    sk = torch.randn(Hq, generator=g) if sinks else None
    dev = [x.cuda() for x in (q, kc, vc, table, local.to(torch.int32))]
    o_ref, lse_ref = gqa_partial_reference(*dev, sinks=None if sk is None else sk.cuda())
    o, lse = gqa_partial_triton(*dev, sinks=None if sk is None else sk.cuda())
    torch.cuda.synchronize()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    fin = torch.isfinite(lse_ref)
    assert torch.allclose(lse[fin], lse_ref[fin], rtol=1e-3, atol=1e-3)
    assert torch.allclose(o, o_ref, rtol=2e-2, atol=2e-2)
