"""CuTe DSL compile calls recorded in a GPU run become precompile units again (``testing.cute_units``): only calls
that reach a new kernel are recorded, configs round-trip through JSON, keyword arguments bind to their positions,
records that no longer fit the code are reported, and a recorded unit compiles into the disk cache (CPU, sm_90a)."""

from __future__ import annotations

import json

import pytest

from latency_specialized.kernels import compile_cache
from latency_specialized.testing import cute_units


@pytest.fixture
def recording(monkeypatch):
    monkeypatch.setattr(compile_cache, "UNIT_LOG", None)
    monkeypatch.setattr(compile_cache, "_CACHE", {})
    cute_units.start()
    return compile_cache


def test_configs_round_trip_through_json():
    from latency_specialized.kernels.gated_act import ActVariant
    from latency_specialized.kernels.gemm_gemv import GemvConfig

    args = (7168, 1, GemvConfig(rows_per_warp=2, lookahead=1), False, False, ActVariant(384, "bfloat16", "swiglu",
                                                                                          clamp=7.0))
    enc = json.loads(json.dumps([cute_units.encode(a) for a in args]))
    assert tuple(cute_units.decode(a) for a in enc) == args
    assert cute_units.decode(cute_units.encode((1, (2, None)))) == (1, (2, None))
    with pytest.raises(TypeError, match="no JSON form"):
        cute_units.encode(object())


def test_only_calls_that_reach_a_new_kernel_are_recorded(recording):
    calls = []

    @compile_cache.compile_unit
    def compile_thing(n, flag=False):
        calls.append(n)
        return compile_cache.cached_compile("thing", (n, flag), lambda arch: f"kernel{n}")

    compile_thing(3)
    compile_thing(3)                 # the memory tier: no new kernel, no record
    compile_thing(4, flag=True)
    assert calls == [3, 3, 4]
    fn = f"{__name__}:test_only_calls_that_reach_a_new_kernel_are_recorded.<locals>.compile_thing"
    assert cute_units.recorded() == [{"fn": fn, "args": [3], "kwargs": {}},
                                     {"fn": fn, "args": [4], "kwargs": {"flag": True}}]


def test_not_recording_passes_straight_through(monkeypatch):
    monkeypatch.setattr(compile_cache, "UNIT_LOG", None)
    monkeypatch.setattr(compile_cache, "_CACHE", {})

    @compile_cache.compile_unit
    def compile_other(n):
        return compile_cache.cached_compile("other", (n,), lambda arch: n * 2)

    assert compile_other(5) == 10 and compile_cache.UNIT_LOG is None


def test_units_bind_keywords_and_report_stale_records():
    from latency_specialized.kernels.gemm_gemv import GemvConfig, compile_gemv

    cfg = cute_units.encode(GemvConfig())
    good = {"fn": "latency_specialized.kernels.gemm_gemv:compile_gemv", "args": [1536, 1, cfg, False],
            "kwargs": {"norm": True}}
    gone = {"fn": "latency_specialized.kernels.gemm_gemv:compile_gone", "args": [], "kwargs": {}}
    renamed = {"fn": good["fn"], "args": [1536, 1, {"dataclass": cfg["dataclass"], "fields": {"no_field": 1}}, False],
               "kwargs": {}}
    units, stale = cute_units.units([good, gone, renamed])
    assert units == [(compile_gemv, (1536, 1, GemvConfig(), False, False, None, False, True, False))]
    assert [s.split(": ")[1] for s in stale] == ["AttributeError", "TypeError"]


def test_the_gemv_decorated_for_recording_compiles_from_a_record(recording, tmp_path, monkeypatch):
    pytest.importorskip("cutlass")
    from latency_specialized.kernels.gemm_gemv import GemvConfig, compile_gemv

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("LS_KERNEL_CACHE_DIR", str(tmp_path))
    compile_gemv(1024, 1, GemvConfig(), False)
    [rec] = cute_units.recorded()
    units, stale = cute_units.units(json.loads(json.dumps([rec])))
    assert not stale
    monkeypatch.setattr(compile_cache, "_CACHE", {})
    [(_, seconds, err)] = compile_cache.precompile(units, jobs=1)
    assert err == "" and len(list(tmp_path.rglob("*.o"))) == 1

