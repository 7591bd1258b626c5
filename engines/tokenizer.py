"""Tokenizing, chat templates and end-of-turn ids for one model directory (via transformers)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import tokenizers
from jinja2 import TemplateError

# What a model directory holds besides its config and weights, for tokenizing and generating.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """Copy `TOKENIZER_FILES` that `src` has into `dst` (a derived checkpoint tokenizes the same)."""
    import shutil

    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)


CHAT_CACHE_SIZE = 1024  # conversations whose token ids are remembered


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template."""


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        self.hf = AutoTokenizer.from_pretrained(model_dir)
        self.backend: tokenizers.Tokenizer = self.hf.backend_tokenizer
        self.eos_token_ids = frozenset(_eos_ids(model_dir, self.hf.eos_token_id))
        # Rendering the chat template (jinja) costs more than the rest of an exact cache hit's own work,
        # and hits are repeated conversations: remember recent ones. Thread-safe, bounded.
        self._chat_ids = functools.lru_cache(maxsize=CHAT_CACHE_SIZE)(self._encode_chat_key)
        # ...unless the template reads the clock (Llama 3's "Today Date"): then the same messages render anew
        self._remember_chats = "strftime_now" not in str(self.hf.chat_template or "")

    @functools.cached_property
    def _byte_level(self) -> dict[str, int] | None:
        """GPT-2's byte-to-character table, inverted, for tokenizers whose tokens are bytes spelled as characters
        (byte-level BPE: SmolLM2, Qwen, Llama 3); None for others (SentencePiece)."""
        decoder = json.loads(self.backend.to_str()).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
        return {c: b for b, c in _bytes_to_unicode().items()} if "ByteLevel" in kinds else None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a token may be part of a character: OpenAI's logprobs `bytes`)."""
        piece = self.backend.id_to_token(token_id) or ""
        table = self._byte_level
        if table is not None and piece and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return str(self.hf.chat_template) if self.hf.chat_template else None

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as the model's chat template writes it, ready for the assistant's turn; `tools`
        (OpenAI's shape) go to the template, which renders them if it knows how."""
        if not self.hf.chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            return self.hf.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=True, tokenize=False
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        # The rendered template already holds every special token the model expects.
        try:
            key = tuple(tuple(m.items()) for m in messages)
            hash(key)
        except TypeError:  # content parts, calls or other unhashable values: not remembered
            key = None
        if key is None or tools or not self._remember_chats:
            return self.encode(self.render_chat(messages, tools), add_special_tokens=False)
        return list(self._chat_ids(key))

    def _encode_chat_key(self, key: tuple[tuple[tuple[str, Any], ...], ...]) -> tuple[int, ...]:
        return tuple(self.encode(self.render_chat([dict(m) for m in key]), add_special_tokens=False))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters (byte-level BPE spells tokens in these)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _eos_ids(model_dir: Path, tokenizer_eos: int | None) -> set[int]:
    ids = {tokenizer_eos} if tokenizer_eos is not None else set()
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids
