"""What the router sees of a conversation: a MiniLM embedding plus cheap text features.

The embedding (all-MiniLM-L6-v2 from its registry package, its matmuls in int8: `router_model.encoder`)
carries the topic; the cheap features carry what an embedding blurs and what predicts a small model's
failures: length, turns, code, math, the answer format asked for, and the kind of question.
The embedded text is capped near 128 word pieces, since MiniLM's time grows with its length and the
gateway routes while the client waits: the last user turn comes first (its head and, past the cap, its
tail, where a GSM8K-style question asks what it wants), then a short tail of the earlier context
(system prompt, previous turns). The cheap features still see the whole conversation.

A saved router records FEATURE_VERSION; change it whenever a feature's meaning, order or scale changes,
so an old model refuses to load instead of scoring vectors it was not trained on.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import numpy as np

from core.embedder import Embedder

FEATURE_VERSION = "minilm-l6-int8-128+cheap-1"

Messages = Sequence[Mapping[str, object]]

# ~128 word pieces in all (shipped prompts: p50 80, p90 126, max 173); MiniLM would stop at 256 itself
LAST_TURN_HEAD_CHARS = 300
LAST_TURN_TAIL_CHARS = 120  # a longer last turn keeps its head and its tail
CONTEXT_CHARS = 100  # the tail of everything before the last user turn

_TOKEN = re.compile(r"\w+|[^\w\s]")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_OPERATOR = re.compile(r"[+\-*/=^%<>×÷]")
_FENCE = re.compile(r"```")
_CODE_WORDS = re.compile(
    r"\b(?:def|class|return|import|function|const|let|var|lambda|async|await|struct|impl|fn|public|static|void|"
    r"select|from|where|join|#include|printf|println|console\.log|self|null|None|True|False)\b|[{};]|=>|->|::"
)
_CODE_ASKS = re.compile(
    r"\b(?:code|function|program|script|implement|python|javascript|typescript|java|rust|golang|sql|c\+\+|bash|"
    r"regex|algorithm|bug|debug|compile|error|exception|api|class|method|refactor|unit test)\b",
    re.I,
)
_MATH_WORDS = re.compile(
    r"\b(?:solve|prove|proof|calculate|compute|equation|integral|derivative|probability|sum|product|total|"
    r"percent|percentage|average|ratio|how many|how much|remainder|prime|factor|simplify|evaluate|geometry|"
    r"triangle|area|volume|speed|cost|price|profit)\b",
    re.I,
)
_LATEX = re.compile(r"\$[^$]+\$|\\(?:frac|sqrt|sum|int|cdot)")
_FORMATS = {
    "json": re.compile(r"\bjson\b", re.I),
    "list": re.compile(r"\b(?:list|bullet(?:s| points?)?|enumerate|numbered)\b", re.I),
    "table": re.compile(r"\b(?:table|tabular|csv|columns?)\b", re.I),
    "length_limit": re.compile(r"\b(?:in|under|within|at most|no more than)\s+\d+\s+(?:words|sentences|lines)\b", re.I),
    "step_by_step": re.compile(r"\bstep[- ]by[- ]step\b|\bexplain your reasoning\b", re.I),
}
_QUESTION_WORDS = {
    "what": re.compile(r"\bwhat\b", re.I),
    "why": re.compile(r"\bwhy\b", re.I),
    "how": re.compile(r"\bhow\b", re.I),
    "which_who_when_where": re.compile(r"\b(?:which|who|whom|when|where)\b", re.I),
    "explain_compare": re.compile(r"\b(?:explain|describe|compare|contrast|analy[sz]e|discuss|evaluate)\b", re.I),
    "write_create": re.compile(r"\b(?:write|compose|create|draft|generate|design)\b", re.I),
}

CHEAP_FEATURES: tuple[str, ...] = (
    "log_chars_last",
    "log_chars_all",
    "log_tokens_last",
    "turns",
    "user_turns",
    "has_system",
    "lines_last",
    "code_fences",
    "code_words_per_100_tokens",
    "code_asks",
    "indented_lines_share",
    "digits_share",
    "numbers",
    "operators_per_100_tokens",
    "math_words",
    "latex",
    *(f"format_{name}" for name in _FORMATS),
    *(f"question_{name}" for name in _QUESTION_WORDS),
    "question_marks",
    "sentences",
)


def message_text(message: Mapping[str, object]) -> str:
    """A message's text: a string, or the text of its content parts (OpenAI's list form)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""


def split_conversation(messages: Messages) -> tuple[str, str]:
    """(last user turn, everything before it as "role: text" lines); the last message if no user turn."""
    if not messages:
        return "", ""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=len(messages) - 1)
    context = "\n".join(f"{m.get('role', '')}: {message_text(m)}" for m in messages[:last])
    return message_text(messages[last]), context


def embedding_text(messages: Messages) -> str:
    """What MiniLM embeds: the last user turn first (head and tail if long), then the context's tail."""
    last, context = split_conversation(messages)
    text = last
    if len(last) > LAST_TURN_HEAD_CHARS + LAST_TURN_TAIL_CHARS:
        text = f"{last[:LAST_TURN_HEAD_CHARS]} … {last[-LAST_TURN_TAIL_CHARS:]}"
    if context:
        text += "\n\n" + context[-CONTEXT_CHARS:]
    return text


def cheap_features(messages: Messages) -> np.ndarray:
    """The CHEAP_FEATURES of one conversation, as float32, in that order."""
    last, context = split_conversation(messages)
    tokens = max(len(_TOKEN.findall(last)), 1)
    lines = last.splitlines() or [""]
    values = [
        math.log1p(len(last)),
        math.log1p(len(last) + len(context)),
        math.log1p(tokens),
        float(len(messages)),
        float(sum(1 for m in messages if m.get("role") == "user")),
        float(any(m.get("role") in ("system", "developer") for m in messages)),
        math.log1p(len(lines)),
        float((len(_FENCE.findall(last)) + 1) // 2),  # fenced blocks, an unclosed one included
        100.0 * len(_CODE_WORDS.findall(last)) / tokens,
        float(len(_CODE_ASKS.findall(last))),
        sum(1 for line in lines if line.startswith(("    ", "\t"))) / len(lines),
        sum(c.isdigit() for c in last) / max(len(last), 1),
        math.log1p(len(_NUMBER.findall(last))),
        100.0 * len(_OPERATOR.findall(last)) / tokens,
        float(len(_MATH_WORDS.findall(last))),
        float(bool(_LATEX.search(last))),
        *(float(bool(p.search(last))) for p in _FORMATS.values()),
        *(float(bool(p.search(last))) for p in _QUESTION_WORDS.values()),
        float(last.count("?")),
        math.log1p(len(re.findall(r"[.!?](?:\s|$)", last))),
    ]
    return np.asarray(values, dtype=np.float32)


def featurize(conversations: Sequence[Messages], embedder: Embedder) -> np.ndarray:
    """(n, 384 + len(CHEAP_FEATURES)) float32: the embedding, then the cheap features."""
    if not conversations:
        return np.zeros((0, Embedder.DIM + len(CHEAP_FEATURES)), np.float32)
    vectors = embedder.encode([embedding_text(m) for m in conversations])
    cheap = np.stack([cheap_features(m) for m in conversations])
    return np.hstack([vectors, cheap]).astype(np.float32)


def prompt_chars(messages: Messages) -> int:
    """Characters of the whole conversation: the length heuristic's score."""
    return sum(len(message_text(m)) for m in messages)
