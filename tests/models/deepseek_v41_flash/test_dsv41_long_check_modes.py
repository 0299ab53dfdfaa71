"""State drift of the long check (``testing/long_check.py``) on DeepSeek-V4.1-Flash's tiny model on the CPU: every
sparse MQA state (window ring, compressed rows, indexer keys, the compressor's pending rows) is compared, the pending
rows on their live entries only (``LIVE_PREFIX_STATES``: the program writes every token's row, the reference's fill
only the incomplete group's), in fp32 and bf16; and the free-running determinism check."""

import math

import pytest
import torch

from latency_specialized.plugins import get_registry
from latency_specialized.testing import long_check as lc


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def adapter():
    return get_registry().adapter("deepseek_v41_flash")


def test_fp32_state_drift_covers_every_sparse_mqa_state_and_stays_at_summation_noise():
    r = lc.teacher_forced(adapter(), 2, 5, variant="tiny", device="cpu", router_scale=0.0, dtype="fp32",
                          state_every=2, say=lambda s: None)
    assert r.ok and [c["step"] for c in r.checkpoints] == [2, 4, 5]
    names = {k.split(".", 1)[1] for k in r.checkpoints[-1]["states"]}
    assert names == {"window", "compressed", "pending", "index_k"}
    assert r.max_rel_err < 5e-5 and r.top1_agreement == 1.0
    # measured 7e-7; the pending rows' dead entries (a completed group's) would read ~1.0 here
    assert r.state_max_rel_err < 1e-5, r.checkpoints[-1]["states"]


def test_bf16_state_drift_is_bf16_rounding_and_the_floor_is_of_its_size():
    r = lc.teacher_forced(adapter(), 2, 4, variant="tiny", device="cpu", router_scale=0.0, fp32_floor=True,
                          state_every=2, say=lambda s: None)
    assert r.ok and r.nonfinite_states == 0 and math.isfinite(r.state_max_rel_err)
    assert r.state_max_rel_err < 5e-2 and r.state_floor_max_rel_err < 5e-2  # measured 2.6e-2 / 2.2e-2


def test_free_running_repeats_identical():
    p = lc.free_running(adapter(), 2, 5, variant="tiny", device="cpu", say=lambda s: None)
    assert p.ok and p.distinct_tokens > 1
