"""The pipeline's refusals, in OpenAI's error shape (`gateway.http.errors.APIError`)."""

from __future__ import annotations

from collections.abc import Iterable

from gateway.http.errors import APIError, invalid
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


def model_not_allowed(model: str, allowed: Iterable[str]) -> APIError:
    return APIError(
        403,
        f"Your tenant's policy does not allow the model `{model}`; allowed: {', '.join(allowed) or 'none'}.",
        code="model_not_allowed",
        param="model",
    )


def unavailable(model: str) -> APIError:
    return APIError(503, f"The model `{model}` is not serving right now; retry shortly.", code="engine_unavailable")


def reject_unsupported(body: ChatCompletionRequest | CompletionRequest, names: tuple[str, ...]) -> None:
    if name := body.unsupported(names):
        raise invalid(f"`{name}` is not supported by this server yet.", param=name, code="unsupported_parameter")
