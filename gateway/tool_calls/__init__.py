"""Tool calling: the request's tools checked and rendered, a grammar that keeps calls well formed, and the model's
output parsed back into OpenAI's `tool_calls` (whole or streamed).

    request   the tools and `tool_choice`, checked (400s); the conversation as a chat template reads it
    formats   how a model family writes calls (Hermes), and tools for a template that does not render them
    grammar   the structural tag per `tool_choice` (auto: lazy, after the trigger; required; a named function)
    parser    text → content and calls, incrementally (a stream and a whole answer parse the same)
"""

from gateway.tool_calls.formats import HERMES, ToolFormat, fallback_messages, format_for, renders_tools
from gateway.tool_calls.grammar import structural_tag
from gateway.tool_calls.parser import CallParser, CallSpec, ParsedCall, Piece, parse_answer
from gateway.tool_calls.request import ToolRequest, function_tool, routing_turns, template_messages, tool_request

__all__ = [
    "HERMES",
    "CallParser",
    "CallSpec",
    "ParsedCall",
    "Piece",
    "ToolFormat",
    "ToolRequest",
    "fallback_messages",
    "format_for",
    "function_tool",
    "parse_answer",
    "renders_tools",
    "routing_turns",
    "structural_tag",
    "template_messages",
    "tool_request",
]
