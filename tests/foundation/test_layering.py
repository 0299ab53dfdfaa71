"""The layers of DESIGN.md ("Layers"), enforced: imports only point down, no private names across
modules, no import cycles. No allow-list: a finding is fixed in the code, or the layer map below
changes (with its reason written next to it).

Every module under ``latency_specialized/`` and ``models/`` (imported as ``latency_specialized_models``)
is parsed with ``ast``; nothing is imported. A module's dependencies are

* every ``import`` / ``from ... import`` statement anywhere in it: at the top, inside functions
  (lazy imports are still dependencies: they run the first time the function does), and under
  ``if TYPE_CHECKING:`` (a name used only in annotations is still a design dependency: the module
  is written against that other module's types, so it may only name types of its own layer or below);
* ``importlib.import_module("a.b")`` with a literal name, and every string constant that *is* the
  dotted name of a module of the tree (``ops/builtin.py`` and ``kernels/registry.py`` import their
  lists of module names): loading by name is importing;
* ``import_module(f"pkg.{x}")``: an import of package ``pkg`` chosen by a naming convention.

Implicit imports of parent packages (``import a.b.c`` runs ``a/__init__`` and ``a/b/__init__``) are
not edges of the importing module: the ``__init__`` modules are classified and checked themselves.

Rules checked (each finding is listed; the test fails on any):

1. an import points to a module of the same layer or of a layer below (``LAYERS``, bottom first);
2. no module imports another module's private (``_underscore``) name, nor reads one through a module
   it imported (``mod._name``);
3. no import cycle between modules (strongly connected components of the graph above);
4. adapters never import ``cutlass`` or ``latency_specialized.kernels`` (they reach kernels through
   op families and the plan);
5. integrations reach adapters through the registry's hooks, never by module name
   (no import of ``latency_specialized_models.*``, literal or by a naming convention);
6. every module is classified (a new top-level module must be placed in ``LAYER_OF``).

The tests directory is exempt (tests may look at anything).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (("latency_specialized", "latency_specialized"), ("models", "latency_specialized_models"))
"""(directory, import name) of the trees checked."""

LAYERS = ("foundation", "kernels", "comm", "ops", "runtime", "composition", "adapters", "integrations")
"""Bottom first: a module may import its own layer or one below."""

LAYER_OF: dict[str, str] = {
    # foundation: the vocabulary every layer shares
    "latency_specialized": "foundation",                 # package docstring only
    "latency_specialized.spec": "foundation",
    "latency_specialized.hardware": "foundation",
    "latency_specialized.trace": "foundation",
    "latency_specialized.errors": "foundation",
    "latency_specialized.contract": "foundation",        # Implementation, OpContext, Support, make_context
    "latency_specialized.config_keys": "foundation",     # checkpoint config-key bookkeeping (errors only)
    # Quantized-weight formats, codecs and official tensor names (torch and errors only): the runtime's
    # checkpoint reader, kernels and adapters all dequantise / pack with the same code.
    "latency_specialized.quant": "foundation",
    # The hook specification (markers, hook names, entry-point group) is foundation: anything may
    # declare hook implementations. The plugin *manager* is not: it loads adapters (ModelAdapter,
    # ops layer) and op implementations into an ImplementationRegistry (ops layer), so it and the
    # package that re-exports it (``from latency_specialized.plugins import get_registry``) sit
    # above ops - at runtime, so that nothing in ops can reach the process-wide registry: the
    # planner and op families are handed a registry, they never look one up. (``ops/builtin.py`` imports
    # ``plugins.hookspecs``, which Python loads after ``plugins/__init__``: a load-order effect of the
    # package, not a dependency of the built-in op plugin on the registry, which loads it as an entry point.)
    "latency_specialized.plugins.hookspecs": "foundation",
    "latency_specialized.plugins": "runtime",
    "latency_specialized.kernels": "kernels",
    "latency_specialized.comm": "comm",
    "latency_specialized.ops": "ops",
    # The adapter contract (name, spec, scope, op sites, optional hooks) is vocabulary: what the planner
    # (ops.plan), the plugin registry and the runtime hold adapters as. It needs the spec only.
    "latency_specialized.adapter_contract": "foundation",
    # ModelAdapter, the class adapters subclass, is that contract plus the default op sites: the sites of
    # the spec's standard pieces (pieces.standard.compose_standard, one definition per site kind). So it
    # sits with the pieces, below the adapters, above everything that holds adapters by the contract.
    "latency_specialized.adapter": "composition",
    "latency_specialized.runtime": "runtime",
    # The test matrix runs adapters' programs per rank (communicators, the registry) and adapters
    # return its CellResult: below adapters, above comm and the registry - runtime.
    "latency_specialized.testing": "runtime",
    "latency_specialized.pieces": "composition",
    "latency_specialized_models": "adapters",
    "latency_specialized.vllm": "integrations",
    "latency_specialized.cli": "integrations",
    "latency_specialized.commands": "integrations",
    "latency_specialized.bench": "integrations",
}
"""Module (or package: its modules too) -> layer; the longest matching name wins."""

ADAPTERS_PKG = "latency_specialized_models"
KERNELS_PKG = "latency_specialized.kernels"
ADAPTER_FORBIDDEN_EXTERNAL = ("cutlass",)


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    names: tuple[str, ...] = ()
    """Names taken from ``dst`` (``from dst import a, b``); empty for ``import dst``."""
    how: str = "import"

    def where(self) -> str:
        return f"{self.src}:{self.line}"


def discover() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for directory, name in PACKAGES:
        base = ROOT / directory
        for p in sorted(base.rglob("*.py")):
            parts = [name, *p.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = p
    return mods


def layer_of(module: str) -> str | None:
    best = None
    for name, layer in LAYER_OF.items():
        if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[0])):
            best = (name, layer)
    return best[1] if best else None


def _resolve(name: str, mods: dict[str, Path]) -> tuple[str | None, list[str]]:
    """The longest prefix of ``name`` that is a module of the tree, and the attribute path after it."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in mods:
            return cand, parts[i:]
    return None, parts


