"""Every import of our packages, as the layer tests read it: module level, inside functions, under
`TYPE_CHECKING`, absolute and relative (tests/test_layers.py, tests/engines/test_package_layers.py)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("engines", "core", "grading", "policies", "router_model", "verifiers", "gateway")


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, wherever it sits."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the importing module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return found


def layer_sources(root: Path = ROOT, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Path relative to root → text, for every module of the layers (`extra`: planted ones)."""
    sources = {p.relative_to(root).as_posix(): p.read_text() for pkg in LAYERS for p in (root / pkg).rglob("*.py")}
    return sources | (extra or {})


def module_of(rel: str) -> tuple[str, bool]:
    parts = Path(rel).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def module_graph(sources: dict[str, str]) -> dict[str, dict[str, str]]:
    """Module → {module it imports → where}. `from pkg import sub` is an import of the module `pkg.sub` where
    that is a module, else of `pkg`; a name that is no module of ours counts as its nearest enclosing one."""
    modules = {module_of(rel)[0] for rel in sources}
    graph: dict[str, dict[str, str]] = defaultdict(dict)
    for rel, text in sources.items():
        module, is_package = module_of(rel)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = imported_modules(ast.unparse(node), module, is_package)[0][1] if node.level else node.module
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                names = subs + ([base or ""] if len(subs) < len(node.names) else [])
            else:
                continue
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    graph[module].setdefault(name, f"{rel}:{node.lineno}")
    return graph


def module_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Every set of modules that import each other round (strongly connected, more than one), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graph is a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)
