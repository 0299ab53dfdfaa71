"""Recorded Triton specialisations compile again ahead of a run (``testing.triton_specs``), on the CPU: a record in
Triton's own serialised form compiles for sm_90 into the on-disk cache, a second compile of it is a cache hit, factory
kernels resolve, stale records are reported, record files (``testing.compile_records``) round-trip, and the recorder
keeps what Triton's hook hands it."""

from __future__ import annotations

import inspect
import json
from types import SimpleNamespace

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from latency_specialized.testing import triton_specs  # noqa: E402


@triton.jit
def scale_rows(x_ptr, y_ptr, alpha, N: tl.constexpr, DT: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y_ptr + o, (tl.load(x_ptr + o) * alpha).to(DT))


@triton.jit
def scale_rows_switched(x_ptr, y_ptr, alpha, N: tl.constexpr, NEG: tl.constexpr, DT: tl.constexpr):
    # scale_rows after gaining a switch in the middle of its constexprs (as the indexer's select gained LOOPS)
    o = tl.arange(0, N)
    y = tl.load(x_ptr + o) * alpha
    if NEG:
        y = -y
    tl.store(y_ptr + o, y.to(DT))


def _record(n: int, neg: bool | None = None) -> dict[str, str]:
    """A record as Triton's hook would hand it over for ``scale_rows`` at N = n (16-byte aligned pointers); with
    ``neg``, for ``scale_rows_switched`` at NEG = neg."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import serialize_specialization_data

    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options({"num_warps": 1})
    extra = {"target": target} if "target" in inspect.signature(serialize_specialization_data).parameters else {}
    name = "scale_rows" if neg is None else "scale_rows_switched"
    signature = {"x_ptr": "*fp32", "y_ptr": "*bf16", "alpha": "fp32", "N": "constexpr"}
    constants: dict[tuple[int, ...], object] = {(3,): n}
    if neg is not None:
        signature["NEG"], constants[(4,)] = "constexpr", neg
    constants[(len(signature),)] = tl.bfloat16
    signature["DT"] = "constexpr"
    data = serialize_specialization_data(
        f"{__name__}.{name}", signature, constants, {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]},
        options, key=f"k{n}", **extra)
    return {"fn": f"{__name__}:{name}", "data": data}


@pytest.fixture
def triton_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    return tmp_path


def test_a_record_compiles_into_the_cache_and_then_hits(triton_cache):
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    rec = _record(32)
    assert triton_specs.compile_record(rec, target) is False        # compiled
    assert any(triton_cache.rglob("*.cubin"))
    assert triton_specs.compile_record(rec, target) is True         # the same key: a hit
    compiled, hits, errors = triton_specs.precompile([rec, _record(64)], jobs=1)
    assert (compiled, hits, errors) == (1, 1, [])


def test_stale_records_are_reported_not_raised(triton_cache):
    bad = dict(_record(16), fn=f"{__name__}:no_such_kernel")
    late = _record(128)
    compiled, hits, errors = triton_specs.precompile([bad], jobs=1)
    assert (compiled, hits) == (0, 0) and errors[0].startswith(f"{__name__}:no_such_kernel: AttributeError")
    compiled, hits, errors = triton_specs.precompile([late], jobs=1, time_limit_s=-1)
    assert (compiled, hits) == (0, 0) and errors == [f"{__name__}:scale_rows: not reached (time limit)"]


def test_records_of_a_kernel_whose_arguments_changed_are_stale(triton_cache):
    """A record made before the kernel gained an argument (a new constexpr, as sessions add switches) is named stale
    without compiling, and ``precompile`` reports it instead of compiling a specialisation no launch will ask for."""
    rec = _record(32)
    assert triton_specs.stale_reason(rec) is None
    data = json.loads(rec["data"])
    del data["signature"]["DT"]
    old = dict(rec, data=json.dumps(data))
    why = triton_specs.stale_reason(old)
    assert why == (f"{__name__}:scale_rows: StaleRecord: the kernel's arguments changed since the record "
                   "(added ['DT'], dropped [])")
    assert triton_specs.stale_reason(dict(rec, fn=f"{__name__}:gone")).startswith(f"{__name__}:gone: AttributeError")
    compiled, hits, errors = triton_specs.precompile([old], jobs=1)
    assert (compiled, hits) == (0, 0) and errors == [why]
    assert not any(triton_cache.rglob("*.cubin"))


def test_a_record_given_the_new_constexpr_compiles_to_the_launchs_entry(triton_cache):
    """``with_constexprs`` (``benchmarks/scripts/migrate_records.py``): an old record of a kernel that gained a
    constexpr before others, given its value, compiles into the very cache entry a record made with the new argument
    does (the second compile a hit); a variant's value changes the entry; a record missing a value or dropping an
    argument is refused."""
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    now = list(scale_rows_switched.arg_names)
    old = dict(_record(32), fn=f"{__name__}:scale_rows_switched")
    assert triton_specs.stale_reason(old) is not None
    migrated = triton_specs.with_constexprs(old, now, {"NEG": False})
    assert triton_specs.stale_reason(migrated) is None
    assert triton_specs.record_constexprs(migrated) == {"N": 32, "NEG": False, "DT": "bf16", "num_warps": 1}
    assert triton_specs.compile_record(migrated, target) is False
    assert triton_specs.compile_record(_record(32, neg=False), target) is True     # the launch's own record: a hit
    flipped = triton_specs.with_constexprs(migrated, now, {"NEG": True, "num_warps": 2})
    assert triton_specs.compile_record(flipped, target) is False
    assert triton_specs.record_constexprs(flipped)["num_warps"] == 2
    with pytest.raises(ValueError, match="no value for the new arguments"):
        triton_specs.with_constexprs(old, now, {})
    with pytest.raises(triton_specs.StaleRecord):
        triton_specs.with_constexprs(migrated, ["x_ptr", "y_ptr", "alpha", "N"], {})


def test_factory_kernels_resolve():
    from latency_specialized.kernels import gqa_decode_triton

    split = triton_specs.resolve("latency_specialized.kernels.gqa_decode_triton:_kernels.<locals>.split_kernel")
    assert split is gqa_decode_triton._kernels(False)["split"]
    assert triton_specs.resolve(f"{__name__}:scale_rows") is scale_rows
    with pytest.raises(LookupError, match="no such kernel"):
        triton_specs.resolve("latency_specialized.kernels.gqa_decode_triton:_kernels.<locals>.gone_kernel")


def test_record_files_round_trip_deduplicated_and_sorted(tmp_path):
    from latency_specialized.testing import compile_records

    recs = {"triton": [_record(64), _record(32), _record(32)], "cute": [{"fn": "m:f", "args": [1], "kwargs": {}}]}
    for name in ("s.json", "s.json.gz"):
        compile_records.save(recs, tmp_path / name)
        back = compile_records.load(tmp_path / name)
        assert [json.loads(r["data"])["constant_vals"][0] for r in back["triton"]] == [32, 64]
        assert back["cute"] == recs["cute"]
    assert compile_records.merge([{"cute": recs["cute"]}, {"triton": [_record(32)]}]) == \
        {"triton": [_record(32)], "cute": recs["cute"]}


def test_the_recorder_keeps_each_specialisation_once_and_chains(monkeypatch):
    seen = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(kw["key"]))
    import triton.runtime.jit as jit

    monkeypatch.setattr(jit, "serialize_specialization_data", jit.serialize_specialization_data)
    rec = triton_specs.SpecRecorder()
    assert rec.install()
    info = SimpleNamespace(module="m", name="k")
    for key in ("a", "a", "b"):
        triton.knobs.runtime.jit_cache_hook(key=key, fn=info, compile={"specialization_data": f"data-{key}"})
    triton.knobs.runtime.jit_cache_hook(key="c", fn=info, compile={"specialization_data": None})
    assert rec.values() == [{"fn": "m:k", "data": "data-a"}, {"fn": "m:k", "data": "data-b"}]
    assert rec.skipped == 1 and seen == ["a", "a", "b", "c"]
    # Triton's serialiser no longer raises on a value JSON cannot hold (it would fail the launch): None instead
    takes_target = "target" in inspect.signature(jit.serialize_specialization_data).parameters
    extra = {"target": SimpleNamespace()} if takes_target else {}
    assert jit.serialize_specialization_data("f", {}, {(0,): object()}, {}, SimpleNamespace(), "k", **extra) is None


def test_the_toolchain_fingerprint_names_version_key_and_backend():
    words = triton_specs.toolchain_fingerprint().split()
    assert words[0] == "triton" and words[1] == triton.__version__ and words[2] == "key" and words[4] == "backend"
    assert all(len(w) == 16 and int(w, 16) >= 0 for w in (words[3], words[5]))


def test_a_no_argument_factory_kernel_resolves():
    """Stock's FlashMLA cache write is made by ``_cache_kernel()`` (no interpret flag): its records resolve too."""
    kernel = triton_specs.resolve(
        "latency_specialized.bench.stock.flashmla:_cache_kernel.<locals>.concat_and_cache_kernel")
    assert kernel.fn.__qualname__ == "_cache_kernel.<locals>.concat_and_cache_kernel"


