"""``tests/gpu_durations.json`` (the long GPU tests, started first by ``tests/conftest.py``): every node id names a
test function that exists, with its GPU marker, so the file cannot silently go stale; and the ordering puts them first,
longest first, after the interpreter drivers."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


def _marks_gpu(node: ast.AST) -> bool:
    """Whether an expression (a decorator, a ``pytestmark`` value) names ``pytest.mark.gpu``."""
    return any(isinstance(n, ast.Attribute) and n.attr == "gpu" for n in ast.walk(node))


def test_every_listed_test_exists_and_is_a_gpu_test():
    listed = json.loads((ROOT / "tests" / "gpu_durations.json").read_text())
    assert listed and all(isinstance(v, (int, float)) and v > 0 for v in listed.values())
    for node in listed:
        path, name = node.split("::")
        func = name.split("[")[0]
        tree = ast.parse((ROOT / path).read_text())
        defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert func in defs, f"{node}: no such test (renamed? rerun benchmarks/scripts/gpu_durations.py)"
        module_mark = any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)
                          and _marks_gpu(n.value) for n in tree.body)
        # a GPU test: the module's or the function's gpu mark, or a cell of the CUDA axis (the matrix)
        assert module_mark or any(_marks_gpu(d) for d in defs[func].decorator_list) or name.endswith("-cuda]"), node


def test_long_gpu_tests_are_ordered_first_longest_first(monkeypatch):
    import tests.conftest as conftest

    monkeypatch.setattr(conftest, "_gpu_seconds", lambda: {"b::long": 50.0, "c::longer": 90.0})

    class Item(SimpleNamespace):
        def get_closest_marker(self, name):
            return self.markers.get(name)

        def add_marker(self, mark):
            self.markers[mark.name] = mark

    items = [Item(nodeid=n, markers={}, keywords={}) for n in ("a::short", "b::long", "c::longer", "d::driver")]
    items[3].markers[conftest.DRIVER] = object()  # any marker object: the layout asks only whether there is one
    config = SimpleNamespace(pluginmanager=SimpleNamespace(hasplugin=lambda name: name == "xdist"))
    conftest._xdist_layout(config, items)
    assert [i.nodeid for i in items] == ["d::driver", "c::longer", "b::long", "a::short"]


def test_memory_table_names_existing_gpu_tests_and_the_longest_prefix_wins():
    """``tests/gpu_memory.json`` (GiB the memory-heavy GPU tests are admitted with): every prefix names an existing
    test file (and function, where it names one) of GPU tests, with a positive figure; a node id takes the figure of
    its longest matching prefix, and an unlisted one none."""
    import tests.conftest as conftest

    table = json.loads((ROOT / "tests" / "gpu_memory.json").read_text())
    assert table and all(isinstance(v, (int, float)) and v > 0 for v in table.values())
    for prefix in table:
        path, _, name = prefix.partition("::")
        tree = ast.parse((ROOT / path).read_text())
        module_mark = any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)
                          and _marks_gpu(n.value) for n in tree.body)
        func = name.split("[")[0]
        defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert not func or func in defs, f"{prefix}: no such test"
        assert module_mark or (func and any(_marks_gpu(d) for d in defs[func].decorator_list)), \
            f"{prefix}: not GPU tests"
    rule = {"a.py::": 2.0, "a.py::test_x[big": 9.0}
    assert conftest._admission_gib("a.py::test_x[big-1]", rule) == 9.0
    assert conftest._admission_gib("a.py::test_x[small]", rule) == 2.0
    assert conftest._admission_gib("b.py::test_y", rule) == 0.0


def test_listed_gpu_tests_run_inside_the_ledger(monkeypatch):
    """The run-test hook holds a listed GPU test's figure in the memory ledger around its setup, call and teardown,
    and leaves other tests alone."""
    import contextlib

    import tests.conftest as conftest
    from latency_specialized.testing import gpu_share

    events = []

    @contextlib.contextmanager
    def fake_admitted(nbytes, label=""):
        events.append(("in", nbytes, label))
        yield
        events.append(("out", nbytes, label))

    monkeypatch.setattr(conftest, "_cuda_available", lambda: True)
    monkeypatch.setattr(conftest, "_gpu_gib", lambda: {"t.py::test_big": 2})
    monkeypatch.setattr(gpu_share, "admitted", fake_admitted)
    monkeypatch.setattr(gpu_share, "release_cached_memory", lambda: events.append(("released",)))
    monkeypatch.delenv("LS_GPU_PEAKS", raising=False)

    class Item(SimpleNamespace):
        def get_closest_marker(self, name):
            return object() if name == "gpu" else None

    for nodeid in ("t.py::test_big[1]", "t.py::test_small"):
        hook = conftest.pytest_runtest_protocol(Item(nodeid=nodeid), None)
        next(hook)
        events.append(("ran", nodeid))
        with contextlib.suppress(StopIteration):
            next(hook)
    assert events == [("in", 2 << 30, "t.py::test_big[1]"), ("ran", "t.py::test_big[1]"), ("released",),
                      ("out", 2 << 30, "t.py::test_big[1]"), ("ran", "t.py::test_small")]
