"""``testing.verify.decisive_agreement``: near ties do not count against a cell, decisive flips do."""

from __future__ import annotations

import torch

from latency_specialized.testing.verify import decisive_agreement


def test_a_flip_inside_the_bound_is_a_near_tie_and_outside_it_counts():
    g = torch.Generator().manual_seed(7)
    want = torch.randn(6, 50, generator=g)
    want[:, 0] = want.max() + 1.0                      # a clear top-1 in every row...
    want[0, 1] = want[0, 0] - 1e-4                     # ...but row 0, a near tie with column 1
    scale = want.abs().max().item()
    got = want.clone()
    got[0, 1] += 2e-4                                  # within 2 x bound: row 0 flips
    raw, agree, decisive = decisive_agreement(got, want, rel_tol=1e-4 / scale)
    assert (raw, agree, decisive) == (5, 5, 5)         # row 0 is not decisive; the other 5 agree
    got[3, 2] = want[3, 0] + 1.0                       # a decisive row flips: counted
    raw, agree, decisive = decisive_agreement(got, want, rel_tol=1e-4 / scale)
    assert (raw, agree, decisive) == (4, 4, 5)


def test_every_position_is_decisive_without_ties():
    g = torch.Generator().manual_seed(8)
    want = torch.randn(2, 3, 40, generator=g, dtype=torch.float64)   # verification logits [B, T, vocab]
    raw, agree, decisive = decisive_agreement(want.float(), want, rel_tol=1e-9)
    assert raw == agree == decisive == 6
