"""What kind of request a conversation is, as the router's labels are split: plain text, or a request with
tools (functions offered, calls made or their results read).

A router knows a kind where its held-out labels hold enough of it to keep the quality floor on that kind alone
(`router_model.train._kinds`; the shipped labels hold both: tool calls from BFCL, `bench.tool_labels`); a kind
it does not know is out of its distribution whatever its embedding says (`router_model.regions`), so `auto`
does not trust P(small ok) on it until a tenant's own verdicts (or labels of that kind) exist.
"""

from __future__ import annotations

from router_model.features import Messages, message_text

__all__ = ["KINDS", "TEXT", "TOOLS", "TOOLS_NOTE", "request_kind"]

TEXT, TOOLS = "text", "tools"
KINDS = (TEXT, TOOLS)
# The system turn the gateway puts before a routed conversation that offers tools
# (`gateway.tool_calls.request.routing_turns`): the router reads that tools are offered, and which.
TOOLS_NOTE = "The assistant may call"


def request_kind(messages: Messages) -> str:
    """TOOLS where tools are offered (the gateway's note), a call was made or a tool's result is read; else TEXT."""
    for m in messages:
        role = m.get("role")
        if role in ("tool", "function") or m.get("tool_calls"):
            return TOOLS
        if role == "system" and message_text(m).startswith(TOOLS_NOTE):
            return TOOLS
    return TEXT