class _Visitor(ast.NodeVisitor):
    def __init__(self, module: str, is_pkg: bool, mods: dict[str, Path]):
        self.module, self.is_pkg, self.mods = module, is_pkg, mods
        self.edges: list[Edge] = []
        self.external: list[tuple[str, int]] = []
        self.aliases: dict[str, str] = {}     # local name -> module of the tree it is bound to
        self.private_reads: list[tuple[str, str, int]] = []
        self.docstrings: set[int] = set()

    # ------------------------------------------------------------------ helpers
    def _edge(self, target: str, line: int, names: tuple[str, ...] = (), how: str = "import") -> str | None:
        dst, rest = _resolve(target, self.mods)
        if dst is None:
            self.external.append((target, line))
            return None
        if rest:  # ``import a.b.attr``-like spellings: the attribute path is a name taken from dst
            names = (rest[0],) + names
        if dst != self.module:
            self.edges.append(Edge(self.module, dst, line, names, how))
        return dst

    def _base(self, level: int, module: str | None) -> str:
        parts = self.module.split(".") if self.is_pkg else self.module.split(".")[:-1]
        parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
        return ".".join(parts + ([module] if module else []))

    # ------------------------------------------------------------------ visitors
    def _mark_docstring(self, body: list[ast.stmt]) -> None:
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            self.docstrings.add(id(body[0].value))

    def visit_Module(self, node: ast.Module) -> None:
        self._mark_docstring(node.body)
        self._mark_attribute_docstrings(node.body)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._mark_docstring(node.body)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def _mark_attribute_docstrings(self, body: list[ast.stmt]) -> None:
        # attribute docstrings (a string statement after an assignment) are documentation too
        for stmt in body:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
                self.docstrings.add(id(stmt.value))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._mark_docstring(node.body)
        self._mark_attribute_docstrings(node.body)
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            dst = self._edge(a.name, node.lineno)  # an external module (cutlass ...) lands in self.external
            if dst is not None:
                # ``import a.b as m`` binds m to a.b; ``import a.b`` binds a (the top package)
                self.aliases[a.asname or a.name.split(".")[0]] = dst if a.asname else a.name.split(".")[0]
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._base(node.level, node.module) if node.level else (node.module or "")
        for a in node.names:
            full = f"{base}.{a.name}"
            if full in self.mods:  # ``from pkg import submodule``
                dst = self._edge(full, node.lineno)
                if dst is not None:
                    self.aliases[a.asname or a.name] = dst
            else:
                self._edge(base, node.lineno, (a.name,))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name == "import_module" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.JoinedStr):  # f"pkg.{x}": a module chosen by naming convention
                head = arg.values[0].value if arg.values and isinstance(arg.values[0], ast.Constant) else ""
                pkg = str(head).rstrip(".")
                if pkg:
                    self._edge(pkg, node.lineno, how="import_module by naming convention")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        v = node.value
        if isinstance(v, str) and id(node) not in self.docstrings and v in self.mods and "." in v:
            self._edge(v, node.lineno, how="module named by a string")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        # ``mod._name`` and ``pkg.mod._name``: a private name read through a module this one imported
        chain: list[str] = []
        cur: ast.expr = node
        while isinstance(cur, ast.Attribute):
            chain.append(cur.attr)
            cur = cur.value
        if isinstance(cur, ast.Name) and node.attr.startswith("_") and not node.attr.startswith("__"):
            self.private_reads.append((cur.id, ".".join(reversed(chain)), node.lineno))
        self.generic_visit(node)