def test_a_record_from_another_machine_compiles_with_this_tritons_libdevice(triton_cache):
    """Records carry the recording machine's libdevice path (the device's /opt/torch/...): where it is missing here
    the record compiles with this Triton's own, into the same cache key (Triton hashes the library's content)."""
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    rec = _record(32)
    assert triton_specs.compile_record(rec, target) is False
    data = json.loads(rec["data"])
    libs = data["options"]["extern_libs"]
    assert libs and all(len(lib) == 2 for lib in libs)
    data["options"]["extern_libs"] = [[name, "/opt/elsewhere/triton/backends/nvidia/lib/libdevice.10.bc"]
                                      for name, _ in libs]
    assert triton_specs.compile_record(dict(rec, data=json.dumps(data)), target) is True   # the same key: a hit


def test_tuple_factory_kernels_resolve():
    """KDA verify's factory returns a NamedTuple of kernels (no __dict__): its records resolve."""
    kernel = triton_specs.resolve("latency_specialized.kernels.kda_verify_triton:_kernels.<locals>.kda_accept_kernel")
    assert kernel.fn.__name__ == "kda_accept_kernel"


def test_migrate_records_adds_the_argument_and_the_variants():
    """``migrate_records.py``: the named kernel's records get the new constexpr from an expression over their own
    constexprs, each ``--variant`` adds a copy where its condition holds; other kernels' records pass unchanged."""
    from tests.script_loader import load_script

    migrate = load_script("benchmarks/scripts/migrate_records.py").migrate
    other = _record(16)
    records = [dict(_record(n), fn=f"{__name__}:scale_rows_switched") for n in (32, 64)] + [other]
    out, migrated, added = migrate(records, "scale_rows_switched", ["NEG=N > 32"],
                                   [("N == 32", ["NEG=True", "num_warps=4"])])
    assert (migrated, added) == (2, 1) and out[-1] is other
    got = [triton_specs.record_constexprs(r) for r in out[:-1]]
    assert [(g["N"], g["NEG"], g["num_warps"]) for g in got] == [(32, False, 1), (32, True, 4), (64, True, 1)]
    assert all(triton_specs.stale_reason(r) is None for r in out)
