"""Incremental detokenization with stop strings, for streaming.

Text is released only in whole UTF-8 characters (the `tokenizers` DecodeStream buffers partial byte
sequences), and the last `len(longest stop) - 1` characters are held back until we know they do not
begin a stop string, so a stream never shows text that the final answer does not contain.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = tuple(stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self._emitted = 0
        self.stopped_by: str | None = None  # the stop string that ended the text (Anthropic's `stop_sequence`)

    def push(self, token_id: int) -> bool:
        """Decode one token; True when a stop string appeared (the text is cut before it)."""
        piece = self._stream.step(self._tokenizer, token_id)
        if not piece:
            return False
        search_from = max(0, len(self.text) - self._holdback)
        self.text += piece
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            cut, self.stopped_by = min(hits, key=lambda hit: hit[0])
            self.text = self.text[:cut]
            return True
        return False

    def take(self, finished: bool) -> str:
        """Text not yet handed out that is safe to show now (all of it once finished)."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._holdback)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
