"""Inside `engines`: no two sub-packages import each other, and no module reaches itself through its imports.

Every import counts: module level, inside functions, under `TYPE_CHECKING`, relative. The sub-packages,
bottom up: kv, kernels, layers, models, checkpoints, speculative (remote beside them); the modules directly
in `engines/` (engine, scheduler, protocol...) are not a sub-package. Each check is shown to catch a planted
violation.
"""

from __future__ import annotations

import ast
from pathlib import Path

ENGINES = Path(__file__).resolve().parents[2] / "engines"
SUBPACKAGES = sorted(p.parent.name for p in ENGINES.glob("*/__init__.py"))


def module_imports(extra: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Module → the engines modules it imports (`from package import module` counts the module only).
    `extra` adds sources (path relative to engines/ → text), as if those files existed."""
    sources = {p.relative_to(ENGINES).as_posix(): p.read_text() for p in ENGINES.rglob("*.py")}
    sources |= extra or {}
    modules = {_module(rel) for rel in sources}
    graph: dict[str, set[str]] = {}
    for rel, text in sources.items():
        module, is_package = _module(rel), rel.endswith("__init__.py")
        found: set[str] = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = module.split(".") if is_package else module.split(".")[:-1]
                    base = ".".join([*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])])
                names = {f"{base}.{alias.name}" for alias in node.names}
                found |= names if names <= modules else names | {base}  # `from pkg import module`: the module
        graph[module] = {m for m in found if m in modules and m != module}
    return graph


def _module(rel: str) -> str:
    parts = Path("engines", rel).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in SUBPACKAGES) else None


def mutual_subpackages(graph: dict[str, set[str]]) -> list[str]:
    edges: dict[tuple[str, str], str] = {}
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            a, b = _subpackage(src), _subpackage(dst)
            if a and b and a != b:
                edges.setdefault((a, b), f"{src} imports {dst}")
    return [f"{a} and {b}: {edges[a, b]}; {edges[b, a]}" for a, b in sorted(edges) if a < b and (b, a) in edges]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_two_subpackages_import_each_other() -> None:
    assert set(SUBPACKAGES) >= {"kv", "kernels", "layers", "models", "checkpoints", "speculative", "remote"}
    assert mutual_subpackages(module_imports()) == []


def test_no_module_imports_itself_through_others() -> None:
    assert cycles(module_imports()) == []


def test_a_planted_cycle_between_subpackages_is_caught() -> None:
    planted = {"kernels/planted.py": "def f() -> None:\n    from engines.layers.linear import Linear\n"}
    problems = mutual_subpackages(module_imports(planted))
    assert any(p.startswith("kernels and layers:") for p in problems), problems


def test_a_planted_module_cycle_is_caught() -> None:
    planted = {"kv/planted.py": "from engines.kv import tier_link\n", "kv/planted2.py": "from . import planted\n"}
    planted["kv/planted.py"] += "from engines.kv.planted2 import x\n"
    assert ["engines.kv.planted", "engines.kv.planted2"] in cycles(module_imports(planted))
