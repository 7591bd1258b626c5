"""The layer rule, checked on every import: module level and inside functions, `import x` and `from x import y`.

Packages, bottom up: engines → core → grading → policies → router_model → verifiers → gateway. A package
may import only packages below it; nothing outside `gateway/` and `tests/` imports `gateway`; no two
packages import each other. Each check is shown to catch a planted violation.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("engines", "core", "grading", "policies", "router_model", "verifiers", "gateway")
RANK = {name: i for i, name in enumerate(LAYERS)}


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
