"""The import graph of fastfeed's modules: the loader sits below its integrations, the ring below its workers.

Imports are read from the source with ``ast`` (module-level and inside functions alike), resolved to the fastfeed
modules they name, and checked for the directions the layers must keep.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fastfeed"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if "_run_site" not in parts:  # sitecustomize for `fastfeed run`'s children, never imported as fastfeed's
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The fastfeed module ``name`` is, or is in (``fastfeed.loader.DataLoader`` -> ``fastfeed.loader``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _bound(package: str) -> set[str]:
    """Names a package's ``__init__.py`` binds at module level."""
    out = set()
    for node in ast.walk(ast.parse(MODULES[package].read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
    return out


def imports(module: str, top_level_only: bool = False) -> set[str]:
    """The fastfeed modules ``module`` imports, at module level only or anywhere in it."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # module level includes imports under if/try at module level
        nodes = [n for stmt in tree.body if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                   ast.ClassDef)) for n in ast.walk(stmt)]
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # "from . import x" names module x when there is one, else an attribute of the package; a name the
            # package does not bind is a compiled module (fastfeed._C), which imports nothing of fastfeed
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
                     if f"{base}.{a.name}" in MODULES or base not in MODULES or MODULES[base].name != "__init__.py"
                     or a.name in _bound(base)]
        else:
            continue
        out |= {m for m in map(_resolve, names) if m is not None and m != module}
    return out


def reaches(start: str, goal: str, top_level_only: bool = False, avoid: frozenset = frozenset()) -> list[str] | None:
    """A chain of imports from ``start`` to ``goal`` (not through ``avoid``), or None."""
    seen, stack = {start}, [[start]]
    while stack:
        chain = stack.pop()
        for nxt in sorted(imports(chain[-1], top_level_only)):
            if nxt == goal:
                return chain + [nxt]
            if nxt not in seen and nxt not in avoid:
                seen.add(nxt)
                stack.append(chain + [nxt])
    return None


def cycles(top_level_only: bool) -> list[list[str]]:
    """Every import cycle among fastfeed's modules, as chains that end where they start (Tarjan's components)."""
    index, low, on, stack, found = {}, {}, set(), [], []
    graph = {m: imports(m, top_level_only) for m in MODULES}

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                found.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for m in MODULES:
        if m not in index:
            visit(m)
    return found


def test_the_reader_finds_the_imports_it_must_check():
    """The checks below can fail: the reader sees relative, absolute and function-level imports as edges."""
    assert "fastfeed._ring.leaf" in imports("fastfeed._ring.layout")
    assert "fastfeed.loader" in imports("fastfeed.accelerate", top_level_only=True)
    assert "fastfeed._iterator" in imports("fastfeed.loader", top_level_only=True)
    assert "fastfeed.tuning.offline" in imports("fastfeed.tuning.auto")  # inside start()
    assert "fastfeed.tuning.offline" not in imports("fastfeed.tuning.auto", top_level_only=True)
    assert reaches("fastfeed.accelerate", "fastfeed._iterator") is not None


def test_the_loader_does_not_import_accelerate():
    """Accelerate's watcher depends on the loader (it registers on fastfeed._hooks), never the reverse."""
    assert reaches("fastfeed.loader", "fastfeed.accelerate") is None, reaches("fastfeed.loader", "fastfeed.accelerate")
    assert "fastfeed._hooks" in imports("fastfeed.loader") and "fastfeed._hooks" in imports("fastfeed.accelerate")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("fastfeed.tuning")))
def test_tuning_does_not_import_the_loader(module):
    """tuning/ receives the loader class it measures (from fastfeed/__init__.py); no module of it imports
    fastfeed.loader, directly or through another module (the package's own __init__, which holds everything, and
    fastfeed.accelerate, which is above the loader, aside)."""
    chain = reaches(module, "fastfeed.loader", avoid=frozenset({"fastfeed", "fastfeed.accelerate"}))
    assert chain is None, " -> ".join(chain)
    assert "fastfeed" not in imports(module, top_level_only=True), f"{module} imports the whole package"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("fastfeed._ring")))
def test_the_ring_does_not_import_its_workers(module):
    """The ring is below the workers that write into it: Leaf, which both use, lives in fastfeed._ring.leaf."""
    assert not any(m.startswith("fastfeed._workers") for m in imports(module)), imports(module)


def test_old_imports_of_leaf_and_worker_types_still_work():
    """Leaf is still importable from the workers' messages, WORKER_TYPES from the loader."""
    from fastfeed._ring.leaf import Leaf
    from fastfeed._workers.messages import Leaf as OldLeaf
    from fastfeed.loader import WORKER_TYPES

    assert OldLeaf is Leaf and WORKER_TYPES == ("process", "thread")


def test_no_import_cycle_at_module_level():
    """No fastfeed module imports, while it is being imported, a module that imports it back."""
    assert cycles(top_level_only=True) == []


def test_no_import_cycle_among_the_loader_accelerate_and_tuning():
    """Counting imports inside functions too, loader.py, accelerate.py and tuning/ form no cycle."""
    layer = {m for m in MODULES if m in ("fastfeed.loader", "fastfeed.accelerate") or m.startswith("fastfeed.tuning")}
    assert [c for c in cycles(top_level_only=False) if len(set(c) & layer) > 1 and set(c) <= layer] == []
    for a in sorted(layer):
        for b in sorted(layer - {a}):
            there = reaches(a, b, avoid=frozenset({"fastfeed"}) | (frozenset(MODULES) - layer))
            back = reaches(b, a, avoid=frozenset({"fastfeed"}) | (frozenset(MODULES) - layer))
            assert there is None or back is None, (there, back)


LAYER = ("fastfeed.loader", "fastfeed.accelerate", "fastfeed.tuning", "fastfeed.tuning.auto", "fastfeed.tuning.offline",
         "fastfeed.tuning.online", "fastfeed.tuning.cli", "fastfeed._ring.layout", "fastfeed._workers.messages")


@pytest.mark.parametrize("module", LAYER)
def test_each_module_of_the_layers_imports(module):
    """Each module the checks above are about imports (without Accelerate installed too: it is imported late)."""
    assert importlib.import_module(module).__name__ == module
