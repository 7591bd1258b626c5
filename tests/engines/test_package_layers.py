"""Inside `engines`: no two sub-packages import each other, and no module reaches itself through its imports.

Every import counts: module level, inside functions, under `TYPE_CHECKING`, relative. The sub-packages,
bottom up: kv, kernels, layers, models, checkpoints, speculative (remote beside them); the modules directly
in `engines/` (engine, scheduler, protocol...) are not a sub-package. Each check is shown to catch a planted
violation.
"""

from __future__ import annotations

from pathlib import Path

from import_graph import module_cycles, module_graph

ENGINES = Path(__file__).resolve().parents[2] / "engines"
SUBPACKAGES = sorted(p.parent.name for p in ENGINES.glob("*/__init__.py"))


def module_imports(extra: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    """Module → the engines modules it imports (`import_graph.module_graph` on engines/ alone). `extra` adds
    sources (path relative to engines/ → text), as if those files existed."""
    sources = {f"engines/{p.relative_to(ENGINES).as_posix()}": p.read_text() for p in ENGINES.rglob("*.py")}
    sources |= {f"engines/{rel}": text for rel, text in (extra or {}).items()}
    return module_graph(sources)


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in SUBPACKAGES) else None


def mutual_subpackages(graph: dict[str, dict[str, str]]) -> list[str]:
    edges: dict[tuple[str, str], str] = {}
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            a, b = _subpackage(src), _subpackage(dst)
            if a and b and a != b:
                edges.setdefault((a, b), f"{src} imports {dst}")
    return [f"{a} and {b}: {edges[a, b]}; {edges[b, a]}" for a, b in sorted(edges) if a < b and (b, a) in edges]


def test_no_two_subpackages_import_each_other() -> None:
    assert set(SUBPACKAGES) >= {"kv", "kernels", "layers", "models", "checkpoints", "speculative", "remote"}
    assert mutual_subpackages(module_imports()) == []


def test_no_module_imports_itself_through_others() -> None:
    assert module_cycles(module_imports()) == []


def test_a_planted_cycle_between_subpackages_is_caught() -> None:
    planted = {"kernels/planted.py": "def f() -> None:\n    from engines.layers.linear import Linear\n"}
    problems = mutual_subpackages(module_imports(planted))
    assert any(p.startswith("kernels and layers:") for p in problems), problems


def test_a_planted_module_cycle_is_caught() -> None:
    planted = {"kv/planted.py": "from engines.kv import tier_link\n", "kv/planted2.py": "from . import planted\n"}
    planted["kv/planted.py"] += "from engines.kv.planted2 import x\n"
    assert ["engines.kv.planted", "engines.kv.planted2"] in module_cycles(module_imports(planted))
