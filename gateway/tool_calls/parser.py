"""Model output → text and tool calls, incrementally: the same parser serves a stream (fed each delta) and a whole
answer (fed once), so a streamed answer's pieces always reassemble into the non-streamed one.

A call is the text between a fence's begin and end (`formats.Fence`) that parses as a JSON object naming an
offered function with an object of arguments (or a list of such objects). Anything else, a fenced block that is
not a call included, is content, unchanged. Whitespace that only separates calls from each other or from the
text is not content. A call still open when the output ends (cut by `max_tokens`) is content too.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from gateway.tool_calls.formats import Fence, ToolFormat


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # the arguments object as compact-spaced JSON text (json.dumps), as OpenAI sends them


@dataclass
class Piece:
    """What one feed produced: text to show now and the calls it completed."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


@dataclass(frozen=True)
class CallSpec:
    """How a request's answers are read: the tool format of the tier that serves, and the offered names."""

    format: ToolFormat
    names: frozenset[str]

    def parser(self) -> CallParser:
        return CallParser(self.format, self.names)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallParser:
    def __init__(self, fmt: ToolFormat, names: frozenset[str]) -> None:
        self.fmt, self.names = fmt, names
        self._buf = ""  # text not yet judged: a possible fence's beginning, or an open call's body
        self._open: Fence | None = None
        self._space = ""  # whitespace held back: content if text follows, dropped if a call does
        self._before = ""  # the whitespace held back when a fence opened: content again if it is no call
        self._after_call = False  # just past a call: leading whitespace is a separator
        self.calls: list[ParsedCall] = []

    def feed(self, text: str) -> Piece:
        self._buf += text
        piece = Piece()
        while True:
            if self._open is None:
                start, fence = self._first_fence()
                if fence is None:
                    keep = self._partial_fence()
                    self._text(self._buf[: len(self._buf) - keep], piece)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return piece
                self._text(self._buf[:start], piece)
                self._buf, self._open = self._buf[start + len(fence.begin) :], fence
                self._before, self._space = self._space, ""  # whitespace before a call separates it
                continue
            end = self._buf.find(self._open.end)
            if end < 0:
                return piece
            body, fence = self._buf[:end], self._open
            self._buf, self._open = self._buf[end + len(fence.end) :], None
            calls = self._parse(body)
            if calls:
                piece.calls += calls
                self.calls += calls
                self._after_call = True
            else:
                self._space = self._before
                self._text(fence.begin + body + fence.end, piece)

    def step(self, text: str, last: bool) -> Piece:
        """One delta of a stream: `feed`, and `finish` with it when it is the last."""
        piece = self.feed(text)
        if not last:
            return piece
        end = self.finish()
        return Piece(piece.content + end.content, piece.calls + end.calls)

    def finish(self) -> Piece:
        """The end of the output: an unclosed call and held-back text are content."""
        piece = Piece()
        rest = (self._open.begin if self._open else "") + self._buf
        if self._open is not None:
            self._space = self._before
        self._buf, self._open = "", None
        self._text(rest, piece)
        if not self.calls:  # trailing whitespace separated nothing: it is the answer's own
            piece.content += self._space
        self._space = ""
        return piece

    def _text(self, text: str, piece: Piece) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            piece.content += self._space + body
            self._space = text[len(body) :]
        else:
            self._space += text

    def _first_fence(self) -> tuple[int, Fence | None]:
        found = [(self._buf.find(f.begin), i, f) for i, f in enumerate(self.fmt.fences)]
        hits = [(at, i, f) for at, i, f in found if at >= 0]
        if not hits:
            return -1, None
        at, _, fence = min(hits)
        return at, fence

    def _partial_fence(self) -> int:
        """How many trailing characters could be the start of a fence (held back until the next delta)."""
        for n in range(min(len(self._buf), max(len(f.begin) for f in self.fmt.fences) - 1), 0, -1):
            if any(f.begin.startswith(self._buf[-n:]) for f in self.fmt.fences):
                return n
        return 0

    def _parse(self, body: str) -> list[ParsedCall]:
        try:
            value = json.loads(body)
        except ValueError:
            return []
        items = value if isinstance(value, list) else [value]
        calls = []
        for item in items:
            if not isinstance(item, dict) or item.get("name") not in self.names:
                return []
            args = next((item[k] for k in self.fmt.arguments_keys if k in item), {})
            if not isinstance(args, dict):
                return []
            calls.append(ParsedCall(_call_id(), item["name"], json.dumps(args, ensure_ascii=False)))
        return calls


def parse_answer(text: str, spec: CallSpec) -> tuple[str | None, list[ParsedCall]]:
    """A whole answer: its content (None when only calls) and its calls."""
    parser = spec.parser()
    content = parser.step(text, last=True).content
    return (content if content or not parser.calls else None), parser.calls
