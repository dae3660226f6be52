"""The product's layout holds (docs/layout.md): imports go only downward through the layers, no import cycle, no
product file over 700 lines, and imports of project modules sit at the top of the module.

Layers, lowest first: ``core`` < ``synth`` < ``datamodules`` < ``lightning_modules`` < ``callbacks`` < ``evals`` and
``runner`` < ``cli`` < ``train.py``. A module may import its own layer and the ones below; two packages of one layer
(``evals``, ``runner``) do not import each other. The product is those packages and every in-repo module they import
(found by reading the source: every ``import`` statement counts, the ones inside functions too). An import of a project
module inside a function is allowed only where ``LAZY`` names it (an optional heavy dependency). Pure AST, no imports
of the project, a fraction of a second. Findings are reported per area (top-level package).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = {
    "core": 0,
    "synth": 1,
    "datamodules": 2,
    "lightning_modules": 3,
    "callbacks": 4,
    "evals": 5,
    "runner": 5,
    "cli": 6,
    "train": 7,
}
ROOTS = tuple(LAYERS)
MAX_LINES = 700
LAZY = {
    ("lightning_modules.engines.vllm_backend", "lightning_modules.engines.vllm_qwen"): "imports vllm at its top",
}
"""The imports of project modules allowed inside a function, ``(module, imported module): why``: only an optional heavy
dependency (a module that imports vllm, diffusers, ... at its top), imported where it is used."""
MAX_LAZY = 20
SKIP_DIRS = {"tests", "experiments", "notebooks", "outputs", "checkpoints", "data", "build", "dist", "__pycache__"}


def _modname(rel: str) -> str:
    mod = rel[: -len(".py")].replace(os.sep, ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def _repo_modules() -> dict[str, Path]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(REPO):
        rel_dir = os.path.relpath(dirpath, REPO)
        dirnames[:] = [
            d
            for d in dirnames
            if not d.startswith(".") and not d.endswith(".egg-info") and (rel_dir != "." or d not in SKIP_DIRS)
        ]
        for f in filenames:
            if f.endswith(".py"):
                rel = os.path.normpath(os.path.join(rel_dir, f))
                out[_modname(rel)] = REPO / rel
    return out


def _imports(path: Path, mod: str, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                parts = parts[: len(parts) - node.level + 1] if node.level > 1 else parts
                base = ".".join([p for p in parts if p] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != mod:
                out.add(n)
    return out


def _resolve(name: str, known: dict[str, Path]) -> str:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def _lazy_imports(path: Path, mod: str, known: dict[str, Path]) -> list[tuple[int, str]]:
    """``(line, project module)`` of every import statement inside a function body of ``path`` (the most specific
    module each names: ``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``)."""
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import):
                out.extend((child.lineno, n) for a in child.names if (n := _resolve(a.name, known)))
            elif in_function and isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = pkg.split(".")
                    parts = parts[: len(parts) - child.level + 1] if child.level > 1 else parts
                    base = ".".join([p for p in parts if p] + ([base] if base else []))
                names = {_resolve(f"{base}.{a.name}", known) for a in child.names} - {""}
                out.extend((child.lineno, n) for n in sorted(names))
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return out


def _sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _area(mod: str) -> str:
    return mod.split(".")[0]


@pytest.fixture(scope="module")
def product():
    known = _repo_modules()
    seeds = [m for m in known if _area(m) in ROOTS]
    graph: dict[str, set[str]] = {}
    todo = list(seeds)
    while todo:
        m = todo.pop()
        if m in graph:
            continue
        graph[m] = _imports(known[m], m, known)
        todo += [n for n in graph[m] if n not in graph]
    return known, graph


def _upward(graph, area):
    return sorted(
        f"{m} -> {n}"
        for m, deps in graph.items()
        if _area(m) == area
        for n in deps
        if _area(n) in LAYERS and LAYERS[_area(n)] > LAYERS[area]
    )


def _cycles(graph, area):
    return [", ".join(c) for c in _sccs(graph) if _area(c[0]) == area]


def _too_long(known, graph, area):
    out = []
    for m in sorted(graph):
        if _area(m) == area:
            n = sum(1 for _ in known[m].open(encoding="utf-8"))
            if n > MAX_LINES:
                out.append(f"{known[m].relative_to(REPO)}: {n} lines")
    return out


def test_the_product_is_found(product):
    known, graph = product
    present = {a for a in LAYERS if (REPO / a).is_dir() or (REPO / f"{a}.py").is_file()}
    assert {_area(m) for m in graph} >= present, sorted({_area(m) for m in graph})
    assert len(graph) >= 30, f"only {len(graph)} product modules found"


@pytest.mark.parametrize("area", ROOTS)
def test_imports_go_only_downward(product, area):
    _, graph = product
    bad = _upward(graph, area)
    assert not bad, f"{area} imports a layer above it (docs/layout.md):\n" + "\n".join(bad)


def test_packages_of_one_layer_do_not_import_each_other(product):
    _, graph = product
    bad = sorted(
        f"{m} -> {n}"
        for m, deps in graph.items()
        for n in deps
        if _area(m) in LAYERS and _area(n) in LAYERS and _area(m) != _area(n)
        if LAYERS[_area(m)] == LAYERS[_area(n)]
    )
    assert not bad, "packages of one layer import each other (docs/layout.md):\n" + "\n".join(bad)


def test_no_import_cycle_across_areas(product):
    _, graph = product
    bad = [", ".join(c) for c in _sccs(graph) if len({_area(m) for m in c}) > 1]
    assert not bad, "import cycles across packages:\n" + "\n".join(bad)


@pytest.mark.parametrize("area", ROOTS)
def test_no_import_cycle(product, area):
    _, graph = product
    bad = _cycles(graph, area)
    assert not bad, f"import cycles in {area}:\n" + "\n".join(bad)


@pytest.mark.parametrize("area", ROOTS)
def test_no_product_file_over_700_lines(product, area):
    known, graph = product
    bad = _too_long(known, graph, area)
    assert not bad, f"{area} files over {MAX_LINES} lines:\n" + "\n".join(bad)


def test_in_repo_modules_the_product_imports_hold_too(product):
    """Modules outside the layers that the product imports (``study``, ...): no cycle, no file over 700 lines."""
    known, graph = product
    others = sorted({_area(m) for m in graph} - set(LAYERS))
    bad = [c for a in others for c in _cycles(graph, a)] + [f for a in others for f in _too_long(known, graph, a)]
    assert not bad, "\n".join(bad)


def test_core_imports_nothing_of_the_project_above_it(product):
    _, graph = product
    bad = sorted(f"{m} -> {n}" for m, deps in graph.items() if _area(m) == "core" for n in deps if _area(n) != "core")
    assert not bad, (
        "core is the low layer: it imports only the standard library and third-party packages\n" + "\n".join(bad)
    )


def test_project_imports_sit_at_the_top_of_the_module(product):
    """Inside a function only what ``LAZY`` lists (at most ``MAX_LAZY``); every entry of ``LAZY`` is still used."""
    known, graph = product
    found = {
        (m, n): f"{known[m].relative_to(REPO)}:{line}: {n}"
        for m in sorted(graph)
        if _area(m) in LAYERS
        for line, n in _lazy_imports(known[m], m, known)
        if n != m
    }
    bad = [where for key, where in found.items() if key not in LAZY]
    assert not bad, (
        f"{len(bad)} imports of project modules inside functions: move them to the top of the module, or, for an "
        "optional heavy dependency, name them in LAZY with the reason\n" + "\n".join(bad)
    )
    assert not set(LAZY) - set(found), f"LAZY names imports that are gone: {sorted(set(LAZY) - set(found))}"
    assert len(LAZY) <= MAX_LAZY, f"{len(LAZY)} lazy imports allowed, the goal is at most {MAX_LAZY}"