def scan() -> tuple[dict[str, Path], list[Edge], list[str]]:
    mods = discover()
    edges: list[Edge] = []
    problems: list[str] = []
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        v = _Visitor(module, path.name == "__init__.py", mods)
        v.visit(tree)
        edges += v.edges
        for local, path, line in v.private_reads:
            base = v.aliases.get(local)
            if base is None:
                continue
            target, rest = _resolve(f"{base}.{path}", mods)
            private = [r for r in rest if r.startswith("_") and not r.startswith("__")]
            if target is not None and target != module and private:
                problems.append(f"private name: {module}:{line} reads {target}.{'.'.join(rest)} (through '{local}')")
        if module.startswith(ADAPTERS_PKG):
            for ext, line in v.external:
                if ext.split(".")[0] in ADAPTER_FORBIDDEN_EXTERNAL:
                    problems.append(f"adapter imports {ext}: {module}:{line} (adapters reach kernels through "
                                    "op families and the plan)")
    return mods, edges, problems


def _cycles(mods: dict[str, Path], edges: list[Edge]) -> list[list[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for e in edges:
        graph[e.src].add(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:  # Tarjan; the tree is small enough for recursion
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(graph):
        if m not in index:
            strong(m)
    return out


def findings() -> list[str]:
    mods, edges, problems = scan()
    rank = {name: i for i, name in enumerate(LAYERS)}
    for m in mods:
        if layer_of(m) is None:
            problems.append(f"unclassified module {m}: place it (or its package) in LAYER_OF")
    for e in edges:
        ls, ld = layer_of(e.src), layer_of(e.dst)
        if ls is None or ld is None:
            continue
        what = f"{e.dst}" + (f" ({', '.join(e.names)})" if e.names else "")
        if rank[ld] > rank[ls]:
            problems.append(f"upward import: {e.where()} [{ls}] -> {what} [{ld}] ({e.how})")
        private = [n for n in e.names if n.startswith("_") and not n.startswith("__")]
        if private:
            problems.append(f"private name: {e.where()} imports {', '.join(private)} from {e.dst}")
        if ls == "adapters" and (e.dst == KERNELS_PKG or e.dst.startswith(KERNELS_PKG + ".")):
            problems.append(f"adapter imports a kernel module: {e.where()} -> {what} (use the op family / plan)")
        if ls == "integrations" and (e.dst == ADAPTERS_PKG or e.dst.startswith(ADAPTERS_PKG + ".")):
            problems.append(f"integration reaches an adapter by module name: {e.where()} -> {what} ({e.how}); "
                            "use a ModelAdapter hook through the registry")
    for comp in _cycles(mods, edges):
        inner = sorted({f"{e.src} -> {e.dst} (line {e.line})" for e in edges if e.src in comp and e.dst in comp})
        problems.append("import cycle: " + " <-> ".join(comp) + "\n      " + "\n      ".join(inner))
    return problems


def test_every_module_is_classified_and_imports_point_down():
    problems = findings()
    assert not problems, f"{len(problems)} layering finding(s) (DESIGN.md 'Layers'):\n  " + "\n  ".join(problems)


def test_the_checker_sees_what_it_must():
    """The scanner itself: lazy, TYPE_CHECKING and by-name imports are edges; private reads are found."""
    src = '''
"""doc naming latency_specialized.ops.plan"""
from typing import TYPE_CHECKING
import importlib
if TYPE_CHECKING:
    from latency_specialized.ops.plan import Plan
def f():
    from latency_specialized.runtime import census as c
    c._private
    importlib.import_module(f"latency_specialized_models.{name}.graphed")
MODS = ("latency_specialized.comm.base",)
'''
    mods = discover()
    v = _Visitor("latency_specialized.kernels.example", False, mods)
    v.visit(ast.parse(src))
    got = {(e.dst, e.how) for e in v.edges}
    assert ("latency_specialized.ops.plan", "import") in got                        # TYPE_CHECKING
    assert ("latency_specialized.runtime.census", "import") in got                  # lazy
    assert ("latency_specialized_models", "import_module by naming convention") in got
    assert ("latency_specialized.comm.base", "module named by a string") in got
    assert ("c", "_private", 9) in v.private_reads
    # and the scan resolves it to the module it belongs to
    assert _resolve("latency_specialized.runtime.census._private", mods) == ("latency_specialized.runtime.census",
                                                                              ["_private"])
    assert layer_of("latency_specialized.kernels.example") == "kernels"
    assert layer_of("latency_specialized.plugins.hookspecs") == "foundation"
    assert layer_of("latency_specialized.plugins.manager") == "runtime"
