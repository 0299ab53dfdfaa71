"""The CuTe DSL disk cache's fingerprint covers the sources that can change a DSL compile, and only those: editing
a Triton-only kernel keeps the compiled objects (the device caches built on the CPU machine stay valid), editing a
DSL kernel or a helper it imports starts a new directory."""

import re
from pathlib import Path

import latency_specialized.kernels as kernels_pkg
from latency_specialized.kernels import compile_cache

KERNELS = Path(kernels_pkg.__file__).parent
DSL_CODE = re.compile(r"^\s*(import cutlass|from cutlass|@cute\.|.*\bcute\.(jit|kernel|compile)\b|.*cached_compile\()",
                      re.M)


def _code(path: Path) -> str:
    """The source without docstrings' and comments' mentions (lines inside triple quotes or after # dropped)."""
    text = re.sub(r'"""[\s\S]*?"""', "", path.read_text())
    return "\n".join(line.split("#")[0] for line in text.splitlines())


def test_every_module_with_dsl_code_is_fingerprinted():
    hashed = {p.name for p in compile_cache.dsl_sources()}
    with_dsl = {p.name for p in KERNELS.glob("*.py") if DSL_CODE.search(_code(p))}
    assert with_dsl, "the pattern found no DSL module: it is out of date"
    assert with_dsl <= hashed, f"DSL code outside the fingerprint: {sorted(with_dsl - hashed)}"
    assert "compile_cache.py" in hashed


def test_triton_only_kernels_are_not_fingerprinted():
    hashed = {p.stem for p in compile_cache.dsl_sources()}
    for name in ("gqa_decode_triton", "indexer_triton", "sparse_mqa_triton", "topk_triton", "mhc_triton"):
        assert (KERNELS / f"{name}.py").exists(), name
        assert name not in hashed, f"{name} (Triton only) would invalidate the CuTe DSL objects"


def _package(root: Path, helper: str, triton: str) -> None:
    (root / "dsl_kernel.py").write_text("import cutlass.cute as cute\n"
                                        "def f():\n    from latency_specialized.kernels.helper import X\n")
    (root / "helper.py").write_text(helper)
    (root / "tri.py").write_text(triton)


def test_the_fingerprint_follows_dsl_sources_and_their_imports(tmp_path):
    _package(tmp_path, "X = 1\n", "import triton\n")
    assert {p.name for p in compile_cache.dsl_sources(tmp_path)} == {"dsl_kernel.py", "helper.py"}
    base = compile_cache.source_fingerprint(tmp_path)
    assert compile_cache.source_fingerprint(tmp_path) == base
    (tmp_path / "tri.py").write_text("import triton\nY = 2\n")
    assert compile_cache.source_fingerprint(tmp_path) == base, "a Triton-only edit changed the fingerprint"
    (tmp_path / "helper.py").write_text("X = 2\n")
    assert compile_cache.source_fingerprint(tmp_path) != base, "an edit of a DSL kernel's import kept it"


def test_relative_imports_are_followed(tmp_path):
    (tmp_path / "dsl_kernel.py").write_text("from cutlass import cute\nfrom .helper import X\nfrom . import other\n")
    (tmp_path / "helper.py").write_text("X = 1\n")
    (tmp_path / "other.py").write_text("Y = 1\n")
    (tmp_path / "tri.py").write_text("import triton\n")
    assert {p.stem for p in compile_cache.dsl_sources(tmp_path)} == {"dsl_kernel", "helper", "other"}
