"""A prompt to label, grade or replay: an `Item` (a stable id, its chat messages, what grading needs), and
`user(text)`, a one-turn chat. A leaf: `datasets` and `facts` both build them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Item", "user"]


@dataclass(frozen=True)
class Item:
    id: str
    source: str
    messages: list[dict[str, str]]
    grading: dict[str, str]  # gsm8k: answer; humaneval: prompt, test, entry_point, canonical_solution; else empty

    @property
    def question(self) -> str:
        """The user's question (the last message): what a judge is shown."""
        return self.messages[-1]["content"]


def user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]
