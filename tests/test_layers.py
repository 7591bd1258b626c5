"""The layer rule, checked on every import: module level, inside functions and under `TYPE_CHECKING`, `import x`
and `from x import y`.

Packages, bottom up: engines → core → grading → policies → router_model → verifiers → gateway. A package
may import only packages below it; nothing outside `gateway/` and `tests/` imports `gateway`; no two
packages import each other. Inside the gateway its sub-packages keep an order of their own (`GATEWAY_ORDER`)
and nothing below `api/` imports a route; no module anywhere imports itself through others (a module
circle). Every sub-package says what it holds (a docstring) and what it offers (`__all__`). Each check is
shown to catch a planted violation.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest
from import_graph import LAYERS, ROOT, imported_modules, layer_sources, module_cycles, module_graph, module_of

RANK = {name: i for i, name in enumerate(LAYERS)}


def package_edges(root: Path = ROOT, extra: dict[str, str] | None = None) -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) → where, for every import between two of our packages.
    `extra` adds sources (path relative to root → text), as if those files existed."""
    sources = {p.relative_to(root).as_posix(): p.read_text() for pkg in LAYERS for p in (root / pkg).rglob("*.py")}
    sources |= extra or {}
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for rel, text in sources.items():
        parts = Path(rel).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        for line, name in imported_modules(text, module, is_package):
            target = name.split(".")[0]
            if target in RANK and target != parts[0]:
                edges[(parts[0], target)].append(f"{rel}:{line} imports {name}")
    return edges


def violations(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    problems = []
    for (src, dst), where in sorted(edges.items()):
        if RANK[dst] > RANK[src]:
            problems += [f"{w} (up: {src} is below {dst})" for w in where]
        if (dst, src) in edges and src < dst:
            problems.append(f"{src} and {dst} import each other: {where[0]}; {edges[(dst, src)][0]}")
    return problems


def test_every_package_is_a_layer() -> None:
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"bench"}
    assert on_disk == set(LAYERS), "a new top-level package needs its place in LAYERS"


def test_imports_point_down_only() -> None:
    assert violations(package_edges()) == []


def test_nothing_below_the_gateway_imports_it() -> None:
    edges = package_edges()
    assert [w for (src, dst), where in edges.items() if dst == "gateway" for w in where] == []


@pytest.mark.parametrize(
    ("path", "source"),
    [
        ("policies/planted.py", "from gateway.http.errors import APIError\n"),  # up, at module level
        ("engines/planted.py", "def f() -> None:\n    import core.settings\n"),  # up, inside a function
        ("grading/planted.py", "from ..router_model import model\n"),  # up, relative
    ],
)
def test_a_planted_upward_import_is_caught(path: str, source: str) -> None:
    problems = violations(package_edges(extra={path: source}))
    assert any(p.startswith(path) for p in problems), problems


def test_a_cycle_between_packages_is_caught() -> None:
    # verifiers → policies is allowed alone; policies → verifiers as well makes a cycle (and points up)
    problems = violations(package_edges(extra={"policies/planted.py": "import verifiers.base\n"}))
    assert any("import each other" in p for p in problems), problems


def test_no_module_circle_anywhere() -> None:
    import sys

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 5000))
    assert module_cycles(module_graph(layer_sources())) == []


@pytest.mark.parametrize(
    "planted",
    [
        {
            "grading/planted_a.py": "from grading.planted_b import x\n",
            "grading/planted_b.py": "import grading.planted_a\n",
        },
        {  # through a function's import and a type-only one
            "policies/planted_a.py": "def f() -> None:\n    from policies import planted_b\n",
            "policies/planted_b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .planted_a import f\n"
            ),
        },
    ],
)
def test_a_planted_module_circle_is_caught(planted: dict[str, str]) -> None:
    cycles = module_cycles(module_graph(layer_sources(extra=planted)))
    assert [module_of(rel)[0] for rel in sorted(planted)] in cycles, cycles


# --- the gateway's rooms ------------------------------------------------------------------------------------

# Each may import only those before it: the leaves (HTTP shapes, tiers and schedules, tenants and the ledger),
# the tenants' adapters, the caches and tool calls, routing, the pipeline, the routes, the console, then `app.py`
# and the CLI on top.
GATEWAY_ORDER = ("http", "runtime", "accounting", "adapters", "cache", "tool_calls", "routing", "pipeline", "api",
                 "console", "app", "cli")  # fmt: skip
ROUTE_USERS = ("api", "app", "cli")  # who may import a route module; the console takes only deps and auth
NOT_ROUTES = ("gateway.api", "gateway.api.deps", "gateway.api.auth", "gateway.api.params")
MAX_GATEWAY_TOP_MODULES = 2  # app.py and __init__.py
MAX_GATEWAY_FILE_LINES = 400


def gateway_room(module: str) -> str:
    parts = module.split(".")
    return "app" if len(parts) < 3 and parts[-1] in ("gateway", "app") else parts[1]


def gateway_violations(graph: dict[str, dict[str, str]]) -> list[str]:
    rank = {room: i for i, room in enumerate(GATEWAY_ORDER)}
    problems = []
    for src, targets in sorted(graph.items()):
        if not src.startswith("gateway"):
            continue
        for dst, where in sorted(targets.items()):
            if not dst.startswith("gateway"):
                continue
            a, b = gateway_room(src), gateway_room(dst)
            if rank[b] > rank[a]:
                problems.append(f"{where} imports {dst} (up: {a} is below {b})")
            if b == "api" and dst not in NOT_ROUTES and a not in ROUTE_USERS:
                problems.append(f"{where} imports the route module {dst}")
    return problems


