"""A policy as this gateway would serve it: valid, naming only tiers it serves, and the `probe` check only where
an answer probe is trained; else a 422 whose `param` is the first bad field's path, every problem listed in
`error.details`. The API's policy routes and the console's both check through `Pipeline.served_policy`."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from gateway.http.errors import APIError
from policies.policy import Policy

__all__ = ["invalid_policy", "validate_policy"]


def validate_policy(body: dict[str, Any], served: list[str], *, probe: bool, callable_: tuple[str, ...] = ()) -> Policy:
    """The policy, or a 422 naming every bad field by its path. `probe`: whether this gateway has a trained
    answer probe (the `probe` check needs one). `callable_`: what an alias may name besides the tiers."""
    try:
        policy = Policy.model_validate(body)
    except ValidationError as exc:
        problems = [(tuple(e["loc"]), e["msg"]) for e in exc.errors()]
        raise invalid_policy(problems) from None
    if problems := policy.check_tiers(served, callable_):
        raise invalid_policy(problems)
    if "probe" in policy.verifiers.checks and not probe:
        why = "no answer probe is trained on this gateway (switchboard verifiers train-probe)"
        raise invalid_policy([(("verifiers", "checks"), why)])
    return policy


def invalid_policy(problems: list[tuple[tuple, str]]) -> APIError:
    details = [{"param": ".".join(map(str, loc)) or None, "message": msg} for loc, msg in problems]
    first = details[0]
    more = f" (and {len(details) - 1} more)" if len(details) > 1 else ""
    err = APIError(
        422, f"{first['param'] or 'policy'}: {first['message']}{more}", param=first["param"], code="invalid_policy"
    )
    err.details = details
    return err
