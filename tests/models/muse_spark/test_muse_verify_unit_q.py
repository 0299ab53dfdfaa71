"""Muse Spark program vs reference with blunt attention (q scale 1), at the default fp32 bound.

The matrix checks the tiny model at the released q scale, whose sharp attention amplifies fp32 summation-order
differences ~100x (``MuseSparkAdapter.verify_rel_tol``, 1e-3). A wrong mask, ring or rollback in a verification
step errs at any q scale; at scale 1 only rounding is left, so the cells here hold the default bound (5e-5),
20x tighter: they catch what the matrix's bound could hide.
"""

from __future__ import annotations

import pytest

from latency_specialized.testing.matrix import Cell
from latency_specialized.testing.verify import REL_TOL
from latency_specialized_models.muse_spark.adapter import MuseSparkAdapter
from latency_specialized_models.muse_spark.spec import full_spec, tiny_spec


class UnitQMuseSpark(MuseSparkAdapter):
    """Muse Spark whose tiny model scales q by 1 (everything else as released)."""

    verify_rel_tol = REL_TOL

    def spec(self, variant="full"):
        return full_spec() if variant == "full" else tiny_spec(qk_scale_factor=1.0)


CELLS = [(4, 0), (2, 7), (4, 7)]
"""(batch, spec tokens) at TP 1, context 40: the matrix's verification sample plus a plain step."""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("batch,k", CELLS, ids=[f"b{b}-s{k}" for b, k in CELLS])
def test_verification_cells_hold_the_default_bound_at_unit_q_scale(batch, k, device):
    adapter = UnitQMuseSpark()
    assert adapter.spec("tiny").qk_scale_factor == 1.0
    r = adapter.verify_cell(Cell("muse_spark", batch, 1, 40, k, device), comm=None)
    assert r.ok, (r.max_abs_err, r.tolerance, r.top1_agreement, r.fast_steps, r.stock_steps)
    assert r.top1_agreement == 1.0
