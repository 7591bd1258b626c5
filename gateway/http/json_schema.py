"""Bounds on the JSON schemas clients send (a tool's parameters, a response format), checked before anything walks
them recursively: the grammar compiler, a chat template's tool rendering, `json.dumps`."""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_SCHEMA_DEPTH", "MAX_SCHEMA_NODES", "bounded_schema"]

MAX_SCHEMA_DEPTH = 64  # nested objects and arrays in a JSON schema: ~30 levels of properties, past any real one
MAX_SCHEMA_NODES = 20_000  # values in one schema, at most


def bounded_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """Refuse a schema nested too deep or too large before anything walks it recursively (the grammar compiler,
    the tool renderer, json.dumps): 300 levels raised RecursionError there, a 500. Walked with a stack here."""
    if schema is None:
        return None
    stack: list[tuple[Any, int]] = [(schema, 1)]
    nodes = 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"a schema may nest at most {MAX_SCHEMA_DEPTH} objects and arrays deep")
        if nodes > MAX_SCHEMA_NODES:
            raise ValueError(f"a schema may hold at most {MAX_SCHEMA_NODES} values")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return schema
