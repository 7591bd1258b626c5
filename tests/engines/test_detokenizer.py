"""Streaming text: whole characters only, stop strings never leak, streamed == final text; chat prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.detokenizer import IncrementalDetokenizer
from engines.tokenizer import Tokenizer

TEXT = "Grüße aus Köln 🇩🇪👍🏽 — 你好世界, naïve café. END here"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)


def stream(tokenizer: Tokenizer, text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    detok = IncrementalDetokenizer(tokenizer.backend, stop)
    pieces, stopped = [], False
    ids = tokenizer.encode(text, add_special_tokens=False)
    for i, token in enumerate(ids):
        stopped = detok.push(token)
        pieces.append(detok.take(finished=stopped or i == len(ids) - 1))
        if stopped:
            break
    return pieces, stopped


def test_multibyte_characters_are_never_split(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.split())  # emoji and CJK span several byte-level tokens
    pieces, stopped = stream(tokenizer, TEXT)
    assert not stopped
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_the_text_and_never_shows(tokenizer: Tokenizer) -> None:
    pieces, stopped = stream(tokenizer, TEXT, stop=("END",))
    assert stopped
    # Streamed pieces only ever append, so equality with the cut text means no part of "END" leaked.
    assert "".join(pieces) == TEXT[: TEXT.index("END")]


def test_stop_string_spanning_tokens(tokenizer: Tokenizer) -> None:
    stop = "世界, na"
    pieces, stopped = stream(tokenizer, TEXT, stop=(stop, "never-there"))
    assert stopped
    assert "".join(pieces) == TEXT[: TEXT.index(stop)]


def test_earliest_of_several_stops_wins(tokenizer: Tokenizer) -> None:
    pieces, stopped = stream(tokenizer, TEXT, stop=("café", "Köln"))
    assert stopped and "".join(pieces) == TEXT[: TEXT.index("Köln")]


def test_special_tokens_add_no_text(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer.backend)
    for token in [*tokenizer.encode("hi", add_special_tokens=False), 2]:  # 2 is <|im_end|>
        detok.push(token)
    assert detok.take(finished=True) == "hi"


def test_chat_prompts_are_remembered_but_never_shared(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name the capital of France."}]
    expected = tokenizer.encode(tokenizer.render_chat(messages), add_special_tokens=False)
    first = tokenizer.encode_chat(messages)
    assert first == expected
    first.append(-1)  # a caller changing its list does not change what the next caller gets
    again = tokenizer.encode_chat([dict(m) for m in messages])
    assert again == expected and tokenizer._chat_ids.cache_info().hits >= 1
    other = tokenizer.encode_chat([messages[0], {"role": "user", "content": "Name the capital of Spain."}])
    assert other != expected
    parts = [{"role": "user", "content": "Hi", "tool_calls": []}]  # unhashable: rendered each time
    assert tokenizer.encode_chat(parts) == tokenizer.encode(tokenizer.render_chat(parts), add_special_tokens=False)