def test_the_gateways_sub_packages_point_down_and_nothing_below_the_api_imports_a_route() -> None:
    gateway = {rel: text for rel, text in layer_sources().items() if rel.startswith("gateway/")}
    rooms = {p.parent.name for p in (ROOT / "gateway").glob("*/__init__.py")}
    assert rooms == set(GATEWAY_ORDER) - {"app"}, "a new gateway sub-package needs its place in GATEWAY_ORDER"
    assert gateway_violations(module_graph(gateway)) == []


@pytest.mark.parametrize(
    ("path", "source", "why"),
    [
        ("gateway/http/planted.py", "from gateway.pipeline import Pipeline\n", "up: http is below pipeline"),
        ("gateway/cache/planted.py", "def f() -> None:\n    from gateway.routing import stage\n", "up: cache"),
        ("gateway/console/planted.py", "from gateway.api.policies import router\n", "route module"),
    ],
)
def test_a_planted_gateway_violation_is_caught(path: str, source: str, why: str) -> None:
    problems = gateway_violations(module_graph(layer_sources(extra={path: source})))
    assert any(p.startswith(path) and why in p for p in problems), problems


def test_the_gateway_keeps_two_modules_on_top_and_small_files() -> None:
    assert sorted(p.name for p in (ROOT / "gateway").glob("*.py")) == ["__init__.py", "app.py"]
    assert len(list((ROOT / "gateway").glob("*.py"))) <= MAX_GATEWAY_TOP_MODULES
    long = {p.relative_to(ROOT).as_posix(): n for p in (ROOT / "gateway").rglob("*.py")
            if (n := p.read_text().count("\n")) > MAX_GATEWAY_FILE_LINES}  # fmt: skip
    assert long == {}


def missing_docs(sources: dict[str, str]) -> list[str]:
    """Packages whose `__init__` says nothing of what they hold (no docstring) or offer (no `__all__`)."""
    problems = []
    for rel, text in sorted(sources.items()):
        if not rel.endswith("__init__.py"):
            continue
        tree = ast.parse(text)
        if ast.get_docstring(tree) is None:
            problems.append(f"{rel}: no docstring")
        targets = [t for n in tree.body if isinstance(n, ast.Assign) for t in n.targets]
        targets += [n.target for n in tree.body if isinstance(n, ast.AnnAssign)]
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        if "__all__" not in names:
            problems.append(f"{rel}: no __all__")
    return problems


def test_every_package_says_what_it_holds_and_offers() -> None:
    assert missing_docs(layer_sources()) == []
    planted = missing_docs({"gateway/planted/__init__.py": "x = 1\n", "core/planted/__init__.py": '"""Doc."""\n'})
    assert planted == ["core/planted/__init__.py: no __all__", "gateway/planted/__init__.py: no docstring",
                       "gateway/planted/__init__.py: no __all__"]  # fmt: skip


# --- small rooms: the limits the layout keeps ------------------------------------------------------------

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_DATACLASS_FIELDS = 15
MAX_ENGINE_TOP_MODULES = 15  # engine, scheduler, block manager, sequence, runner...; the rest in sub-packages


def _is_dataclass(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if (isinstance(target, ast.Name) and target.id == "dataclass") or (
            isinstance(target, ast.Attribute) and target.attr == "dataclass"
        ):
            return True
    return False


def oversized(sources: dict[str, str]) -> list[str]:
    """Files, functions and dataclasses past the limits, in `sources` (path → text)."""
    problems = []
    for rel, text in sources.items():
        if (lines := text.count("\n")) > MAX_FILE_LINES:
            problems.append(f"{rel}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if (length := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_FUNCTION_LINES:
                    problems.append(f"{rel}:{node.lineno} {node.name}: {length} lines")
            elif isinstance(node, ast.ClassDef) and _is_dataclass(node):
                fields = sum(isinstance(s, ast.AnnAssign) for s in node.body)
                if fields > MAX_DATACLASS_FIELDS:
                    problems.append(f"{rel}:{node.lineno} {node.name}: {fields} fields")
    return problems


def test_files_functions_and_dataclasses_stay_small() -> None:
    sources = {p.relative_to(ROOT).as_posix(): p.read_text() for pkg in LAYERS for p in (ROOT / pkg).rglob("*.py")}
    assert oversized(sources) == []


def test_the_size_check_catches_each_limit() -> None:
    long_function = "def f() -> None:\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    wide = "@dataclass(frozen=True)\nclass C:\n" + "".join(f"    f{i}: int\n" for i in range(16))
    long_file = "x = 1\n" * (MAX_FILE_LINES + 1)
    problems = oversized({"a.py": long_function, "b.py": wide, "c.py": long_file})
    assert [p.split(":")[0] for p in problems] == ["a.py", "b.py", "c.py"]


def test_the_engine_keeps_few_modules_on_top() -> None:
    assert len(list((ROOT / "engines").glob("*.py"))) <= MAX_ENGINE_TOP_MODULES


@pytest.mark.parametrize(
    "modules",
    [
        ["grading.answers", "grading.datasets", "grading.graders", "grading.sandbox"],  # text only
        ["engines.protocol"],  # the tier protocol and its exceptions (RequestRejected): no torch for an error
    ],
)
def test_light_modules_do_not_load_torch(modules: list[str]) -> None:
    import subprocess
    import sys

    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
