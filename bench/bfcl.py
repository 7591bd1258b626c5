"""The Berkeley Function Calling Leaderboard's own data and AST checker (`bfcl-eval` from PyPI), for `bench.tools`.

bfcl-eval pins numpy 1.26 (we need 2) and imports every hosted-API client its model handlers support (anthropic,
cohere, mistralai, google-genai...) from one module, `bfcl_eval.constants.model_config`, which its AST checker
reads for one thing: whether a model's function names had their dots sent as underscores. So the package is
installed without its dependencies into a folder of its own ($SWITCHBOARD_HOME/bfcl/<version>), and that one
module is stubbed: a mapping that says `underscore_to_dot = True` for our model, since tools go out with `.` as
`_`, as BFCL's own OpenAI function-calling handler sends them. Everything else (data, possible answers, the
checker, the type mappings) is bfcl-eval's, unchanged.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import random
import re
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERSION = "2026.3.23"
CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")
MODEL = "switchboard"  # the model name the checker is told; its config says underscore_to_dot
HOME = Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")).expanduser() / "bfcl"


@dataclass(frozen=True)
class Question:
    id: str
    category: str
    messages: list[dict[str, Any]]  # the first turn (every question of these categories has one)
    functions: list[dict[str, Any]]  # BFCL's own function docs (the checker reads these)
    answer: list[dict[str, Any]]  # the possible answers ([] for irrelevance: no call is right)


def package_dir() -> Path:
    """bfcl-eval installed without its dependencies (once)."""
    target = HOME / VERSION
    if not (target / "bfcl_eval" / "data").is_dir():
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps"]
        subprocess.run([*pip, "--target", str(target), f"bfcl-eval=={VERSION}"], check=True)
    return target


def _import_bfcl() -> Any:
    """bfcl_eval's AST checker module, with `constants.model_config` stubbed (see the module docstring)."""
    folder = str(package_dir())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    stub = types.ModuleType("bfcl_eval.constants.model_config")
    stub.MODEL_CONFIG_MAPPING = {MODEL: types.SimpleNamespace(underscore_to_dot=True)}  # type: ignore[attr-defined]
    sys.modules["bfcl_eval.constants.model_config"] = stub
    return importlib.import_module("bfcl_eval.eval_checker.ast_eval.ast_checker")


def questions(category: str, limit: int | None, seed: int = 0) -> list[Question]:
    """The category's questions with their possible answers; `limit`: a fixed random sample of that many."""
    data = package_dir() / "bfcl_eval" / "data"
    rows = [json.loads(line) for line in (data / f"BFCL_v4_{category}.json").read_text().splitlines() if line]
    answers: dict[str, list] = {}
    answer_file = data / "possible_answer" / f"BFCL_v4_{category}.json"
    if answer_file.exists():
        for line in answer_file.read_text().splitlines():
            if line:
                row = json.loads(line)
                answers[row["id"]] = row["ground_truth"]
    if limit is not None and limit < len(rows):
        rows = random.Random(f"{seed}-{category}").sample(rows, limit)
    return [Question(r["id"], category, r["question"][0], r["function"], answers.get(r["id"], [])) for r in rows]


def openai_tools(functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """BFCL's function docs as OpenAI tools, as its OpenAI function-calling handler converts them: `.` in names
    as `_`, its types mapped to JSON schema's (GORILLA_TO_OPENAPI: dict → object, float → number, tuple →
    array, any → string)."""
    _import_bfcl()
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI  # type: ignore[import-not-found]

    tools = []
    for f in copy.deepcopy(functions):
        parameters = f["parameters"]
        parameters["type"] = "object"
        parameters["properties"] = _openapi(parameters.get("properties", {}), GORILLA_TO_OPENAPI)
        name = re.sub(r"\.", "_", f["name"])
        tools.append({"type": "function", "function": {"name": name, "description": f.get("description", ""),
                                                       "parameters": parameters}})  # fmt: skip
    return tools


def _openapi(properties: dict[str, Any], mapping: dict[str, str]) -> dict[str, Any]:
    for value in properties.values():
        kind = value.get("type")
        if kind == "float":
            value["format"] = "float"
        value["type"] = mapping.get(kind, "string") if kind is not None else "string"
        if value["type"] in ("array", "object"):
            if "properties" in value:
                value["properties"] = _openapi(value["properties"], mapping)
            elif isinstance(value.get("items"), dict) and "type" in value["items"]:
                items = value["items"]
                items["type"] = mapping.get(items["type"], "string")
                if items["type"] == "object" and "properties" in items:
                    items["properties"] = _openapi(items["properties"], mapping)
                elif items["type"] == "array" and isinstance(items.get("items"), dict) and "type" in items["items"]:
                    items["items"]["type"] = mapping.get(items["items"]["type"], "string")
    return properties


def correct(q: Question, calls: list[tuple[str, dict[str, Any]]]) -> bool:
    """BFCL's verdict on the calls (name as sent, arguments): irrelevance is right with no call; every other
    category goes through its AST checker."""
    if q.category == "irrelevance":
        return not calls
    if not calls:
        return False
    checker = _import_bfcl()
    from bfcl_eval.constants.enums import Language  # type: ignore[import-not-found]

    output = [{name: args} for name, args in calls]
    result = checker.ast_checker(q.functions, output, q.answer, Language.PYTHON, q.category, MODEL)
    return bool(result["valid"])
