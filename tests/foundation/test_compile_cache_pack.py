"""Kernel caches packed on one machine serve another (``benchmarks/scripts/compile_cache_pack.py``): a Triton entry
stripped to its group file, metadata and cubin and moved to another directory is still a cache hit; CuTe DSL objects
keep their fingerprint directory; the budget keeps the archive small and says what it left out."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.script_loader import load_script

triton = pytest.importorskip("triton")

pack_mod = load_script("benchmarks/scripts/compile_cache_pack.py")


def _use_cache(monkeypatch, path: Path) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(path))
    monkeypatch.setattr(triton.knobs.cache, "dir", str(path))


def test_a_packed_cache_is_hit_where_it_is_unpacked(tmp_path, monkeypatch):
    from triton.backends.compiler import GPUTarget

    from latency_specialized.testing.triton_specs import compile_record
    from tests.foundation.test_triton_specs import _record

    target = GPUTarget("cuda", 90, 32)
    _use_cache(monkeypatch, tmp_path / "built")
    assert [compile_record(_record(n), target) for n in (32, 64)] == [False, False]
    cute = tmp_path / "kc" / "0123456789abcdef"
    cute.mkdir(parents=True)
    (cute / "k1.o").write_bytes(b"object" * 100)
    archive = tmp_path / "c.tar.xz"
    report = pack_mod.pack(archive, tmp_path / "built", cute, budget=1 << 20)
    assert "CuTe DSL objects 1 (+0 over budget), Triton entries 2 (+0 over budget)" in report
    moved = tmp_path / "elsewhere"
    assert pack_mod.unpack(archive, moved / "tc", moved / "kc").endswith(f"2 Triton entries -> {moved / 'tc'}")
    assert (moved / "kc" / "0123456789abcdef" / "k1.o").read_bytes() == b"object" * 100
    assert not list((moved / "tc").rglob("*.ptx")) and not list((moved / "tc").rglob("*.ttir"))
    _use_cache(monkeypatch, moved / "tc")
    assert [compile_record(_record(n), target) for n in (32, 64)] == [True, True]


def test_the_budget_leaves_entries_out_and_counts_them(tmp_path):
    cute = tmp_path / "kc" / "fp"
    cute.mkdir(parents=True)
    for i in range(3):
        (cute / f"k{i}.o").write_bytes(bytes(range(256)) * 64)
    report = pack_mod.pack(tmp_path / "c.tar.xz", None, cute, budget=1)
    assert "CuTe DSL objects 0 (+3 over budget)" in report


def test_similar_entries_all_fit_where_only_the_whole_archive_fits(tmp_path):
    """Objects that compress well together (kernels of one family are alike) go in whole where the archive fits the
    budget, though each compressed alone would not (session 39's records: 1,454 entries in 10 MiB of a 15 MiB budget,
    where a per-entry estimate left 216 out); below it the longest prefix that fits goes in."""
    import random

    cute = tmp_path / "kc" / "fp"
    cute.mkdir(parents=True)
    body = random.Random(0).randbytes(20000)
    for i in range(8):
        (cute / f"k{i}.o").write_bytes(body + bytes([i]))
    alone = len(pack_mod.lzma.compress(body, preset=6))
    report = pack_mod.pack(tmp_path / "c.tar.xz", None, cute, budget=3 * alone)
    assert "CuTe DSL objects 8 (+0 over budget)" in report
    assert (tmp_path / "c.tar.xz").stat().st_size <= 3 * alone
    report = pack_mod.pack(tmp_path / "d.tar.xz", None, cute, budget=alone // 2)
    assert "CuTe DSL objects 0 (+8 over budget)" in report


def test_what_the_budget_leaves_out_goes_to_the_rest_archive(tmp_path):
    """``rest``: the entries past the longest prefix that fits (CuTe DSL objects first) go to a second archive, so
    two calls under the transfer limit carry them all; unpacking both gives every object back."""
    import random

    cute = tmp_path / "kc" / "fp"
    cute.mkdir(parents=True)
    rnd = random.Random(1)
    blobs = {f"k{i}.o": rnd.randbytes(4000) for i in range(10)}
    for name, blob in blobs.items():
        (cute / name).write_bytes(blob)
    report = pack_mod.pack(tmp_path / "a.tar.xz", None, cute, budget=25000, rest=tmp_path / "b.tar.xz")
    first = int(report.split("CuTe DSL objects ")[1].split(" ")[0])
    assert 0 < first < 10 and f"(+{10 - first} over budget)" in report and "the rest ->" in report
    assert (tmp_path / "a.tar.xz").stat().st_size <= 25000
    moved = tmp_path / "elsewhere"
    pack_mod.unpack(tmp_path / "a.tar.xz", moved / "tc", moved / "kc")
    assert len(list((moved / "kc" / "fp").glob("*.o"))) == first
    pack_mod.unpack(tmp_path / "b.tar.xz", moved / "tc", moved / "kc")
    assert {p.name: p.read_bytes() for p in (moved / "kc" / "fp").glob("*.o")} == blobs
