"""The wire formats a chat-shaped request can arrive in. Each translates to a `ChatCompletionRequest` and runs the
one chat pipeline; the wire names its ledger rows (`endpoint`), its ids and the field a prompt refusal points at."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CHAT", "MESSAGES", "RESPONSES", "WIRES", "Wire", "prompt_field"]


@dataclass(frozen=True)
class Wire:
    endpoint: str  # the ledger's `endpoint`, the cache key's, the shadow runs'
    id_prefix: str  # request ids are `{id_prefix}-{hex}`
    prompt_field: str  # what a refusal of the prompt names as its `param`


CHAT = Wire("chat.completions", "chatcmpl", "messages")
RESPONSES = Wire("responses", "resp", "input")  # OpenAI's Responses API (gateway.api.responses)
MESSAGES = Wire("messages", "msg", "messages")  # Anthropic's Messages API (gateway.api.messages)
WIRES = {w.endpoint: w for w in (CHAT, RESPONSES, MESSAGES)}


def prompt_field(endpoint: str) -> str:
    """The request field a refusal of the prompt points at: `prompt` for completions."""
    wire = WIRES.get(endpoint)
    return wire.prompt_field if wire is not None else "prompt"
