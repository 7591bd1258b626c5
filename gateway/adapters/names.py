"""How a request names an adapter: `<tier>:<name>`, the tier one the gateway serves and the name one of the
tenant's adapters on it. Any other model name (`gpt-4o-mini`, an alias with a colon in it) is not an adapter's."""

from __future__ import annotations

import re
from collections.abc import Collection

__all__ = ["ADAPTER_NAME", "split_model"]

# Lowercase letters, digits, `.`, `_`, `-`; 64 at most: what fits a model id, a path segment and the ledger column.
ADAPTER_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


def split_model(model: str, tiers: Collection[str]) -> tuple[str, str | None]:
    """(tier, adapter name) for `small:NAME` where `small` is a served tier; else (model, None)."""
    tier, sep, name = model.partition(":")
    if sep and tier in tiers and name:
        return tier, name
    return model, None
